"""MODE_TCQ (trellis codes, kernels/dequant.py) in the fused kernels against their torch references: the MoE
decode GEMV, the grouped prefill GEMM and the quantized linear (GEMV and GEMM) at 2, 3 and 4 bits (3-bit
states straddle words); and the kernels' reference against the runtime's (runtime/tcq.py). CPU: Triton's
interpreter at toy shapes."""

import os

import torch

if not torch.cuda.is_available():  # the CPU runs the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.kernels.dequant import MODE_TCQ, QWeight, dequant_ref  # noqa: E402
from moec.kernels.moe_decode import moe_decode, moe_decode_ref  # noqa: E402
from moec.kernels.moe_prefill import moe_grouped, moe_grouped_ref  # noqa: E402
from moec.kernels.qlinear import qlinear, qlinear_ref  # noqa: E402
from moec.runtime import tcq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tcq_weight(bits: int, E: int, O: int, n_in: int, gen) -> QWeight:
    held = tcq.hold_tcq(bits, tcq.random_tcq(bits, (E, O, n_in), 0, "cpu", gen))
    held["scale"] = held["scale"] * (0.5 + torch.rand(E, O, generator=gen))  # rows of different scales
    return QWeight(MODE_TCQ, bits, n_in, held["codes"].to(DEVICE), held["scale"].to(DEVICE))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kernel_reference_is_the_runtime_dequant(bits):
    from moec.registry import weight_codec

    assert weight_codec("tcq").kernel_mode == MODE_TCQ
    g = torch.Generator().manual_seed(bits)
    stored = tcq.random_tcq(bits, (2, 5, 64), 0, "cpu", g)
    held = tcq.hold_tcq(bits, stored)
    w = QWeight(MODE_TCQ, bits, 64, held["codes"], held["scale"])
    assert torch.equal(dequant_ref(w), tcq.dequantize_tcq(bits, (2, 5, 64), stored))


def _moe(bits, N, A, E, D, I, seed, down_bits=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(N)]).to(DEVICE)
    wts = torch.rand(N, A, generator=g).to(DEVICE)
    return x, ids, wts, tcq_weight(bits, E, I, D, g), tcq_weight(bits, E, I, D, g), \
        tcq_weight(down_bits or bits, E, D, I, g)


# (2, 3): w2 of its own width (allocate's unit gate_up), the down launch reads it alone
@pytest.mark.parametrize("bits,N,A,E,D,I,down", [(2, 1, 2, 3, 64, 32, 2), (3, 2, 2, 4, 32, 64, 3),
                                                 (4, 1, 2, 3, 64, 32, 4), (2, 1, 2, 3, 64, 32, 3)])
def test_moe_decode_tcq(bits, N, A, E, D, I, down):
    x, ids, wts, w1, w3, w2 = _moe(bits, N, A, E, D, I, bits + N, down)
    got = moe_decode(x, ids, wts, w1, w3, w2, block_o=16, block_k=64, block_o_down=16, block_k_down=32)
    want = moe_decode_ref(x, ids, wts, w1, w3, w2)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item() + 1e-6


@pytest.mark.parametrize("bits,down", [(2, 2), (3, 3), (3, 2)])
def test_moe_grouped_tcq(bits, down):
    x, ids, wts, w1, w3, w2 = _moe(bits, 5, 2, 3, 64, 32, 7, down)
    got = moe_grouped(x, ids, wts, w1, w3, w2, block_m=16, block_n=16, block_k=32, num_warps=4)
    want = moe_grouped_ref(x, ids, wts, w1, w3, w2)
    # h is stored bf16 (and the CUDA dot runs on bf16 operands): ~1e-2 of the output scale
    assert (got.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@pytest.mark.parametrize("bits,M", [(2, 1), (3, 1), (2, 19)])
def test_qlinear_tcq(bits, M):
    g = torch.Generator().manual_seed(M + bits)
    w = tcq_weight(bits, 1, 24, 64, g)
    x = torch.randn(M, 64, generator=g).to(DEVICE)
    cfg = dict(block_m=16, block_n=16, block_k=32, num_warps=4) if M > 1 else {}
    got = qlinear(x, w, None, **cfg)
    want = qlinear_ref(x, w)
    tol = (1e-4 if M == 1 else 2e-2) * want.abs().max().item()  # GEMM: bf16 operands on CUDA
    assert (got.float() - want).abs().max().item() <= tol
