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

One tier rule and one history store serve every tiered cache: `TierPolicy` (which tokens are sinks,
history blocks or window after n tokens; capacity; fp16 slots) and `HistoryStore` (field buffers,
encode dispatch, pre-RoPE rotation, the torch path's mirror, byte counts) are used by TieredKVCache
here (host-side lengths, the dynamic cache of eval/generate), by decode.StaticTieredCache (device-side
positions, the CUDA-graph engine), by the simulated decode mode (kvsim.py) and by the latent and RVQ
caches built on TieredKVCache. Any registered block codec (moec/registry.py `layer_codecs`) runs in
all of them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .backend import kernels_enabled
from .config import ModelArgs
from .kvcache import causal_attention
from .model import apply_rope, rope_cos_sin, rope_inv_freq
from .nuq import quantize_pack_supports


def rope_table(args: ModelArgs, sinks: int, device) -> tuple[torch.Tensor, int]:
    """The decode kernels' `rope` argument for a pre-RoPE history whose token t sits at position sinks + t:
    (inv_freq [d/2] fp32 contiguous on `device`, sinks). Caches make it once, in their constructor."""
    return rope_inv_freq(args, device).float().contiguous(), sinks


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


def rotate(args: ModelArgs, x: torch.Tensor, pos0: int, inverse: bool) -> torch.Tensor:
    """RoPE (or its inverse) of x [..., n, d] at positions pos0..pos0+n-1, in fp32 tables."""
    pos = torch.arange(pos0, pos0 + x.shape[2], device=x.device)
    cos, sin = rope_cos_sin(args, pos, torch.float32)
    return apply_rope(x, cos, -sin if inverse else sin)


class LayerRotations:
    """The codecs' head_dim rotations R [d, d] (nuq-outlier `rotate: hadamard`), per layer, kept in each dtype
    the model may attend in (made here, so never inside a CUDA-graph capture; d×d per layer each).

    A cache with rotations stores k·R and v·R, attends with q·R (q·k and the softmax are unchanged: R is
    orthogonal) and returns (Σ p·v·R)·Rᵀ: the rotation sits outside every attention path (torch, fused
    kernel, simulated), which attend in the rotated basis."""

    def __init__(self, rots: list[torch.Tensor]):
        self.by_dtype = {dt: [r.to(dt) for r in rots] for dt in (torch.float32, torch.bfloat16, torch.float16)}

    @classmethod
    def of(cls, codecs: list, device) -> LayerRotations | None:
        rots = [getattr(c, "rotation", None) for c in codecs]
        return None if all(r is None for r in rots) else cls([r.to(device) for r in rots])

    def get(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        return self.by_dtype[dtype][layer]

    def attend(self, attend, layer: int, q, k, v, start_pos) -> torch.Tensor:
        """attend(layer, q·R, k·R, v·R, start_pos)·Rᵀ in q's dtype: one concatenation and two products per
        layer (each a kernel launch in a decode step)."""
        R = self.get(layer, q.dtype)
        H, K = q.shape[1], k.shape[1]
        qkv = torch.cat([q, k.to(q.dtype), v.to(q.dtype)], dim=1) @ R
        out = attend(layer, qkv[:, :H], qkv[:, H : H + K], qkv[:, H + K :], start_pos)
        return out.to(q.dtype) @ R.T

    def rotate(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.by_dtype[torch.float32][layer]


def history_bias(codec, q: torch.Tensor) -> torch.Tensor | None:
    """The score bias of the history keys (nuq-outlier `score_bias`), [B, H, T, 1] fp32: half the expected
    square of q·e/√d, e the key rounding error with calibrated per-channel power k_err2 [K, d] (channels
    taken as independent): E[exp(q·k/√d) | k̂] = exp(q·k̂/√d + σ²/2). None for codecs without it."""
    err2 = getattr(codec, "k_err2", None)
    if err2 is None:
        return None
    H, d = q.shape[1], q.shape[3]
    e = err2.to(q.device, torch.float32).repeat_interleave(H // err2.shape[0], 0)  # [H, d]
    return (q.float().pow(2) * e[None, :, None, :]).sum(-1, keepdim=True) * (0.5 / d)


def biased_scores(q: torch.Tensor, keys: torch.Tensor, is_hist: torch.Tensor, bias: torch.Tensor):
    """(q', keys', scale) such that SDPA(q', keys', v, scale=scale) adds `bias` [B, H, T, 1] to the scores of
    the keys where is_hist [B or 1, 1, S, 1] is set: one extra channel, bias·√d on the query side and the
    history flag on the key side (no [T, S] float mask: simulated decode at 8k context would need GBs)."""
    d = q.shape[-1]
    flag = is_hist.to(keys.dtype).expand(keys.shape[0], keys.shape[1], keys.shape[2], 1)
    return (torch.cat([q, (bias * d**0.5).to(q.dtype)], -1), torch.cat([keys, flag], -1), d**-0.5)


class TierPolicy(NamedTuple):
    """The one tier rule every tiered cache follows (dynamic, static, simulated, latent, RVQ).

    Positions [0, sinks) stay fp16 forever; after `tokens` tokens, blocks_at(tokens) blocks of `block`
    tokens after the sinks are encoded history; the rest (window ≤ n < window + block tokens) is the
    fp16 window. A block is encoded as soon as the window holds window + block tokens."""

    sinks: int
    window: int
    block: int

    def blocks_at(self, tokens: int) -> int:
        """History blocks after `tokens` tokens went through the cache."""
        return max(0, (tokens - self.sinks - self.window) // self.block) if tokens > self.sinks else 0

    def capacity(self, max_len: int) -> int:
        """History blocks a cache of max_len tokens can come to hold (at least 1, so buffers exist)."""
        return max(math.ceil(max(max_len - self.sinks - self.window, 0) / self.block), 1)

    def window_slots(self) -> int:
        """fp16 slots a static window needs: sinks + window + block (the step before an encode holds all)."""
        return self.sinks + self.window + self.block

    def fp16_tokens(self, tokens: int) -> int:
        """Tokens held in fp16 (sinks + window) after `tokens` tokens."""
        return tokens - self.blocks_at(tokens) * self.block


def static_bytes(codecs: list) -> int:
    """Bytes of the codecs' per-layer static tensors (scales, levels), counted once per cache."""
    return sum(t.numel() * t.element_size() for c in codecs for t in c.static_tensors().values())


class HistoryStore:
    """The encoded history of every layer, for both tiered caches: allocation ([B, K, n, ...] per codec
    field), the encode dispatch (the Triton quantize-pack kernel where it takes the codec, else
    codec.encode), pre-RoPE keys (un-rotated before encoding, rotated back after decoding), and an
    optional dequantized mirror for the torch attention path (a compute cache, not counted as stored)."""

    def __init__(self, args: ModelArgs, codecs: list, policy: TierPolicy, max_blocks: int, batch: int,
                 rope_pre: bool, device, mirror_dtype: torch.dtype | None = None):
        self.args, self.codecs, self.policy, self.rope_pre = args, codecs, policy, rope_pre
        self.max_blocks, self.batch, self.device = max_blocks, batch, torch.device(device)
        K, d, blk = args.n_kv_heads, args.head_dim, policy.block
        self.hist = {kind: [alloc_fields(c.fields(kind), batch, K, max_blocks, blk, self.device) for c in codecs]
                     for kind in "kv"}
        self.mirror = None if mirror_dtype is None else {
            kind: [torch.zeros(batch, K, max_blocks * blk, d, dtype=mirror_dtype, device=self.device)
                   for _ in codecs] for kind in "kv"}
        # blocks leaving the window: the quantize-pack kernel where the kernels run and it takes the codec
        self.fast_encode = kernels_enabled(self.device) and all(quantize_pack_supports(c) for c in codecs)

    def per_block(self, layer: int, kind: str, name: str) -> int:
        """Entries one block takes along a field's axis: `block` for token fields, 1 for block fields."""
        return self.policy.block if self.codecs[layer].fields(kind)[name][0] == "token" else 1

    def encode(self, layer: int, kind: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The codec's fields of x [M, K, block, d] (M blocks, each encoded alone)."""
        codec = self.codecs[layer]
        if self.fast_encode:
            from ..kernels.kv_quantize_pack import kv_quantize_pack

            return kv_quantize_pack(x.contiguous(), kind, codec.kernel_view(x.device))
        return codec.encode(x.float(), kind)

    def put(self, layer: int, kind: str, x: torch.Tensor, nb0: int, row: int | None = None) -> None:
        """Encode post-RoPE tokens into the history. row None: x [B, K, block, d] is block nb0 of every row
        (the dynamic cache); row r: x [n, K, block, d] are blocks nb0..nb0+n-1 of row r (the static cache)."""
        blk, codec = self.policy.block, self.codecs[layer]
        n, K = x.shape[0], x.shape[1]
        pos0 = self.policy.sinks + nb0 * blk
        pre = kind == "k" and self.rope_pre
        if pre and row is None:
            x = rotate(self.args, x.float(), pos0, inverse=True)
        elif pre:  # n consecutive blocks of one row: one run of positions
            x = rotate(self.args, x.float().transpose(0, 1).reshape(1, K, n * blk, -1), pos0, inverse=True)
            x = x.view(K, n, blk, -1).transpose(0, 1)
        enc = self.encode(layer, kind, x)
        for name, t in enc.items():
            per = self.per_block(layer, kind, name)
            if row is None:
                self.hist[kind][layer][name][:, :, nb0 * per : (nb0 + 1) * per] = t
            else:  # [n, K, per, ...] -> [K, n·per, ...]
                t = t.transpose(0, 1).reshape(K, n * per, *t.shape[3:])
                self.hist[kind][layer][name][row, :, nb0 * per : (nb0 + n) * per] = t
        if self.mirror is None:
            return
        y = codec.decode(enc, kind)
        if row is None:
            if pre:
                y = rotate(self.args, y, pos0, inverse=False)
            self.mirror[kind][layer][:, :, nb0 * blk : (nb0 + 1) * blk] = y
        else:
            y = y.transpose(0, 1).reshape(1, K, n * blk, -1)  # [1, K, n·block, d]
            if pre:
                y = rotate(self.args, y, pos0, inverse=False)
            self.mirror[kind][layer][row, :, nb0 * blk : (nb0 + n) * blk] = y[0]

    def fields(self, layer: int, kind: str, blocks: int) -> dict[str, torch.Tensor]:
        """The first `blocks` blocks of every field [B, K, blocks·per, ...] (views)."""
        return {n: t[:, :, : blocks * self.per_block(layer, kind, n)] for n, t in self.hist[kind][layer].items()}

    def decode(self, layer: int, kind: str, blocks: int) -> torch.Tensor:
        """The dequantized first `blocks` blocks [B, K, h, d] fp32 (post-RoPE keys), from the stored fields."""
        x = self.codecs[layer].decode(self.fields(layer, kind, blocks), kind)
        if kind == "k" and self.rope_pre and x.shape[2]:
            x = rotate(self.args, x, self.policy.sinks, inverse=False)
        return x

    def buffers(self):
        """Every history buffer [B, ...] (latency runs fill them with stand-in values)."""
        return [t for kind in "kv" for layer in self.hist[kind] for t in layer.values()]

    def row_block_bytes(self) -> int:
        """Bytes one history block of one row takes over all layers, K and V (from the buffers)."""
        return sum(t.element_size() * t[0].numel() // t.shape[2] * self.per_block(layer, kind, n)
                   for kind in "kv" for layer in range(len(self.codecs)) for n, t in self.hist[kind][layer].items())

    def static_bytes(self) -> int:
        return static_bytes(self.codecs)


class TieredKVCache:
    """The dynamic tiered cache (host-side lengths): `attend(layer, q, k, v, start_pos)` for prefill and
    decode, every row at the same length. The tier rule is TierPolicy, the history a HistoryStore."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, codecs: list, window: int = 128,
                 sinks: int = 4, block: int = 32, rope_pre: bool = False, device="cpu",
                 use_kernel: bool | None = None):
        assert len(codecs) == args.n_layers, (len(codecs), args.n_layers)
        assert window >= 0 and sinks >= 0 and block > 0, (window, sinks, block)
        self.args, self.batch, self.max_len = args, batch, max_len
        self.codecs, self.window, self.sinks, self.block, self.rope_pre = codecs, window, sinks, block, rope_pre
        self.policy = TierPolicy(sinks, window, block)
        self.device = torch.device(device)
        self.codec = codecs[0].name
        self.bits = codecs[0].bits
        B, K, d = batch, args.n_kv_heads, args.head_dim
        self.max_blocks = self.policy.capacity(max_len)
        self.win = {kind: [torch.zeros(B, K, 0, d, dtype=torch.float16, device=device)
                           for _ in range(args.n_layers)] for kind in "kv"}
        self.n_blocks = [0] * args.n_layers
        self.length = 0
        self.use_kernel = kernel_path(device, self.codec, d, block) if use_kernel is None else use_kernel
        self.store = HistoryStore(args, codecs, self.policy, self.max_blocks, batch, rope_pre, device,
                                  mirror_dtype=None if self.use_kernel else torch.float32)
        self.hist, self.mirror = self.store.hist, self.store.mirror
        # the decode kernels' `rope` argument for pre-RoPE keys (made here even when use_kernel is off: it may be
        # switched on later)
        self.rope_table = rope_table(args, sinks, self.device) if rope_pre else None
        self.rot = LayerRotations.of(codecs, self.device)

    def _alloc(self, fields: dict) -> dict[str, torch.Tensor]:
        return alloc_fields(fields, self.batch, self.args.n_kv_heads, self.max_blocks, self.block, self.device)

    # -- history ----------------------------------------------------------------------------------------

    def _rope(self, x: torch.Tensor, pos0: int, inverse: bool) -> torch.Tensor:
        return rotate(self.args, x, pos0, inverse)

    def history_fields(self, layer: int, kind: str, blocks: int | None = None) -> dict[str, torch.Tensor]:
        return self.store.fields(layer, kind, self.n_blocks[layer] if blocks is None else blocks)

    def decode_history(self, layer: int, kind: str) -> torch.Tensor:
        """The dequantized history [B, K, h, d] fp32 (post-RoPE keys), from the stored fields."""
        return self.store.decode(layer, kind, self.n_blocks[layer])

    def _encode_block(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        nb = self.n_blocks[layer]
        assert nb < self.max_blocks, (nb, self.max_blocks)
        for kind, x in (("k", k.float()), ("v", v.float())):
            self.store.put(layer, kind, x, nb)
        self.n_blocks[layer] = nb + 1

    # -- the cache interface ----------------------------------------------------------------------------

    def attend(self, layer: int, q, k, v, start_pos: int) -> torch.Tensor:
        """q: [B, H, T, d]; k, v: [B, K, T, d] at positions start_pos.. -> [B, H, T, d]."""
        if self.rot is not None:
            return self.rot.attend(self._attend, layer, q, k, v, start_pos)
        return self._attend(layer, q, k, v, start_pos)

    def _attend(self, layer: int, q, k, v, start_pos: int) -> torch.Tensor:
        T = k.shape[2]
        wk, wv, s, h = self._append(layer, k, v, start_pos)
        if T == 1 and self.use_kernel:
            out = self._attend_kernel(layer, q, wk, wv)
        else:
            keys, vals = self._keys_values(layer, wk, wv, s, h, q.dtype)
            bias = history_bias(self.codecs[layer], q)
            if bias is None:
                out = causal_attention(q, keys, vals, start_pos)
            else:
                pos = torch.arange(keys.shape[2], device=q.device)
                is_hist = ((pos >= s) & (pos < s + h))[None, None, :, None]
                q2, keys2, scale = biased_scores(q, keys, is_hist, bias)
                out = causal_attention(q2, keys2, vals, start_pos, scale=scale)
        self._age(layer, wk, wv, s, start_pos + T)
        return out

    def _append(self, layer: int, k, v, start_pos: int):
        """The layer's fp16 sinks + window with the new tokens k, v [B, K, T, d] appended (not yet stored):
        (wk, wv, s, h), s the sinks held, h the history tokens."""
        T = k.shape[2]
        h = self.n_blocks[layer] * self.block
        held = self.win["k"][layer].shape[2]
        assert start_pos == held + h, (start_pos, held, h)
        assert start_pos + T <= self.max_len, (start_pos, T, self.max_len)
        wk = torch.cat([self.win["k"][layer], k.half()], dim=2)
        wv = torch.cat([self.win["v"][layer], v.half()], dim=2)
        return wk, wv, min(self.sinks, wk.shape[2]), h

    def _keys_values(self, layer: int, wk, wv, s: int, h: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, K, s + h + n, d] in position order: sinks, dequantized history, window."""
        if self.mirror is not None:
            hk, hv = self.mirror["k"][layer][:, :, :h], self.mirror["v"][layer][:, :, :h]
        else:
            hk, hv = self.decode_history(layer, "k"), self.decode_history(layer, "v")
        keys = torch.cat([wk[:, :, :s].to(dtype), hk.to(dtype), wk[:, :, s:].to(dtype)], dim=2)
        vals = torch.cat([wv[:, :, :s].to(dtype), hv.to(dtype), wv[:, :, s:].to(dtype)], dim=2)
        return keys, vals

    def _age(self, layer: int, wk, wv, s: int, tokens: int) -> None:
        """Store the window after `tokens` tokens, moving whole blocks of its oldest (non-sink) tokens into the
        history (TierPolicy), then the subclass's `_aged` hook."""
        target = self.policy.blocks_at(tokens)
        while self.n_blocks[layer] < target:
            self._encode_block(layer, wk[:, :, s : s + self.block], wv[:, :, s : s + self.block])
            wk = torch.cat([wk[:, :, :s], wk[:, :, s + self.block :]], dim=2)
            wv = torch.cat([wv[:, :, :s], wv[:, :, s + self.block :]], dim=2)
        self.win["k"][layer], self.win["v"][layer] = wk, wv
        if layer == self.args.n_layers - 1:
            self.length = tokens
        self._aged(layer, tokens)

    def _aged(self, layer: int, tokens: int) -> None:
        """Work after the window aged (the RVQ cache archives old blocks here)."""

    def read_append(self, layer: int, k, v, start_pos: int, dtype) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """For callers that attend themselves (transformers' Cache.update, moec/hf/cache.py): store k, v
        [B, K, T, d] (post-RoPE, positions start_pos..) as `attend` would and return what `attend` attends
        over, (keys, values [B, K, start_pos + T, d] in `dtype`, in position order, and (s, h): the history
        occupies key positions [s, s + h)). With head_dim rotations the cache stores k·R, v·R: the keys and
        values come back rotated by Rᵀ (q·k and p·v are unchanged by an orthogonal R, so attending over them
        equals attending in the rotated basis up to rounding). A codec with a history score bias
        (nuq-outlier `score_bias`) needs it added to the scores of [s, s + h): `history_bias(codecs[layer], q)`."""
        R = self.rot.get(layer, torch.float32) if self.rot is not None else None
        if R is not None:
            k, v = k.float() @ R, v.float() @ R
        wk, wv, s, h = self._append(layer, k, v, start_pos)
        keys, vals = self._keys_values(layer, wk, wv, s, h, torch.float32 if R is not None else dtype)
        self._age(layer, wk, wv, s, start_pos + k.shape[2])
        if R is not None:
            keys, vals = (keys @ R.T).to(dtype), (vals @ R.T).to(dtype)
        return keys, vals, (s, h)

    def _attend_kernel(self, layer: int, q, wk, wv) -> torch.Tensor:
        """One decode step of a nuq-outlier cache through the fused kernel (moec/kernels/kv_decode_attention.py;
        subclasses with other codecs override this). Pre-RoPE history keys are rotated in the kernel, history
        token t at position sinks + t. q [B, H, 1, d]; wk, wv [B, K, n, d] fp16 window (sinks first) ->
        [B, H, 1, d] in q.dtype."""
        from ..kernels.kv_decode_attention import kv_decode_attention

        codec = self.codecs[layer]
        view = codec.kernel_view(q.device)
        hk, hv = self.hist["k"][layer], self.hist["v"][layer]
        B = q.shape[0]
        dev = q.device
        if view.n_out:
            koi, kov, voi, vov = hk["out_idx"], hk["out_val"], hv["out_idx"], hv["out_val"]
        else:
            z = torch.zeros(B, wk.shape[1], self.max_blocks, 0, device=dev)
            koi = voi = z.to(torch.int16)
            kov = vov = z.half()
        hist_len = torch.full((B,), self.n_blocks[layer] * self.block, dtype=torch.int32, device=dev)
        win_len = torch.full((B,), wk.shape[2], dtype=torch.int32, device=dev)
        out = kv_decode_attention(q[:, :, 0].contiguous(), hk["codes"], hv["codes"], view.k_scale, hv["scale"],
                                  view.k_levels, view.v_levels, koi, kov, voi, vov, hist_len, wk.contiguous(),
                                  wv.contiguous(), win_len, view.bits, self.block,
                                  rope=self.rope_table if self.rope_pre else None, k_center=view.k_center,
                                  k_err2=view.k_err2)
        return out[:, :, None].to(q.dtype)

    # -- bytes ------------------------------------------------------------------------------------------

    def _static_bytes(self) -> int:
        return self.store.static_bytes()

    def _block_bytes(self) -> int:
        """Bytes one history block takes over all layers, K and V, the whole batch (from the buffers)."""
        return self.batch * self.store.row_block_bytes()

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
        """History blocks after `tokens` tokens went through the cache (TierPolicy, the eviction rule of `attend`)."""
        return self.policy.blocks_at(tokens)

    def bits_at(self, tokens: int) -> float:
        """Effective bits projected to `tokens`, by the stored-byte formula of `stored_bytes`."""
        nb = self.blocks_at(tokens)
        n = nb * self._block_bytes() + self.policy.fp16_tokens(tokens) * self._fp16_token_bytes() + self._static_bytes()
        return 8.0 * n / self._elements(tokens)


def build_codecs(section: dict, tensors: dict[str, torch.Tensor], args: ModelArgs) -> list:
    """Per-layer block codecs from a packed checkpoint's `kv` section and `kv.*` tensors, by the codec's
    registered `layer_codecs` hook (moec/registry.py).

    Raises FormatError when the calibration does not match the model's layer/head shapes, or when the
    codec has no tiered block codec."""
    from ..errors import FormatError
    from ..registry import kv_codec

    L, K, d = args.n_layers, args.n_kv_heads, args.head_dim
    if (section.get("n_layers"), section.get("n_kv_heads"), section.get("head_dim")) != (L, K, d):
        raise FormatError(f"KV calibration is for {section.get('n_layers')} layers × {section.get('n_kv_heads')} "
                          f"KV heads × head_dim {section.get('head_dim')}, the model has {L} × {K} × {d}")
    spec = kv_codec(section["codec"])
    if not spec.tiered:
        raise FormatError(f"KV codec {section['codec']!r} has no tiered block codec")
    return spec.hook("layer_codecs")(section, tensors, args)


def rope_pre(section: dict) -> bool:
    """Whether the codec encodes keys before RoPE (its registered `rope_pre` hook; False without one)."""
    from ..registry import kv_codec

    spec = kv_codec(section["codec"])
    return bool(spec.rope_pre is not None and spec.hook("rope_pre")(section))


def tiered_cache_factory(section: dict, codecs: list, simulated: bool = False, use_kernel: bool | None = None):
    """(model, batch, max_len) -> TieredKVCache, the `cache_factory` of moec.runtime.perplexity.evaluate
    (or, `simulated`, the one-forward-per-window SimulatedTieredCache of moec/runtime/kvsim.py);
    use_kernel=False keeps the dequantize-then-attend torch path on CUDA (the oracle of GPU checks)."""

    pre = rope_pre(section)

    def make(model, batch: int, max_len: int):
        dev = model.tok_embeddings.weight.device
        if simulated:
            from .kvsim import SimulatedTieredCache

            return SimulatedTieredCache(model.args, batch, max_len, codecs, section["window"], section["sinks"],
                                        section["block"], pre)
        return TieredKVCache(model.args, batch, max_len, codecs, window=section["window"], sinks=section["sinks"],
                             block=section["block"], rope_pre=pre, device=dev, use_kernel=use_kernel)

    return make
