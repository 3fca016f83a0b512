"""Runtime half of the intsym weight codec (moec/codecs/intsym.py): the fp32 reference dequantization, what
runtime/experts.QuantMatrix holds, and the random stand-in of `moec pack --random`.

Stored (formats/codecs.py WeightCodec.INTSYM): codes uint8 [E, O, row_bytes] (ROW layout, code = q + 2^(b-1)),
scale fp16 [E, O, G]; w = scale · (code - 2^(b-1)).

Held: the codes, the fp16 scale and zero = -2^(b-1) · scale (fp16, exact: a power-of-two multiple), the
operands of kernels/dequant.py MODE_AFFINE, which computes zero + scale · code in fp32. That sum equals
scale · (code - 2^(b-1)) bit for bit: scale · code (an 11-bit mantissa times an integer below 2^8) and the
result (an 11-bit mantissa times an integer of magnitude at most 2^(b-1)) are exact in fp32, so the kernels, the
held reference and `dequantize_intsym` agree exactly (tests/runtime/test_intsym.py).
"""

from __future__ import annotations

import torch

from ..formats import bitpack


def offset(bits: int) -> int:
    """2^(b-1): the code of level 0."""
    return 1 << (bits - 1)


def levels(bits: int, shape: tuple[int, int, int], codes: torch.Tensor, groups: int) -> torch.Tensor:
    """Signed levels q [E, O, G, g] (int64) from the packed codes."""
    E, O, I = shape
    return bitpack.unpack(codes, bits, I).view(E, O, groups, I // groups) - offset(bits)


def dequantize_intsym(bits: int, shape: tuple[int, int, int], stored: dict) -> torch.Tensor:
    """W_hat [E, O, I] fp32 = scale · q (the reference)."""
    scale = stored["scale"].float()  # [E, O, G]
    q = levels(bits, shape, stored["codes"], scale.shape[2])
    return (scale[..., None] * q.float()).reshape(shape)


def hold_intsym(bits: int, stored: dict) -> dict:
    """Codes, fp16 scale and fp16 zero = -2^(b-1)·scale: what MODE_AFFINE reads."""
    scale = stored["scale"].half().contiguous()
    return {"codes": stored["codes"].contiguous(), "scale": scale, "zero": (scale * -offset(bits)).contiguous()}


def held_dequantize_intsym(bits: int, shape: tuple[int, int, int], held: dict) -> torch.Tensor:
    """zero + scale · code in fp32, as the kernels compute it (equal to dequantize_intsym: module docstring)."""
    E, O, I = shape
    G = held["scale"].shape[2]
    code = bitpack.unpack(held["codes"], bits, I).view(E, O, G, I // G).float()
    return (held["zero"].float()[..., None] + held["scale"].float()[..., None] * code).reshape(E, O, I)


def held_group_intsym(shape, held: dict) -> int:
    return shape[2] // held["scale"].shape[2]


def random_intsym(bits, shape, group_size, device, gen=None):
    """Uniform random codes, scales in [0.015, 0.03) / 2^(b-1) (weights within ±0.03)."""
    E, O, I = shape
    G = I // group_size if group_size else 1
    codes = torch.randint(0, 256, (E, O, bitpack.packed_row_bytes(I, bits)), dtype=torch.uint8, device=device,
                          generator=gen)
    scale = (1 + torch.rand(E, O, G, device=device, generator=gen)) * (0.015 / offset(bits))
    return {"codes": codes, "scale": scale.half()}
