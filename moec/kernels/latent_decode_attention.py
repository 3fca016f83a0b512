"""Fused decode attention straight from a low-rank latent KV cache (issue 6; MLA-style absorbed decode).

The history of a layer is a latent per token shared by all KV heads (cross-head, seed 000; and, for
cross-layer groups, by several layers, seed 001): keys k = U_k z_k + mean_k and values v = U_v z_v + mean_v,
with z stored as 2/4-bit codes (moec/formats/bitpack.py Layout.PLANAR: channel c in byte c % W at bit
b·(c // W)) on a uniform mid-rise grid with per-channel steps, or as fp16, plus seed 000's sparse fp16
residual: per history block of `block` tokens, n_out (index, value) pairs over the group's rows
(index t·DG + j, t the token in the block, j = [layer, kv head, channel] of the group width DG).

Per decode step (one query token per sequence), two history kernels:
  post-RoPE keys (`_latent_hist_kernel`, grid (B, SPLITS)): the up-projection is absorbed into the query,
    q_lat[b, h] = step_k ⊙ (U_k[kv(h)]^T q[b, h]) and bias = q·mean_k − off_k·Σ q_lat (launcher, torch), so
    q·k̂_t = q_lat · code_t + bias. Each program streams its share of the latent history in tiles of
    BLOCK_N tokens for *all* H query heads at once (one read of the latent per token): scores [H, N] =
    q_lat · codes^T, online softmax, latent accumulator acc [H, RV] += p · codes_v.
  pre-RoPE keys (`_latent_hist_pre_kernel`, grid (B, K, SPLITS)): the rotation depends on the position,
    so the keys of the tile are rebuilt for one KV head, k = codes · (U_k ⊙ step)^T + (mean − off·U_k step),
    in halves (c, c + d/2), rotated in registers with the position's cos/sin, and dotted with its G query
    heads. This is d·RK multiply-adds per token and KV head, not per element read: compute-bound.
  Sparse residual, both kernels: the tile loads the entries of the blocks it covers and keeps those of
    this layer (j in [layer_off, layer_off + K·d)). Keys: post-RoPE, q[h, c]·value scattered into the
    scores through a one-hot product [H, E] · [E, N]; pre-RoPE, value scattered into the rebuilt key
    halves before the rotation ([N, E] · [E, d/2]). Values: p gathered at the entries' tokens, weighted by
    the value and scattered into a d-space accumulator acc_d [H, d] (one-hot products, tensor cores).
  window kernel (grid (B, K)): the fp16 sinks + window of each KV head for its G = H/K query heads.
  combine (torch): log-sum-exp merge of the splits and the window, then one up-projection per head:
    out = (U_v[kv(h)] (step_v ⊙ (acc − off_v·Σp)) + mean_v·Σp + acc_d + acc_win) / Σp_all.

Shapes (B batch, H query heads, K KV heads, d head dim, S history capacity, RK/RV latent ranks,
WK/WV bytes per token of the codes, Wc window capacity, NB history blocks, NO entries per block):
    q [B, H, d]; codes_k [B, S, WK] uint8 (or fp16 [B, S, RK]); codes_v likewise
    u_k [K, d, RK], mean_k [K, d], step_k [RK]; u_v [K, d, RV], mean_v [K, d], step_v [RV]   (fp32)
    hist_len [B] int32; win_k, win_v [B, K, Wc, d] fp16; win_len [B] int32   ->  out [B, H, d] fp32
    k_out / v_out: (idx [B, NB, NO] int16/int32, val [B, NB, NO] fp16) or None
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats.bitpack import unpack_planar
from . import launch_config

BLOCK_W = 32  # window tokens per tile
# Launch settings, from configs/<device>.json (launch_config; CONFIG: the defaults, tuned on the H200,
# benchmarks/results/latent_attention_h200.json): tile, dot operands on the GPU, warps per program,
# programs per step to aim for (history splits); 64-token tiles and 4 warps without the residual, block_res
# (32) tokens and 8 warps with it (the block must divide it). fp16 operands (codes exact in fp16, q and p
# rounded as in flash attention) were faster than tf32, but the GPU smoke (benchmarks/gpu_smoke.py) saw
# them part from the torch path on some prompts of kv-latent-head, kv-latent-layer and kv-latent-layer-g2,
# where tf32 stays at the bf16 noise level (benchmarks/results/gpu_smoke_h200.json): off (tf32) until that
# is understood.
CONFIG = launch_config.defaults()["latent_decode_attention"]["launch"]
BLOCK_N = CONFIG["block_res"]  # the defaults' residual tile, for callers that ask without a device


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _codes_tile(c_ptr, tok, tmask, R, W, BITS: tl.constexpr, R_P2: tl.constexpr, c0=0):
    """Latent codes of tokens `tok` [N], channels c0 .. c0 + R_P2, as floats [N, R_P2] (channels >= R are 0)."""
    offs_c = c0 + tl.arange(0, R_P2)
    cmask = offs_c < R
    m = tmask[:, None] & cmask[None, :]
    if BITS == 16:
        return tl.load(c_ptr + tok[:, None] * R + offs_c[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        byte = offs_c % W
        shift = (offs_c // W) * BITS
        b = tl.load(c_ptr + tok[:, None] * W + byte[None, :], mask=m, other=0).to(tl.int32)
        c = (b >> shift[None, :]) & ((1 << BITS) - 1)
        return tl.where(m, c.to(tl.float32), 0.0)


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax over one tile of scores s [M, N] (log2 units; -inf where masked): (p, rescale of
    the running sums, new running max, new running sum)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _outlier_entries(idx_ptr, val_ptr, b, NBLK, NO, t0, hlen, DG, layer_off,
                     KD: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr, BLOCK: tl.constexpr,
                     E_P2: tl.constexpr):
    """The sparse-residual entries of the history blocks that tile [t0, t0 + BLOCK) covers, kept when they
    fall in the tile, before hlen and in this layer's rows: (token in tile, kv head, channel, value (0 when
    not kept), kept) each [E_P2]. BLK divides BLOCK or BLOCK divides BLK (the launcher checks)."""
    b0 = t0 // BLK
    e = tl.arange(0, E_P2)
    blk = b0 + e // NO
    emask = (e < ((BLOCK + BLK - 1) // BLK) * NO) & (blk < NBLK)  # the blocks the tile covers
    ptr = (b * NBLK + b0) * NO + e
    raw = tl.load(idx_ptr + ptr, mask=emask, other=0).to(tl.int32)
    val = tl.load(val_ptr + ptr, mask=emask, other=0.0).to(tl.float32)
    t = blk * BLK + raw // DG
    j = raw % DG - layer_off
    ok = emask & (t >= t0) & (t < t0 + BLOCK) & (t < hlen) & (j >= 0) & (j < KD)
    j = tl.where(ok, j, 0)
    return t - t0, j // D, j % D, tl.where(ok, val, 0.0), ok


@triton.jit
def _token_onehot(tt, ok, BLOCK: tl.constexpr, DT: tl.constexpr):
    """[E, BLOCK] in DT (exact): entry e sits at token tt[e] of the tile."""
    return tl.where(ok[:, None] & (tt[:, None] == tl.arange(0, BLOCK)[None, :]), 1.0, 0.0).to(DT)


@triton.jit
def _value_outliers(acc_d, p, vidx_ptr, vval_ptr, b, NBLK, NO, t0, hlen, DG, layer_off, head_of,
                    KD: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr, BLOCK: tl.constexpr,
                    E_P2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """acc_d [M, D] += Σ_e p[:, t_e]·value_e·[kv head of the row == head_e] at channel c_e (acc_d already
    rescaled by the caller); head_of [M]: the kv head of each query-head row."""
    tt, hd, ch, val, ok = _outlier_entries(vidx_ptr, vval_ptr, b, NBLK, NO, t0, hlen, DG, layer_off,
                                           KD, D, BLK, BLOCK, E_P2)
    # one-hot operands in DT (fp16 on the GPU: exact, half the registers of fp32); p and p·value round to it
    pe = tl.dot(p.to(DT), tl.trans(_token_onehot(tt, ok, BLOCK, DT)), input_precision=PREC)  # [M, E]: p at entries
    w = tl.where(head_of[:, None] == hd[None, :], pe * val[None, :], 0.0).to(DT)
    cmat = tl.where(ok[:, None] & (ch[:, None] == tl.arange(0, D)[None, :]), 1.0, 0.0).to(DT)  # [E, D]
    return acc_d + tl.dot(w, cmat, input_precision=PREC)


@triton.jit
def _latent_hist_kernel(
    # pointers
    qlat_ptr, bias_ptr, q_ptr, ck_ptr, cv_ptr, hlen_ptr, kidx_ptr, kval_ptr, vidx_ptr, vval_ptr,
    m_ptr, l_ptr, acc_ptr, accd_ptr,
    # sizes
    H, S, RK, RV, WK, WV, n_splits, tiles_per_split, sm_scale, G, NBLK, NOK, NOV, DG, layer_off,
    # constexprs
    BITS: tl.constexpr, H_P2: tl.constexpr, RK_P2: tl.constexpr, RV_P2: tl.constexpr, BLOCK: tl.constexpr,
    PREC: tl.constexpr, DT: tl.constexpr, D: tl.constexpr, KD: tl.constexpr, BLK: tl.constexpr,
    KOUT: tl.constexpr, VOUT: tl.constexpr, EK_P2: tl.constexpr, EV_P2: tl.constexpr,
):
    b = tl.program_id(0)
    sp = tl.program_id(1)
    offs_h = tl.arange(0, H_P2)
    hmask = offs_h < H
    head_of = offs_h // G
    offs_rk = tl.arange(0, RK_P2)
    offs_rv = tl.arange(0, RV_P2)
    offs_d = tl.arange(0, D)
    # q_lat in log2 units so the softmax uses exp2
    qscale = sm_scale * 1.4426950408889634
    q = tl.load(qlat_ptr + (b * H + offs_h)[:, None] * RK + offs_rk[None, :],
                mask=hmask[:, None] & (offs_rk < RK)[None, :], other=0.0) * qscale  # [H_P2, RK_P2]
    q = q.to(DT)
    bias = tl.load(bias_ptr + b * H + offs_h, mask=hmask, other=0.0) * qscale  # [H_P2]
    hlen = tl.load(hlen_ptr + b)
    ck_row = ck_ptr + b * S * WK  # W = R for an fp16 latent
    cv_row = cv_ptr + b * S * WV
    m_i = tl.full([H_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([H_P2], tl.float32)
    acc = tl.zeros([H_P2, RV_P2], tl.float32)
    acc_d = tl.zeros([H_P2, D], tl.float32)
    t0 = sp * tiles_per_split * BLOCK
    t_hi = tl.minimum(t0 + tiles_per_split * BLOCK, hlen)
    while t0 < t_hi:  # a while loop: the CPU interpreter rejects range() over a runtime bound
        tok = t0 + tl.arange(0, BLOCK)
        tmask = tok < hlen
        ck = _codes_tile(ck_row, tok, tmask, RK, WK, BITS, RK_P2).to(DT)  # [BLOCK, RK_P2], exact in fp16
        s = tl.dot(q, tl.trans(ck), input_precision=PREC) + bias[:, None]  # [H_P2, BLOCK]
        if KOUT:  # q[h, c]·residual, scattered into the scores of the entries' tokens
            tt, hd, ch, val, ok = _outlier_entries(kidx_ptr, kval_ptr, b, NBLK, NOK, t0, hlen, DG, layer_off,
                                                   KD, D, BLK, BLOCK, EK_P2)
            sel = hmask[:, None] & (head_of[:, None] == hd[None, :])  # entries not kept have value 0
            qe = tl.load(q_ptr + (b * H + offs_h)[:, None] * D + ch[None, :], mask=sel, other=0.0)
            s += tl.dot((qe * (val * qscale)[None, :]).to(DT), _token_onehot(tt, ok, BLOCK, DT), input_precision=PREC)
        s = tl.where(tmask[None, :], s, float("-inf"))
        p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i)
        cv = _codes_tile(cv_row, tok, tmask, RV, WV, BITS, RV_P2).to(DT)  # [BLOCK, RV_P2]
        acc = acc * alpha[:, None] + tl.dot(p.to(DT), cv, input_precision=PREC)
        if VOUT:
            acc_d = _value_outliers(acc_d * alpha[:, None], p, vidx_ptr, vval_ptr, b, NBLK, NOV, t0, hlen, DG,
                                    layer_off, head_of, KD, D, BLK, BLOCK, EV_P2, PREC, DT)
        m_i = m_new
        t0 += BLOCK
    row = b * n_splits + sp
    tl.store(m_ptr + row * H + offs_h, m_i, mask=hmask)
    tl.store(l_ptr + row * H + offs_h, l_i, mask=hmask)
    tl.store(acc_ptr + (row * H + offs_h)[:, None] * RV + offs_rv[None, :], acc,
             mask=hmask[:, None] & (offs_rv < RV)[None, :])
    if VOUT:
        tl.store(accd_ptr + (row * H + offs_h)[:, None] * D + offs_d[None, :], acc_d, mask=hmask[:, None])


@triton.jit
def _latent_hist_pre_kernel(
    # pointers
    q_ptr, uk_ptr, kb_ptr, inv_ptr, ck_ptr, cv_ptr, hlen_ptr, kidx_ptr, kval_ptr, vidx_ptr, vval_ptr,
    m_ptr, l_ptr, acc_ptr, accd_ptr,
    # sizes
    H, K, S, RK, RV, WK, WV, n_splits, tiles_per_split, sm_scale, pos0, NBLK, NOK, NOV, DG, layer_off,
    # constexprs
    BITS: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, RK_P2: tl.constexpr, RV_P2: tl.constexpr,
    BLOCK: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, D: tl.constexpr, KD: tl.constexpr,
    BLK: tl.constexpr, KOUT: tl.constexpr, VOUT: tl.constexpr, EK_P2: tl.constexpr, EV_P2: tl.constexpr,
    RC: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    DH: tl.constexpr = D // 2
    offs_g = tl.arange(0, G_P2)
    gmask = offs_g < G
    heads = kh * G + offs_g
    head_of = tl.where(gmask, kh, -1)  # rows past G match no residual entry
    offs_i = tl.arange(0, DH)
    offs_rv = tl.arange(0, RV_P2)
    qscale = sm_scale * 1.4426950408889634
    qrow = (b * H + heads)[:, None] * D
    q1 = tl.load(q_ptr + qrow + offs_i[None, :], mask=gmask[:, None], other=0.0) * qscale  # [G_P2, DH]
    q2 = tl.load(q_ptr + qrow + DH + offs_i[None, :], mask=gmask[:, None], other=0.0) * qscale
    kb1 = tl.load(kb_ptr + kh * D + offs_i)  # mean − off·U step, halves
    kb2 = tl.load(kb_ptr + kh * D + DH + offs_i)
    inv = tl.load(inv_ptr + offs_i)
    hlen = tl.load(hlen_ptr + b)
    ck_row = ck_ptr + b * S * WK  # W = R for an fp16 latent
    cv_row = cv_ptr + b * S * WV
    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    acc = tl.zeros([G_P2, RV_P2], tl.float32)
    acc_d = tl.zeros([G_P2, D], tl.float32)
    t0 = sp * tiles_per_split * BLOCK
    t_hi = tl.minimum(t0 + tiles_per_split * BLOCK, hlen)
    while t0 < t_hi:
        tok = t0 + tl.arange(0, BLOCK)
        tmask = tok < hlen
        k1 = tl.zeros([BLOCK, DH], tl.float32) + kb1[None, :]  # [BLOCK, DH]
        k2 = tl.zeros([BLOCK, DH], tl.float32) + kb2[None, :]
        for c0 in tl.static_range(0, RK_P2, RC):  # RC latent channels at a time: bounded registers
            ck = _codes_tile(ck_row, tok, tmask, RK, WK, BITS, RC, c0).to(DT)  # [BLOCK, RC]
            offs_c = c0 + tl.arange(0, RC)
            u_rows = uk_ptr + (kh * D + offs_i)[:, None] * RK + offs_c[None, :]  # U ⊙ step, first half
            umask = (offs_c < RK)[None, :]
            u1 = tl.load(u_rows, mask=umask, other=0.0)  # [DH, RC]
            u2 = tl.load(u_rows + DH * RK, mask=umask, other=0.0)
            k1 += tl.dot(ck, tl.trans(u1), input_precision=PREC)
            k2 += tl.dot(ck, tl.trans(u2), input_precision=PREC)
        if KOUT:  # residual added to the un-rotated key halves
            tt, hd, ch, val, ok = _outlier_entries(kidx_ptr, kval_ptr, b, NBLK, NOK, t0, hlen, DG, layer_off,
                                                   KD, D, BLK, BLOCK, EK_P2)
            mine = ok & (hd == kh)
            oh = tl.trans(_token_onehot(tt, mine, BLOCK, DT))  # [BLOCK, E]
            m1 = tl.where(mine[:, None] & (ch[:, None] == offs_i[None, :]), val[:, None], 0.0).to(DT)  # [E, DH]
            m2 = tl.where(mine[:, None] & (ch[:, None] == DH + offs_i[None, :]), val[:, None], 0.0).to(DT)
            k1 += tl.dot(oh, m1, input_precision=PREC)
            k2 += tl.dot(oh, m2, input_precision=PREC)
        ang = (pos0 + tok).to(tl.float32)[:, None] * inv[None, :]  # fl(pos · inv_freq), as torch forms it
        c = tl.cos(ang)
        sn = tl.sin(ang)
        r1 = k1 * c - k2 * sn
        r2 = k2 * c + k1 * sn
        s = tl.dot(q1, tl.trans(r1), input_precision=PREC)
        s = tl.dot(q2, tl.trans(r2), s, input_precision=PREC)  # [G_P2, BLOCK]
        s = tl.where(tmask[None, :], s, float("-inf"))
        p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i)
        cv = _codes_tile(cv_row, tok, tmask, RV, WV, BITS, RV_P2).to(DT)
        acc = acc * alpha[:, None] + tl.dot(p.to(DT), cv, input_precision=PREC)
        if VOUT:
            acc_d = _value_outliers(acc_d * alpha[:, None], p, vidx_ptr, vval_ptr, b, NBLK, NOV, t0, hlen, DG,
                                    layer_off, head_of, KD, D, BLK, BLOCK, EV_P2, PREC, DT)
        m_i = m_new
        t0 += BLOCK
    row = (b * n_splits + sp) * H + heads
    tl.store(m_ptr + row, m_i, mask=gmask)
    tl.store(l_ptr + row, l_i, mask=gmask)
    tl.store(acc_ptr + row[:, None] * RV + offs_rv[None, :], acc, mask=gmask[:, None] & (offs_rv < RV)[None, :])
    if VOUT:
        tl.store(accd_ptr + row[:, None] * D + tl.arange(0, D)[None, :], acc_d, mask=gmask[:, None])


@triton.jit
def _window_kernel(
    # pointers
    q_ptr, wk_ptr, wv_ptr, wlen_ptr, m_ptr, l_ptr, acc_ptr,
    # sizes
    H, K, WC, sm_scale,
    # constexprs
    D: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    offs_g = tl.arange(0, G_P2)
    gmask = offs_g < G
    offs_d = tl.arange(0, D)
    heads = kh * G + offs_g
    qscale = sm_scale * 1.4426950408889634
    q = tl.load(q_ptr + (b * H + heads)[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(tl.float32) * qscale  # [G_P2, D]
    wlen = tl.load(wlen_ptr + b)
    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    acc = tl.zeros([G_P2, D], tl.float32)
    base = (b * K + kh) * WC
    t0 = 0
    while t0 < wlen:
        tok = t0 + tl.arange(0, BLOCK)
        tmask = tok < wlen
        ptr = (base + tok)[:, None] * D + offs_d[None, :]
        k = tl.load(wk_ptr + ptr, mask=tmask[:, None], other=0.0).to(tl.float32)  # [BLOCK, D]
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        s = tl.where(tmask[None, :], s, float("-inf"))
        p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i)
        v = tl.load(wv_ptr + ptr, mask=tmask[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m_i = m_new
        t0 += BLOCK
    out = b * H + heads
    tl.store(m_ptr + out, m_i, mask=gmask)
    tl.store(l_ptr + out, l_i, mask=gmask)
    tl.store(acc_ptr + out[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])


class LatentView(NamedTuple):
    """A latent codec (one layer group's keys or values, moec.runtime.latent.LatentCodec) on one device, in
    the forms the launcher's per-layer arguments are cut from (made once per codec and device by its
    `kernel_view`): layer j of the group, K KV heads of head_dim d, takes u = basis[j·K·d : (j+1)·K·d]
    viewed [K, d, r], mean likewise [K, d], and step."""

    bits: int  # 2, 4 or 16 on the kernel path (kernel_supports)
    block: int  # tokens per history block (the sparse residual's unit)
    n_out: int  # sparse-residual entries per block; 0: none
    group_dim: int  # D = rows of the group: [layer, kv head, channel]
    basis: torch.Tensor  # [D, r] fp32
    mean: torch.Tensor  # [D] fp32
    step: torch.Tensor  # [r] fp32: the quantization step 2·scale/2^bits (ones for a 16-bit latent)


def layer_parts(view: LatentView, j: int, K: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u [K, d, r], mean [K, d], step [r]) of layer j of the group (views of the codec's tensors, no copy)."""
    rows = slice(j * K * d, (j + 1) * K * d)
    return view.basis[rows].reshape(K, d, view.basis.shape[1]), view.mean[rows].reshape(K, d), view.step


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def kernel_supports(bits: int, head_dim: int, rope_pre: bool, block: int, has_outliers: bool,
                    tile: int = BLOCK_N) -> bool:
    """Whether latent_decode_attention takes this cache (else the cache's torch path): 2/4/16-bit codes, a
    power-of-two head_dim (≥ 32 for pre-RoPE keys, whose halves go through tl.dot), and for a sparse
    residual a block that divides the tile or is a multiple of it."""
    d = head_dim
    ok = bits in (2, 4, 16) and d >= (32 if rope_pre else 16) and d & (d - 1) == 0
    if has_outliers:
        ok = ok and (tile % block == 0 or block % tile == 0)
    return ok


def _dot_types(dev, cfg: dict) -> tuple[str, tl.dtype]:
    """(input precision of fp32 dots, dtype of the main dot operands): tf32 / fp16 on the GPU, exact fp32 in
    the CPU interpreter."""
    gpu = not _interpreting() and torch.device(dev).type != "cpu"
    return ("tf32" if gpu else "ieee"), (tl.float16 if gpu and cfg["fp16"] else tl.float32)


def latent_statics(u_k, mean_k, step_k, u_v, mean_v, step_v, bits: int, G: int, rope_pre: bool,
                   config: dict | None = None) -> dict[str, torch.Tensor]:
    """What the launcher derives from a layer's codec tensors: the head-expanded bases of the absorbed
    query (U_k ⊙ step) and of the output up-projection, or for pre-RoPE keys the rebuild matrix U_k ⊙ step
    in the dot dtype and its offset. LatentKVCache makes it once per layer (from its codecs' LatentView), so
    a decode step does not redo it."""
    off = 0.0 if bits == 16 else 2 ** (bits - 1) - 0.5
    _prec, dt = _dot_types(u_k.device, launch_config.config("latent_decode_attention", u_k.device)["launch"]
                           | (config or {}))
    uks = u_k.float() * step_k.float()  # [K, d, RK]
    st = {"uv_h": u_v.float().repeat_interleave(G, 0).contiguous(),  # [H, d, RV]
          "mv_h": mean_v.float().repeat_interleave(G, 0).contiguous(), "step_v": step_v.float().contiguous()}
    if rope_pre:
        st["uks"] = uks.to(torch.float16 if dt == tl.float16 else torch.float32).contiguous()
        st["kb"] = (mean_k.float() - off * st["uks"].float().sum(-1)).contiguous()  # [K, d]
    else:
        st["uk_h"] = uks.repeat_interleave(G, 0).contiguous()  # [H, d, RK]
        st["mk_h"] = mean_k.float().repeat_interleave(G, 0).contiguous()  # [H, d]
    return st


def latent_decode_attention(q, codes_k, codes_v, u_k, mean_k, step_k, u_v, mean_v, step_v, bits: int,
                            hist_len, win_k, win_v, win_len, splits: int | None = None, *,
                            k_out=None, v_out=None, block: int = 0, group_dim: int = 0, layer_off: int = 0,
                            rope: tuple[torch.Tensor, int] | None = None, config: dict | None = None,
                            statics: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over latent history + fp16 window -> out [B, H, d] fp32.

    step_*: the per-channel quantization step (2·scale/2^bits; ones for a 16-bit latent).
    k_out / v_out: the sparse residual (idx, val) per history block of `block` tokens; idx = t·group_dim + j,
    this layer's rows j in [layer_off, layer_off + K·d). rope = (inv_freq [d/2], pos0): pre-RoPE keys,
    history token t at position pos0 + t (moec.runtime.model.rope_cos_sin's formula). statics: this
    layer's latent_statics (made here when not given)."""
    B, H, d = q.shape
    K, d2, RK = u_k.shape
    RV = u_v.shape[2]
    S = codes_k.shape[1]
    assert d2 == d and H % K == 0 and d & (d - 1) == 0 and d >= 16, (q.shape, u_k.shape)
    assert bits in (2, 4, 16), bits
    if bits == 16:
        assert codes_k.dtype == codes_v.dtype == torch.float16, (codes_k.dtype, codes_v.dtype)
        assert codes_k.shape == (B, S, RK) and codes_v.shape == (B, S, RV), (codes_k.shape, codes_v.shape)
        WK, WV = RK, RV
    else:
        WK, WV = RK * bits // 8, RV * bits // 8
        assert RK % (8 // bits) == 0 and RV % (8 // bits) == 0, (RK, RV, bits)
        assert codes_k.dtype == codes_v.dtype == torch.uint8, (codes_k.dtype, codes_v.dtype)
        assert codes_k.shape == (B, S, WK) and codes_v.shape == (B, S, WV), (codes_k.shape, codes_v.shape)
    assert u_v.shape == (K, d, RV) and mean_k.shape == mean_v.shape == (K, d), (u_v.shape, mean_k.shape)
    assert step_k.shape == (RK,) and step_v.shape == (RV,), (step_k.shape, step_v.shape)
    assert win_k.shape == win_v.shape and win_k.shape[:2] == (B, K) and win_k.shape[3] == d, win_k.shape
    assert win_k.dtype == torch.float16 and hist_len.shape == win_len.shape == (B,), (win_k.dtype, hist_len.shape)
    assert codes_k.is_contiguous() and codes_v.is_contiguous() and win_k.is_contiguous() and win_v.is_contiguous()
    k_out, v_out = (None if o is None or o[0].shape[-1] == 0 else o for o in (k_out, v_out))
    cfg = launch_config.config("latent_decode_attention", q.device)["launch"] | (config or {})
    has_res = k_out is not None or v_out is not None
    BLOCK = cfg["block_res"] if has_res and "block" not in (config or {}) else cfg["block"]
    assert kernel_supports(bits, d, rope is not None, block or BLOCK, has_res, BLOCK)
    dev, G = q.device, H // K
    off = 0.0 if bits == 16 else 2 ** (bits - 1) - 0.5
    qf = q.float().contiguous()
    hist_len, win_len = hist_len.to(torch.int32).contiguous(), win_len.to(torch.int32).contiguous()
    sm_scale = 1.0 / math.sqrt(d)
    prec, dt = _dot_types(dev, cfg)
    st = statics if statics is not None else latent_statics(u_k, mean_k, step_k, u_v, mean_v, step_v, bits, G,
                                                            rope is not None, config)

    # the sparse residual: dummies when absent (never read: KOUT / VOUT are constexpr)
    nblk = nok = nov = 0
    dummy_i, dummy_v = torch.zeros(1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.float16, device=dev)
    kidx, kval, vidx, vval = dummy_i, dummy_v, dummy_i, dummy_v
    for kind, o in (("k", k_out), ("v", v_out)):
        if o is None:
            continue
        idx, val = o
        assert idx.shape == val.shape and idx.shape[0] == B and block and group_dim, (idx.shape, block, group_dim)
        assert layer_off + K * d <= group_dim, (layer_off, K, d, group_dim)
        nblk = idx.shape[1]
        if kind == "k":
            kidx, kval, nok = idx.contiguous(), val.contiguous(), idx.shape[2]
        else:
            vidx, vval, nov = idx.contiguous(), val.contiguous(), idx.shape[2]
    blk = block or BLOCK
    nbt = max(1, BLOCK // blk)
    ek, ev = _p2(nbt * max(nok, 1)), _p2(nbt * max(nov, 1))
    out_args = (kidx, kval, vidx, vval)
    out_sizes = (nblk, nok, nov, group_dim or K * d, layer_off)
    out_const = dict(D=d, KD=K * d, BLK=blk, KOUT=k_out is not None, VOUT=v_out is not None, EK_P2=ek, EV_P2=ev)

    tiles = triton.cdiv(S, BLOCK)
    programs_per_split = B if rope is None else B * K
    if splits is None:  # enough programs to fill the GPU at batch 1, a few tiles each
        splits = max(1, min(tiles, triton.cdiv(cfg["programs"], programs_per_split)))
    tps = triton.cdiv(max(tiles, 1), splits)
    splits = triton.cdiv(max(tiles, 1), tps)
    m_h = torch.empty(B, splits, H, device=dev)
    l_h = torch.empty(B, splits, H, device=dev)
    a_h = torch.empty(B, splits, H, RV, device=dev)
    a_d = torch.zeros(B, splits, H, d, device=dev) if v_out is not None else torch.zeros(1, device=dev)
    if rope is None:
        qlat = torch.einsum("bhd,hdr->bhr", qf, st["uk_h"])  # [B, H, RK]: step_k ⊙ (U_k^T q)
        bias = (qf * st["mk_h"]).sum(-1) - off * qlat.sum(-1)  # [B, H]
        _latent_hist_kernel[(B, splits)](
            qlat.contiguous(), bias.contiguous(), qf, codes_k, codes_v, hist_len, *out_args, m_h, l_h, a_h, a_d,
            H, S, RK, RV, WK, WV, splits, tps, sm_scale, G, *out_sizes,
            BITS=bits, H_P2=_p2(H), RK_P2=_p2(RK), RV_P2=_p2(RV), BLOCK=BLOCK, PREC=prec, DT=dt, **out_const,
            num_warps=cfg["warps_res"] if has_res and "warps_post" not in (config or {}) else cfg["warps_post"])
    else:
        inv_freq, pos0 = rope
        _latent_hist_pre_kernel[(B, K, splits)](
            qf, st["uks"], st["kb"], inv_freq.float().contiguous(), codes_k, codes_v, hist_len, *out_args,
            m_h, l_h, a_h, a_d,
            H, K, S, RK, RV, WK, WV, splits, tps, sm_scale, pos0, *out_sizes,
            BITS=bits, G=G, G_P2=_p2(G), RK_P2=_p2(RK), RV_P2=_p2(RV), BLOCK=BLOCK, PREC=prec, DT=dt, **out_const,
            RC=min(cfg["rank_chunk"], _p2(RK)), num_warps=cfg["warps_pre"])
    m_w = torch.empty(B, H, device=dev)
    l_w = torch.empty(B, H, device=dev)
    a_w = torch.empty(B, H, d, device=dev)
    _window_kernel[(B, K)](
        q.contiguous(), win_k, win_v, win_len, m_w, l_w, a_w, H, K, win_k.shape[2], sm_scale,
        D=d, G=G, G_P2=_p2(G), BLOCK=BLOCK_W, PREC=prec, num_warps=4)

    # merge (log2 units): splits and window
    m = torch.maximum(m_h.amax(1), m_w)  # [B, H]
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    a_s = torch.exp2(m_h - m[:, None])  # [B, splits, H]
    a_wf = torch.exp2(m_w - m)
    p_h = (a_s * l_h).sum(1)  # [B, H]
    lat = (a_s[..., None] * a_h).sum(1)  # [B, H, RV]
    lat = (lat - off * p_h[..., None]) * st["step_v"]
    out = torch.einsum("hdr,bhr->bhd", st["uv_h"], lat) + st["mv_h"] * p_h[..., None]
    if v_out is not None:
        out = out + (a_s[..., None] * a_d).sum(1)
    out = out + a_wf[..., None] * a_w
    return out / (p_h + a_wf * l_w)[..., None]


def _residual(o, B, S, block, group_dim, layer_off, K, d, dev):
    """The sparse residual of one layer as a dense [B, K, S, d] tensor (reference)."""
    x = torch.zeros(B, S // block if S % block == 0 else -(-S // block), block * group_dim, device=dev)
    if o is not None:
        idx, val = o
        x[:, : idx.shape[1]].scatter_add_(-1, idx.long(), val.float())
    x = x.reshape(B, -1, group_dim)[:, :S, layer_off : layer_off + K * d]
    return x.reshape(B, S, K, d).permute(0, 2, 1, 3)


def latent_decode_attention_ref(q, codes_k, codes_v, u_k, mean_k, step_k, u_v, mean_v, step_v, bits: int,
                                hist_len, win_k, win_v, win_len, *, k_out=None, v_out=None, block: int = 0,
                                group_dim: int = 0, layer_off: int = 0,
                                rope: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Plain torch: reconstruct every key/value (k = U_k deq(z) + mean + residual, rotated for pre-RoPE
    keys), then softmax attention per row."""
    B, H, d = q.shape
    K = u_k.shape[0]
    S = codes_k.shape[1]
    G = H // K
    off = 0.0 if bits == 16 else 2 ** (bits - 1) - 0.5

    def deq(codes, step):
        c = codes.float() if bits == 16 else unpack_planar(codes, bits, step.shape[0]).float()
        return (c - off) * step.float()  # [B, S, R]

    kh = torch.einsum("kdr,bsr->bksd", u_k.float(), deq(codes_k, step_k)) + mean_k.float()[None, :, None]
    vh = torch.einsum("kdr,bsr->bksd", u_v.float(), deq(codes_v, step_v)) + mean_v.float()[None, :, None]
    if k_out is not None:
        kh = kh + _residual(k_out, B, S, block, group_dim, layer_off, K, d, q.device)
    if v_out is not None:
        vh = vh + _residual(v_out, B, S, block, group_dim, layer_off, K, d, q.device)
    if rope is not None:
        inv_freq, pos0 = rope
        ang = torch.arange(pos0, pos0 + S, device=q.device).float()[:, None] * inv_freq.float()[None, :]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        kh = kh * cos + torch.cat([-kh[..., d // 2 :], kh[..., : d // 2]], -1) * sin
    out = torch.empty(B, H, d, device=q.device)
    for b in range(B):
        hl, wl = int(hist_len[b]), int(win_len[b])
        keys = torch.cat([kh[b, :, :hl], win_k[b, :, :wl].float()], 1).repeat_interleave(G, 0)  # [H, n, d]
        vals = torch.cat([vh[b, :, :hl], win_v[b, :, :wl].float()], 1).repeat_interleave(G, 0)
        s = torch.einsum("hd,hnd->hn", q[b].float(), keys) / math.sqrt(d)
        out[b] = torch.einsum("hn,hnd->hd", s.softmax(-1), vals)
    return out
