"""Study kernel (not used by the runtime): decode attention over an outlier-free 2-bit NUQ history + fp16
window with the operands of both products swapped, so the dequantized history is tl.dot's left-hand tile.
Measured by benchmarks/studies/bench_nuq_attention.py (results/nuq_attention_h200.json): no faster than the
runtime's kernel (moec/kernels/kv_decode_attention.py) on the same cache; why is at the end.

Same inputs and partial/reduce protocol as moec/kernels/kv_decode_attention.py (split-K over the context,
online softmax, the last split attends the window; planar 2-bit codes, levels by `prmt`), restricted to
what a Hadamard-rotated cache needs: no sparse residuals and no in-kernel RoPE. What differs is the
orientation of the two products, per tile of BLOCK_T tokens and channel block j (d/4 channels):

    scores  sᵀ [BLOCK_T, G]  = Σ_j  K_j [BLOCK_T, d/4] · q_jᵀ [d/4, G]
    output  accᵀ_j [d/4, G] += V_jᵀ [d/4, BLOCK_T] · (p·v_scale)ᵀ [BLOCK_T, G]

The G = H/K query heads of a KV head (4 for Mixtral) are the narrow side. tl.dot's left operand may come
from registers (mma's A fragment; Hopper's wgmma reads A from registers and only B from shared memory),
its right operand goes through shared memory. With the history on the left, the large dequantized tiles
(BLOCK_T × d per tile, 2 bytes per element once dequantized) need not be staged through shared memory;
only q (once per program) and p (BLOCK_T × 16 per tile) are. The unswapped kernel stages every
dequantized K and V element through shared memory, ~4 bytes of shared-memory traffic per element, which at
2 bits per element caps it near the SM's shared-memory bandwidth long before HBM's.

What the H200 said (Triton 3.6, CUDA-graph replays of 32 layers, Mixtral shape; nuq_attention_h200.json):
the hypothesis is wrong for Triton. The compiled TTGIR stages every unpacked tile through shared memory
all the same (`local_alloc` of the [BLOCK_T, d/4] fp16 tile, then a load into the dot-operand layout):
the level lookup runs in a blocked layout and Triton does not hoist the layout conversion above the
inline-asm lookup onto the (4x smaller) byte tile. The key product does become a wgmma (M = BLOCK_T);
the value product (M = d/4 = 32) stays mma.sync. 32k batch 16: 15.3 ms against 15.7 for the unswapped
kernel and 15.3 for SDPA on fp16; leaving the value products out: 6.3 ms. Getting the dequantized values
into registers in the MMA fragment layout needs explicit layouts (Gluon, or CUDA as BitDecoding does).

Shapes (B batch, H query heads, K KV heads, d head dim (power of two >= 64), S history capacity):
    q [B, H, d] fp16/bf16/fp32; k_codes, v_codes [B, K, S, d/4] uint8 (bitpack Layout.PLANAR, 2-bit)
    k_scale [K, d] fp32; v_scale [B, K, S] fp16; k_lev, v_lev [4] fp32 ascending; k_center [K, d] fp32 or None
    hist_len [B] int32 (multiple of BLOCK_T not required); win_k, win_v [B, K, Wc, d] fp16; win_len [B] int32
    -> out [B, H, d] fp32
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from moec.kernels.kv_decode_attention import LOG2E, NUM_SMS, _lev_table, _unpack2, combine_splits

# launch defaults on CUDA (benchmarks/bench_kv_attention.py --sweep)
CONFIG = {"block_t": 64, "num_warps": 4, "num_stages": 3, "waves": 4, "deq": 1}
_LAST: dict = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _q_t(q_ptr, qrow, gmask, ks_ptr, is_hist, qscale, j: tl.constexpr, DQ: tl.constexpr, DT: tl.constexpr):
    """qᵀ of channel block j [DQ, G_P2]: q·qscale, times the key channel scale in history programs."""
    offs_i = j * DQ + tl.arange(0, DQ)
    qj = tl.load(q_ptr + qrow[None, :] + offs_i[:, None], mask=gmask[None, :], other=0.0).to(tl.float32)
    ks = tl.where(is_hist, tl.load(ks_ptr + offs_i), 1.0)
    return (qj * (ks * qscale)[:, None]).to(DT)


@triton.jit
def _softmax_update(s, m_i, l_i, a0, a1, a2, a3, LAZY: tl.constexpr):
    """Online softmax over a score tile sᵀ [BLOCK_T, G_P2] (log2 units): p, and m, l, acc rescaled."""
    m_t = tl.max(s, axis=0)
    if LAZY:  # move the running max only when a tile exceeds it by > 8 (p stays <= 2^8): rare rescales
        grow = tl.max(m_t - m_i, axis=0) > 8.0
    else:
        grow = True
    if grow:
        m_new = tl.maximum(m_i, m_t)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        a0 = a0 * alpha[None, :]
        a1 = a1 * alpha[None, :]
        a2 = a2 * alpha[None, :]
        a3 = a3 * alpha[None, :]
        m_i = m_new
    p = tl.exp2(s - m_i[None, :])
    l_i += tl.sum(p, axis=0)
    return p, m_i, l_i, a0, a1, a2, a3


@triton.jit
def _hist_tile(qt0, qt1, qt2, qt3, qc, m_i, l_i, a0, a1, a2, a3, kc_ptr, vc_ptr, vs_ptr, klev_ptr, vlev_ptr,
               ktab_lo, ktab_hi, vtab_lo, vtab_hi, bk, t0, t_end, S,
               DQ: tl.constexpr, BLOCK_T: tl.constexpr, DEQ: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
               LAZY: tl.constexpr, CENTER: tl.constexpr, ABL: tl.constexpr):
    offs_t = tl.arange(0, BLOCK_T)
    offs_i = tl.arange(0, DQ)
    tok = t0 + offs_t
    tmask = tok < t_end
    row = (bk * S + tok) * DQ
    kb = tl.load(kc_ptr + row[:, None] + offs_i[None, :], mask=tmask[:, None], other=0)  # [BLOCK_T, DQ]
    if ABL >= 2:  # benchmark ablations (bench_nuq_attention.py --ablate): no tensor-core products
        if ABL == 3:  # loads only
            kf = kb.to(tl.float32)
        else:  # loads + level lookup
            kf = (_unpack2(kb, 0, klev_ptr, ktab_lo, ktab_hi, 2, DEQ, DT) + _unpack2(kb, 3, klev_ptr, ktab_lo,
                  ktab_hi, 2, DEQ, DT)).to(tl.float32)
        s = tl.sum(kf, axis=1)[:, None] + tl.sum(qt0.to(tl.float32), axis=0)[None, :]
    else:
        s = tl.dot(_unpack2(kb, 0, klev_ptr, ktab_lo, ktab_hi, 2, DEQ, DT), qt0, input_precision=PREC)
        s = tl.dot(_unpack2(kb, 1, klev_ptr, ktab_lo, ktab_hi, 2, DEQ, DT), qt1, s, input_precision=PREC)
        s = tl.dot(_unpack2(kb, 2, klev_ptr, ktab_lo, ktab_hi, 2, DEQ, DT), qt2, s, input_precision=PREC)
        s = tl.dot(_unpack2(kb, 3, klev_ptr, ktab_lo, ktab_hi, 2, DEQ, DT), qt3, s, input_precision=PREC)
    if CENTER:  # q·k_center, one scalar per query head
        s += qc[None, :]
    s = tl.where(tmask[:, None], s, float("-inf"))
    p, m_i, l_i, a0, a1, a2, a3 = _softmax_update(s, m_i, l_i, a0, a1, a2, a3, LAZY)
    vs = tl.load(vs_ptr + bk * S + tok, mask=tmask, other=0.0).to(tl.float32)
    pv = (p * vs[:, None]).to(DT)  # [BLOCK_T, G_P2]
    vb = tl.load(vc_ptr + row[None, :] + offs_i[:, None], mask=tmask[None, :], other=0)  # [DQ, BLOCK_T]
    if ABL >= 2:
        if ABL == 3:
            vf = vb.to(tl.float32)
        else:
            vf = (_unpack2(vb, 0, vlev_ptr, vtab_lo, vtab_hi, 2, DEQ, DT) + _unpack2(vb, 3, vlev_ptr, vtab_lo,
                  vtab_hi, 2, DEQ, DT)).to(tl.float32)
        a0 += tl.sum(vf, axis=1)[:, None] * tl.sum(pv.to(tl.float32), axis=0)[None, :]
    elif ABL == 0:  # ABL 1: the key side alone
        a0 = tl.dot(_unpack2(vb, 0, vlev_ptr, vtab_lo, vtab_hi, 2, DEQ, DT), pv, a0, input_precision=PREC)
        a1 = tl.dot(_unpack2(vb, 1, vlev_ptr, vtab_lo, vtab_hi, 2, DEQ, DT), pv, a1, input_precision=PREC)
        a2 = tl.dot(_unpack2(vb, 2, vlev_ptr, vtab_lo, vtab_hi, 2, DEQ, DT), pv, a2, input_precision=PREC)
        a3 = tl.dot(_unpack2(vb, 3, vlev_ptr, vtab_lo, vtab_hi, 2, DEQ, DT), pv, a3, input_precision=PREC)
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _win_tile(qt0, qt1, qt2, qt3, m_i, l_i, a0, a1, a2, a3, wk_ptr, wv_ptr, bk, t0, wlen, WC,
              D: tl.constexpr, BLOCK_T: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """One tile of the fp16 window, in the same orientation."""
    DQ: tl.constexpr = D // 4
    offs_t = tl.arange(0, BLOCK_T)
    offs_i = tl.arange(0, DQ)
    tok = t0 + offs_t
    tmask = tok < wlen
    row = (bk * WC + tok) * D
    kp = wk_ptr + row[:, None] + offs_i[None, :]
    km = tmask[:, None]
    s = tl.dot(tl.load(kp, mask=km, other=0.0).to(DT), qt0, input_precision=PREC)
    s = tl.dot(tl.load(kp + DQ, mask=km, other=0.0).to(DT), qt1, s, input_precision=PREC)
    s = tl.dot(tl.load(kp + 2 * DQ, mask=km, other=0.0).to(DT), qt2, s, input_precision=PREC)
    s = tl.dot(tl.load(kp + 3 * DQ, mask=km, other=0.0).to(DT), qt3, s, input_precision=PREC)
    s = tl.where(tmask[:, None], s, float("-inf"))
    p, m_i, l_i, a0, a1, a2, a3 = _softmax_update(s, m_i, l_i, a0, a1, a2, a3, False)
    p = p.to(DT)
    vp = wv_ptr + row[None, :] + offs_i[:, None]
    vm = tmask[None, :]
    a0 = tl.dot(tl.load(vp, mask=vm, other=0.0).to(DT), p, a0, input_precision=PREC)
    a1 = tl.dot(tl.load(vp + DQ, mask=vm, other=0.0).to(DT), p, a1, input_precision=PREC)
    a2 = tl.dot(tl.load(vp + 2 * DQ, mask=vm, other=0.0).to(DT), p, a2, input_precision=PREC)
    a3 = tl.dot(tl.load(vp + 3 * DQ, mask=vm, other=0.0).to(DT), p, a3, input_precision=PREC)
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _nuq_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, klev_ptr, vlev_ptr, kcen_ptr, hlen_ptr, wk_ptr, wv_ptr, wlen_ptr,
    part_ptr, H, K, S, WC, n_splits, tiles_per_split, qscale,
    D: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, BLOCK_T: tl.constexpr, DEQ: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, LAZY: tl.constexpr, STAGES: tl.constexpr, INTERP: tl.constexpr,
    CENTER: tl.constexpr, ABL: tl.constexpr,
):
    bk = tl.program_id(0)  # b·K + kv head
    split = tl.program_id(1)
    b = bk // K
    kh = bk % K
    DQ: tl.constexpr = D // 4
    offs_g = tl.arange(0, G_P2)  # the KV head's query heads, padded to >= 16 columns for tl.dot
    offs_i = tl.arange(0, DQ)
    gmask = offs_g < G
    qrow = (b * H + kh * G + offs_g) * D
    is_hist = split < n_splits - 1
    qt0 = _q_t(q_ptr, qrow, gmask, ks_ptr + kh * D, is_hist, qscale, 0, DQ, DT)
    qt1 = _q_t(q_ptr, qrow, gmask, ks_ptr + kh * D, is_hist, qscale, 1, DQ, DT)
    qt2 = _q_t(q_ptr, qrow, gmask, ks_ptr + kh * D, is_hist, qscale, 2, DQ, DT)
    qt3 = _q_t(q_ptr, qrow, gmask, ks_ptr + kh * D, is_hist, qscale, 3, DQ, DT)
    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    a0 = tl.zeros([DQ, G_P2], tl.float32)
    a1 = tl.zeros([DQ, G_P2], tl.float32)
    a2 = tl.zeros([DQ, G_P2], tl.float32)
    a3 = tl.zeros([DQ, G_P2], tl.float32)
    if is_hist:
        hlen = tl.load(hlen_ptr + b)
        t_lo = split * tiles_per_split * BLOCK_T
        t_hi = tl.minimum(t_lo + tiles_per_split * BLOCK_T, hlen)
        n_it = tl.maximum(tl.cdiv(t_hi - t_lo, BLOCK_T), 0)
        qc = tl.zeros([G_P2], tl.float32)
        if CENTER:  # q·k_center·sm_scale·log2e per query head
            offs_c = tl.arange(0, D)
            qf = tl.load(q_ptr + qrow[:, None] + offs_c[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
            qc = tl.sum(qf * tl.load(kcen_ptr + kh * D + offs_c)[None, :], axis=1) * qscale
        if DEQ == 1:
            ktab_lo, ktab_hi = _lev_table(klev_ptr)
            vtab_lo, vtab_hi = _lev_table(vlev_ptr)
        else:
            ktab_lo = 0
            ktab_hi = 0
            vtab_lo = 0
            vtab_hi = 0
        if INTERP:  # the CPU interpreter rejects range() over a runtime bound
            it = 0
            while it < n_it:
                m_i, l_i, a0, a1, a2, a3 = _hist_tile(
                    qt0, qt1, qt2, qt3, qc, m_i, l_i, a0, a1, a2, a3, kc_ptr, vc_ptr, vs_ptr, klev_ptr, vlev_ptr,
                    ktab_lo, ktab_hi, vtab_lo, vtab_hi, bk, t_lo + it * BLOCK_T, t_hi, S, DQ, BLOCK_T, DEQ, DT,
                    PREC, LAZY, CENTER, ABL)
                it += 1
        else:
            for it in tl.range(0, n_it, num_stages=STAGES):
                m_i, l_i, a0, a1, a2, a3 = _hist_tile(
                    qt0, qt1, qt2, qt3, qc, m_i, l_i, a0, a1, a2, a3, kc_ptr, vc_ptr, vs_ptr, klev_ptr, vlev_ptr,
                    ktab_lo, ktab_hi, vtab_lo, vtab_hi, bk, t_lo + it * BLOCK_T, t_hi, S, DQ, BLOCK_T, DEQ, DT,
                    PREC, LAZY, CENTER, ABL)
    else:
        wlen = tl.load(wlen_ptr + b)
        t0 = 0
        while t0 < wlen:
            m_i, l_i, a0, a1, a2, a3 = _win_tile(qt0, qt1, qt2, qt3, m_i, l_i, a0, a1, a2, a3, wk_ptr, wv_ptr,
                                                 bk, t0, wlen, WC, D, 32, DT, PREC)
            t0 += 32
    # partials [B·H, n_splits, D + 2]: acc (channels in natural order), m (log2 units), l
    out = part_ptr + ((b * H + kh * G + offs_g) * n_splits + split) * (D + 2)  # [G_P2]
    g2 = gmask[None, :]
    tl.store(out[None, :] + offs_i[:, None], a0, mask=g2)
    tl.store(out[None, :] + DQ + offs_i[:, None], a1, mask=g2)
    tl.store(out[None, :] + 2 * DQ + offs_i[:, None], a2, mask=g2)
    tl.store(out[None, :] + 3 * DQ + offs_i[:, None], a3, mask=g2)
    tl.store(out + D, m_i, mask=gmask)
    tl.store(out + D + 1, l_i, mask=gmask)


def supports(head_dim: int, bits: int, n_out: int, rope_pre: bool) -> bool:
    """Whether this kernel takes a cache: 2-bit planar codes, no sparse residuals, post-RoPE keys, power-of-two
    head_dim >= 64 (four channel blocks of >= 16 for tl.dot)."""
    return bits == 2 and n_out == 0 and not rope_pre and head_dim >= 64 and head_dim & (head_dim - 1) == 0


def nuq_attention(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, hist_len, win_k, win_v, win_len,
                  k_center: torch.Tensor | None = None, sm_scale: float | None = None,
                  n_splits: int | None = None, precision: str | None = None, block_t: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None, deq: int | None = None,
                  lazy: bool = True, waves: float | None = None, ablate: int = 0) -> torch.Tensor:
    """Decode attention (one query token per row) over the packed 2-bit history + fp16 window -> [B, H, d] fp32.
    precision "fp16" (tensor cores, fp32 accumulation; the CUDA default) or "ieee" (fp32; elsewhere).
    Launch knobs default to CONFIG. No host syncs (CUDA-graph safe). ablate (benchmarks only, wrong results):
    1 skips the value products, 2 replaces both products by reductions of the looked-up levels, 3 of the raw
    bytes (what the loads alone cost)."""
    B, H, d = q.shape
    _, K, S, dw = k_codes.shape
    assert supports(d, 2, 0, False) and dw == d // 4, (d, dw)
    assert H % K == 0 and v_codes.shape == k_codes.shape and k_codes.dtype == v_codes.dtype == torch.uint8
    assert k_scale.shape == (K, d) and k_scale.dtype == torch.float32, (k_scale.shape, k_scale.dtype)
    assert v_scale.shape == (B, K, S) and v_scale.dtype == torch.float16, (v_scale.shape, v_scale.dtype)
    assert k_lev.shape == v_lev.shape == (4,) and k_lev.dtype == v_lev.dtype == torch.float32
    assert win_k.shape == win_v.shape and win_k.shape[:2] == (B, K) and win_k.shape[3] == d, win_k.shape
    assert win_k.dtype == win_v.dtype == torch.float16
    assert hist_len.shape == win_len.shape == (B,) and hist_len.dtype == win_len.dtype == torch.int32
    if k_center is not None:
        assert k_center.shape == (K, d) and k_center.dtype == torch.float32
    for t in (q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, hist_len, win_k, win_v, win_len,
              *(() if k_center is None else (k_center,))):
        assert t.is_contiguous() and t.device == q.device, "inputs must be contiguous on one device"
    cuda = q.is_cuda and not _interpreting()
    precision = precision or ("fp16" if cuda else "ieee")
    block_t = block_t or (CONFIG["block_t"] if cuda else 16)
    deq = (CONFIG["deq"] if cuda and precision == "fp16" else 0) if deq is None else deq
    assert deq == 0 or (cuda and precision == "fp16"), "the prmt lookup is PTX (CUDA, fp16)"
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    n_tiles = triton.cdiv(S, block_t)
    if n_splits is None:
        n_splits = max(1, min(n_tiles, triton.cdiv(int((waves or CONFIG["waves"]) * NUM_SMS), B * K)))
    tps = triton.cdiv(n_tiles, max(1, min(n_splits, n_tiles)))
    P = triton.cdiv(n_tiles, tps) + 1  # the last split attends the window
    G = H // K
    part = torch.empty(B * H * P * (d + 2), device=q.device, dtype=torch.float32)
    _LAST["kernel"] = _nuq_attention_kernel[(B * K, P)](
        q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_scale if k_center is None else k_center,
        hist_len, win_k, win_v, win_len, part, H, K, S, win_k.shape[2], P, tps, sm_scale * LOG2E,
        D=d, G=G, G_P2=max(16, triton.next_power_of_2(G)), BLOCK_T=block_t, DEQ=deq,
        DT=tl.float16 if precision == "fp16" else tl.float32, PREC="ieee", LAZY=bool(lazy),
        STAGES=num_stages or CONFIG["num_stages"], INTERP=not cuda, CENTER=k_center is not None, ABL=ablate,
        num_warps=num_warps or CONFIG["num_warps"])
    return combine_splits(part, B * H, P, d).view(B, H, d)
