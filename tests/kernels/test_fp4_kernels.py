"""MODE_FP4 (mxfp4 / nvfp4: e2m1 codes × an fp32 scale per block, kernels/dequant.py) in the fused kernels
against their torch references: the MoE decode GEMV, the grouped prefill GEMM and the quantized linear
(GEMV and GEMM), with tiles wider than a block (a tile reads each chunk's own block scale); and the kernels'
reference against the runtime's (runtime/fp4.py). CPU: Triton's interpreter at toy shapes."""

import os

import torch

if not torch.cuda.is_available():  # the CPU runs the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.kernels.dequant import dequant_ref  # noqa: E402
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
