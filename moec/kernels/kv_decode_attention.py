"""Fused decode attention over a tiered nuq-outlier KV cache (seed 003), flash-decoding style.

One query token per sequence attends to
    history: packed 2/3-bit codes in moec/formats/bitpack.py's Layout.PLANAR (2-bit: byte i of
             a token's row holds channels i, i+d/4, i+d/2, i+3d/4), keys k = k_lev[code]·k_scale[c]
             (+ sparse residuals), values v = v_lev[code]·v_scale[t] (+ sparse residuals); the
             residuals are kept per cache block of `block` tokens as int16 index t·d + c, fp16 value
    window:  fp16 keys/values of the sinks and the most recent tokens
Each program (batch row b, KV head, split s) streams its share of the history in tiles of BLOCK_T
tokens (one or more cache blocks) or, for the last splits, a chunk of the window, and keeps an online softmax; it
writes partial (max, sum, acc) and a small reduce kernel combines the splits (split-K over the
context). The dequantized history never leaves registers.

Why it is shaped this way (the history is 2 bits per element, so the kernel is bound by the
per-element work, not by bytes, unless that work is a handful of instructions):
  - planar codes: a contiguous [BLOCK_T, d/4] byte tile unpacks with shifts 0/2/4/6 into four
    [BLOCK_T, d/4] channel blocks j (channels j·d/4 + i); q·k = sum_j q_j·k_j and acc_j += p·v_j
    work in that order, so there are no per-channel byte gathers.
  - the key channel scale is folded into q once per program (q' = q·k_scale·sm_scale·log2 e) and
    the per-token value scale into p, so a code maps to a level and nothing else.
  - level lookup on the GPU (DEQ=1): one PTX `prmt` per two codes picks fp16 levels out of a
    register holding the four levels of the layer; 2-bit codes of four bytes become eight fp16
    values in ~6 instructions. DEQ=0 (portable, the CPU interpreter and 3-bit): a select tree.
  - fp16 dot inputs with fp32 accumulation (tensor cores); the G = H/K query heads of a KV head
    are padded to 16 rows (tl.dot's minimum).
  - lazy rescaling (LAZY): the running max is only moved when a tile's max exceeds it by more
    than 8 (log2 units), so the [G, d] accumulator is rarely rescaled; p stays <= 2^8.
  - sparse residuals: key residuals as a one-hot product per tile, scores += (q[c_o]·r_o)·onehot(t_o)
    (or, out_mode 2, atomic adds into a per-program [G, BLOCK_T] scratch); value residuals
    p[t_o]·r_o (p gathered by a one-hot product) are atomically added into a per-program [G, d]
    scratch, rescaled with the running max and added to acc at the end (out_mode 1, default), or
    enter as one-hot products over the channels (out_mode 0).
  - pre-RoPE keys (KVQuant), option `rope`: the key tile is scaled (and centered), then each pair
    (c, c + d/2) = blocks (0, 2), (1, 3) is rotated in registers with cos/sin of the fp32 angle
    (pos · inv_freq); a key residual adds r·(q[c]·cos ± q[partner]·sin) to its token's score.
  - key centers (nuq.NUQCenteredCodec, option `k_center`): pre-RoPE they are added to the key
    tile before the rotation; post-RoPE q·center is one scalar per query head, added to every
    history score of the program.

Status (Mixtral shape, 32 layers per step, on the H200; timings in benchmarks/results/kv_attention_h200.json
against SDPA flash on the fp16 cache): with the sparse residuals (post-RoPE centered keys, 0.8% outliers)
the kernel is far from the bandwidth bound, and the residuals take most of its time; neither atomics nor
one-hot products (out_mode) nor a power-of-two outlier count changes that much. Pre-RoPE keys rotated in
registers cost several times more (sin/cos per element). More splits at batch 1 are slower, so the
per-program fixed cost (scratch zeroing, partial writes) matters too. What bounds it (estimates, no
counters): the dequantized fp16 tiles reach the tensor cores through a shared-memory layout conversion
(a tile row per token and KV head), tl.dot's 16-row minimum pads the G = 4 query heads to 16 rows, and
the outlier path raises the registers per thread (fewer warps in flight).

Shapes (B batch, H query heads, K KV heads, d head dim, S history capacity in tokens, NB = S / block,
NOUT outliers per block, Wc window capacity):
    q       [B, H, d]           fp16/bf16/fp32
    k_codes [B, K, S, d·bits/8] uint8      v_codes  same
    k_scale [K, d]              fp32       v_scale  [B, K, S] fp16
    k_lev, v_lev [2^bits]       fp32 (ascending)
    k_oidx, v_oidx [B, K, NB, NOUT] int16  k_oval, v_oval  [B, K, NB, NOUT] fp16
    hist_len [B] int32 (a multiple of block), win_k/win_v [B, K, Wc, d] fp16, win_len [B] int32
    -> out [B, H, d] fp32
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..formats.bitpack import unpack_planar
from . import launch_config, pdl
from .pdl import begin as pdl_begin

LOG2E = 1.4426950408889634
# Launch settings on CUDA, from configs/<device>.json (launch_config; the names below are the defaults,
# tuned on the H200): CONFIG (residual), with sparse residuals: the fastest of
# benchmarks/bench_kv_attention.py --sweep at 32k batch 16 (results/kv_attention_sweep_h200.json);
# CONFIG_DENSE (dense), without them (a Hadamard-rotated cache, moec/recipes/kv-nuq2-rot.yaml): the fastest of
# benchmarks/studies/bench_nuq_attention.py --sweep-runtime, CUDA-graph replays (results/nuq_attention_h200.json):
# 64-token tiles, 3 stages, `waves` waves of programs when there are few (batch · KV heads <= `many`),
# `waves_many` when there are many. The split count is sized in waves of the device's SMs
# (launch_config.num_sms).
CONFIG = launch_config.defaults()["kv_decode_attention"]["residual"]
CONFIG_DENSE = launch_config.defaults()["kv_decode_attention"]["dense"]
NUM_SMS = launch_config.defaults()["device"]["sms"]  # the defaults' count, for scripts; launches ask num_sms


_LAST: dict = {}  # the last compiled kernel (registers / spills for the benchmark's sweep)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _levels_select(code, lev_ptr, BITS: tl.constexpr, DT: tl.constexpr):
    """lev[code] by a select tree on the code bits (portable; no per-element gather)."""
    l0 = tl.load(lev_ptr).to(DT)
    l1 = tl.load(lev_ptr + 1).to(DT)
    l2 = tl.load(lev_ptr + 2).to(DT)
    l3 = tl.load(lev_ptr + 3).to(DT)
    b0 = (code & 1) != 0
    lo = tl.where((code & 2) != 0, tl.where(b0, l3, l2), tl.where(b0, l1, l0))
    if BITS == 3:
        l4 = tl.load(lev_ptr + 4).to(DT)
        l5 = tl.load(lev_ptr + 5).to(DT)
        l6 = tl.load(lev_ptr + 6).to(DT)
        l7 = tl.load(lev_ptr + 7).to(DT)
        hi = tl.where((code & 2) != 0, tl.where(b0, l7, l6), tl.where(b0, l5, l4))
        lo = tl.where((code & 4) != 0, hi, lo)
    return lo


@triton.jit
def _lev_table(lev_ptr):
    """The four fp16 levels as two 32-bit words (lev0 | lev1 << 16, lev2 | lev3 << 16) for prmt."""
    w0 = tl.load(lev_ptr).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    w1 = tl.load(lev_ptr + 1).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    w2 = tl.load(lev_ptr + 2).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    w3 = tl.load(lev_ptr + 3).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return w0 | (w1 << 16), w2 | (w3 << 16)


@triton.jit
def _unpack2(b, j: tl.constexpr, lev_ptr, tab_lo, tab_hi, BITS: tl.constexpr, DEQ: tl.constexpr,
             DT: tl.constexpr):
    """Byte tile b [N, d/4] uint8 -> levels of its j-th 2-bit field [N, d/4] (channels j·d/4 + i)."""
    if DEQ == 1:
        # per 4 bytes: shift, mask, selector = code·0x22 + 0x10 per byte (nibbles 2c, 2c+1: the two
        # bytes of fp16 level c in {tab_hi, tab_lo}), two prmt -> 4 fp16 levels
        return tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .b32 r, s, t;
            shr.b32 r, $2, {2 * j};
            and.b32 r, r, 0x03030303;
            mul.lo.u32 s, r, 34;
            add.u32 s, s, 0x10101010;
            prmt.b32 $0, $3, $7, s;
            shr.b32 t, s, 16;
            prmt.b32 $1, $3, $7, t;
            }}""",
            constraints="=r,=r,r,r,r,r,r,r,r,r,r",
            args=[b, tab_lo, tab_hi], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return _levels_select((b.to(tl.int32) >> (2 * j)) & 3, lev_ptr, BITS, DT)


@triton.jit
def _levels(b, b32, h32, hsh, j: tl.constexpr, lev_ptr, tab_lo, tab_hi, BITS: tl.constexpr, DEQ: tl.constexpr,
            DT: tl.constexpr):
    """Levels of channel block j [N, d/4] from the byte tile (3-bit: plus the high-bit plane)."""
    if BITS == 3:
        return _levels_select(((b32 >> (2 * j)) & 3) | (((h32 >> (2 * j + hsh)) & 1) << 2), lev_ptr, BITS, DT)
    else:
        return _unpack2(b, j, lev_ptr, tab_lo, tab_hi, BITS, DEQ, DT)


@triton.jit
def _read_and_clear(ptr, mask):
    """Atomic exchange with 0 of fp32 scratch cells (as int32: the interpreter exchanges integers only);
    an atomic, so the software pipeliner never hoists it above the adds it must see. 0 where masked."""
    old = tl.atomic_xchg(ptr.to(tl.pointer_type(tl.int32)), tl.zeros(ptr.shape, tl.int32), mask=mask,
                         sem="relaxed")
    return tl.where(mask, old.to(tl.float32, bitcast=True), 0.0)


@triton.jit
def _rescale_scratch(sc_ptr, alpha, D: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr):
    """scratch[g, :] *= alpha[g] for the value-outlier scratch (a rare event under lazy rescaling)."""
    offs_g = tl.arange(0, G_P2)
    offs_c = tl.arange(0, D)
    ptr = sc_ptr + offs_g[:, None] * D + offs_c[None, :]
    gm = (offs_g < G)[:, None]
    tl.debug_barrier()  # every earlier add has landed
    x = _read_and_clear(ptr, gm)
    tl.atomic_add(ptr, x * alpha[:, None], mask=gm, sem="relaxed")
    tl.debug_barrier()  # ... and no later add lands before the rescale


@triton.jit
def _tile(q0, q1, q2, q3, qo_ptr, qscale, m_i, l_i, a0, a1, a2, a3,
          kc_ptr, vc_ptr, vs_ptr, klev_ptr, vlev_ptr, ktab_lo, ktab_hi, vtab_lo, vtab_hi,
          koi_ptr, kov_ptr, voi_ptr, vov_ptr, sc_ptr, ks_ptr, kcen_ptr, qc, inv_ptr, pos0, bk, t0, t_end, S, NB,
          D: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
          BLOCK_T: tl.constexpr, NOUT: tl.constexpr, NOUT_P2: tl.constexpr, DEQ: tl.constexpr, DT: tl.constexpr,
          PREC: tl.constexpr, LAZY: tl.constexpr, OUT: tl.constexpr, ROPE: tl.constexpr, CENTER: tl.constexpr,
          ADDQ: tl.constexpr):
    """One history tile of BLOCK_T tokens starting at t0 (a multiple of BLOCK): online-softmax update."""
    DQ: tl.constexpr = D // 4
    DW: tl.constexpr = D * BITS // 8
    offs_t = tl.arange(0, BLOCK_T)
    offs_i = tl.arange(0, DQ)
    tok = t0 + offs_t
    tmask = tok < t_end
    row = (bk * S + tok) * DW
    ptr = row[:, None] + offs_i[None, :]
    kb = tl.load(kc_ptr + ptr, mask=tmask[:, None], other=0)  # [BLOCK_T, DQ] uint8
    vb = tl.load(vc_ptr + ptr, mask=tmask[:, None], other=0)
    if BITS == 3:  # high-bit plane: channel i + j·DQ sits in byte (i % (DQ/2)), bit 2j + i // (DQ/2)
        hptr = row[:, None] + DQ + (offs_i % (DQ // 2))[None, :]
        hsh = (offs_i // (DQ // 2))[None, :]
        kh = tl.load(kc_ptr + hptr, mask=tmask[:, None], other=0).to(tl.int32)
        vh = tl.load(vc_ptr + hptr, mask=tmask[:, None], other=0).to(tl.int32)
        kb32 = kb.to(tl.int32)
        vb32 = vb.to(tl.int32)
    else:
        hsh = 0
        kh = 0
        vh = 0
        kb32 = 0
        vb32 = 0
    vs = tl.load(vs_ptr + bk * S + tok, mask=tmask, other=0.0).to(tl.float32)  # [BLOCK_T]

    # scores (log2 units) [G_P2, BLOCK_T]
    if ROPE:  # pre-RoPE keys: scale, then rotate the pairs (c, c + d/2) = blocks (0, 2) and (1, 3)
        k0 = _levels(kb, kb32, kh, hsh, 0, klev_ptr, ktab_lo, ktab_hi, BITS, DEQ, DT).to(tl.float32)
        k1 = _levels(kb, kb32, kh, hsh, 1, klev_ptr, ktab_lo, ktab_hi, BITS, DEQ, DT).to(tl.float32)
        k2 = _levels(kb, kb32, kh, hsh, 2, klev_ptr, ktab_lo, ktab_hi, BITS, DEQ, DT).to(tl.float32)
        k3 = _levels(kb, kb32, kh, hsh, 3, klev_ptr, ktab_lo, ktab_hi, BITS, DEQ, DT).to(tl.float32)
        k0 = k0 * tl.load(ks_ptr + offs_i)[None, :]
        k1 = k1 * tl.load(ks_ptr + DQ + offs_i)[None, :]
        k2 = k2 * tl.load(ks_ptr + 2 * DQ + offs_i)[None, :]
        k3 = k3 * tl.load(ks_ptr + 3 * DQ + offs_i)[None, :]
        if CENTER:  # asymmetric keys: the per-channel center is added before the rotation
            k0 += tl.load(kcen_ptr + offs_i)[None, :]
            k1 += tl.load(kcen_ptr + DQ + offs_i)[None, :]
            k2 += tl.load(kcen_ptr + 2 * DQ + offs_i)[None, :]
            k3 += tl.load(kcen_ptr + 3 * DQ + offs_i)[None, :]
        pos = (pos0 + tok).to(tl.float32)[:, None]  # [BLOCK_T, 1]
        ang_a = pos * tl.load(inv_ptr + offs_i)[None, :]  # the angle as torch forms it: fl(pos · inv_freq)
        ang_b = pos * tl.load(inv_ptr + DQ + offs_i)[None, :]
        ca = tl.cos(ang_a)
        sa = tl.sin(ang_a)
        cb = tl.cos(ang_b)
        sb = tl.sin(ang_b)
        s = tl.dot(q0, tl.trans((k0 * ca - k2 * sa).to(DT)), input_precision=PREC)
        s = tl.dot(q1, tl.trans((k1 * cb - k3 * sb).to(DT)), s, input_precision=PREC)
        s = tl.dot(q2, tl.trans((k2 * ca + k0 * sa).to(DT)), s, input_precision=PREC)
        s = tl.dot(q3, tl.trans((k3 * cb + k1 * sb).to(DT)), s, input_precision=PREC)
    else:
        s = tl.dot(q0, tl.trans(_levels(kb, kb32, kh, hsh, 0, klev_ptr, ktab_lo, ktab_hi, BITS, DEQ, DT)),
                   input_precision=PREC)
        s = tl.dot(q1, tl.trans(_levels(kb, kb32, kh, hsh, 1, klev_ptr, ktab_lo, ktab_hi, BITS, DEQ, DT)), s,
                   input_precision=PREC)
        s = tl.dot(q2, tl.trans(_levels(kb, kb32, kh, hsh, 2, klev_ptr, ktab_lo, ktab_hi, BITS, DEQ, DT)), s,
                   input_precision=PREC)
        s = tl.dot(q3, tl.trans(_levels(kb, kb32, kh, hsh, 3, klev_ptr, ktab_lo, ktab_hi, BITS, DEQ, DT)), s,
                   input_precision=PREC)
    if ADDQ:  # one term per query head on every history score: q·center (post-RoPE keys), the score bias
        s += qc[:, None]

    if NOUT > 0:  # outliers of the tile's cache blocks
        NBT: tl.constexpr = BLOCK_T // BLOCK
        offs_o = tl.arange(0, NBT * NOUT_P2)
        ob = offs_o // NOUT_P2
        oo = offs_o % NOUT_P2
        blk = t0 // BLOCK + ob
        omask = (oo < NOUT) & (blk * BLOCK < t_end)
        obase = (bk * NB + blk) * NOUT + oo
        koi = tl.load(koi_ptr + obase, mask=omask, other=0).to(tl.int32)
        kov = tl.load(kov_ptr + obase, mask=omask, other=0.0).to(tl.float32)
        # q·sm_scale·log2e (not scaled by k_scale) at the outlier channels: [G_P2, NO]
        offs_g = tl.arange(0, G_P2)
        qo = tl.load(qo_ptr + offs_g[:, None] * D + (koi % D)[None, :], mask=(offs_g < G)[:, None], other=0.0)
        qo = qo.to(tl.float32) * qscale
        if ROPE:  # a residual r at channel c rotates into c and its partner c ± d/2
            c_o = koi % D
            upper = c_o >= D // 2
            partner = tl.where(upper, c_o - D // 2, c_o + D // 2)
            qp = tl.load(qo_ptr + offs_g[:, None] * D + partner[None, :], mask=(offs_g < G)[:, None], other=0.0)
            ang = (pos0 + t0 + ob * BLOCK + koi // D).to(tl.float32) * tl.load(inv_ptr + (c_o % (D // 2)))
            sgn = tl.where(upper, -1.0, 1.0)
            qo = qo * tl.cos(ang)[None, :] + (qp.to(tl.float32) * qscale) * (sgn * tl.sin(ang))[None, :]
        gm = (offs_g < G)[:, None]
        if OUT == 2:  # scatter-add into this program's [G, BLOCK_T] scratch, read it back and clear it
            ksc = sc_ptr + G_P2 * D + offs_g[:, None] * BLOCK_T
            tl.atomic_add(ksc + (ob * BLOCK + koi // D)[None, :], qo * kov[None, :], mask=gm & omask[None, :],
                          sem="relaxed")
            tl.debug_barrier()
            corr = _read_and_clear(ksc + offs_t[None, :], gm)
            tl.debug_barrier()  # every read-and-clear is done before the next tile's adds
            s += corr
        else:
            hit = ((ob * BLOCK + koi // D)[:, None] == offs_t[None, :]).to(DT)  # [NO, BLOCK_T]
            s = tl.dot((qo * kov[None, :]).to(DT), hit, s, input_precision=PREC)
    s = tl.where(tmask[None, :], s, float("-inf"))

    m_t = tl.max(s, axis=1)
    if LAZY:
        grow = tl.max(m_t - m_i, axis=0) > 8.0
    else:
        grow = True
    if grow:
        m_new = tl.maximum(m_i, m_t)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        a0 = a0 * alpha[:, None]
        a1 = a1 * alpha[:, None]
        a2 = a2 * alpha[:, None]
        a3 = a3 * alpha[:, None]
        m_i = m_new
        if OUT >= 1:
            if NOUT > 0:  # the value-outlier scratch holds accumulator terms too: rescale it
                _rescale_scratch(sc_ptr, alpha, D, G, G_P2)
    p = tl.exp2(s - m_i[:, None])  # [G_P2, BLOCK_T]
    l_i += tl.sum(p, axis=1)
    pv = (p * vs[None, :]).to(DT)
    a0 = tl.dot(pv, _levels(vb, vb32, vh, hsh, 0, vlev_ptr, vtab_lo, vtab_hi, BITS, DEQ, DT), a0,
                input_precision=PREC)
    a1 = tl.dot(pv, _levels(vb, vb32, vh, hsh, 1, vlev_ptr, vtab_lo, vtab_hi, BITS, DEQ, DT), a1,
                input_precision=PREC)
    a2 = tl.dot(pv, _levels(vb, vb32, vh, hsh, 2, vlev_ptr, vtab_lo, vtab_hi, BITS, DEQ, DT), a2,
                input_precision=PREC)
    a3 = tl.dot(pv, _levels(vb, vb32, vh, hsh, 3, vlev_ptr, vtab_lo, vtab_hi, BITS, DEQ, DT), a3,
                input_precision=PREC)

    if NOUT > 0:
        voi = tl.load(voi_ptr + obase, mask=omask, other=0).to(tl.int32)
        vov = tl.load(vov_ptr + obase, mask=omask, other=0.0).to(tl.float32)
        vhit = (offs_t[:, None] == (ob * BLOCK + voi // D)[None, :]).to(DT)  # [BLOCK_T, NO]
        po = tl.dot(p.to(DT), vhit, input_precision=PREC) * vov[None, :]  # [G_P2, NO]
        vch = voi % D
        if OUT >= 1:  # scatter-add p·r into this program's [G, D] scratch (added to acc at the end)
            tl.atomic_add(sc_ptr + offs_g[:, None] * D + vch[None, :], po, mask=gm & omask[None, :], sem="relaxed")
        else:  # one-hot products over the channels
            po = po.to(DT)
            a0 = tl.dot(po, (vch[:, None] == offs_i[None, :]).to(DT), a0, input_precision=PREC)
            a1 = tl.dot(po, (vch[:, None] == (DQ + offs_i)[None, :]).to(DT), a1, input_precision=PREC)
            a2 = tl.dot(po, (vch[:, None] == (2 * DQ + offs_i)[None, :]).to(DT), a2, input_precision=PREC)
            a3 = tl.dot(po, (vch[:, None] == (3 * DQ + offs_i)[None, :]).to(DT), a3, input_precision=PREC)
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _win_tile(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, wk_ptr, wv_ptr, bk, t0, wlen, WC,
              D: tl.constexpr, BLOCK_T: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """One tile of the fp16 window (channels in the same four blocks as the history)."""
    DQ: tl.constexpr = D // 4
    offs_t = tl.arange(0, BLOCK_T)
    offs_i = tl.arange(0, DQ)
    tok = t0 + offs_t
    tmask = tok < wlen
    ptr = ((bk * WC + tok) * D)[:, None] + offs_i[None, :]
    m2 = tmask[:, None]
    s = tl.dot(q0, tl.trans(tl.load(wk_ptr + ptr, mask=m2, other=0.0).to(DT)), input_precision=PREC)
    s = tl.dot(q1, tl.trans(tl.load(wk_ptr + ptr + DQ, mask=m2, other=0.0).to(DT)), s, input_precision=PREC)
    s = tl.dot(q2, tl.trans(tl.load(wk_ptr + ptr + 2 * DQ, mask=m2, other=0.0).to(DT)), s, input_precision=PREC)
    s = tl.dot(q3, tl.trans(tl.load(wk_ptr + ptr + 3 * DQ, mask=m2, other=0.0).to(DT)), s, input_precision=PREC)
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(DT)
    a0 = tl.dot(p, tl.load(wv_ptr + ptr, mask=m2, other=0.0).to(DT), a0 * alpha[:, None], input_precision=PREC)
    a1 = tl.dot(p, tl.load(wv_ptr + ptr + DQ, mask=m2, other=0.0).to(DT), a1 * alpha[:, None],
                input_precision=PREC)
    a2 = tl.dot(p, tl.load(wv_ptr + ptr + 2 * DQ, mask=m2, other=0.0).to(DT), a2 * alpha[:, None],
                input_precision=PREC)
    a3 = tl.dot(p, tl.load(wv_ptr + ptr + 3 * DQ, mask=m2, other=0.0).to(DT), a3 * alpha[:, None],
                input_precision=PREC)
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _load_q(q_ptr, qrow, gmask, ks_ptr, is_hist, qscale, j: tl.constexpr, DQ: tl.constexpr, DT: tl.constexpr,
            FOLD: tl.constexpr):
    """Channel block j of the G query heads [G_P2, DQ], times qscale (and k_scale in history programs)."""
    offs_i = j * DQ + tl.arange(0, DQ)
    qj = tl.load(q_ptr + qrow[:, None] + offs_i[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    ks = tl.where(is_hist, tl.load(ks_ptr + offs_i), 1.0)
    if not FOLD:  # pre-RoPE keys: the scale applies before the rotation, so to the key tile
        ks = tl.full([DQ], 1.0, tl.float32)
    return (qj * (ks * qscale)[None, :]).to(DT)


@triton.jit
def _q_dot(q_ptr, qrow, gmask, c_ptr, D: tl.constexpr, SQUARE: tl.constexpr = False):
    """q·c (SQUARE: q²·c) [G_P2] fp32 for the G query heads and a [D] vector c."""
    offs_c = tl.arange(0, D)
    qf = tl.load(q_ptr + qrow[:, None] + offs_c[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    if SQUARE:
        qf = qf * qf
    return tl.sum(qf * tl.load(c_ptr + offs_c)[None, :], axis=1)


@triton.jit
def _kv_decode_attention_kernel(
    # pointers
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, klev_ptr, vlev_ptr, koi_ptr, kov_ptr, voi_ptr, vov_ptr,
    hlen_ptr, wk_ptr, wv_ptr, wlen_ptr, part_ptr, scratch_ptr, inv_ptr, kcen_ptr, kerr_ptr,
    # sizes
    H, K, S, NB, WC, n_splits, tiles_per_split, qscale, pos0, win_splits,
    # constexprs
    D: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr, NOUT: tl.constexpr, NOUT_P2: tl.constexpr, DEQ: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr, LAZY: tl.constexpr, STAGES: tl.constexpr, INTERP: tl.constexpr, OUT: tl.constexpr,
    ROPE: tl.constexpr, CENTER: tl.constexpr, WCHUNK: tl.constexpr, BIAS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    ADDQ: tl.constexpr = (CENTER and not ROPE) or BIAS
    bk = tl.program_id(0)  # b·K + kv head
    split = tl.program_id(1)
    b = bk // K
    kh = bk % K
    DQ: tl.constexpr = D // 4
    offs_g = tl.arange(0, G_P2)  # query heads of this KV head, padded to >= 16 rows for tl.dot
    offs_i = tl.arange(0, DQ)
    gmask = offs_g < G
    qrow = (b * H + kh * G + offs_g) * D  # [G_P2]
    is_hist = split < n_splits - win_splits

    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    a0 = tl.zeros([G_P2, DQ], tl.float32)
    a1 = tl.zeros([G_P2, DQ], tl.float32)
    a2 = tl.zeros([G_P2, DQ], tl.float32)
    a3 = tl.zeros([G_P2, DQ], tl.float32)
    # q·sm_scale·log2e in four channel blocks; history programs also fold in the key channel scale
    q0 = _load_q(q_ptr, qrow, gmask, ks_ptr + kh * D, is_hist, qscale, 0, DQ, DT, not ROPE)
    q1 = _load_q(q_ptr, qrow, gmask, ks_ptr + kh * D, is_hist, qscale, 1, DQ, DT, not ROPE)
    q2 = _load_q(q_ptr, qrow, gmask, ks_ptr + kh * D, is_hist, qscale, 2, DQ, DT, not ROPE)
    q3 = _load_q(q_ptr, qrow, gmask, ks_ptr + kh * D, is_hist, qscale, 3, DQ, DT, not ROPE)

    if is_hist:
        hlen = tl.load(hlen_ptr + b)
        t_lo = split * tiles_per_split * BLOCK_T
        t_hi = tl.minimum(t_lo + tiles_per_split * BLOCK_T, hlen)
        n_it = tl.maximum(tl.cdiv(t_hi - t_lo, BLOCK_T), 0)
        qo_ptr = q_ptr + (b * H + kh * G) * D  # the outlier corrections gather q by channel
        qc = tl.zeros([G_P2], tl.float32)
        if CENTER:
            if not ROPE:  # q·k_center·sm_scale·log2e per query head (fp32), added to every history score
                qc = _q_dot(q_ptr, qrow, gmask, kcen_ptr + kh * D, D) * qscale
        if BIAS:  # score bias Σ q²·k_err2·sm_scale²/2, in log2 units (qscale = sm_scale·log2e)
            qc += _q_dot(q_ptr, qrow, gmask, kerr_ptr + kh * D, D, True) * (0.5 * qscale * qscale / 1.4426950408889634)
        # this program's outlier scratch: [G_P2, D] value terms, then [G_P2, BLOCK_T] score terms
        sc_ptr = scratch_ptr + (bk * n_splits + split) * (G_P2 * (D + BLOCK_T))
        if OUT >= 1:
            if NOUT > 0:
                offs_s = tl.arange(0, G_P2 * D)
                tl.store(sc_ptr + offs_s, tl.zeros([G_P2 * D], tl.float32))
                offs_s2 = tl.arange(0, G_P2 * BLOCK_T)
                tl.store(sc_ptr + G_P2 * D + offs_s2, tl.zeros([G_P2 * BLOCK_T], tl.float32))
                tl.debug_barrier()
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
                m_i, l_i, a0, a1, a2, a3 = _tile(
                    q0, q1, q2, q3, qo_ptr, qscale, m_i, l_i, a0, a1, a2, a3, kc_ptr, vc_ptr, vs_ptr, klev_ptr,
                    vlev_ptr, ktab_lo, ktab_hi, vtab_lo, vtab_hi, koi_ptr, kov_ptr, voi_ptr, vov_ptr, sc_ptr,
                    ks_ptr + kh * D, kcen_ptr + kh * D, qc, inv_ptr, pos0, bk,
                    t_lo + it * BLOCK_T, t_hi, S, NB, D, G, G_P2, BITS, BLOCK, BLOCK_T, NOUT, NOUT_P2, DEQ, DT, PREC,
                    LAZY, OUT, ROPE, CENTER, ADDQ)
                it += 1
        else:
            for it in tl.range(0, n_it, num_stages=STAGES):
                m_i, l_i, a0, a1, a2, a3 = _tile(
                    q0, q1, q2, q3, qo_ptr, qscale, m_i, l_i, a0, a1, a2, a3, kc_ptr, vc_ptr, vs_ptr, klev_ptr,
                    vlev_ptr, ktab_lo, ktab_hi, vtab_lo, vtab_hi, koi_ptr, kov_ptr, voi_ptr, vov_ptr, sc_ptr,
                    ks_ptr + kh * D, kcen_ptr + kh * D, qc, inv_ptr, pos0, bk,
                    t_lo + it * BLOCK_T, t_hi, S, NB, D, G, G_P2, BITS, BLOCK, BLOCK_T, NOUT, NOUT_P2, DEQ, DT, PREC,
                    LAZY, OUT, ROPE, CENTER, ADDQ)
        if OUT >= 1:
            if NOUT > 0:  # add the value-outlier terms (channels in natural order)
                tl.debug_barrier()
                vrow = sc_ptr + offs_g[:, None] * D + offs_i[None, :]
                a0 += tl.load(vrow, cache_modifier=".cg")
                a1 += tl.load(vrow + DQ, cache_modifier=".cg")
                a2 += tl.load(vrow + 2 * DQ, cache_modifier=".cg")
                a3 += tl.load(vrow + 3 * DQ, cache_modifier=".cg")
    else:
        # the window in chunks of WCHUNK tokens, one program each (one serial program over the whole window was
        # the critical path at short contexts, where every history program has one or two tiles)
        t0 = (split - (n_splits - win_splits)) * WCHUNK
        wend = tl.minimum(tl.load(wlen_ptr + b), t0 + WCHUNK)
        while t0 < wend:
            m_i, l_i, a0, a1, a2, a3 = _win_tile(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, wk_ptr,
                                                 wv_ptr, bk, t0, wend, WC, D, 32, DT, PREC)
            t0 += 32

    # partials [B·H, n_splits, D + 2]: acc (channels in natural order), then m (log2 units), l
    out = part_ptr + ((b * H + kh * G + offs_g) * n_splits + split) * (D + 2)  # [G_P2]
    g2 = gmask[:, None]
    tl.store(out[:, None] + offs_i[None, :], a0, mask=g2)
    tl.store(out[:, None] + DQ + offs_i[None, :], a1, mask=g2)
    tl.store(out[:, None] + 2 * DQ + offs_i[None, :], a2, mask=g2)
    tl.store(out[:, None] + 3 * DQ + offs_i[None, :], a3, mask=g2)
    tl.store(out + D, m_i, mask=gmask)
    tl.store(out + D + 1, l_i, mask=gmask)


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, r_ptr, n_splits, sink_ptr, H, D: tl.constexpr, P_P2: tl.constexpr,
                   DC: tl.constexpr, CHUNK: tl.constexpr, NCHUNK: tl.constexpr, ROT: tl.constexpr,
                   OUTC: tl.constexpr = 0,
                   SINKS: tl.constexpr = False, q_ptr=None, kc_ptr=None, ke_ptr=None, n_hist=0, HQ=1, G=1,
                   qscale=1.0, bscale=1.0, CENTER: tl.constexpr = False, BIAS: tl.constexpr = False,
                   acc16_ptr=None, HALF: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[bh, c] = sum_s 2^(m_s - M)·acc_s[c] / sum_s 2^(m_s - M)·l_s over the splits of one (b, head), for
    the DC channels c of program_id(1). The splits stream in CHUNK rows: a [P_P2, D] tile in one program
    spilled (Qwen3 at 32k batch 1, 135 splits: slower than the attention kernel itself).
    ROT (DC == D): out[bh] = o·Rᵀ, the cache's head_dim rotation undone here, in out's dtype; each program
    reduces all D channels and writes OUTC of the output's (a row in one program left Qwen3's 32 rows on
    32 SMs, latency-bound).
    SINKS: the head's sink logit (sink_ptr[bh % H], natural units) joins the denominator (gpt-oss), once per row.
    CENTER / BIAS (the Gluon kernels' partials): the first n_hist splits' m lack the per-head score terms
    qscale·(q·center) and bscale·(q²·err2) of KV head (bh % HQ) // G; they are added here, once per head,
    instead of in every split program.
    HALF: the partials come in two buffers, part [bh, s, (m, l)] fp32 and acc16 [bh, s, D] fp16 holding acc_s / l_s
    (half the bytes a split writes and this kernel reads; kernels/mla_decode_attention.py's half_partials)."""
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    bh = tl.program_id(0)
    offs_c = (0 if ROT else tl.program_id(1) * DC) + tl.arange(0, DC)
    ST: tl.constexpr = 2 if HALF else D + 2  # floats a split's row of part; m at MO, l at MO + 1
    MO: tl.constexpr = 0 if HALF else D
    base = part_ptr + bh * n_splits * ST
    offs_p = tl.arange(0, P_P2)
    qc = 0.0
    if CENTER or BIAS:
        offs_d = tl.arange(0, D)
        qv = tl.load(q_ptr + bh * D + offs_d).to(tl.float32)
        kh = (bh % HQ) // G
        if CENTER:
            qc += qscale * tl.sum(qv * tl.load(kc_ptr + kh * D + offs_d), axis=0)
        if BIAS:
            qc += bscale * tl.sum(qv * qv * tl.load(ke_ptr + kh * D + offs_d), axis=0)
    m_all = tl.load(base + offs_p * ST + MO, mask=offs_p < n_splits, other=float("-inf"))
    mx = tl.max(tl.where(offs_p < n_hist, m_all + qc, m_all), axis=0)
    if SINKS:
        sk = tl.load(sink_ptr + bh % H).to(tl.float32) * 1.4426950408889634  # log2 units, as m
        mx = tl.maximum(mx, sk)
    acc = tl.zeros((DC,), dtype=tl.float32)
    den = tl.zeros((CHUNK,), dtype=tl.float32)
    for i in range(NCHUNK):  # cdiv(n_splits, CHUNK), a constexpr: the P_P2 // CHUNK it replaced ran up to twice the
        # chunks, each a dependent L2 round trip (the combine is latency-bound at batch 1)
        offs = i * CHUNK + tl.arange(0, CHUNK)
        pmask = offs < n_splits
        row = base + offs * ST
        m = tl.load(row + MO, mask=pmask, other=float("-inf"))
        m = tl.where(offs < n_hist, m + qc, m)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - mx))  # splits with no tokens weigh 0
        lw = tl.load(row + MO + 1, mask=pmask, other=0.0) * w
        den += lw
        if HALF:  # acc_s / l_s in fp16: weighed by l_s·w
            a = tl.load(acc16_ptr + (bh * n_splits + offs)[:, None] * D + offs_c[None, :], mask=pmask[:, None],
                        other=0.0).to(tl.float32)
            acc += tl.sum(a * lw[:, None], axis=0)
        else:
            a = tl.load(row[:, None] + offs_c[None, :], mask=pmask[:, None], other=0.0)
            acc += tl.sum(a * w[:, None], axis=0)
    total = tl.sum(den, axis=0)
    if SINKS:
        total += tl.exp2(sk - mx)
    o = acc / total
    if ROT:  # out[c] = sum_i o[i]·R[c, i], RC output channels at a time
        RC: tl.constexpr = 32
        for c0 in tl.static_range(0, OUTC, RC):
            offs_r = tl.program_id(1) * OUTC + c0 + tl.arange(0, RC)
            r = tl.load(r_ptr + offs_r[None, :] * D + offs_c[:, None])  # [D, RC]: R[c, i] at [i, c]
            tl.store(out_ptr + bh * D + offs_r, tl.sum(o[:, None] * r, axis=0).to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + bh * D + offs_c, o.to(out_ptr.dtype.element_ty))


def _check(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval, v_oidx, v_oval, hist_len,
           win_k, win_v, win_len, bits, block):
    B, H, d = q.shape
    _, K, S, dw = k_codes.shape
    assert bits in (2, 3) and dw == d * bits // 8, (bits, dw, d)
    assert H % K == 0 and S % block == 0, (H, K, S, block)
    assert d & (d - 1) == 0 and block & (block - 1) == 0 and d >= 64 and block >= 16, ("tl.dot needs "
        "power-of-two head_dim >= 64 (four blocks of >= 16 channels) and block >= 16", d, block)
    NB = S // block
    assert k_codes.dtype == v_codes.dtype == torch.uint8 and v_codes.shape == k_codes.shape
    assert k_scale.shape == (K, d) and k_scale.dtype == torch.float32, (k_scale.shape, k_scale.dtype)
    assert v_scale.shape == (B, K, S) and v_scale.dtype == torch.float16, (v_scale.shape, v_scale.dtype)
    assert k_lev.shape == v_lev.shape == (2**bits,) and k_lev.dtype == v_lev.dtype == torch.float32
    nout = k_oidx.shape[-1]
    for t, dt in ((k_oidx, torch.int16), (v_oidx, torch.int16), (k_oval, torch.float16), (v_oval, torch.float16)):
        assert t.shape == (B, K, NB, nout) and t.dtype == dt, (t.shape, t.dtype)
    assert win_k.shape == win_v.shape and win_k.shape[:2] == (B, K) and win_k.shape[3] == d, win_k.shape
    assert win_k.dtype == win_v.dtype == torch.float16
    assert hist_len.shape == win_len.shape == (B,) and hist_len.dtype == win_len.dtype == torch.int32
    for t in (q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval, v_oidx, v_oval, hist_len,
              win_k, win_v, win_len):
        assert t.is_contiguous() and t.device == q.device, "inputs must be contiguous on one device"
    return B, H, d, K, S, NB, nout


def kv_decode_attention(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval, v_oidx, v_oval,
                        hist_len, win_k, win_v, win_len, bits: int, block: int, sm_scale: float | None = None,
                        n_splits: int | None = None, precision: str | None = None, block_t: int | None = None,
                        num_warps: int | None = None, num_stages: int | None = None, deq: int | None = None,
                        lazy: bool | None = None, waves: float | None = None, out_mode: int | None = None,
                        rope: tuple[torch.Tensor, int] | None = None,
                        k_center: torch.Tensor | None = None, k_err2: torch.Tensor | None = None,
                        out_rotation: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention (one query token per row) over packed history + fp16 window -> [B, H, d] in out_dtype
    (fp32 by default); out_rotation R [d, d] fp32: the output times Rᵀ (a cache that attends in a rotated
    basis, kvtiered.LayerRotations, undoes it in the split combine instead of a cast and a GEMM).

    precision: dot inputs, "half" (fp16 operands on tensor cores, fp32 accumulation; the CUDA default) or "ieee"
    (exact fp32; the default elsewhere). n_splits: history splits (default: ~`waves` waves of the
    SMs). block_t (history tokens per tile, a multiple of `block`), num_warps, num_stages, deq
    (1: prmt level lookup, CUDA 2-bit only; 0: select tree), lazy, out_mode (sparse residuals: 0
    one-hot products, 1 value residuals by atomic adds into a per-program scratch, 2 keys too; the
    atomic modes need lazy rescaling): launch knobs, CONFIG defaults.
    rope = (inv_freq [d/2] fp32, pos0): the history holds pre-RoPE keys (KVQuant); history token t
    sits at position pos0 + t and is rotated in registers (half-rotation layout, fp32 angles
    fl(pos · inv_freq) as moec.runtime.model.rope_cos_sin forms them); the window is post-RoPE.
    k_center [K, d] fp32 (nuq.NUQCenteredCodec): history keys are k_center + k_lev[code]·k_scale
    (+ residuals), before the rotation when `rope` is given.
    k_err2 [K, d] fp32 (nuq `score_bias`): every history score gets Σ_c q_c²·k_err2_c·sm_scale²/2, the
    log-normal correction for the keys' rounding error (kvtiered.history_bias).
    The runtime sends the caches gluon_kv_attention.supports accepts to the Gluon kernel instead on CUDA
    (kvtiered.decode_attention; MOEC_KERNELS=tl keeps them here).
    Works under CUDA-graph capture: no host syncs; hist_len/win_len are only read on the device."""
    B, H, d, K, S, NB, nout = _check(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval,
                                     v_oidx, v_oval, hist_len, win_k, win_v, win_len, bits, block)
    cuda = q.is_cuda and not _interpreting()
    configs = launch_config.config("kv_decode_attention", q.device)
    config = configs["residual"]
    precision = precision or config.get("precision") or ("half" if cuda else "ieee")
    assert precision in ("half", "ieee"), precision
    if cuda and nout == 0:  # launch defaults of the residual-free cache
        dense = configs["dense"]
        block_t = block_t or (dense["block_t"] if dense["block_t"] % block == 0 else None)
        num_stages = num_stages or dense["num_stages"]
        waves = waves or (dense["waves_many"] if B * K > dense["many"] else dense["waves"])
    block_t = block_t or max(block, config["block_t"] if cuda else block)
    assert block_t % block == 0 and block_t & (block_t - 1) == 0, (block_t, block)
    deq = (1 if cuda and bits == 2 and precision == "half" else 0) if deq is None else deq
    assert deq == 0 or (cuda and bits == 2 and precision == "half"), "the prmt lookup is PTX (CUDA, 2-bit, fp16 dots)"
    lazy = config["lazy"] if lazy is None else lazy
    out_mode = config["out_mode"] if out_mode is None else out_mode
    assert out_mode in (0, 1, 2) and (lazy or out_mode == 0 or nout == 0), (out_mode, lazy)
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    n_tiles = triton.cdiv(S, block_t)
    if n_splits is None:
        programs = int((waves or config["waves"]) * launch_config.num_sms(q.device))
        n_splits = max(1, min(n_tiles, triton.cdiv(programs, B * K)))
    hist_splits = max(1, min(n_splits, n_tiles))
    tps = triton.cdiv(n_tiles, hist_splits)
    hist_splits = triton.cdiv(n_tiles, tps)
    win_chunk = config["win_chunk"]
    win_splits = max(1, triton.cdiv(win_k.shape[2], win_chunk))
    P = hist_splits + win_splits  # the last win_splits splits attend the window, win_chunk tokens each
    G = H // K
    G_P2 = max(16, triton.next_power_of_2(G))
    part = torch.empty(B * H * P * (d + 2), device=q.device, dtype=torch.float32)
    if rope is not None:
        inv_freq, pos0 = rope
        assert inv_freq.shape == (d // 2,) and inv_freq.dtype == torch.float32 and inv_freq.device == q.device
    else:
        inv_freq, pos0 = k_scale, 0  # unused
    for t in (k_center, k_err2):
        if t is not None:
            assert t.shape == (K, d) and t.dtype == torch.float32 and t.device == q.device and t.is_contiguous()
    scratch = torch.empty(B * K * P * G_P2 * (d + block_t) if out_mode and nout else 1, device=q.device,
                          dtype=torch.float32)  # zeroed by the kernel itself
    _LAST["kernel"] = _kv_decode_attention_kernel[(B * K, P)](
        q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval, v_oidx, v_oval,
        hist_len, win_k, win_v, win_len, part, scratch, inv_freq, k_scale if k_center is None else k_center,
        k_scale if k_err2 is None else k_err2, H, K, S, NB, win_k.shape[2], P, tps, sm_scale * LOG2E, int(pos0),
        win_splits,
        D=d, G=G, G_P2=G_P2, BITS=bits, BLOCK=block, BLOCK_T=block_t, NOUT=nout,
        NOUT_P2=triton.next_power_of_2(max(nout, 1)), DEQ=deq,
        DT=tl.float16 if precision == "half" else tl.float32, PREC="ieee",
        LAZY=bool(lazy), STAGES=num_stages or config["num_stages"], INTERP=not cuda, OUT=out_mode,
        ROPE=rope is not None, CENTER=k_center is not None, WCHUNK=win_chunk, BIAS=k_err2 is not None,
        num_warps=num_warps or config["num_warps"], **pdl.options(q.device),
    )
    return combine_splits(part, B * H, P, d, out_rotation, out_dtype, sinks=sinks).view(B, H, d)


def combine_splits(part: torch.Tensor, BH: int, P: int, d: int, rotation: torch.Tensor | None = None,
                   out_dtype: torch.dtype = torch.float32, outc: int = 32,
                   sinks: torch.Tensor | None = None, hist_terms: dict | None = None,
                   acc16: torch.Tensor | None = None) -> torch.Tensor:
    """The split-K combine: part [BH, P, d + 2] (acc, m in log2 units, l per split) -> out [BH, d] in
    out_dtype; rotation R [d, d] fp32: out·Rᵀ, d / outc programs per row, each reducing all d channels and
    writing outc of the rotated ones. sinks [H] (BH rows of H heads): a logit per head in the denominator.
    hist_terms: the per-head score terms the first n_hist splits' m lack (_reduce_kernel's CENTER / BIAS): dict
    q [BH, d], k_center and k_err2 [K, d] fp32 (either None), n_hist, HQ (query heads), G, qscale, bscale.
    acc16 [BH, P, d] fp16: the partials' acc_s / l_s apart, part then holding (m, l) only ([BH, P, 2] fp32)."""
    out = torch.empty(BH, d, device=part.device, dtype=out_dtype)
    p2 = triton.next_power_of_2(P)
    H = 1 if sinks is None else sinks.numel()
    assert sinks is None or BH % H == 0, (BH, H)
    sk = dict(SINKS=sinks is not None)
    if acc16 is not None:
        assert acc16.dtype == torch.float16 and acc16.numel() == BH * P * d and part.numel() == BH * P * 2
        sk |= dict(acc16_ptr=acc16, HALF=True)
    if hist_terms is not None:
        ht = hist_terms
        kc, ke = ht.get("k_center"), ht.get("k_err2")
        sk |= dict(q_ptr=ht["q"], kc_ptr=ht["q"] if kc is None else kc, ke_ptr=ht["q"] if ke is None else ke,
                   n_hist=ht["n_hist"], HQ=ht["HQ"], G=ht["G"], qscale=float(ht["qscale"]),
                   bscale=float(ht["bscale"]), CENTER=kc is not None, BIAS=ke is not None)
    if rotation is not None:
        assert rotation.shape == (d, d) and rotation.dtype == torch.float32 and rotation.is_contiguous()
        outc = min(d, outc)
        ch = min(64 * 128 // d, p2)  # splits a chunk: a [ch, d] fp32 tile is 64 registers a thread at 4 warps
        _reduce_kernel[(BH, d // outc)](part, out, rotation, P, part if sinks is None else sinks, H, D=d, P_P2=p2,
                                        DC=d, CHUNK=ch, NCHUNK=triton.cdiv(P, ch), ROT=True, OUTC=outc, num_warps=4,
                                        **sk, **pdl.options(part.device))
        return out
    dc = min(d, 32)
    ch = min(64, p2)
    _reduce_kernel[(BH, d // dc)](part, out, part, P, part if sinks is None else sinks, H, D=d, P_P2=p2, DC=dc,
                                  CHUNK=ch, NCHUNK=triton.cdiv(P, ch), ROT=False, num_warps=2, **sk,
                                  **pdl.options(part.device))
    return out


def dequant_history_ref(codes, scale_k_or_v, lev, oidx, oval, bits: int, block: int, kind: str,
                        center: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize a whole history buffer [B, K, S, ·] -> [B, K, S, d] fp32 (codes in bitpack's Layout.PLANAR);
    center [K, d]: added to every token (keys of nuq.NUQCenteredCodec)."""
    B, K, S, dw = codes.shape
    d = dw * 8 // bits
    x = lev.float()[unpack_planar(codes, bits, d)]
    x = x * (scale_k_or_v.float()[None, :, None, :] if kind == "k" else scale_k_or_v.float()[..., None])
    if oidx.shape[-1]:
        x = x.reshape(B, K, S // block, block * d).scatter_add(-1, oidx.long(), oval.float()).reshape(B, K, S, d)
    if center is not None:
        x = x + center.float()[None, :, None, :]
    return x


def kv_decode_attention_ref(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval, v_oidx, v_oval,
                            hist_len, win_k, win_v, win_len, bits: int, block: int,
                            sm_scale: float | None = None, rope: tuple[torch.Tensor, int] | None = None,
                            k_center: torch.Tensor | None = None, k_err2: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: dequantize the history (and rotate pre-RoPE keys), concatenate the window,
    softmax attention in fp32 (history scores + Σ q²·k_err2·sm_scale²/2 per query head with k_err2)."""
    B, H, d = q.shape
    K = k_codes.shape[1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    kh = dequant_history_ref(k_codes, k_scale, k_lev, k_oidx, k_oval, bits, block, "k", k_center)
    if rope is not None:  # the formula of moec.runtime.model.rope_cos_sin / apply_rope
        inv_freq, pos0 = rope
        ang = torch.arange(pos0, pos0 + kh.shape[2], device=kh.device).float()[:, None] * inv_freq.float()[None, :]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        kh = kh * cos + torch.cat([-kh[..., d // 2 :], kh[..., : d // 2]], -1) * sin
    vh = dequant_history_ref(v_codes, v_scale, v_lev, v_oidx, v_oval, bits, block, "v")
    out = torch.empty(B, H, d, dtype=torch.float32, device=q.device)
    for b in range(B):
        h, w = int(hist_len[b]), int(win_len[b])
        keys = torch.cat([kh[b, :, :h], win_k[b, :, :w].float()], 1)  # [K, n, d]
        vals = torch.cat([vh[b, :, :h], win_v[b, :, :w].float()], 1)
        qb = q[b].float().view(K, H // K, d)
        scores = qb @ keys.transpose(1, 2) * sm_scale  # [K, G, n]
        if k_err2 is not None:
            scores[:, :, :h] += (qb.pow(2) * k_err2.float()[:, None, :]).sum(-1, keepdim=True) * (sm_scale**2 / 2)
        p = torch.softmax(scores, dim=-1)
        out[b] = (p @ vals).reshape(H, d)
    return out
