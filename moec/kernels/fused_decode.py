"""Small fused kernels for the batch-1 decode step (issue 5): residual add + RMSNorm, and per-head
RMSNorm (Qwen3) + RoPE of q and k.

At batch 1 a decoder layer's step is dominated by launches, not bytes: torch runs RMSNorm as ~6
elementwise/reduce kernels and RoPE as ~6 per tensor (cat, neg, two muls, add, slices), each a few
microseconds inside a CUDA graph. These kernels replace them with one launch each, one program per
row, and keep torch's rounding: RMSNorm normalizes in fp32, casts to the model dtype, then multiplies
by the weight in that dtype (moec.runtime.model.rms_norm); RoPE rounds x·cos and rot(x)·sin to the
model dtype before adding them (moec.runtime.model.apply_rope with cos/sin in the model dtype).

    add_rms_norm(x [N, D], delta [N, D] | None, weight [D], eps) -> (x + delta, rms_norm(x + delta))
    qk_norm_rope(q [N, H·d], k [N, K·d], cos [N, d], sin [N, d], q_w, k_w, eps) -> q' [N, H, d], k' [N, K, d]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, h_ptr, D, sx, sd, sxo, sh, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0)
    if HAS_DELTA:  # the residual add in the model dtype (one rounding, as torch's x + delta)
        x = (x.to(tl.float32) + tl.load(d_ptr + row * sd + offs, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(xo_ptr + row * sxo + offs, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    xn = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * sh + offs, (w * xn).to(h_ptr.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta, weight)) for x, delta [N, D] (rows may be strided); delta None:
    (x, rms_norm(x)). Outputs are new contiguous tensors in x.dtype."""
    N, D = x.shape
    assert x.stride(1) == 1 and weight.shape == (D,), (x.stride(), weight.shape)
    assert delta is None or (delta.shape == x.shape and delta.stride(1) == 1), (delta.shape, x.shape)
    h = torch.empty(N, D, dtype=x.dtype, device=x.device)
    xo = torch.empty_like(h) if delta is not None else x
    _add_rms_norm_kernel[(N,)](x, x if delta is None else delta, weight, xo, h, D, x.stride(0),
                               0 if delta is None else delta.stride(0), xo.stride(0), h.stride(0), eps,
                               HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(D),
                               num_warps=4 if D <= 4096 else 8)
    return xo, h


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, H, K, sq, sk, sc, eps,
                         D: tl.constexpr, ROT: tl.constexpr, REST: tl.constexpr, NORM: tl.constexpr):
    """One program per (row n, head j): j < H a query head, else key head j − H. The first ROT dims of a head
    are rotated (halves layout), dims ROT..D pass through (partial rotary, GLM-4.5: ROT < D, REST the next
    power of two ≥ D − ROT)."""
    n = tl.program_id(0)
    j = tl.program_id(1)
    HALF: tl.constexpr = ROT // 2
    offs = tl.arange(0, HALF)
    is_q = j < H
    if is_q:
        src = q_ptr + n * sq + j * D
        dst = qo_ptr + (n * H + j) * D
        w_ptr = qw_ptr
    else:
        src = k_ptr + n * sk + (j - H) * D
        dst = ko_ptr + (n * K + j - H) * D
        w_ptr = kw_ptr
    x1 = tl.load(src + offs)
    x2 = tl.load(src + HALF + offs)
    dt = x1.dtype
    if ROT < D:
        offs3 = ROT + tl.arange(0, REST)
        m3 = offs3 < D
        x3 = tl.load(src + offs3, mask=m3, other=0.0)
    if NORM:  # per-head RMSNorm before the rotation (Qwen3 q_norm / k_norm), torch's rounding
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        ss = tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)
        if ROT < D:
            f3 = x3.to(tl.float32)
            ss += tl.sum(f3 * f3, axis=0)
        inv = 1.0 / tl.sqrt(ss / D + eps)
        x1 = (tl.load(w_ptr + offs).to(tl.float32) * (f1 * inv).to(dt).to(tl.float32)).to(dt)
        x2 = (tl.load(w_ptr + HALF + offs).to(tl.float32) * (f2 * inv).to(dt).to(tl.float32)).to(dt)
        if ROT < D:
            x3 = (tl.load(w_ptr + offs3, mask=m3, other=0.0).to(tl.float32) * (f3 * inv).to(dt).to(tl.float32))
            x3 = x3.to(dt)
    c1 = tl.load(cos_ptr + n * sc + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + n * sc + HALF + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + n * sc + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + n * sc + HALF + offs).to(tl.float32)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # x·cos + cat(−x2, x1)·sin, each product rounded to the model dtype first (as torch does)
    o1 = ((a1 * c1).to(dt).to(tl.float32) + (-a2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(dst + offs, o1)
    tl.store(dst + HALF + offs, o2)
    if ROT < D:
        tl.store(dst + offs3, x3, mask=m3)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                 n_kv_heads: int, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (half-rotation layout) of one token per row, with the optional per-head RMSNorm (over the whole head)
    before it. q [N, H·d], k [N, K·d] (rows may be strided views of a fused qkv output); cos, sin [N, r] in the
    model dtype, r ≤ d: the first r dims of a head are rotated, the rest pass through (partial rotary)
    -> q' [N, H, d], k' [N, K, d] contiguous."""
    N = q.shape[0]
    d = q.shape[1] // n_heads
    r = cos.shape[-1]
    assert q.shape[1] == n_heads * d and k.shape == (N, n_kv_heads * d), (q.shape, k.shape)
    assert q.stride(1) == 1 and k.stride(1) == 1 and cos.shape == sin.shape == (N, r) and cos.stride() == sin.stride()
    assert r <= d and r & (r - 1) == 0 and r >= 8, (r, d)
    norm = q_weight is not None
    qo = torch.empty(N, n_heads, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(N, n_kv_heads, d, dtype=k.dtype, device=k.device)
    _qk_norm_rope_kernel[(N, n_heads + n_kv_heads)](
        q, k, cos, sin, q_weight if norm else cos, k_weight if norm else cos, qo, ko, n_heads, n_kv_heads,
        q.stride(0), k.stride(0), cos.stride(0), eps, D=d, ROT=r, REST=triton.next_power_of_2(max(d - r, 1)),
        NORM=norm, num_warps=1)
    return qo, ko
