"""KV caches. The model calls `cache.attend(layer, q, k, v, start_pos)`; the cache stores the new
keys/values in its own format and returns the attention output, so a compressed cache can attend
straight from its packed history (later issues) without the model knowing the format.

This module holds the uncompressed cache (fp16 by default: the baseline every codec is compared
against), preallocated for `max_len` tokens like a static cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelArgs


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int,
                     scale: float | None = None) -> torch.Tensor:
    """q: [B, H, T, d] at positions start_pos..start_pos+T-1; k, v: [B, K, S, d] with S = start_pos+T.
    scale: the score scale (SDPA's default 1/√(q's last dim) when None)."""
    T, S = q.shape[2], k.shape[2]
    if T == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=scale)
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


class DenseKVCache:
    """Keys/values as stored tensors [B, K, max_len, d] per layer, in `dtype` (fp16 unless told)."""

    codec = "fp16"

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype=torch.float16, device="cpu"):
        shape = (batch, args.n_kv_heads, max_len, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.args, self.max_len, self.length = args, max_len, 0

    def attend(self, layer: int, q, k, v, start_pos: int) -> torch.Tensor:
        end = start_pos + k.shape[2]
        assert end <= self.max_len, (end, self.max_len)
        self.k[layer][:, :, start_pos:end] = k
        self.v[layer][:, :, start_pos:end] = v
        if layer == self.args.n_layers - 1:
            self.length = end
        keys = self.k[layer][:, :, :end].to(q.dtype)
        values = self.v[layer][:, :, :end].to(q.dtype)
        return causal_attention(q, keys, values, start_pos)

    def stored_bytes(self) -> int:
        """Bytes the cache holds for the tokens written so far (all layers, K and V, whole batch)."""
        per_token = 2 * self.args.n_layers * self.args.n_kv_heads * self.args.head_dim
        return self.length * self.k[0].shape[0] * per_token * self.k[0].element_size()

    def bits_per_element(self) -> float:
        elems = self.length * self.k[0].shape[0] * 2 * self.args.n_layers * self.args.n_kv_heads * self.args.head_dim
        return 8.0 * self.stored_bytes() / max(elems, 1)
