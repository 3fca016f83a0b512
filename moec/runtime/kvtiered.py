"""The tiered KV cache: fp16 sinks + compressed history + fp16 window of the most recent tokens.

Per layer, token positions are laid out in order
    [0, s)            sinks: the first `sinks` tokens, fp16, kept forever (attention sinks)
    [s, s + h)        history: h = n_blocks · block tokens, encoded block by block by a codec
    [s + h, length)   window: the most recent tokens, fp16, between `window` and window+block−1 of them
The cache, not the model, drives encoding: after each `attend`, while the window holds at least
window + block tokens, its oldest `block` tokens are encoded into the history (one codec call per
block). Prefill works the same way: a prompt longer than sinks + window + block has its older
tokens encoded right after the prefill attention (which, like KIVI, sees the prompt's own fp16
keys/values); the 32-token prefill of the eval protocol stays entirely in fp16.

Keys may be encoded pre-RoPE (`rope_pre`, KVQuant): the cache un-rotates a block with the inverse
rotation of its positions before encoding and rotates the decoded block back.

Attention: the torch reference dequantizes the history and attends (the correctness oracle). On the
CPU a dequantized mirror of the history is kept so each decode step does not decode the whole
history again (equal to dequantizing every step; it is a compute cache, not counted as stored).
On CUDA, decode steps of a nuq-outlier cache (pre- or post-RoPE keys, centered or not) go through the
fused Triton kernel (moec/kernels/kv_decode_attention.py), which reads the packed history directly, and nuq-outlier
blocks leaving the window are encoded by moec/kernels/kv_quantize_pack.py (the codec's exact fields).

Stored bytes are summed from the tensors held: window and sinks (fp16), every history field sliced
to the blocks filled, and each codec's per-layer static tensors (scales, levels).
"""

from __future__ import annotations

import torch

from .backend import kernels_enabled
from .config import ModelArgs
from .kvcache import causal_attention
from .model import apply_rope, rope_cos_sin


def kernel_path(device, codec: str, head_dim: int, block: int) -> bool:
    """Whether decode steps of a nuq-outlier cache go through the fused kernel by default (its shape limits:
    power-of-two head_dim >= 64 and block >= 16; where backend.kernels_enabled says so: CUDA by default)."""
    d = head_dim
    return (codec == "nuq-outlier" and d >= 64 and d & (d - 1) == 0 and block >= 16 and block & (block - 1) == 0
            and kernels_enabled(device))


def alloc_fields(fields: dict, batch: int, n_kv_heads: int, max_blocks: int, block: int, device) -> dict:
    """Zeroed history buffers [batch, K, n, *trail] for a codec's `fields()`: n = max_blocks · block for
    token fields, max_blocks for block fields."""
    return {name: torch.zeros(batch, n_kv_heads, max_blocks * (block if axis == "token" else 1), *trail,
                              dtype=dtype, device=device)
            for name, (axis, trail, dtype) in fields.items()}


class TieredKVCache:
    def __init__(self, args: ModelArgs, batch: int, max_len: int, codecs: list, window: int = 128,
                 sinks: int = 4, block: int = 32, rope_pre: bool = False, device="cpu",
                 use_kernel: bool | None = None):
        assert len(codecs) == args.n_layers, (len(codecs), args.n_layers)
        assert window >= 0 and sinks >= 0 and block > 0, (window, sinks, block)
        self.args, self.batch, self.max_len = args, batch, max_len
        self.codecs, self.window, self.sinks, self.block, self.rope_pre = codecs, window, sinks, block, rope_pre
        self.device = torch.device(device)
        self.codec = codecs[0].name
        self.bits = codecs[0].bits
        B, K, d = batch, args.n_kv_heads, args.head_dim
        self.max_blocks = max(max_len // block, 1)
        self.win = {kind: [torch.zeros(B, K, 0, d, dtype=torch.float16, device=device)
                           for _ in range(args.n_layers)] for kind in "kv"}
        self.hist = {kind: [self._alloc(c.fields(kind)) for c in codecs] for kind in "kv"}
        self.n_blocks = [0] * args.n_layers
        self.length = 0
        self.use_kernel = kernel_path(device, self.codec, d, block) if use_kernel is None else use_kernel
        self.rope_table = None  # the kernel's `rope` argument for pre-RoPE keys (kv_decode_attention.attend_cache)
        self.mirror = None if self.use_kernel else {
            kind: [torch.zeros(B, K, self.max_blocks * block, d, device=device) for _ in range(args.n_layers)]
            for kind in "kv"}

    def _alloc(self, fields: dict) -> dict[str, torch.Tensor]:
        return alloc_fields(fields, self.batch, self.args.n_kv_heads, self.max_blocks, self.block, self.device)

    def _axis_len(self, name: str, kind: str, layer: int, blocks: int) -> int:
        axis = self.codecs[layer].fields(kind)[name][0]
        return blocks * (self.block if axis == "token" else 1)

    # -- history ----------------------------------------------------------------------------------------

    def _rope(self, x: torch.Tensor, pos0: int, inverse: bool) -> torch.Tensor:
        pos = torch.arange(pos0, pos0 + x.shape[2], device=x.device)
        cos, sin = rope_cos_sin(self.args, pos, torch.float32)
        return apply_rope(x, cos, -sin if inverse else sin)

    def history_fields(self, layer: int, kind: str, blocks: int | None = None) -> dict[str, torch.Tensor]:
        blocks = self.n_blocks[layer] if blocks is None else blocks
        return {n: t[:, :, : self._axis_len(n, kind, layer, blocks)] for n, t in self.hist[kind][layer].items()}

    def decode_history(self, layer: int, kind: str) -> torch.Tensor:
        """The dequantized history [B, K, h, d] fp32 (post-RoPE keys), from the stored fields."""
        x = self.codecs[layer].decode(self.history_fields(layer, kind), kind)
        if kind == "k" and self.rope_pre and x.shape[2]:
            x = self._rope(x, self.sinks, inverse=False)
        return x

    def _encode(self, codec, x: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        """codec.encode; nuq-outlier blocks on CUDA go through the Triton quantize-pack kernel (same fields)."""
        if kernels_enabled(x.device):
            from ..kernels.kv_quantize_pack import kv_quantize_pack, supports

            if supports(codec):
                return kv_quantize_pack(x, kind, codec)
        return codec.encode(x, kind)

    def _encode_block(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        nb = self.n_blocks[layer]
        assert nb < self.max_blocks, (nb, self.max_blocks)
        pos0 = self.sinks + nb * self.block
        codec = self.codecs[layer]
        for kind, x in (("k", k.float()), ("v", v.float())):
            if kind == "k" and self.rope_pre:
                x = self._rope(x, pos0, inverse=True)
            enc = self._encode(codec, x, kind)
            for name, t in enc.items():
                n = self._axis_len(name, kind, layer, 1)
                self.hist[kind][layer][name][:, :, nb * n : (nb + 1) * n] = t
            if self.mirror is not None:
                one = {name: t for name, t in enc.items()}
                y = codec.decode(one, kind)
                if kind == "k" and self.rope_pre:
                    y = self._rope(y, pos0, inverse=False)
                self.mirror[kind][layer][:, :, nb * self.block : (nb + 1) * self.block] = y
        self.n_blocks[layer] = nb + 1

    # -- the cache interface ----------------------------------------------------------------------------

    def attend(self, layer: int, q, k, v, start_pos: int) -> torch.Tensor:
        """q: [B, H, T, d]; k, v: [B, K, T, d] at positions start_pos.. -> [B, H, T, d]."""
        T = k.shape[2]
        h = self.n_blocks[layer] * self.block
        held = self.win["k"][layer].shape[2]
        assert start_pos == held + h, (start_pos, held, h)
        assert start_pos + T <= self.max_len, (start_pos, T, self.max_len)
        wk = torch.cat([self.win["k"][layer], k.half()], dim=2)
        wv = torch.cat([self.win["v"][layer], v.half()], dim=2)
        s = min(self.sinks, wk.shape[2])
        if T == 1 and self.use_kernel:
            out = self._attend_kernel(layer, q, wk, wv)
        else:
            if self.mirror is not None:
                hk, hv = self.mirror["k"][layer][:, :, :h], self.mirror["v"][layer][:, :, :h]
            else:
                hk, hv = self.decode_history(layer, "k"), self.decode_history(layer, "v")
            keys = torch.cat([wk[:, :, :s].to(q.dtype), hk.to(q.dtype), wk[:, :, s:].to(q.dtype)], dim=2)
            vals = torch.cat([wv[:, :, :s].to(q.dtype), hv.to(q.dtype), wv[:, :, s:].to(q.dtype)], dim=2)
            out = causal_attention(q, keys, vals, start_pos)
        # Age the window: move whole blocks of its oldest (non-sink) tokens into the history.
        while wk.shape[2] - s >= self.window + self.block and s == self.sinks:
            self._encode_block(layer, wk[:, :, s : s + self.block], wv[:, :, s : s + self.block])
            wk = torch.cat([wk[:, :, :s], wk[:, :, s + self.block :]], dim=2)
            wv = torch.cat([wv[:, :, :s], wv[:, :, s + self.block :]], dim=2)
        self.win["k"][layer], self.win["v"][layer] = wk, wv
        if layer == self.args.n_layers - 1:
            self.length = start_pos + T
        return out

    def _attend_kernel(self, layer: int, q, wk, wv) -> torch.Tensor:
        """One decode step through the fused kernel (subclasses with other codecs override this)."""
        from ..kernels.kv_decode_attention import attend_cache

        return attend_cache(self, layer, q, wk, wv)

    # -- bytes ------------------------------------------------------------------------------------------

    def _static_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.codecs for t in c.static_tensors().values())

    def _block_bytes(self) -> int:
        """Bytes one history block takes over all layers, K and V, the whole batch (from the buffers)."""
        return sum(t.element_size() * t.numel() // t.shape[2] * self._axis_len(n, kind, layer, 1)
                   for kind in "kv" for layer in range(self.args.n_layers)
                   for n, t in self.hist[kind][layer].items())

    def _fp16_token_bytes(self) -> int:
        return self.batch * self.args.n_layers * 2 * self.args.n_kv_heads * self.args.head_dim * 2

    def stored_bytes(self) -> int:
        """Bytes held now: window + sinks, filled history fields, per-layer static tensors."""
        n = 0
        for kind in "kv":
            for layer in range(self.args.n_layers):
                w = self.win[kind][layer]
                n += w.numel() * w.element_size()
                n += sum(t.numel() * t.element_size() for t in self.history_fields(layer, kind).values())
        return n + self._static_bytes()

    def _elements(self, tokens: int) -> int:
        return tokens * self.batch * 2 * self.args.n_layers * self.args.n_kv_heads * self.args.head_dim

    def bits_per_element(self) -> float:
        return 8.0 * self.stored_bytes() / max(self._elements(self.length), 1)

    def blocks_at(self, tokens: int) -> int:
        """History blocks after `tokens` tokens went through the cache (the eviction rule of `attend`)."""
        recent = tokens - min(self.sinks, tokens)
        return max(0, (recent - self.window) // self.block) if tokens > self.sinks else 0

    def bits_at(self, tokens: int) -> float:
        """Effective bits projected to `tokens`, by the stored-byte formula of `stored_bytes`."""
        nb = self.blocks_at(tokens)
        n = nb * self._block_bytes() + (tokens - nb * self.block) * self._fp16_token_bytes() + self._static_bytes()
        return 8.0 * n / self._elements(tokens)


def build_codecs(section: dict, tensors: dict[str, torch.Tensor], args: ModelArgs) -> list:
    """Per-layer codecs from a packed checkpoint's `kv` manifest section and `kv.*` tensors.

    Raises FormatError when the calibration does not match the model's layer/head shapes."""
    from ..errors import FormatError
    from .kvquant import KIVICodec, NUQCenteredCodec, NUQOutlierCodec

    L, K, d, bits = args.n_layers, args.n_kv_heads, args.head_dim, section["bits"]
    if (section.get("n_layers"), section.get("n_kv_heads"), section.get("head_dim")) != (L, K, d):
        raise FormatError(f"KV calibration is for {section.get('n_layers')} layers × {section.get('n_kv_heads')} "
                          f"KV heads × head_dim {section.get('head_dim')}, the model has {L} × {K} × {d}")
    if section["codec"] == "kivi":
        return [KIVICodec(bits, d, section["group_size"]) for _ in range(L)]
    if section["codec"] != "nuq-outlier":
        raise FormatError(f"KV codec {section['codec']!r} is not one this runtime executes (kivi, nuq-outlier)")
    codecs = []
    want = {"k_scale": (K, d), "k_levels": (2**bits,), "v_levels": (2**bits,)}
    if section.get("k_center", False):  # the NUQCenteredCodec options (older checkpoints have neither)
        want["k_center"] = (K, d)
    if section.get("outlier_select", "magnitude") == "weighted-error":
        want["k_weight"] = (K, d)
    for i in range(L):
        parts = {}
        for part, shape in want.items():
            t = tensors.get(f"kv.layers.{i}.{part}")
            if t is None:
                raise FormatError(f"KV calibration tensor kv.layers.{i}.{part} is missing")
            if tuple(t.shape) != shape:
                raise FormatError(f"KV calibration tensor kv.layers.{i}.{part} has shape {list(t.shape)}, "
                                  f"the model needs {list(shape)} ({L} layers, {K} KV heads, head_dim {d})")
            parts[part] = t
        if len(want) > 3:
            codecs.append(NUQCenteredCodec(bits, d, section["block"], parts["k_levels"], parts["v_levels"],
                                           parts["k_scale"], section["outlier_frac"], parts.get("k_center"),
                                           parts.get("k_weight")))
            continue
        codecs.append(NUQOutlierCodec(bits, d, section["block"], parts["k_levels"], parts["v_levels"],
                                      parts["k_scale"], section["outlier_frac"]))
    extra = [n for n in tensors if not n.startswith("kv.layers.") or int(n.split(".")[2]) >= L]
    if extra:
        raise FormatError(f"KV calibration tensor {extra[0]} does not belong to a {L}-layer model")
    return codecs


def tiered_cache_factory(section: dict, codecs: list, simulated: bool = False, use_kernel: bool | None = None):
    """(model, batch, max_len) -> TieredKVCache, the `cache_factory` of moec.runtime.perplexity.evaluate
    (or, `simulated`, the one-forward-per-window SimulatedTieredCache of moec/runtime/kvsim.py);
    use_kernel=False keeps the dequantize-then-attend torch path on CUDA (the oracle of GPU checks)."""

    rope_pre = section["codec"] == "nuq-outlier" and section["rope"] == "pre"

    def make(model, batch: int, max_len: int):
        dev = model.tok_embeddings.weight.device
        if simulated:
            from .kvsim import SimulatedTieredCache

            return SimulatedTieredCache(model.args, batch, max_len, codecs, section["window"], section["sinks"],
                                        section["block"], rope_pre)
        return TieredKVCache(model.args, batch, max_len, codecs, window=section["window"], sinks=section["sinks"],
                             block=section["block"], rope_pre=rope_pre, device=dev, use_kernel=use_kernel)

    return make
