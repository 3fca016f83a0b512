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

import torch
import triton
import triton.language as tl

from . import launch_config, pdl
from .dequant import (
    MODE_TCQ,
    MODE_VQ,
    TCQ_MAX_STAGES,
    QWeight,
    codes_per_chunk,
    dequant_ref,
    dequant_tile,
    gemv_chunks,
    pick_block_k,
    tcq_asm,
    vq_static,
)
from .moe_prefill import dot_dtype
from .pdl import begin as pdl_begin

GEMV_MAX_M = 8
# Launch settings, from configs/<device>.json (launch_config; the names below are the defaults, tuned on
# the H200). gemv, decode (M <= GEMV_MAX_M; benchmarks/sweep_qlinear.py, results/qlinear_sweep2_h200.json):
# 4 rows, 8 warps, 4 group tiles per loop step; block_k is capped by the group size (pick_block_k).
# gemm (M > 64) and small_gemm (M <= 64): the tiles of moe_prefill.
_CFG = launch_config.defaults()["qlinear"]
GEMV_CONFIG, GEMM_CONFIG, SMALL_GEMM_CONFIG = _CFG["gemv"], _CFG["gemm"], _CFG["small_gemm"]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, a_ptr, b_ptr, bias_ptr, y_ptr, O, stride_xm, stride_wo, stride_ao,
                 K: tl.constexpr, HAS_BIAS: tl.constexpr, MODE: tl.constexpr, BITS: tl.constexpr,
                 C: tl.constexpr, BPC: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
                 BO: tl.constexpr, BKC: tl.constexpr, UNROLL: tl.constexpr, VD: tl.constexpr = 1,
                 VQF: tl.constexpr = 0, ASM: tl.constexpr = False, PDL: tl.constexpr = False,
                 GATED: tl.constexpr = False):
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    m = tl.program_id(0)
    offs_o = tl.program_id(1) * BO + tl.arange(0, BO)
    mask_o = offs_o < O
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


def qlinear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None, gluon: bool = False,
            gated: bool = False, **cfg) -> torch.Tensor:
    """x [..., K] -> [..., O] in x.dtype. w: QWeight with data [1, O, ...]. cfg overrides the block
    config of the path taken (the gemv or gemm keys of launch_config.config("qlinear", device)). gluon: decode
    rows (M <= 8) of the weights gluon_qlinear.supports take the Gluon GEMV (the caller decides: the runtime's
    MOEC_KERNELS switch and gluon_measured_faster). gated: x is a fused gate/up projection [..., 2K] and the `tl`
    GEMV reads silu(g)·u (fused_decode.silu_mul's numbers) in its loads; decode rows only (M <= GEMV_MAX_M), not vq
    (gated_ok), never the Gluon GEMV (its gated load was slower than silu_mul and the Gluon GEMV: results.md)."""
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
    if gluon and M <= GEMV_MAX_M and not gated:
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
        _gemv_kernel[(M, triton.cdiv(O, c["block_o"]))](
            x2, d, a, b, bias_arg, y, O, x2.stride(0), d.stride(1), w.row_stride_a(), K=K,
            HAS_BIAS=bias is not None, BO=c["block_o"], BKC=bk // C, UNROLL=unroll, num_warps=c["num_warps"], **st,
            GATED=gated, **pdl.options(x.device))
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
