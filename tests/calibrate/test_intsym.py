"""intsym (symmetric int4/int8, moec/codecs/intsym.py): GPTQ lowers the Hessian-weighted output error below
round-to-nearest on the same scales and layout; the stored levels are signed b-bit integers times fp16 scales;
the runtime's reference, its held MODE_AFFINE buffers and the kernels' torch reference agree bit for bit."""

from __future__ import annotations

import pytest
import torch

from moec.calibrate import intsym
from moec.calibrate.hls import output_error
from moec.formats import bitpack
from moec.kernels.dequant import dequant_ref
from moec.runtime import intsym as rt
from moec.runtime.experts import QuantMatrix


def _case(E=2, O=24, I=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(E, O, I, generator=g) * 0.05
    X = torch.randn(E, 256, I, generator=g) * (torch.rand(I, generator=g) * 3 + 0.1)  # uneven input energy
    X[..., 1::2] += 0.7 * X[..., ::2]  # correlated inputs: what GPTQ's error feedback exploits
    H = X.transpose(1, 2) @ X / 256 + 1e-2 * torch.eye(I)
    return W, H


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 0)])
def test_gptq_beats_round_to_nearest(bits, group):
    W, H = _case()
    rtn = intsym.quantize(W, H, bits, group, gptq=False)
    gptq = intsym.quantize(W, H, bits, group, gptq=True)
    static = intsym.quantize(W, H, bits, group, gptq=True, actorder=False)
    assert torch.equal(rtn["scale"], gptq["scale"])  # the same fixed scales: only the levels differ
    err = {k: output_error(W, rt.dequantize_intsym(bits, tuple(W.shape), s), H).mean().item()
           for k, s in (("rtn", rtn), ("gptq", gptq), ("static", static))}
    # a clear margin (not noise): on correlated inputs GPTQ removes a large share of the output error
    assert err["gptq"] < 0.9 * err["rtn"] and err["static"] < 0.9 * err["rtn"], err


def test_stored_levels_and_scales():
    W, H = _case(E=1, O=8, I=64)
    W[0, 0, :32] = 0  # an all-zero group
    s = intsym.quantize(W, H, 4, 32)
    assert s["codes"].dtype == torch.uint8 and s["codes"].shape == (1, 8, 32)  # ROW layout, two codes a byte
    assert s["scale"].dtype == torch.float16 and s["scale"].shape == (1, 8, 2)
    q = bitpack.unpack(s["codes"], 4, 64) - 8
    assert q.min() >= -8 and q.max() <= 7
    w = rt.dequantize_intsym(4, (1, 8, 64), s)
    assert torch.equal(w, s["scale"].float().repeat_interleave(32, -1) * q.float())
    # the zero group gets the smallest fp16 scale; GPTQ may still move rounding error from other columns into it
    assert s["scale"][0, 0, 0] == 2.0 ** -24
    assert not rt.dequantize_intsym(4, (1, 8, 64), intsym.quantize(W, H, 4, 32, gptq=False))[0, 0, :32].any()
    s8 = intsym.quantize(W, None, 8, 0, gptq=True)  # no Hessian: round to nearest, one scale per row
    assert s8["codes"].shape == (1, 8, 64) and s8["scale"].shape == (1, 8, 1)


@pytest.mark.parametrize(("bits", "group"), [(4, 16), (8, 32), (8, 0)])
def test_runtime_held_and_kernel_reference_agree_bit_for_bit(bits, group):
    W, H = _case(E=3, O=16, I=64)
    stored = intsym.quantize(W, H, bits, group)
    want = rt.dequantize_intsym(bits, (3, 16, 64), stored)
    m = QuantMatrix("intsym", bits, (3, 16, 64), stored)
    assert m.kernel_ok() and sorted(m.parts) == ["codes", "scale", "zero"]
    assert torch.equal(m.dequant_ref(), want)
    assert torch.equal(dequant_ref(m.qweight()), want)  # MODE_AFFINE: zero + scale · code in fp32
