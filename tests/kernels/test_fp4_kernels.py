"""MODE_FP4 (mxfp4 / nvfp4: e2m1 codes × an fp32 scale per block, kernels/dequant.py) in the fused kernels
against their torch references: the MoE decode GEMV, the grouped prefill GEMM and the quantized linear
(GEMV and GEMM), with tiles wider than a block (a tile reads each chunk's own block scale); and the kernels'
reference against the runtime's (runtime/fp4.py). CPU: Triton's interpreter at toy shapes."""

import os

import torch

if not torch.cuda.is_available():  # the CPU runs the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.kernels.dequant import dequant_ref, use_fp4_words  # noqa: E402
from moec.kernels.moe_decode import moe_decode, moe_decode_ref  # noqa: E402
from moec.kernels.moe_prefill import moe_grouped, moe_grouped_ref  # noqa: E402
from moec.kernels.qlinear import qlinear, qlinear_ref  # noqa: E402
from moec.runtime import fp4  # noqa: E402
from tests.kernels.moe_cases import moe_case, qweight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_kernel_reference_is_the_runtime_dequant(kind):
    """dequant_ref (MODE_FP4, the kernels' reference) == runtime/fp4.held_dequantize bit for bit, every code;
    the codec's registered kernel mode is this one (moec/codecs may not import the kernels)."""
    from moec.kernels.dequant import MODE_FP4
    from moec.registry import weight_codec

    assert weight_codec(kind).kernel_mode == MODE_FP4
    w = qweight(kind, 2, 8, 64, 0, torch.Generator().manual_seed(1), "cpu")
    held = {"codes": w.data, "scale": w.a}
    assert torch.equal(dequant_ref(w), fp4.held_dequantize(4, (2, 8, 64), held))
    codes = torch.arange(16).repeat(4)[None, None]  # each code once per 16 inputs
    from moec.formats import bitpack

    v = fp4.held_dequantize(4, (1, 1, 64), {"codes": bitpack.pack(codes, 4), "scale": torch.ones(1, 1, 4)})
    assert torch.equal(v[0, 0, :16], fp4.E2M1) and torch.equal(v[0, 0, 8:9].signbit(), torch.tensor([True]))


@pytest.mark.parametrize("kind,N,A,E,D,I", [("mxfp4", 1, 2, 3, 64, 32), ("nvfp4", 2, 2, 4, 32, 48)])
def test_moe_decode_fp4(kind, N, A, E, D, I):
    x, ids, wts, w1, w3, w2 = moe_case(kind, N, A, E, D, I, 0, 0, DEVICE, seed=N + D)
    got = moe_decode(x, ids, wts, w1, w3, w2, block_o=32, block_k=64, block_o_down=32, block_k_down=64, prmt=False)
    want = moe_decode_ref(x, ids, wts, w1, w3, w2)
    # fp32 everywhere (the decoded weights are exact); only the summation order differs
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item() + 1e-6


@pytest.mark.parametrize("kind,D,I,block_k,split", [("mxfp4", 96, 64, 64, 1), ("nvfp4", 64, 96, 32, 2),
                                                     ("mxfp4", 128, 96, 64, 3)])
def test_moe_decode_fp4_words_match_bytes(kind, D, I, block_k, split):
    """The word path (int32 words of 8 codes, a chunk's block scale loaded once: dequant.gemv_fp4_words, the
    default where rows hold whole 32-input chunks) against the reference and the byte path (words=False): tiles
    spanning blocks, a masked tail chunk (96 inputs in 64-input tiles), nvfp4's two scales a chunk, the down
    GEMV's inputs split over programs."""
    x, ids, wts, w1, w3, w2 = moe_case(kind, 2, 2, 4, D, I, 0, 0, DEVICE, seed=D + I)
    assert use_fp4_words(w1) and use_fp4_words(w2) and w1.n_in // w1.groups == (32 if kind == "mxfp4" else 16)
    kw = dict(block_o=32, block_k=block_k, block_o_down=32, block_k_down=block_k, prmt=False, split=split)
    got = moe_decode(x, ids, wts, w1, w3, w2, **kw)
    old = moe_decode(x, ids, wts, w1, w3, w2, words=False, **kw)
    want = moe_decode_ref(x, ids, wts, w1, w3, w2)
    tol = 1e-4 * want.abs().max().item() + 1e-6
    assert (got - want).abs().max().item() <= tol and (old - want).abs().max().item() <= tol


def test_moe_grouped_fp4():
    """nvfp4 with 32-input tiles: each tile spans two 16-input blocks."""
    x, ids, wts, w1, w3, w2 = moe_case("nvfp4", 5, 2, 3, 32, 32, 0, 0, DEVICE, seed=3)
    got = moe_grouped(x, ids, wts, w1, w3, w2, block_m=16, block_n=32, block_k=32, num_warps=4)
    want = moe_grouped_ref(x, ids, wts, w1, w3, w2)
    # h is stored bf16 (and the CUDA dot runs on bf16 operands): ~1e-2 of the output scale
    assert (got.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@pytest.mark.parametrize("kind,M,half", [("nvfp4", 1, True), ("mxfp4", 1, False), ("nvfp4", 19, True)])
def test_qlinear_fp4(kind, M, half):
    """half: block scales held in fp16 (runtime/fp4.py does where they are all fp16 values)."""
    g = torch.Generator().manual_seed(M)
    w = qweight(kind, 1, 24, 64, 0, g, DEVICE)
    if half:
        w = w._replace(a=w.a.half())
    x = torch.randn(M, 64, generator=g).to(DEVICE)
    cfg = dict(block_m=16, block_n=16, block_k=32, num_warps=4) if M > 1 else {}
    got = qlinear(x, w, None, **cfg)
    want = qlinear_ref(x, w)
    tol = (1e-4 if M == 1 else 2e-2) * want.abs().max().item()  # GEMM: bf16 operands on CUDA
    assert (got.float() - want).abs().max().item() <= tol


def test_fp4_word_kernels_compile_without_spills():
    """gpt-oss-120b's mxfp4 experts (2880 x 2880, top-4, blocks of 32) on the word path, compiled for sm_90 (CPU):
    no stack, few registers, no compare-and-select decode (the byte path's gate/up build held 255 registers and
    spilled 432 bytes of stack at the legacy launch)."""
    from moec.kernels import aot

    gu = {n: "*fp32" for n in ("x_ptr", "wts_ptr", "h_ptr", "bg_ptr", "bu_ptr", "a1_ptr", "b1_ptr", "a3_ptr",
                               "b3_ptr", "zero_ptr")} | {"ids_ptr": "*i32", "w1_ptr": "*i32", "w3_ptr": "*i32"} | {
        n: "i32" for n in ("I", "stride_we", "stride_wo", "stride_ae", "stride_ao", "n_zero")}
    down = {n: "*fp32" for n in ("h_ptr", "a2_ptr", "b2_ptr", "out_ptr", "wts_ptr", "bd_ptr")} | {
        "ids_ptr": "*i32", "w2_ptr": "*i32"} | {n: "i32" for n in ("D", "stride_we", "stride_wo", "stride_ae",
                                                                   "stride_ao")}
    fp4 = dict(MODE=5, BITS=4, C=32, BPC=16, G=90, GS=32, BO=16, BKC=32, WORDS=True, POLY=False, HAS_BIAS=True)
    jobs = [{"module": "moec.kernels.moe_decode", "kernel": "_gate_up_kernel", "types": gu,
             "constexprs": fp4 | dict(D=2880, A=4, ACT=1), "num_warps": 8},
            {"module": "moec.kernels.moe_decode", "kernel": "_down_kernel", "types": down,
             "constexprs": fp4 | dict(I=2880, A=4, PER=3072, SPLIT=1), "num_warps": 8}]
    for job, rep in zip(jobs, aot.report_in_subprocess(jobs), strict=True):
        res, ops = rep["resources"], rep["opcodes"]
        assert res["stack"] == 0 and res["local"] == 0 and res["registers"] <= 96, (job["kernel"], res)
        assert ops.get("FSEL", 0) + ops.get("SEL", 0) == 0 and ops.get("ISETP", 0) <= 32, (job["kernel"], ops)
