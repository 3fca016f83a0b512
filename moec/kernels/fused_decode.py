"""Small fused kernels for the batch-1 decode step (issue 5): residual add + RMSNorm, and per-head
RMSNorm (Qwen3) + RoPE of q and k.

At batch 1 a decoder layer's step is dominated by launches, not bytes: torch runs RMSNorm as ~6
elementwise/reduce kernels and RoPE as ~6 per tensor (cat, neg, two muls, add, slices), each a few
microseconds inside a CUDA graph. These kernels replace them with one launch each, one program per
row, and keep torch's rounding: RMSNorm normalizes in fp32, casts to the model dtype, then multiplies
by the weight in that dtype (moec.runtime.model.rms_norm); RoPE rounds x·cos and rot(x)·sin to the
model dtype before adding them (moec.runtime.model.apply_rope with cos/sin in the model dtype).

    add_rms_norm(x [N, D], delta [N, D] | None, weight [D], eps, delta2=None) -> (x + delta, rms_norm(x + delta))
    silu_mul(gu [N, 2·I]) -> silu(gu[:, :I]) · gu[:, I:]  [N, I]
    qk_norm_rope(q [N, H·d], k [N, K·d], cos [N, r], sin [N, r], q_w, k_w, eps) -> q' [N, H, d], k' [N, K, d]
    mla_rope_latent(q, ckr, cos, sin, kv_a_norm_w, eps, H, nope, interleave)
        -> q_rope [N, H, rope], latent [N, r + rope]
    mla_uv(o_lat [N, H, r], w_uv [H, v, r]) -> [N, H·v]: MLA's absorbed output product o_lat[n, h]·W_UV[h]ᵀ
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import begin as pdl_begin


@triton.jit
def _residual(x_ptr, d_ptr, d2_ptr, row, sx, sd, sd2, offs, m, HAS_DELTA: tl.constexpr, HAS_DELTA2: tl.constexpr):
    """x + delta (+ delta2) at offs, in the model dtype: the residual add, as torch's x + delta.to(x.dtype)."""
    x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * sd + offs, mask=m, other=0.0).to(x.dtype)  # an fp32 delta rounded first
        if HAS_DELTA2:  # the two deltas summed first and rounded, as torch's x + (delta + delta2)
            d2 = tl.load(d2_ptr + row * sd2 + offs, mask=m, other=0.0).to(x.dtype)
            d = (d.to(tl.float32) + d2.to(tl.float32)).to(x.dtype)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, d2_ptr, w_ptr, xo_ptr, h_ptr, D, sx, sd, sd2, sxo, sh, eps,
                         HAS_DELTA: tl.constexpr, HAS_DELTA2: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    x = _residual(x_ptr, d_ptr, d2_ptr, row, sx, sd, sd2, offs, m, HAS_DELTA, HAS_DELTA2)
    if HAS_DELTA:
        tl.store(xo_ptr + row * sxo + offs, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    xn = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * sh + offs, (w * xn).to(h_ptr.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 delta2: torch.Tensor | None = None):
    """(x + delta, rms_norm(x + delta, weight)) for x, delta [N, D] (rows may be strided); delta None:
    (x, rms_norm(x)); delta2 (a shared expert's output beside the routed experts'): x + (delta + delta2), the
    deltas' sum rounded to the model dtype first. A delta of another dtype (the MoE kernels' fp32 accumulator) is
    rounded to x.dtype before anything else, as torch's delta.to(x.dtype). Outputs are new contiguous tensors in
    x.dtype."""
    N, D = x.shape
    assert x.stride(1) == 1 and weight.shape == (D,), (x.stride(), weight.shape)
    for t in (delta, delta2):
        assert t is None or (t.shape == x.shape and t.stride(1) == 1), (t.shape, x.shape)
    assert delta2 is None or delta is not None, "delta2 needs a delta"
    h = torch.empty(N, D, dtype=x.dtype, device=x.device)
    xo = torch.empty_like(h) if delta is not None else x
    d = x if delta is None else delta
    d2 = d if delta2 is None else delta2
    _add_rms_norm_kernel[(N,)](x, d, d2, weight, xo, h, D, x.stride(0), d.stride(0), d2.stride(0), xo.stride(0),
                               h.stride(0), eps, HAS_DELTA=delta is not None, HAS_DELTA2=delta2 is not None,
                               BLOCK=triton.next_power_of_2(D), num_warps=4 if D <= 4096 else 8,
                               **pdl.options(x.device))
    return xo, h


@triton.jit
def _silu_mul_kernel(gu_ptr, o_ptr, I, sgu, so, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    row, blk = tl.program_id(0), tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(gu_ptr + row * sgu + offs, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * sgu + I + offs, mask=m, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # torch's silu: fp32 inside, rounded
    tl.store(o_ptr + row * so + offs, (s * u).to(o_ptr.dtype.element_ty), mask=m)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(g) · u of a fused gate/up projection gu = [g | u] [N, 2·I] -> [N, I] in gu.dtype, rounded as torch's
    F.silu(g) * u (the shared expert's activation: two elementwise launches in torch)."""
    N, I2 = gu.shape
    assert I2 % 2 == 0 and gu.stride(1) == 1, (gu.shape, gu.stride())
    I = I2 // 2
    out = torch.empty(N, I, dtype=gu.dtype, device=gu.device)
    BLOCK = min(triton.next_power_of_2(I), 1024)
    _silu_mul_kernel[(N, triton.cdiv(I, BLOCK))](gu, out, I, gu.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4,
                                                 **pdl.options(gu.device))
    return out


@triton.jit
def _rope_store(x1, x2, dst, cos_ptr, sin_ptr, offs, HALF: tl.constexpr):
    """dst[:2·HALF] = RoPE of one head's rotary halves x1, x2 (the model dtype; cos_ptr, sin_ptr: the row's
    [2·HALF]), results in halves order: x·cos + cat(−x2, x1)·sin, each product rounded to the model dtype first
    (as model.apply_rope does)."""
    dt = x1.dtype
    c1 = tl.load(cos_ptr + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + offs).to(tl.float32)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    tl.store(dst + offs, ((a1 * c1).to(dt).to(tl.float32) + (-a2 * s1).to(dt).to(tl.float32)).to(dt))
    tl.store(dst + HALF + offs, ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt))


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, H, K, sq, sk, sc, eps,
                         D: tl.constexpr, ROT: tl.constexpr, REST: tl.constexpr, NORM: tl.constexpr,
                         PDL: tl.constexpr = False):
    """One program per (row n, head j): j < H a query head, else key head j − H. The first ROT dims of a head
    are rotated (halves layout), dims ROT..D pass through (partial rotary, GLM-4.5: ROT < D, REST the next
    power of two ≥ D − ROT)."""
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
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
    _rope_store(x1, x2, dst, cos_ptr + n * sc, sin_ptr + n * sc, offs, HALF)
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
        NORM=norm, num_warps=1, **pdl.options(q.device))
    return qo, ko


@triton.jit
def _rope_pair(src, dst, cos_ptr, sin_ptr, offs, i1, i2, HALF: tl.constexpr):
    """dst[:2·HALF] = RoPE(src) of one head's rotary part, its pairs at (i1, i2): _rope_store of the loaded halves."""
    _rope_store(tl.load(src + i1), tl.load(src + i2), dst, cos_ptr, sin_ptr, offs, HALF)


@triton.jit
def _mla_rope_latent_kernel(q_ptr, ckr_ptr, cos_ptr, sin_ptr, w_ptr, uk_ptr, qo_ptr, lat_ptr, H, sq, sckr, sc,
                            su0, su1, eps, N: tl.constexpr, HD: tl.constexpr, NOPE: tl.constexpr, NB: tl.constexpr,
                            R: tl.constexpr, RB: tl.constexpr, ROPE: tl.constexpr, INTERLEAVE: tl.constexpr,
                            ABSORB: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr = False):
    """Program (j, t), every row n in a loop: j < H is query head j. ABSORB: columns [t·BR, (t+1)·BR) of
    q_nope·W_UK[j] (the absorbed query, W_UK's tile loaded once for all rows) into qo[n, j, :R], and (t = 0)
    RoPE(q_rope) into qo[n, j, R:]; else (t = 0 only) RoPE(q_rope) into qo[n, j]. j = H, t = 0 writes the cache's
    latent rows lat[n] = [kv_a_norm(c), RoPE(k_rope)] from ckr[n] = wkv_a(x) = [c (R), k_rope (ROPE)]. N (rows) is a
    constant: the step's batch buckets, a handful of compiles (and Triton's interpreter loops only over those)."""
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    j = tl.program_id(0)
    t = tl.program_id(1)
    HALF: tl.constexpr = ROPE // 2
    QS: tl.constexpr = R + ROPE if ABSORB else ROPE  # qo's head stride
    QOFF: tl.constexpr = R if ABSORB else 0  # where the turned RoPE part starts in a head of qo
    offs = tl.arange(0, HALF)
    if INTERLEAVE:  # pairs (x0, x1), (x2, x3), ...: the result in halves order, as model.apply_rope writes it
        i1 = 2 * offs
        i2 = 2 * offs + 1
    else:
        i1 = offs
        i2 = HALF + offs
    if j < H:
        if ABSORB:  # bmm(q_nope, W_UK) of the absorbed step: fp32 sums, rounded once, as cuBLAS's bf16 bmm
            kk = tl.arange(0, NB)
            cols = t * BR + tl.arange(0, BR)
            mk = kk < NOPE
            mc = cols < R
            wt = tl.load(uk_ptr + j * su0 + kk[:, None] * su1 + cols[None, :], mask=mk[:, None] & mc[None, :],
                         other=0.0).to(tl.float32)
            for n in range(N):
                qn = tl.load(q_ptr + n * sq + j * HD + kk, mask=mk, other=0.0)
                y = tl.sum(qn.to(tl.float32)[:, None] * wt, axis=0)
                tl.store(qo_ptr + (n * H + j) * QS + cols, y.to(qn.dtype), mask=mc)
        if t == 0:
            for n in range(N):
                _rope_pair(q_ptr + n * sq + j * HD + NOPE, qo_ptr + (n * H + j) * QS + QOFF, cos_ptr + n * sc,
                           sin_ptr + n * sc, offs, i1, i2, HALF)
    elif t == 0:
        ro = tl.arange(0, RB)
        m = ro < R
        w = tl.load(w_ptr + ro, mask=m, other=0.0).to(tl.float32)
        for n in range(N):
            c = tl.load(ckr_ptr + n * sckr + ro, mask=m, other=0.0)
            cf = c.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(cf * cf, axis=0) / R + eps)  # model.rms_norm: fp32, then the model dtype
            cn = (cf * inv).to(c.dtype).to(tl.float32)
            tl.store(lat_ptr + n * (R + ROPE) + ro, (w * cn).to(lat_ptr.dtype.element_ty), mask=m)
            _rope_pair(ckr_ptr + n * sckr + R, lat_ptr + n * (R + ROPE) + R, cos_ptr + n * sc, sin_ptr + n * sc,
                       offs, i1, i2, HALF)


def mla_rope_latent(q: torch.Tensor, ckr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, n_heads: int, nope: int, interleave: bool, w_uk: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's decode-step prologue in one launch (model.MLAttention.forward's kv_a_norm, both RoPEs and the latent
    row, ~18 torch launches a layer): q [N, H·(nope + rope)] (rows may be strided), ckr [N, r + rope] = wkv_a(x),
    cos, sin [N, rope] -> q_rope [N, H, rope] (turned), latent [N, r + rope] = [rms_norm(c), RoPE(k_rope)], both
    contiguous, in the one dtype of q, ckr and the norm's weight. w_uk [H, nope, r] (the absorbed weight's W_UK
    part, any strides but the last): the first output is the whole absorbed query [N, H, r + rope] =
    [q_nope·W_UK[h], RoPE(q_rope)] instead (torch: a bmm and a cat more)."""
    N = q.shape[0]
    rope = cos.shape[-1]
    r = ckr.shape[1] - rope
    hd = nope + rope
    assert q.shape[1] == n_heads * hd and q.stride(1) == 1 and ckr.stride(1) == 1, (q.shape, q.stride(), ckr.stride())
    assert cos.shape == sin.shape == (N, rope) and cos.stride() == sin.stride() and norm_weight.shape == (r,)
    assert rope >= 2 and rope & (rope - 1) == 0, rope
    assert q.dtype == ckr.dtype == norm_weight.dtype, (q.dtype, ckr.dtype, norm_weight.dtype)
    absorb = w_uk is not None
    if absorb:
        assert w_uk.shape == (n_heads, nope, r) and w_uk.stride(2) == 1 and w_uk.dtype == q.dtype, \
            (w_uk.shape, w_uk.stride(), w_uk.dtype)
    q_out = torch.empty(N, n_heads, r + rope if absorb else rope, dtype=q.dtype, device=q.device)
    latent = torch.empty(N, r + rope, dtype=q.dtype, device=q.device)
    BR = 32  # W_UK columns a program: H·r/32 programs (V2-Lite: 256, one wave per batch of rows)
    uk = w_uk if absorb else q
    _mla_rope_latent_kernel[(n_heads + 1, triton.cdiv(r, BR) if absorb else 1)](
        q, ckr, cos, sin, norm_weight, uk, q_out, latent, n_heads, q.stride(0), ckr.stride(0), cos.stride(0),
        uk.stride(0) if absorb else 0, uk.stride(1) if absorb else 0, eps, N=N, HD=hd, NOPE=nope,
        NB=triton.next_power_of_2(nope), R=r, RB=triton.next_power_of_2(r), ROPE=rope, INTERLEAVE=interleave,
        ABSORB=absorb, BR=BR, num_warps=4 if absorb else 1, **pdl.options(q.device))
    return q_out, latent


@triton.jit
def _mla_uv_kernel(o_ptr, w_ptr, out_ptr, H, V, so0, so1, sw0, sw1, N: tl.constexpr, R: tl.constexpr,
                   RB: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
    """Program (j, t): rows [t·BV, (t+1)·BV) of head j's W_UV [V, R] loaded once, then for every row n (a loop, N a
    constant as in _mla_rope_latent_kernel) out[n, j·V + v] = Σ_r o[n, j, r]·W_UV[j, v, r]; o rounded to the output
    dtype first and the fp32 sum rounded once, as the cast and cuBLAS's bmm of the torch step."""
    pdl_begin(PDL)
    j = tl.program_id(0)
    t = tl.program_id(1)
    rows = t * BV + tl.arange(0, BV)
    rr = tl.arange(0, RB)
    mv = rows < V
    mr = rr < R
    w = tl.load(w_ptr + j * sw0 + rows[:, None] * sw1 + rr[None, :], mask=mv[:, None] & mr[None, :],
                other=0.0).to(tl.float32)
    for n in range(N):
        o = tl.load(o_ptr + n * so0 + j * so1 + rr, mask=mr, other=0.0)
        o = o.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = tl.sum(w * o[None, :], axis=1)
        tl.store(out_ptr + (n * H + j) * V + rows, y.to(out_ptr.dtype.element_ty), mask=mv)


def mla_uv(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """MLA's absorbed output product in one launch: o_lat [N, H, r] (any float dtype and strides but the last: the
    latent attention's output), w_uv [H, v, r] (the absorbed weight's W_UV part, rows contiguous) -> [N, H·v] in
    w_uv's dtype, = bmm(o_lat.to(dtype), W_UVᵀ) per head. Why not the bmm: at decode batch sizes cuBLAS ran it as a
    [1, r] x [r, v] product per head with W_UV read through its transposed view, and the cast of o_lat was a launch of
    its own; here each W_UV tile is read once, for every row."""
    N, H, r = o_lat.shape
    v = w_uv.shape[1]
    assert w_uv.shape == (H, v, r) and w_uv.stride(2) == 1 and o_lat.stride(2) == 1, \
        (o_lat.shape, o_lat.stride(), w_uv.shape, w_uv.stride())
    out = torch.empty(N, H * v, dtype=w_uv.dtype, device=w_uv.device)
    BV = 16  # W_UV rows a program: H·v/16 programs (V2-Lite: 128, DeepSeek-V3: 1024), a [16, r] tile in registers
    _mla_uv_kernel[(H, triton.cdiv(v, BV))](o_lat, w_uv, out, H, v, o_lat.stride(0), o_lat.stride(1),
                                           w_uv.stride(0), w_uv.stride(1), N=N, R=r, RB=triton.next_power_of_2(r),
                                           BV=BV, num_warps=4, **pdl.options(w_uv.device))
    return out
