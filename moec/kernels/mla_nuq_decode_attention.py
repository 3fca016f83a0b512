"""Decode attention over the compressed MLA latent cache (KV codec mla-nuq, runtime/mla_nuq.py).

The absorbed MLA step (kernels/mla_decode_attention.py) over a cache whose rows are held in a rotated basis:
sinks and window as fp16 rows, the history as 2-bit codes in planes with one fp16 scale per token and part
(c, k_rope) and 4 levels per part and layer. With levels lv and scales s_c, s_r of token t:
    score(h, t) = s_c · (q_lat_h · lv_c[codes_c]) + s_r · (q_rope_h · lv_r[codes_r])
    out_h      += (p_t · s_c) · lv_c[codes_c]
so a history tile is dequantized once to level values (no multiply: the per-token scales factor out of both
products) and serves the scores and the output of every head of the block (values are a prefix of the keys).

  - programs: (batch row, block of BH heads, split); splits 0..PH-1 share the history (whole BLOCK_N tiles,
    the split length from hist_len on the device, so one static grid serves any context: CUDA graphs);
    splits PH.. take one BLOCK_N tile of the fp16 window each (sinks first, slots < win_len);
  - the new row (already rotated, the last window slot) enters from registers in the window split holding
    its slot, whose head block 0 also writes it to the window;
  - history tiles are worked one code plane at a time (the query and the accumulator held split by plane):
    a plane is one shift and mask of the loaded bytes and a 4-way select into the levels, in the compute dtype,
    fed straight to the dots (no reshape, no fp32 tile);
  - the query's latent part comes rotated (model.MLAttention folds Rc into its absorbed weights, and the output
    stays in the rotated basis for W_UV·Rc); its RoPE part is rotated by Rr here, one small dot per program;
  - splits are combined by kv_decode_attention.combine_splits.

Shapes: q [B, H, R + RP] (last dim contiguous), codes [Bc, HC, (R + RP) / 4] uint8, scales [Bc, HC, 2] fp16,
levels [2, 4] fp32, hist_len [B] int32, win [Bc, WC, R + RP] fp16, new [B, R + RP], win_len [B] int32 (slot of the
new row + 1), rope_rotation Rr [RP, RP] fp32 -> [B, H, R]. R and RP powers of two >= 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch_config, pdl
from .kv_decode_attention import LOG2E, _interpreting, combine_splits
from .mla_decode_attention import _new_row, _store_part, _tile
from .pdl import begin as pdl_begin

CONFIG = launch_config.defaults()["mla_nuq_decode_attention"]["launch"]


@triton.jit
def _plane(packed, k: tl.constexpr, l0, l1, l2, l3):
    """Plane k of packed codes (int32 [BLOCK_N, n/4]) as level values in the levels' dtype: channels k·n/4 .."""
    c = (packed >> (2 * k)) & 3
    return tl.where(c == 0, l0, tl.where(c == 1, l1, tl.where(c == 2, l2, l3)))


@triton.jit
def _hist_tile(qc0, qc1, qc2, qc3, qr0, qr1, qr2, qr3, m_i, l_i, a0, a1, a2, a3, codes_ptr, scale_ptr, cbase, sbase,
               t0, end, lc0, lc1, lc2, lc3, lr0, lr1, lr2, lr3, R: tl.constexpr, RP: tl.constexpr,
               BLOCK_N: tl.constexpr, DT: tl.constexpr):
    """Online softmax over history tokens t0 .. t0 + BLOCK_N - 1 (< end), one code plane at a time: the query
    and the accumulator come split by plane (qc_k, a_k: channels k·R/4 ..), so no tile is ever reshaped."""
    NB: tl.constexpr = (R + RP) // 4
    offs_n = t0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < end
    row = codes_ptr + cbase + offs_n[:, None].to(tl.int64) * NB
    cb = tl.load(row + tl.arange(0, R // 4)[None, :], mask=nmask[:, None], other=0).to(tl.int32)
    rb = tl.load(row + R // 4 + tl.arange(0, RP // 4)[None, :], mask=nmask[:, None], other=0).to(tl.int32)
    srow = scale_ptr + sbase + offs_n.to(tl.int64) * 2
    sc = tl.load(srow, mask=nmask, other=0.0).to(tl.float32)
    sr = tl.load(srow + 1, mask=nmask, other=0.0).to(tl.float32)
    s_c = tl.dot(qc0, tl.trans(_plane(cb, 0, lc0, lc1, lc2, lc3)))
    s_c = tl.dot(qc1, tl.trans(_plane(cb, 1, lc0, lc1, lc2, lc3)), s_c)
    s_c = tl.dot(qc2, tl.trans(_plane(cb, 2, lc0, lc1, lc2, lc3)), s_c)
    s_c = tl.dot(qc3, tl.trans(_plane(cb, 3, lc0, lc1, lc2, lc3)), s_c)
    s_r = tl.dot(qr0, tl.trans(_plane(rb, 0, lr0, lr1, lr2, lr3)))
    s_r = tl.dot(qr1, tl.trans(_plane(rb, 1, lr0, lr1, lr2, lr3)), s_r)
    s_r = tl.dot(qr2, tl.trans(_plane(rb, 2, lr0, lr1, lr2, lr3)), s_r)
    s_r = tl.dot(qr3, tl.trans(_plane(rb, 3, lr0, lr1, lr2, lr3)), s_r)
    s = s_c * sc[None, :] + s_r * sr[None, :]  # log2 units
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pw = (p * sc[None, :]).to(DT)
    a0 = tl.dot(pw, _plane(cb, 0, lc0, lc1, lc2, lc3), a0 * alpha[:, None])
    a1 = tl.dot(pw, _plane(cb, 1, lc0, lc1, lc2, lc3), a1 * alpha[:, None])
    a2 = tl.dot(pw, _plane(cb, 2, lc0, lc1, lc2, lc3), a2 * alpha[:, None])
    a3 = tl.dot(pw, _plane(cb, 3, lc0, lc1, lc2, lc3), a3 * alpha[:, None])
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _mla_nuq_kernel(q_ptr, codes_ptr, scale_ptr, lev_ptr, hist_ptr, win_ptr, new_ptr, wlen_ptr, rr_ptr, part_ptr,
                    acc16_ptr, H, HC, WC, PH, P, sq_b, sq_h, sn_b, qk_scale, R: tl.constexpr, RW: tl.constexpr,
                    RP: tl.constexpr, BH: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
                    ROT_ROPE: tl.constexpr, STAGES: tl.constexpr, INTERP: tl.constexpr, HALF: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    L: tl.constexpr = R + RP
    RQ: tl.constexpr = R // 4
    PQ: tl.constexpr = RP // 4
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    offs_h = hb * BH + tl.arange(0, BH)
    hmask = offs_h < H
    qrow = q_ptr + b * sq_b + offs_h[:, None] * sq_h
    if HALF:  # acc / l in fp16 apart (acc16 [B·H, P, RW]), (m, l) in part [B·H, P, 2]
        out = acc16_ptr + ((b * H + offs_h) * P + sp) * RW
        ml = part_ptr + ((b * H + offs_h) * P + sp) * 2
    else:
        out = part_ptr + ((b * H + offs_h) * P + sp) * (RW + 2)  # RW >= R: the combine's width (zeros past R)
        ml = out + RW
    m_i = tl.full((BH,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BH,), dtype=tl.float32)

    if sp < PH:  # a share of the history, by code plane (the query split the same way)
        oq = tl.arange(0, RQ)
        op = tl.arange(0, PQ)
        qc0 = (tl.load(qrow + oq[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(DT)
        qc1 = (tl.load(qrow + RQ + oq[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(DT)
        qc2 = (tl.load(qrow + 2 * RQ + oq[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(DT)
        qc3 = (tl.load(qrow + 3 * RQ + oq[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(DT)
        if ROT_ROPE:  # q_rope·Rr, plane by plane: [BH, RP] x [RP, RP/4]
            opf = tl.arange(0, RP)
            qrf = (tl.load(qrow + R + opf[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
                   * qk_scale).to(DT)
            rrow = rr_ptr + opf[:, None] * RP
            qr0 = tl.dot(qrf, tl.load(rrow + op[None, :]).to(DT)).to(DT)
            qr1 = tl.dot(qrf, tl.load(rrow + PQ + op[None, :]).to(DT)).to(DT)
            qr2 = tl.dot(qrf, tl.load(rrow + 2 * PQ + op[None, :]).to(DT)).to(DT)
            qr3 = tl.dot(qrf, tl.load(rrow + 3 * PQ + op[None, :]).to(DT)).to(DT)
        else:
            qr0 = (tl.load(qrow + R + op[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
                   * qk_scale).to(DT)
            qr1 = (tl.load(qrow + R + PQ + op[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
                   * qk_scale).to(DT)
            qr2 = (tl.load(qrow + R + 2 * PQ + op[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
                   * qk_scale).to(DT)
            qr3 = (tl.load(qrow + R + 3 * PQ + op[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
                   * qk_scale).to(DT)
        a0 = tl.zeros((BH, RQ), dtype=tl.float32)
        a1 = tl.zeros((BH, RQ), dtype=tl.float32)
        a2 = tl.zeros((BH, RQ), dtype=tl.float32)
        a3 = tl.zeros((BH, RQ), dtype=tl.float32)
        hl = tl.load(hist_ptr + b)
        tps = tl.cdiv(tl.cdiv(hl, PH), BLOCK_N) * BLOCK_N
        start = sp * tps
        end = tl.minimum(start + tps, hl)
        lc0 = tl.load(lev_ptr).to(DT)
        lc1 = tl.load(lev_ptr + 1).to(DT)
        lc2 = tl.load(lev_ptr + 2).to(DT)
        lc3 = tl.load(lev_ptr + 3).to(DT)
        lr0 = tl.load(lev_ptr + 4).to(DT)
        lr1 = tl.load(lev_ptr + 5).to(DT)
        lr2 = tl.load(lev_ptr + 6).to(DT)
        lr3 = tl.load(lev_ptr + 7).to(DT)
        cbase = b.to(tl.int64) * HC * (L // 4)
        sbase = b.to(tl.int64) * HC * 2
        n_it = tl.cdiv(end - start, BLOCK_N)
        if INTERP:  # the CPU interpreter rejects range() over a runtime bound
            it = 0
            while it < n_it:
                m_i, l_i, a0, a1, a2, a3 = _hist_tile(
                    qc0, qc1, qc2, qc3, qr0, qr1, qr2, qr3, m_i, l_i, a0, a1, a2, a3, codes_ptr, scale_ptr, cbase,
                    sbase, start + it * BLOCK_N, end, lc0, lc1, lc2, lc3, lr0, lr1, lr2, lr3, R, RP, BLOCK_N, DT)
                it += 1
        else:
            for it in tl.range(0, n_it, num_stages=STAGES):
                m_i, l_i, a0, a1, a2, a3 = _hist_tile(
                    qc0, qc1, qc2, qc3, qr0, qr1, qr2, qr3, m_i, l_i, a0, a1, a2, a3, codes_ptr, scale_ptr, cbase,
                    sbase, start + it * BLOCK_N, end, lc0, lc1, lc2, lc3, lr0, lr1, lr2, lr3, R, RP, BLOCK_N, DT)
        _store_part(out, oq, hmask, a0, RW, l_i, HALF)
        _store_part(out, RQ + oq, hmask, a1, RW, l_i, HALF)
        _store_part(out, 2 * RQ + oq, hmask, a2, RW, l_i, HALF)
        _store_part(out, 3 * RQ + oq, hmask, a3, RW, l_i, HALF)
    else:  # one tile of the fp16 window
        offs_r = tl.arange(0, R)
        offs_p = tl.arange(0, RP)
        ql = (tl.load(qrow + offs_r[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(DT)
        qr = (tl.load(qrow + R + offs_p[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(DT)
        if ROT_ROPE:  # q_rope·Rr
            qr = tl.dot(qr, tl.load(rr_ptr + offs_p[:, None] * RP + offs_p[None, :]).to(DT)).to(DT)
        acc = tl.zeros((BH, R), dtype=tl.float32)
        slot = tl.load(wlen_ptr + b) - 1  # the new row's slot
        start = (sp - PH) * BLOCK_N
        wbase = b.to(tl.int64) * WC * L
        if start < slot:
            m_i, l_i, acc = _tile(ql, qr, m_i, l_i, acc, win_ptr, wbase, start, slot, R, RP, R, RP, BLOCK_N, DT)
        if (slot >= start) & (slot < start + BLOCK_N):  # the new row, from registers
            cn = tl.load(new_ptr + b * sn_b + offs_r).to(win_ptr.dtype.element_ty)
            kn = tl.load(new_ptr + b * sn_b + R + offs_p).to(win_ptr.dtype.element_ty)
            m_i, l_i, acc = _new_row(ql, qr, m_i, l_i, acc, cn, kn, DT)
            if hb == 0:
                tl.store(win_ptr + wbase + slot * L + offs_r, cn)
                tl.store(win_ptr + wbase + slot * L + R + offs_p, kn)
        _store_part(out, offs_r, hmask, acc, RW, l_i, HALF)
    tl.store(ml, m_i, mask=hmask)
    tl.store(ml + 1, l_i, mask=hmask)


def supports(r: int, rp: int) -> bool:
    """Whether the kernel takes a latent of r + rp channels (both powers of two, >= 16)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (r, rp))


def mla_nuq_decode_attention(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor,
                             hist_len: torch.Tensor, win: torch.Tensor, new: torch.Tensor, win_len: torch.Tensor,
                             r: int, sm_scale: float, rope_rotation: torch.Tensor | None = None,
                             out_rotation: torch.Tensor | None = None,
                             n_splits: int | None = None, block_n: int | None = None, block_h: int | None = None,
                             num_warps: int | None = None, num_stages: int | None = None,
                             precision: str | None = None, out_dtype: torch.dtype | None = None,
                             half_partials: bool | None = None) -> torch.Tensor:
    """-> [B, H, r] in out_dtype (q's by default); q's RoPE part is rotated by rope_rotation (Rr, fp32 [rp, rp])
    in the kernel and the output by out_rotation (fp32 [r, r]) in the combine, when given; writes `new` into win
    at slot win_len[b] - 1. n_splits: history splits. half_partials: the splits' outputs as fp16 acc / l (as
    mla_decode_attention's; default: the launch config's `half_partials` on CUDA, fp32 partials elsewhere). No
    host syncs (CUDA graphs)."""
    B, H, L = q.shape
    Bc, HC, NB = codes.shape
    rp = L - r
    assert supports(r, rp) and NB == L // 4 and Bc >= B, (q.shape, codes.shape, r)
    assert codes.is_contiguous() and scales.is_contiguous() and win.is_contiguous() and q.stride(-1) == 1
    assert scales.shape == (Bc, HC, 2) and win.shape[0] >= B and win.shape[2] == L and new.shape == (B, L)
    assert levels.shape == (2, 4) and levels.dtype == torch.float32 and new.stride(-1) == 1
    cuda = q.is_cuda and not _interpreting()
    configs = launch_config.config("mla_nuq_decode_attention", q.device)
    # many heads (DeepSeek-V3's 128) have their own launch: a head block re-reads and re-unpacks every tile
    config = configs["many_heads"] if H >= configs["many_heads"]["min_heads"] else configs["launch"]
    precision = precision or ("half" if cuda else "ieee")
    block_n = block_n or (config["block_n"] if cuda else 16)
    bh = block_h or min(config["block_h"], max(16, triton.next_power_of_2(H)))
    warps = num_warps or config["num_warps"]
    if bh >= 64 and warps * 16 > bh:
        # Triton 3.6 lays these dots out as wgmma over more warpgroups along M than the head block has rows
        # (warpsPerCTA [8, 1] on M = 64): wrong results on sm_90 (docs/results.md), so refused on every device
        raise ValueError(f"mla_nuq_decode_attention: a head block of {bh} with {warps} warps is miscompiled on "
                         f"sm_90 (at most {bh // 16} warps for it)")
    n_hb = triton.cdiv(H, bh)
    WC = win.shape[1]
    pw = triton.cdiv(WC, block_n)
    if n_splits is None:  # whole waves of history splits (the window's few short programs come on top)
        programs = int(config["waves"] * launch_config.num_sms(q.device)) if cuda else 4
        n_splits = max(1, min(triton.cdiv(HC, block_n), programs // (B * n_hb)))
    P = n_splits + pw
    rw = triton.cdiv(r, 32) * 32
    half = (cuda and config.get("half_partials", False)) if half_partials is None else half_partials
    part = torch.empty(B * H * P * (2 if half else rw + 2), device=q.device, dtype=torch.float32)
    acc16 = torch.empty(B * H * P * rw, device=q.device, dtype=torch.float16) if half else None
    dt = tl.float32 if precision == "ieee" else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    if rope_rotation is not None:
        rr = rope_rotation
        assert rr.shape == (rp, rp) and rr.dtype == torch.float32 and rr.is_contiguous(), (rr.shape, rr.dtype)
    _mla_nuq_kernel[(B, n_hb, P)](
        q, codes, scales, levels, hist_len, win, new, win_len, levels if rope_rotation is None else rope_rotation, part,
        acc16 if half else part, H, HC, WC, n_splits, P, q.stride(0), q.stride(1), new.stride(0), sm_scale * LOG2E,
        R=r, RW=rw, RP=rp, BH=bh,
        BLOCK_N=block_n, DT=dt, ROT_ROPE=rope_rotation is not None, STAGES=num_stages or config["num_stages"],
        INTERP=not cuda, HALF=half, num_warps=warps, **pdl.options(q.device))
    out = combine_splits(part, B * H, P, rw, out_rotation, out_dtype or q.dtype, acc16=acc16).view(B, H, rw)
    return out if rw == r else out[..., :r]


def mla_nuq_decode_attention_ref(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, codec, hist_len,
                                 win: torch.Tensor, new: torch.Tensor, win_len: torch.Tensor, r: int,
                                 sm_scale: float) -> torch.Tensor:
    """Torch reference (fp32 math; writes the window like the kernel; codec: runtime/mla_nuq.LatentRowCodec for
    the decode) -> [B, H, r] fp32 in the rotated basis."""
    B = q.shape[0]
    rows = torch.arange(B, device=q.device)
    win[rows, win_len.long() - 1] = new.to(win.dtype)
    keys = torch.cat([win[:B].float(), codec.decode(codes[:B], scales[:B])], 1)  # [B, WC + HC, L]
    WC, HC = win.shape[1], codes.shape[1]
    mask = torch.cat([torch.arange(WC, device=q.device)[None, :] < win_len[:, None],
                      torch.arange(HC, device=q.device)[None, :] < hist_len[:, None]], 1)
    s = torch.einsum("bhl,bsl->bhs", q.float(), keys) * sm_scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("bhs,bsr->bhr", s.softmax(-1), keys[..., :r])
