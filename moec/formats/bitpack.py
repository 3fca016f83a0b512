"""Bit layouts of packed integer codes: every sub-byte packing of the project lives here.

Four layouts (`Layout`, whose members' docstrings give the exact bytes), one packer/unpacker pair each,
registered in `LAYOUTS`:
    ROW        codebook indices of weight rows (moec/runtime/experts.py, moec/kernels/dequant.py)
    PLANAR     KV-cache codes (moec/runtime/nuq.py, latent.py; kernels kv_decode_attention.py,
               kv_quantize_pack.py, latent_decode_attention.py)
    TRITS      ternary latent codes (moec/runtime/latent.py)
    BITSTREAM  variable-width residual-VQ codes (moec/runtime/rvq.py, kernels/rvq_lut_attention.py)
Every layout packs the last dimension of an integer tensor [..., n] into uint8 [..., width], each row
independently of the other rows; unpackers return int64 [..., n]. Round trips are exact and the bytes
are pinned (tests/formats/test_bitpack.py).

Calling convention of the registry (keyword parameters, the same for every layout):
    pack(codes, **p) -> uint8 [..., width(n=n, **p)]    unpack(packed, n=n, **p) -> int64 [..., n]
with p = {"bits": b} for ROW and PLANAR, {} for TRITS, {"widths": [w_0, ...]} for BITSTREAM (n = len(widths)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Layout(StrEnum):
    """Physical layouts of packed codes (uint8 tensors; bit 0 is the least significant bit of a byte)."""

    ROW = "row"
    """Weight-row indices (`pack`, `unpack`, `packed_row_bytes`), b = 2, 3, 4 or 8 bits, in row order:
    b = 2, four per byte: index k in byte k // 4 at bits 2·(k % 4), 2·(k % 4) + 1, i.e.
        byte = i0 | i1 << 2 | i2 << 4 | i3 << 6; ceil(n / 4) bytes.
    b = 3, eight per three bytes: indices k = 8c .. 8c+7 form the 24-bit little-endian integer
        v = Σ_j i_{8c+j} << 3j, stored as bytes 3c, 3c+1, 3c+2 = v & 0xFF, v >> 8 & 0xFF, v >> 16 (index k
        starts at bit 3·(k % 8) of chunk k // 8 and may straddle two bytes); 3 · ceil(n / 8) bytes.
    b = 4, two per byte: byte = i0 | i1 << 4; ceil(n / 2) bytes.
    b = 8, one per byte: byte k = index k; n bytes (symmetric int8 weights, moec/codecs/intsym.py).
    A row is zero-padded to whole chunks (`unpack(..., n)` drops the padding), so a kernel that owns a
    block of rows and inputs finds its bytes at row · row_bytes + k · b // 8 without reading neighbours."""

    PLANAR = "planar"
    """KV-cache codes (`pack_planar`, `unpack_planar`, `planar_width`), b = 1, 2, 3 or 4 bits, n channels,
    W = n·b/8 bytes, no padding (n·b a multiple of 8; n of 8 for b = 3):
    b = 1, 2, 4, bit planes: byte i holds channel i + m·W in bits m·b .. m·b + b − 1 (m = 0 .. 8/b − 1)
        (2-bit: byte i holds channels i, i + n/4, i + n/2, i + 3n/4 in bits 0-1, 2-3, 4-5, 6-7), so a
        contiguous run of bytes unpacks with one shift into a contiguous run of channels.
    b = 3: the 2-bit layout of the low two bits (code & 3, n/4 bytes), then the 1-bit layout of the high
        bit (n/8 bytes: byte n/4 + i holds bit 2 of channel i + m·n/8 in bit m, m = 0 .. 7)."""

    TRITS = "trits"
    """Ternary codes in {0, 1, 2} (`pack_trits`, `unpack_trits`, `trit_width`), five per byte:
    byte i = Σ_j c[5i + j] · 3^j (j = 0 .. 4, at most 242); ceil(n / 5) bytes, the last zero-padded."""

    BITSTREAM = "bitstream"
    """Codes of per-position widths (`pack_bits`, `unpack_bits`, `bitstream_width`): code j takes widths[j]
    bits, LSB first, from bit Σ_{j' < j} widths[j'] of the row read as one little-endian bit string (bit t in
    byte t // 8 at bit t % 8); ceil(Σ widths / 8) bytes, the last zero-padded."""


# -- ROW: weight-row indices -------------------------------------------------------------------------------

_CHUNK = {2: (4, 1), 3: (8, 3), 4: (2, 1), 8: (1, 1)}  # bits -> (indices per chunk, bytes per chunk)


def packed_row_bytes(n: int, bits: int) -> int:
    per, nbytes = _CHUNK[bits]
    return -(-n // per) * nbytes


def pack(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """idx: integer tensor [..., n] with values in [0, 2^bits) -> uint8 [..., packed_row_bytes(n, bits)]."""
    assert bits in _CHUNK, f"bits must be 2, 3, 4 or 8, got {bits}"
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


# -- PLANAR: KV-cache codes ----------------------------------------------------------------------------------

def planar_width(n: int, bits: int) -> int:
    """Bytes per row of n codes in the PLANAR layout."""
    assert bits in (1, 2, 3, 4) and n * bits % 8 == 0 and (bits != 3 or n % 8 == 0), (n, bits)
    return n * bits // 8


def pack_planar(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., n] integer in [0, 2^bits) -> uint8 [..., n·bits/8] (Layout.PLANAR)."""
    n = codes.shape[-1]
    planar_width(n, bits)
    c = codes.to(torch.int32)
    if bits == 3:
        return torch.cat([pack_planar(c & 3, 2), pack_planar(c >> 2, 1)], dim=-1)
    per = 8 // bits
    c = c.reshape(*c.shape[:-1], per, n // per)  # [..., m, i]: channel m·W + i
    shifts = (torch.arange(per, device=c.device, dtype=torch.int32) * bits)[:, None]
    return (c << shifts).sum(-2).to(torch.uint8)


def _unpack_planes(p: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] bit planes of `bits` -> int32 [..., W·8/bits] (channel m·W + i)."""
    per = 8 // bits
    shifts = (torch.arange(per, device=p.device, dtype=torch.int32) * bits)[:, None]
    return ((p[..., None, :] >> shifts) & (2**bits - 1)).flatten(-2)


def unpack_planar(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_planar: uint8 [..., n·bits/8] -> int64 codes [..., n]."""
    assert packed.shape[-1] == planar_width(n, bits), (packed.shape, n, bits)
    p = packed.to(torch.int32)
    if bits == 3:
        return (_unpack_planes(p[..., : n // 4], 2) | (_unpack_planes(p[..., n // 4 :], 1) << 2)).long()
    return _unpack_planes(p, bits).long()


# -- TRITS: ternary codes ------------------------------------------------------------------------------------

_TRIT_WEIGHTS = (1, 3, 9, 27, 81)


def trit_width(n: int) -> int:
    """Bytes per row of n ternary codes (Layout.TRITS)."""
    return -(-n // 5)


def pack_trits(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., n] in {0, 1, 2} -> uint8 [..., ceil(n/5)]: byte i = Σ_j codes[5i + j]·3^j (Layout.TRITS)."""
    n = codes.shape[-1]
    c = F.pad(codes.to(torch.int32), (0, trit_width(n) * 5 - n)).view(*codes.shape[:-1], -1, 5)
    w = torch.tensor(_TRIT_WEIGHTS, dtype=torch.int32, device=codes.device)
    return (c * w).sum(-1).to(torch.uint8)


def unpack_trits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_trits: uint8 [..., ceil(n/5)] -> int64 codes [..., n]."""
    p = packed.to(torch.int32)[..., None]
    w = torch.tensor(_TRIT_WEIGHTS, dtype=torch.int32, device=packed.device)
    return ((p // w) % 3).flatten(-2)[..., :n].long()


# -- BITSTREAM: variable-width codes ---------------------------------------------------------------------

def bitstream_width(widths: Sequence[int], n: int | None = None) -> int:
    """Bytes per row of codes of these widths (Layout.BITSTREAM); n, when given, must be len(widths)."""
    assert n is None or n == len(widths), (n, len(widths))
    return -(-sum(widths) // 8)


def _fixed_chunk(widths: Sequence[int]) -> tuple[int, int] | None:
    """(codes, bytes) per whole-byte chunk when every code has one width w and a chunk fits an int64
    (w in 1..16 but not 9, 11, 13, 15: lcm(w, 8) <= 64): the fast path of pack_bits / unpack_bits."""
    if not widths or len(set(widths)) != 1:
        return None  # (no codes: the general path handles the empty row)
    w = widths[0]
    span = w * 8 // math.gcd(w, 8)  # lcm(w, 8) bits
    return (span // w, span // 8) if 1 <= w and span <= 64 else None


def pack_bits(codes: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
    """codes [..., n] integers, code j < 2^widths[j] -> uint8 [..., ceil(Σ widths / 8)] (Layout.BITSTREAM)."""
    assert codes.shape[-1] == len(widths), (codes.shape, len(widths))
    if not codes.numel():  # no rows, or rows of no codes
        return torch.zeros(*codes.shape[:-1], bitstream_width(widths), dtype=torch.uint8, device=codes.device)
    if (chunk := _fixed_chunk(widths)) is not None:  # one width: whole chunks as int64, the same bytes
        per, nbytes = chunk
        n, w = len(widths), widths[0]
        c = F.pad(codes.long(), (0, -n % per)).view(*codes.shape[:-1], -1, per)
        v = (c << (w * torch.arange(per, device=codes.device))).sum(-1)  # disjoint bit fields: sum = or
        out = ((v[..., None] >> (8 * torch.arange(nbytes, device=codes.device))) & 0xFF).flatten(-2)
        return out[..., : bitstream_width(widths)].to(torch.uint8)
    bits = [(codes[..., j : j + 1] >> torch.arange(w, device=codes.device)) & 1 for j, w in enumerate(widths)]
    b = torch.cat(bits, -1)  # [..., Σw]
    pad = -b.shape[-1] % 8
    if pad:
        b = F.pad(b, (0, pad))
    b = b.view(*b.shape[:-1], -1, 8)
    return (b << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, widths: Sequence[int], n: int | None = None) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., nbytes] -> int64 codes [..., len(widths)] (n, when given, = len(widths))."""
    assert n is None or n == len(widths), (n, len(widths))
    if not packed.numel():  # no rows (an empty archive): nothing to read
        return torch.zeros(*packed.shape[:-1], len(widths), dtype=torch.int64, device=packed.device)
    if (chunk := _fixed_chunk(widths)) is not None:
        per, nbytes = chunk
        w = widths[0]
        p = F.pad(packed.long(), (0, -packed.shape[-1] % nbytes)).view(*packed.shape[:-1], -1, nbytes)
        v = (p << (8 * torch.arange(nbytes, device=packed.device))).sum(-1)
        c = (v[..., None] >> (w * torch.arange(per, device=packed.device))) & ((1 << w) - 1)
        return c.flatten(-2)[..., : len(widths)]
    b = (packed.long()[..., None] >> torch.arange(8, device=packed.device)) & 1
    b = b.flatten(-2)  # [..., nbytes·8]
    out, pos = [], 0
    for w in widths:
        out.append((b[..., pos : pos + w] << torch.arange(w, device=packed.device)).sum(-1))
        pos += w
    return torch.stack(out, -1)


# -- the registry ----------------------------------------------------------------------------------------

class Packing(NamedTuple):
    """A layout's functions, called with keyword parameters (module docstring):
    pack(codes, **p), unpack(packed, n=n, **p), width(n=n, **p)."""

    pack: Callable[..., torch.Tensor]
    unpack: Callable[..., torch.Tensor]
    width: Callable[..., int]


LAYOUTS: dict[Layout, Packing] = {
    Layout.ROW: Packing(pack, unpack, packed_row_bytes),
    Layout.PLANAR: Packing(pack_planar, unpack_planar, planar_width),
    Layout.TRITS: Packing(pack_trits, unpack_trits, trit_width),
    Layout.BITSTREAM: Packing(pack_bits, unpack_bits, bitstream_width),
}
