"""Decode attention over a static fp16 cache, flash-decoding style, with the new token's write fused in.

One query token per row attends to the cached keys/values of slots 0..pos-1 plus its own key/value
(slot pos), which the kernel also stores into the cache. This is the bf16 path's attention (and the
fair fp16 reference the compressed caches are timed against in the runtime).

Why it is shaped this way (a profile of the torch version, runtime/decode.py split_attention, at Mixtral
32k batch 1, showed two bandwidth-bound batched matmuls but ten more kernels per layer -- fp32 max/sum
reductions over the scores, a mask, casts, two index_put writes -- taking a large share of the step; the
kernel's timings against it: benchmarks/results/fp16_attention_h200.json):
  - one program per (row, KV head, split): the G = H/K query heads of a KV head share every key and
    value load, padded to 16 rows for tl.dot (tensor cores, fp32 accumulation);
  - the split length is computed on the device from pos (cdiv(pos, P), whole tiles), so a static grid
    (CUDA graphs) spreads any context over all P splits, and only slots < pos are read -- never the
    unused tail of the static buffer;
  - the new token enters from registers in the split that holds slot pos, which also writes it to
    the cache: no separate write kernels, and no read-after-write inside the step;
  - splits are combined by kv_decode_attention.combine_splits (partials acc, m in log2 units, l), which
    writes the output in the query's dtype (and adds gpt-oss's sink logits to the denominator).

Shapes: q [B, H, d] (any float dtype, last dim contiguous); k_cache, v_cache [Bc, K, S, d] fp16/bf16
contiguous (Bc >= B); k_new, v_new [B, K, d]; pos [B] int32/int64 (slot of the new token, < S).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import launch_config, pdl
from .kv_decode_attention import LOG2E, _interpreting, combine_splits
from .pdl import begin as pdl_begin

# launch settings on CUDA, from configs/<device>.json (launch_config; CONFIG: the defaults, tuned with
# benchmarks/bench_fp16_attention.py on the H200); the split count is sized in waves of the device's SMs
CONFIG = launch_config.defaults()["fp16_decode_attention"]["launch"]


@triton.jit
def _tile(q, m_i, l_i, acc, k_ptr, v_ptr, row, t0, end, skip, D: tl.constexpr, BLOCK_N: tl.constexpr,
          DT: tl.constexpr):
    """Online softmax over cached slots t0 .. t0 + BLOCK_N - 1 (< end, != skip: the new token's slot)."""
    offs_n = t0 + tl.arange(0, BLOCK_N)
    nmask = (offs_n < end) & (offs_n != skip)
    kv_off = row + offs_n[:, None] * D + tl.arange(0, D)[None, :]
    k = tl.load(k_ptr + kv_off, mask=nmask[:, None], other=0.0).to(DT)
    s = tl.dot(q, tl.trans(k))  # [G_P2, BLOCK_N], log2 units
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile holding only the new slot: nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + kv_off, mask=nmask[:, None], other=0.0).to(DT)
    acc = acc * alpha[:, None] + tl.dot(p.to(DT), v)
    return m_new, l_i, acc


@triton.jit
def _fp16_decode_kernel(q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, pos_ptr, part_ptr,
                        H, K, S, P, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, qk_scale, RING,
                        D: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                        DT: tl.constexpr, STAGES: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    bk = tl.program_id(0)
    sp = tl.program_id(1)
    b = bk // K
    kh = bk % K
    pos = tl.load(pos_ptr + b).to(tl.int32)
    # slots in use (the new token's included) and the new token's: a ring of RING slots (a sliding-window
    # layer) holds positions pos - RING + 1 .. pos once full, the new one replacing the oldest
    n_slots = pos + 1
    slot = pos
    if RING > 0:
        n_slots = tl.minimum(pos + 1, RING)
        slot = pos % RING
    # this row's split length: whole tiles, all P splits busy whatever the context
    tps = tl.cdiv(tl.cdiv(n_slots, P), BLOCK_N) * BLOCK_N
    start = sp * tps
    end = tl.minimum(start + tps, n_slots)

    offs_g = tl.arange(0, G_P2)
    gmask = offs_g < G
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + (kh * G + offs_g)[:, None] * sq_h + offs_d[None, :], mask=gmask[:, None],
                other=0.0).to(tl.float32)
    q = (q * qk_scale).to(DT)  # sm_scale·log2 e folded in once: exp2 below

    m_i = tl.full((G_P2,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((G_P2,), dtype=tl.float32)
    acc = tl.zeros((G_P2, D), dtype=tl.float32)
    row = (b * K + kh).to(tl.int64) * S * D
    n_it = tl.cdiv(end - start, BLOCK_N)
    if INTERP:  # the CPU interpreter rejects range() over a runtime bound
        it = 0
        while it < n_it:
            m_i, l_i, acc = _tile(q, m_i, l_i, acc, k_ptr, v_ptr, row, start + it * BLOCK_N, end, slot, D, BLOCK_N,
                                  DT)
            it += 1
    else:
        for it in tl.range(0, n_it, num_stages=STAGES):
            m_i, l_i, acc = _tile(q, m_i, l_i, acc, k_ptr, v_ptr, row, start + it * BLOCK_N, end, slot, D, BLOCK_N,
                                  DT)

    if (slot >= start) & (slot < start + tps):  # the split of the new slot: the new token, from registers
        kn = tl.load(kn_ptr + b * sk_b + kh * sk_h + offs_d)
        vn = tl.load(vn_ptr + b * sv_b + kh * sv_h + offs_d)
        kc = kn.to(k_ptr.dtype.element_ty)  # attend to the value the cache will hold
        vc = vn.to(v_ptr.dtype.element_ty)
        s_n = tl.sum(q.to(tl.float32) * kc.to(DT).to(tl.float32)[None, :], axis=1)
        m_new = tl.maximum(m_i, s_n)
        alpha = tl.exp2(m_i - m_new)
        p_n = tl.exp2(s_n - m_new)
        l_i = l_i * alpha + p_n
        acc = acc * alpha[:, None] + p_n.to(DT).to(tl.float32)[:, None] * vc.to(DT).to(tl.float32)[None, :]
        m_i = m_new
        tl.store(k_ptr + row + slot * D + offs_d, kc)
        tl.store(v_ptr + row + slot * D + offs_d, vc)

    out = part_ptr + ((b * H + kh * G + offs_g) * P + sp) * (D + 2)
    tl.store(out[:, None] + offs_d[None, :], acc, mask=gmask[:, None])
    tl.store(out + D, m_i, mask=gmask)
    tl.store(out + D + 1, l_i, mask=gmask)


def fp16_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                          v_new: torch.Tensor, pos: torch.Tensor, sm_scale: float | None = None,
                          n_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, precision: str | None = None,
                          out_dtype: torch.dtype | None = None, ring: int = 0,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """-> [B, H, d] in out_dtype (q's by default). Writes k_new/v_new into the caches at slot pos[b] (ring > 0:
    slot pos[b] % ring of a ring of `ring` slots, S >= ring, attending to min(pos + 1, ring) slots). sinks [H]:
    a logit per query head in the softmax's denominator (gpt-oss). precision "half" (fp16 tensor-core dots; the
    CUDA default) or "ieee" (fp32 dots; the default elsewhere). No host syncs: safe under CUDA-graph capture."""
    B, H, d = q.shape
    Bc, K, S, dk = k_cache.shape
    assert dk == d and v_cache.shape == k_cache.shape and Bc >= B and H % K == 0, (q.shape, k_cache.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert k_new.shape == (B, K, d) and v_new.shape == (B, K, d) and v_new.stride(-1) == 1
    assert k_new.stride(-1) == 1 and pos.shape == (B,) and d & (d - 1) == 0, (k_new.shape, pos.shape, d)
    cuda = q.is_cuda and not _interpreting()
    config = launch_config.config("fp16_decode_attention", q.device)["launch"]
    precision = precision or ("half" if cuda else "ieee")
    block_n = block_n or (config["block_n"] if cuda else 16)
    G = H // K
    if n_splits is None:
        programs = int(config["waves"] * launch_config.num_sms(q.device))
        n_splits = max(1, min(triton.cdiv(S, block_n), triton.cdiv(programs, B * K)))
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    assert 0 <= ring <= S and (sinks is None or sinks.shape == (H,)), (ring, S, None if sinks is None else sinks.shape)
    if ring:  # the splits share at most `ring` slots
        n_splits = max(1, min(n_splits, triton.cdiv(ring, block_n)))
    part = torch.empty(B * H * n_splits * (d + 2), device=q.device, dtype=torch.float32)
    _fp16_decode_kernel[(B * K, n_splits)](
        q, k_cache, v_cache, k_new, v_new, pos, part, H, K, S, n_splits,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        sm_scale * LOG2E, ring,
        D=d, G=G, G_P2=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n,
        DT=tl.float16 if precision == "half" else tl.float32, STAGES=num_stages or config["num_stages"],
        INTERP=not cuda, num_warps=num_warps or config["num_warps"], **pdl.options(q.device))
    return combine_splits(part, B * H, n_splits, d, None, out_dtype or q.dtype, sinks=sinks).view(B, H, d)


def fp16_decode_attention_ref(q, k_cache, v_cache, k_new, v_new, pos, ring: int = 0, sinks=None) -> torch.Tensor:
    """Torch reference (fp32 math; writes the caches like the kernel): -> [B, H, d] fp32."""
    B, H, d = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    rows = torch.arange(B, device=q.device)
    slot = pos.long() % ring if ring else pos.long()
    k_cache[rows, :, slot] = k_new.to(k_cache.dtype)
    v_cache[rows, :, slot] = v_new.to(v_cache.dtype)
    used = torch.arange(S, device=q.device)[None, :]
    mask = (used <= pos.long()[:, None]) & (used < (ring or S))  # [B, S]
    qf = q.float().view(B, K, H // K, d)
    s = torch.einsum("bkgd,bksd->bkgs", qf, k_cache[:B].float()) / math.sqrt(d)
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    if sinks is not None:  # one more logit per head in the denominator, no value
        s = torch.cat([s, sinks.float().view(1, K, H // K, 1).expand(B, -1, -1, 1)], dim=-1)
    p = s.softmax(-1)[..., :S]
    out = torch.einsum("bkgs,bksd->bkgd", p, v_cache[:B].float())
    return out.reshape(B, H, d)
