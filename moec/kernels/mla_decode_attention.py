"""Decode attention over the MLA latent cache (DeepSeek), flash-decoding style, the new row's write fused in.

The absorbed form of multi-head latent attention (runtime/model.MLAttention, runtime/mla.py) is multi-query
attention with one shared "head" per token: the cached row [c (R = kv_lora_rank), k_rope (RP = qk_rope_dim)],
the keys being the whole row and the values its first R channels. Each query head h brings
[q_lat_h (R), q_rope_h (RP)]; score = q_lat·c + q_rope·k_rope; out_h = Σ p·c, [R] (the caller projects it by
W_UV). So every row loaded serves all H heads: the kernel is bandwidth-bound on the cache exactly when it
reads each row once per step, whatever H is.

  - one program per (batch row, block of BH heads, split of the cache): the heads of a block share every row
    load (tl.dot on tensor cores, fp32 accumulation); with H <= BH (DeepSeek-V2-Lite's 16) one block reads
    the cache once; more heads (V3's 128) take H / BH blocks, which read it again from L2 when they run
    together;
  - the row splits into its two power-of-two parts (c and k_rope, masked up to powers of two otherwise), two
    dots per score tile;
  - the split length comes from pos on the device (cdiv(pos + 1, P) whole tiles), so one static grid (CUDA
    graphs) serves any context and reads only slots < pos;
  - the new row enters from registers in the split that holds slot pos, whose head block 0 also writes it to
    the cache; splits are combined by kv_decode_attention.combine_splits.

Shapes: q [B, H, R + RP] (last dim contiguous), rows [Bc, S, R + RP] fp16/bf16 contiguous (Bc >= B),
new [B, R + RP], pos [B] (slot of the new row, < S) -> [B, H, R].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch_config, pdl
from .kv_decode_attention import LOG2E, _interpreting, combine_splits
from .pdl import begin as pdl_begin

# launch settings on CUDA, from configs/<device>.json (launch_config; these are the defaults)
CONFIG = launch_config.defaults()["mla_decode_attention"]["launch"]


@triton.jit
def _tile(ql, qr, m_i, l_i, acc, rows_ptr, base, t0, end, R: tl.constexpr, RP: tl.constexpr,
          R_P2: tl.constexpr, RP_P2: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr):
    """Online softmax over cached rows t0 .. t0 + BLOCK_N - 1 (< end)."""
    L: tl.constexpr = R + RP
    offs_n = t0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < end
    offs_r = tl.arange(0, R_P2)
    offs_p = tl.arange(0, RP_P2)
    row = base + offs_n[:, None].to(tl.int64) * L
    c = tl.load(rows_ptr + row + offs_r[None, :], mask=nmask[:, None] & (offs_r < R)[None, :], other=0.0).to(DT)
    kr = tl.load(rows_ptr + row + R + offs_p[None, :], mask=nmask[:, None] & (offs_p < RP)[None, :],
                 other=0.0).to(DT)
    s = tl.dot(ql, tl.trans(c)) + tl.dot(qr, tl.trans(kr))  # [BH, BLOCK_N], log2 units
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DT), c)
    return m_new, l_i, acc


@triton.jit
def _new_row(ql, qr, m_i, l_i, acc, cn, kn, DT: tl.constexpr):
    """Online softmax over the new row (c cn, k_rope kn: already in the cache's dtype), from registers."""
    cf = cn.to(DT).to(tl.float32)  # attend to the value the cache will hold
    s_n = tl.sum(ql.to(tl.float32) * cf[None, :], axis=1) + \
        tl.sum(qr.to(tl.float32) * kn.to(DT).to(tl.float32)[None, :], axis=1)
    m_new = tl.maximum(m_i, s_n)
    alpha = tl.exp2(m_i - m_new)
    p_n = tl.exp2(s_n - m_new)
    l_i = l_i * alpha + p_n
    acc = acc * alpha[:, None] + p_n.to(DT).to(tl.float32)[:, None] * cf[None, :]
    return m_new, l_i, acc


@triton.jit
def _store_part(out, offs_c, hmask, acc, RW: tl.constexpr, l_i, HALF: tl.constexpr):
    """A split's output channels offs_c: acc in fp32, or (HALF) acc / l in fp16 (0 where the split is empty)."""
    if HALF:
        a = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0).to(tl.float16)
    else:
        a = acc
    tl.store(out[:, None] + offs_c[None, :], a, mask=hmask[:, None] & (offs_c < RW)[None, :])


@triton.jit
def _mla_decode_kernel(q_ptr, rows_ptr, new_ptr, pos_ptr, part_ptr, acc16_ptr, H, S, P, sq_b, sq_h, sn_b,
                       qk_scale, R: tl.constexpr, RW: tl.constexpr, RP: tl.constexpr, R_P2: tl.constexpr,
                       RP_P2: tl.constexpr, BH: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
                       STAGES: tl.constexpr, INTERP: tl.constexpr, HALF: tl.constexpr = False,
                       PDL: tl.constexpr = False):
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    L: tl.constexpr = R + RP
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    tps = tl.cdiv(tl.cdiv(pos + 1, P), BLOCK_N) * BLOCK_N  # pos + 1: the new slot belongs to a split
    start = sp * tps
    end = tl.minimum(start + tps, pos)

    offs_h = hb * BH + tl.arange(0, BH)
    hmask = offs_h < H
    offs_r = tl.arange(0, R_P2)
    offs_p = tl.arange(0, RP_P2)
    qrow = q_ptr + b * sq_b + offs_h[:, None] * sq_h
    ql = tl.load(qrow + offs_r[None, :], mask=hmask[:, None] & (offs_r < R)[None, :], other=0.0).to(tl.float32)
    qr = tl.load(qrow + R + offs_p[None, :], mask=hmask[:, None] & (offs_p < RP)[None, :], other=0.0)
    ql = (ql * qk_scale).to(DT)  # sm_scale·log2 e folded in once: exp2 below
    qr = (qr.to(tl.float32) * qk_scale).to(DT)

    m_i = tl.full((BH,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, R_P2), dtype=tl.float32)
    base = b.to(tl.int64) * S * L
    n_it = tl.cdiv(end - start, BLOCK_N)
    if INTERP:  # the CPU interpreter rejects range() over a runtime bound
        it = 0
        while it < n_it:
            m_i, l_i, acc = _tile(ql, qr, m_i, l_i, acc, rows_ptr, base, start + it * BLOCK_N, end, R, RP, R_P2,
                                  RP_P2, BLOCK_N, DT)
            it += 1
    else:
        for it in tl.range(0, n_it, num_stages=STAGES):
            m_i, l_i, acc = _tile(ql, qr, m_i, l_i, acc, rows_ptr, base, start + it * BLOCK_N, end, R, RP, R_P2,
                                  RP_P2, BLOCK_N, DT)

    if (pos >= start) & (pos < start + tps):  # the split of slot pos: the new row, from registers
        rmask = offs_r < R
        pmask = offs_p < RP
        cn = tl.load(new_ptr + b * sn_b + offs_r, mask=rmask, other=0.0).to(rows_ptr.dtype.element_ty)
        kn = tl.load(new_ptr + b * sn_b + R + offs_p, mask=pmask, other=0.0).to(rows_ptr.dtype.element_ty)
        m_i, l_i, acc = _new_row(ql, qr, m_i, l_i, acc, cn, kn, DT)
        if hb == 0:
            tl.store(rows_ptr + base + pos * L + offs_r, cn, mask=rmask)
            tl.store(rows_ptr + base + pos * L + R + offs_p, kn, mask=pmask)

    if HALF:  # acc / l in fp16 apart, (m, l) in part: half the bytes written here and read by the combine
        out = acc16_ptr + ((b * H + offs_h) * P + sp) * RW
        ml = part_ptr + ((b * H + offs_h) * P + sp) * 2
    else:
        out = part_ptr + ((b * H + offs_h) * P + sp) * (RW + 2)  # RW >= R: the combine's width (zeros past R)
        ml = out + RW
    _store_part(out, offs_r, hmask, acc, RW, l_i, HALF)
    tl.store(ml, m_i, mask=hmask)
    tl.store(ml + 1, l_i, mask=hmask)


def mla_decode_attention(q: torch.Tensor, rows: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, r: int,
                         sm_scale: float, n_splits: int | None = None, block_n: int | None = None,
                         block_h: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                         precision: str | None = None, out_dtype: torch.dtype | None = None,
                         half_partials: bool | None = None) -> torch.Tensor:
    """-> [B, H, r] in out_dtype (q's by default); writes `new` into rows at slot pos[b]. precision "half"
    (fp16/bf16 tensor-core dots in the cache's dtype; the CUDA default) or "ieee" (fp32; the default elsewhere).
    half_partials: each split writes its normalized output acc / l in fp16 (and m, l in fp32) instead of acc in
    fp32 (at batch 1 the splits' partials are about a tenth of the cache's bytes at 32k; default: the launch
    config's `half_partials` on CUDA, on in the shipped configs; fp32 partials elsewhere, as its ieee precision).
    No host syncs: safe under CUDA-graph capture."""
    B, H, L = q.shape
    Bc, S, Lc = rows.shape
    rp = L - r
    assert Lc == L and Bc >= B and 0 < r < L and r % 16 == 0, (q.shape, rows.shape, r)
    assert rows.is_contiguous() and q.stride(-1) == 1 and new.shape == (B, L) and new.stride(-1) == 1
    assert pos.shape == (B,), pos.shape
    cuda = q.is_cuda and not _interpreting()
    config = launch_config.config("mla_decode_attention", q.device)["launch"]
    precision = precision or ("half" if cuda else "ieee")
    block_n = block_n or (config["block_n"] if cuda else 16)
    bh = block_h or min(config["block_h"], max(16, triton.next_power_of_2(H)))
    n_hb = triton.cdiv(H, bh)
    if n_splits is None:  # whole waves: rounding up would start a nearly empty extra wave (B = 16: 144 programs)
        programs = int(config["waves"] * launch_config.num_sms(q.device)) if cuda else 4
        n_splits = max(1, min(triton.cdiv(S, block_n), programs // (B * n_hb)))
    rw = triton.cdiv(r, 32) * 32  # combine_splits reduces channels in chunks of 32
    half = (cuda and config.get("half_partials", False)) if half_partials is None else half_partials
    part = torch.empty(B * H * n_splits * (2 if half else rw + 2), device=q.device, dtype=torch.float32)
    acc16 = torch.empty(B * H * n_splits * rw, device=q.device, dtype=torch.float16) if half else None
    dt = tl.float32 if precision == "ieee" else (tl.bfloat16 if rows.dtype == torch.bfloat16 else tl.float16)
    _mla_decode_kernel[(B, n_hb, n_splits)](
        q, rows, new, pos, part, acc16 if half else part, H, S, n_splits, q.stride(0), q.stride(1), new.stride(0),
        sm_scale * LOG2E,
        R=r, RW=rw, RP=rp, R_P2=triton.next_power_of_2(r), RP_P2=max(16, triton.next_power_of_2(rp)), BH=bh,
        BLOCK_N=block_n, DT=dt, STAGES=num_stages or config["num_stages"], INTERP=not cuda, HALF=half,
        num_warps=num_warps or config["num_warps"], **pdl.options(q.device))
    out = combine_splits(part, B * H, n_splits, rw, None, out_dtype or q.dtype, acc16=acc16).view(B, H, rw)
    return out if rw == r else out[..., :r]


def mla_decode_attention_ref(q: torch.Tensor, rows: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, r: int,
                             sm_scale: float) -> torch.Tensor:
    """Torch reference (fp32 math; writes the rows like the kernel): -> [B, H, r] fp32."""
    B, H, L = q.shape
    S = rows.shape[1]
    rows[torch.arange(B, device=q.device), pos.long()] = new.to(rows.dtype)
    mask = torch.arange(S, device=q.device)[None, :] <= pos.long()[:, None]  # [B, S]
    s = torch.einsum("bhl,bsl->bhs", q.float(), rows[:B].float()) * sm_scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("bhs,bsr->bhr", s.softmax(-1), rows[:B, :, :r].float())
