"""The decode step's KV prologue in one launch: rotate q, k and v along head_dim and write k, v into the
fp16 window of a tiered cache (issue 16: fewer kernels per decode layer).

Shape legend: B = rows (batch), H = query heads, K = KV heads, d = head_dim, W = window slots.

    rotate_write_window(q [B, H, d], k [B, K, d], v [B, K, d], R [d, d] fp32 | None,
                        win_k [B', K, W, d] fp16, win_v [B', K, W, d] fp16, slot [B]) -> q·R [B, H, d] in q's dtype

with win_k[b, :, slot[b]] = k[b]·R and win_v[b, :, slot[b]] = v[b]·R (fp16), R None: no rotation. torch does
this as a concatenation, a GEMM, two casts and two index_put kernels, plus a copy of q, each a few
microseconds inside a CUDA graph, once per layer (runtime/kvtiered.py TieredKVCache, static mode). One program
per (row, head of q | k | v, DC output channels) forms x·R in fp32 from x and R's [d, DC] slice, and rounds once
(torch's path rounds x·R to q's dtype before the fp16 window). `rotate_write_window_ref` is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import begin as pdl_begin


@triton.jit
def _rotate_store(src, dst, r_ptr, D: tl.constexpr, DC: tl.constexpr, ROT: tl.constexpr):
    """dst[c] = (src[:D]·R if ROT else src)[c] rounded to dst's dtype, for the DC output channels c of
    program_id(2): one [D, DC] slice of R per program (a program looping over all of R was latency-bound
    on Qwen3's 40 heads)."""
    offs_c = tl.program_id(2) * DC + tl.arange(0, DC)
    if ROT:
        offs_i = tl.arange(0, D)
        x = tl.load(src + offs_i).to(tl.float32)
        r = tl.load(r_ptr + offs_i[:, None] * D + offs_c[None, :])  # [D, DC] fp32
        y = tl.sum(x[:, None] * r, axis=0)  # [DC]
    else:
        y = tl.load(src + offs_c).to(tl.float32)
    tl.store(dst + offs_c, y.to(dst.dtype.element_ty))


@triton.jit
def _rotate_write_kernel(q_ptr, k_ptr, v_ptr, r_ptr, qo_ptr, wk_ptr, wv_ptr, slot_ptr,
                         H, K, sqb, sqh, skb, skh, svb, svh, swb, swk, sws,
                         D: tl.constexpr, DC: tl.constexpr, ROT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    b = tl.program_id(0)
    j = tl.program_id(1)  # j < H: query head j; j < H + K: key head j - H; else value head j - H - K
    if j < H:
        _rotate_store(q_ptr + b * sqb + j * sqh, qo_ptr + (b * H + j) * D, r_ptr, D, DC, ROT)
    elif j < H + K:
        slot = tl.load(slot_ptr + b)
        _rotate_store(k_ptr + b * skb + (j - H) * skh, wk_ptr + b * swb + (j - H) * swk + slot * sws, r_ptr,
                      D, DC, ROT)
    else:
        slot = tl.load(slot_ptr + b)
        _rotate_store(v_ptr + b * svb + (j - H - K) * svh, wv_ptr + b * swb + (j - H - K) * swk + slot * sws,
                      r_ptr, D, DC, ROT)


def rotate_write_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, R: torch.Tensor | None,
                        win_k: torch.Tensor, win_v: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """q·R [B, H, d] (new, contiguous, q's dtype); writes k·R, v·R into the windows at slot[b] (see the module
    docstring). q, k, v may be strided views (last dim contiguous); rows b of the windows are 0..B-1."""
    B, H, d = q.shape
    K = k.shape[1]
    assert k.shape == v.shape == (B, K, d) and q.stride(2) == k.stride(2) == v.stride(2) == 1, (k.shape, v.shape)
    assert k.dtype == v.dtype == q.dtype, (q.dtype, k.dtype, v.dtype)
    assert win_k.shape == win_v.shape and win_k.shape[0] >= B and win_k.shape[1] == K and win_k.shape[3] == d
    assert win_k.is_contiguous() and win_v.is_contiguous() and win_k.dtype == win_v.dtype == torch.float16
    assert slot.shape == (B,), slot.shape
    assert d & (d - 1) == 0, ("head_dim must be a power of two", d)
    if R is not None:
        assert R.shape == (d, d) and R.dtype == torch.float32 and R.is_contiguous(), (R.shape, R.dtype)
    qo = torch.empty(B, H, d, dtype=q.dtype, device=q.device)
    dc = min(d, 32)
    _rotate_write_kernel[(B, H + 2 * K, d // dc)](
        q, k, v, q if R is None else R, qo, win_k, win_v, slot.contiguous(), H, K,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        win_k.stride(0), win_k.stride(1), win_k.stride(2), D=d, DC=dc, ROT=R is not None, num_warps=4,
        **pdl.options(q.device))
    return qo


def rotate_write_window_ref(q, k, v, R, win_k, win_v, slot) -> torch.Tensor:
    """Torch reference of rotate_write_window (same arguments and effects), products in fp32."""
    rot = (lambda x: x.float() @ R) if R is not None else (lambda x: x.float())
    rows = torch.arange(q.shape[0], device=q.device)
    win_k[rows, :, slot] = rot(k).half()
    win_v[rows, :, slot] = rot(v).half()
    return rot(q).to(q.dtype)


__all__ = ["rotate_write_window", "rotate_write_window_ref"]
