"""Variants of the mla-nuq latent decode kernel's history loop (issue 35: the shipped kernel is 2x slower than the
fp16 latent kernel, see docs/results.md), to time against it in one GPU call.

    python3 -m benchmarks.studies.mla_nuq_variants --out benchmarks/results/mla_nuq_variants_<device>.json
    TRITON_INTERPRET=1 python3 -m benchmarks.studies.mla_nuq_variants --check      # CPU: each variant's numbers

The shipped kernel (moec/kernels/mla_nuq_decode_attention.py) turns each code plane into level values twice per
32-token tile (for the scores, then again for P·c), each with a shift, a mask and three selects. The variants
change only the history tile (the window, the new row and the combine are the shipped ones):
  keep   the four c planes are made once per tile and reused by P·c (more registers, half the dequant work)
  poly   a level is a cubic in the code, k0 + c·(k1 + c·(k2 + c·k3)) in the compute dtype (the 4 levels
         interpolated exactly by the host), instead of the select chain: one convert and three FMAs
  both   keep + poly
Timing: CUDA-graph replays (benchmarks/bench_mla_attention.time_graph), DeepSeek-V2-Lite heads, the cache of
kv-mla-nuq2 at 4k / 32k, batch 1 and 16, each variant beside the shipped kernel and the fp16 latent kernel.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from moec.kernels.kv_decode_attention import LOG2E, _interpreting, combine_splits
from moec.kernels.mla_decode_attention import _new_row, _tile
from moec.kernels.mla_nuq_decode_attention import _plane

VARIANTS = {"keep": (True, False), "poly": (False, True), "both": (True, True)}


@triton.jit
def _lv(packed, k: tl.constexpr, l0, l1, l2, l3, POLY: tl.constexpr, DT: tl.constexpr):
    if POLY:  # l0..l3 are the cubic's coefficients k0..k3 (in DT)
        c = ((packed >> (2 * k)) & 3).to(DT)
        return ((l3 * c + l2) * c + l1) * c + l0
    else:
        return _plane(packed, k, l0, l1, l2, l3)


@triton.jit
def _hist_tile_v(qc0, qc1, qc2, qc3, qr0, qr1, qr2, qr3, m_i, l_i, a0, a1, a2, a3, codes_ptr, scale_ptr, cbase,
                 sbase, t0, end, lc0, lc1, lc2, lc3, lr0, lr1, lr2, lr3, R: tl.constexpr, RP: tl.constexpr,
                 BLOCK_N: tl.constexpr, DT: tl.constexpr, KEEP: tl.constexpr, POLY: tl.constexpr):
    NB: tl.constexpr = (R + RP) // 4
    offs_n = t0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < end
    row = codes_ptr + cbase + offs_n[:, None].to(tl.int64) * NB
    cb = tl.load(row + tl.arange(0, R // 4)[None, :], mask=nmask[:, None], other=0).to(tl.int32)
    rb = tl.load(row + R // 4 + tl.arange(0, RP // 4)[None, :], mask=nmask[:, None], other=0).to(tl.int32)
    srow = scale_ptr + sbase + offs_n.to(tl.int64) * 2
    sc = tl.load(srow, mask=nmask, other=0.0).to(tl.float32)
    sr = tl.load(srow + 1, mask=nmask, other=0.0).to(tl.float32)
    p0 = _lv(cb, 0, lc0, lc1, lc2, lc3, POLY, DT)
    p1 = _lv(cb, 1, lc0, lc1, lc2, lc3, POLY, DT)
    p2 = _lv(cb, 2, lc0, lc1, lc2, lc3, POLY, DT)
    p3 = _lv(cb, 3, lc0, lc1, lc2, lc3, POLY, DT)
    s_c = tl.dot(qc0, tl.trans(p0))
    s_c = tl.dot(qc1, tl.trans(p1), s_c)
    s_c = tl.dot(qc2, tl.trans(p2), s_c)
    s_c = tl.dot(qc3, tl.trans(p3), s_c)
    s_r = tl.dot(qr0, tl.trans(_lv(rb, 0, lr0, lr1, lr2, lr3, POLY, DT)))
    s_r = tl.dot(qr1, tl.trans(_lv(rb, 1, lr0, lr1, lr2, lr3, POLY, DT)), s_r)
    s_r = tl.dot(qr2, tl.trans(_lv(rb, 2, lr0, lr1, lr2, lr3, POLY, DT)), s_r)
    s_r = tl.dot(qr3, tl.trans(_lv(rb, 3, lr0, lr1, lr2, lr3, POLY, DT)), s_r)
    s = tl.where(nmask[None, :], s_c * sc[None, :] + s_r * sr[None, :], float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pw = (p * sc[None, :]).to(DT)
    if not KEEP:  # the shipped kernel's way: the planes made again
        p0 = _lv(cb, 0, lc0, lc1, lc2, lc3, POLY, DT)
        p1 = _lv(cb, 1, lc0, lc1, lc2, lc3, POLY, DT)
        p2 = _lv(cb, 2, lc0, lc1, lc2, lc3, POLY, DT)
        p3 = _lv(cb, 3, lc0, lc1, lc2, lc3, POLY, DT)
    a0 = tl.dot(pw, p0, a0 * alpha[:, None])
    a1 = tl.dot(pw, p1, a1 * alpha[:, None])
    a2 = tl.dot(pw, p2, a2 * alpha[:, None])
    a3 = tl.dot(pw, p3, a3 * alpha[:, None])
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _kernel_v(q_ptr, codes_ptr, scale_ptr, lev_ptr, hist_ptr, win_ptr, new_ptr, wlen_ptr, part_ptr, H, HC, WC, PH,
              P, sq_b, sq_h, sn_b, qk_scale, R: tl.constexpr, RW: tl.constexpr, RP: tl.constexpr, BH: tl.constexpr,
              BLOCK_N: tl.constexpr, DT: tl.constexpr, STAGES: tl.constexpr, INTERP: tl.constexpr,
              KEEP: tl.constexpr, POLY: tl.constexpr):
    """The shipped kernel without its in-kernel q_rope rotation (q comes fully rotated) and with _hist_tile_v."""
    L: tl.constexpr = R + RP
    RQ: tl.constexpr = R // 4
    PQ: tl.constexpr = RP // 4
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    offs_h = hb * BH + tl.arange(0, BH)
    hmask = offs_h < H
    qrow = q_ptr + b * sq_b + offs_h[:, None] * sq_h
    out = part_ptr + ((b * H + offs_h) * P + sp) * (RW + 2)
    m_i = tl.full((BH,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BH,), dtype=tl.float32)
    if sp < PH:
        oq = tl.arange(0, RQ)
        op = tl.arange(0, PQ)
        hm = hmask[:, None]
        qc0 = (tl.load(qrow + oq[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale).to(DT)
        qc1 = (tl.load(qrow + RQ + oq[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale).to(DT)
        qc2 = (tl.load(qrow + 2 * RQ + oq[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale).to(DT)
        qc3 = (tl.load(qrow + 3 * RQ + oq[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale).to(DT)
        qr0 = (tl.load(qrow + R + op[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale).to(DT)
        qr1 = (tl.load(qrow + R + PQ + op[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale).to(DT)
        qr2 = (tl.load(qrow + R + 2 * PQ + op[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale).to(DT)
        qr3 = (tl.load(qrow + R + 3 * PQ + op[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale).to(DT)
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
        if INTERP:
            it = 0
            while it < n_it:
                m_i, l_i, a0, a1, a2, a3 = _hist_tile_v(
                    qc0, qc1, qc2, qc3, qr0, qr1, qr2, qr3, m_i, l_i, a0, a1, a2, a3, codes_ptr, scale_ptr, cbase,
                    sbase, start + it * BLOCK_N, end, lc0, lc1, lc2, lc3, lr0, lr1, lr2, lr3, R, RP, BLOCK_N, DT,
                    KEEP, POLY)
                it += 1
        else:
            for it in tl.range(0, n_it, num_stages=STAGES):
                m_i, l_i, a0, a1, a2, a3 = _hist_tile_v(
                    qc0, qc1, qc2, qc3, qr0, qr1, qr2, qr3, m_i, l_i, a0, a1, a2, a3, codes_ptr, scale_ptr, cbase,
                    sbase, start + it * BLOCK_N, end, lc0, lc1, lc2, lc3, lr0, lr1, lr2, lr3, R, RP, BLOCK_N, DT,
                    KEEP, POLY)
        tl.store(out[:, None] + oq[None, :], a0, mask=hm)
        tl.store(out[:, None] + RQ + oq[None, :], a1, mask=hm)
        tl.store(out[:, None] + 2 * RQ + oq[None, :], a2, mask=hm)
        tl.store(out[:, None] + 3 * RQ + oq[None, :], a3, mask=hm)
    else:
        offs_r = tl.arange(0, R)
        offs_p = tl.arange(0, RP)
        ql = (tl.load(qrow + offs_r[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(DT)
        qr = (tl.load(qrow + R + offs_p[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(DT)
        acc = tl.zeros((BH, R), dtype=tl.float32)
        slot = tl.load(wlen_ptr + b) - 1
        start = (sp - PH) * BLOCK_N
        wbase = b.to(tl.int64) * WC * L
        if start < slot:
            m_i, l_i, acc = _tile(ql, qr, m_i, l_i, acc, win_ptr, wbase, start, slot, R, RP, R, RP, BLOCK_N, DT)
        if (slot >= start) & (slot < start + BLOCK_N):
            cn = tl.load(new_ptr + b * sn_b + offs_r).to(win_ptr.dtype.element_ty)
            kn = tl.load(new_ptr + b * sn_b + R + offs_p).to(win_ptr.dtype.element_ty)
            m_i, l_i, acc = _new_row(ql, qr, m_i, l_i, acc, cn, kn, DT)
        tl.store(out[:, None] + offs_r[None, :], acc, mask=hmask[:, None])
    tl.store(out + RW, m_i, mask=hmask)
    tl.store(out + RW + 1, l_i, mask=hmask)


def cubic(levels: torch.Tensor) -> torch.Tensor:
    """[2, 4] levels -> [2, 4] coefficients k0..k3 of the cubic through (c, level_c), c = 0..3."""
    V = torch.tensor([[c**j for j in range(4)] for c in range(4)], dtype=torch.float64, device=levels.device)
    return torch.linalg.solve(V, levels.double().T).T.float().contiguous()


def run_variant(name: str, q, codes, scales, levels, hist_len, win, new, win_len, r: int, sm_scale: float,
                block_n: int = 32, num_warps: int = 4, num_stages: int = 2, waves: int = 2):
    """-> [B, H, r] (q fully rotated; the window is not written: the variants time reads only)."""
    keep, poly = VARIANTS[name]
    B, H, L = q.shape
    HC, WC = codes.shape[1], win.shape[1]
    cuda = q.is_cuda and not _interpreting()
    from moec.kernels import launch_config

    programs = int(waves * launch_config.num_sms(q.device)) if cuda else 4
    bn = block_n if cuda else 16
    ph = max(1, min(triton.cdiv(HC, bn), programs // B))
    P = ph + triton.cdiv(WC, bn)
    rw = triton.cdiv(r, 32) * 32
    part = torch.empty(B * H * P * (rw + 2), device=q.device, dtype=torch.float32)
    dt = (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16) if cuda else tl.float32
    _kernel_v[(B, 1, P)](q, codes, scales, cubic(levels) if poly else levels, hist_len, win, new, win_len, part, H,
                         HC, WC, ph, P, q.stride(0), q.stride(1), new.stride(0), sm_scale * LOG2E, R=r, RW=rw,
                         RP=L - r, BH=max(16, triton.next_power_of_2(H)), BLOCK_N=bn, DT=dt, STAGES=num_stages,
                         INTERP=not cuda, KEEP=keep, POLY=poly, num_warps=num_warps)
    return combine_splits(part, B * H, P, rw, None, q.dtype).view(B, H, rw)[..., :r]


def _inputs(B: int, H: int, ctx: int, device, r: int = 512, rp: int = 64, dtype=torch.bfloat16):
    from moec.runtime.config import ModelArgs
    from moec.runtime.mla_nuq import MLANUQCache, build_codecs, random_tensors

    a = ModelArgs(arch="deepseek_v2", vocab_size=64, dim=64, n_layers=1, n_heads=H, n_kv_heads=H, head_dim=r // 4 + rp,
                  max_seq_len=1 << 16, attn_kind="mla", kv_lora_rank=r, qk_rope_dim=rp, v_head_dim=128)
    codec = build_codecs({}, random_tensors(a, {}, torch.Generator().manual_seed(0), "cpu"), a)[0].to(device)
    cache = MLANUQCache(a, B, ctx + 64, [codec], window=128, sinks=4, block=32, device=device, mode="static",
                        use_kernel=False)
    g = torch.Generator(device=device).manual_seed(0)
    for row in range(B):
        cache.fill_random(row, ctx, g)
    hist = cache.hist_len[:B]
    wl = (torch.tensor(cache.length[:B], device=device) + 1 - hist).to(torch.int32)
    q = torch.randn(B, H, r + rp, device=device, generator=g).to(dtype)
    new = torch.randn(B, r + rp, device=device, generator=g).to(dtype)
    return codec, cache, q, new, hist, wl


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--check", action="store_true", help="each variant against the reference at a small shape")
    a = ap.parse_args()
    from moec.kernels.mla_nuq_decode_attention import mla_nuq_decode_attention, mla_nuq_decode_attention_ref

    if a.check:  # CPU under TRITON_INTERPRET=1, or a GPU
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        codec, cache, q, new, hist, wl = _inputs(2, 16, 300, dev, r=64, rp=16, dtype=torch.float32)
        ref = mla_nuq_decode_attention_ref(q, cache.codes[0], cache.scales[0], codec, hist, cache.win[0].clone(), new,
                                           wl, 64, 0.1)
        for name in VARIANTS:
            out = run_variant(name, q, cache.codes[0], cache.scales[0], codec.levels, hist, cache.win[0], new, wl, 64,
                              0.1)
            print(name, "max abs error", (out.float() - ref).abs().max().item())
        return 0
    if not torch.cuda.is_available():
        print("mla_nuq_variants: timing needs a CUDA GPU (--check runs on the CPU)", file=sys.stderr)
        return 2
    from benchmarks.bench_mla_attention import time_graph
    from moec.kernels.mla_decode_attention import mla_decode_attention

    scale, records = 1 / math.sqrt(192), []
    for B, ctx in itertools.product((1, 16), (4096, 32768)):
        codec, cache, q, new, hist, wl = _inputs(B, 16, ctx, "cuda")
        codes, scales, win = cache.codes[0], cache.scales[0], cache.win[0]
        rows = torch.randn(B, ctx + 64, 576, device="cuda", dtype=torch.float16)
        pos = torch.full((B,), ctx, device="cuda", dtype=torch.long)
        rec = {"batch": B, "context": ctx, "device": torch.cuda.get_device_name(),
               "ms_fp16": time_graph(functools.partial(mla_decode_attention, q, rows, new, pos, 512, scale)),
               "ms_shipped": time_graph(functools.partial(mla_nuq_decode_attention, q, codes, scales, codec.levels,
                                                          hist, win, new, wl, 512, scale))}
        qr = codec.rotate_query(q)
        ref = mla_nuq_decode_attention_ref(qr, codes, scales, codec, hist, win.clone(), new, wl, 512, scale)
        for name in VARIANTS:
            for bn, nw in ((32, 4), (64, 8)):
                fn = functools.partial(run_variant, name, qr, codes, scales, codec.levels, hist, win, new, wl, 512,
                                       scale, block_n=bn, num_warps=nw)
                err = (fn().float() - ref).abs().max().item() / ref.abs().max().item()
                rec[f"ms_{name}_bn{bn}_w{nw}"] = time_graph(fn)
                rec[f"err_{name}_bn{bn}_w{nw}"] = err
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if a.out:
            a.out.write_text(json.dumps(records, indent=1))
        del rows, cache
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
