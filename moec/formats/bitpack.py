"""Sub-byte packing of codebook indices along the last dimension (the input dim of a weight row).

Every layout packs a row of n indices independently of the other rows, so a kernel that owns a block
of rows and a block of inputs finds its bytes at `row * row_bytes + k * bits // 8` without looking at
neighbours. Rows whose length is not a multiple of the codes-per-chunk are zero-padded; the padding
is dropped by `unpack(..., n)`. Round trips are exact (tests/formats/test_bitpack.py).
"""

from __future__ import annotations

from enum import StrEnum

import torch


class PackLayout(StrEnum):
    """Physical layout of packed indices (uint8 tensors, little-endian within a byte).

    U2X4: 2-bit indices, four per byte. Index k of a row lives in byte k // 4 at bits
        [2·(k % 4), 2·(k % 4) + 1]: byte = i0 | i1 << 2 | i2 << 4 | i3 << 6. Row bytes = ceil(n / 4).
    U3X8: 3-bit indices, eight per three bytes. Indices k = 8c .. 8c+7 form the 24-bit little-endian
        integer v = Σ_j i_{8c+j} << 3j, stored as bytes 3c, 3c+1, 3c+2 = v & 0xFF, v >> 8 & 0xFF,
        v >> 16. Index k therefore starts at bit 3·(k % 8) of chunk k // 8 and may straddle two bytes.
        Row bytes = 3 · ceil(n / 8): no bit is wasted for rows that are multiples of 8.
    U4X2: 4-bit indices, two per byte: byte = i0 | i1 << 4. Row bytes = ceil(n / 2).
    """

    U2X4 = "u2x4"
    U3X8 = "u3x8"
    U4X2 = "u4x2"


LAYOUT_FOR_BITS = {2: PackLayout.U2X4, 3: PackLayout.U3X8, 4: PackLayout.U4X2}
_CHUNK = {2: (4, 1), 3: (8, 3), 4: (2, 1)}  # bits -> (indices per chunk, bytes per chunk)


def packed_row_bytes(n: int, bits: int) -> int:
    per, nbytes = _CHUNK[bits]
    return -(-n // per) * nbytes


def pack(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """idx: integer tensor [..., n] with values in [0, 2^bits) -> uint8 [..., packed_row_bytes(n, bits)]."""
    assert bits in _CHUNK, f"bits must be 2, 3 or 4, got {bits}"
    n = idx.shape[-1]
    per, _ = _CHUNK[bits]
    assert idx.numel() == 0 or (int(idx.min()) >= 0 and int(idx.max()) < (1 << bits)), "index out of range"
    pad = -n % per
    x = torch.nn.functional.pad(idx.to(torch.int32), (0, pad)).view(*idx.shape[:-1], -1, per)  # [..., C, per]
    shifts = torch.arange(per, dtype=torch.int32, device=idx.device) * bits
    v = (x << shifts).sum(-1)  # [..., C]: disjoint bit fields, so the sum is an OR
    if bits == 3:
        v = torch.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], dim=-1).flatten(-2)
    return v.to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 [..., row_bytes] -> int64 indices [..., n] (inverse of `pack`)."""
    assert packed.dtype == torch.uint8, packed.dtype
    per, nbytes = _CHUNK[bits]
    assert packed.shape[-1] == packed_row_bytes(n, bits), (packed.shape, n, bits)
    p = packed.to(torch.int32)
    if bits == 3:
        p = p.view(*p.shape[:-1], -1, 3)
        v = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)  # [..., C]
    else:
        v = p
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    out = (v[..., None] >> shifts) & ((1 << bits) - 1)  # [..., C, per]
    return out.flatten(-2)[..., :n].long()
