"""Latent KV caches: cross-head latent (seed 000, after Palu) and cross-layer shared latent (seed 001, after
xKV), on the tiered cache's fp16 sinks + window (moec/runtime/kvtiered.py, whose eviction rule, RoPE
helpers and byte formula this subclass reuses).

A group is G adjacent layers (G = 1: latent-head). When a block of `block` tokens leaves the fp16
window, its keys and values of all the group's layers are concatenated per token,
x = [layer, kv head, channel] (D = G·K·d), and stored as
    codes    the latent z = W_down (x − mean), r dims, W_down = basis^T (PCA, moec/calibrate/latent.py),
             at `bits` per latent element: 16 (fp16), 2/3/4 (uniform mid-rise grid of [−scale, scale]
             per latent channel, offline scales) or 1 = ternary (seed 001's sub-2-bit option: levels
             {−scale, 0, +scale}, five trits per byte, 1.6 bits per element)
    out_idx  the ceil(outlier_frac · block · D) largest |x − x̂| of the block (per batch row), as int16
    out_val  (int32 when block·D > 32767) index t·D + j, and their fp16 residuals (seed 000's sparse term)
with x̂ = basis · deq(z) + mean. Keys are compressed pre-RoPE (`rope: pre`, ShadowKV: un-rotated before
encoding, reconstructed and rotated back at attention) or post-RoPE (`rope: post`: scores can be taken
in latent space with the up-projection absorbed into the query, MLA-style). The fused CUDA kernel
moec/kernels/latent_decode_attention.py takes both placements and the sparse residual. Values always
attend in latent space on the kernel path: out = W_up_v (p · z_v) + mean_v.

Cross-layer timing: a group's block is encoded when the *last* layer of the group has attended (all
layers' keys/values of those tokens exist then); until then the tokens stay in every layer's fp16
window. Eviction happens after the attention of the step, as in TieredKVCache, so every query sees the
same cache view as with per-layer eviction: query at position p sees blocks_at(p) history blocks.

Multi-token calls (prefill, or the exact chunked evaluation of benchmarks/bench_kv_latent.py) give each
query its own decode-mode view: blocks the later queries of the chunk already see in compressed form
are encoded first (their tokens come from earlier calls, so every layer of the group has them) and
masked per query; this needs chunks of at most window + 1 tokens (asserted).

Latent code layout (moec/formats/bitpack.py; `LatentCodec.layout`): 2/3/4 bits Layout.PLANAR, chosen for the
kernel: W = r·b/8 bytes per token; at 2/4 bits latent channel c lives in byte c % W at bit b·(c // W) (the
channels of one bit plane are contiguous); ternary latents Layout.TRITS (byte i holds channels 5i..5i+4 as
Σ c·3^j; r padded to a multiple of 5). The kernel reads 2/4-bit codes; 3-bit and ternary: torch path only.

Stored bytes: window + sinks (fp16), codes and outliers of the filled blocks, and once per group and
kind the basis, mean and scale (held in fp16: W_down/W_up counted once, amortized over the tokens).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..errors import FormatError
from ..formats.bitpack import LAYOUTS, Layout
from ..formats.kvsection import group_tensor
from .backend import kernels_enabled
from .config import ModelArgs
from .kvtiered import HistoryStore, TieredKVCache, rotate

if TYPE_CHECKING:
    from ..kernels.latent_decode_attention import LatentView

TERNARY = 1  # `bits` value of the ternary latent


def quantize_latent(z: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes in [0, 2^b) of z [..., r] on the uniform mid-rise grid of [-scale, scale] (float);
    ternary (bits 1): codes 0, 1, 2 for the levels -scale, 0, +scale (nearest)."""
    if bits == TERNARY:
        return torch.clamp(torch.round(z / scale) + 1, 0, 2)
    n = 2**bits
    step = 2.0 * scale / n
    return torch.clamp(torch.floor(z / step) + n // 2, 0, n - 1)


def dequantize_latent(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == TERNARY:
        return (codes.float() - 1.0) * scale
    n = 2**bits
    return (codes.float() - n // 2 + 0.5) * (2.0 * scale / n)


class LatentCodec:
    """One group and kind: encode a block x [B, N, D] -> fields; decode fields -> x̂ [B, S, D] (fp32)."""

    def __init__(self, basis: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, bits: int, block: int,
                 outlier_frac: float, device="cpu"):
        self.D, self.r = basis.shape
        self.bits, self.block = bits, block
        # held (and counted) in fp16; computed with in fp32
        self.basis16, self.mean16, self.scale16 = (t.to(device, torch.float16).contiguous()
                                                   for t in (basis, mean, scale))
        self.basis, self.mean, self.scale = self.basis16.float(), self.mean16.float(), self.scale16.float()
        self.n_out = math.ceil(outlier_frac * block * self.D - 1e-9) if outlier_frac > 0 else 0
        self.idx_dtype = torch.int16 if block * self.D <= 32767 else torch.int32
        # the packed-code layout (moec/formats/bitpack.py) and its parameters; fp16 latents are not packed
        self.layout = None if bits == 16 else Layout.TRITS if bits == TERNARY else Layout.PLANAR
        self.layout_params = {} if bits in (16, TERNARY) else {"bits": bits}
        self._kernel_views: dict[str, LatentView] = {}  # device -> kernel_view(device)

    def fields(self) -> dict[str, tuple[str, tuple, torch.dtype]]:
        """name -> (axis "token"|"block", trailing shape, dtype)."""
        if self.bits == 16:
            f = {"codes": ("token", (self.r,), torch.float16)}
        else:
            f = {"codes": ("token", (LAYOUTS[self.layout].width(n=self.r, **self.layout_params),), torch.uint8)}
        if self.n_out:
            f["out_idx"] = ("block", (self.n_out,), self.idx_dtype)
            f["out_val"] = ("block", (self.n_out,), torch.float16)
        return f

    def _pack(self, codes):
        return LAYOUTS[self.layout].pack(codes, **self.layout_params)

    def latent(self, codes: torch.Tensor) -> torch.Tensor:
        """Stored codes [B, S, w] -> dequantized latent [B, S, r] fp32."""
        if self.bits == 16:
            return codes.float()
        c = LAYOUTS[self.layout].unpack(codes, n=self.r, **self.layout_params)
        return dequantize_latent(c, self.scale, self.bits)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        B, N, D = x.shape
        assert D == self.D and N == self.block, (x.shape, self.D, self.block)
        z = (x - self.mean) @ self.basis  # [B, N, r]
        out = {"codes": z.half() if self.bits == 16 else self._pack(quantize_latent(z, self.scale, self.bits))}
        if self.n_out:
            e = (x - self.decode({"codes": out["codes"]})).reshape(B, 1, N * D)
            idx = e.abs().topk(self.n_out, dim=-1).indices  # [B, 1, n_out]
            out["out_idx"] = idx.to(self.idx_dtype)
            out["out_val"] = e.gather(-1, idx).half()
        return out

    def decode(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.latent(f["codes"]) @ self.basis.T + self.mean  # [B, S, D]
        if self.n_out and "out_idx" in f:
            B, S, D = x.shape
            x = x.reshape(B, S // self.block, self.block * D)
            x = x.scatter_add(-1, f["out_idx"].long(), f["out_val"].float()).reshape(B, S, D)
        return x

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return {"basis": self.basis16, "mean": self.mean16, "scale": self.scale16}

    def kernel_view(self, device) -> LatentView:
        """This codec's tensors on `device` as moec/kernels/latent_decode_attention.py takes them (fp32 basis,
        mean and quantization step), made once per device and kept on the codec."""
        key = str(device)
        if key not in self._kernel_views:
            from ..kernels.latent_decode_attention import LatentView

            step = torch.ones_like(self.scale) if self.bits == 16 else 2.0 * self.scale / 2**self.bits
            self._kernel_views[key] = LatentView(self.bits, self.block, self.n_out, self.D, self.basis.to(device),
                                                 self.mean.to(device), step.to(device))
        return self._kernel_views[key]


class _NoFields:
    """Stands in for TieredKVCache's per-layer codecs: the latent history lives in per-group buffers."""

    def __init__(self, name: str, bits: int):
        self.name, self.bits = name, bits

    def fields(self, kind):
        return {}

    def static_tensors(self):
        return {}


class LatentKVCache(TieredKVCache):
    """latent-head / latent-layer in the dynamic and static modes of TieredKVCache (no simulated mode): the tier
    rule, the windows and their ageing (`_age`) are the tiered cache's; a block leaving the window is encoded
    for the whole layer group at once (`_encode_group`) into per-group codes (`lhist`, a _LatentStore).
    Dynamic mode: multi-token calls give each query its own view (module docstring), decode steps go through
    moec/kernels/latent_decode_attention.py where it takes the codec; static mode: the CUDA-graph engine's
    step attends over the dequantized mirror (graph-safe SDPA); the latent kernel is not wired there."""

    position_order_view = False  # queries attend per query over group-encoded blocks (module docstring)

    def __init__(self, args: ModelArgs, batch: int, max_len: int, groups: list[list[int]],
                 codecs: list[dict[str, LatentCodec]], name: str = "latent-head", *, window: int, sinks: int = 4,
                 block: int = 32, rope_pre: bool = False, device="cpu", use_kernel: bool | None = None,
                 mode: str = "dynamic", mirror_dtype=torch.float32):
        assert [i for g in groups for i in g] == list(range(args.n_layers)), groups
        assert mode != "simulated", "the latent cache has no simulated mode"
        bits = codecs[0]["k"].bits
        if mode == "static":
            use_kernel = False
        elif use_kernel is None:  # the fused kernel's conditions (moec/kernels/latent_decode_attention.py)
            from ..kernels.latent_decode_attention import kernel_supports

            has_out = any(c[k].n_out for c in codecs for k in "kv")
            use_kernel = (kernel_supports(bits, args.head_dim, rope_pre, block, has_out)
                          and kernels_enabled(device))
        self.lgroups, self.lcodecs = groups, codecs
        super().__init__(args, batch, max_len, [_NoFields(name, bits)] * args.n_layers, window, sinks, block,
                         rope_pre, device, use_kernel=use_kernel, mode=mode, mirror_dtype=mirror_dtype)
        self.lhist = self.store.lhist  # per group and kind: {field: [B, n, ...]}
        self.n_dropped = [0] * args.n_layers  # dynamic: history blocks already cut from each layer's fp16 window
        self._kernel_layers: dict[int, tuple] = {}  # layer -> its kernel arguments (_kernel_layer)

    def _make_store(self, mirror_dtype) -> HistoryStore:
        return _LatentStore(self, mirror_dtype)

    def _layer_groups(self) -> list[list[int]]:
        return self.lgroups

    def group_fields(self, g: int, kind: str, blocks: int | None = None) -> dict[str, torch.Tensor]:
        """The stored fields of group g's filled history blocks (token or block axis at dim 1)."""
        nb = self.n_blocks[self.groups[g][0]] if blocks is None else blocks
        fields = self.lcodecs[g][kind].fields()
        return {n: t[:, : nb * (self.block if fields[n][0] == "token" else 1)] for n, t in self.lhist[g][kind].items()}

    # -- history ----------------------------------------------------------------------------------------

    def _encode_group(self, rows: slice, layers: list[int], xs: dict, nb0: int) -> None:
        """xs[layer][kind] [b, K, n·block, d] fp16 (n consecutive blocks of `rows`) -> the group's codes (and the
        mirror): the tokens of every layer of the group concatenated per token, each block encoded alone."""
        g, blk, K, d = self.group_of[layers[0]], self.block, self.args.n_kv_heads, self.args.head_dim
        pos0 = self.sinks + nb0 * blk
        for kind in "kv":
            parts = []
            for i in layers:
                x = xs[i][kind].float()  # [b, K, n·blk, d]
                b, n = x.shape[0], x.shape[2] // blk
                if kind == "k" and self.rope_pre:  # n consecutive blocks: one run of positions
                    x = rotate(self.args, x, pos0, inverse=True)
                parts.append(x.permute(0, 2, 1, 3).reshape(b * n, blk, K * d))
            codec = self.lcodecs[g][kind]
            enc = codec.encode(torch.cat(parts, dim=2))  # [b·n, per, ...] per field
            for name, t in enc.items():
                per = t.shape[1]
                self.lhist[g][kind][name][rows, nb0 * per : (nb0 + n) * per] = t.reshape(b, n * per, *t.shape[2:])
            if self.mirror is None:
                continue
            y = codec.decode(enc).view(b, n, blk, len(layers), K, d)
            for j, i in enumerate(layers):
                yi = y[:, :, :, j].permute(0, 3, 1, 2, 4).reshape(b, K, n * blk, d)
                if kind == "k" and self.rope_pre:
                    yi = rotate(self.args, yi, pos0, inverse=False)
                self.mirror[kind][i][rows, :, nb0 * blk : (nb0 + n) * blk] = yi

    def _encode_group_block(self, g: int) -> None:
        """Dynamic mode: encode the group's next history block ahead of the window's ageing (a multi-token call's
        later queries see it compressed), from its layers' fp16 windows, which keep its tokens until `_age`."""
        layers, blk = self.groups[g], self.block
        nb = self.n_blocks[layers[0]]
        assert nb < self.max_blocks, (nb, self.max_blocks)
        xs = {}
        for i in layers:
            lo = self.sinks + (nb - self.n_dropped[i]) * blk
            xs[i] = {kind: self.win[kind][i][:, :, lo : lo + blk] for kind in "kv"}
            assert xs[i]["k"].shape[2] == blk, (i, xs[i]["k"].shape, lo)
        self._encode_group(slice(None), layers, xs, nb)
        for i in layers:
            self.n_blocks[i] = nb + 1

    def _history(self, i: int, kind: str, blocks: int) -> torch.Tensor:
        """Layer i's reconstructed history [B, K, blocks·block, d] fp32 (post-RoPE keys): the CPU mirror, or
        decoded from the stored fields (kernel caches keep no mirror; used by their multi-token calls)."""
        if self.mirror is not None:
            return self.mirror[kind][i][:, :, : blocks * self.block]
        g, K, d = self.group_of[i], self.args.n_kv_heads, self.args.head_dim
        j = self.groups[g].index(i)
        x = self.lcodecs[g][kind].decode(self.group_fields(g, kind, blocks))[:, :, j * K * d : (j + 1) * K * d]
        x = x.reshape(self.batch, -1, K, d).permute(0, 2, 1, 3)
        return self._rope(x, self.sinks, inverse=False) if kind == "k" and self.rope_pre and x.shape[2] else x

    def _cut_window(self, i: int) -> None:
        """Drop from layer i's fp16 window the tokens its history now holds."""
        s, cut = self.sinks, (self.n_blocks[i] - self.n_dropped[i]) * self.block
        for kind in "kv":
            w = self.win[kind][i]
            self.win[kind][i] = torch.cat([w[:, :, :s], w[:, :, s + cut :]], dim=2)
        self.n_dropped[i] = self.n_blocks[i]

    def _window_positions(self, i: int, n: int) -> torch.Tensor:
        s = min(self.sinks, n)
        start = self.sinks + self.n_dropped[i] * self.block
        return torch.cat([torch.arange(s), torch.arange(start, start + n - s)]).to(self.device)

    # -- the cache interface ----------------------------------------------------------------------------

    def _attend(self, layer: int, q, k, v, start_pos: int) -> torch.Tensor:
        """Dynamic mode. q: [B, H, T, d]; k, v: [B, K, T, d] at positions start_pos.. -> [B, H, T, d]."""
        T, s, blk = k.shape[2], self.sinks, self.block
        g = self.group_of[layer]
        layers = self.groups[g]
        held = self.win["k"][layer].shape[2]
        assert start_pos == held + self.n_dropped[layer] * blk, (start_pos, held, self.n_dropped[layer])
        assert start_pos + T <= self.max_len, (start_pos, T, self.max_len)
        self.win["k"][layer] = wk = torch.cat([self.win["k"][layer], k.half()], dim=2)
        self.win["v"][layer] = wv = torch.cat([self.win["v"][layer], v.half()], dim=2)
        need = self.blocks_at(start_pos + T - 1)  # history blocks the chunk's last query sees
        if layer == layers[0]:
            # Only blocks of earlier calls' tokens can be encoded here (every layer of the group holds them).
            # A chunk's own tokens (a prompt longer than the window) are seen in fp16, as TieredKVCache's
            # prefill sees them, and encoded when the group's last layer ages the window below.
            while self.n_blocks[layer] < need and s + (self.n_blocks[layer] + 1) * blk <= start_pos:
                self._encode_group_block(g)
        nb = self.n_blocks[layer]
        if T == 1 and self.use_kernel:
            assert nb == self.n_dropped[layer], (nb, self.n_dropped[layer])
            out = self._attend_kernel(layer, q, wk, wv)
        else:
            hk, hv = self._history(layer, "k", nb).to(q.dtype), self._history(layer, "v", nb).to(q.dtype)
            keys, vals = torch.cat([wk.to(q.dtype), hk], dim=2), torch.cat([wv.to(q.dtype), hv], dim=2)
            if T == 1 and nb == self.n_dropped[layer]:  # one query: it sees everything held
                out = F.scaled_dot_product_attention(q, keys, vals, enable_gqa=True)
            else:  # per query: fp16 keys outside its history, compressed keys inside it
                qpos = torch.arange(start_pos, start_pos + T, device=self.device)
                hend = s + torch.tensor([min(self.blocks_at(int(p)), nb) for p in qpos], device=self.device) * blk
                pw = self._window_positions(layer, wk.shape[2])
                ph = torch.arange(s, s + nb * blk, device=self.device)
                in_hist = (pw[None] >= s) & (pw[None] < hend[:, None])
                mask = torch.cat([(pw[None] <= qpos[:, None]) & ~in_hist, ph[None] < hend[:, None]], dim=1)
                out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True)
        if layer == layers[-1]:  # the group's tokens are complete: cut blocks encoded ahead, age the window
            for i in layers:
                self._cut_window(i)
            self._age(slice(None), [layers], start_pos + T)
            for i in layers:
                self.n_dropped[i] = self.n_blocks[i]
        if layer == self.args.n_layers - 1:
            self.length = start_pos + T
        return out

    def _kernel_layer(self, layer: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """Layer's (u_k, mean_k, step_k, u_v, mean_v, step_v) cut from its group's codec views, and the
        launcher's latent_statics of them: made once per layer (they depend on this cache's heads and RoPE
        placement, so they live here, not on the codecs)."""
        if layer not in self._kernel_layers:
            from ..kernels.latent_decode_attention import latent_statics, layer_parts

            g, K, d = self.group_of[layer], self.args.n_kv_heads, self.args.head_dim
            j = self.groups[g].index(layer)
            parts = [t for kind in "kv" for t in layer_parts(self.lcodecs[g][kind].kernel_view(self.device), j, K, d)]
            bits = self.lcodecs[g]["k"].bits
            self._kernel_layers[layer] = (parts, latent_statics(*parts, bits, self.args.n_heads // K, self.rope_pre))
        return self._kernel_layers[layer]

    def _attend_kernel(self, layer: int, q: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
        """Decode-step attention through moec/kernels/latent_decode_attention.py: q [B, H, 1, d] -> [B, H, 1, d];
        wk/wv: this layer's fp16 sinks + window [B, K, n, d] (the new token included)."""
        from ..kernels.latent_decode_attention import latent_decode_attention

        g = self.group_of[layer]
        j = self.groups[g].index(layer)
        B, K, d = self.batch, self.args.n_kv_heads, self.args.head_dim
        (uk, mk, sk, uv, mv, sv), statics = self._kernel_layer(layer)
        kview, vview = (self.lcodecs[g][kind].kernel_view(self.device) for kind in "kv")
        nb = self.n_blocks[layer]
        outs = {}
        for kind, view in (("k", kview), ("v", vview)):
            hist = self.lhist[g][kind]
            outs[kind] = (hist["out_idx"][:, :nb], hist["out_val"][:, :nb]) if view.n_out else None
        hist_len = torch.full((B,), nb * self.block, dtype=torch.int32, device=q.device)
        wlen = torch.full((B,), wk.shape[2], dtype=torch.int32, device=q.device)
        ck, cv = self.lhist[g]["k"]["codes"], self.lhist[g]["v"]["codes"]
        out = latent_decode_attention(q[:, :, 0], ck, cv, uk, mk, sk, uv, mv, sv, kview.bits, hist_len,
                                      wk.contiguous(), wv.contiguous(), wlen, k_out=outs["k"], v_out=outs["v"],
                                      block=self.block, group_dim=kview.group_dim, layer_off=j * K * d,
                                      rope=self.rope_table if self.rope_pre else None, statics=statics)
        return out[:, :, None].to(q.dtype)

    # -- bytes ------------------------------------------------------------------------------------------

    def stored_bytes(self) -> int:
        n = sum(w.numel() * w.element_size() for kind in "kv" for w in self.win[kind])
        n += sum(t.numel() * t.element_size() for g in range(len(self.groups)) for kind in "kv"
                 for t in self.group_fields(g, kind).values())
        return n + self._static_bytes()


LATENT_PARTS = ("basis", "mean", "scale")


def build_latent_codecs(section: dict, tensors: dict[str, torch.Tensor], args: ModelArgs,
                        device="cpu") -> tuple[list[list[int]], list[dict[str, LatentCodec]]]:
    """Groups and per-group codecs from a packed checkpoint's `kv` section and `kv.groups.*` tensors.

    Raises FormatError when the calibration does not match the model's shapes."""
    L, K, d, bits = args.n_layers, args.n_kv_heads, args.head_dim, section["bits"]
    if (section.get("n_layers"), section.get("n_kv_heads"), section.get("head_dim")) != (L, K, d):
        raise FormatError(f"KV calibration is for {section.get('n_layers')} layers × {section.get('n_kv_heads')} "
                          f"KV heads × head_dim {section.get('head_dim')}, the model has {L} × {K} × {d}")
    lat = section.get("latent") or {}
    G = lat.get("group_layers", 0)
    if not 1 <= G <= L or section.get("n_groups") != -(-L // G):
        raise FormatError(f"KV latent section: group_layers {G} / n_groups {section.get('n_groups')} do not "
                          f"fit a {L}-layer model")
    if bits not in (TERNARY, 2, 3, 4, 16):
        raise FormatError(f"KV latent section: bits {bits} is not one of 1 (ternary), 2, 3, 4, 16")
    groups = [list(range(i, min(i + G, L))) for i in range(0, L, G)]
    codecs = []
    for g, layers in enumerate(groups):
        D = len(layers) * K * d
        parts = {}
        for kind in "kv":
            for p in LATENT_PARTS:
                name = f"kv.groups.{g}.{kind}_{p}"
                t = tensors.get(name)
                if t is None:
                    raise FormatError(f"KV calibration tensor {name} is missing")
                parts[kind, p] = t
            basis, mean, scale = (parts[kind, p] for p in LATENT_PARTS)
            r = basis.shape[-1] if basis.dim() == 2 else -1
            if basis.dim() != 2 or basis.shape[0] != D or not 0 < r <= D:
                raise FormatError(f"KV calibration tensor kv.groups.{g}.{kind}_basis has shape {list(basis.shape)}, "
                                  f"the model needs [{D}, r ≤ {D}] ({len(layers)} layers × {K} KV heads × "
                                  f"head_dim {d})")
            if tuple(mean.shape) != (D,) or tuple(scale.shape) != (r,):
                raise FormatError(f"KV calibration tensors kv.groups.{g}.{kind}_mean/_scale have shapes "
                                  f"{list(mean.shape)}/{list(scale.shape)}, expected [{D}]/[{r}]")
            if bits not in (TERNARY, 16) and r % 8:
                raise FormatError(f"KV calibration: kv.groups.{g}.{kind} rank {r} does not pack at {bits} bits")
        codecs.append({kind: LatentCodec(parts[kind, "basis"], parts[kind, "mean"], parts[kind, "scale"], bits,
                                         section["block"], lat["outlier_frac"], device) for kind in "kv"})
    extra = [n for n in tensors if not n.startswith("kv.groups.") or int(n.split(".")[2]) >= len(groups)]
    if extra:
        raise FormatError(f"KV calibration tensor {extra[0]} does not belong to {len(groups)} latent groups")
    return groups, codecs


def latent_section(kv, args: ModelArgs) -> dict:
    """Derived manifest key: the number of layer groups."""
    return {"n_groups": -(-args.n_layers // kv.latent.group_layers)}


def latent_tensor_names(section: dict, args: ModelArgs) -> list[str]:
    return [group_tensor(g, f"{kind}_{p}") for g in range(section["n_groups"]) for kind in "kv" for p in LATENT_PARTS]


def random_latent_tensors(args: ModelArgs, section: dict, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    """Stand-in calibration: per group, an orthonormal random basis [D, r], zero mean, latent scale 3
    (the codes of unit-variance inputs then span the grid)."""
    out = {}
    G = section["latent"]["group_layers"]
    for g in range(section["n_groups"]):
        D = min(G, args.n_layers - g * G) * args.n_kv_heads * args.head_dim
        for kind in "kv":
            r = section["latent"].get(f"rank_{kind}") or D // 32 * 8  # ranks sized by energy: D / 4
            basis = torch.linalg.qr(torch.randn(D, min(r, D), generator=gen)).Q
            out[group_tensor(g, f"{kind}_basis")] = basis.to(device)
            out[group_tensor(g, f"{kind}_mean")] = torch.zeros(D, device=device)
            out[group_tensor(g, f"{kind}_scale")] = torch.full((basis.shape[1],), 3.0, device=device)
    return out


def latent_cache_factory(section: dict, tensors: dict[str, torch.Tensor], args: ModelArgs, mode: str = "dynamic",
                         use_kernel: bool | None = None):
    """(model, batch, max_len) -> the latent cache in `mode` (dynamic: the `cache_factory` of
    moec.runtime.perplexity.evaluate; static: the decode engine's, history mirror in the model's dtype).
    use_kernel=False keeps the torch path on CUDA (the oracle of GPU checks)."""
    groups, codecs = build_latent_codecs(section, tensors, args)
    per_device = {}

    def make(model, batch: int, max_len: int):
        w = model.tok_embeddings.weight
        dev = w.device
        if dev not in per_device:
            per_device[dev] = codecs if dev.type == "cpu" else build_latent_codecs(section, tensors, args, dev)[1]
        return LatentKVCache(model.args, batch, max_len, groups, per_device[dev], section["codec"],
                             window=section["window"], sinks=section["sinks"], block=section["block"],
                             rope_pre=section["rope"] == "pre", device=dev,
                             use_kernel=use_kernel, mode=mode,
                             mirror_dtype=w.dtype if mode == "static" else torch.float32)

    return make


# -- the static engine's cache ---------------------------------------------------------------------------

class _LatentStore(HistoryStore):
    """HistoryStore for latent groups: the per-layer fields are empty (_NoFields); the codes live per group
    ([B, n, ...], token or block axis at dim 1) in `lhist`; the mirror is per layer as for block codecs."""

    def __init__(self, cache: LatentKVCache, mirror_dtype):
        super().__init__(cache.args, cache.codecs, cache.policy, cache.max_blocks, cache.batch, cache.rope_pre,
                         cache.device, mirror_dtype=mirror_dtype)
        self.lcodecs, self.blk = cache.lcodecs, cache.block
        self.lhist = []
        for c in cache.lcodecs:
            self.lhist.append({kind: {name: torch.zeros(cache.batch, cache.max_blocks * (self.blk if axis == "token"
                                                                                        else 1), *trail, dtype=dtype,
                                                        device=self.device)
                                      for name, (axis, trail, dtype) in c[kind].fields().items()} for kind in "kv"})

    def buffers(self):
        return [t for g in self.lhist for kind in "kv" for t in g[kind].values()]

    def row_block_bytes(self) -> int:
        return sum(t.element_size() * t[0].numel() // t.shape[1] * (self.blk if self.lcodecs[g][kind].fields()[n][0]
                                                                      == "token" else 1)
                   for g, h in enumerate(self.lhist) for kind in "kv" for n, t in h[kind].items())

    def static_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.lcodecs for kind in "kv"
                   for t in c[kind].static_tensors().values())
