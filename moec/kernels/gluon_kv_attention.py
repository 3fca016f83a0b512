"""Decode attention over the 2-bit nuq KV cache in Gluon: packed codes loaded straight into the tensor-core
operand registers, dequantized there, multiplied by mma.sync — no shared-memory staging.

Why (benchmarks/swapab_attention.py, the `tl` kernel in kv_decode_attention.py): `tl` places a dequantized
K/V tile in a blocked register layout and reaches the tensor cores through a shared-memory layout conversion
of every fp16 tile; that round trip, not the bytes, bounded the kernel (13% of copy bandwidth at 32k). Gluon
lets the kernel name its register layouts, so the uint8 code tile is *loaded* in mma_v2's operand layout and
the level lookup is an in-register `prmt`: what reaches the tensor cores never leaves the thread that loaded it.

The same cache as the `tl` kernel reads (moec/formats/bitpack.py's Layout.PLANAR, 2-bit: byte i of a token's
row holds channels i, i + d/4, i + d/2, i + 3d/4 in bit fields j = 0..3), the same partial-output format
([B·H, splits, d + 2]: acc, running max in log2 units, sum) and so the same split combine
(kv_decode_attention.combine_splits, which also undoes a head_dim rotation).

How codes reach the tensor cores (one warp per program, mma.sync m16n8k16, fp16 operands, fp32 accumulation):
  - codes are loaded as int32 words (4 bytes = 16 codes) in a register layout that, after a join/reshape/
    permute of the unpacked values, *is* the mma operand layout: convert_layout(..., assert_trivial=True) holds
    at compile time, so no value moves between threads. The channel order inside a block is the one that makes
    this true (_key_channel, _value_channel); q is loaded and the output stored in that order.
  - the level lookup (gluon_moe_decode._lookup4, shared with the MoE kernel): per word and bit field a shift, a
    mask, one IMAD building the byte selectors, two `prmt` picking fp16 levels out of two registers holding the
    layer's four levels (_vector_reg keeps them in vector registers), the selector's high half by a shift: 23
    instructions per 16 codes, the levels written as fp16 pairs in 32-bit registers, the operand's own form.
  - values need a token pair per register: two tokens' words are byte-interleaved by two `prmt` (_interleave).
  - operands swapped: Sᵀ[T, N] = K·Qᵀ with tokens as M and the query heads of a KV head as N = 8 (G = 4 wastes
    half, not three quarters as M = 16 rows would), then Oᵀ_j[32, N] += Vᵀ_j·Pᵀ, Pᵀ moved between the two
    products by an intra-warp conversion: 136 registers with the next tile's loads in flight (PREFETCH).
  - lazy rescaling as in the `tl` kernel (the running max moves only when a tile's max exceeds it by > 8); the
    per-head score terms (q·center, the score bias) shift every history score of a head alike, so they are not
    added here at all: the split combine adds them to the history splits' running maxima, once per head
    (combine_splits' hist_terms; each program computing them for itself was a visible share of the kernel's
    stall samples under Nsight Compute: benchmarks/studies/ncu_kernels.py).

Measured on the H200 (benchmarks/results/gluon_kv_attention_sweep2_h200.json: kernel alone and with the split
combine, against the `tl` kernel and the fp16 cache's kernel, Mixtral and Qwen3 shapes, 4k and 32k, batch 1 and
16): faster than both at 32k and at batch 16, but issue- and latency-bound, not bandwidth-bound (SASS per code:
benchmarks/studies/gluon_sass.py; one warp per program), and at batch 1 the split combine is a large share of
the time. At 4k batch 1 the fixed cost per program and the combine lost to the `tl` kernel, so the runtime
sends it only batch · history capacity >= min_batch_tokens (faster(); kvtiered.decode_attention).

Not here (the `tl` kernel serves them): 3-bit codes, sparse fp16 outliers, pre-RoPE keys, head_dim other than
128. Gluon has no CPU interpreter, so tests/kernels/test_gluon_kv_attention.py compiles this kernel for sm_90
on the CPU (ptxas ships with triton) and the GPU smoke checks it against the torch reference
(benchmarks/gpu_smoke.py, both paths).
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from . import launch_config, pdl
from .gluon_moe_decode import _four, _lookup4
from .kv_decode_attention import LOG2E, combine_splits
from .pdl import gluon_begin

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
OP_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
OP_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
MAX_G = 16  # query heads per KV head: the mma's N is 8 or 16
HEAD_DIM = 128  # the word maps below are written for 8 words (32 bytes) of codes per token and K or V
# key words [T, 8] int32: lane (c = lane % 4, n = lane / 4) holds words 2c, 2c + 1 of tokens n + 8i (A's rows)
KEY_WORDS = gl.constexpr(gl.BlockedLayout([1, 2], [8, 4], [1, 1], [1, 0]))
# value words [T, 8] int32: lane (c, n) holds word n of tokens 2c, 2c + 1 (+ 8i)
VALUE_WORDS = gl.constexpr(gl.BlockedLayout([2, 1], [4, 8], [1, 1], [0, 1]))


@gluon.jit
def _lev_words(lev_ptr):
    """The four fp16 levels as two 32-bit words: lev0 | lev1 << 16, lev2 | lev3 << 16."""
    w0 = gl.load(lev_ptr).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    w1 = gl.load(lev_ptr + 1).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    w2 = gl.load(lev_ptr + 2).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    w3 = gl.load(lev_ptr + 3).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return w0 | (w1 << 16), w2 | (w3 << 16)


@gluon.jit
def _vector_reg(x):
    """x (a uniform value broadcast to a tensor) through a warp shuffle: ptxas then holds it in one vector
    register instead of re-copying it from a uniform register before every `prmt` that reads it."""
    return gl.inline_asm_elementwise(asm="{ .reg .b32 l; mov.u32 l, %laneid; shr.b32 l, l, 6; add.u32 $0, $1, l; }",
                                     constraints="=r,r", args=[x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _tables(kt_lo, kt_hi, vt_lo, vt_hi, T: gl.constexpr):
    """The level words as tensors in the layouts of the key words [T, 8] and of the interleaved value words
    [T/2, 8], in vector registers (_vector_reg), built once per program."""
    kz = gl.full([T, 8], 0, gl.int32, KEY_WORDS)
    vz, _ = gl.split(gl.permute(gl.reshape(gl.full([T, 8], 0, gl.int32, VALUE_WORDS), [T // 2, 2, 8]), [0, 2, 1]))
    return (_vector_reg(kz + kt_lo), _vector_reg(kz + kt_hi), _vector_reg(vz + vt_lo), _vector_reg(vz + vt_hi))


@gluon.jit
def _interleave(a, b):
    """Two words of tokens t, t + 1 -> bytes (a0, b0, a1, b1) and (a2, b2, a3, b3): a byte pair per channel."""
    return gl.inline_asm_elementwise(
        asm="prmt.b32 $0, $2, $3, 0x5140; prmt.b32 $1, $2, $3, 0x7362;",
        constraints="=r,=r,r,r", args=[a, b], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _key_channel(k):
    """Physical byte (channel within a block) of logical key row k in [0, 32) (see _key_block)."""
    return 4 * (2 * ((k % 8) // 2) + k // 16) + 2 * ((k // 8) % 2) + k % 2


@gluon.jit
def _value_channel(n):
    """Physical channel (within a block) of logical value column n in [0, 32) (see _value_block)."""
    return 4 * (n % 8) + n // 8


# Sᵀ[T, N] = K[T, 32]·Qᵀ[32, N] per channel block, Oᵀ[32, N] += Vᵀ[32, T]·Pᵀ[T, N]: tokens as the mma's M,
# query heads as N (8 or 16). The first version had the query heads as M (padded to 16 rows) and P feeding the
# PV product without a conversion (FA2's trick); swapped it ran faster in every case of
# gluon_kv_attention_sweep1_h200.json: G = 4 pads to 8, not 16, half the mmas, the softmax on T·N scores,
# half the accumulator registers; the price, Pᵀ changing layout between the two products, is a transpose
# within the warp.


@gluon.jit
def _key_block(kw, j: gl.constexpr, tab_lo, tab_hi, T: gl.constexpr):
    """Channel block j of a key tile as the A operand K [T, 32] fp16 (rows in _key_channel's order). The lookup
    yields each word's four levels packed in two 32-bit registers (gluon_moe_decode._lookup4: the operand's own
    form; four 16-bit outputs cost a register move a pair)."""
    x = _lookup4(_four(kw), _four(tab_lo), _four(tab_hi), j)  # [t, r, mh, ml]: byte 2·mh + ml of word r
    x = gl.reshape(x, [T, 4, 2, 2, 2])  # [t, c, ks, mh, ml]
    x = gl.reshape(gl.permute(x, [0, 2, 3, 1, 4]), [T, 32])  # [t, ks, mh, c, ml]
    return gl.convert_layout(x, OP_A, assert_trivial=True)


@gluon.jit
def _value_block(p0, p1, j: gl.constexpr, tab_lo, tab_hi, T: gl.constexpr):
    """Channel block j of a value tile as the A operand Vᵀ [32, T] fp16 (rows in _value_channel's order)."""
    t4 = _four(tab_lo)
    h4 = _four(tab_hi)
    y0 = _lookup4(_four(p0), t4, h4, j)  # [tp, n, m_lo, pair]: byte 2·m_lo + pair of p0 (packed as _key_block's)
    y1 = _lookup4(_four(p1), t4, h4, j)
    # [tp, n, m_lo, pair, m_hi] -> [m_hi, m_lo, n, tp, pair]
    y = gl.reshape(gl.permute(gl.join(y0, y1), [4, 2, 1, 0, 3]), [32, T])
    return gl.convert_layout(y, OP_A, assert_trivial=True)


@gluon.jit
def _load_qt(q_ptr, qbase, gmask, ks_ptr, scale_k, qscale, j: gl.constexpr, N: gl.constexpr):
    """Channel block j of the query heads as the B operand Qᵀ [32, N] fp16, rows in _key_channel's order."""
    offs_c = j * 32 + _key_channel(gl.arange(0, 32, layout=gl.SliceLayout(1, OP_B)))
    offs_g = gl.arange(0, N, layout=gl.SliceLayout(0, OP_B))
    m = gl.convert_layout(gmask, gl.SliceLayout(0, OP_B))
    q = gl.load(q_ptr + qbase + offs_g[None, :] * 128 + offs_c[:, None], mask=m[None, :], other=0.0).to(gl.float32)
    ks = gl.where(scale_k, gl.load(ks_ptr + offs_c), 1.0)
    return (q * (ks * qscale)[:, None]).to(gl.float16)


@gluon.jit
def _load_words(kc_ptr, vc_ptr, vs_ptr, row0, t0, t_hi, ktok, kword, vtok, vword, stok):
    """A history tile's key words [T, 8], value words [T, 8] (int32) and value scales [T] fp32."""
    kw = gl.load(kc_ptr + ((row0 + t0 + ktok) * 8)[:, None] + kword[None, :], mask=(t0 + ktok < t_hi)[:, None],
                 other=0)
    vw = gl.load(vc_ptr + ((row0 + t0 + vtok) * 8)[:, None] + vword[None, :], mask=(t0 + vtok < t_hi)[:, None],
                 other=0)
    vs = gl.load(vs_ptr + row0 + t0 + stok, mask=t0 + stok < t_hi, other=0.0).to(gl.float32)
    return kw, vw, vs


@gluon.jit
def _load_full(kc_ptr, vc_ptr, vs_ptr, r, koff, voff, stok):
    """A whole history tile at row r (= row0 + its first token): _load_words without masks, the rows' offsets
    hoisted out of the loop and added to one scalar base a load."""
    return (gl.load(kc_ptr + r * 8 + koff), gl.load(vc_ptr + r * 8 + voff),
            gl.load(vs_ptr + r + stok).to(gl.float32))


@gluon.jit
def _hist_tile(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, kw, vw, vs, tmask_s,
                 ktl, kth, vtl, vth, T: gl.constexpr, N: gl.constexpr, MASKED: gl.constexpr = True):
    """One history tile: scores Sᵀ [T, N], the accumulators Oᵀ_j [32, N] (MASKED: tokens past the split's end
    score -inf; a whole tile needs no mask)."""
    s = gl.zeros([T, N], gl.float32, MMA)
    s = mma_v2(_key_block(kw, 0, ktl, kth, T), q0, s)
    s = mma_v2(_key_block(kw, 1, ktl, kth, T), q1, s)
    s = mma_v2(_key_block(kw, 2, ktl, kth, T), q2, s)
    s = mma_v2(_key_block(kw, 3, ktl, kth, T), q3, s)
    if MASKED:
        s = gl.where(tmask_s[:, None], s, float("-inf"))
    m_t = gl.max(s, axis=0)
    if gl.max(m_t - m_i, axis=0) > 8.0:
        m_new = gl.maximum(m_i, m_t)
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha
        a0 = a0 * alpha[None, :]
        a1 = a1 * alpha[None, :]
        a2 = a2 * alpha[None, :]
        a3 = a3 * alpha[None, :]
        m_i = m_new
    p = gl.exp2(s - m_i[None, :])
    l_i = l_i + gl.sum(p, axis=0)
    pb = gl.convert_layout((p * vs[:, None]).to(gl.float16), OP_B)  # Pᵀ [T, N]: a transpose within the warp
    va, vb = gl.split(gl.permute(gl.reshape(vw, [T // 2, 2, 8]), [0, 2, 1]))
    p0, p1 = _interleave(va, vb)
    a0 = mma_v2(_value_block(p0, p1, 0, vtl, vth, T), pb, a0)
    a1 = mma_v2(_value_block(p0, p1, 1, vtl, vth, T), pb, a1)
    a2 = mma_v2(_value_block(p0, p1, 2, vtl, vth, T), pb, a2)
    a3 = mma_v2(_value_block(p0, p1, 3, vtl, vth, T), pb, a3)
    return m_i, l_i, a0, a1, a2, a3


@gluon.jit
def _win_tile(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, wk_ptr, wv_ptr, bk, t0, wend, WC,
                D: gl.constexpr, T: gl.constexpr, N: gl.constexpr):
    """One tile of the fp16 window (keys as A [T, 32], values as Aᵀ [32, T]), loaded straight into the A layout
    in the history's channel orders."""
    tok_m = t0 + gl.arange(0, T, layout=gl.SliceLayout(1, OP_A))
    ch_k = _key_channel(gl.arange(0, 32, layout=gl.SliceLayout(0, OP_A)))
    kptr = wk_ptr + ((bk * WC + tok_m) * D)[:, None] + ch_k[None, :]
    km = (tok_m < wend)[:, None]
    s = gl.zeros([T, N], gl.float32, MMA)
    s = mma_v2(gl.load(kptr, mask=km, other=0.0), q0, s)
    s = mma_v2(gl.load(kptr + 32, mask=km, other=0.0), q1, s)
    s = mma_v2(gl.load(kptr + 64, mask=km, other=0.0), q2, s)
    s = mma_v2(gl.load(kptr + 96, mask=km, other=0.0), q3, s)
    tok_s = t0 + gl.arange(0, T, layout=gl.SliceLayout(1, MMA))
    s = gl.where((tok_s < wend)[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + gl.sum(p, axis=0)
    pb = gl.convert_layout(p.to(gl.float16), OP_B)
    tok_k = t0 + gl.arange(0, T, layout=gl.SliceLayout(0, OP_A))
    ch_m = _value_channel(gl.arange(0, 32, layout=gl.SliceLayout(1, OP_A)))
    vptr = wv_ptr + ((bk * WC + tok_k) * D)[None, :] + ch_m[:, None]
    vm = (tok_k < wend)[None, :]
    a0 = mma_v2(gl.load(vptr, mask=vm, other=0.0), pb, a0 * alpha[None, :])
    a1 = mma_v2(gl.load(vptr + 32, mask=vm, other=0.0), pb, a1 * alpha[None, :])
    a2 = mma_v2(gl.load(vptr + 64, mask=vm, other=0.0), pb, a2 * alpha[None, :])
    a3 = mma_v2(gl.load(vptr + 96, mask=vm, other=0.0), pb, a3 * alpha[None, :])
    return m_new, l_i, a0, a1, a2, a3


@gluon.jit
def _gluon_kv_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, klev_ptr, vlev_ptr, hlen_ptr, wk_ptr, wv_ptr, wlen_ptr, part_ptr,
    H, K, S, WC, n_splits, tiles_per_split, qscale, win_splits,
    D: gl.constexpr, G: gl.constexpr, T: gl.constexpr, WCHUNK: gl.constexpr, PREFETCH: gl.constexpr,
    PDL: gl.constexpr = False,
):
    """Grid (B·K, splits): the first n_splits - win_splits splits stream tiles_per_split history tiles of T tokens
    each, the rest a WCHUNK-token chunk of the window each; one partial per (query head, split), the `tl`
    kernel's format. kc_ptr/vc_ptr: the codes as int32 words."""
    gluon_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    N: gl.constexpr = 8 if G <= 8 else 16
    bk = gl.program_id(0)
    split = gl.program_id(1)
    b = bk // K
    kh = bk % K
    is_hist = split < n_splits - win_splits

    offs_g = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
    gmask = offs_g < G
    qbase = (b * H + kh * G) * D
    q0 = _load_qt(q_ptr, qbase, gmask, ks_ptr + kh * D, is_hist, qscale, 0, N)
    q1 = _load_qt(q_ptr, qbase, gmask, ks_ptr + kh * D, is_hist, qscale, 1, N)
    q2 = _load_qt(q_ptr, qbase, gmask, ks_ptr + kh * D, is_hist, qscale, 2, N)
    q3 = _load_qt(q_ptr, qbase, gmask, ks_ptr + kh * D, is_hist, qscale, 3, N)

    m_i = gl.full([N], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
    l_i = gl.zeros([N], gl.float32, gl.SliceLayout(0, MMA))
    a0 = gl.zeros([32, N], gl.float32, MMA)
    a1 = gl.zeros([32, N], gl.float32, MMA)
    a2 = gl.zeros([32, N], gl.float32, MMA)
    a3 = gl.zeros([32, N], gl.float32, MMA)

    if is_hist:
        hlen = gl.load(hlen_ptr + b)
        t_lo = split * tiles_per_split * T
        t_hi = gl.minimum(t_lo + tiles_per_split * T, hlen)
        n_it = gl.maximum(gl.cdiv(t_hi - t_lo, T), 0)
        kt_lo, kt_hi = _lev_words(klev_ptr)
        vt_lo, vt_hi = _lev_words(vlev_ptr)
        ktl, kth, vtl, vth = _tables(kt_lo, kt_hi, vt_lo, vt_hi, T)
        kword = gl.arange(0, 8, layout=gl.SliceLayout(0, KEY_WORDS))
        ktok = gl.arange(0, T, layout=gl.SliceLayout(1, KEY_WORDS))
        vtok = gl.arange(0, T, layout=gl.SliceLayout(1, VALUE_WORDS))
        vword = gl.arange(0, 8, layout=gl.SliceLayout(0, VALUE_WORDS))
        stok = gl.arange(0, T, layout=gl.SliceLayout(1, MMA))
        row0 = bk * S
        t0 = t_lo
        if PREFETCH:  # the next tile's loads go out before this tile's math
            kw, vw, vs = _load_words(kc_ptr, vc_ptr, vs_ptr, row0, t0, t_hi, ktok, kword, vtok, vword, stok)
            # whole tiles whose next tile is whole too: no masks, addresses from hoisted pointer tensors
            n_full = gl.maximum((t_hi - t_lo) // T - 1, 0)
            koff = (ktok * 8)[:, None] + kword[None, :]
            voff = (vtok * 8)[:, None] + vword[None, :]
            for _ in range(n_full):
                kw_n, vw_n, vs_n = _load_full(kc_ptr, vc_ptr, vs_ptr, row0 + t0 + T, koff, voff, stok)
                m_i, l_i, a0, a1, a2, a3 = _hist_tile(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, kw, vw, vs,
                                                        stok >= 0, ktl, kth, vtl, vth, T, N, False)
                kw = kw_n
                vw = vw_n
                vs = vs_n
                t0 += T
            for _ in range(n_it - n_full):  # the rest (at most two tiles), masked
                kw_n, vw_n, vs_n = _load_words(kc_ptr, vc_ptr, vs_ptr, row0, t0 + T, t_hi, ktok, kword, vtok,
                                                 vword, stok)
                m_i, l_i, a0, a1, a2, a3 = _hist_tile(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, kw, vw, vs,
                                                        t0 + stok < t_hi, ktl, kth, vtl, vth, T, N)
                kw = kw_n
                vw = vw_n
                vs = vs_n
                t0 += T
        else:
            for _ in range(n_it):
                kw, vw, vs = _load_words(kc_ptr, vc_ptr, vs_ptr, row0, t0, t_hi, ktok, kword, vtok, vword, stok)
                m_i, l_i, a0, a1, a2, a3 = _hist_tile(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, kw, vw, vs,
                                                        t0 + stok < t_hi, ktl, kth, vtl, vth, T, N)
                t0 += T
        # a term per query head on every history score (q·center, the score bias) shifts only the running max:
        # exp2(s + qc - (m + qc)) = exp2(s - m), so the split combine adds it to the history splits' m, once per
        # head (combine_splits' hist_terms), not every program to its own
    else:
        t0 = (split - (n_splits - win_splits)) * WCHUNK
        wend = gl.minimum(gl.load(wlen_ptr + b), t0 + WCHUNK)
        while t0 < wend:
            m_i, l_i, a0, a1, a2, a3 = _win_tile(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, wk_ptr, wv_ptr, bk,
                                                   t0, wend, WC, D, 32, N)
            t0 += 32

    # partials: row ρ of Oᵀ_j is channel 32j + _value_channel(ρ), column g query head kh·G + g
    orow = _value_channel(gl.arange(0, 32, layout=gl.SliceLayout(1, MMA)))
    ocol = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
    out = part_ptr + ((b * H + kh * G + ocol) * n_splits + split) * (D + 2)
    om = (ocol < G)[None, :]
    gl.store(out[None, :] + orow[:, None], a0, mask=om)
    gl.store(out[None, :] + 32 + orow[:, None], a1, mask=om)
    gl.store(out[None, :] + 64 + orow[:, None], a2, mask=om)
    gl.store(out[None, :] + 96 + orow[:, None], a3, mask=om)
    gl.store(out + D, m_i, mask=ocol < G)
    gl.store(out + D + 1, l_i, mask=ocol < G)


LAUNCHES = 0  # host-side count of launches (captures under CUDA graphs): the GPU smoke records which path ran


def default_splits(B: int, S: int, T: int, cfg: dict, sms: int) -> int:
    """History splits per (sequence, KV head), from the measured optima (gluon_kv_attention_h200.json): about one
    per SM at batch 1 (fewer programs starve the memory system; more make the combine read more partials than the
    kernel saves), `splits_min` at large batches, none shorter than `tokens_min` tokens."""
    per_head = max(cfg["splits_min"], triton.cdiv(int(cfg["splits_sm"] * sms), B))
    return max(1, min(triton.cdiv(S, T), per_head, triton.cdiv(S, cfg["tokens_min"])))


def faster(B: int, S: int, device) -> bool:
    """Whether this kernel beat the `tl` kernel where measured (gluon_kv_attention_sweep2_h200.json): from a batch
    times history capacity of `min_batch_tokens` up (at 4k batch 1 its fixed per-program cost and the longer split
    combine lost; at 4k batch 16 and at 32k it won)."""
    return B * S >= launch_config.config("kv_decode_attention", device)["gluon"]["min_batch_tokens"]


def supports(bits: int, nout: int, rope, d: int, G: int) -> bool:
    """Whether this kernel serves a cache: 2-bit codes, no sparse outliers, post-RoPE keys, head_dim a
    128 (the word maps are written for it), at most 16 query heads per KV head."""
    return bits == 2 and nout == 0 and rope is None and d == HEAD_DIM and G <= MAX_G


def gluon_kv_attention(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, hist_len, win_k, win_v, win_len,
                       sm_scale: float | None = None, k_center=None, k_err2=None, out_rotation=None,
                       out_dtype: torch.dtype = torch.float32, n_splits: int | None = None,
                       block_t: int | None = None, waves: float | None = None, prefetch: bool | None = None,
                       win_chunk: int | None = None, maxnreg: int | None = None,
                       combine: bool = True, outc: int | None = None, warps: int | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """kv_decode_attention's contract for the caches `supports` accepts (CUDA only; the caller checked shapes):
    [B, H, d] in out_dtype. Launch knobs default to configs/<device>.json's kv_decode_attention.gluon."""
    global LAUNCHES
    LAUNCHES += 1
    B, H, d = q.shape
    K, S = k_codes.shape[1], k_codes.shape[2]
    G = H // K
    cfg = launch_config.config("kv_decode_attention", q.device)["gluon"]
    T = block_t or cfg["block_t"]
    prefetch = cfg["prefetch"] if prefetch is None else prefetch
    maxnreg = (cfg["maxnreg"] if G <= 8 else None) if maxnreg is None else (maxnreg or None)
    win_chunk = win_chunk or cfg["win_chunk"]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    n_tiles = triton.cdiv(S, T)
    if n_splits is None and waves is not None:  # a sweep's knob: `waves` waves of one-warp programs
        n_splits = max(1, min(n_tiles, triton.cdiv(int(waves * launch_config.num_sms(q.device)), B * K)))
    elif n_splits is None:
        n_splits = default_splits(B, S, T, cfg, launch_config.num_sms(q.device))
    warps = warps or cfg["warps"]
    tps = triton.cdiv(n_tiles, max(1, min(n_splits, n_tiles)))
    if warps > 1:  # gluon_kv_attention_wg: `warps` one-warp splits per program, combined in the program
        from .gluon_kv_attention_wg import W, _gluon_kv_attention_wg_kernel

        assert warps == W.value, f"the warp-group kernel is written for {W.value} warps"
        tps = triton.cdiv(n_tiles, max(1, min(n_splits, n_tiles) // W.value))
        tps = triton.cdiv(tps, W.value) * W.value
        win_chunk = triton.cdiv(win_chunk, 32 * W.value) * 32 * W.value
        maxnreg = cfg["maxnreg_wg"] if G <= 8 else None
    hist_splits = triton.cdiv(n_tiles, tps)
    win_splits = max(1, triton.cdiv(win_k.shape[2], win_chunk))
    P = hist_splits + win_splits
    part = torch.empty(B * H * P * (d + 2), device=q.device, dtype=torch.float32)
    args = (q, k_codes.view(torch.int32), v_codes.view(torch.int32), k_scale, v_scale, k_lev, v_lev, hist_len, win_k,
            win_v, win_len, part)
    scalars = (H, K, S, win_k.shape[2], P, tps, sm_scale * LOG2E, win_splits)
    knobs = dict(D=d, G=G, T=T, WCHUNK=win_chunk, PREFETCH=bool(prefetch), num_warps=warps, **pdl.options(q.device),
                 **({"maxnreg": maxnreg} if maxnreg else {}))
    if warps > 1:  # the W-warp kernel adds the per-head score terms itself
        _gluon_kv_attention_wg_kernel[(B * K, P)](
            *args, k_scale if k_center is None else k_center, k_scale if k_err2 is None else k_err2, *scalars,
            CENTER=k_center is not None, BIAS=k_err2 is not None, **knobs)
    else:
        _gluon_kv_attention_kernel[(B * K, P)](*args, *scalars, **knobs)
    if not combine:  # the partials alone (benchmarks time the kernel apart from the split combine; the one-warp
        return part  # kernel's history splits' m without the per-head score terms)
    qscale = sm_scale * LOG2E
    terms = None
    if warps == 1 and (k_center is not None or k_err2 is not None):
        terms = dict(q=q, k_center=k_center, k_err2=k_err2, n_hist=hist_splits, HQ=H, G=G, qscale=qscale,
                     bscale=0.5 * qscale * qscale / LOG2E)
    return combine_splits(part, B * H, P, d, out_rotation, out_dtype, cfg["combine_outc"] if outc is None else outc,
                          sinks=sinks, hist_terms=terms).view(B, H, d)
