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

One class, every mode (moec/runtime/kvcache.py lists the families and modes): TieredKVCache runs dynamic
(host-side lengths: eval, generate, the transformers Cache), static (device-side positions: the CUDA-graph
engine of runtime/decode.py) and simulated (one teacher-forced forward per window, exact when the prefill
evicts nothing: benchmarks/bench_kv_sim_check.py checks it against decode mode). Every mode uses one tier
rule, `TierPolicy` (which tokens are sinks, history blocks or window after n tokens; capacity; fp16 slots),
one history store, `HistoryStore` (field buffers, encode dispatch, pre-RoPE rotation, the torch path's
mirror, byte counts), and one ageing function, `TieredKVCache._age` (window blocks into the history, then
the family's `_aged`, e.g. the RVQ archive). The latent (latent.py) and RVQ (rvq.py) families subclass it.
Any registered block codec (moec/registry.py `layer_codecs`) runs in every mode; a codec declaring
`fused_decode_attention` (nuq-outlier) takes the fused kernels where they run.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .backend import gluon_enabled, gluon_forced, kernels_enabled
from .config import ModelArgs
from .kvcache import MODES, FP16Cache, LayerSplitCache, causal_attention, layer_subset, sdpa
from .model import apply_rope, rope_cos_sin, rope_inv_freq
from .nuq import quantize_pack_supports


def rope_table(args: ModelArgs, sinks: int, device) -> tuple[torch.Tensor, int]:
    """The decode kernels' `rope` argument for a pre-RoPE history whose token t sits at position sinks + t:
    (inv_freq [d/2] fp32 contiguous on `device`, sinks). Caches make it once, in their constructor."""
    return rope_inv_freq(args, device).float().contiguous(), sinks


def kernel_path(device, codec, head_dim: int, block: int) -> bool:
    """Whether decode steps of a cache of block codec `codec` go through the fused kernel by default: the codec
    declares `fused_decode_attention` (moec/kernels/kv_decode_attention.py takes its fields), within the
    kernel's shape limits (power-of-two head_dim >= 64 and block >= 16), where backend.kernels_enabled says so
    (CUDA by default)."""
    d = head_dim
    return bool(getattr(codec, "fused_decode_attention", False) and d >= 64 and d & (d - 1) == 0 and block >= 16
                and block & (block - 1) == 0 and kernels_enabled(device))


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


def decode_attention(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval, v_oidx, v_oval, hist_len,
                     win_k, win_v, win_len, bits: int, block: int, rope=None, k_center=None, k_err2=None,
                     out_rotation=None, out_dtype: torch.dtype = torch.float32, sinks=None) -> torch.Tensor:
    """Decode attention over the tiered cache's packed history and window: the Gluon kernel
    (kernels/gluon_kv_attention.py) where it serves the cache on CUDA (2-bit, no sparse outliers, post-RoPE,
    head_dim 128) and was measured faster (batch · history capacity >= the config's min_batch_tokens, or
    MOEC_KERNELS=gluon); MOEC_KERNELS=tl turns it off. Else the `tl` kernel (kernels/kv_decode_attention.py).
    Same arguments and result as kv_decode_attention (sinks [H]: gpt-oss's logits, added in the split combine)."""
    from ..kernels import gluon_kv_attention as gka
    from ..kernels.kv_decode_attention import kv_decode_attention

    B, H, d = q.shape
    K, S = k_codes.shape[1], k_codes.shape[2]
    if (gluon_enabled(q.device) and gka.supports(bits, k_oidx.shape[-1], rope, d, H // K)
            and (gluon_forced() or gka.faster(B, S, q.device))):
        return gka.gluon_kv_attention(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, hist_len, win_k, win_v,
                                      win_len, k_center=k_center, k_err2=k_err2, out_rotation=out_rotation,
                                      out_dtype=out_dtype, sinks=sinks)
    return kv_decode_attention(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval, v_oidx, v_oval,
                               hist_len, win_k, win_v, win_len, bits, block, rope=rope, k_center=k_center,
                               k_err2=k_err2, out_rotation=out_rotation, out_dtype=out_dtype, sinks=sinks)


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

    def put(self, layer: int, kind: str, x: torch.Tensor, nb0: int, rows: slice = slice(None)) -> None:
        """Encode post-RoPE tokens into the history: x [b, K, n·block, d] are blocks nb0..nb0+n-1 of `rows`
        (b rows; each block encoded alone, so n blocks of one row and one block of b rows encode alike)."""
        blk, codec = self.policy.block, self.codecs[layer]
        b, K, T = x.shape[0], x.shape[1], x.shape[2]
        n = T // blk
        pos0 = self.policy.sinks + nb0 * blk
        pre = kind == "k" and self.rope_pre
        if pre:  # n consecutive blocks: one run of positions
            x = rotate(self.args, x.float(), pos0, inverse=True)
        enc = self.encode(layer, kind, x.reshape(b, K, n, blk, -1).transpose(1, 2).reshape(b * n, K, blk, -1))
        for name, t in enc.items():
            per = self.per_block(layer, kind, name)
            t = t.reshape(b, n, K, per, *t.shape[3:]).transpose(1, 2).reshape(b, K, n * per, *t.shape[3:])
            self.hist[kind][layer][name][rows, :, nb0 * per : (nb0 + n) * per] = t
        if self.mirror is None:
            return
        y = codec.decode(enc, kind)  # [b·n, K, block, d]
        y = y.reshape(b, n, K, blk, -1).transpose(1, 2).reshape(b, K, n * blk, -1)
        if pre:
            y = rotate(self.args, y, pos0, inverse=False)
        self.mirror[kind][layer][rows, :, nb0 * blk : (nb0 + n) * blk] = y

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


class WindowSlots:
    """The static mode's slot of the new token in a compact fp16 window (sinks first, then the window): pos −
    hist_len, the same in every layer of a step. For caches with `pos` (the engine's positions) and `hist_len`
    (history tokens per row): TieredKVCache and mla_nuq.MLANUQCache."""

    def begin_step(self, b: int) -> None:
        """The engine opens a step of rows [0, b): the window slot and length of the new token are the same in
        every layer, so they are computed once here, not per layer (3 tiny integer kernels per layer were
        ~0.2 ms of a 4.4 ms Qwen3 step). end_step drops them, so no later step reads stale positions."""
        slot = self.pos[:b] - self.hist_len[:b]
        self._step_slots = (b, slot, (slot + 1).to(torch.int32))

    def end_step(self) -> None:
        self._step_slots = None

    def _slots(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot [b] int64, win_len [b] int32) of the new token: the step's, or computed here outside one."""
        cached = getattr(self, "_step_slots", None)
        if cached is not None and cached[0] == b:
            return cached[1], cached[2]
        slot = self.pos[:b] - self.hist_len[:b]  # [b] window slot of the new token
        return slot, (slot + 1).to(torch.int32)


class TieredKVCache(WindowSlots):
    """The tiered cache of every registered block codec, in any mode (moec/runtime/kvcache.py):

    dynamic    host-side lengths, every row at the same length: `attend(layer, q, k, v, start_pos)` for prefill
               and decode; the window of a layer is a tensor [B, K, n, d] that grows by the new tokens and
               loses whole blocks as they are encoded; `n_blocks[layer]`, `length` an int
    static     the CUDA-graph engine (runtime/decode.DecodeEngine): one token per row per step at device
               positions `pos`; the window is a buffer of sinks + window + block slots per row, kept compact;
               the step is graph-safe (decode.py); `n_blocks[row]`, `length[row]`, `hist_len` [B] int32
    simulated  one teacher-forced forward per window giving each query the keys/values the dynamic mode
               holds at its step (`_attend_simulated`)
    The tier rule is TierPolicy, the history a HistoryStore, and the ageing of the window into the history
    (and the family's later tiers, `_aged`) is the one function `_age`, in every mode. `read_append` and
    `attend_history` serve callers that attend themselves (the transformers Cache, moec/hf/cache.py), for
    families whose every query sees the same view in position order (`position_order_view`)."""

    # read_append's keys/values in position order are what every query attends over (a family attending per
    # query over another view, as the latent groups do, sets it False: moec/hf refuses it)
    position_order_view = True

    def __init__(self, args: ModelArgs, batch: int, max_len: int, codecs: list, window: int,
                 sinks: int = 4, block: int = 32, rope_pre: bool = False, device="cpu",
                 use_kernel: bool | None = None, mode: str = "dynamic", mirror_dtype=torch.float32,
                 prefill: int = 32):
        assert mode in MODES, mode
        assert len(codecs) == args.n_layers, (len(codecs), args.n_layers)
        # window, sinks and block come validated from the recipe's config (moec/codecs/base.py TieredConfig)
        self.args, self.batch, self.max_len, self.mode = args, batch, max_len, mode
        self.codecs, self.window, self.sinks, self.block, self.rope_pre = codecs, window, sinks, block, rope_pre
        self.policy = TierPolicy(sinks, window, block)
        self.device = torch.device(device)
        self.codec, self.bits = codecs[0].name, codecs[0].bits
        B, K, d = batch, args.n_kv_heads, args.head_dim
        self.max_blocks = self.policy.capacity(max_len)
        if mode == "simulated":  # attends over the dequantized mirror: never the kernels
            assert sinks + window + block > prefill, "the prefill would evict blocks; simulation not exact"
            use_kernel = False
        self.use_kernel = kernel_path(device, codecs[0], d, block) if use_kernel is None else use_kernel
        # the history (and, on the torch path, its dequantized mirror): a HistoryStore, or a family's own
        self.store = self._make_store(None if self.use_kernel else mirror_dtype)
        self.hist, self.mirror = self.store.hist, self.store.mirror
        # the decode kernels' `rope` argument for pre-RoPE keys (history token t at position sinks + t; made here
        # even when use_kernel is off: it may be switched on later)
        self.rope_table = rope_table(args, sinks, self.device) if rope_pre else None
        self.rot = LayerRotations.of(codecs, self.device)  # head_dim rotations (nuq-outlier rotate: hadamard)
        self.groups = self._layer_groups()  # layers encoded together (one each for block codecs)
        self.group_of = {i: g for g, layers in enumerate(self.groups) for i in layers}
        if mode != "static":
            self.win = {kind: [torch.zeros(B, K, 0, d, dtype=torch.float16, device=device)
                               for _ in range(args.n_layers)] for kind in "kv"}
            self.n_blocks = [0] * args.n_layers
            self.length: int | list[int] = 0
            return
        self.wcap = self.policy.window_slots()
        self.win = {kind: [torch.zeros(B, K, self.wcap, d, dtype=torch.float16, device=device)
                           for _ in range(args.n_layers)] for kind in "kv"}
        self.hist_len = torch.zeros(B, dtype=torch.int32, device=device)  # tokens in the history per row
        self.n_blocks = [0] * B
        self.length = [0] * B
        self.rows = torch.arange(B, device=device)
        self.pos: torch.Tensor | None = None  # [B] int64, the engine's position buffer
        self._pending: dict[tuple[int, int], dict] = {}  # (row, layer) -> prompt blocks awaiting their group
        if self.use_kernel:
            # the codecs' device tensors (codec.kernel_view, made once per codec), taken here, outside any capture
            self.views = [c.kernel_view(self.device) for c in codecs]
            if not codecs[0].n_out:  # the kernel takes (empty) outlier tensors all the same
                z = torch.zeros(B, K, self.max_blocks, 0, device=device)
                self.no_out = (z.to(torch.int16), z.half())
        else:
            self.wslots = torch.arange(self.wcap, device=device)
            self.hslots = torch.arange(self.max_blocks * block, device=device)

    def _make_store(self, mirror_dtype) -> HistoryStore:
        return HistoryStore(self.args, self.codecs, self.policy, self.max_blocks, self.batch, self.rope_pre,
                            self.device, mirror_dtype=mirror_dtype)

    def _layer_groups(self) -> list[list[int]]:
        return [[i] for i in range(self.args.n_layers)]

    # -- history ----------------------------------------------------------------------------------------

    def _rope(self, x: torch.Tensor, pos0: int, inverse: bool) -> torch.Tensor:
        return rotate(self.args, x, pos0, inverse)

    def history_fields(self, layer: int, kind: str, blocks: int | None = None) -> dict[str, torch.Tensor]:
        """The stored fields of the history blocks (dynamic mode: the layer's; pass `blocks` in static mode)."""
        return self.store.fields(layer, kind, self.n_blocks[layer] if blocks is None else blocks)

    def decode_history(self, layer: int, kind: str) -> torch.Tensor:
        """The dequantized history [B, K, h, d] fp32 (post-RoPE keys), from the stored fields (dynamic mode)."""
        return self.store.decode(layer, kind, self.n_blocks[layer])

    def _encode_group(self, rows: slice, layers: list[int], xs: dict, nb0: int) -> None:
        """Encode xs[layer][kind] [b, K, n·block, d] (n consecutive blocks of the b `rows`) as history blocks
        nb0.. of one layer group (a block codec: one layer; latent-layer: the layers sharing a basis)."""
        for layer in layers:
            for kind in "kv":
                self.store.put(layer, kind, xs[layer][kind], nb0, rows)

    def _age(self, rows: slice, groups: list[list[int]], tokens: int, later_tiers: bool = True) -> None:
        """The one ageing rule of every mode: after `tokens` tokens in `rows` (dynamic and simulated: every row,
        one layer per call; static: one row, every group), move whole blocks of the oldest non-sink window
        tokens into the history until TierPolicy.blocks_at(tokens) blocks are held, one block at a time (each
        encoded alone), then (later_tiers) the family's later tiers (`_aged`). The window holds
        tokens − n_blocks·block slots, sinks first."""
        s, blk = self.sinks, self.block
        static = self.mode == "static"
        nb = self.n_blocks[rows.start] if static else self.n_blocks[groups[0][0]]
        while nb < self.policy.blocks_at(tokens):
            assert nb < self.max_blocks, (nb, self.max_blocks)
            held = tokens - nb * blk  # window slots in use, sinks included
            for layers in groups:
                self._encode_group(rows, layers, {i: {kind: self.win[kind][i][rows, :, s : s + blk] for kind in "kv"}
                                                  for i in layers}, nb)
                for i in layers:
                    for kind in "kv":
                        w = self.win[kind][i]
                        if static:  # the fixed slots of the row shift down by one block
                            w[rows, :, s : held - blk] = w[rows, :, s + blk : held].clone()
                        else:
                            self.win[kind][i] = torch.cat([w[:, :, :s], w[:, :, s + blk :]], dim=2)
            nb += 1
            if static:
                self.n_blocks[rows.start] = nb
                self.hist_len[rows] = nb * blk
            else:
                for layers in groups:
                    for i in layers:
                        self.n_blocks[i] = nb
        if later_tiers:
            self._aged(rows, groups, tokens)

    def _aged(self, rows: slice, groups: list[list[int]], tokens: int) -> None:
        """Work after the window aged (the RVQ cache archives old blocks here)."""

    # -- the cache interface ----------------------------------------------------------------------------

    def attend(self, layer: int, q, k, v, start_pos=None, sinks=None) -> torch.Tensor:
        """q: [B, H, T, d]; k, v: [B, K, T, d] at positions start_pos.. (static: one token at `pos`) ->
        [B, H, T, d]. Head_dim rotations wrap every path but the static kernel's, which rotates itself.
        sinks [H]: gpt-oss's logits in every query's softmax denominator (model.sdpa; the kernels' combine)."""
        if self.mode == "static":
            if self.use_kernel:
                return self._step_kernel(layer, q, k, v, sinks)
            fn = self._step_torch
        else:
            fn = self._attend_simulated if self.mode == "simulated" else self._attend
        if sinks is not None:
            fn = functools.partial(fn, sinks=sinks)
        if self.rot is not None:
            return self.rot.attend(fn, layer, q, k, v, start_pos)
        return fn(layer, q, k, v, start_pos)

    # -- dynamic mode -------------------------------------------------------------------------------------

    def _attend(self, layer: int, q, k, v, start_pos: int, sinks=None) -> torch.Tensor:
        T = k.shape[2]
        wk, wv, s, h = self._append(layer, k, v, start_pos)
        if T == 1 and self.use_kernel:
            out = self._attend_kernel(layer, q, wk, wv, **({} if sinks is None else {"sinks": sinks}))
        else:
            keys, vals = self._keys_values(layer, wk, wv, s, h, q.dtype)
            out = self.attend_history(layer, q, keys, vals, s, h, start_pos, sinks=sinks)
        self._store_window(layer, wk, wv, start_pos + T)
        return out

    def attend_history(self, layer: int, q, keys, vals, s: int, h: int, start_pos: int, attn_mask=None,
                       q_rotated: bool = True, sinks=None):
        """Attention of q [B, H, T, d] (positions start_pos..) over keys/values [B, K, S, d] in position order whose
        [s, s + h) is the layer's history (`read_append`'s view): adds the codec's history score bias where it
        has one (nuq-outlier `score_bias`); causal unless attn_mask (an SDPA mask) is given. The bias is a function
        of q in the codec's basis: q_rotated False (read_append's callers, whose q and keys are in the model's
        basis) rotates a copy of q for it."""
        qc = q if q_rotated or self.rot is None else q @ self.rot.get(layer, q.dtype)
        bias = history_bias(self.codecs[layer], qc)
        scale = None
        if bias is not None:
            pos = torch.arange(keys.shape[2], device=q.device)
            is_hist = ((pos >= s) & (pos < s + h))[None, None, :, None]
            q, keys, scale = biased_scores(q, keys, is_hist, bias)
        if attn_mask is None:
            return causal_attention(q, keys, vals, start_pos, scale=scale, sinks=sinks)
        return sdpa(q, keys, vals, attn_mask, scale, None if sinks is None else sinks.view(-1, 1))

    def history_biased(self, layer: int) -> bool:
        """Whether the layer's history scores carry a bias (`attend_history` adds it; keys alone cannot)."""
        return getattr(self.codecs[layer], "k_err2", None) is not None

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

    def _store_window(self, layer: int, wk, wv, tokens: int) -> None:
        """Keep the layer's window after `tokens` tokens and age it (`_age`)."""
        self.win["k"][layer], self.win["v"][layer] = wk, wv
        if layer == self.args.n_layers - 1:
            self.length = tokens
        self._age(slice(None), [[layer]], tokens)

    def _keys_values(self, layer: int, wk, wv, s: int, h: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, K, s + h + n, d] in position order: sinks, dequantized history, window."""
        if self.mirror is not None:
            hk, hv = self.mirror["k"][layer][:, :, :h], self.mirror["v"][layer][:, :, :h]
        else:
            hk, hv = self.decode_history(layer, "k"), self.decode_history(layer, "v")
        keys = torch.cat([wk[:, :, :s].to(dtype), hk.to(dtype), wk[:, :, s:].to(dtype)], dim=2)
        vals = torch.cat([wv[:, :, :s].to(dtype), hv.to(dtype), wv[:, :, s:].to(dtype)], dim=2)
        return keys, vals

    def read_append(self, layer: int, k, v, start_pos: int, dtype) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """For callers that attend themselves (transformers' Cache.update, moec/hf/cache.py): store k, v
        [B, K, T, d] (post-RoPE, positions start_pos..) as `attend` would and return what `attend` attends
        over, (keys, values [B, K, start_pos + T, d] in `dtype`, in position order, and (s, h): the history
        occupies key positions [s, s + h)). With head_dim rotations the cache stores k·R, v·R: the keys and
        values come back rotated by Rᵀ (q·k and p·v are unchanged by an orthogonal R, so attending over them
        equals attending in the rotated basis up to rounding). A codec with a history score bias
        (nuq-outlier `score_bias`) needs it added to the scores of [s, s + h): `history_bias(codecs[layer], q)`."""
        assert self.mode == "dynamic", self.mode
        R = self.rot.get(layer, torch.float32) if self.rot is not None else None
        if R is not None:
            k, v = k.float() @ R, v.float() @ R
        wk, wv, s, h = self._append(layer, k, v, start_pos)
        keys, vals = self._keys_values(layer, wk, wv, s, h, torch.float32 if R is not None else dtype)
        self._store_window(layer, wk, wv, start_pos + k.shape[2])
        if R is not None:
            keys, vals = (keys @ R.T).to(dtype), (vals @ R.T).to(dtype)
        return keys, vals, (s, h)

    def _attend_kernel(self, layer: int, q, wk, wv, sinks=None) -> torch.Tensor:
        """One decode step of a codec with `fused_decode_attention` through the fused kernel
        (decode_attention; families with other kernels override this). Pre-RoPE history
        keys are rotated in the kernel, history token t at position sinks + t. q [B, H, 1, d]; wk, wv
        [B, K, n, d] fp16 window (sinks first) -> [B, H, 1, d] in q.dtype."""
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
        out = decode_attention(q[:, :, 0].contiguous(), hk["codes"], hv["codes"], view.k_scale, hv["scale"],
                               view.k_levels, view.v_levels, koi, kov, voi, vov, hist_len, wk.contiguous(),
                               wv.contiguous(), win_len, view.bits, self.block,
                               rope=self.rope_table if self.rope_pre else None, k_center=view.k_center,
                               k_err2=view.k_err2, sinks=sinks)
        return out[:, :, None].to(q.dtype)

    # -- simulated mode -----------------------------------------------------------------------------------

    def _history_blocks(self, layer: int, kf: torch.Tensor, vf: torch.Tensor) -> tuple:
        """Simulated mode: age a whole window's fp16 keys/values kf, vf [B, K, S, d] through `_age` (the blocks
        every query up to S sees in the history, encoded one at a time as in decode mode; the family's later
        tiers not yet) and return their dequantized copies at the same positions (zeros elsewhere):
        (kq, vq) [B, K, S, d] in kf's dtype."""
        s, blk, S = self.sinks, self.block, kf.shape[2]
        self.n_blocks[layer] = 0
        empty = self.win["k"][layer]
        self.win["k"][layer], self.win["v"][layer] = kf, vf
        self._age(slice(None), [[layer]], S, later_tiers=False)
        self.win["k"][layer] = self.win["v"][layer] = empty  # nothing is held between windows
        h = self.n_blocks[layer] * blk
        kq, vq = torch.zeros_like(kf), torch.zeros_like(vf)
        kq[:, :, s : s + h] = self.mirror["k"][layer][:, :, :h].to(kf.dtype)
        vq[:, :, s : s + h] = self.mirror["v"][layer][:, :, :h].to(vf.dtype)
        return kq, vq

    def _attend_simulated(self, layer: int, q, k, v, start_pos: int, sinks=None) -> torch.Tensor:
        """One forward over whole windows [B, S] (start_pos 0) that reproduces decode mode: per layer, every block
        that will ever be evicted is encoded and decoded, and query i sees key j in fp16 if j is a sink or in
        i's window, in its decoded form if j lies in one of the blocks_at(i) history blocks (causal: j ≤ i).
        Equal to the dynamic mode up to float summation order, provided the prompt prefill evicts nothing
        (asserted at construction). benchmarks/bench_kv_sim_check.py checks it against decode mode."""
        assert start_pos == 0, "simulated decode runs one forward per window"
        B, H, S, d = q.shape
        kf, vf = k.half().to(q.dtype), v.half().to(q.dtype)  # what the cache stores
        pos = torch.arange(S, device=q.device)
        causal = pos[None, :] <= pos[:, None]  # [S(query), S(key)]
        if layer == self.args.n_layers - 1:
            self.length = S
        sk = None if sinks is None else sinks.view(-1, 1)
        if self.blocks_at(S) == 0:
            return sdpa(q, kf, vf, causal, sinks=sk)
        s, blk = self.sinks, self.block
        kq, vq = self._history_blocks(layer, kf, vf)
        hist_end = s + torch.tensor([self.blocks_at(i) for i in range(S)], device=q.device) * blk  # per query
        in_hist = (pos[None, :] >= s) & (pos[None, :] < hist_end[:, None])  # [S, S]
        mask = torch.cat([causal & ~in_hist, in_hist], dim=1)  # fp16 keys, then quantized keys
        keys, vals = torch.cat([kf, kq], 2), torch.cat([vf, vq], 2)
        bias = history_bias(self.codecs[layer], q)
        if bias is not None:  # the quantized copies are the second half of the keys
            is_hist = (torch.arange(2 * S, device=q.device) >= S)[None, None, :, None]
            q, keys, scale = biased_scores(q, keys, is_hist, bias)
            # values padded to the keys' d + 1 channels: with value and key head dims unequal, CPU SDPA takes a
            # path ~4x slower (2 × 8192 simulated decode: ~40 instead of ~10 min); the zero channel is dropped
            vals = F.pad(vals, (0, 1))
            return sdpa(q, keys, vals, mask, scale, sk)[..., :-1]
        return sdpa(q, keys, vals, mask, sinks=sk)

    # -- static mode: the step (graph-safe: no host reads of device values, nothing allocated) -----------

    def _step_kernel(self, layer: int, q, k, v, sinks=None) -> torch.Tensor:
        """The fused path: one kernel rotates q, k, v and writes the window (kernels/kv_window_write.py), the
        decode-attention kernel reads the packed history and the window, and the output is rotated back."""
        from ..kernels.kv_window_write import rotate_write_window

        b = q.shape[0]
        slot, win_len = self._slots(b)
        wk, wv = self.win["k"][layer], self.win["v"][layer]
        R = self.rot.get(layer, torch.float32) if self.rot is not None else None
        qr = rotate_write_window(q[:, :, 0], k[:, :, 0].to(q.dtype), v[:, :, 0].to(q.dtype), R, wk, wv, slot)
        hk, hv = self.hist["k"][layer], self.hist["v"][layer]
        if self.codecs[layer].n_out:
            koi, kov, voi, vov = hk["out_idx"][:b], hk["out_val"][:b], hv["out_idx"][:b], hv["out_val"][:b]
        else:
            koi = voi = self.no_out[0][:b]
            kov = vov = self.no_out[1][:b]
        view = self.views[layer]
        out = decode_attention(qr, hk["codes"][:b], hv["codes"][:b], view.k_scale,
                               hv["scale"][:b], view.k_levels, view.v_levels, koi, kov, voi, vov,
                               self.hist_len[:b], wk[:b], wv[:b], win_len,
                               self.codecs[layer].bits, self.block, rope=self.rope_table,
                               k_center=view.k_center, k_err2=view.k_err2, out_rotation=R,
                               out_dtype=q.dtype, sinks=sinks)  # [b, H, d], rotated back
        return out[:, :, None]

    def _step_torch(self, layer: int, q, k, v, start_pos=None, sinks=None) -> torch.Tensor:
        b, H, _, d = q.shape
        K = k.shape[1]
        rows = self.rows[:b]
        slot = self.pos[:b] - self.hist_len[:b]  # [b] window slot of the new token
        wk, wv = self.win["k"][layer], self.win["v"][layer]
        wk[rows, :, slot] = k[:, :, 0].half()
        wv[rows, :, slot] = v[:, :, 0].half()
        win_len = slot + 1
        hk, hv = self.mirror["k"][layer][:b], self.mirror["v"][layer][:b]
        keys = torch.cat([wk[:b].to(q.dtype), hk.to(q.dtype)], dim=2)  # [b, K, wcap + S, d]
        vals = torch.cat([wv[:b].to(q.dtype), hv.to(q.dtype)], dim=2)
        mask = torch.cat([self.wslots[None, :] < win_len[:, None],
                          self.hslots[None, :] < self.hist_len[:b, None]], dim=1)[:, None, None, :]
        sk = None if sinks is None else sinks.view(K, H // K)
        bias = history_bias(self.codecs[layer], q)
        if bias is not None:  # [b, H, 1, 1] -> per KV head's query group, as q is viewed below
            is_hist = (torch.arange(keys.shape[2], device=q.device) >= self.wcap)[None, None, :, None]
            q2, keys, scale = biased_scores(q, keys, is_hist, bias)
            out = sdpa(q2.view(b, K, H // K, d + 1), keys, vals, mask, scale, sk)
            return out.reshape(b, H, 1, d)
        out = sdpa(q.view(b, K, H // K, d), keys, vals, mask, sinks=sk)
        return out.reshape(b, H, 1, d)

    # -- static mode: host-side bookkeeping between steps ---------------------------------------------------

    def after_step(self, rows: range) -> None:
        for r in rows:
            self.length[r] += 1
            self._age(slice(r, r + 1), self.groups, self.length[r])

    def prefill_row(self, row: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [K, T, d] (post-RoPE) of positions 0..T-1 into an empty row: sinks and the newest tokens into the
        window, the blocks TierPolicy puts in the history after T tokens encoded at once (as `_age` would, one
        at a time: each block is encoded alone)."""
        assert self.n_blocks[row] == 0 and self.length[row] == 0, "prefill_row needs an empty row"
        if self.rot is not None:
            k, v = self.rot.rotate(layer, k), self.rot.rotate(layer, v)
        T = k.shape[1]
        s, blk = min(self.sinks, T), self.block
        nb = self.policy.blocks_at(T)
        hist = {}
        for kind, x in (("k", k.half()), ("v", v.half())):
            w = self.win[kind][layer]
            w[row, :, :s] = x[:, :s]
            if nb:
                hist[kind] = x[None, :, s : s + nb * blk]  # [1, K, nb·block, d]
            rest = x[:, s + nb * blk :]
            w[row, :, s : s + rest.shape[1]] = rest
        if nb:  # a group is encoded once its last layer's prompt K/V are in
            self._pending[row, layer] = hist
            layers = self.groups[self.group_of[layer]]
            if layer == layers[-1]:
                self._encode_group(slice(row, row + 1), layers, {i: self._pending.pop((row, i)) for i in layers}, 0)

    def set_length(self, row: int, n: int) -> None:
        """After prefill_row of every layer: n tokens held (then the family's later tiers age, `_aged`)."""
        nb = self.policy.blocks_at(n)
        self.length[row], self.n_blocks[row] = n, nb
        self.hist_len[row] = nb * self.block
        self._age(slice(row, row + 1), self.groups, n)

    def _row_block_bytes(self) -> int:
        """Bytes of one history block of one row over all layers, K and V (from the buffers)."""
        return self.store.row_block_bytes()

    def _history_bytes(self, row: int) -> int:
        """Bytes of the row's filled history blocks, as stored."""
        return self.n_blocks[row] * self._row_block_bytes()

    def bytes_read(self, rows: range) -> int:
        """KV bytes a decode step reads: filled history blocks + window tokens (fp16) + static tensors."""
        tok = FP16Cache.bytes_per_token(self.args)
        n = sum(self._history_bytes(r) + (self.length[r] + 1 - self.n_blocks[r] * self.block) * tok
                for r in rows)  # the step reads the held tokens plus the one it appends
        return n + self._static_bytes()

    def fill_random(self, row: int, n: int, gen: torch.Generator | None = None) -> None:
        """Stand-in state after n tokens: random codes, scales and outliers (latency runs only)."""
        nb = self.policy.blocks_at(n)
        assert nb <= self.max_blocks, (nb, self.max_blocks)
        for kind in "kv":
            for layer in range(self.args.n_layers):
                self.win[kind][layer][row].normal_(0, 1, generator=gen)
                if self.mirror is not None:
                    self.mirror[kind][layer][row].normal_(0, 1, generator=gen)
        for t in self.store.buffers():
            r = t[row]
            if t.dtype == torch.uint8:
                r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, device=r.device, generator=gen))
            elif not t.dtype.is_floating_point:  # outlier positions inside a block
                r.copy_(torch.randint(0, self.block * self.args.head_dim, r.shape, device=r.device,
                                      generator=gen).to(t.dtype))
            else:
                r.uniform_(0.05, 0.5, generator=gen)
        self.set_length(row, n)

    # -- bytes ------------------------------------------------------------------------------------------

    def _static_bytes(self) -> int:
        return self.store.static_bytes()

    def _block_bytes(self) -> int:
        """Bytes one history block takes over all layers, K and V, the whole batch (from the buffers)."""
        return self.batch * self.store.row_block_bytes()

    def _fp16_token_bytes(self) -> int:
        return self.batch * self.args.n_layers * 2 * self.args.n_kv_heads * self.args.head_dim * 2

    def stored_bytes(self) -> int:
        """Bytes held now (dynamic mode): window + sinks, filled history fields, per-layer static tensors."""
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
        if self.mode == "simulated":  # nothing is held between windows: the formula at the window's length
            return self.bits_at(self.length)
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


def tiered_cache_factory(section: dict, codecs: list, mode: str = "dynamic", use_kernel: bool | None = None):
    """(model, batch, max_len) -> TieredKVCache in `mode` (moec/runtime/kvcache.py): dynamic, the `cache_factory`
    of moec.runtime.perplexity.evaluate; static, the decode engine's (history mirror in the model's dtype);
    simulated, one forward per window (built on the CPU, as the dynamic reference it reproduces).
    use_kernel=False keeps the dequantize-then-attend torch path on CUDA (the oracle of GPU checks)."""

    pre = rope_pre(section)

    def tiered(args: ModelArgs, layer_codecs: list, batch: int, max_len: int, w: torch.Tensor):
        kw = dict(window=section["window"], sinks=section["sinks"], block=section["block"], rope_pre=pre)
        if mode == "simulated":
            return TieredKVCache(args, batch, max_len, layer_codecs, mode=mode, **kw)
        return TieredKVCache(args, batch, max_len, layer_codecs, device=w.device, use_kernel=use_kernel, mode=mode,
                             mirror_dtype=w.dtype if mode == "static" else torch.float32, **kw)

    def make(model, batch: int, max_len: int):
        args, w = model.args, model.tok_embeddings.weight
        if not args.has_windows:
            return tiered(args, codecs, batch, max_len, w)
        # sliding-window layers (gpt-oss): their own fp16 rings, the codec on the full-attention layers only
        windowed = [i for i, n in enumerate(args.layer_windows) if n]
        full = [i for i, n in enumerate(args.layer_windows) if not n]
        ring = FP16Cache(layer_subset(args, windowed), batch, max_len, device=w.device, mode=mode)
        inner = tiered(layer_subset(args, full), [codecs[i] for i in full], batch, max_len, w)
        return LayerSplitCache(args, ring, inner, windowed, full)

    return make
