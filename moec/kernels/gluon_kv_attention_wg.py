"""The swapped-operand Gluon decode attention (gluon_kv_attention.py) with W warps per program: each warp streams
its own tiles (tile it·W + w of the program's split) with its own running max, sum and accumulators, and the
warps' partials are combined in the program (a reduction over the leading warp axis, through shared memory)
before one partial per program is written.

Why: at batch 1 the one-warp kernel needs ~one split per SM per KV head to keep the memory system busy, and the
split combine then reads that many partials per query head (a quarter of the attention time on the Mixtral
shape at 32k, more on Qwen3's: gluon_kv_attention_sweep2_h200.json, latency_gluon_h200.json). W warps per
program write W times fewer partials for the same warps in flight, and share the program's prologue cost. Every
tensor of the one-warp kernel gains a leading axis of W, the warp (mma_v2's batch dimension: warps_per_cta
[W, 1, 1]); the maps from codes to operand registers are the same.
The running max moves every tile (no lazy rescaling: its branch would need the warps to agree). The per-head
score terms (q·center, the score bias) are computed here, once per program (the one-warp kernel leaves them to
the split combine: a program of W warps pays them once for W warps' splits, and the combine computing them cost
the 4-warp launch more than it saved, benchmarks/studies/kv_splits_sweep.py).

Status: checked against the torch reference by the GPU smoke (benchmarks/gpu_smoke.py, both Gluon KV paths)
and chosen per device by benchmarks/choose_gluon_config.py from bench_gluon_kv_attention.py's sweep
(moec/kernels/configs/: the H100 runs this kernel, the H200 the one-warp one; figures in docs/results.md).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .gluon_kv_attention import (
    _interleave,
    _key_channel,
    _lev_words,
    _value_channel,
    _vector_reg,
)
from .pdl import gluon_begin

W = gl.constexpr(4)
LN2_INV = gl.constexpr(1.4426950408889634)  # log2 e
MMA3 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
A3 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=2))
B3 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=2))
KEY_WORDS3 = gl.constexpr(gl.BlockedLayout([1, 1, 2], [1, 8, 4], [4, 1, 1], [2, 1, 0]))
VALUE_WORDS3 = gl.constexpr(gl.BlockedLayout([1, 2, 1], [1, 4, 8], [4, 1, 1], [1, 2, 0]))
ROW3 = gl.constexpr(gl.SliceLayout(1, MMA3))  # [W, N]: one value per warp and query head
TOK3 = gl.constexpr(gl.SliceLayout(2, MMA3))  # [W, T]: one value per warp and token


@gluon.jit
def _unpack4(w, j: gl.constexpr, tab_lo, tab_hi):
    """Bit field j of the four bytes of each int32 word -> four fp16 levels (byte order). Per word: shift, mask,
    selector byte = code·0x22 + 0x10 (nibbles 2c, 2c + 1: level c's two bytes in {tab_hi, tab_lo}), two `prmt`;
    the selector's high half by a shift. Shifts, not multiply-highs: Hopper issues IMAD.HI at a quarter of the
    rate of SHF, LOP3, IMAD and PRMT (benchmarks/studies/int_pipe_throughput.py: 32 against ~124 lanes per clock
    per SM on an H100); until 2026-12-06 both shifts were multiply-highs. The one-warp kernel reads its levels
    through gluon_moe_decode._lookup4 and an unmasked loop over whole tiles; the same change here made this kernel
    slower at most split counts (benchmarks/results/kv_splits_lean_h100.json), so it keeps this unpacking."""
    return gl.inline_asm_elementwise(
        asm=f"""{{
        .reg .b32 r, s, t, u, v;
        shr.b32 r, $4, {2 * j};
        and.b32 r, r, 0x03030303;
        mad.lo.u32 s, r, 34, 0x10101010;
        prmt.b32 u, $5, $6, s;
        shr.b32 t, s, 16;
        prmt.b32 v, $5, $6, t;
        mov.b32 {{$0, $1}}, u;
        mov.b32 {{$2, $3}}, v;
        }}""",
        constraints="=h,=h,=h,=h,r,r,r",
        args=[w, tab_lo, tab_hi], dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=1)


@gluon.jit
def _key_block3(kw, j: gl.constexpr, tab_lo, tab_hi, T: gl.constexpr):
    """Channel block j of the warps' key tiles as the A operand K [W, T, 32] (rows in _key_channel's order)."""
    e0, e1, e2, e3 = _unpack4(kw, j, tab_lo, tab_hi)
    x = gl.join(gl.join(e0, e1), gl.join(e2, e3))  # [w, t, r, ml, mh]
    x = gl.reshape(x, [W, T, 4, 2, 2, 2])  # [w, t, c, ks, ml, mh]
    x = gl.reshape(gl.permute(x, [0, 1, 3, 5, 2, 4]), [W, T, 32])  # [w, t, ks, mh, c, ml]
    return gl.convert_layout(x, A3, assert_trivial=True)


@gluon.jit
def _value_block3(p0, p1, j: gl.constexpr, tab_lo, tab_hi, T: gl.constexpr):
    """Channel block j of the warps' value tiles as the A operand Vᵀ [W, 32, T] (rows in _value_channel's order)."""
    h00, h01, h10, h11 = _unpack4(p0, j, tab_lo, tab_hi)
    h20, h21, h30, h31 = _unpack4(p1, j, tab_lo, tab_hi)
    y = gl.join(gl.join(gl.join(h00, h01), gl.join(h10, h11)), gl.join(gl.join(h20, h21), gl.join(h30, h31)))
    # [w, tp, n, pair, m_lo, m_hi] -> [w, m_hi, m_lo, n, tp, pair]
    y = gl.reshape(gl.permute(y, [0, 5, 4, 2, 1, 3]), [W, 32, T])
    return gl.convert_layout(y, A3, assert_trivial=True)


@gluon.jit
def _load_qt3(q_ptr, qbase, G, ks_ptr, scale_k, qscale, j: gl.constexpr, N: gl.constexpr):
    """Channel block j of the query heads as the B operand Qᵀ [W, 32, N] (every warp the same)."""
    w = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, B3)))
    c = j * 32 + _key_channel(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, B3))))
    g = gl.arange(0, N, layout=gl.SliceLayout(0, gl.SliceLayout(1, B3)))
    off = 0 * w[:, None, None] + c[None, :, None] + g[None, None, :] * 128
    q = gl.load(q_ptr + qbase + off, mask=(g < G)[None, None, :] & (w >= 0)[:, None, None], other=0.0)
    ks = gl.where(scale_k, gl.load(ks_ptr + c), 1.0)
    return (q.to(gl.float32) * (ks * qscale)[None, :, None]).to(gl.float16)


@gluon.jit
def _q_cols3(q_ptr, qbase, G, c_ptr, D: gl.constexpr, N: gl.constexpr, SQUARE: gl.constexpr):
    """Σ_c q_c·c_c (SQUARE: q_c²·c_c) per query head, [N] fp32 in the layout of one warp's row of ROW3."""
    L2: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 4], [1, 0])
    offs_g = gl.arange(0, N, layout=gl.SliceLayout(1, L2))
    offs_c = gl.arange(0, D, layout=gl.SliceLayout(0, L2))
    q = gl.load(q_ptr + qbase + offs_g[:, None] * D + offs_c[None, :], mask=(offs_g < G)[:, None], other=0.0)
    q = q.to(gl.float32)
    if SQUARE:
        q = q * q
    r = gl.sum(q * gl.load(c_ptr + offs_c)[None, :], axis=1)
    return gl.convert_layout(r, gl.SliceLayout(0, ROW3))


@gluon.jit
def _load_words3(kc_ptr, vc_ptr, vs_ptr, row0, t0, t_hi, T: gl.constexpr):
    """The warps' tiles: warp w reads tokens t0 + w·T + [0, T): key words, value words [W, T, 8], scales [W, T]."""
    kw_w = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, KEY_WORDS3)))
    kw_t = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(2, KEY_WORDS3)))
    kw_r = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, KEY_WORDS3)))
    ktok = t0 + kw_w[:, None] * T + kw_t[None, :]  # [W, T]
    kw = gl.load(kc_ptr + ((row0 + ktok) * 8)[:, :, None] + kw_r[None, None, :], mask=(ktok < t_hi)[:, :, None],
                 other=0)
    vw_w = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, VALUE_WORDS3)))
    vw_t = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(2, VALUE_WORDS3)))
    vw_r = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, VALUE_WORDS3)))
    vtok = t0 + vw_w[:, None] * T + vw_t[None, :]
    vw = gl.load(vc_ptr + ((row0 + vtok) * 8)[:, :, None] + vw_r[None, None, :], mask=(vtok < t_hi)[:, :, None],
                 other=0)
    s_w = gl.arange(0, W, layout=gl.SliceLayout(1, TOK3))
    s_t = gl.arange(0, T, layout=gl.SliceLayout(0, TOK3))
    stok = t0 + s_w[:, None] * T + s_t[None, :]
    vs = gl.load(vs_ptr + row0 + stok, mask=stok < t_hi, other=0.0).to(gl.float32)
    return kw, vw, vs, stok < t_hi


@gluon.jit
def _tables3(kt_lo, kt_hi, vt_lo, vt_hi, T: gl.constexpr):
    kz = gl.full([W, T, 8], 0, gl.int32, KEY_WORDS3)
    vz, _ = gl.split(gl.permute(gl.reshape(gl.full([W, T, 8], 0, gl.int32, VALUE_WORDS3), [W, T // 2, 2, 8]),
                                [0, 1, 3, 2]))
    return (_vector_reg(kz + kt_lo), _vector_reg(kz + kt_hi), _vector_reg(vz + vt_lo), _vector_reg(vz + vt_hi))


@gluon.jit
def _softmax_pv(s, tmask, vs, m_i, l_i, a0, a1, a2, a3, p0, p1, vtl, vth, T: gl.constexpr):
    """The online-softmax update of every warp (no lazy rescaling; a warp whose tiles were all masked keeps
    -inf and weight 0) and Oᵀ_j += Vᵀ_j·Pᵀ from the value words' interleaved pairs p0, p1."""
    s = gl.where(tmask[:, :, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.where(m_new == float("-inf"), 1.0, gl.exp2(m_i - m_new))
    p = gl.exp2(s - gl.where(m_new == float("-inf"), 0.0, m_new)[:, None, :])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    pb = gl.convert_layout((p * vs[:, :, None]).to(gl.float16), B3)
    a0 = mma_v2(_value_block3(p0, p1, 0, vtl, vth, T), pb, a0 * alpha[:, None, :])
    a1 = mma_v2(_value_block3(p0, p1, 1, vtl, vth, T), pb, a1 * alpha[:, None, :])
    a2 = mma_v2(_value_block3(p0, p1, 2, vtl, vth, T), pb, a2 * alpha[:, None, :])
    a3 = mma_v2(_value_block3(p0, p1, 3, vtl, vth, T), pb, a3 * alpha[:, None, :])
    return m_new, l_i, a0, a1, a2, a3


@gluon.jit
def _hist_tile3(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, kw, vw, vs, tmask, ktl, kth, vtl, vth, T: gl.constexpr,
                N: gl.constexpr):
    s = gl.zeros([W, T, N], gl.float32, MMA3)
    s = mma_v2(_key_block3(kw, 0, ktl, kth, T), q0, s)
    s = mma_v2(_key_block3(kw, 1, ktl, kth, T), q1, s)
    s = mma_v2(_key_block3(kw, 2, ktl, kth, T), q2, s)
    s = mma_v2(_key_block3(kw, 3, ktl, kth, T), q3, s)
    va, vb = gl.split(gl.permute(gl.reshape(vw, [W, T // 2, 2, 8]), [0, 1, 3, 2]))
    p0, p1 = _interleave(va, vb)
    return _softmax_pv(s, tmask, vs, m_i, l_i, a0, a1, a2, a3, p0, p1, vtl, vth, T)


@gluon.jit
def _win_tile3(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, wk_ptr, wv_ptr, bk, t0, wend, WC, D: gl.constexpr,
               N: gl.constexpr):
    """32 window tokens per warp (warp w: t0 + 32w + [0, 32)), fp16, loaded straight into the A layout."""
    T: gl.constexpr = 32
    kw_ = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, A3)))
    kt = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(2, A3)))
    kc = _key_channel(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, A3))))
    ktok = t0 + kw_[:, None] * T + kt[None, :]
    kptr = wk_ptr + ((bk * WC + ktok) * D)[:, :, None] + kc[None, None, :]
    km = (ktok < wend)[:, :, None]
    s = gl.zeros([W, T, N], gl.float32, MMA3)
    s = mma_v2(gl.load(kptr, mask=km, other=0.0), q0, s)
    s = mma_v2(gl.load(kptr + 32, mask=km, other=0.0), q1, s)
    s = mma_v2(gl.load(kptr + 64, mask=km, other=0.0), q2, s)
    s = mma_v2(gl.load(kptr + 96, mask=km, other=0.0), q3, s)
    s_w = gl.arange(0, W, layout=gl.SliceLayout(1, TOK3))
    s_t = gl.arange(0, T, layout=gl.SliceLayout(0, TOK3))
    tmask = (t0 + s_w[:, None] * T + s_t[None, :]) < wend
    s = gl.where(tmask[:, :, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.where(m_new == float("-inf"), 1.0, gl.exp2(m_i - m_new))
    p = gl.exp2(s - gl.where(m_new == float("-inf"), 0.0, m_new)[:, None, :])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    pb = gl.convert_layout(p.to(gl.float16), B3)
    vw_ = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(1, A3)))
    vc = _value_channel(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, A3))))
    vt = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(1, A3)))
    vtok = t0 + vw_[:, None] * T + vt[None, :]  # [W, T]
    vptr = wv_ptr + ((bk * WC + vtok) * D)[:, None, :] + vc[None, :, None]
    vm = (vtok < wend)[:, None, :]
    a0 = mma_v2(gl.load(vptr, mask=vm, other=0.0), pb, a0 * alpha[:, None, :])
    a1 = mma_v2(gl.load(vptr + 32, mask=vm, other=0.0), pb, a1 * alpha[:, None, :])
    a2 = mma_v2(gl.load(vptr + 64, mask=vm, other=0.0), pb, a2 * alpha[:, None, :])
    a3 = mma_v2(gl.load(vptr + 96, mask=vm, other=0.0), pb, a3 * alpha[:, None, :])
    return m_new, l_i, a0, a1, a2, a3


@gluon.jit
def _store_combined(part_ptr, b, H, kh, G, n_splits, split, m_i, l_i, a0, a1, a2, a3, qc, D: gl.constexpr,
                    N: gl.constexpr):
    """The warps' partials combined (max over warps, rescaled sums) and written as the program's one partial."""
    M = gl.max(m_i, axis=0)  # [N]
    sc = gl.where(m_i == float("-inf"), 0.0, gl.exp2(m_i - gl.where(M == float("-inf"), 0.0, M)[None, :]))
    l_c = gl.sum(l_i * sc, axis=0)
    o0 = gl.sum(a0 * sc[:, None, :], axis=0)  # [32, N]
    o1 = gl.sum(a1 * sc[:, None, :], axis=0)
    o2 = gl.sum(a2 * sc[:, None, :], axis=0)
    o3 = gl.sum(a3 * sc[:, None, :], axis=0)
    OL: gl.constexpr = o0.type.layout
    rows = _value_channel(gl.arange(0, 32, layout=gl.SliceLayout(1, OL)))
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, OL))
    out = part_ptr + ((b * H + kh * G + cols) * n_splits + split) * (D + 2)
    om = (cols < G)[None, :]
    gl.store(out[None, :] + rows[:, None], o0, mask=om)
    gl.store(out[None, :] + 32 + rows[:, None], o1, mask=om)
    gl.store(out[None, :] + 64 + rows[:, None], o2, mask=om)
    gl.store(out[None, :] + 96 + rows[:, None], o3, mask=om)
    mcols = gl.arange(0, N, layout=M.type.layout)
    gl.store(part_ptr + ((b * H + kh * G + mcols) * n_splits + split) * (D + 2) + D, M + qc, mask=mcols < G)
    gl.store(part_ptr + ((b * H + kh * G + mcols) * n_splits + split) * (D + 2) + D + 1,
             gl.convert_layout(l_c, M.type.layout), mask=mcols < G)


@gluon.jit
def _gluon_kv_attention_wg_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, klev_ptr, vlev_ptr, hlen_ptr, wk_ptr, wv_ptr, wlen_ptr, part_ptr,
    kcen_ptr, kerr_ptr,
    H, K, S, WC, n_splits, tiles_per_split, qscale, win_splits,
    D: gl.constexpr, G: gl.constexpr, T: gl.constexpr, CENTER: gl.constexpr, BIAS: gl.constexpr,
    WCHUNK: gl.constexpr, PREFETCH: gl.constexpr,
    PDL: gl.constexpr = False,
):
    """The one-warp swapped kernel's grid and partials, W warps per program (tiles_per_split counts each
    program's tiles, a multiple of W; WCHUNK a multiple of 32·W)."""
    gluon_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    N: gl.constexpr = 8 if G <= 8 else 16
    bk = gl.program_id(0)
    split = gl.program_id(1)
    b = bk // K
    kh = bk % K
    is_hist = split < n_splits - win_splits
    qbase = (b * H + kh * G) * D
    q0 = _load_qt3(q_ptr, qbase, G, ks_ptr + kh * D, is_hist, qscale, 0, N)
    q1 = _load_qt3(q_ptr, qbase, G, ks_ptr + kh * D, is_hist, qscale, 1, N)
    q2 = _load_qt3(q_ptr, qbase, G, ks_ptr + kh * D, is_hist, qscale, 2, N)
    q3 = _load_qt3(q_ptr, qbase, G, ks_ptr + kh * D, is_hist, qscale, 3, N)
    m_i = gl.full([W, N], float("-inf"), gl.float32, ROW3)
    l_i = gl.zeros([W, N], gl.float32, ROW3)
    a0 = gl.zeros([W, 32, N], gl.float32, MMA3)
    a1 = gl.zeros([W, 32, N], gl.float32, MMA3)
    a2 = gl.zeros([W, 32, N], gl.float32, MMA3)
    a3 = gl.zeros([W, 32, N], gl.float32, MMA3)
    qc = gl.zeros([N], gl.float32, gl.SliceLayout(0, ROW3))
    if is_hist:
        hlen = gl.load(hlen_ptr + b)
        t_lo = split * tiles_per_split * T
        t_hi = gl.minimum(t_lo + tiles_per_split * T, hlen)
        n_it = gl.maximum(gl.cdiv(t_hi - t_lo, T * W), 0)  # rounds of W tiles
        if CENTER:
            qc = qc + _q_cols3(q_ptr, qbase, G, kcen_ptr + kh * D, D, N, False) * qscale
        if BIAS:
            qc = qc + _q_cols3(q_ptr, qbase, G, kerr_ptr + kh * D, D, N, True) * (0.5 * qscale * qscale / LN2_INV)
        kt_lo, kt_hi = _lev_words(klev_ptr)
        vt_lo, vt_hi = _lev_words(vlev_ptr)
        ktl, kth, vtl, vth = _tables3(kt_lo, kt_hi, vt_lo, vt_hi, T)
        row0 = bk * S
        t0 = t_lo
        if PREFETCH:
            kw, vw, vs, tm = _load_words3(kc_ptr, vc_ptr, vs_ptr, row0, t0, t_hi, T)
            for _ in range(n_it):
                kw_n, vw_n, vs_n, tm_n = _load_words3(kc_ptr, vc_ptr, vs_ptr, row0, t0 + T * W, t_hi, T)
                m_i, l_i, a0, a1, a2, a3 = _hist_tile3(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, kw, vw, vs, tm,
                                                       ktl, kth, vtl, vth, T, N)
                kw = kw_n
                vw = vw_n
                vs = vs_n
                tm = tm_n
                t0 += T * W
        else:
            for _ in range(n_it):
                kw, vw, vs, tm = _load_words3(kc_ptr, vc_ptr, vs_ptr, row0, t0, t_hi, T)
                m_i, l_i, a0, a1, a2, a3 = _hist_tile3(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, kw, vw, vs, tm,
                                                       ktl, kth, vtl, vth, T, N)
                t0 += T * W
    else:
        t0 = (split - (n_splits - win_splits)) * WCHUNK
        wend = gl.minimum(gl.load(wlen_ptr + b), t0 + WCHUNK)
        while t0 < wend:
            m_i, l_i, a0, a1, a2, a3 = _win_tile3(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, wk_ptr, wv_ptr, bk, t0,
                                                  wend, WC, D, N)
            t0 += 32 * W
    _store_combined(part_ptr, b, H, kh, G, n_splits, split, m_i, l_i, a0, a1, a2, a3, qc, D, N)
