"""Fused decode attention over a tiered nuq-outlier KV cache (seed 003), flash-decoding style.

One query token per sequence attends to
    history: packed 2/3-bit codes (moec/runtime/kvquant.py layout, along head_dim per token), keys
             k = k_levels[code] · k_scale[channel] (+ sparse residuals), values
             v = v_levels[code] · v_scale[token] (+ sparse residuals); residuals per block of
             BLOCK_N tokens: int16 index t·d + c and fp16 value
    window:  fp16 keys/values of the sinks and the most recent tokens
Each program (batch row b, KV head, split s) streams its share of the history's blocks (or, for
the last split, the window), dequantizes each tile in registers (the dequantized history is never
written to memory), applies the sparse residuals as score/output corrections, and keeps an online
softmax; it writes partial (max, sum, acc) per split, and `_reduce` combines the splits
(split-K over the context). GQA: the G = H / K query heads of a KV head share each tile; they are
padded to 16 rows so scores, p·V and the sparse-residual corrections are tl.dot products (the
residuals enter as one-hot matrices: scores += (q[c_o]·r_o) · onehot(t_o), acc += (p[t_o]·r_o) ·
onehot(c_o)). Dots take tf32 inputs on the GPU and exact fp32 in the CPU interpreter.

Status (H200, benchmarks/results/kv_attention_h200.json): correct at full size, but slow: ~70 GB/s,
about 10x slower than SDPA on the fp16 cache. The per-channel code gather (one byte load per
channel), G padded from 4 to 16 rows and the one-hot residual dots make it compute- and
latency-bound; launcher + torch reduce cost ~0.3 ms per call at small sizes.

Shapes (B batch, H query heads, K KV heads, d head dim, S history capacity in tokens, NB = S / BLOCK_N,
NOUT outliers per block, Wc window capacity):
    q       [B, H, d]           fp16/bf16/fp32
    k_codes [B, K, S, d·bits/8] uint8      v_codes  same
    k_scale [K, d]              fp32       v_scale  [B, K, S] fp16
    k_lev, v_lev [2^bits]       fp32
    k_oidx, v_oidx [B, K, NB, NOUT] int16  k_oval, v_oval  [B, K, NB, NOUT] fp16
    hist_len [B] int32 (a multiple of BLOCK_N), win_k/win_v [B, K, Wc, d] fp16, win_len [B] int32
    -> out [B, H, d] fp32
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant(code, lev_ptr, LEVELS: tl.constexpr):
    """levels[code] by a chain of selects (no per-element gather)."""
    val = tl.zeros(code.shape, tl.float32) + tl.load(lev_ptr)
    for i in tl.static_range(1, LEVELS):
        val = tl.where(code == i, tl.load(lev_ptr + i), val)
    return val


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, PREC: tl.constexpr):
    """One tile: scores s [G, N] (masked entries -inf), values v [N, D] -> updated (m, l, acc, p)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])  # [G, N]
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
    return m_new, l_i, acc, p


@triton.jit
def _kv_decode_attention_kernel(
    # pointers
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, klev_ptr, vlev_ptr, koi_ptr, kov_ptr, voi_ptr, vov_ptr,
    hlen_ptr, wk_ptr, wv_ptr, wlen_ptr, m_ptr, l_ptr, acc_ptr,
    # sizes
    H, K, S, NB, WC, n_splits, blocks_per_split, sm_scale,
    # constexprs
    D: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
    NOUT: tl.constexpr, NOUT_P2: tl.constexpr, PREC: tl.constexpr,
):
    bk = tl.program_id(0)  # b·K + kv head
    split = tl.program_id(1)
    b = bk // K
    kh = bk % K
    DW: tl.constexpr = D * BITS // 8
    offs_g = tl.arange(0, G_P2)  # query heads of this KV head, padded to >= 16 rows for tl.dot
    offs_c = tl.arange(0, D)
    offs_t = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    heads = kh * G + offs_g
    q = tl.load(q_ptr + (b * H + heads[:, None]) * D + offs_c[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(tl.float32) * sm_scale  # [G_P2, D]

    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    acc = tl.zeros([G_P2, D], tl.float32)

    if split < n_splits - 1:
        hlen = tl.load(hlen_ptr + b)
        # where each channel's code lives inside a token's packed row
        if BITS == 2:
            byte_c = offs_c // 4
            shift_c = (offs_c % 4) * 2
        else:
            bit_c = 3 * (offs_c % 8)
            byte_c = 3 * (offs_c // 8) + bit_c // 8
            shift_c = bit_c % 8
        kscale = tl.load(ks_ptr + kh * D + offs_c)  # [D]
        offs_o = tl.arange(0, NOUT_P2)
        omask = offs_o < NOUT
        j = 0
        while j < blocks_per_split:  # (a while loop: the CPU interpreter rejects range() over a runtime int)
            blk = split * blocks_per_split + j
            tok = blk * BLOCK_N + offs_t  # [BLOCK_N]
            tmask = tok < hlen
            ptr = ((bk * S + tok) * DW)[:, None] + byte_c[None, :]
            m2 = tmask[:, None]
            kb = tl.load(kc_ptr + ptr, mask=m2, other=0).to(tl.int32)
            vb = tl.load(vc_ptr + ptr, mask=m2, other=0).to(tl.int32)
            if BITS == 3:  # codes 2 and 5 of each group straddle a byte
                hm = m2 & (shift_c[None, :] > 5)
                kb = kb | (tl.load(kc_ptr + ptr + 1, mask=hm, other=0).to(tl.int32) << 8)
                vb = vb | (tl.load(vc_ptr + ptr + 1, mask=hm, other=0).to(tl.int32) << 8)
            kcode = (kb >> shift_c[None, :]) & ((1 << BITS) - 1)
            vcode = (vb >> shift_c[None, :]) & ((1 << BITS) - 1)
            k = _dequant(kcode, klev_ptr, 1 << BITS) * kscale[None, :]  # [BLOCK_N, D]
            vs = tl.load(vs_ptr + bk * S + tok, mask=tmask, other=0.0).to(tl.float32)
            v = _dequant(vcode, vlev_ptr, 1 << BITS) * vs[:, None]
            s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [G_P2, BLOCK_N]
            if NOUT > 0:
                obase = (bk * NB + blk) * NOUT + offs_o
                kmask = omask & (blk * BLOCK_N < hlen)
                koi = tl.load(koi_ptr + obase, mask=kmask, other=0).to(tl.int32)
                kov = tl.load(kov_ptr + obase, mask=kmask, other=0.0).to(tl.float32)
                # score correction: q[c_o] · residual_o lands on token t_o
                qo = tl.load(q_ptr + (b * H + heads[:, None]) * D + (koi % D)[None, :],
                             mask=gmask[:, None] & kmask[None, :], other=0.0).to(tl.float32) * sm_scale
                hit = ((koi // D)[:, None] == offs_t[None, :]).to(tl.float32)  # [NOUT_P2, BLOCK_N]
                s += tl.dot(qo * kov[None, :], hit, input_precision=PREC)
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_i, l_i, acc, p = _online_softmax(s, v, m_i, l_i, acc, PREC)
            if NOUT > 0:
                voi = tl.load(voi_ptr + obase, mask=kmask, other=0).to(tl.int32)
                vov = tl.load(vov_ptr + obase, mask=kmask, other=0.0).to(tl.float32)
                vhit = (offs_t[:, None] == (voi // D)[None, :]).to(tl.float32)  # [BLOCK_N, NOUT_P2]
                po = tl.dot(p, vhit, input_precision=PREC) * vov[None, :]  # [G_P2, NOUT_P2]
                chit = ((voi % D)[:, None] == offs_c[None, :]).to(tl.float32)  # [NOUT_P2, D]
                acc += tl.dot(po, chit, input_precision=PREC)
            j += 1
    else:
        wlen = tl.load(wlen_ptr + b)
        t0 = 0
        while t0 < wlen:
            tok = t0 + offs_t
            tmask = tok < wlen
            ptr = (bk * WC + tok)[:, None] * D + offs_c[None, :]
            k = tl.load(wk_ptr + ptr, mask=tmask[:, None], other=0.0).to(tl.float32)
            v = tl.load(wv_ptr + ptr, mask=tmask[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_i, l_i, acc, p = _online_softmax(s, v, m_i, l_i, acc, PREC)
            t0 += BLOCK_N

    out = (b * H + heads) * n_splits + split  # [G_P2]
    tl.store(m_ptr + out, m_i, mask=gmask)
    tl.store(l_ptr + out, l_i, mask=gmask)
    tl.store(acc_ptr + out[:, None] * D + offs_c[None, :], acc, mask=gmask[:, None])


def _reduce(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Combine per-split partials m, l [B, H, P], acc [B, H, P, d] -> [B, H, d]."""
    mx = m.amax(-1, keepdim=True)
    w = torch.exp(m - mx)  # splits with no tokens have m = -inf -> weight 0
    return (acc * w[..., None]).sum(2) / (l * w).sum(-1, keepdim=True)


def _check(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval, v_oidx, v_oval, hist_len,
           win_k, win_v, win_len, bits, block):
    B, H, d = q.shape
    _, K, S, dw = k_codes.shape
    assert bits in (2, 3) and dw == d * bits // 8, (bits, dw, d)
    assert H % K == 0 and S % block == 0, (H, K, S, block)
    assert d & (d - 1) == 0 and block & (block - 1) == 0 and d >= 16 and block >= 16, ("tl.dot needs "
        "power-of-two head_dim and block >= 16", d, block)
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
                        n_splits: int | None = None, precision: str | None = None) -> torch.Tensor:
    """Decode attention (one query token per row) over packed history + fp16 window -> [B, H, d] fp32.

    precision: tl.dot input precision, "tf32" (tensor cores, ~1e-3 relative) by default on CUDA and
    "ieee" (exact fp32) elsewhere."""
    if precision is None:
        precision = "tf32" if q.is_cuda else "ieee"
    B, H, d, K, S, NB, nout = _check(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval,
                                     v_oidx, v_oval, hist_len, win_k, win_v, win_len, bits, block)
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if n_splits is None:  # enough programs to fill the GPU: ~4 waves of 132 SMs
        n_splits = max(1, min(NB, triton.cdiv(528, B * K)))
    hist_splits = max(1, min(n_splits, NB))
    bps = triton.cdiv(NB, hist_splits) if NB else 0
    P = hist_splits + 1  # the last split attends the window
    m = torch.empty(B, H, P, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(B, H, P, d, device=q.device, dtype=torch.float32)
    G = H // K
    _kv_decode_attention_kernel[(B * K, P)](
        q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval, v_oidx, v_oval,
        hist_len, win_k, win_v, win_len, m, l, acc,
        H, K, S, NB, win_k.shape[2], P, bps, sm_scale,
        D=d, G=G, G_P2=max(16, triton.next_power_of_2(G)), BITS=bits, BLOCK_N=block, NOUT=nout,
        NOUT_P2=max(triton.next_power_of_2(nout), 16), PREC=precision, num_warps=4,
    )
    return _reduce(m, l, acc)


def dequant_history_ref(codes, scale_k_or_v, lev, oidx, oval, bits: int, block: int, kind: str) -> torch.Tensor:
    """Dequantize a whole history buffer [B, K, S, ·] -> [B, K, S, d] fp32 (the layout of kvquant.py)."""
    from ..runtime.kvquant import unpack_codes

    B, K, S, dw = codes.shape
    d = dw * 8 // bits
    x = lev.float()[unpack_codes(codes, bits, d)]
    x = x * (scale_k_or_v.float()[None, :, None, :] if kind == "k" else scale_k_or_v.float()[..., None])
    if oidx.shape[-1]:
        x = x.reshape(B, K, S // block, block * d).scatter_add(-1, oidx.long(), oval.float()).reshape(B, K, S, d)
    return x


def kv_decode_attention_ref(q, k_codes, v_codes, k_scale, v_scale, k_lev, v_lev, k_oidx, k_oval, v_oidx, v_oval,
                            hist_len, win_k, win_v, win_len, bits: int, block: int,
                            sm_scale: float | None = None) -> torch.Tensor:
    """Torch reference: dequantize the history, concatenate the window, softmax attention in fp32."""
    B, H, d = q.shape
    K = k_codes.shape[1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    kh = dequant_history_ref(k_codes, k_scale, k_lev, k_oidx, k_oval, bits, block, "k")
    vh = dequant_history_ref(v_codes, v_scale, v_lev, v_oidx, v_oval, bits, block, "v")
    out = torch.empty(B, H, d, dtype=torch.float32, device=q.device)
    for b in range(B):
        h, w = int(hist_len[b]), int(win_len[b])
        keys = torch.cat([kh[b, :, :h], win_k[b, :, :w].float()], 1)  # [K, n, d]
        vals = torch.cat([vh[b, :, :h], win_v[b, :, :w].float()], 1)
        qb = q[b].float().view(K, H // K, d)
        p = torch.softmax(qb @ keys.transpose(1, 2) * sm_scale, dim=-1)  # [K, G, n]
        out[b] = (p @ vals).reshape(H, d)
    return out


def attend_cache(cache, layer: int, q: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
    """One decode step of a TieredKVCache (nuq-outlier, post-RoPE keys) through the kernel.
    q [B, H, 1, d]; wk, wv [B, K, n, d] fp16 window (sinks first) -> [B, H, 1, d] in q.dtype."""
    codec = cache.codecs[layer]
    hk, hv = cache.hist["k"][layer], cache.hist["v"][layer]
    B = q.shape[0]
    dev = q.device
    nout = codec.n_out
    if nout:
        koi, kov, voi, vov = hk["out_idx"], hk["out_val"], hv["out_idx"], hv["out_val"]
    else:
        z = torch.zeros(B, wk.shape[1], cache.max_blocks, 0, device=dev)
        koi = voi = z.to(torch.int16)
        kov = vov = z.half()
    hist_len = torch.full((B,), cache.n_blocks[layer] * cache.block, dtype=torch.int32, device=dev)
    win_len = torch.full((B,), wk.shape[2], dtype=torch.int32, device=dev)
    out = kv_decode_attention(q[:, :, 0].contiguous(), hk["codes"], hv["codes"], codec.k_scale.to(dev),
                              hv["scale"], codec.levels["k"].to(dev), codec.levels["v"].to(dev), koi, kov, voi, vov,
                              hist_len, wk.contiguous(), wv.contiguous(), win_len, codec.bits, cache.block)
    return out[:, :, None].to(q.dtype)
