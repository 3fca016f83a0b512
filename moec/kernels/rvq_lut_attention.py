"""Decode attention over a residual-VQ KV cache (seed 002) by lookup tables, flash-decoding style.

One query token per sequence attends to
    coded segments: tokens stored as bit-packed residual-VQ codes (moec/formats/bitpack.py Layout.BITSTREAM: code
              j = s·P + p of stage s, sub-vector p, log2(C_s) bits at bit offset Σ_{j'<j} width_j'),
              one segment per cache tier (archive, middle), each with its own codebooks;
    window:   fp16 keys/values of the sinks and the most recent tokens.
Keys never get dequantized: per query head, `lut[g, base_j + c] = scale · q[g, sub-vector p]·C_s[p, c]`
(q·centroid tables for every stage and sub-vector, built once per step by one batched matmul in the
launcher: B·H·Σ_s P·C_s floats) and a key's score is Σ_j lut[g, base_j + code_j]: NJ table lookups
instead of d multiply-adds, reading only the codes. Values are dequantized tile by tile in registers
(Σ_s C_s[p, code] per channel; codebooks are tiny and stay in L1/L2), weighted by the softmax
probabilities and accumulated: equivalent to accumulating attention-weighted code histograms and
multiplying by the codebooks once, and the dequantized history never touches HBM.

Grid: (B·K, splits) per segment (split-K over the segment's tokens) plus one program per (b, KV head)
for the window; each writes partial (max, sum, acc) rows for its G = H / K query heads (GQA: the heads
share every code load), and `_reduce` combines them. Reductions are broadcast-and-sum (no tl.dot), so
the interpreter result is exact fp32 and G needs no padding to 16.

Shapes (B batch, H query heads, K KV heads, d head dim, S code-buffer capacity, RB bytes per token row,
NJ codes per token, TOT = Σ_s P·C_s centroids, Gc = K or 1 (codebooks shared by heads)):
    q        [B, H, d]            fp16/bf16/fp32
    codes_k  [B, K, S, RB]        uint8        codes_v same shape
    start, length [B]             int32        tokens start..start+length-1 of the buffer, per row
    cb_k, cb_v [Gc, TOT, dim]     fp32         the stages' codebooks, concatenated
    bit_off, width, base [NJ]     int32        per code: bit offset in the row, bits, first centroid
    win_k, win_v [B, K, Wc, d]    fp16         win_len [B] int32
    -> out [B, H, d] fp32
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats.bitpack import unpack_bits
from . import launch_config


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc):
    """Scores s [G, N] (masked: -inf), values v [N, D] -> updated (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])  # [G, N]
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_i, acc


@triton.jit
def _extract(row_ptr, rmask, boff, wid, RB):
    """Codes at bit offsets boff (width wid) of the packed rows row_ptr [N, 1] -> int32 [N, J]."""
    byte = boff >> 3
    sh = boff & 7
    b0 = tl.load(row_ptr + byte, mask=rmask & (byte < RB), other=0).to(tl.int32)
    b1 = tl.load(row_ptr + byte + 1, mask=rmask & (byte + 1 < RB), other=0).to(tl.int32)
    b2 = tl.load(row_ptr + byte + 2, mask=rmask & (byte + 2 < RB), other=0).to(tl.int32)
    word = b0 | (b1 << 8) | (b2 << 16)  # a code of <= 16 bits starting at bit sh <= 7 fits in 3 bytes
    return (word >> sh) & ((1 << wid) - 1)


@triton.jit
def _rvq_lut_attention_kernel(
    # pointers
    lut_ptr, ck_ptr, cv_ptr, start_ptr, len_ptr, cbv_ptr, boff_ptr, wid_ptr, base_ptr,
    q_ptr, wk_ptr, wv_ptr, wlen_ptr, m_ptr, l_ptr, acc_ptr,
    # sizes
    H, K, S, RB, NJ, TOT, cb_head_stride, WC, n_total, split_off, tokens_per_split,
    # constexprs
    D: tl.constexpr, DIM: tl.constexpr, P: tl.constexpr, NS: tl.constexpr, G: tl.constexpr,
    G_P2: tl.constexpr, NJ_P2: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
):
    bk = tl.program_id(0)  # b·K + kv head
    split = tl.program_id(1)
    b = bk // K
    kh = bk % K
    offs_g = tl.arange(0, G_P2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, D)
    gmask = offs_g < G
    heads = kh * G + offs_g
    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    acc = tl.zeros([G_P2, D], tl.float32)

    if WINDOW:  # fp16 sinks + recent tokens: plain scores q·k
        q = tl.load(q_ptr + (b * H + heads[:, None]) * D + offs_c[None, :], mask=gmask[:, None], other=0.0)
        q = q.to(tl.float32)  # [G_P2, D], already scaled by the launcher
        wlen = tl.load(wlen_ptr + b)
        t0 = 0
        while t0 < wlen:  # (while: the CPU interpreter rejects range() over a runtime int)
            tok = t0 + offs_n
            tmask = tok < wlen
            ptr = (bk * WC + tok).to(tl.int64)[:, None] * D + offs_c[None, :]
            k = tl.load(wk_ptr + ptr, mask=tmask[:, None], other=0.0).to(tl.float32)
            v = tl.load(wv_ptr + ptr, mask=tmask[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_P2, BLOCK_N]
            s = tl.where(tmask[None, :] & gmask[:, None], s, float("-inf"))
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc)
            t0 += BLOCK_N
    else:
        seg_start = tl.load(start_ptr + b)
        seg_len = tl.load(len_ptr + b)
        offs_j = tl.arange(0, NJ_P2)
        jmask = offs_j < NJ
        boff = tl.load(boff_ptr + offs_j, mask=jmask, other=0)
        wid = tl.load(wid_ptr + offs_j, mask=jmask, other=0)
        base = tl.load(base_ptr + offs_j, mask=jmask, other=0)
        lut_rows = lut_ptr + (bk * G + offs_g).to(tl.int64) * TOT  # [G_P2] this row's tables
        cbv = cbv_ptr + kh * cb_head_stride
        sub = offs_c // DIM  # sub-vector of each channel
        lo = split * tokens_per_split
        hi = tl.minimum(lo + tokens_per_split, seg_len)
        t0 = lo
        while t0 < hi:
            tok = t0 + offs_n
            tmask = tok < hi
            row = (bk.to(tl.int64) * S + seg_start + tok) * RB  # [BLOCK_N] byte offset of each row
            # keys: Σ_j lut[g, base_j + code_j]
            codes = _extract(ck_ptr + row[:, None], tmask[:, None] & jmask[None, :], boff[None, :],
                             wid[None, :], RB)  # [BLOCK_N, NJ_P2]
            idx = base[None, :] + codes
            t = tl.load(lut_rows[:, None, None] + idx[None, :, :],
                        mask=gmask[:, None, None] & tmask[None, :, None] & jmask[None, None, :], other=0.0)
            s = tl.sum(t, axis=2)  # [G_P2, BLOCK_N]
            s = tl.where(tmask[None, :] & gmask[:, None], s, float("-inf"))
            # values: dequantized in registers, Σ_s C_s[p, code] per channel
            v = tl.zeros([BLOCK_N, D], tl.float32)
            for st in tl.static_range(NS):
                j = st * P + sub  # [D] the code each channel reads in stage st
                cj = _extract(cv_ptr + row[:, None], tmask[:, None], tl.load(boff_ptr + j)[None, :],
                              tl.load(wid_ptr + j)[None, :], RB)  # [BLOCK_N, D]
                cidx = (tl.load(base_ptr + j)[None, :] + cj) * DIM + (offs_c % DIM)[None, :]
                v += tl.load(cbv + cidx, mask=tmask[:, None], other=0.0)
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc)
            t0 += BLOCK_N

    out = (b * H + heads) * n_total + split_off + split  # [G_P2]
    tl.store(m_ptr + out, m_i, mask=gmask)
    tl.store(l_ptr + out, l_i, mask=gmask)
    tl.store(acc_ptr + out[:, None] * D + offs_c[None, :], acc, mask=gmask[:, None])


class RVQTierView(NamedTuple):
    """One residual-VQ tier (moec.runtime.rvq.RVQTier) on one device, as CodeSegment takes it (made once per
    tier and device by its `kernel_view`)."""

    codebooks: list[torch.Tensor]  # per stage [Gc, P, C_s, dim] fp16


_LAYOUTS: dict = {}


@dataclass
class CodeSegment:
    """One tier's coded tokens: rows start..start+length-1 of codes_{k,v} [B, K, S, RB] per batch row, and
    the tier's codebooks [Gc, P, C_s, dim] per stage (keys, values)."""

    codes_k: torch.Tensor
    codes_v: torch.Tensor
    start: torch.Tensor  # [B] int32
    length: torch.Tensor  # [B] int32
    cb_k: list[torch.Tensor]
    cb_v: list[torch.Tensor]

    def layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """(bit_off, width, base) [NJ] int32, TOT centroids, P: the Layout.BITSTREAM offsets of the codes
        (moec/formats/bitpack.py; memoized per codebook shapes and device, so a step makes no host-to-device
        copies: CUDA graphs)."""
        key = (tuple(tuple(c.shape) for c in self.cb_k), str(self.codes_k.device))
        if key not in _LAYOUTS:
            _LAYOUTS[key] = self._layout()
        return _LAYOUTS[key]

    def _layout(self):
        P = self.cb_k[0].shape[1]
        widths, bases, off = [], [], 0
        for c in self.cb_k:
            C = c.shape[2]
            widths += [int(math.log2(C))] * P
            bases += [off + p * C for p in range(P)]
            off += P * C
        bit_off = [sum(widths[:j]) for j in range(len(widths))]
        dev = self.codes_k.device
        as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
        return as_t(bit_off), as_t(widths), as_t(bases), off, P


def _tables(q: torch.Tensor, cbs: list[torch.Tensor], K: int) -> torch.Tensor:
    """q [B, H, d] (scaled) -> lut [B, K, G, TOT] fp32: q's sub-vectors · every stage's centroids."""
    B, H, d = q.shape
    Gc, P, _, dim = cbs[0].shape
    qv = q.float().view(B, K, H // K, P, dim)
    out = []
    for c in cbs:
        cf = c.float().expand(K, -1, -1, -1) if Gc == 1 else c.float()  # [K, P, C, dim]
        out.append(torch.einsum("bkgpe,kpce->bkgpc", qv, cf).flatten(-2))  # [B, K, G, P·C]
    return torch.cat(out, -1).contiguous()


def _reduce(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Combine partials m, l [B, H, n], acc [B, H, n, d] -> [B, H, d] (empty partials have m = -inf)."""
    mx = m.amax(-1, keepdim=True)
    w = torch.exp(m - mx)
    return (acc * w[..., None]).sum(2) / (l * w).sum(-1, keepdim=True)


def rvq_lut_attention(q: torch.Tensor, segments: list[CodeSegment], win_k: torch.Tensor, win_v: torch.Tensor,
                      win_len: torch.Tensor, sm_scale: float | None = None, n_splits: int | None = None,
                      block_n: int | None = None, max_len: int | None = None) -> torch.Tensor:
    """Decode attention (one query per row) over coded segments + an fp16 window -> [B, H, d] fp32.

    max_len: the longest segment (tokens), to size the split-K grid without a device sync (default: read).
    block_n (tokens per tile) and the split count default to the device's launch_config ("rvq_lut_attention":
    block_n, and `waves` waves of the device's SMs)."""
    B, H, d = q.shape
    config = launch_config.config("rvq_lut_attention", q.device)["launch"]
    block_n = block_n or config["block_n"]
    K = win_k.shape[1]
    assert H % K == 0 and d & (d - 1) == 0 and block_n & (block_n - 1) == 0, (H, K, d, block_n)
    assert win_k.shape == win_v.shape and win_k.shape[:2] == (B, K) and win_k.shape[3] == d, win_k.shape
    assert win_k.dtype == win_v.dtype == torch.float16 and win_len.shape == (B,) and win_len.dtype == torch.int32
    G = H // K
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qs = (q.float() * sm_scale).contiguous()
    warps = 8 if d >= 128 else 4  # the [G, BLOCK_N, NJ] table gather and [G, BLOCK_N, d] p·v tiles live in registers
    plans = []
    for seg in segments:
        Bc, Kc, S, RB = seg.codes_k.shape
        assert (Bc, Kc) == (B, K) and seg.codes_v.shape == seg.codes_k.shape, (seg.codes_k.shape, seg.codes_v.shape)
        assert seg.codes_k.dtype == seg.codes_v.dtype == torch.uint8 and seg.codes_k.is_contiguous()
        assert seg.codes_v.is_contiguous() and seg.start.shape == seg.length.shape == (B,)
        assert seg.start.dtype == seg.length.dtype == torch.int32
        Gc, P, _, dim = seg.cb_k[0].shape
        assert Gc in (1, K) and P * dim == d and len(seg.cb_k) == len(seg.cb_v), (Gc, P, dim, d)
        bit_off, width, base, tot, _ = seg.layout()
        nbits = sum(int(math.log2(c.shape[2])) for c in seg.cb_k) * P
        assert nbits <= 8 * RB and all(c.shape[2] <= 2**16 for c in seg.cb_k), (RB, nbits)
        n = int(seg.length.max()) if max_len is None else max_len
        if n_splits is None:  # enough programs to fill the GPU: `waves` waves of its SMs
            programs = config["waves"] * launch_config.num_sms(q.device)
            splits = max(1, min(triton.cdiv(n, block_n), triton.cdiv(programs, B * K)))
        else:
            splits = max(1, n_splits)
        tps = triton.cdiv(triton.cdiv(max(n, 1), splits), block_n) * block_n
        splits = max(1, triton.cdiv(n, tps))
        plans.append((seg, bit_off, width, base, tot, P, dim, Gc, S, RB, splits, tps))
    n_total = sum(p[10] for p in plans) + 1  # + the window
    m = torch.full((B, H, n_total), float("-inf"), device=q.device)
    l = torch.zeros(B, H, n_total, device=q.device)
    acc = torch.zeros(B, H, n_total, d, device=q.device)
    off = 0
    for seg, bit_off, width, base, tot, P, dim, Gc, S, RB, splits, tps in plans:
        lut = _tables(qs, seg.cb_k, K)
        cbv = torch.cat([c.float().reshape(Gc, -1, dim) for c in seg.cb_v], 1).contiguous()  # [Gc, TOT, dim]
        _rvq_lut_attention_kernel[(B * K, splits)](
            lut, seg.codes_k, seg.codes_v, seg.start, seg.length, cbv, bit_off, width, base,
            qs, win_k, win_v, win_len, m, l, acc,
            H, K, S, RB, len(width), tot, 0 if Gc == 1 else tot * dim, win_k.shape[2], n_total, off, tps,
            D=d, DIM=dim, P=P, NS=len(seg.cb_k), G=G, G_P2=triton.next_power_of_2(G),
            NJ_P2=triton.next_power_of_2(len(width)), BLOCK_N=block_n, WINDOW=False, num_warps=warps)
        off += splits
    wk, wv = win_k.contiguous(), win_v.contiguous()
    dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    _rvq_lut_attention_kernel[(B * K, 1)](
        qs, dummy, dummy, dummy, dummy, qs, dummy, dummy, dummy,
        qs, wk, wv, win_len, m, l, acc,
        H, K, 0, 1, 1, 1, 0, wk.shape[2], n_total, off, 0,
        D=d, DIM=1, P=1, NS=1, G=G, G_P2=triton.next_power_of_2(G), NJ_P2=1, BLOCK_N=block_n, WINDOW=True,
        num_warps=warps)
    return _reduce(m, l, acc)


def _gather_centroids(c: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """c [K, P, C, dim], i [B, K, N, P] -> [B, K, N, P, dim]: centroid i[b, k, n, p] of c[k, p]."""
    B, K, N, P = i.shape
    idx = i.permute(1, 3, 0, 2).reshape(K, P, B * N, 1).expand(-1, -1, -1, c.shape[-1])
    return c.gather(2, idx).view(K, P, B, N, c.shape[-1]).permute(2, 0, 3, 1, 4)


def dequant_segment_ref(seg: CodeSegment, kind: str) -> torch.Tensor:
    """All rows of the segment's code buffer dequantized: [B, K, S, d] fp32 (torch, for the reference): the
    codes unpacked (moec/formats/bitpack.py Layout.BITSTREAM), then Σ_s C_s[p, code] with the fp16 codebooks
    in fp32 (the decode of moec.runtime.rvq.RVQTier)."""
    cbs = [c.half() for c in (seg.cb_k if kind == "k" else seg.cb_v)]
    packed = seg.codes_k if kind == "k" else seg.codes_v
    P, dim = cbs[0].shape[1], cbs[0].shape[3]
    codes = unpack_bits(packed, [int(math.log2(c.shape[2])) for c in cbs for _ in range(P)])
    B, K, N, _ = codes.shape
    x = torch.zeros(B, K, N, P, dim, device=codes.device)
    for s, cb in enumerate(cbs):
        c = cb.float().to(codes.device).expand(K, -1, -1, -1)
        x += _gather_centroids(c, codes[..., s * P : (s + 1) * P])
    return x.reshape(B, K, N, P * dim)


def rvq_lut_attention_ref(q: torch.Tensor, segments: list[CodeSegment], win_k: torch.Tensor, win_v: torch.Tensor,
                          win_len: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
    """Torch reference: dequantize every segment, concatenate the window, softmax attention in fp32."""
    B, H, d = q.shape
    K = win_k.shape[1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    deq = [(dequant_segment_ref(s, "k"), dequant_segment_ref(s, "v"), s) for s in segments]
    out = torch.empty(B, H, d, dtype=torch.float32, device=q.device)
    for b in range(B):
        keys, vals = [], []
        for kk, vv, s in deq:
            a, n = int(s.start[b]), int(s.length[b])
            keys.append(kk[b, :, a : a + n])
            vals.append(vv[b, :, a : a + n])
        w = int(win_len[b])
        keys.append(win_k[b, :, :w].float())
        vals.append(win_v[b, :, :w].float())
        kb, vb = torch.cat(keys, 1), torch.cat(vals, 1)  # [K, n, d]
        p = torch.softmax(q[b].float().view(K, H // K, d) @ kb.transpose(1, 2) * sm_scale, dim=-1)
        out[b] = (p @ vb).reshape(H, d)
    return out
