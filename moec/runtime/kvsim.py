"""Simulated decode mode for tiered KV caches: one teacher-forced forward per window that gives each
query position exactly the keys/values the decode-mode cache would hold at that step.

In decode mode (moec/runtime/kvtiered.py) the query at position i attends to: the sinks and the
window in fp16, and the first blocks_at(i) blocks after the sinks in their encoded-then-decoded form
(a block, once encoded, never changes, and its encoding depends only on its own fp16 keys/values).
So one forward can reproduce decode mode: per layer, encode+decode every block that will ever be
evicted, and let query i see key j in fp16 if j is in a sink or in i's window, or in quantized form
if j lies in one of the blocks_at(i) history blocks (causal: j ≤ i). Hidden states of later layers
then follow from the same attention outputs as in decode mode. Equal to decode mode up to float
summation order, provided the prompt prefill (CONTEXT tokens) evicts nothing, i.e.
sinks + window + block > CONTEXT (asserted). benchmarks/bench_kv_quality.py checks it against
decode mode on a sample before using it (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kvtiered import TieredKVCache, biased_scores, history_bias


class SimulatedTieredCache:
    """Drop-in `cache` for one `model(tokens, cache, 0)` call over whole windows [B, S]."""

    def __init__(self, args, batch: int, max_len: int, codecs: list | None, window: int = 128, sinks: int = 4,
                 block: int = 32, rope_pre: bool = False, prefill: int = 32):
        self.ref = None if codecs is None else TieredKVCache(args, batch, max_len, codecs, window, sinks, block,
                                                             rope_pre)
        self.codec = "fp16" if codecs is None else codecs[0].name
        if self.ref is not None:
            assert sinks + window + block > prefill, "the prefill would evict blocks; simulation not exact"
        self.length = 0
        self.args = args

    def attend(self, layer: int, q, k, v, start_pos: int) -> torch.Tensor:
        if self.ref is not None and self.ref.rot is not None:  # the cache's head_dim rotation, as it applies it
            return self.ref.rot.attend(self._attend, layer, q, k, v, start_pos)
        return self._attend(layer, q, k, v, start_pos)

    def _attend(self, layer: int, q, k, v, start_pos: int) -> torch.Tensor:
        assert start_pos == 0, "simulated decode runs one forward per window"
        B, H, S, d = q.shape
        kf, vf = k.half().to(q.dtype), v.half().to(q.dtype)  # what the cache stores
        pos = torch.arange(S, device=q.device)
        causal = pos[None, :] <= pos[:, None]  # [S(query), S(key)]
        if layer == self.args.n_layers - 1:
            self.length = S
        if self.ref is None or self.ref.blocks_at(S) == 0:
            return F.scaled_dot_product_attention(q, kf, vf, attn_mask=causal, enable_gqa=True)
        c = self.ref
        nb, s, blk = c.blocks_at(S), c.sinks, c.block
        kq, vq = torch.zeros_like(kf), torch.zeros_like(vf)
        for b in range(nb):  # encode + decode each block that leaves the window, as the cache does
            lo = s + b * blk
            c.n_blocks[layer] = b
            c._encode_block(layer, kf[:, :, lo : lo + blk], vf[:, :, lo : lo + blk])
            kq[:, :, lo : lo + blk] = c.mirror["k"][layer][:, :, b * blk : (b + 1) * blk].to(q.dtype)
            vq[:, :, lo : lo + blk] = c.mirror["v"][layer][:, :, b * blk : (b + 1) * blk].to(q.dtype)
        hist_end = s + torch.tensor([c.blocks_at(i) for i in range(S)], device=q.device) * blk  # per query
        in_hist = (pos[None, :] >= s) & (pos[None, :] < hist_end[:, None])  # [S, S]
        mask = torch.cat([causal & ~in_hist, in_hist], dim=1)  # fp16 keys, then quantized keys
        keys, vals = torch.cat([kf, kq], 2), torch.cat([vf, vq], 2)
        bias = history_bias(c.codecs[layer], q)
        if bias is not None:  # the quantized copies are the second half of the keys
            is_hist = (torch.arange(2 * S, device=q.device) >= S)[None, None, :, None]
            q, keys, scale = biased_scores(q, keys, is_hist, bias)
            # values padded to the keys' d + 1 channels: with value and key head dims unequal, CPU SDPA takes a
            # path ~4x slower (2 × 8192 simulated decode: ~40 instead of ~10 min); the zero channel is dropped
            vals = F.pad(vals, (0, 1))
            return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True, scale=scale)[..., :-1]
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True)

    def bits_per_element(self) -> float:
        return 16.0 if self.ref is None else self.ref.bits_at(self.length)

    def bits_at(self, tokens: int) -> float:
        return 16.0 if self.ref is None else self.ref.bits_at(tokens)
