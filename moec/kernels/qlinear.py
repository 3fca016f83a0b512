"""Quantized linear layer (attention projections): y = x Wᵀ (+ bias), W dequantized in registers.

Shape legend: M = rows of x (tokens), K = inputs, O = outputs, BO/BK/BM = tile sizes.

W is a `dequant.QWeight` with E = 1: group-wise 4-bit codes with affine levels (rtn: zero + scale·idx)
or a 16-entry table (hls), any other bit width of those codecs, fp8, vector codebooks (vq: row scales
applied to the output like fp8's), or plain bf16 (the peer).
  - M ≤ GEMV_MAX_M (decode): `_gemv_kernel`, one program per (row of x, block of BO outputs), CUDA
    cores, fp32 register tile reduced once at the end.
  - larger M: `_gemm_kernel`, one program per (BM rows, BN outputs), tiles dequantized to bf16 and
    tl.dot (dequant.dequant_tile).
`qlinear_ref` is the plain-torch reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import launch_config, pdl
from .dequant import (
    MODE_DENSE,
    MODE_TCQ,
    MODE_VQ,
    TCQ_MAX_STAGES,
    QWeight,
    codes_per_chunk,
    dequant_ref,
    dequant_tile,
    gemv_chunks,
    load_x,
    pick_block_k,
    tcq_asm,
    vq_static,
)
from .moe_prefill import dot_dtype
from .pdl import begin as pdl_begin
from .route_topk import _sigmoid_rank_row, _topk_rank_row

GEMV_MAX_M = 8
# Launch settings, from configs/<device>.json (launch_config; the names below are the defaults, tuned on
# the H200). gemv, decode (M <= GEMV_MAX_M; benchmarks/sweep_qlinear.py, results/qlinear_sweep2_h200.json):
# 4 rows, 8 warps, 4 group tiles per loop step; block_k is capped by the group size (pick_block_k).
# gemm (M > 64) and small_gemm (M <= 64): the tiles of moe_prefill.
_CFG = launch_config.defaults()["qlinear"]
GEMV_CONFIG, GEMM_CONFIG, SMALL_GEMM_CONFIG = _CFG["gemv"], _CFG["gemm"], _CFG["small_gemm"]


@triton.jit
def _weights_before_wait(w_ptr, stride_wo, O, BO: tl.constexpr, KP: tl.constexpr, K: tl.constexpr,
                         EARLY: tl.constexpr):
    """EARLY: this program's BO weight rows as one [BO, KP] tile (MODE_DENSE, KP >= K), loaded before the PDL wait:
    no kernel of the decode step writes weights, so their DRAM reads may overlap the predecessor's tail instead of
    starting after it (the wait still comes before x, the bias and every store). Else nothing is loaded."""
    if EARLY:
        offs_o = tl.program_id(1) * BO + tl.arange(0, BO)
        k = tl.arange(0, KP)
        return tl.load(w_ptr + offs_o[:, None] * stride_wo + k[None, :], mask=(offs_o < O)[:, None] & (k < K)[None, :],
                       other=0.0)
    else:
        return 0.0


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, a_ptr, b_ptr, bias_ptr, y_ptr, O, stride_xm, stride_wo, stride_ao,
                 K: tl.constexpr, HAS_BIAS: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr,
                 C: tl.constexpr, BPC: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
                 BO: tl.constexpr, BKC: tl.constexpr, UNROLL: tl.constexpr, VD: tl.constexpr = 1,
                 VQF: tl.constexpr = 0, ASM: tl.constexpr = False, PDL: tl.constexpr = False,
                 GATED: tl.constexpr = False, EARLY: tl.constexpr = False, KP: tl.constexpr = 1,
                 ROUTE: tl.constexpr = 0, RE: tl.constexpr = 0, RE_P2: tl.constexpr = 1, RA: tl.constexpr = 1,
                 RNORM: tl.constexpr = False, RBIAS: tl.constexpr = False, rscale=1.0, count_ptr=None, rw_ptr=None,
                 rids_ptr=None, rb_ptr=None):
    # EARLY: the program's weight rows loaded ahead of the PDL wait (_weights_before_wait), then nothing read or
    # written before the predecessor's writes are visible
    w_early = _weights_before_wait(w_ptr, stride_wo, O, BO, KP, K, EARLY)
    pdl_begin(PDL)
    m = tl.program_id(0)
    offs_o = tl.program_id(1) * BO + tl.arange(0, BO)
    mask_o = offs_o < O
    if EARLY:  # MODE_DENSE, the whole row in one [BO, KP] tile
        x = load_x(x_ptr + m * stride_xm, tl.arange(0, KP), K, GATED)
        y = tl.sum(w_early.to(tl.float32) * x[None, :], axis=1)
    else:
        acc = tl.zeros((BO, BKC), dtype=tl.float32)
        # a tile never straddles a quantization group (pick_block_k: <= 128 inputs at group 128), so at K = 4096
        # the loop is 32 dependent steps of ~1 KB each; UNROLL tiles per step put more loads in flight
        for k0 in range(0, K, BKC * C * UNROLL):
            for u in tl.static_range(UNROLL):
                acc = gemv_chunks(acc, w_ptr, a_ptr, b_ptr, x_ptr + m * stride_xm, offs_o, mask_o, stride_wo,
                                  stride_ao, k0 + u * BKC * C, K, MODE, BITS, C, BPC, G, GS, BKC, VD, VQF, ASM, GATED)
        y = tl.sum(acc, axis=1)
    if MODE == 2 or MODE == 6:
        y *= tl.load(a_ptr + offs_o, mask=mask_o, other=0.0)
    if MODE == 4:  # vq row scales (b)
        y *= tl.load(b_ptr + offs_o, mask=mask_o, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_o, mask=mask_o, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * O + offs_o, y.to(y_ptr.dtype.element_ty), mask=mask_o)
    if ROUTE > 0:  # outputs [0, RE) are router logits: the last of their programs to finish routes row m
        _route_epilogue(y_ptr + m * O, count_ptr + m, rw_ptr, rids_ptr, rb_ptr, m, rscale, BO, ROUTE, RE, RE_P2, RA,
                        RNORM, RBIAS)


@triton.jit
def _route_epilogue(logits_ptr, count_ptr, rw_ptr, rids_ptr, rb_ptr, m, rscale, BO: tl.constexpr,
                    ROUTE: tl.constexpr, RE: tl.constexpr, RE_P2: tl.constexpr, RA: tl.constexpr,
                    RNORM: tl.constexpr, RBIAS: tl.constexpr):
    """The routing kernels' work at the end of the router's GEMV (route_topk.py's ticket scheme, as route_gemv_topk):
    each program holding router rows takes a ticket once its logits are stored; the one taking the last reads all RE
    logits back (as stored, in the model dtype, as the routing kernel reads the router's output) and routes: ROUTE 1
    softmax then top RA (_topk_rank_row), 2 sigmoid scores with the correction bias, no groups (_sigmoid_rank_row);
    then it zeroes the counter for the next launch."""
    if tl.program_id(1) * BO < RE:
        tl.debug_barrier()  # every thread's logits are stored before the ticket is taken
        ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")
        if ticket == (RE + BO - 1) // BO - 1:  # the last router program: all logits are visible
            offs = tl.arange(0, RE_P2)
            rm = offs < RE
            z = tl.load(logits_ptr + offs, mask=rm, other=0.0, cache_modifier=".cg").to(tl.float32)
            if ROUTE == 1:
                _topk_rank_row(tl.where(rm, z, float("-inf")), offs, rm, rw_ptr, rids_ptr, m, RE_P2, RA, RNORM)
            else:
                _sigmoid_rank_row(z, offs, rm, rb_ptr, rw_ptr, rids_ptr, m, RE_P2, RA, RNORM, RBIAS, rscale)
            tl.atomic_xchg(count_ptr, 0, sem="relaxed")  # zeroed for the next launch


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, a_ptr, b_ptr, bias_ptr, y_ptr, M, O, stride_xm, stride_wo, stride_ao,
                 K: tl.constexpr, HAS_BIAS: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr,
                 C: tl.constexpr, BPC: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, VD: tl.constexpr = 1):
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < O
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                     mask=mask_m[:, None] & (k < K)[None, :], other=0.0).to(DOT)
        w = dequant_tile(w_ptr, a_ptr, b_ptr, offs_n, mask_n, stride_wo, stride_ao, k0, K,
                         MODE, BITS, C, BPC, G, GS, BK, DOT, VD)
        acc = tl.dot(xt, tl.trans(w), acc)
    if MODE == 2 or MODE == 6:
        acc *= tl.load(a_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if MODE == 4:
        acc *= tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * O + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def gluon_measured_faster(device) -> bool:
    """Whether this device's launch config sends 4-bit affine decode GEMVs to the Gluon kernel (gluon_qlinear.py):
    `gluon4` in the gemv settings, set where benchmarks/bench_gluon_qlinear.py measured it faster."""
    return bool(launch_config.config("qlinear", device)["gemv"].get("gluon4", False))


# the dense GEMV's weights loaded ahead of the PDL wait (_weights_before_wait): set by the decode step's A/B on the GPU
# (benchmarks/studies/fp4h_flip.py --decide-switches, MOEC_GEMV_EARLY=0/1)
EARLY_DEFAULT = True
EARLY_MAX_K = 4096  # a [BO, K] tile in registers: 4 rows of 4096 fp32 are 64 registers a thread at 8 warps


def early_weights(device, w: QWeight, K: int, M: int) -> bool:
    """Whether the decode GEMV loads its weights before the PDL wait: plain (MODE_DENSE) weights of at most
    EARLY_MAX_K inputs, one row of x (a program then reads its rows once), PDL on, MOEC_GEMV_EARLY (else
    EARLY_DEFAULT) on."""
    on = os.environ.get("MOEC_GEMV_EARLY", "1" if EARLY_DEFAULT else "0") == "1"
    return on and w.mode == MODE_DENSE and K <= EARLY_MAX_K and M == 1 and pdl.enabled(device)


ROUTE_MAX_EXPERTS = 128  # the routing epilogue's [E, E] rank comparison in one program: 64 registers a thread
_ROUTE_COUNTERS: dict = {}  # device -> int32 [GEMV_MAX_M]: the routing epilogue's tickets, zero between launches


def qlinear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None, gluon: bool = False,
            gated: bool = False, route: dict | None = None, **cfg):
    """x [..., K] -> [..., O] in x.dtype. w: QWeight with data [1, O, ...]. cfg overrides the block
    config of the path taken (the gemv or gemm keys of launch_config.config("qlinear", device)). gluon: decode
    rows (M <= 8) of the weights gluon_qlinear.supports take the Gluon GEMV (the caller decides: the runtime's
    MOEC_KERNELS switch and gluon_measured_faster). gated: x is a fused gate/up projection [..., 2K] and the `tl`
    GEMV reads silu(g)·u (fused_decode.silu_mul's numbers) in its loads; decode rows only (M <= GEMV_MAX_M), not vq
    (gated_ok), never the Gluon GEMV (its gated load was slower than silu_mul and the Gluon GEMV: results.md).
    route (decode rows, the `tl` GEMV): the first route["experts"] outputs are a MoE router's logits and the GEMV
    also routes each row (_route_epilogue): dict(experts, top_k, norm, kind "softmax" or "sigmoid", score_bias
    [E] or None, scale) -> (y, weights [M, top_k] fp32, ids [M, top_k] int32), the routing kernels' numbers
    (kernels/route_topk.py) without their launch. The ticket counter is made on the first call (before a capture)."""
    K = x.shape[-1] // 2 if gated else x.shape[-1]
    O = w.data.shape[1]
    assert w.n_in == K and w.data.shape[0] == 1, (w.n_in, w.data.shape, K)
    assert not gated or gated_ok(w, x.numel() // x.shape[-1]), (w.mode, x.shape)
    w.check(1, O)
    assert bias is None or bias.shape == (O,), (None if bias is None else bias.shape, O)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, O, dtype=x.dtype, device=x.device)
    d, a, b = w.ptrs()
    bias_arg = bias if bias is not None else d
    configs = launch_config.config("qlinear", x.device)
    assert route is None or (M <= GEMV_MAX_M and w.mode != MODE_VQ and 1 <= route["top_k"] <= route["experts"] <= O
                             and route["experts"] <= ROUTE_MAX_EXPERTS), (M, w.mode, route, O)
    if gluon and M <= GEMV_MAX_M and not gated and route is None:
        from . import gluon_qlinear as gq

        if gq.supports(w, M):
            c = configs["gemv"]
            return gq.gluon_qlinear(x2, w, bias, y, c["gluon_block_m"], c["gluon_warps"]).view(*lead, O)
    if M <= GEMV_MAX_M:
        c = configs["gemv"] | cfg
        if w.mode == MODE_VQ:  # cfg words=False: the byte-code variant, vq_gather=True: tl.gather (gemv_vq)
            st = vq_static(w, c["block_k"], c.get("words", True), c.get("vq_gather", False))
            bk, C = st.pop("BK"), st["C"]
            if st["VQF"]:
                d, a = w.vq_views()
        else:
            C, BPC = codes_per_chunk(w.mode, w.bits)
            G = w.groups
            st = dict(MODE=w.mode, BITS=w.bits, C=C, BPC=BPC, G=G, GS=K // G, ASM=tcq_asm(w))
            bk = pick_block_k(K, w.tile_group, c["block_k"], C)
        unroll = c.get("unroll", 1)
        while unroll > 1 and K % (bk * unroll):
            unroll //= 2
        early = early_weights(x.device, w, K, M)
        rt, routed = _route_args(route, M, x.device) if route is not None else ({}, None)
        _gemv_kernel[(M, triton.cdiv(O, c["block_o"]))](
            x2, d, a, b, bias_arg, y, O, x2.stride(0), d.stride(1), w.row_stride_a(), K=K,
            HAS_BIAS=bias is not None, BO=c["block_o"], BKC=bk // C, UNROLL=unroll, num_warps=c["num_warps"], **st,
            GATED=gated, EARLY=early, KP=triton.next_power_of_2(K) if early else 1, **rt, **pdl.options(x.device))
        if routed is not None:
            return (y.view(*lead, O), *routed)
    else:
        small = configs["small_gemm"] | cfg
        c = small if M <= 64 else configs["gemm"] | cfg
        key = (w.mode, w.bits, K, *c.values())
        if key in _BROKEN:
            c = small
        try:
            _gemm(x2, w, d, a, b, bias, bias_arg, y, c)
        except RuntimeError as ex:  # a Triton compile failure (first call of a config only)
            if "PassManager" not in str(ex) or c == small:
                raise
            _BROKEN.add(key)
            _gemm(x2, w, d, a, b, bias, bias_arg, y, small)
    return y.view(*lead, O)


def _route_args(route: dict, M: int, device) -> tuple[dict, tuple[torch.Tensor, torch.Tensor]]:
    """_gemv_kernel's routing epilogue arguments for qlinear's `route`, and its outputs (weights, ids)."""
    E, A = route["experts"], route["top_k"]
    count = _ROUTE_COUNTERS.get(device)
    if count is None:
        count = _ROUTE_COUNTERS[device] = torch.zeros(GEMV_MAX_M, dtype=torch.int32, device=device)
    wts = torch.empty(M, A, dtype=torch.float32, device=device)
    ids = torch.empty(M, A, dtype=torch.int32, device=device)
    sb = route.get("score_bias")
    assert route["kind"] in ("softmax", "sigmoid") and (sb is None or route["kind"] == "sigmoid"), route
    args = dict(ROUTE=1 if route["kind"] == "softmax" else 2, RE=E, RE_P2=triton.next_power_of_2(E), RA=A,
                RNORM=bool(route["norm"]), RBIAS=sb is not None, rscale=float(route.get("scale", 1.0)),
                count_ptr=count, rw_ptr=wts, rids_ptr=ids, rb_ptr=wts if sb is None else sb)
    return args, (wts, ids)


# GEMM configs whose compile failed: Triton 3.6's TritonGPUOptimizeDotOperands fails on the 3-bit table-dequant
# tile with BM >= 64 ("Illegal shared layout", sm_90; moe_prefill meets the same); they run the small config
_BROKEN: set = set()


def _gemm(x2, w: QWeight, d, a, b, bias, bias_arg, y, c: dict) -> None:
    """One _gemm_kernel launch of qlinear with block config c."""
    M, K = x2.shape
    O = y.shape[1]
    if w.mode == MODE_VQ:
        st = vq_static(w, c["block_k"], words=False)
        bk = st.pop("BK")
        del st["VQF"]
    else:
        C, BPC = codes_per_chunk(w.mode, w.bits)
        G = w.groups
        st = dict(MODE=w.mode, BITS=w.bits, C=C, BPC=BPC, G=G, GS=K // G)
        bk = pick_block_k(K, w.tile_group, c["block_k"], C)
    _gemm_kernel[(triton.cdiv(M, c["block_m"]), triton.cdiv(O, c["block_n"]))](
        x2, d, a, b, bias_arg, y, M, O, x2.stride(0), d.stride(1), w.row_stride_a(), K=K,
        HAS_BIAS=bias is not None, BM=c["block_m"], BN=c["block_n"], BK=bk, DOT=dot_dtype(),
        num_warps=c["num_warps"], num_stages=min(c["num_stages"], TCQ_MAX_STAGES) if w.mode == MODE_TCQ
        else c["num_stages"], **st)


def gated_ok(w: QWeight, M: int) -> bool:
    """Whether qlinear(gated=True) takes this weight at M rows: the `tl` decode GEMV, any mode but vq (its codebook
    GEMV loads x its own way)."""
    return M <= GEMV_MAX_M and w.mode != MODE_VQ


def qlinear_ref(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: fp32 x @ W_hatᵀ (+ bias)."""
    y = x.float() @ dequant_ref(w)[0].t()
    return y + bias.float() if bias is not None else y
