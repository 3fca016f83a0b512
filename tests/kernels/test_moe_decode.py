"""Fused 2-bit MoE decode kernel vs its torch reference (TRITON_INTERPRET=1 on the CPU)."""

import os

import torch

if not torch.cuda.is_available():  # the CPU runs the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.calibrate import hls  # noqa: E402
from moec.formats import bitpack  # noqa: E402
from moec.kernels.moe_decode import moe_decode, moe_decode_ref  # noqa: E402
from moec.runtime.experts import ExpertWeights, QuantMatrix  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _quant(E, O, n_in, G, gen):
    idx = torch.randint(0, 4, (E, O, n_in), generator=gen)
    lut = torch.randn(E, O, G, 4, generator=gen).sort(-1).values * 0.1
    return bitpack.pack(idx, 2).to(DEVICE), lut.to(DEVICE)


def _case(N, A, E, D, I, G1, G2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    c1, l1 = _quant(E, I, D, G1, gen)
    c3, l3 = _quant(E, I, D, G1, gen)
    c2, l2 = _quant(E, D, I, G2, gen)
    x = torch.randn(N, D, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:A] for _ in range(N)]).to(DEVICE)
    wts = torch.softmax(torch.randn(N, A, generator=gen), -1).to(DEVICE)
    return x, ids, wts, c1, l1, c3, l3, c2, l2


# (N tokens, top-k A, experts E, D, I, groups of w1/w3, groups of w2): one-token decode, top-1/2/8,
# odd token counts, D and I not multiples of the block (and of 4), grouped codebooks. With N·A < E
# most experts get zero tokens.
SHAPES = [
    (1, 1, 4, 64, 48, 1, 1),
    (1, 2, 8, 256, 160, 1, 1),
    (3, 2, 5, 40, 24, 1, 1),
    (5, 1, 3, 96, 64, 3, 2),
    (3, 2, 6, 70, 36, 1, 1),
    (2, 8, 16, 64, 32, 2, 1),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_moe_decode_matches_reference(shape):
    args = _case(*shape)
    got = moe_decode(*args, block_i=64, block_d=64, block_k=64)  # big blocks: fewer interpreted programs
    want = moe_decode_ref(*args)
    # fp32 everywhere; only the summation order differs (blocked K, split-I atomics), so the error is
    # a few ulps of the largest partial sums: 1e-4 relative to the output scale.
    tol = 1e-4 * want.abs().max().item() + 1e-6
    err = (got - want).abs().max().item()
    assert err <= tol, f"max abs err {err:.3e} > {tol:.3e} for shape {shape}"


def test_moe_decode_split_i():
    args = _case(1, 2, 4, 32, 96, 1, 1, seed=3)
    want = moe_decode_ref(*args)
    for split in (1, 3):  # the down projection summed over slices of I with atomics
        got = moe_decode(*args, block_i=64, block_d=64, block_k=32, split_i=split)
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_moe_decode_routing_weight_and_zero_experts():
    # Expert outputs are combined with their routing weights: zero weight on slot 1 = top-1 on slot 0.
    x, ids, wts, *w = _case(3, 2, 4, 32, 16, 1, 1, seed=5)
    wts = torch.zeros_like(wts)
    wts[:, 0] = 1.0
    got = moe_decode(x, ids, wts, *w, block_i=16, block_d=16, block_k=32)
    top1 = moe_decode(x, ids[:, :1].contiguous(), wts[:, :1].contiguous(), *w, block_i=16, block_d=16, block_k=32)
    assert torch.allclose(got, top1, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, torch.zeros_like(got))


def test_moe_decode_rejects_bad_shapes():
    x, ids, wts, c1, l1, c3, l3, c2, l2 = _case(1, 2, 4, 64, 48, 1, 1)
    with pytest.raises(AssertionError):
        moe_decode(x[:, :60], ids, wts, c1, l1, c3, l3, c2, l2)
    with pytest.raises(AssertionError):
        moe_decode(x, ids, wts, c1, l1.half(), c3, l3, c2, l2)


def test_runtime_routes_decode_through_kernel_on_cuda():
    # ExpertWeights (what the runtime's MoE layer calls) takes the fused kernel for a 2-bit decode step
    # on CUDA and declines elsewhere; both agree with its per-expert reference path.
    E, D, I, N, A = 4, 64, 32, 3, 2
    g = torch.Generator().manual_seed(7)
    qs = [QuantMatrix("hls", 2, (E, o, i), hls.quantize(torch.randn(E, o, i, generator=g), None, "hls", 2, 0, False))
          for o, i in ((I, D), (I, D), (D, I))]
    ew = ExpertWeights(*qs).to(DEVICE)
    x = torch.randn(N, D, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(N)]).to(DEVICE)
    wts = torch.softmax(torch.randn(N, A, generator=g), -1).to(DEVICE)
    ref = torch.zeros_like(x)
    for n in range(N):
        for a in range(A):
            ref[n] += wts[n, a] * ew.expert(int(ids[n, a]), x[n : n + 1])[0]
    out = ew.fused(x, wts, ids)
    if DEVICE == "cpu":
        assert out is None
    else:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
