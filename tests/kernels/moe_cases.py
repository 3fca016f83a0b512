"""Random quantized expert matrices for the MoE / qlinear kernel tests (every storage mode)."""

from __future__ import annotations

import torch

from moec.formats import bitpack
from moec.kernels.dequant import MODE_AFFINE, MODE_DENSE, MODE_FP4, MODE_FP8, MODE_LUT, QWeight
from moec.runtime.experts import lut_poly

# name -> (mode, bits)
MODES = {"lut2": (MODE_LUT, 2), "lut2p": (MODE_LUT, 2), "lut3": (MODE_LUT, 3), "lut4": (MODE_LUT, 4),
         "rtn2": (MODE_AFFINE, 2), "rtn4": (MODE_AFFINE, 4), "int8": (MODE_AFFINE, 8), "fp8": (MODE_FP8, 8),
         "bf16": (MODE_DENSE, 16), "mxfp4": (MODE_FP4, 4), "nvfp4": (MODE_FP4, 4)}
FP4_BLOCK = {"mxfp4": 32, "nvfp4": 16}  # inputs per block scale (the qweight G of these kinds is n_in / block)


def qweight(kind: str, E: int, O: int, n_in: int, G: int, gen: torch.Generator, device) -> QWeight:
    """A random QWeight [E, O, n_in] of `kind` with G groups per row (tables sorted, scale ~0.1)."""
    mode, bits = MODES[kind]
    if mode == MODE_DENSE:
        return QWeight(mode, bits, n_in, (torch.randn(E, O, n_in, generator=gen) * 0.1).to(torch.bfloat16).to(device))
    if mode == MODE_FP8:
        w = (torch.randn(E, O, n_in, generator=gen) * 100).clamp(-440, 440).to(torch.float8_e4m3fn)
        return QWeight(mode, bits, n_in, w.to(device), (torch.rand(E, O, generator=gen) * 1e-3).to(device))
    idx = torch.randint(0, 1 << bits, (E, O, n_in), generator=gen)
    codes = bitpack.pack(idx, bits).to(device)
    if mode == MODE_FP4:  # every e2m1 code; scales: powers of two (mxfp4), e4m3 values / 2^12 (nvfp4)
        G = n_in // FP4_BLOCK[kind]
        if kind == "mxfp4":
            scale = 2.0 ** torch.randint(-8, -3, (E, O, G), generator=gen).float()
        else:
            b = torch.randint(0x30, 0x7F, (E, O, G), dtype=torch.uint8, generator=gen)
            scale = b.view(torch.float8_e4m3fn).float() / 2.0 ** 12
        return QWeight(mode, bits, n_in, codes, scale.to(device))
    if mode == MODE_LUT:
        lut = (torch.randn(E, O, G, 1 << bits, generator=gen).sort(-1).values * 0.1).half()
        poly = lut_poly(lut.to(device)) if kind == "lut2p" else None  # "lut2p": the cubic GEMV decode
        return QWeight(mode, bits, n_in, codes, lut.to(device), poly)
    scale = (torch.rand(E, O, G, generator=gen) * 0.05 + 0.01).half()
    zero = (-scale.float() * (1 << (bits - 1)) + torch.randn(E, O, G, generator=gen) * 0.01).half()
    return QWeight(mode, bits, n_in, codes, scale.to(device), zero.to(device))


def moe_case(kind, N, A, E, D, I, G1, G2, device, seed=0, dtype=torch.float32):
    """(x, ids, weights, w1, w3, w2) with distinct experts per token."""
    gen = torch.Generator().manual_seed(seed)
    w1 = qweight(kind, E, I, D, G1, gen, device)
    w3 = qweight(kind, E, I, D, G1, gen, device)
    w2 = qweight(kind, E, D, I, G2, gen, device)
    x = torch.randn(N, D, generator=gen).to(dtype).to(device)
    ids = torch.stack([torch.randperm(E, generator=gen)[:A] for _ in range(N)]).to(device)
    wts = torch.softmax(torch.randn(N, A, generator=gen), -1).to(device)
    return x, ids, wts, w1, w3, w2
