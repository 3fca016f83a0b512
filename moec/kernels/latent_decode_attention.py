"""Fused decode attention straight from a low-rank latent KV cache (issue 6; MLA-style absorbed decode).

The history of a layer is a latent per token shared by all KV heads (cross-head, seed 000; and, for
cross-layer groups, by several layers, seed 001): keys k = U_k z_k + mean_k and values v = U_v z_v + mean_v,
with z stored as 2/4-bit codes (moec/runtime/kvlatent.py planar layout: channel c in byte c % W at bit
b·(c // W)) on a uniform mid-rise grid with per-channel steps, or as fp16. Post-RoPE keys only (the
up-projection is absorbed into the query; pre-RoPE latents need per-position rotation of the
reconstructed keys and go through the torch path).

Per decode step (one query token per sequence):
    launcher  q_lat[b, h] = step_k ⊙ (U_k[kv(h)]^T q[b, h])  [B, H, RK]  (tiny, torch)
              bias[b, h]  = q·mean_k[kv(h)] − off_k · Σ q_lat     so  q·k̂_t = q_lat · code_t + bias
    hist kernel  grid (B, SPLITS): each program streams its share of the latent history in tiles of
              BLOCK_N tokens for *all* H query heads at once (one read of the latent per token, not
              one per KV head): scores [H, N] = q_lat [H, RK] · codes^T, online softmax, latent
              accumulator acc [H, RV] += p · codes_v. Nothing of size d·K per token is materialized.
    window kernel  grid (B, K): the fp16 sinks + window of each KV head for its G = H/K query heads.
    combine   (torch) log-sum-exp merge of the splits and the window, then one up-projection per
              head: out = (U_v[kv(h)] (step_v ⊙ (acc − off_v·Σp)) + mean_v·Σp + acc_win) / Σp_all.

Shapes (B batch, H query heads, K KV heads, d head dim, S history capacity, RK/RV latent ranks,
WK/WV bytes per token of the codes, Wc window capacity):
    q [B, H, d]; codes_k [B, S, WK] uint8 (or fp16 [B, S, RK]); codes_v likewise
    u_k [K, d, RK], mean_k [K, d], step_k [RK]; u_v [K, d, RV], mean_v [K, d], step_v [RV]   (fp32)
    hist_len [B] int32; win_k, win_v [B, K, Wc, d] fp16; win_len [B] int32   ->  out [B, H, d] fp32
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # history tokens per tile
BLOCK_W = 32  # window tokens per tile


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _codes_tile(c_ptr, tok, tmask, R, W, BITS: tl.constexpr, R_P2: tl.constexpr):
    """Latent codes of tokens `tok` [N] as floats [N, R_P2] (channels >= R are 0)."""
    offs_c = tl.arange(0, R_P2)
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
def _latent_hist_kernel(
    # pointers
    qlat_ptr, bias_ptr, ck_ptr, cv_ptr, hlen_ptr, m_ptr, l_ptr, acc_ptr,
    # sizes
    H, S, RK, RV, WK, WV, n_splits, tiles_per_split, sm_scale,
    # constexprs
    BITS: tl.constexpr, H_P2: tl.constexpr, RK_P2: tl.constexpr, RV_P2: tl.constexpr, BLOCK: tl.constexpr,
    PREC: tl.constexpr,
):
    b = tl.program_id(0)
    sp = tl.program_id(1)
    offs_h = tl.arange(0, H_P2)
    hmask = offs_h < H
    offs_rk = tl.arange(0, RK_P2)
    offs_rv = tl.arange(0, RV_P2)
    # q_lat in log2 units so the softmax uses exp2
    qscale = sm_scale * 1.4426950408889634
    q = tl.load(qlat_ptr + (b * H + offs_h)[:, None] * RK + offs_rk[None, :],
                mask=hmask[:, None] & (offs_rk < RK)[None, :], other=0.0) * qscale  # [H_P2, RK_P2]
    bias = tl.load(bias_ptr + b * H + offs_h, mask=hmask, other=0.0) * qscale  # [H_P2]
    hlen = tl.load(hlen_ptr + b)
    if BITS == 16:
        ck_row = ck_ptr + b * S * RK
        cv_row = cv_ptr + b * S * RV
    else:
        ck_row = ck_ptr + b * S * WK
        cv_row = cv_ptr + b * S * WV
    m_i = tl.full([H_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([H_P2], tl.float32)
    acc = tl.zeros([H_P2, RV_P2], tl.float32)
    t0 = sp * tiles_per_split * BLOCK
    t_hi = tl.minimum(t0 + tiles_per_split * BLOCK, hlen)
    while t0 < t_hi:  # a while loop: the CPU interpreter rejects range() over a runtime bound
        tok = t0 + tl.arange(0, BLOCK)
        tmask = tok < hlen
        ck = _codes_tile(ck_row, tok, tmask, RK, WK, BITS, RK_P2)  # [BLOCK, RK_P2]
        s = tl.dot(q, tl.trans(ck), input_precision=PREC) + bias[:, None]  # [H_P2, BLOCK]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        cv = _codes_tile(cv_row, tok, tmask, RV, WV, BITS, RV_P2)  # [BLOCK, RV_P2]
        acc = acc * alpha[:, None] + tl.dot(p, cv, input_precision=PREC)
        m_i = m_new
        t0 += BLOCK
    row = b * n_splits + sp
    tl.store(m_ptr + row * H + offs_h, m_i, mask=hmask)
    tl.store(l_ptr + row * H + offs_h, l_i, mask=hmask)
    tl.store(acc_ptr + (row * H + offs_h)[:, None] * RV + offs_rv[None, :], acc,
             mask=hmask[:, None] & (offs_rv < RV)[None, :])


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
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(wv_ptr + ptr, mask=tmask[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m_i = m_new
        t0 += BLOCK
    out = b * H + heads
    tl.store(m_ptr + out, m_i, mask=gmask)
    tl.store(l_ptr + out, l_i, mask=gmask)
    tl.store(acc_ptr + out[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def latent_decode_attention(q, codes_k, codes_v, u_k, mean_k, step_k, u_v, mean_v, step_v, bits: int,
                            hist_len, win_k, win_v, win_len, splits: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over latent history + fp16 window -> out [B, H, d] fp32.

    step_*: the per-channel quantization step (2·scale/2^bits; ones for a 16-bit latent)."""
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
    dev, G = q.device, H // K
    off = 0.0 if bits == 16 else 2 ** (bits - 1) - 0.5
    qf = q.float()
    uk_h = u_k.float().repeat_interleave(G, 0)  # [H, d, RK]
    qlat = torch.einsum("bhd,hdr->bhr", qf, uk_h) * step_k.float()  # [B, H, RK]
    bias = (qf * mean_k.float().repeat_interleave(G, 0)).sum(-1) - off * qlat.sum(-1)  # [B, H]
    qlat, bias = qlat.contiguous(), bias.contiguous()
    hist_len, win_len = hist_len.to(torch.int32).contiguous(), win_len.to(torch.int32).contiguous()
    sm_scale = 1.0 / math.sqrt(d)
    prec = "ieee" if _interpreting() or dev.type == "cpu" else "tf32"

    tiles = triton.cdiv(S, BLOCK_N)
    if splits is None:  # enough programs to fill the GPU at batch 1, a few tiles each
        splits = max(1, min(tiles, triton.cdiv(132 * 2, B)))
    tps = triton.cdiv(max(tiles, 1), splits)
    splits = triton.cdiv(max(tiles, 1), tps)
    m_h = torch.empty(B, splits, H, device=dev)
    l_h = torch.empty(B, splits, H, device=dev)
    a_h = torch.empty(B, splits, H, RV, device=dev)
    _latent_hist_kernel[(B, splits)](
        qlat, bias, codes_k, codes_v, hist_len, m_h, l_h, a_h,
        H, S, RK, RV, WK, WV, splits, tps, sm_scale,
        BITS=bits, H_P2=_p2(H), RK_P2=_p2(RK), RV_P2=_p2(RV), BLOCK=BLOCK_N, PREC=prec, num_warps=8)
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
    lat = (lat - off * p_h[..., None]) * step_v.float()
    uv_h = u_v.float().repeat_interleave(G, 0)  # [H, d, RV]
    out = torch.einsum("hdr,bhr->bhd", uv_h, lat) + mean_v.float().repeat_interleave(G, 0) * p_h[..., None]
    out = out + a_wf[..., None] * a_w
    return out / (p_h + a_wf * l_w)[..., None]


def latent_decode_attention_ref(q, codes_k, codes_v, u_k, mean_k, step_k, u_v, mean_v, step_v, bits: int,
                                hist_len, win_k, win_v, win_len) -> torch.Tensor:
    """Plain torch: reconstruct every key/value (k = U_k deq(z) + mean), then softmax attention per row."""
    from ..runtime.kvlatent import unpack_planar

    B, H, d = q.shape
    K = u_k.shape[0]
    G = H // K
    off = 0.0 if bits == 16 else 2 ** (bits - 1) - 0.5

    def deq(codes, step):
        c = codes.float() if bits == 16 else unpack_planar(codes, bits).float()
        return (c - off) * step.float()  # [B, S, R]

    kh = torch.einsum("kdr,bsr->bksd", u_k.float(), deq(codes_k, step_k)) + mean_k.float()[None, :, None]
    vh = torch.einsum("kdr,bsr->bksd", u_v.float(), deq(codes_v, step_v)) + mean_v.float()[None, :, None]
    out = torch.empty(B, H, d, device=q.device)
    for b in range(B):
        hl, wl = int(hist_len[b]), int(win_len[b])
        keys = torch.cat([kh[b, :, :hl], win_k[b, :, :wl].float()], 1).repeat_interleave(G, 0)  # [H, n, d]
        vals = torch.cat([vh[b, :, :hl], win_v[b, :, :wl].float()], 1).repeat_interleave(G, 0)
        s = torch.einsum("hd,hnd->hn", q[b].float(), keys) / math.sqrt(d)
        out[b] = torch.einsum("hn,hnd->hd", s.softmax(-1), vals)
    return out


def attend_latent_cache(cache, layer: int, q: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
    """Decode-step attention of a post-RoPE LatentKVCache (moec/runtime/kvlatent.py): q [B, H, 1, d] ->
    [B, H, 1, d]; wk/wv: this layer's fp16 sinks + window [B, K, n, d] (the new token included)."""
    g = cache.group_of[layer]
    j = cache.groups[g].index(layer)
    B, K, d = cache.batch, cache.args.n_kv_heads, cache.args.head_dim
    rows = slice(j * K * d, (j + 1) * K * d)  # this layer's rows of the group basis
    parts = []
    for kind in "kv":
        c = cache.lcodecs[g][kind]
        u = c.basis[rows].reshape(K, d, c.r)
        step = torch.ones_like(c.scale) if c.bits == 16 else 2.0 * c.scale / 2**c.bits
        parts += [cache.lhist[g][kind]["codes"], u, c.mean[rows].reshape(K, d), step]
    ck, uk, mk, sk, cv, uv, mv, sv = parts
    hist = torch.full((B,), cache.n_blocks[layer] * cache.block, dtype=torch.int32, device=q.device)
    wlen = torch.full((B,), wk.shape[2], dtype=torch.int32, device=q.device)
    out = latent_decode_attention(q[:, :, 0], ck, cv, uk, mk, sk, uv, mv, sv, cache.lcodecs[g]["k"].bits, hist,
                                  wk.contiguous(), wv.contiguous(), wlen)
    return out[:, :, None].to(q.dtype)
