"""Runtime half of the FP4 weight codecs mxfp4 and nvfp4 (registered in moec/codecs/fp4.py; fitted by
moec/calibrate/fp4.py; stored parts in moec/formats/codecs.py): the e2m1 table, the fp32 reference
dequantization, what runtime/experts.QuantMatrix holds (codes + one fp16/fp32 scale per block, the operands of
kernels/dequant.py MODE_FP4), the random stand-ins of `moec pack --random`, and the exact import of
gpt-oss-style MXFP4 tensors (`*_blocks` / `*_scales`).

Shape legend: E = experts, O = output rows, I = inputs, g = inputs per block (mxfp4 32, nvfp4 16), G = I / g.

Both codecs store codes uint8 [E, O, I / 2] in formats/bitpack.py's 4-bit ROW layout (input 2j in the low
nibble of byte j, 2j + 1 in the high one), a code being the e2m1 bit pattern (bit 3 the sign, bits 1-2 the
exponent, bit 0 the mantissa: E2M1[code] below). The block scale is a power of two (mxfp4: e8m0 byte e,
2^(e − 127)) or an e4m3 float divided by a per-matrix fp32 global scale (nvfp4, compressed-tensors'
convention). Every dequantized weight is e2m1 × that block scale in fp32: mxfp4's product is exact, and so
is nvfp4's when the global scale is a power of two (what moec's fit writes), which is what makes the
exports decode bit for bit (moec/export).
"""

from __future__ import annotations

import torch

from ..errors import FormatError
from ..formats import bitpack

# the 16 e2m1 values by code (OCP MX spec; the order of transformers' FP4_VALUES and gguf-py's MXFP4
# kvalues / 2); code 8 is -0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
E8M0_BIAS = 127
E8M0_NAN = 255  # the one e8m0 byte that is not a power of two
MX_BLOCK, NV_BLOCK = 32, 16  # inputs per block scale


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 bytes -> fp32 2^(e − 127), built from the bits (exact; e = 0 is the subnormal 2^-127)."""
    ei = e.to(torch.int32)
    normal = (ei << 23).view(torch.float32)
    return torch.where(ei == 0, torch.full_like(normal, 2.0 ** -127), normal)


def e2m1_values(codes: torch.Tensor, n_in: int) -> torch.Tensor:
    """uint8 codes [..., I / 2] -> fp32 e2m1 values [..., I]."""
    # from the code's bits on its own device (E2M1 by arithmetic): no table copied to the device per call, which
    # a CUDA-graph capture refuses
    c = bitpack.unpack(codes, 4, n_in).to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2((e - 1).float()))
    return torch.where((c & 8) != 0, -mag, mag)


def mx_scale(stored: dict) -> torch.Tensor:
    """fp32 block scales [E, O, G] of mxfp4 parts (e8m0 bytes)."""
    return e8m0_to_float(stored["scale"])


def nv_scale(stored: dict) -> torch.Tensor:
    """fp32 block scales [E, O, G] of nvfp4 parts: e4m3 / global_scale[e] (compressed-tensors computes the same
    quotient in fp32 before multiplying by the e2m1 value)."""
    gs = stored["global_scale"].float()
    return stored["scale"].float() / gs.reshape(*gs.shape, *(1,) * (stored["scale"].dim() - gs.dim()))


def _dequant(codes: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    E, O, I = shape
    G = scale.shape[-1]
    v = e2m1_values(codes, I).view(*codes.shape[:-1], G, I // G)
    return (v * scale[..., None]).reshape(*codes.shape[:-1], I)


def dequantize_mxfp4(bits, shape, stored):
    """W_hat [E, O, I] fp32 = E2M1[code] · 2^(e8m0 − 127)."""
    return _dequant(stored["codes"], mx_scale(stored), shape)


def dequantize_nvfp4(bits, shape, stored):
    """W_hat [E, O, I] fp32 = E2M1[code] · (fp32(e4m3) / global_scale)."""
    return _dequant(stored["codes"], nv_scale(stored), shape)


# -- what QuantMatrix holds (kernels/dequant.py MODE_FP4: codes and block scales) -------------------------

def _held_scale(scale: torch.Tensor) -> torch.Tensor:
    """The block scales as the kernels read them: fp16 where every one is an fp16 value (the usual case: a
    power of two, or an e4m3 value over a power-of-two global scale, inside fp16's range), else fp32; the
    products with the e2m1 values are then the same fp32 numbers either way, at half the bytes."""
    half = scale.half()
    return (half if torch.equal(half.float(), scale) else scale).contiguous()


def hold_mxfp4(bits: int, stored: dict) -> dict:
    return {"codes": stored["codes"].contiguous(), "scale": _held_scale(mx_scale(stored))}


def hold_nvfp4(bits: int, stored: dict) -> dict:
    return {"codes": stored["codes"].contiguous(), "scale": _held_scale(nv_scale(stored))}


def held_dequantize(bits: int, shape, held: dict) -> torch.Tensor:
    return _dequant(held["codes"], held["scale"].float(), shape)


def held_group(shape, held: dict) -> int:
    return shape[2] // held["scale"].shape[-1]


# -- random stand-ins (speed runs; check_quant_parts builds them on the meta device for the expected parts) -

def _codes(shape, device, gen) -> torch.Tensor:
    E, O, I = shape
    return torch.randint(0, 256, (E, O, I // 2), dtype=torch.uint8, device=device, generator=gen)


def random_mxfp4(bits, shape, group_size, device, gen=None):
    """Every code, block scale 2^-7 (weights up to 6/128)."""
    E, O, I = shape
    return {"codes": _codes(shape, device, gen),
            "scale": torch.full((E, O, I // MX_BLOCK), E8M0_BIAS - 7, dtype=torch.uint8, device=device)}


def random_nvfp4(bits, shape, group_size, device, gen=None):
    """Every code, e4m3 block scales 448 and a global scale 2^13 (weights up to 6·448/8192 = 0.33)."""
    E, O, I = shape
    return {"codes": _codes(shape, device, gen),
            "scale": torch.full((E, O, I // NV_BLOCK), 448.0, device=device).to(torch.float8_e4m3fn),
            "global_scale": torch.full((E,), 2.0 ** 13, device=device)}


# -- gpt-oss-style MXFP4 checkpoints ------------------------------------------------------------------------

def mxfp4_from_blocks(blocks: torch.Tensor, scales: torch.Tensor, name: str = "tensor") -> dict[str, torch.Tensor]:
    """A gpt-oss checkpoint's `<name>_blocks` uint8 [..., O, G, 16] and `<name>_scales` uint8 [..., O, G] as
    moec's mxfp4 parts {codes [..., O, G·16], scale [..., O, G]}, bit for bit: gpt-oss packs input 2j of a
    block in the low nibble of byte j (transformers.integrations.mxfp4: lut[blk & 0x0F] fills the even
    inputs), as the 4-bit ROW layout does, its codes are e2m1 patterns and its scales e8m0 with bias 127
    (the rows are the output features; gpt-oss's own dequantizer transposes to [in, out] afterwards). A row
    permutation of both parts (gpt-oss's gate_up_proj interleaves gate and up rows: w1 = rows 0::2, w3 = 1::2)
    moves whole blocks and stays exact. FormatError for anything else (shapes, dtypes, the e8m0 NaN byte 255)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise FormatError(f"{name}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != MX_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise FormatError(f"{name}: MXFP4 blocks [..., O, G, 16] and scales [..., O, G] expected, got "
                          f"{list(blocks.shape)} and {list(scales.shape)}")
    if bool((scales == E8M0_NAN).any()):
        raise FormatError(f"{name}: an e8m0 scale is 255 (NaN in the MX spec): not a weight moec can hold")
    return {"codes": blocks.reshape(*blocks.shape[:-2], -1).contiguous(), "scale": scales.contiguous()}
