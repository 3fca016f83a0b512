"""FP4 codecs at run time (moec/runtime/fp4.py): gpt-oss-style MXFP4 tensors (`*_blocks` / `*_scales`) become
moec's mxfp4 parts bit for bit, checked against transformers' own gpt-oss dequantizer; malformed ones are
refused in one line; QuantMatrix holds both codecs for the kernels (MODE_FP4: block scales in fp16 where they
are all fp16 values, else fp32) and dequantizes them exactly."""

from __future__ import annotations

import pytest
import torch

from moec.errors import FormatError
from moec.kernels.dequant import MODE_FP4, dequant_ref
from moec.runtime import fp4
from moec.runtime.experts import QuantMatrix


def _gpt_oss_tensors(E=2, O=6, G=3, seed=0):
    """blocks uint8 [E, O, G, 16] (every byte) and scales uint8 [E, O, G] (every e8m0 value but NaN, 0 and 254
    included) as a gpt-oss checkpoint stores `*_blocks` / `*_scales`."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, O, G, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(90, 140, (E, O, G), dtype=torch.uint8, generator=g)
    scales.view(-1)[:3] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    return blocks, scales


def test_gpt_oss_mxfp4_loads_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _gpt_oss_tensors()
    parts = fp4.mxfp4_from_blocks(blocks, scales, "gate_up_proj")
    E, O, G = scales.shape
    w = fp4.dequantize_mxfp4(4, (E, O, G * 32), parts)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]: gpt-oss's layout
    assert torch.equal(w, ref.transpose(1, 2)), (w - ref.transpose(1, 2)).abs().max()
    assert torch.equal(w.signbit(), ref.transpose(1, 2).signbit())  # -0 (code 8) kept
    assert parts["codes"].shape == (E, O, G * 16) and torch.equal(parts["scale"], scales)
    held = QuantMatrix("mxfp4", 4, (E, O, G * 32), parts)
    assert held.scale.dtype == torch.float32  # 2^-127 .. is no fp16 value: the scales are held in fp32
    assert held.kernel_ok() and held.qweight().mode == MODE_FP4
    assert torch.equal(held.dequant_ref(), w) and torch.equal(dequant_ref(held.qweight()), w)


@pytest.mark.parametrize(("blocks", "scales", "match"), [
    (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.int32), "uint8"),
    (torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), r"blocks \[\.\.\., O, G, 16\]"),
    (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.full((2, 3), 255, dtype=torch.uint8), "255"),
])
def test_malformed_gpt_oss_tensors_are_refused(blocks, scales, match):
    with pytest.raises(FormatError, match=rf"^down_proj: .*{match}"):
        fp4.mxfp4_from_blocks(blocks, scales, "down_proj")


def test_nvfp4_quant_matrix_holds_the_quotient_scale():
    """nvfp4 is held as codes + e4m3 / global_scale in fp32 (one operand for the kernels), the same weights
    as the stored parts give; a plain [O, I] weight stores its global scale without the E axis (0-dim)."""
    parts = fp4.random_nvfp4(4, (1, 8, 32), 16, "cpu", torch.Generator().manual_seed(0))
    parts["scale"] = torch.randint(1, 0x7F, (1, 8, 2), dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = fp4.dequantize_nvfp4(4, (1, 8, 32), parts)
    q = QuantMatrix("nvfp4", 4, (8, 32), {k: v[0] for k, v in parts.items()})
    assert q.scale.dtype == torch.float16 and q.scale.shape == (1, 8, 2)  # every e4m3 / 2^13 is an fp16 value
    assert torch.equal(q.dequant_ref(), w) and torch.equal(w.bfloat16().float(), w)
