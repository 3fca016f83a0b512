"""Grouped MoE dequant-GEMM over tokens sorted by expert (vLLM fused_moe style), for prefill and for
decode steps with many tokens.

Shape legend: N = tokens, A = experts per token, T = N·A token-slots, E = experts, D = model dim,
I = expert intermediate dim, BM/BN/BK = tile rows (slots) / columns (outputs) / inputs, P = padded slots.

`align` sorts the slots by expert and pads each expert's run to a multiple of BM (sorted_ids [P],
padding = T), so every BM-block of slots belongs to one expert (block_expert [P / BM], E for blocks
past the end). Everything is computed on the device with static shapes (no host sync), so a decode
step through this path can be captured in a CUDA graph. P = (cdiv(T, BM) + min(E, T)) · BM bounds
Σ_e ceil(count_e / BM) · BM.

Two launches, one program per (BM-block of slots, BN-block of outputs):
  1. gate/up: x rows gathered by token id straight from the input, W1/W3 tiles [BN, BK] dequantized
     in registers to bf16 (dequant.dequant_tile: codebook/affine/fp8/vq), two tl.dot into fp32 (fp8 and
     vq row scales applied to the fp32 result's columns);
     h = silu(g) ⊙ u stored bf16 [T, I] in slot order.
  2. down: h rows of the block, W2 tiles, tl.dot; the routing weight of each slot is applied in
     registers; y [T, D] (x dtype) in slot order, then out = y.view(N, A, D).sum(1).
No dequantized weight reaches memory. `moe_grouped_ref` is the plain-torch reference.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from . import launch_config
from .dequant import (
    EXPERT_ACT_IDS,
    MODE_DENSE,
    MODE_FP8,
    MODE_TCQ,
    MODE_VQ,
    TCQ_MAX_STAGES,
    QWeight,
    check_moe_args,
    codes_per_chunk,
    dequant_ref,
    dequant_tile,
    gated_act,
    gated_act_ref,
    pick_block_k,
    vq_static,
)

# Launch settings, from configs/<device>.json (launch_config; the names below are the defaults, a hand
# sweep on the H200 with benchmarks/bench_moe_kernel.py --sweep): prefill (many slots per expert) and small
# (decode-size batches: BM = 16, the smallest tl.dot tile).
# (Triton 3.6 fails to compile BM 64 / BN 128 / BK 64 / 4 warps with the table dequant: a
# TritonGPUOptimizeDotOperands pass failure, seen on the H200.)
PREFILL_CONFIG, SMALL_CONFIG = (launch_config.defaults()["moe_prefill"][k] for k in ("prefill", "small"))


def dot_dtype():
    """tl.dot operand type: bf16 (tensor cores); fp32 under TRITON_INTERPRET, whose bf16 dot is broken
    in Triton 3.6 (garbage results), so the CPU tests check the indexing and dequant logic in fp32."""
    return tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16


def align(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, A] -> (sorted_ids [P] int32, block_expert [P / BM] int32); no host synchronization."""
    flat = ids.reshape(-1).long()
    T = flat.numel()
    dev = flat.device
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, in token order within one
    se = flat[order]
    rank = torch.arange(T, device=dev) - (counts.cumsum(0) - counts)[se]
    n_blocks = triton.cdiv(T, block_m) + min(n_experts, T)
    sorted_ids = torch.full((n_blocks * block_m,), T, dtype=torch.int32, device=dev)
    sorted_ids[(pad_end - padded)[se] + rank] = order.to(torch.int32)
    starts = torch.arange(n_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)  # E past the end
    return sorted_ids, block_expert


@triton.jit
def _gate_up_kernel(x_ptr, sid_ptr, bexp_ptr, w1_ptr, a1_ptr, b1_ptr, w3_ptr, a3_ptr, b3_ptr, h_ptr, bg_ptr, bu_ptr,
                    T, I, E, stride_xn, stride_we, stride_wo, stride_ae, stride_ao,
                    D: tl.constexpr, A: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr,
                    C: tl.constexpr, BPC: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, VD: tl.constexpr = 1,
                    HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 7.0):
    pid_m = tl.program_id(0)
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if e >= E:  # a block past the last expert's run
        return
    slot = tl.load(sid_ptr + pid_m * BM + tl.arange(0, BM))
    valid = slot < T
    tok = (slot // A).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < I
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + tok[:, None] * stride_xn + k[None, :], mask=valid[:, None] & (k < D)[None, :],
                     other=0.0).to(DOT)
        w1 = dequant_tile(w1_ptr + e * stride_we, a1_ptr + e * stride_ae, b1_ptr + e * stride_ae, offs_n, mask_n,
                          stride_wo, stride_ao, k0, D, MODE, BITS, C, BPC, G, GS, BK, DOT, VD)
        acc_g = tl.dot(xt, tl.trans(w1), acc_g)
        w3 = dequant_tile(w3_ptr + e * stride_we, a3_ptr + e * stride_ae, b3_ptr + e * stride_ae, offs_n, mask_n,
                          stride_wo, stride_ao, k0, D, MODE, BITS, C, BPC, G, GS, BK, DOT, VD)
        acc_u = tl.dot(xt, tl.trans(w3), acc_u)
    if MODE == 2 or MODE == 6:  # fp8, tcq row scales: one per output column of the tile
        acc_g *= tl.load(a1_ptr + e * stride_ae + offs_n, mask=mask_n, other=0.0)[None, :]
        acc_u *= tl.load(a3_ptr + e * stride_ae + offs_n, mask=mask_n, other=0.0)[None, :]
    if MODE == 4:  # vq row scales [E, I] (b)
        acc_g *= tl.load(b1_ptr + e * I + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc_u *= tl.load(b3_ptr + e * I + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:  # the experts' biases [E, I] fp32, one per output column
        acc_g += tl.load(bg_ptr + e * I + offs_n, mask=mask_n, other=0.0)[None, :]
        acc_u += tl.load(bu_ptr + e * I + offs_n, mask=mask_n, other=0.0)[None, :]
    h = gated_act(acc_g, acc_u, ACT, LIMIT)
    tl.store(h_ptr + slot[:, None].to(tl.int64) * I + offs_n[None, :], h.to(tl.bfloat16),
             mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(h_ptr, sid_ptr, bexp_ptr, wts_ptr, w2_ptr, a2_ptr, b2_ptr, y_ptr, bd_ptr,
                 T, D, E, stride_we, stride_wo, stride_ae, stride_ao,
                 I: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr,
                 C: tl.constexpr, BPC: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, VD: tl.constexpr = 1,
                 HAS_BIAS: tl.constexpr = False):
    pid_m = tl.program_id(0)
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if e >= E:
        return
    slot = tl.load(sid_ptr + pid_m * BM + tl.arange(0, BM))
    valid = slot < T
    srow = slot.to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < D
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        k = k0 + tl.arange(0, BK)
        ht = tl.load(h_ptr + srow[:, None] * I + k[None, :], mask=valid[:, None] & (k < I)[None, :], other=0.0).to(DOT)
        w2 = dequant_tile(w2_ptr + e * stride_we, a2_ptr + e * stride_ae, b2_ptr + e * stride_ae, offs_n, mask_n,
                          stride_wo, stride_ao, k0, I, MODE, BITS, C, BPC, G, GS, BK, DOT, VD)
        acc = tl.dot(ht, tl.trans(w2), acc)
    if MODE == 2 or MODE == 6:
        acc *= tl.load(a2_ptr + e * stride_ae + offs_n, mask=mask_n, other=0.0)[None, :]
    if MODE == 4:
        acc *= tl.load(b2_ptr + e * D + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bd_ptr + e * D + offs_n, mask=mask_n, other=0.0)[None, :]
    acc *= tl.load(wts_ptr + slot, mask=valid, other=0.0)[:, None]
    tl.store(y_ptr + srow[:, None] * D + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & mask_n[None, :])


def _static(w: QWeight, block_k: int) -> dict:
    if w.mode == MODE_VQ:  # byte codes (the tile gathers codebook rows; no word chunks here)
        st = vq_static(w, block_k, words=False)
        del st["VQF"]
        return st
    C, BPC = codes_per_chunk(w.mode, w.bits)
    G = w.groups
    return dict(MODE=w.mode, BITS=w.bits, C=C, BPC=BPC, G=G, GS=w.n_in // G,
                BK=pick_block_k(w.n_in, w.tile_group, block_k, C), VD=1)


# Configs whose compile failed (Triton 3.6's TritonGPUOptimizeDotOperands pass fails on some table-dequant
# tiles, e.g. 3-bit with BM 128 / BN 128 / BK 64 / 8 warps, seen on the H200); they run the small config.
_BROKEN: set = set()
_WARNED: set = set()
log = logging.getLogger(__name__)


def _launch(x, ids, weights, w1: QWeight, w3: QWeight, w2: QWeight, cfg: dict, out_dtype,
            h_rotate=None, biases=None, act: str = "silu", limit: float = 7.0) -> torch.Tensor:
    """align + the two launches; returns y [T, D] in slot order."""
    N, D = x.shape
    A = ids.shape[1]
    E, I = w1.data.shape[:2]
    T = N * A
    BM, BN = cfg["block_m"], cfg["block_n"]
    sorted_ids, block_expert = align(ids, E, BM)
    h = torch.empty(T, I, dtype=torch.bfloat16, device=x.device)
    (d1, a1, b1), (d3, a3, b3), (d2, a2, b2) = w1.ptrs(), w3.ptrs(), w2.ptrs()
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if MODE_TCQ in (w1.mode, w2.mode):  # two gathered int32 word tiles per dequant tile: 4 stages of 128 x 64
        # overflow shared memory
        launch["num_stages"] = min(launch["num_stages"], TCQ_MAX_STAGES)
    bg, bu, bd = (weights,) * 3 if biases is None else (b.float().contiguous() for b in biases)
    _gate_up_kernel[(block_expert.numel(), triton.cdiv(I, BN))](
        x, sorted_ids, block_expert, d1, a1, b1, d3, a3, b3, h, bg, bu, T, I, E, x.stride(0),
        d1.stride(0), d1.stride(1), a1.stride(0) if w1.a is not None else 0, w1.row_stride_a(),
        D=D, A=A, BM=BM, BN=BN, DOT=dot_dtype(), **_static(w1, cfg["block_k"]), **launch,
        HAS_BIAS=biases is not None, ACT=EXPERT_ACT_IDS[act], LIMIT=float(limit))
    if h_rotate is not None:  # rows of h are slots: every row is rotated alike
        h = h_rotate(h).contiguous()
    y = torch.empty(T, D, dtype=out_dtype or x.dtype, device=x.device)
    _down_kernel[(block_expert.numel(), triton.cdiv(D, BN))](
        h, sorted_ids, block_expert, weights, d2, a2, b2, y, bd, T, D, E,
        d2.stride(0), d2.stride(1), a2.stride(0) if w2.a is not None else 0, w2.row_stride_a(),
        I=I, BM=BM, BN=BN, DOT=dot_dtype(), **_static(w2, cfg["block_k"]), **launch, HAS_BIAS=biases is not None)
    return y


def moe_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: QWeight, w3: QWeight,
                w2: QWeight, block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None, small: bool | None = None,
                out_dtype: torch.dtype | None = None, h_rotate=None, biases=None, act: str = "silu",
                limit: float = 7.0) -> torch.Tensor:
    """Grouped quantized MoE. x [N, D] (bf16/fp16/fp32); ids, weights [N, A]; w1, w3 [E, I, D] and
    w2 [E, D, I] as QWeight of one mode (w1 and w3 of one width). Returns out [N, D] in out_dtype (default
    x.dtype). h_rotate: a function applied to the intermediate h [T, I] between the launches (moe_decode's
    h_rotate); biases, act, limit: moe_decode's."""
    N, D, A, E, I = check_moe_args(x, ids, weights, w1, w3, w2)
    T = N * A
    configs = launch_config.config("moe_prefill", x.device)
    small_cfg = configs["small"]
    cfg = dict(small_cfg if (small if small is not None else T <= 4 * E) else configs["prefill"])
    for k, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k), ("num_warps", num_warps),
                 ("num_stages", num_stages)):
        if v is not None:
            cfg[k] = v
    x = x.contiguous()
    weights = weights.float().contiguous()
    if x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1" and w1.mode not in (MODE_FP8, MODE_DENSE) and \
            min(_static(w, cfg["block_k"])["BK"] for w in (w1, w2)) < 32:
        # Table/RTN dequant tiles 16 inputs wide give wrong sums on the H200 (Triton 3.6; every BK = 16
        # case of a probe over shapes and block sizes, while BK >= 32 is exact; cause not found). Rows of
        # 16 inputs (or groups of 16) are toy shapes: they take the torch reference instead.
        if "bk16" not in _WARNED:
            _WARNED.add("bk16")
            log.warning("grouped MoE: 16-input dequant tiles (D=%d, I=%d) run the torch reference on CUDA", D, I)
        return moe_grouped_ref(x, ids, weights, w1, w3, w2, h_rotate, biases, act, limit).to(out_dtype or x.dtype)
    key = (w1.mode, w1.bits, w2.bits, D, I, *cfg.values())
    if key in _BROKEN:
        cfg = dict(small_cfg)
    try:
        y = _launch(x, ids, weights, w1, w3, w2, cfg, out_dtype, h_rotate, biases, act, limit)
    except RuntimeError as ex:  # a Triton compile failure (first call of a config only)
        if "PassManager" not in str(ex) or cfg == small_cfg:
            raise
        _BROKEN.add(key)
        y = _launch(x, ids, weights, w1, w3, w2, dict(small_cfg), out_dtype, h_rotate, biases, act, limit)
    return y.view(N, A, D).sum(1)


def moe_grouped_ref(x, ids, weights, w1: QWeight, w3: QWeight, w2: QWeight, h_rotate=None, biases=None,
                    act: str = "silu", limit: float = 7.0) -> torch.Tensor:
    """Plain-torch reference (fp32, per expert over its tokens), out [N, D] fp32."""
    W1, W3, W2 = dequant_ref(w1), dequant_ref(w3), dequant_ref(w2)
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        h = gated_act_ref(xf[tok] @ W1[e].t(), xf[tok] @ W3[e].t(), biases, e, act, limit)
        if h_rotate is not None:
            h = h_rotate(h)
        y = h @ W2[e].t()
        if biases is not None:
            y = y + biases[2][e].float()
        out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out
