"""Runtime halves of the built-in weight codecs (registered in moec/codecs/hls.py and vq.py): the lookup
table a LUT codec reconstructs from its stored parts, the fp32 reference dequantization, what
runtime/experts.QuantMatrix holds of each codec (`hold_*`, the buffers the kernels read and the reference
dequantizes), and the random stand-in parts of `moec pack --random` / random latency models. Stored
layouts: formats/codecs.py.

LUT codecs (hls, rtn, fp3): w[e, o, i] = lut[e, o, i // g, idx[e, o, i]], lut [E, O, G, K] fp32, idx the
codes packed per row (formats/bitpack.py). fp8: e4m3 weights times fp32 row scales. vq: one code per d
consecutive inputs (d = the rule's group_size), w[e, o, j·d : (j+1)·d] = row_scale[e, o] · codebook[e, idx]
(calibrate/vq.py).
"""

from __future__ import annotations

import torch

from ..errors import FormatError
from ..formats import bitpack
from ..formats.codecs import VQ_DIMS

FP3_GRID = torch.tensor([-1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0])


def lut_hls(bits: int, stored: dict) -> torch.Tensor:
    return stored["codebook"].float() * stored["cb_scale"].float()[..., None]


def lut_rtn(bits: int, stored: dict) -> torch.Tensor:
    k = torch.arange(1 << bits, dtype=torch.float32, device=stored["scale"].device)
    return stored["zero"].float()[..., None] + stored["scale"].float()[..., None] * k


def lut_fp3(bits: int, stored: dict) -> torch.Tensor:
    return stored["scale"].float()[..., None] * FP3_GRID.to(stored["scale"].device)


def dequantize_lut(lut: torch.Tensor, bits: int, shape: tuple[int, int, int], codes: torch.Tensor) -> torch.Tensor:
    """W_hat [E, O, I] fp32 from a LUT [E, O, G, K] and the packed codes."""
    E, O, I = shape
    G = lut.shape[2]
    idx = bitpack.unpack(codes, bits, I).view(E, O, G, I // G)
    return lut.gather(-1, idx).reshape(E, O, I)


def dequantize_lut_hls(bits, shape, stored):
    return dequantize_lut(lut_hls(bits, stored), bits, shape, stored["codes"])


def dequantize_lut_rtn(bits, shape, stored):
    return dequantize_lut(lut_rtn(bits, stored), bits, shape, stored["codes"])


def dequantize_lut_fp3(bits, shape, stored):
    return dequantize_lut(lut_fp3(bits, stored), bits, shape, stored["codes"])


def dequantize_fp8(bits, shape, stored):
    return stored["fp8"].float() * stored["scale"].float()[..., None]


def vq_code_width(bits: int, dim: int) -> int:
    """Bits per vq code: `bits` per weight over a vector of `dim` weights (K = 2^width codewords)."""
    return bits * dim


def vq_codes(stored: dict, n_in: int) -> torch.Tensor:
    """int64 codes [E, O, I / d] of a vq matrix (formats/bitpack.py BITSTREAM of one width per row)."""
    K, d = stored["codebook"].shape[-2:]
    width = K.bit_length() - 1
    return bitpack.unpack_bits(stored["codes"], [width] * (n_in // d))


def dequantize_vq(bits, shape, stored):
    E, O, I = shape
    cb = stored["codebook"].float().expand(E, -1, -1)  # [E, K, d] (stored [1, K, d]: shared by the experts)
    d = cb.shape[-1]
    idx = vq_codes(stored, I).reshape(E, O * (I // d), 1).expand(-1, -1, d)
    return (cb.gather(1, idx).reshape(E, O, I) * stored["row_scale"].float()[..., None])


# -- what QuantMatrix holds at run time (registry hooks hold / held_dequantize / held_group) -----------------

def lut_poly(lut: torch.Tensor) -> torch.Tensor:
    """Cubic coefficients [..., 4] (a, b, c, d: p(q) = a + bq + cq² + dq³, fp32) through the four entries
    of 2-bit tables lut [..., 4] at q = 0..3 (Newton differences): the fused GEMV decodes 2-bit codes
    through these on the FMA pipe (kernels/dequant.py `_poly_code`)."""
    L = lut.double()
    d1, d2 = L[..., 1] - L[..., 0], L[..., 2] - 2 * L[..., 1] + L[..., 0]
    d3 = L[..., 3] - 3 * L[..., 2] + 3 * L[..., 1] - L[..., 0]
    return torch.stack([L[..., 0], d1 - d2 / 2 + d3 / 3, d2 / 2 - d3 / 2, d3 / 6], -1).float().contiguous()


def _hold_table(lut: torch.Tensor, bits: int, stored: dict) -> dict:
    """hls / fp3: codes, the fp32 lut (the reference) and the fp16 copy the kernels read (2-bit: its cubic)."""
    held = {"codes": stored["codes"], "lut": lut, "lut16": lut.half().contiguous()}
    if bits == 2:  # the GEMV's FMA-pipe decode (lut_poly) of the same fp16 tables
        held["poly"] = lut_poly(held["lut16"])
    return held


def hold_lut_hls(bits: int, stored: dict) -> dict:
    return _hold_table(lut_hls(bits, stored), bits, stored)


def hold_lut_fp3(bits: int, stored: dict) -> dict:
    return _hold_table(lut_fp3(bits, stored), bits, stored)


def hold_lut_rtn(bits: int, stored: dict) -> dict:
    """rtn: codes, the fp32 lut (the reference), and the fp16 scale and zero the kernels compute
    zero + scale · idx from (MODE_AFFINE)."""
    return {"codes": stored["codes"], "lut": lut_rtn(bits, stored), "scale": stored["scale"].half().contiguous(),
            "zero": stored["zero"].half().contiguous()}


def held_dequantize_lut(bits: int, shape: tuple[int, int, int], held: dict) -> torch.Tensor:
    return dequantize_lut(held["lut"], bits, shape, held["codes"])


def held_group_lut(shape, held: dict) -> int:
    """Inputs per group of the held lut [E, O, G, K] (the whole row: one group)."""
    return shape[2] // held["lut"].shape[2]


def hold_fp8(bits: int, stored: dict) -> dict:
    """fp8: the e4m3 weights and fp32 row scales the kernels read (MODE_FP8)."""
    return {"fp8": stored["fp8"], "scale": stored["scale"].float()}


def held_group_row(shape, held: dict) -> int:
    return shape[2]


def hold_vq(bits: int, stored: dict) -> dict:
    """vq: the stored parts as the kernels read them (MODE_VQ): BITSTREAM codes uint8 [E, O, bytes], the fp16
    codebook [E, 2^(bits·d), d] (a shared one, stored [1, K, d], copied per expert: the kernels index it by
    expert, and E copies of ≤ 32 KiB cost nothing beside the codes), fp16 row scales [E, O]."""
    E = stored["codes"].shape[0]
    return {"codes": stored["codes"].contiguous(), "codebook": stored["codebook"].half().expand(E, -1, -1).contiguous(),
            "row_scale": stored["row_scale"].contiguous()}


def held_group_vq(shape, held: dict) -> int:
    """The vector length d of the held codebook [E, K, d]."""
    return held["codebook"].shape[-1]


# -- random stand-ins (speed runs: the values do not matter, the layout does) ------------------------------

def _random_codes(bits: int, shape, device, gen) -> torch.Tensor:
    E, O, I = shape
    codes = torch.randint(0, 256, (E, O, bitpack.packed_row_bytes(I, bits)), dtype=torch.uint8, device=device,
                          generator=gen)
    if bits == 3 and I % 8:  # keep padding bits zero, as bitpack writes them
        codes[..., -1] &= 0x3F
    return codes


def _groups(shape, group_size: int) -> int:
    return shape[2] // group_size if group_size else 1


def random_hls(bits, shape, group_size, device, gen=None):
    """Sorted int8 entries spanning [-127, 127], scale ~ 0.03 / 127."""
    E, O, _ = shape
    G, K = _groups(shape, group_size), 1 << bits
    codes = _random_codes(bits, shape, device, gen)
    cb = torch.linspace(-127, 127, K, device=device).round().to(torch.int8).expand(E, O, G, K).contiguous()
    return {"codes": codes, "codebook": cb,
            "cb_scale": torch.full((E, O, G), 0.03 / 127, device=device, dtype=torch.float16)}


def random_rtn(bits, shape, group_size, device, gen=None):
    E, O, _ = shape
    G, K = _groups(shape, group_size), 1 << bits
    codes = _random_codes(bits, shape, device, gen)
    return {"codes": codes, "scale": torch.full((E, O, G), 0.06 / (K - 1), device=device, dtype=torch.float16),
            "zero": torch.full((E, O, G), -0.03, device=device, dtype=torch.float16)}


def random_fp3(bits, shape, group_size, device, gen=None):
    E, O, _ = shape
    codes = _random_codes(bits, shape, device, gen)
    return {"codes": codes, "scale": torch.full((E, O, _groups(shape, group_size)), 0.03 / float(FP3_GRID.abs().max()),
                                                device=device, dtype=torch.float16)}


def random_vq(bits, shape, group_size, device, gen=None):
    """Codewords of N(0, 1) entries (a rotated, row-normalized weight is near Gaussian), row scale 0.02."""
    E, O, I = shape
    d = group_size
    if d not in VQ_DIMS or I % d:  # a manifest's group_size (the vector length) checked before any shape
        raise FormatError(f"vq group_size {d} is not a vector length (1, 2, 4 or 8) dividing the {I} inputs")
    width = vq_code_width(bits, d)
    nbytes = bitpack.bitstream_width([width] * (I // d))
    codes = torch.randint(0, 256, (E, O, nbytes), dtype=torch.uint8, device=device, generator=gen)
    if (I // d * width) % 8:  # keep padding bits zero, as bitpack writes them
        codes[..., -1] &= (1 << ((I // d * width) % 8)) - 1
    cb = torch.randn(E, 1 << width, d, device=device, generator=gen).half()
    return {"codes": codes, "codebook": cb, "row_scale": torch.full((E, O), 0.02, device=device, dtype=torch.float16)}


def random_fp8(bits, shape, group_size, device, gen=None):
    E, O, I = shape
    w = torch.randn(E, O, I, device=device, generator=gen, dtype=torch.bfloat16) * 0.5
    return {"fp8": w.to(torch.float8_e4m3fn), "scale": torch.full((E, O), 0.02 / 0.5, device=device)}
