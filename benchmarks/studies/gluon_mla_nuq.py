"""A Gluon history kernel for the mla-nuq latent cache (issue 35: the `tl` kernel is 2x slower than the fp16 latent
kernel; the issue asks for 2x faster), prepared to be checked and timed in one GPU call.

    python3 -m benchmarks.studies.gluon_mla_nuq --compile          # CPU: builds for sm_90, registers and SASS
    python3 -m benchmarks.studies.gluon_mla_nuq --out OUT.json     # GPU: checked against torch, timed

The design (docs/results.md, "Next for the latent kernel"): the cache's rows are the per-head Gluon kernel's
PLANAR bytes (byte j of c holds channels j, j+128, j+256, j+384 in bit fields 0..3; the 16 rope bytes likewise
with a stride of 16), so a program of W = 4 warps gives warp w bit field w of every byte — c channels 128w..
and rope channels 16w.. — and reuses gluon_kv_attention_wg's operand maps (_key_block3 / _value_block3 on words
shifted right by 2w) per 32-byte chunk. Per tile of T tokens (the same tokens in every warp):
    S_w = s_c · (K_c,w · q_c,w) + s_r · (K_r,w · q_r,w)       4 + 1 mma chains (the rope chunk zero-padded)
    S   = Σ_w S_w                                            the sum over the warp axis (shared memory)
    online softmax in every warp (the same numbers); Oᵀ_w,i += V_w,iᵀ · (P∘s_c)ᵀ for the warp's 4 chunks
Programs: (batch row, head block of N = 16, history split); the window and the new row are left to the shipped
kernel in this study, so what is timed is the history part (the dequantized work), checked as the attention over
the history alone (the split combine normalizes it). q comes rotated (its rope part by Rr) and pre-scaled.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from moec.kernels.gluon_kv_attention import _interleave, _key_channel, _lev_words, _value_channel
from moec.kernels.gluon_kv_attention_wg import (
    B3,
    KEY_WORDS3,
    MMA3,
    ROW3,
    TOK3,
    VALUE_WORDS3,
    W,
    _key_block3,
    _tables3,
    _value_block3,
)

R = gl.constexpr(512)  # kv_lora_rank
RP = gl.constexpr(64)  # RoPE dims
NWORDS = gl.constexpr(36)  # int32 words of codes a token: 32 for c, 4 for rope
RH, RPH = 512, 64  # the same on the host
NB_HOST = 144 + 128  # codes a warp looks up per token: 144 bytes' field for the scores, 128 for the values


@gluon.jit
def _q_chunk(q_ptr, qbase, sq_h, nh, i: gl.constexpr, ROPE: gl.constexpr, N: gl.constexpr):
    """Warp w's query chunk as the B operand [W, 32, N]: c channels 128w + 32i + _key_channel(k), or (ROPE) rope
    channels 16w + _key_channel(k) where _key_channel(k) < 16 (zeros in the padding)."""
    w = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, B3)))
    kc = _key_channel(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, B3))))
    g = gl.arange(0, N, layout=gl.SliceLayout(0, gl.SliceLayout(1, B3)))
    if ROPE:
        ch = R + 16 * w[:, None, None] + kc[None, :, None]
        valid = (kc < 16)[None, :, None]
    else:
        ch = 128 * w[:, None, None] + (32 * i + kc)[None, :, None]
        valid = (kc >= 0)[None, :, None]
    m = valid & (g < nh)[None, None, :] & (w >= 0)[:, None, None]
    return gl.load(q_ptr + qbase + ch + g[None, None, :] * sq_h, mask=m, other=0.0).to(gl.float16)


@gluon.jit
def _ld(ptrs, mask, MASKED: gl.constexpr):
    """A load, masked only where the tile may pass the split's end."""
    if MASKED:
        return gl.load(ptrs, mask=mask, other=0)
    else:
        return gl.load(ptrs)


@gluon.jit
def _pairs(vw, T: gl.constexpr):
    """Value words [W, T, 8] as the byte-interleaved token pairs _value_block3 takes."""
    va, vb = gl.split(gl.permute(gl.reshape(vw, [W, T // 2, 2, 8]), [0, 1, 3, 2]))
    return _interleave(va, vb)


@gluon.jit
def _mla_tile(codes_ptr, scale_ptr, rowb, t0, t_hi, koff, voff, soff, kt, vt, st, kshift, vshift, rmask,
              q0, q1, q2, q3, qr, ktl, kth, vtl, vth, rtl, rth, m_i, l_i, a0, a1, a2, a3,
              T: gl.constexpr, N: gl.constexpr, LAZY: gl.constexpr, MASKED: gl.constexpr):
    """One tile of T tokens from t0 in every warp (warp w: bit field w). The word offsets (koff, voff) and the
    scales' (soff) are hoisted out of the loop; a tile is one scalar base plus them. MASKED: the split's last
    tile (tokens from t_hi on score -inf and load nothing)."""
    base = codes_ptr + (rowb + t0) * NWORDS
    km = (t0 + kt) < t_hi
    vm = (t0 + vt) < t_hi
    tm = (t0 + st) < t_hi
    s_c = gl.zeros([W, T, N], gl.float32, MMA3)
    s_c = mma_v2(_key_block3(_ld(base + koff, km, MASKED) >> kshift, 0, ktl, kth, T), q0, s_c)
    s_c = mma_v2(_key_block3(_ld(base + 8 + koff, km, MASKED) >> kshift, 0, ktl, kth, T), q1, s_c)
    s_c = mma_v2(_key_block3(_ld(base + 16 + koff, km, MASKED) >> kshift, 0, ktl, kth, T), q2, s_c)
    s_c = mma_v2(_key_block3(_ld(base + 24 + koff, km, MASKED) >> kshift, 0, ktl, kth, T), q3, s_c)
    rw = gl.load(base + 32 + koff, mask=rmask & km, other=0) >> kshift  # 4 words, zero-padded to 8
    s_r = mma_v2(_key_block3(rw, 0, rtl, rth, T), qr, gl.zeros([W, T, N], gl.float32, MMA3))
    sp = scale_ptr + (rowb + t0) * 2 + soff
    sc = _ld(sp, tm, MASKED).to(gl.float32)
    sr = _ld(sp + 1, tm, MASKED).to(gl.float32)
    s = s_c * sc[:, :, None] + s_r * sr[:, :, None]  # warp w's share of the scores
    s = gl.sum(s, axis=0)  # [T, N]: the whole score, in every warp
    s = gl.expand_dims(s, 0) + gl.zeros([W, T, N], gl.float32, MMA3)
    if MASKED:
        s = gl.where(tm[:, :, None], s, float("-inf"))
    m_t = gl.max(s, axis=1)
    # lazy rescaling, as the one-warp kernel: every warp holds the same scores, so the branch is uniform
    if LAZY:
        grow = gl.max(gl.max(m_t - m_i, axis=1), axis=0) > 8.0
    else:
        grow = True
    if grow:
        m_new = gl.maximum(m_i, m_t)
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha
        a0 = a0 * alpha[:, None, :]
        a1 = a1 * alpha[:, None, :]
        a2 = a2 * alpha[:, None, :]
        a3 = a3 * alpha[:, None, :]
        m_i = m_new
    p = gl.exp2(s - m_i[:, None, :])
    l_i = l_i + gl.sum(p, axis=1)
    pb = gl.convert_layout((p * sc[:, :, None]).to(gl.float16), B3)
    p0, p1 = _pairs(_ld(base + voff, vm, MASKED) >> vshift, T)
    a0 = mma_v2(_value_block3(p0, p1, 0, vtl, vth, T), pb, a0)
    p0, p1 = _pairs(_ld(base + 8 + voff, vm, MASKED) >> vshift, T)
    a1 = mma_v2(_value_block3(p0, p1, 0, vtl, vth, T), pb, a1)
    p0, p1 = _pairs(_ld(base + 16 + voff, vm, MASKED) >> vshift, T)
    a2 = mma_v2(_value_block3(p0, p1, 0, vtl, vth, T), pb, a2)
    p0, p1 = _pairs(_ld(base + 24 + voff, vm, MASKED) >> vshift, T)
    a3 = mma_v2(_value_block3(p0, p1, 0, vtl, vth, T), pb, a3)
    return m_i, l_i, a0, a1, a2, a3


@gluon.jit
def _gluon_mla_hist_kernel(q_ptr, codes_ptr, scale_ptr, lev_ptr, hist_ptr, part_ptr, H, HC, n_splits, sq_b, sq_h,
                           T: gl.constexpr, N: gl.constexpr, LAZY: gl.constexpr = True):
    b = gl.program_id(0)
    hb = gl.program_id(1)
    split = gl.program_id(2)
    nh = H - hb * N
    qbase = b * sq_b + hb * N * sq_h
    q0 = _q_chunk(q_ptr, qbase, sq_h, nh, 0, False, N)
    q1 = _q_chunk(q_ptr, qbase, sq_h, nh, 1, False, N)
    q2 = _q_chunk(q_ptr, qbase, sq_h, nh, 2, False, N)
    q3 = _q_chunk(q_ptr, qbase, sq_h, nh, 3, False, N)
    qr = _q_chunk(q_ptr, qbase, sq_h, nh, 0, True, N)
    c_lo, c_hi = _lev_words(lev_ptr)
    r_lo, r_hi = _lev_words(lev_ptr + 4)
    ktl, kth, vtl, vth = _tables3(c_lo, c_hi, c_lo, c_hi, T)
    rtl, rth, _u, _v = _tables3(r_lo, r_hi, r_lo, r_hi, T)
    m_i = gl.full([W, N], float("-inf"), gl.float32, ROW3)
    l_i = gl.zeros([W, N], gl.float32, ROW3)
    a0 = gl.zeros([W, 32, N], gl.float32, MMA3)
    a1 = gl.zeros([W, 32, N], gl.float32, MMA3)
    a2 = gl.zeros([W, 32, N], gl.float32, MMA3)
    a3 = gl.zeros([W, 32, N], gl.float32, MMA3)
    # loop-invariant offsets: key words [W, T, 8] (KEY_WORDS3), value words (VALUE_WORDS3), scales [W, T]
    kw_ = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, KEY_WORDS3)))[:, None, None]
    kt = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(2, KEY_WORDS3)))[None, :, None] + 0 * kw_
    kr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, KEY_WORDS3)))[None, None, :]
    koff = kt * NWORDS + kr
    kshift = 2 * kw_
    rmask = (kr < 4) & (kt >= 0)
    vw_ = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, VALUE_WORDS3)))[:, None, None]
    vt = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(2, VALUE_WORDS3)))[None, :, None] + 0 * vw_
    vr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, VALUE_WORDS3)))[None, None, :]
    voff = vt * NWORDS + vr
    vshift = 2 * vw_
    sw = gl.arange(0, W, layout=gl.SliceLayout(1, TOK3))[:, None]
    st = gl.arange(0, T, layout=gl.SliceLayout(0, TOK3))[None, :] + 0 * sw
    soff = st * 2
    hl = gl.load(hist_ptr + b)
    per = gl.cdiv(gl.cdiv(hl, n_splits), T) * T
    t_lo = split * per
    t_hi = gl.minimum(t_lo + per, hl)
    rowb = b.to(gl.int64) * HC
    n_full = gl.maximum(t_hi - t_lo, 0) // T
    for it in range(n_full):  # whole tiles: no masks
        m_i, l_i, a0, a1, a2, a3 = _mla_tile(
            codes_ptr, scale_ptr, rowb, t_lo + it * T, t_hi, koff, voff, soff, kt, vt, st, kshift, vshift, rmask,
            q0, q1, q2, q3, qr, ktl, kth, vtl, vth, rtl, rth, m_i, l_i, a0, a1, a2, a3, T, N, LAZY, False)
    t_last = t_lo + n_full * T
    if t_last < t_hi:  # the split's partial last tile
        m_i, l_i, a0, a1, a2, a3 = _mla_tile(
            codes_ptr, scale_ptr, rowb, t_last, t_hi, koff, voff, soff, kt, vt, st, kshift, vshift, rmask,
            q0, q1, q2, q3, qr, ktl, kth, vtl, vth, rtl, rth, m_i, l_i, a0, a1, a2, a3, T, N, LAZY, True)
    # partials [B·H, n_splits, R + 2] (combine_splits' format): warp w writes its channels 128w + 32i + ...
    OL: gl.constexpr = MMA3
    ow = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, OL)))
    on = _value_channel(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, OL))))
    og = gl.arange(0, N, layout=gl.SliceLayout(0, gl.SliceLayout(1, OL)))
    head = hb * N + og
    base = ((b * H + head) * n_splits + split) * (R + 2)
    ch = 128 * ow[:, None, None] + on[None, :, None]
    om = (og < nh)[None, None, :] & (ow >= 0)[:, None, None]
    gl.store(part_ptr + base[None, None, :] + ch, a0, mask=om)
    gl.store(part_ptr + base[None, None, :] + ch + 32, a1, mask=om)
    gl.store(part_ptr + base[None, None, :] + ch + 64, a2, mask=om)
    gl.store(part_ptr + base[None, None, :] + ch + 96, a3, mask=om)
    mw = gl.arange(0, W, layout=gl.SliceLayout(1, ROW3))
    mg = gl.arange(0, N, layout=gl.SliceLayout(0, ROW3))
    mbase = ((b * H + hb * N + mg) * n_splits + split) * (R + 2)
    mm = (mg < nh)[None, :] & (mw == 0)[:, None]
    gl.store(part_ptr + mbase[None, :] + R + 0 * mw[:, None], m_i, mask=mm)
    gl.store(part_ptr + mbase[None, :] + R + 1 + 0 * mw[:, None], l_i, mask=mm)


def gluon_mla_history(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor,
                      hist_len: torch.Tensor, qk_scale: float, n_splits: int, T: int = 16,
                      lazy: bool = True) -> torch.Tensor:
    """The attention of q (rotated, [B, H, RH + RPH]) over each row's history alone -> [B, H, R] fp32 (rotated)."""
    from moec.kernels.kv_decode_attention import LOG2E, combine_splits

    B, H, _ = q.shape
    N = 16
    qs = (q.float() * (qk_scale * LOG2E)).contiguous()
    part = torch.empty(B * H * n_splits * (RH + 2), device=q.device, dtype=torch.float32)
    _gluon_mla_hist_kernel[(B, triton.cdiv(H, N), n_splits)](
        qs, codes.view(torch.int32), scales, levels, hist_len, part, H, codes.shape[1], n_splits, qs.stride(0),
        qs.stride(1), T=T, N=N, LAZY=lazy, num_warps=4)
    return combine_splits(part, B * H, n_splits, RH).view(B, H, RH)


def history_ref(q, codes, scales, codec, hist_len, qk_scale):
    """Torch: softmax over the decoded history only (fp32)."""
    B = q.shape[0]
    keys = codec.decode(codes[:B], scales[:B]).float()  # [B, HC, RH + RPH]
    mask = torch.arange(keys.shape[1], device=q.device)[None, :] < hist_len[:, None]
    s = torch.einsum("bhl,bsl->bhs", q.float(), keys) * qk_scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("bhs,bsr->bhr", s.softmax(-1), keys[..., :RH])


def compile_report() -> None:
    from moec.kernels import aot

    for T, lazy in ((16, True), (32, True), (32, False)):
        types = dict(q_ptr="*fp32", codes_ptr="*i32", scale_ptr="*fp16", lev_ptr="*fp32", hist_ptr="*i32",
                     part_ptr="*fp32", H="i32", HC="i32", n_splits="i32", sq_b="i32", sq_h="i32")
        k = aot.compile_cuda(_gluon_mla_hist_kernel, types, dict(T=T, N=16, LAZY=lazy), num_warps=4)
        res = aot.resources(k.asm["cubin"])
        loop = aot.loop_histogram(aot.sass(k.asm["cubin"]), "HMMA")
        codes = T * NB_HOST // 32  # codes a lane looks up per tile (gluon_sass.py's "per code")
        top = ", ".join(f"{o} {n}" for o, n in loop.most_common(8))
        print(f"T={T} lazy={lazy}: {res}; loop {sum(loop.values())} SASS a warp and tile ({top}); "
              f"{sum(loop.values()) / codes:.2f} a code", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compile", action="store_true", help="CPU: build for sm_90 and report registers/spills")
    a = ap.parse_args()
    if a.compile:
        compile_report()
        return 0
    if not torch.cuda.is_available():
        print("gluon_mla_nuq: needs a CUDA GPU (--compile does not)", file=sys.stderr)
        return 2
    from benchmarks.bench_mla_attention import time_graph
    from moec.atomic import write_json
    from moec.kernels.mla_decode_attention import mla_decode_attention
    from moec.kernels.mla_nuq_decode_attention import mla_nuq_decode_attention
    from moec.provenance import environment
    from moec.runtime.config import ModelArgs
    from moec.runtime.mla_nuq import MLANUQCache, build_codecs, random_tensors

    t0 = time.time()
    res = {"study": "gluon_mla_nuq", "device": torch.cuda.get_device_name(), "environment": environment("cuda"),
           "date": time.strftime("%Y-%m-%d"), "records": []}
    scale = 1 / math.sqrt(192)
    for H, B, ctx in ((16, 1, 4096), (16, 1, 32768), (16, 16, 32768), (128, 1, 32768)):
        args = ModelArgs(arch="deepseek_v2", vocab_size=64, dim=64, n_layers=1, n_heads=H, n_kv_heads=H,
                         head_dim=192, max_seq_len=1 << 16, attn_kind="mla", kv_lora_rank=RH, qk_rope_dim=RPH,
                         v_head_dim=128)
        codec = build_codecs({}, random_tensors(args, {}, torch.Generator().manual_seed(0), "cpu"), args)[0]
        codec = codec.to("cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        cache = MLANUQCache(args, B, ctx + 64, [codec], window=128, sinks=4, block=32, device="cuda",
                            mode="static")
        for r in range(B):
            cache.fill_random(r, ctx, torch.Generator(device="cuda").manual_seed(r))
        codes, scales, win = cache.codes[0], cache.scales[0], cache.win[0]
        scales.copy_((torch.rand(scales.shape, device="cuda", generator=g) + 0.5).half())
        hist = cache.hist_len[:B]
        q = torch.randn(B, H, RH + RPH, device="cuda", dtype=torch.bfloat16, generator=g)
        qr = codec.rotate_query(q)
        want = history_ref(qr, codes, scales, codec, hist, scale)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for T, waves, lazy in ((16, 1, True), (16, 2, True), (32, 1, True), (32, 2, True), (32, 1, False)):
            n_splits = max(1, min(triton.cdiv(int(hist.max()), T), waves * sms // (B * triton.cdiv(H, 16))))
            rec = dict(heads=H, batch=B, context=ctx, T=T, waves=waves, lazy=lazy, n_splits=n_splits)
            try:
                got = gluon_mla_history(qr, codes, scales, codec.levels, hist, scale, n_splits, T, lazy)
                rec["max_rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
                rec["ms"] = time_graph(functools.partial(gluon_mla_history, qr, codes, scales, codec.levels, hist,
                                                         scale, n_splits, T, lazy))
            except Exception as e:  # a setting that does not build or run
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res["records"].append(rec)
            print(rec, flush=True)
        # the shipped kernels at the same point: the tl mla-nuq kernel (history + window + combine), fp16 latent
        wl = (torch.tensor(cache.length[:B], device="cuda") + 1 - hist).to(torch.int32)
        new = torch.randn(B, RH + RPH, device="cuda", dtype=torch.bfloat16, generator=g)
        ms_tl = time_graph(functools.partial(mla_nuq_decode_attention, q, codes, scales, codec.levels, hist, win,
                                             new, wl, RH, scale, rope_rotation=codec.Rr))
        rows = torch.randn(B, ctx + 64, RH + RPH, device="cuda", dtype=torch.float16, generator=g)
        pos = torch.full((B,), ctx, device="cuda", dtype=torch.long)
        ms_fp16 = time_graph(functools.partial(mla_decode_attention, q, rows, new, pos, RH, scale))
        res["records"].append(dict(heads=H, batch=B, context=ctx, ms_tl_mla_nuq=ms_tl, ms_fp16_latent=ms_fp16))
        print(res["records"][-1], flush=True)
        del cache, rows
        torch.cuda.empty_cache()
        if a.out:
            write_json(a.out, res)
    res["seconds"] = time.time() - t0
    if a.out:
        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
