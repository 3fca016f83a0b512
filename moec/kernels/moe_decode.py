"""Fused MoE decode (few tokens): quantized expert GEMVs with dequantization in registers (seed 000).

Shape legend: N = tokens (a decode step), A = experts per token, T = N·A token-slots, E = experts,
D = model dim, I = expert intermediate dim.

    out[n] = Σ_a weights[n, a] · W2[e] (silu(W1[e] x_n) ⊙ (W3[e] x_n)),  e = ids[n, a]

Each matrix is a `dequant.QWeight`: 2/3/4-bit codes with a per-group table (hls, fp3) or affine
levels (rtn), fp8 e4m3 with per-row scales, vector codebooks (vq: one code per d inputs, a codebook per
matrix and row scales; dequant.gemv_vq) or plain bf16 (the peer). 2-bit tables that come with
their cubic coefficients (QWeight.b = runtime/experts.lut_poly(lut)) are decoded on the FMA pipe (q as a
float from one logic op, then Horner) instead of a bit-test/select tree on the half-rate integer pipe.
Two launches:
  1. gate/up: one program per (slot, block of BO rows of I). It reads x_n straight from the input (no
     gathered copy), streams BO rows of W1 and W3 over the whole D, dequantizes in registers and
     accumulates into a [BO, BK/C] fp32 register tile (reduced once at the end, not per step), then
     writes h = weight · silu(g) ⊙ u [T, I] fp32, the only intermediate (routing weight folded in,
     since W2 is linear).
  2. down + combine: one program per (token, block of BO rows of D, slice of I); it loops over the
     token's A slots, so the weighted sum over experts stays in registers and is stored once
     (SPLIT = 1), or added with fp32 atomics when I is split across programs (small grids).
2-bit fp16 tables in the word layout take, on CUDA, the PTX prmt path by default (dequant.gemv_prmt:
about a third of the cubic path's SASS instructions per code in the gate/up loop, as counted by
benchmarks/sass_moe_decode.py): x goes in as fp16
pairs in the prmt order (dequant.prmt_pairs) and h is stored as fp16 in that order, products are fp16x2
with fp32 sums per 16 codes (within tests/kernels/test_moe_decode.py's tolerance of the fp32 reference);
prmt=False keeps the previous path, and a prmt compile failure falls back to it with a warning.
No dequantized weight reaches memory. At more tokens per step the grouped kernel
(moe_prefill.moe_grouped) reads each expert once instead of once per slot; `moe_forward` picks.
`moe_decode_ref` is the plain-torch reference.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from . import launch_config, pdl
from .dequant import (
    EXPERT_ACT_IDS,
    MODE_DENSE,
    MODE_FP4,
    MODE_FP8,
    MODE_VQ,
    QWeight,
    check_moe_args,
    codes_per_chunk,
    dequant_ref,
    gated_act,
    gated_act_ref,
    gemv_chunks,
    gemv_fp4_words,
    gemv_fp4_words2,
    gemv_prmt,
    gemv_prmt2,
    gemv_words,
    gemv_words2,
    pick_block_k,
    prmt_pairs,
    prmt_tab,
    tcq_asm,
    use_fp4_words,
    use_prmt,
    use_words,
    vq_static,
)
from .fp4_h2 import FP4H_SCALE, fp4_pair_slot, fp4_pairs, gemv_fp4h, gemv_fp4h2, use_fp4h
from .pdl import begin as pdl_begin

log = logging.getLogger(__name__)

# Launch settings, from configs/<device>.json (launch_config; the names below are the defaults, tuned on
# the H200 with benchmarks/sweep_moe_decode.py, the sweeps in benchmarks/results/moe_decode_sweep*_h200.json).
#   prmt (2-bit prmt path; None = chosen per call): gate/up 32 rows and 4 warps when that still gives >= 4
#     programs per SM, else 16 rows and 8 warps (a grid of few 32-row programs leaves SMs idle); down 16
#     rows, 2048 inputs per step, 8 warps, I split only when the grid has fewer programs than SMs;
#     num_stages None: Triton's default (1 and 3 measured the same).
#   legacy: the non-prmt paths (select/cubic 2-bit, 3/4-bit, fp8) keep the settings they were swept with.
#   dense (bf16 experts): 512-input tiles; 16 gate/up rows and 4 warps where 16-row programs fill every SM
#     4 times, else 8 rows and 8 warps; down 8 rows of 1024 inputs.
#   vq: 8-row gate/up programs over 1024 inputs and 8 warps, 16-row down programs (a codebook gather per
#     code bounds them).
#   fp4 (mxfp4 / nvfp4, the int32-word GEMV): its own slot for its own sweep (sweep_moe_decode --kind mxfp4);
#     the legacy values until then.
_CFG = launch_config.defaults()["moe_decode"]
DECODE_CONFIG, LEGACY_CONFIG, DENSE_CONFIG, VQ_CONFIG = _CFG["prmt"], _CFG["legacy"], _CFG["dense"], _CFG["vq"]
FP4_CONFIG = _CFG["fp4"]


def config_name(prmt: bool, mode: int) -> str:
    """The launch config slot of a moe_decode call: prmt for the 2-bit prmt path, else by the weights' mode."""
    return "prmt" if prmt else "vq" if mode == MODE_VQ else "fp4" if mode == MODE_FP4 else "legacy"


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, wts_ptr, w1_ptr, a1_ptr, b1_ptr, w3_ptr, a3_ptr, b3_ptr, h_ptr, bg_ptr, bu_ptr,
                    I, stride_we, stride_wo, stride_ae, stride_ao,
                    D: tl.constexpr, A: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr,
                    C: tl.constexpr, BPC: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
                    BO: tl.constexpr, BKC: tl.constexpr, WORDS: tl.constexpr, POLY: tl.constexpr,
                    PRMT: tl.constexpr = False, VD: tl.constexpr = 1, VQF: tl.constexpr = 0,
                    HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = 0, LIMIT: tl.constexpr = 7.0,
                    ASM: tl.constexpr = False, zero_ptr=None, n_zero=0, ZB: tl.constexpr = 0,
                    PDL: tl.constexpr = False, FP4H: tl.constexpr = False):
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    t = tl.program_id(0)  # token-slot n·A + a
    if ZB > 0:  # the split down GEMV's fp32 output [N, D] zeroed here, ZB values a program (no memset launch)
        zo = (t * tl.num_programs(1) + tl.program_id(1)) * ZB + tl.arange(0, ZB)
        tl.store(zero_ptr + zo, tl.zeros((ZB,), dtype=tl.float32), mask=zo < n_zero)
    n = t // A
    e = tl.load(ids_ptr + t).to(tl.int64)
    offs_o = tl.program_id(1) * BO + tl.arange(0, BO)
    mask_o = offs_o < I
    acc_g = tl.zeros((BO, BKC), dtype=tl.float32)
    acc_u = tl.zeros((BO, BKC), dtype=tl.float32)
    xr = x_ptr + n * D
    if PRMT:  # unmasked loads from rows clamped into the matrix (rows past I are dropped at the store)
        rows = tl.where(mask_o, offs_o, 0)
        glo, ghi = prmt_tab(a1_ptr + e * stride_ae, rows, stride_ao, 0)
        ulo, uhi = prmt_tab(a3_ptr + e * stride_ae, rows, stride_ao, 0)
    for k0 in range(0, D, BKC * C):
        if PRMT:  # x_ptr: x as prmt_pairs [N, 8, D/16] int32; a*_ptr: fp16 tables viewed as int32
            if G > 1:
                glo, ghi = prmt_tab(a1_ptr + e * stride_ae, rows, stride_ao, k0 // GS)
                ulo, uhi = prmt_tab(a3_ptr + e * stride_ae, rows, stride_ao, k0 // GS)
            acc_g, acc_u = gemv_prmt2(acc_g, acc_u, w1_ptr + e * stride_we, glo, ghi, w3_ptr + e * stride_we,
                                      ulo, uhi, x_ptr + n * (D // 2), rows, stride_wo, k0, D // 16, BKC)
        elif FP4H:  # x_ptr: x as fp4_pairs [N, 16, D/32] int32
            acc_g, acc_u = gemv_fp4h2(acc_g, acc_u, w1_ptr + e * stride_we, a1_ptr + e * stride_ae,
                                      w3_ptr + e * stride_we, a3_ptr + e * stride_ae, x_ptr + n * (D // 2), offs_o,
                                      mask_o, stride_wo, stride_ao, k0, D, GS, BKC)
        elif WORDS and MODE == 5:
            acc_g, acc_u = gemv_fp4_words2(acc_g, acc_u, w1_ptr + e * stride_we, a1_ptr + e * stride_ae,
                                           w3_ptr + e * stride_we, a3_ptr + e * stride_ae, xr, offs_o, mask_o,
                                           stride_wo, stride_ao, k0, D, GS, BKC)
        elif WORDS:
            acc_g, acc_u = gemv_words2(acc_g, acc_u, w1_ptr + e * stride_we, a1_ptr + e * stride_ae,
                                       b1_ptr + e * stride_ae, w3_ptr + e * stride_we, a3_ptr + e * stride_ae,
                                       b3_ptr + e * stride_ae, xr, offs_o, mask_o, stride_wo, stride_ao, k0, D,
                                       BITS, G, GS, BKC, POLY)
        else:
            acc_g = gemv_chunks(acc_g, w1_ptr + e * stride_we, a1_ptr + e * stride_ae, b1_ptr + e * stride_ae, xr,
                                offs_o, mask_o, stride_wo, stride_ao, k0, D, MODE, BITS, C, BPC, G, GS, BKC, VD, VQF,
                                ASM)
            acc_u = gemv_chunks(acc_u, w3_ptr + e * stride_we, a3_ptr + e * stride_ae, b3_ptr + e * stride_ae, xr,
                                offs_o, mask_o, stride_wo, stride_ao, k0, D, MODE, BITS, C, BPC, G, GS, BKC, VD, VQF,
                                ASM)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if FP4H:  # the e4m3 bytes hold e2m1 · 2^-6
        g *= FP4H_SCALE
        u *= FP4H_SCALE
    if MODE == 2 or MODE == 6:  # fp8, tcq: per-row scales commute with the row sum
        g *= tl.load(a1_ptr + e * stride_ae + offs_o, mask=mask_o, other=0.0)
        u *= tl.load(a3_ptr + e * stride_ae + offs_o, mask=mask_o, other=0.0)
    if MODE == 4:  # vq: row scales [E, I] (b), likewise after the sum
        g *= tl.load(b1_ptr + e * I + offs_o, mask=mask_o, other=0.0).to(tl.float32)
        u *= tl.load(b3_ptr + e * I + offs_o, mask=mask_o, other=0.0).to(tl.float32)
    if HAS_BIAS:  # the experts' biases [E, I] as stored (the model dtype), added in fp32
        g += tl.load(bg_ptr + e * I + offs_o, mask=mask_o, other=0.0).to(tl.float32)
        u += tl.load(bu_ptr + e * I + offs_o, mask=mask_o, other=0.0).to(tl.float32)
    wt = tl.load(wts_ptr + t).to(tl.float32)
    h = gated_act(g, u, ACT, LIMIT) * wt  # weight · act(gate, up)
    if PRMT:  # h as fp16 in prmt_pairs order for the down GEMV: input 16cw + 8q + 4half + j -> pair 2j + q
        r = offs_o % 16
        pos = ((2 * (r % 4) + r // 8) * (I // 16) + offs_o // 16) * 2 + (r // 4) % 2
        tl.store(h_ptr + t * I + pos, h.to(tl.float16), mask=mask_o)
    elif FP4H:  # h as fp16 in fp4_pairs order for the down GEMV
        p, c, hh = fp4_pair_slot(offs_o)
        tl.store(h_ptr + t * I + (p * (I // 32) + c) * 2 + hh, h.to(tl.float16), mask=mask_o)
    else:
        tl.store(h_ptr + t * I + offs_o, h, mask=mask_o)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, w2_ptr, a2_ptr, b2_ptr, out_ptr, wts_ptr, bd_ptr,
                 D, stride_we, stride_wo, stride_ae, stride_ao,
                 I: tl.constexpr, A: tl.constexpr, PER: tl.constexpr, SPLIT: tl.constexpr,
                 MODE: tl.constexpr, BITS: tl.constexpr, C: tl.constexpr, BPC: tl.constexpr,
                 G: tl.constexpr, GS: tl.constexpr, BO: tl.constexpr, BKC: tl.constexpr, WORDS: tl.constexpr,
                 POLY: tl.constexpr, PRMT: tl.constexpr = False, VD: tl.constexpr = 1, VQF: tl.constexpr = 0,
                 HAS_BIAS: tl.constexpr = False, ASM: tl.constexpr = False, AP: tl.constexpr = 0,
                 PDL: tl.constexpr = False, FP4H: tl.constexpr = False):
    """Program (n, output block, z): token n's slots [a0, a0 + AP) (AP: a divisor of A; 0: all A) over inputs
    [k_start, k_start + PER), z = (a0 / AP)·SPLIT + k_start / PER; several programs a row add with fp32 atomics."""
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    n = tl.program_id(0)
    offs_o = tl.program_id(1) * BO + tl.arange(0, BO)
    mask_o = offs_o < D
    SLOTS: tl.constexpr = A if AP == 0 else AP
    z = tl.program_id(2)
    k_start = (z % SPLIT) * PER
    a0 = (z // SPLIT) * SLOTS
    y = tl.zeros((BO,), dtype=tl.float32)
    # h carries the routing weights, so where no per-expert row scale follows the sum (hls, rtn, fp4) every slot
    # adds into one accumulator, reduced once: a cross-warp sum a slot was a shared-memory round trip and a
    # barrier each, which also kept the next slot's loads from issuing before it
    ROW_SCALED: tl.constexpr = MODE == 2 or MODE == 4 or MODE == 6
    acc = tl.zeros((BO, BKC), dtype=tl.float32)
    for a in tl.static_range(SLOTS):  # unrolled: the slots' loads overlap (results/moe_down_unroll_ab_h100.json)
        t = n * A + a0 + a
        e = tl.load(ids_ptr + t).to(tl.int64)
        if ROW_SCALED:
            acc = tl.zeros((BO, BKC), dtype=tl.float32)
        if PRMT:  # unmasked loads from rows clamped into the matrix (rows past D are dropped at the store)
            rows = tl.where(mask_o, offs_o, 0)
            tlo, thi = prmt_tab(a2_ptr + e * stride_ae, rows, stride_ao, k_start // GS)
        for kk in range(0, PER, BKC * C):
            if PRMT:  # h_ptr: fp16 h in prmt_pairs order viewed as int32 [T, 8, I/16]
                if G > 1:
                    tlo, thi = prmt_tab(a2_ptr + e * stride_ae, rows, stride_ao, (k_start + kk) // GS)
                acc = gemv_prmt(acc, w2_ptr + e * stride_we, tlo, thi, h_ptr + t * (I // 2), rows, stride_wo,
                                k_start + kk, I // 16, BKC)
            elif FP4H:  # h_ptr: fp16 h in fp4_pairs order viewed as int32 [T, 16, I/32]
                acc = gemv_fp4h(acc, w2_ptr + e * stride_we, a2_ptr + e * stride_ae, h_ptr + t * (I // 2), offs_o,
                                mask_o, stride_wo, stride_ao, k_start + kk, I, GS, BKC)
            elif WORDS and MODE == 5:
                acc = gemv_fp4_words(acc, w2_ptr + e * stride_we, a2_ptr + e * stride_ae, h_ptr + t * I, offs_o,
                                     mask_o, stride_wo, stride_ao, k_start + kk, I, GS, BKC)
            elif WORDS:
                acc = gemv_words(acc, w2_ptr + e * stride_we, a2_ptr + e * stride_ae, b2_ptr + e * stride_ae,
                                 h_ptr + t * I, offs_o, mask_o, stride_wo, stride_ao, k_start + kk, I,
                                 BITS, G, GS, BKC, POLY)
            else:
                acc = gemv_chunks(acc, w2_ptr + e * stride_we, a2_ptr + e * stride_ae, b2_ptr + e * stride_ae,
                                  h_ptr + t * I, offs_o, mask_o, stride_wo, stride_ao, k_start + kk, I,
                                  MODE, BITS, C, BPC, G, GS, BKC, VD, VQF, ASM)
        if ROW_SCALED:
            r = tl.sum(acc, axis=1)
            if MODE == 2 or MODE == 6:
                r *= tl.load(a2_ptr + e * stride_ae + offs_o, mask=mask_o, other=0.0)
            if MODE == 4:
                r *= tl.load(b2_ptr + e * D + offs_o, mask=mask_o, other=0.0).to(tl.float32)
            y += r
        if HAS_BIAS:  # h carries the routing weight, the bias [E, D] does not: weight · b2[e], once (split 0)
            wt = tl.load(wts_ptr + t).to(tl.float32)
            y += tl.where(k_start == 0, wt, 0.0) * tl.load(bd_ptr + e * D + offs_o, mask=mask_o, other=0.0).to(
                tl.float32)
    if not ROW_SCALED:
        if FP4H:
            y += tl.sum(acc, axis=1) * FP4H_SCALE
        else:
            y += tl.sum(acc, axis=1)
    if SPLIT == 1 and SLOTS == A:
        tl.store(out_ptr + n * D + offs_o, y.to(out_ptr.dtype.element_ty), mask=mask_o)
    else:
        tl.atomic_add(out_ptr + n * D + offs_o, y, mask=mask_o)


def _static(w: QWeight, block_k: int, words: bool | None, poly: bool | None = None, prmt: bool = False,
            vq_gather: bool = False) -> dict:
    if w.mode == MODE_VQ:  # words=False: the byte-code variant (else word chunks where rows allow)
        st = vq_static(w, block_k, words is not False, vq_gather)
        bk = st.pop("BK")
        return st | dict(BKC=bk // st["C"], WORDS=False, POLY=False, PRMT=False, ASM=False)
    # fp4 (mxfp4 / nvfp4): int32 words of 8 codes, a block scale a chunk (dequant.gemv_fp4_words) unless turned off
    fp4_words = words is not False and use_fp4_words(w)
    words = fp4_words or (use_words(w) if words is None else words and use_words(w))
    poly = words and w.bits == 2 and w.b is not None and poly is not False and not prmt  # tables with cubics
    C, BPC = (16, 4) if prmt else (32, 4 * w.bits) if words else codes_per_chunk(w.mode, w.bits)
    G = w.groups
    bk = pick_block_k(w.n_in, w.tile_group, block_k, C)
    return dict(MODE=w.mode, BITS=w.bits, C=C, BPC=BPC, G=G, GS=w.n_in // G, BKC=bk // C, WORDS=words,
                POLY=poly, PRMT=prmt, VD=1, VQF=0, ASM=tcq_asm(w))


def least_padding_block(n: int, cap: int, floor: int = 512) -> int:
    """The power-of-two tile in [floor, cap] that pads n inputs the least (the largest on a tie). GLM-4.5-Air's
    and DeepSeek-V2-Lite's 1408 expert inputs fill a 2048 tile (or two of 1024) to 69%, three of 512 to 92%;
    smaller tiles where nothing is padded only add loop trips."""
    best, bk = cap, cap
    while bk >= floor:
        if triton.cdiv(n, bk) * bk < triton.cdiv(n, best) * best:
            best = bk
        bk //= 2
    return best


_PRMT_FAILED: list[str] = []  # set when the prmt kernels fail to compile here: the auto choice then falls back
_FP4H_FAILED: list[str] = []  # likewise for the fp4 fp16x2 kernels


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: QWeight, w3: QWeight,
               w2: QWeight, block_o: int | None = None, block_k: int | None = None, num_warps: int | None = None,
               block_o_down: int | None = None, block_k_down: int | None = None, split: int | None = None,
               words: bool | None = None, poly: bool | None = None, prmt: bool | None = None,
               out_dtype: torch.dtype | None = torch.float32, num_stages: int | None = None,
               num_warps_down: int | None = None, num_stages_down: int | None = None,
               h_rotate=None, vq_gather: bool = False, biases=None, act: str = "silu",
               limit: float = 7.0, split_experts: int | None = None, fp4h: bool | None = None) -> torch.Tensor:
    """Fused MoE for few tokens. x [N, D]; ids, weights [N, A]; w1, w3 [E, I, D] and w2 [E, D, I] as
    QWeight (all of one mode, w1 and w3 of one width). Returns out [N, D] in out_dtype; None: x's dtype where the
    down GEMV writes each output once, its fp32 accumulator where it splits the inputs (no cast launch: the caller
    rounds, as the fused step's add_rms_norm does). vq: word chunks by
    default (codebook gathers through L1), vq_gather=True their tl.gather variant, words=False the byte-code GEMV. prmt
    (default: where it applies, i.e. CUDA 2-bit fp16 tables in the word layout and words not turned off):
    the PTX prmt lookup with fp16x2 products (dequant.gemv_prmt); False: the previous select-tree / cubic
    path. h_rotate: a function applied to the intermediate h [T, I] fp32 between the two launches (the
    incoherence rotation of w2's inputs, runtime/experts.py; it takes the non-prmt path, whose h is fp32
    in natural order). biases: (b1, b3 [E, I], b2 [E, D]) added to gate, up and down (b2 times the routing
    weight); act: the gated activation ("silu" or gpt-oss's "clamped_swiglu" at `limit`). split_experts: the down
    GEMV's slots of a token in that many programs (a divisor of A; default: 1 where the grid fills the SMs twice, else
    the fewest that give it 8 programs an SM: at batch 1 DeepSeek-V2-Lite's and Qwen3's down grid would run under one
    program an SM, gpt-oss's and GLM-4.5-Air's under two, each through all A experts). fp4h (mxfp4 / nvfp4 experts):
    the fp16x2 kernels of fp4_h2.py (x and h as fp16 pairs); None: where fp4_h2.use_fp4h says (MOEC_FP4H, else its
    ON_BY_DEFAULT), falling back to the fp32 word path if they fail to compile."""
    N, D, A, E, I = check_moe_args(x, ids, weights, w1, w3, w2)
    x_dtype = x.dtype  # out_dtype None's dtype where the down GEMV writes each output once (prmt_pairs changes x)
    # x in its own dtype: every GEMV path converts its loads to fp32 (and prmt_pairs rounds to fp16, which
    # bf16 -> fp16 does exactly as bf16 -> fp32 -> fp16); an fp32 copy first was one more kernel per layer
    x = x.contiguous() if x.dtype in (torch.float16, torch.bfloat16, torch.float32) else x.float().contiguous()
    ids = ids.to(torch.int32).contiguous()
    weights = weights.float().contiguous()
    T = N * A
    can = words is not False and all(use_prmt(w) for w in (w1, w3, w2)) and I % 16 == 0 and h_rotate is None
    if prmt is None:  # the default: prmt where it applies, unless it failed to compile on this machine
        if can and not _PRMT_FAILED:
            try:
                return moe_decode(x, ids, weights, w1, w3, w2, block_o, block_k, num_warps, block_o_down,
                                  block_k_down, split, words, poly, True, out_dtype, num_stages, num_warps_down,
                                  num_stages_down, biases=biases, act=act, limit=limit,
                                  split_experts=split_experts)
            except triton.TritonError as ex:  # inline PTX refused (compile or ptxas error): keep the portable path
                _PRMT_FAILED.append(f"{type(ex).__name__}: {str(ex)[:200]}")
                log.warning("prmt MoE decode kernels failed to compile, using the select path: %s", _PRMT_FAILED[0])
        prmt = False
    prmt = prmt and can
    # fp4 experts: fp16x2 products through e4m3 conversions (fp4_h2.py) where the GPU has them
    if fp4h is None:
        if (not prmt and words is not False and h_rotate is None and not _FP4H_FAILED
                and all(use_fp4h(w) for w in (w1, w3, w2))):
            try:
                return moe_decode(x, ids, weights, w1, w3, w2, block_o, block_k, num_warps, block_o_down,
                                  block_k_down, split, words, poly, False, out_dtype, num_stages, num_warps_down,
                                  num_stages_down, biases=biases, act=act, limit=limit,
                                  split_experts=split_experts, fp4h=True)
            except triton.TritonError as ex:  # the conversion refused by ptxas: keep the fp32 word path
                _FP4H_FAILED.append(f"{type(ex).__name__}: {str(ex)[:200]}")
                log.warning("fp4 fp16x2 MoE decode kernels failed to compile, using the word path: %s",
                            _FP4H_FAILED[0])
        fp4h = False
    # launch settings: the caller's, else the swept prmt defaults (DECODE_CONFIG), else the earlier ones
    configs, sms = launch_config.config("moe_decode", x.device), launch_config.num_sms(x.device)
    cfg = configs[config_name(prmt, w1.mode)]
    wide = T * triton.cdiv(I, 32) >= 4 * sms  # 32-row gate/up programs still fill every SM several times
    if w1.mode == MODE_DENSE:
        wide16 = T * triton.cdiv(I, 16) >= 4 * sms
        cfg = configs["dense"] | {"block_o": 16 if wide16 else 8, "num_warps": 4 if wide16 else 8, "num_stages": None,
                              "num_warps_down": 4 if wide16 else 8, "num_stages_down": None}
    block_o = block_o or cfg["block_o"] or (32 if wide else 16)
    block_k = block_k or cfg["block_k"]
    block_o_down = block_o_down or cfg["block_o_down"]
    if block_k_down is None:
        block_k_down = cfg["block_k_down"]
        # the config's tile is a ceiling: the down GEMV's inputs (I) padded to it waste masked lanes. bf16 experts:
        # where the dense config's least_padding says (MOEC_DENSE_LEAST_PADDING=0/1: the A/B; DeepSeek-V2-Lite's and
        # GLM-4.5-Air's 1408 inputs take three 512 tiles instead of two of 1024)
        dense_pad = w1.mode == MODE_DENSE and os.environ.get(
            "MOEC_DENSE_LEAST_PADDING", "1" if cfg.get("least_padding") else "0") == "1"
        if prmt or dense_pad:
            block_k_down = least_padding_block(I, block_k_down)
    num_warps = num_warps or cfg["num_warps"] or (4 if wide else 8)
    num_stages = num_stages or cfg["num_stages"]
    num_warps_down = num_warps_down or cfg["num_warps_down"] or num_warps
    num_stages_down = num_stages_down or cfg["num_stages_down"]
    launch1 = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages else {})
    launch2 = {"num_warps": num_warps_down} | ({"num_stages": num_stages_down} if num_stages_down else {})
    s1 = _static(w1, block_k, words, poly, prmt, vq_gather)
    s2 = _static(w2, block_k_down, words, poly, prmt, vq_gather)
    h = torch.empty(T, I, dtype=torch.float16 if prmt or fp4h else torch.float32, device=x.device)
    (d1, a1, b1), (d3, a3, b3) = w1.ptrs(), w3.ptrs()
    if s1["WORDS"]:
        d1, d3 = d1.view(torch.int32), d3.view(torch.int32)
    if s1["VQF"]:  # int32 code words, codebook in words of d fp16
        (d1, a1), (d3, a3) = w1.vq_views(), w3.vq_views()
    if prmt:  # fp16 pairs in the prmt order; tables as two int32 per group
        x = prmt_pairs(x)  # [N, 8, D/16] int32
        a1, a3 = a1.view(torch.int32), a3.view(torch.int32)
    if fp4h:
        x = fp4_pairs(x)  # [N, 16, D/32] int32
    stride_ae1 = a1.stride(0) if w1.a is not None else 0
    row_a1 = a1.stride(1) if prmt else w1.row_stride_a()
    # the biases as stored (converted in the kernels: an fp32 copy here was three copy kernels a layer every step)
    bg, bu, bd = (weights,) * 3 if biases is None else (b.contiguous() for b in biases)
    extra = dict(HAS_BIAS=biases is not None, ACT=EXPERT_ACT_IDS[act], LIMIT=float(limit))
    bk2 = s2["BKC"] * s2["C"]
    n_d = triton.cdiv(D, block_o_down)
    if split is None:  # split I (fp32 atomics) until the grid has a few programs per SM; prmt: only below one
        split = max(1, min(triton.cdiv(I, 4 * bk2), (4 * sms) // max(1, N * n_d)))
        if prmt and N * n_d >= sms:
            split = 1
    per = triton.cdiv(triton.cdiv(I, split), bk2) * bk2
    split = triton.cdiv(I, per)
    if split_experts is None:  # below two waves: the fewest slot groups that give the down grid 8 programs an SM
        split_experts = 1 if N * n_d * split >= 2 * sms else next(
            (g for g in range(1, A + 1) if A % g == 0 and N * n_d * split * g >= 8 * sms), A)
    assert A % split_experts == 0, (A, split_experts)
    n_up = T * triton.cdiv(I, block_o)  # gate/up programs
    if split * split_experts == 1:
        out = torch.empty(N, D, dtype=out_dtype or x_dtype, device=x.device)
        zero = {}
    else:  # fp32 atomics into zeros: the gate/up launch writes them (it runs first)
        out = torch.empty(N, D, dtype=torch.float32, device=x.device)
        zero = dict(zero_ptr=out, n_zero=N * D, ZB=triton.next_power_of_2(triton.cdiv(N * D, n_up)))
    _gate_up_kernel[(T, triton.cdiv(I, block_o))](
        x, ids, weights, d1, a1, b1, d3, a3, b3, h, bg, bu, I,
        d1.stride(0), d1.stride(1), stride_ae1, row_a1,
        D=D, A=A, BO=block_o, **launch1, **s1, **extra, **zero, FP4H=fp4h, **pdl.options(x.device))
    if h_rotate is not None:
        h = h_rotate(h).contiguous()
    d2, a2, b2 = w2.ptrs()
    if s2["WORDS"]:
        d2 = d2.view(torch.int32)
    if s2["VQF"]:
        d2, a2 = w2.vq_views()
    if prmt:
        a2, h = a2.view(torch.int32), h.view(torch.int32)
    if fp4h:
        h = h.view(torch.int32)
    _down_kernel[(N, n_d, split * split_experts)](
        h, ids, d2, a2, b2, out, weights, bd, D, d2.stride(0), d2.stride(1), a2.stride(0) if w2.a is not None else 0,
        a2.stride(1) if prmt else w2.row_stride_a(), I=I, A=A, PER=per, SPLIT=split, BO=block_o_down,
        **launch2, **s2, HAS_BIAS=biases is not None, AP=A // split_experts, FP4H=fp4h, **pdl.options(x.device))
    return out if out_dtype is None else out.to(out_dtype)


def moe_decode_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: QWeight, w3: QWeight,
                   w2: QWeight, h_rotate=None, biases=None, act: str = "silu", limit: float = 7.0) -> torch.Tensor:
    """Plain-torch reference of `moe_decode` (same arguments), out [N, D] fp32."""
    W1, W3, W2 = dequant_ref(w1), dequant_ref(w3), dequant_ref(w2)
    xf = x.float()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for n in range(x.shape[0]):
        for a in range(ids.shape[1]):
            e = int(ids[n, a])
            h = gated_act_ref(W1[e] @ xf[n], W3[e] @ xf[n], biases, e, act, limit)
            if h_rotate is not None:
                h = h_rotate(h)
            y = W2[e] @ h
            out[n] += weights[n, a].float() * (y if biases is None else y + biases[2][e].float())
    return out


__all__ = ["DECODE_CONFIG", "MODE_FP8", "moe_decode", "moe_decode_ref"]
