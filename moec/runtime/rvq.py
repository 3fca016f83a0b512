"""Tiered residual-VQ KV cache (seed 002): fp16 sinks + window, a middle tier of multi-stage residual
VQ codes, and an archive tier that older blocks are re-encoded into.

Reading of seed 002 (docs/architecture.md, seeds): each tier is a residual vector quantizer over sub-vectors of `dim`
channels (P = head_dim / dim sub-vectors per token, one codebook per sub-vector position — per KV
head, or shared by the heads), stage s with C_s centroids, so a tier costs Σ_s log2(C_s) / dim bits
per element plus its codebooks (fp16, per layer, counted once). Stage s quantizes the residual the
stages before it left (x ≈ Σ_s C_s[i_s]; the seed's sketch split the vector instead). Encoding is
greedy per stage (nearest centroid of the current residual).

Per layer, positions are laid out as in TieredKVCache (moec/runtime/kvtiered.py, whose window,
sink and block eviction this cache inherits):
    [0, s)                              sinks, fp16
    [s, s + a·block)                    archive: blocks re-encoded with the archive tier's codebooks
    [s + a·block, s + n·block)          middle: blocks encoded with the middle tier's codebooks
    [s + n·block, length)               window, fp16
A block moves to the archive once all its tokens are at least `archive_after` tokens back
(tokens − block_end ≥ archive_after). There is no fp16 copy left by then, so it is re-encoded from
the middle tier's reconstruction (moec/calibrate/rvq.py reports the extra error that costs
against encoding the original). `archive_after = 0`: one tier.

Codes are bit-packed per token (moec/formats/bitpack.py Layout.BITSTREAM): code j = s·P + p (stage-major)
takes log2(C_s) bits, LSB first, starting at bit Σ_{j'<j} width_j'; the row is padded to whole bytes.
Keys are quantized post-RoPE (lookup tables of q·centroid work directly, moec/kernels/rvq_lut_attention.py) or
pre-RoPE (`rope: pre`; TieredKVCache un-rotates a block before encoding and rotates it back after
decoding; torch path only).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..formats.bitpack import pack_bits, unpack_bits
from .backend import kernels_enabled
from .config import ModelArgs
from .kvtiered import TieredKVCache

if TYPE_CHECKING:
    from ..kernels.rvq_lut_attention import RVQTierView

# -- one residual-VQ tier ----------------------------------------------------------------------------------

class RVQTier:
    """Residual VQ of [.., K, N, d] vectors over sub-vectors: codebooks[s] [Gc, P, C_s, dim] (Gc = K or 1)."""

    def __init__(self, codebooks: list[torch.Tensor]):
        self.cb = [c.half() for c in codebooks]  # stored fp16 (what the checkpoint and stored bytes hold)
        Gc, P, _, dim = codebooks[0].shape
        assert all(c.shape[0] == Gc and c.shape[1] == P and c.shape[3] == dim for c in codebooks)
        self.P, self.dim, self.shared = P, dim, Gc == 1
        self.widths = [int(math.log2(c.shape[2])) for c in codebooks for _ in range(P)]
        self.row_bytes = -(-sum(self.widths) // 8)
        self.bits = sum(self.widths) / (P * dim)  # nominal bits per element (codes only)
        self._kernel_views: dict[str, RVQTierView] = {}  # device -> kernel_view(device)

    def kernel_view(self, device) -> RVQTierView:
        """The codebooks on `device` as moec/kernels/rvq_lut_attention.py's CodeSegment takes them, made once per
        device and kept on the tier."""
        key = str(device)
        if key not in self._kernel_views:
            from ..kernels.rvq_lut_attention import RVQTierView

            self._kernel_views[key] = RVQTierView([c.to(device) for c in self.cb])
        return self._kernel_views[key]

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, K, N, d] fp32 -> codes [B, K, N, S·P] int64 (greedy per stage on the residual)."""
        B, K, N, d = x.shape
        r = x.float().reshape(B, K, N, self.P, self.dim)
        out = []
        for cb in self.cb:
            c = cb.float().to(x.device).expand(K, -1, -1, -1)  # [K, P, C, dim]
            dist = (r.pow(2).sum(-1, keepdim=True) - 2 * torch.einsum("bknpe,kpce->bknpc", r, c)
                    + c.pow(2).sum(-1)[None, :, None])  # [B, K, N, P, C]
            i = dist.argmin(-1)  # [B, K, N, P]
            r = r - self._gather(c, i)
            out.append(i)
        return torch.cat(out, -1)

    @staticmethod
    def _gather(c: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        """c [K, P, C, dim], i [B, K, N, P] -> [B, K, N, P, dim]."""
        B, K, N, P = i.shape
        idx = i.permute(1, 3, 0, 2).reshape(K, P, B * N, 1).expand(-1, -1, -1, c.shape[-1])
        return c.gather(2, idx).view(K, P, B, N, c.shape[-1]).permute(2, 0, 3, 1, 4)

    def reconstruct(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, K, N, S·P] -> [B, K, N, d] fp32."""
        B, K, N, _ = codes.shape
        x = torch.zeros(B, K, N, self.P, self.dim, device=codes.device)
        for s, cb in enumerate(self.cb):
            c = cb.float().to(codes.device).expand(K, -1, -1, -1)
            x += self._gather(c, codes[..., s * self.P : (s + 1) * self.P])
        return x.reshape(B, K, N, self.P * self.dim)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return pack_bits(self.codes(x), self.widths)

    def decode(self, packed: torch.Tensor) -> torch.Tensor:
        return self.reconstruct(unpack_bits(packed, self.widths))


class RVQLayerCodec:
    """One layer's codec in TieredKVCache's interface (the middle tier) plus its archive tier."""

    name = "rvq-tiered"

    def __init__(self, mid: dict[str, RVQTier], arch: dict[str, RVQTier] | None):
        self.mid, self.arch = mid, arch
        self.bits = mid["k"].bits

    def fields(self, kind: str) -> dict[str, tuple[str, tuple, torch.dtype]]:
        return {"codes": ("token", (self.mid[kind].row_bytes,), torch.uint8)}

    def encode(self, x: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        return {"codes": self.mid[kind].encode(x)}

    def decode(self, f: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
        return self.mid[kind].decode(f["codes"])

    def static_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for tier, t in (("mid", self.mid), ("arch", self.arch or {})):
            for kind, q in t.items():
                out.update({f"{kind}.{tier}.{s}": c for s, c in enumerate(q.cb)})
        return out


# -- the cache -----------------------------------------------------------------------------------------

class RVQTieredCache(TieredKVCache):
    """The rvq-tiered family in every mode of TieredKVCache (dynamic, static, simulated): the middle tier is the
    block codec of the tiered history; after the window ages (TieredKVCache._age), `_aged` re-encodes the
    blocks older than `archive_after` into the archive tier from the middle tier's reconstruction. The LUT
    kernel (moec/kernels/rvq_lut_attention.py) serves dynamic decode steps with post-RoPE keys; the static mode
    attends over the dequantized mirror (graph-safe SDPA); the LUT kernel is not wired there."""

    SIM_CHUNK = 256  # simulated mode: queries attended per chunk, so memory stays bounded at 8k-token windows

    def __init__(self, args: ModelArgs, batch: int, max_len: int, codecs: list[RVQLayerCodec], window: int,
                 sinks: int = 4, block: int = 32, archive_after: int = 4096, rope_pre: bool = False, device="cpu",
                 use_kernel: bool | None = None, mode: str = "dynamic", mirror_dtype=torch.float32,
                 prefill: int = 32):
        if mode == "static":
            use_kernel = False
        elif use_kernel is None:  # the LUT kernel needs post-RoPE keys (tables of q·centroid)
            use_kernel = not rope_pre and kernels_enabled(device)
        super().__init__(args, batch, max_len, codecs, window, sinks, block, rope_pre, device, use_kernel, mode,
                         mirror_dtype, prefill)
        self.archive_after = archive_after if codecs[0].arch is not None else 0
        self.n_arch = [0] * (batch if mode == "static" else args.n_layers)  # archived blocks per row / per layer
        self.arch = None
        if self.archive_after:
            n = self.max_blocks * block
            self.arch = {kind: [torch.zeros(batch, args.n_kv_heads, n, c.arch[kind].row_bytes, dtype=torch.uint8,
                                            device=self.device) for c in codecs] for kind in "kv"}

    def arch_at(self, tokens: int) -> int:
        """Archived blocks after `tokens` tokens: those whose every token is ≥ archive_after back."""
        if not self.archive_after:
            return 0
        return min(self.blocks_at(tokens), max(0, (tokens - self.archive_after - self.sinks) // self.block))

    def history_fields(self, layer: int, kind: str, blocks: int | None = None) -> dict[str, torch.Tensor]:
        nb = self.n_blocks[layer] if blocks is None else blocks
        na, b = min(self.n_arch[layer], nb), self.block
        out = {"codes": self.hist[kind][layer]["codes"][:, :, na * b : nb * b]}
        if self.arch is not None:
            out["arch"] = self.arch[kind][layer][:, :, : na * b]
        return out

    def decode_history(self, layer: int, kind: str) -> torch.Tensor:
        f = self.history_fields(layer, kind)
        codec = self.codecs[layer]
        x = codec.mid[kind].decode(f["codes"])
        if "arch" in f:
            x = torch.cat([codec.arch[kind].decode(f["arch"]), x], dim=2)
        if kind == "k" and self.rope_pre and x.shape[2]:
            x = self._rope(x, self.sinks, inverse=False)
        return x

    def _archive_block(self, rows: slice, layer: int, b: int) -> None:
        """Re-encode middle-tier block b of `rows` into the archive, from the middle tier's reconstruction."""
        blk, codec = self.block, self.codecs[layer]
        sl = slice(b * blk, (b + 1) * blk)
        for kind in "kv":
            x = codec.mid[kind].decode(self.hist[kind][layer]["codes"][rows, :, sl])  # pre-RoPE if rope_pre
            codes = codec.arch[kind].encode(x)
            self.arch[kind][layer][rows, :, sl] = codes
            if self.mirror is not None:
                y = codec.arch[kind].decode(codes)
                if kind == "k" and self.rope_pre:
                    y = self._rope(y, self.sinks + b * blk, inverse=False)
                self.mirror[kind][layer][rows, :, sl] = y

    def _aged(self, rows: slice, groups: list[list[int]], tokens: int) -> None:
        """The archive ageing of every mode, after TieredKVCache._age aged the window into the middle tier: the
        blocks whose every token is ≥ archive_after back (arch_at) move to the archive, oldest first."""
        if not self.archive_after:
            return
        static = self.mode == "static"
        layers = [i for g in groups for i in g]
        na = self.n_arch[rows.start] if static else self.n_arch[layers[0]]
        while na < self.arch_at(tokens):
            for layer in layers:
                nb = self.n_blocks[rows.start] if static else self.n_blocks[layer]
                assert na < nb, (na, nb)
                self._archive_block(rows, layer, na)
            na += 1
            if static:
                self.n_arch[rows.start] = na
            else:
                for layer in layers:
                    self.n_arch[layer] = na

    def _attend_kernel(self, layer: int, q: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
        """One decode step (post-RoPE keys) through moec/kernels/rvq_lut_attention.py, one code segment per tier.
        q [B, H, 1, d]; wk, wv [B, K, n, d] fp16 window (sinks first) -> [B, H, 1, d] in q.dtype."""
        from ..kernels.rvq_lut_attention import CodeSegment, rvq_lut_attention

        codec, B, dev, blk = self.codecs[layer], q.shape[0], q.device, self.block
        nb, na = self.n_blocks[layer], self.n_arch[layer]
        full = lambda n: torch.full((B,), n, dtype=torch.int32, device=dev)  # noqa: E731
        segs = []
        if na:
            segs.append(CodeSegment(self.arch["k"][layer], self.arch["v"][layer], full(0), full(na * blk),
                                    codec.arch["k"].kernel_view(dev).codebooks,
                                    codec.arch["v"].kernel_view(dev).codebooks))
        if nb > na:
            segs.append(CodeSegment(self.hist["k"][layer]["codes"], self.hist["v"][layer]["codes"], full(na * blk),
                                    full((nb - na) * blk), codec.mid["k"].kernel_view(dev).codebooks,
                                    codec.mid["v"].kernel_view(dev).codebooks))
        out = rvq_lut_attention(q[:, :, 0].contiguous(), segs, wk.contiguous(), wv.contiguous(), full(wk.shape[2]),
                                max_len=max([na * blk, (nb - na) * blk, 1]))
        return out[:, :, None].to(q.dtype)

    def _attend_simulated(self, layer: int, q, k, v, start_pos: int) -> torch.Tensor:
        """TieredKVCache._attend_simulated with three representations of a key (fp16, middle, archive), attended in
        chunks of SIM_CHUNK queries."""
        assert start_pos == 0, "simulated decode runs one forward per window"
        B, H, S, d = q.shape
        if layer == self.args.n_layers - 1:
            self.length = S
        kf, vf = k.half().to(q.dtype), v.half().to(q.dtype)  # what the cache stores
        s, blk = self.sinks, self.block
        self.n_arch[layer] = 0
        km, vm = self._history_blocks(layer, kf, vf)  # every block that leaves the window: middle tier
        self._aged(slice(None), [[layer]], S)  # then the blocks that age: the archive
        ka, va = torch.zeros_like(kf), torch.zeros_like(vf)
        a = self.n_arch[layer] * blk
        ka[:, :, s : s + a] = self.mirror["k"][layer][:, :, :a].to(q.dtype)
        va[:, :, s : s + a] = self.mirror["v"][layer][:, :, :a].to(q.dtype)
        hist_end = torch.tensor([s + self.blocks_at(i) * blk for i in range(S)], device=q.device)  # per query
        arch_end = torch.tensor([s + self.arch_at(i) * blk for i in range(S)], device=q.device)
        out = torch.empty_like(q)
        for i0 in range(0, S, self.SIM_CHUNK):
            i1 = min(S, i0 + self.SIM_CHUNK)
            qi = torch.arange(i0, i1, device=q.device)[:, None]  # [c, 1]
            he, ae = hist_end[i0:i1, None], arch_end[i0:i1, None]
            # keys some query of the chunk sees in each representation
            jf = torch.cat([torch.arange(0, min(s, i1)), torch.arange(max(s, int(hist_end[i0])), i1)]).to(q.device)
            jm = torch.arange(int(arch_end[i0]), int(hist_end[i1 - 1]), device=q.device)
            ja = torch.arange(s, int(arch_end[i1 - 1]), device=q.device)
            mask = torch.cat([(jf <= qi) & ((jf < s) | (jf >= he)), (jm >= ae) & (jm < he), ja < ae], 1)
            keys = torch.cat([kf[:, :, jf], km[:, :, jm], ka[:, :, ja]], 2)
            vals = torch.cat([vf[:, :, jf], vm[:, :, jm], va[:, :, ja]], 2)
            out[:, :, i0:i1] = F.scaled_dot_product_attention(q[:, :, i0:i1], keys, vals, attn_mask=mask,
                                                              enable_gqa=True)
        return out

    def _history_bytes(self, row: int) -> int:
        """Static mode: bytes of the row's filled middle and archive blocks, as stored."""
        na, nb = self.n_arch[row], self.n_blocks[row]
        arch = 0 if self.arch is None else sum(t[0, :, : self.block].numel() * t.element_size()
                                               for kind in "kv" for t in self.arch[kind])
        return (nb - na) * self._row_block_bytes() + na * arch

    def _arch_block_bytes(self) -> int:
        if self.arch is None:
            return 0
        return sum(t.element_size() * t.shape[0] * t.shape[1] * t.shape[3] * self.block
                   for kind in "kv" for t in self.arch[kind])

    def bits_at(self, tokens: int) -> float:
        """Effective bits projected to `tokens`, by the stored-byte formula (codebooks amortized)."""
        nb, na = self.blocks_at(tokens), self.arch_at(tokens)
        n = ((nb - na) * self._block_bytes() + na * self._arch_block_bytes()
             + self.policy.fp16_tokens(tokens) * self._fp16_token_bytes() + self._static_bytes())
        return 8.0 * n / self._elements(tokens)


# -- from a packed checkpoint ----------------------------------------------------------------------------

def tensor_names(rvq: dict, n_layers: int) -> list[str]:
    """Calibration tensor names of an rvq-tiered cache: kv.layers.{i}.{k|v}.{mid|arch}.{stage}."""
    tiers = [("mid", rvq["mid_sizes"])] + ([("arch", rvq["arch_sizes"])] if rvq["archive_after"] else [])
    return [f"kv.layers.{i}.{kind}.{tier}.{s}" for i in range(n_layers) for kind in "kv"
            for tier, sizes in tiers for s in range(len(sizes))]


def rvq_tensor_names(section: dict, args: ModelArgs) -> list[str]:
    return tensor_names(section["rvq"], args.n_layers)


def random_rvq_tensors(args: ModelArgs, section: dict, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    """Stand-in calibration: random codebooks [heads, d / sub_dim, C, sub_dim], each stage finer than the last."""
    rvq = section["rvq"]
    heads = 1 if rvq["shared_heads"] else args.n_kv_heads
    dims = {"mid": (rvq["mid_sizes"], rvq["mid_dim"]), "arch": (rvq["arch_sizes"], rvq["arch_dim"])}
    out = {}
    for name in tensor_names(rvq, args.n_layers):
        tier, stage = name.split(".")[-2], int(name.split(".")[-1])
        sizes, sub = dims[tier]
        cb = torch.randn(heads, args.head_dim // sub, sizes[stage], sub, generator=gen) * 0.5**stage
        out[name] = cb.to(device)
    return out


def build_rvq_codecs(section: dict, tensors: dict[str, torch.Tensor], args: ModelArgs) -> list[RVQLayerCodec]:
    """Per-layer codecs from the manifest's `kv` section and `kv.*` tensors; FormatError on any mismatch."""
    from ..errors import FormatError

    L, K, d = args.n_layers, args.n_kv_heads, args.head_dim
    if (section.get("n_layers"), section.get("n_kv_heads"), section.get("head_dim")) != (L, K, d):
        raise FormatError(f"KV calibration is for {section.get('n_layers')} layers × {section.get('n_kv_heads')} "
                          f"KV heads × head_dim {section.get('head_dim')}, the model has {L} × {K} × {d}")
    rvq = section["rvq"]
    Gc = 1 if rvq["shared_heads"] else K
    want = {}
    for tier, sizes, dim in (("mid", rvq["mid_sizes"], rvq["mid_dim"]), ("arch", rvq["arch_sizes"], rvq["arch_dim"])):
        if d % dim:
            raise FormatError(f"KV calibration: {tier}_dim {dim} does not divide the model's head_dim {d}")
        for s, C in enumerate(sizes):
            want[(tier, s)] = (Gc, d // dim, C, dim)
    names = set(tensor_names(rvq, L))
    extra = sorted(n for n in tensors if n not in names)
    if extra:
        raise FormatError(f"KV calibration tensor {extra[0]} does not belong to this rvq-tiered cache "
                          f"({L} layers)")
    codecs = []
    for i in range(L):
        tiers = {}
        for tier, sizes in (("mid", rvq["mid_sizes"]), ("arch", rvq["arch_sizes"] if rvq["archive_after"] else [])):
            if not sizes:
                continue
            tiers[tier] = {}
            for kind in "kv":
                cbs = []
                for s in range(len(sizes)):
                    name = f"kv.layers.{i}.{kind}.{tier}.{s}"
                    t = tensors.get(name)
                    if t is None:
                        raise FormatError(f"KV calibration tensor {name} is missing")
                    if tuple(t.shape) != want[(tier, s)]:
                        raise FormatError(f"KV calibration tensor {name} has shape {list(t.shape)}, the model "
                                          f"needs {list(want[(tier, s)])} ({K} KV heads, head_dim {d})")
                    cbs.append(t)
                tiers[tier][kind] = RVQTier(cbs)
        codecs.append(RVQLayerCodec(tiers["mid"], tiers.get("arch")))
    return codecs


def rvq_cache_factory(section: dict, tensors: dict[str, torch.Tensor], args: ModelArgs, mode: str = "dynamic",
                      use_kernel: bool | None = None):
    """(model, batch, max_len) -> RVQTieredCache in `mode` (dynamic: for perplexity.evaluate; static: the decode
    engine's, history mirror in the model's dtype; simulated: one forward per window, built on the CPU): the
    registry's `cache_factory` hook."""
    codecs = build_rvq_codecs(section, tensors, args)
    rvq = section["rvq"]
    rope_pre = rvq["rope"] == "pre"

    def make(model, batch: int, max_len: int):
        w = model.tok_embeddings.weight
        kw = dict(window=section["window"], sinks=section["sinks"], block=section["block"],
                  archive_after=rvq["archive_after"], rope_pre=rope_pre, mode=mode)
        if mode == "simulated":
            return RVQTieredCache(model.args, batch, max_len, codecs, use_kernel=False, **kw)
        return RVQTieredCache(model.args, batch, max_len, codecs, device=w.device, use_kernel=use_kernel,
                              mirror_dtype=w.dtype if mode == "static" else torch.float32, **kw)

    return make
