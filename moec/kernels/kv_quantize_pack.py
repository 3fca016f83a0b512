"""Quantize-and-pack one KV block leaving the fp16 window (nuq-outlier codec, seed 003) in one kernel.

Produces exactly the fields of moec.runtime.nuq.NUQOutlierCodec.encode (and of its subclass
NUQCenteredCodec: keys minus an offline per-channel center, key outliers by the rounding error
weighted with the channel's query RMS) for x [B, K, N, d]:
    codes   [B, K, N, d·bits/8] uint8   nearest level of x / scale, moec/formats/bitpack.py Layout.PLANAR
    scale   [B, K, N] fp16              (values only) per-token absmax after removing the outliers
    out_idx [B, K, 1, n_out] int16      t·d + c of the n_out largest |x / scale| (keys) or |x| (values)
                                        of the block, ascending
    out_val [B, K, 1, n_out] fp16       residual x − level·scale at those elements

One program per (batch row, KV head) holds the whole block in registers as a [N, 8, d/8] tile
(channel c = m·d/8 + i), so every packed byte is an elementwise combination of the m slices:
    2-bit byte i < d/8:        m = 0, 2, 4, 6 at column i,       shifts 0, 2, 4, 6
    2-bit byte d/8 + i:        m = 1, 3, 5, 7 at column i,       shifts 0, 2, 4, 6
    3-bit high-plane byte i:   m = 0..7 at column i (bit 2),     shift m
The n_out largest magnitudes: bisection on the int32 bit pattern of the (non-negative) magnitudes
for the n_out-th largest value T (31 counting passes over the block), then compaction of
{mag > T} plus the first (in index order) elements equal to T by an exclusive prefix sum.
Tie rule: where several elements equal T, torch.topk picks an unspecified subset; this kernel the
lowest indices (the reference codec sorts its topk indices, so away from ties the two agree
exactly). Divisions are IEEE round-to-nearest (div_rn), as in torch, so codes match bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _nearest(xn, mid_ptr, LEVELS: tl.constexpr):
    """torch.bucketize(xn, midpoints): the number of midpoints strictly below xn."""
    code = tl.zeros(xn.shape, tl.int32)
    for i in tl.static_range(LEVELS - 1):
        code += (xn > tl.load(mid_ptr + i)).to(tl.int32)
    return code


@triton.jit
def _level(code, lev_ptr, LEVELS: tl.constexpr):
    val = tl.zeros(code.shape, tl.float32) + tl.load(lev_ptr)
    for i in tl.static_range(1, LEVELS):
        val = tl.where(code == i, tl.load(lev_ptr + i), val)
    return val


@triton.jit
def _kv_quantize_pack_kernel(
    x_ptr, ks_ptr, lev_ptr, mid_ptr, codes_ptr, vs_ptr, oidx_ptr, oval_ptr, kc_ptr, kw_ptr,
    K, n_out,
    N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, IS_K: tl.constexpr, HAS_OUT: tl.constexpr,
    CENTER: tl.constexpr, WEIGHTED: tl.constexpr,
):
    bk = tl.program_id(0)
    kh = bk % K
    D8: tl.constexpr = D // 8
    DW: tl.constexpr = D * BITS // 8
    LEVELS: tl.constexpr = 1 << BITS
    offs_t = tl.arange(0, N)[:, None, None]
    offs_m = tl.arange(0, 8)[None, :, None]
    offs_i = tl.arange(0, D8)[None, None, :]
    chan = offs_m * D8 + offs_i  # [1, 8, D8]
    flat = offs_t * D + chan  # [N, 8, D8]: t·d + c, row-major = ascending
    x = tl.load(x_ptr + bk * N * D + flat).to(tl.float32)

    if IS_K:
        if CENTER:
            x = x - tl.load(kc_ptr + kh * D + chan)
        scale = tl.load(ks_ptr + kh * D + chan)  # [1, 8, D8] fp32
        xn = tl.math.div_rn(x, scale)
        if WEIGHTED:  # |x − level·scale| · query RMS of the channel (the codes do not depend on outliers)
            mag = tl.abs(x - _level(_nearest(xn, mid_ptr, LEVELS), lev_ptr, LEVELS) * scale) \
                * tl.load(kw_ptr + kh * D + chan)
        else:
            mag = tl.abs(xn)
    else:
        mag = tl.abs(x)

    if HAS_OUT:
        # the n_out-th largest magnitude T: max t with #{bits >= t} >= n_out (bits monotone in mag >= 0)
        bits = mag.to(tl.int32, bitcast=True)
        lo = 0
        hi = 0x7F800000
        for _ in range(31):
            mid = lo + (hi - lo + 1) // 2
            cnt = tl.sum(tl.sum(tl.sum((bits >= mid).to(tl.int32), axis=2), axis=1), axis=0)
            if cnt >= n_out:
                lo = mid
            else:
                hi = mid - 1
        gt = bits > lo
        tie = bits == lo
        need = n_out - tl.sum(tl.sum(tl.sum(gt.to(tl.int32), axis=2), axis=1), axis=0)
        sel = gt | (tie & (_excl_prefix(tie.to(tl.int32)) < need))
    else:
        sel = mag < 0  # nothing

    if not IS_K:
        core = tl.where(sel, 0.0, mag)
        s = tl.max(tl.max(core, axis=2), axis=1)  # [N]
        s = tl.maximum(s, 1e-6).to(tl.float16)
        tl.store(vs_ptr + bk * N + tl.arange(0, N), s)
        scale = s.to(tl.float32)[:, None, None]
        xn = tl.math.div_rn(x, scale)
    code = _nearest(xn, mid_ptr, LEVELS)  # [N, 8, D8] int32

    # planar packing (see the module docstring)
    row = codes_ptr + bk * N * DW + tl.arange(0, N)[:, None] * DW + tl.arange(0, D8)[None, :]  # [N, D8]
    even = (offs_m % 2) == 0
    lo2 = code & 3
    shift = offs_m - (offs_m % 2)  # 0, 0, 2, 2, 4, 4, 6, 6
    b_even = tl.sum(tl.where(even, lo2 << shift, 0), axis=1)
    b_odd = tl.sum(tl.where(even, 0, lo2 << shift), axis=1)
    tl.store(row, b_even.to(tl.uint8))
    tl.store(row + D8, b_odd.to(tl.uint8))
    if BITS == 3:
        b_hi = tl.sum(((code >> 2) & 1) << offs_m, axis=1)
        tl.store(row + 2 * D8, b_hi.to(tl.uint8))

    if HAS_OUT:
        resid = x - _level(code, lev_ptr, LEVELS) * scale
        pos = _excl_prefix(sel.to(tl.int32))
        obase = bk * n_out + pos
        tl.store(oidx_ptr + obase, flat.to(tl.int16), mask=sel)
        tl.store(oval_ptr + obase, resid.to(tl.float16), mask=sel)


@triton.jit
def _excl_prefix(v):
    """Exclusive prefix sum of an int32 [N, 8, D8] tile in row-major (flat index) order."""
    c2 = tl.cumsum(v, axis=2)
    r2 = tl.sum(v, axis=2)  # [N, 8]
    c1 = tl.cumsum(r2, axis=1) - r2
    r1 = tl.sum(r2, axis=1)  # [N]
    c0 = tl.cumsum(r1, axis=0) - r1
    return c0[:, None, None] + c1[:, :, None] + c2 - v


class NUQView(NamedTuple):
    """A nuq-outlier codec (moec.runtime.nuq.NUQOutlierCodec / NUQCenteredCodec) on one device, in the
    forms the kernels take (made once per codec and device by its `kernel_view`). Tensors are contiguous."""

    bits: int  # 2 or 3
    block: int  # tokens per encoded block (N)
    n_out: int  # outliers per (batch row, KV head) block; 0: none
    k_scale: torch.Tensor  # [K, d] fp32, the offline per-channel key scale
    k_levels: torch.Tensor  # [2^bits] fp32, ascending
    v_levels: torch.Tensor  # [2^bits] fp32, ascending
    k_mids: torch.Tensor  # [2^bits - 1] fp32, (lev[1:] + lev[:-1]) / 2: the codec's bucketize boundaries
    v_mids: torch.Tensor
    k_center: torch.Tensor | None  # [K, d] fp32 (NUQCenteredCodec) or None
    k_weight: torch.Tensor | None  # [K, d] fp32, query RMS for weighted-error key outliers, or None
    k_err2: torch.Tensor | None = None  # [K, d] fp32, key error power for the history score bias, or None


def kv_quantize_pack(x: torch.Tensor, kind: str, view: NUQView) -> dict[str, torch.Tensor]:
    """The nuq-outlier encode of x [B, K, N, d] fp16/fp32 (keys or values) on the GPU (or under
    TRITON_INTERPRET): the fields of NUQOutlierCodec.encode(x, kind), bit for bit away from ties.
    view: the codec's tensors on x's device (codec.kernel_view(x.device))."""
    B, K, N, d = x.shape
    bits, n_out = view.bits, view.n_out
    assert kind in ("k", "v") and bits in (2, 3), (kind, bits)
    assert N == view.block and (K, d) == tuple(view.k_scale.shape), (N, K, d, view.block, view.k_scale.shape)
    assert N & (N - 1) == 0 and d & (d - 1) == 0 and d >= 16, ("power-of-two block and head_dim >= 16", N, d)
    assert N * d < 2**15, "out_idx is int16"
    assert x.dtype in (torch.float16, torch.float32), x.dtype
    x = x.contiguous()
    dev = x.device
    lev, mids = (view.k_levels, view.k_mids) if kind == "k" else (view.v_levels, view.v_mids)
    ks, kc, kw = view.k_scale, view.k_center, view.k_weight
    assert ks.device == dev, (ks.device, dev)
    out = {"codes": torch.empty(B, K, N, d * bits // 8, dtype=torch.uint8, device=dev)}
    if kind == "v":
        out["scale"] = torch.empty(B, K, N, dtype=torch.float16, device=dev)
    if n_out:
        out["out_idx"] = torch.empty(B, K, 1, n_out, dtype=torch.int16, device=dev)
        out["out_val"] = torch.empty(B, K, 1, n_out, dtype=torch.float16, device=dev)
    dummy = out["codes"]
    _kv_quantize_pack_kernel[(B * K,)](
        x, ks, lev, mids, out["codes"], out.get("scale", dummy), out.get("out_idx", dummy),
        out.get("out_val", dummy), ks if kc is None else kc, ks if kw is None else kw, K, n_out,
        N=N, D=d, BITS=bits, IS_K=kind == "k", HAS_OUT=n_out > 0, CENTER=kc is not None,
        WEIGHTED=kw is not None and n_out > 0, num_warps=4,
    )
    return out
