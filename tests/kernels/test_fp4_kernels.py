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


def _gpt_oss_fp4_jobs(fp16x2: bool) -> list[dict]:
    """aot jobs: gpt-oss-120b's mxfp4 experts (2880 x 2880, top-4, blocks of 32), gate/up and down, 8 warps, on the
    fp32 word path or the fp16x2 one (x and h as fp16 pairs, viewed as int32 where the kernel reads them)."""
    gu = {n: "*fp32" for n in ("x_ptr", "wts_ptr", "h_ptr", "bg_ptr", "bu_ptr", "a1_ptr", "b1_ptr", "a3_ptr",
                               "b3_ptr", "zero_ptr")} | {"ids_ptr": "*i32", "w1_ptr": "*i32", "w3_ptr": "*i32"} | {
        n: "i32" for n in ("I", "stride_we", "stride_wo", "stride_ae", "stride_ao", "n_zero")}
    down = {n: "*fp32" for n in ("h_ptr", "a2_ptr", "b2_ptr", "out_ptr", "wts_ptr", "bd_ptr")} | {
        "ids_ptr": "*i32", "w2_ptr": "*i32"} | {n: "i32" for n in ("D", "stride_we", "stride_wo", "stride_ae",
                                                                   "stride_ao")}
    fp4 = dict(MODE=5, BITS=4, C=32, BPC=16, G=90, GS=32, BO=16, BKC=32, WORDS=True, POLY=False, HAS_BIAS=True)
    if fp16x2:
        gu |= {"x_ptr": "*i32", "h_ptr": "*fp16", "a1_ptr": "*fp16", "a3_ptr": "*fp16"}
        down |= {"h_ptr": "*i32", "a2_ptr": "*fp16"}
        fp4["FP4H"] = True
    return [{"module": "moec.kernels.moe_decode", "kernel": "_gate_up_kernel", "types": gu,
             "constexprs": fp4 | dict(D=2880, A=4, ACT=1), "num_warps": 8},
            {"module": "moec.kernels.moe_decode", "kernel": "_down_kernel", "types": down,
             "constexprs": fp4 | dict(I=2880, A=4, PER=3072, SPLIT=1), "num_warps": 8}]


def test_fp4_word_kernels_compile_without_spills():
    """gpt-oss-120b's mxfp4 experts on the word path, compiled for sm_90 (CPU):
    no stack, few registers, no compare-and-select decode (the byte path's gate/up build held 255 registers and
    spilled 432 bytes of stack at the legacy launch)."""
    from moec.kernels import aot

    jobs = _gpt_oss_fp4_jobs(False)
    for job, rep in zip(jobs, aot.report_in_subprocess(jobs), strict=True):
        res, ops = rep["resources"], rep["opcodes"]
        assert res["stack"] == 0 and res["local"] == 0 and res["registers"] <= 96, (job["kernel"], res)
        assert ops.get("FSEL", 0) + ops.get("SEL", 0) == 0 and ops.get("ISETP", 0) <= 32, (job["kernel"], ops)


# ---- the fp16x2 path (kernels/fp4_h2.py): its PTX runs only on a GPU (the smoke's fp4h-moe-decode checks); here the
# byte arithmetic replayed in torch, the pair order, the pairing kernel, and the sm_90 build


def test_fp4h_bytes_are_e2m1_over_64_every_code_every_nibble():
    """fp4h_decode_emulate (the PTX's shifts, masks and e4m3 -> fp16 conversions) gives e2m1(code) · 2^-6 exactly,
    signed zero included, for every code at every nibble, in the pair order fp4_pairs gives x."""
    from moec.formats import bitpack
    from moec.kernels.fp4_h2 import fp4_pairs_ref, fp4h_decode_emulate

    gen = torch.Generator().manual_seed(4)
    codes = torch.cat([torch.arange(16).repeat_interleave(32).view(16, 32),  # every code at every position
                       torch.randint(0, 16, (8, 32), generator=gen)])
    codes = torch.cat([codes, codes.roll(1, 0)], 1)  # [24, 64]: two chunks a row
    words = bitpack.pack(codes, 4).view(torch.int32).view(24, 2, 4)
    got = fp4h_decode_emulate(words)  # [24, 2, 16, 2]
    want = fp4.held_dequantize(4, (1, 24, 64), {"codes": bitpack.pack(codes, 4)[None], "scale": torch.ones(1, 24, 2)})
    want = fp4_pairs_ref(want[0] / 64).view(torch.float16).reshape(24, 16, 2, 2).transpose(1, 2)
    assert torch.equal(got.view(torch.int16), want.reshape(got.shape).view(torch.int16))


def test_fp4h_pairs_sum_to_the_gemv():
    """Decoded fp4h weights against fp4_pairs(x), summed, are W @ x / 64: the two permutations agree."""
    from moec.formats import bitpack
    from moec.kernels.fp4_h2 import fp4_pairs_ref, fp4h_decode_emulate

    gen = torch.Generator().manual_seed(6)
    O, n = 5, 160
    codes = torch.randint(0, 16, (O, n), generator=gen)
    x = torch.randn(n, generator=gen).half().float()
    wq = fp4h_decode_emulate(bitpack.pack(codes, 4).view(torch.int32).view(O, n // 32, 4)).float()  # [O, C, 16, 2]
    xp = fp4_pairs_ref(x).view(torch.float16).reshape(16, n // 32, 2).transpose(0, 1).float()  # [C, 16, 2]
    W = fp4.held_dequantize(4, (1, O, n), {"codes": bitpack.pack(codes, 4)[None], "scale": torch.ones(1, O, n // 32)})
    assert torch.allclose((wq * xp).sum((1, 2, 3)) * 64, W[0] @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_pairs_kernel_equals_torch(dtype):
    """The pairing kernel (CUDA's launch; its slot function is the gate/up kernel's h store) gives exactly the torch
    permutation: a leading batch dim, rows longer than one block."""
    from moec.kernels.fp4_h2 import _fp4_pairs_launch, fp4_pairs_ref

    v = (torch.randn(3, 32 * 45, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    got = _fp4_pairs_launch(v, block=512)
    assert got.shape == (3, 16, 45) and got.dtype == torch.int32
    assert torch.equal(got, fp4_pairs_ref(v))


def test_fp4h_kernels_compile_for_sm90_with_fewer_instructions():
    """The same experts on the fp16x2 path, compiled for sm_90 (CPU): no stack, e4m3 conversions and HFMA2 in the
    loop, no FFMA a code (the fp32 word path's 128 FMUL + 132 FFMA a 128-code step are gone)."""
    from moec.kernels import aot

    jobs = _gpt_oss_fp4_jobs(True)
    for job, rep in zip(jobs, aot.report_in_subprocess(jobs), strict=True):
        res, ops = rep["resources"], rep["opcodes"]
        assert res["stack"] == 0 and res["local"] == 0, (job["kernel"], res)
        assert ops.get("F2FP", 0) >= 64 and ops.get("HFMA2", 0) >= 56 and ops.get("FFMA", 0) <= 40, (job["kernel"], ops)
