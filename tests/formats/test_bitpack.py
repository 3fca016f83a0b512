"""Bit packing: exact round trips, and the documented physical layouts byte for byte."""

import hashlib

import pytest
import torch

from moec.formats import bitpack
from moec.formats.bitpack import LAYOUTS, Layout, pack, packed_row_bytes, unpack


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 8), (3, 5), (2, 7, 160), (4, 257), (1, 1)])
def test_round_trip_exact(bits, shape):
    g = torch.Generator().manual_seed(bits * 1000 + shape[-1])
    idx = torch.randint(0, 1 << bits, shape, generator=g)
    p = pack(idx, bits)
    assert p.dtype == torch.uint8 and p.shape[-1] == packed_row_bytes(shape[-1], bits)
    assert torch.equal(unpack(p, bits, shape[-1]), idx)


def test_row_bytes():
    assert packed_row_bytes(256, 2) == 64 and packed_row_bytes(256, 3) == 96 and packed_row_bytes(256, 4) == 128
    assert packed_row_bytes(5, 2) == 2 and packed_row_bytes(9, 3) == 6 and packed_row_bytes(3, 4) == 2


def test_u2x4_layout():
    # byte = i0 | i1 << 2 | i2 << 4 | i3 << 6
    idx = torch.tensor([[1, 2, 3, 0, 3, 3, 3, 3]])
    assert pack(idx, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 255]]


def test_u3x8_layout():
    idx = torch.tensor([[7, 0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 5]])
    # row 0: v = 7 -> bytes 7, 0, 0. row 1: v = 1 << 6 | 5 << 21 -> 64, 0, 160.
    assert pack(idx, 3).tolist() == [[7, 0, 0], [64, 0, 5 << 5]]


def test_u4x2_layout():
    assert pack(torch.tensor([[15, 1, 2]]), 4).tolist() == [[15 | 1 << 4, 2]]


def test_out_of_range_index_rejected():
    with pytest.raises(AssertionError):
        pack(torch.tensor([[4]]), 2)


# -- every layout of the registry ------------------------------------------------------------------------
# (layout, parameters, codes, bytes): small rows worked out by hand from the Layout docstrings; the same
# bytes as the packers these replaced (nuq.pack_codes, latent.pack_planar / pack_trits,
# rvq.pack_bits) gave.
HAND = [
    (Layout.ROW, {"bits": 2}, [1, 2, 3, 0, 3], [1 | 2 << 2 | 3 << 4, 3]),  # padded to a whole byte
    (Layout.ROW, {"bits": 3}, [7, 0, 0, 0, 0, 0, 0, 0, 1], [7, 0, 0, 1, 0, 0]),
    (Layout.ROW, {"bits": 4}, [15, 1, 2], [15 | 1 << 4, 2]),
    # byte i: channels i, i + 2, i + 4, i + 6 (W = 2) at bits 0, 2, 4, 6
    (Layout.PLANAR, {"bits": 2}, [1, 0, 2, 3, 3, 1, 0, 2], [1 | 2 << 2 | 3 << 4, 3 << 2 | 1 << 4 | 2 << 6]),
    (Layout.PLANAR, {"bits": 4}, [5, 9, 15, 2], [5 | 15 << 4, 9 | 2 << 4]),
    (Layout.PLANAR, {"bits": 1}, [1, 0, 1, 1, 0, 0, 0, 1], [1 | 1 << 2 | 1 << 3 | 1 << 7]),
    # 3-bit: the 2-bit planes of code & 3 = [1, 2, 3, 2, 0, 1, 3, 0], then the plane of code >> 2 = [0, 1, 1, 0,
    # 0, 1, 0, 1] (bit m = channel m)
    (Layout.PLANAR, {"bits": 3}, [1, 6, 7, 2, 0, 5, 3, 4],
     [1 | 3 << 2 | 0 << 4 | 3 << 6, 2 | 2 << 2 | 1 << 4 | 0 << 6, 1 << 1 | 1 << 2 | 1 << 5 | 1 << 7]),
    (Layout.TRITS, {}, [2, 1, 0, 2, 1, 1], [2 + 1 * 3 + 0 * 9 + 2 * 27 + 1 * 81, 1]),
    # v = 5 | 17 << 3 | 1 << 8 | 100 << 9 = 51597 = 0xC98D, little-endian
    (Layout.BITSTREAM, {"widths": [3, 5, 1, 7]}, [5, 17, 1, 100], [0x8D, 0xC9]),
]

# sha256 (first 16 hex digits) of the bytes of seeded random rows [3, 4, n], frozen from the packers these
# replaced: nuq.pack_codes (PLANAR 2/3/4), latent.pack_planar (PLANAR 2/4), latent.pack_trits,
# rvq.pack_bits, and bitpack.pack (ROW)
FROZEN = [
    (Layout.ROW, {"bits": 2}, 64, "5d6b53bab6abef37"),
    (Layout.PLANAR, {"bits": 2}, 64, "8ef4cb6a88c817f0"),
    (Layout.ROW, {"bits": 3}, 64, "428ad4767453579e"),
    (Layout.PLANAR, {"bits": 3}, 64, "bada495292745f0c"),
    (Layout.ROW, {"bits": 4}, 64, "d3d93db531bf890c"),
    (Layout.PLANAR, {"bits": 4}, 64, "aae76e542ed5f673"),
    (Layout.PLANAR, {"bits": 2}, 64, "e4fd7ae71a7e1831"),
    (Layout.PLANAR, {"bits": 4}, 64, "49e830d4ac2fe323"),
    (Layout.TRITS, {}, 23, "cf935663ba3afd5e"),
    (Layout.BITSTREAM, {"widths": [6] * 16 + [5] * 16 + [3]}, 33, "978d10906df62309"),
]


def _random_codes(layout, p, n, g):
    if layout is Layout.TRITS:
        return torch.randint(0, 3, (3, 4, n), generator=g)
    if layout is Layout.BITSTREAM:
        return torch.stack([torch.randint(0, 2**w, (3, 4), generator=g) for w in p["widths"]], -1)
    return torch.randint(0, 2 ** p["bits"], (3, 4, n), generator=g)


def test_registry_names_every_layout():
    assert set(LAYOUTS) == set(Layout)
    assert all(layout.__doc__ for layout in Layout)


@pytest.mark.parametrize("layout,p,codes,want", HAND, ids=[f"{h[0]}-{h[1]}" for h in HAND])
def test_layout_bytes_and_round_trip(layout, p, codes, want):
    f = LAYOUTS[layout]
    if layout is Layout.TRITS:
        top = [2] * len(codes)
    else:
        top = [2**w - 1 for w in p["widths"]] if layout is Layout.BITSTREAM else [2 ** p["bits"] - 1] * len(codes)
    c = torch.tensor([codes, [t - x for t, x in zip(top, codes, strict=True)]])  # two rows, each packed alone
    packed = f.pack(c, **p)
    assert packed.dtype == torch.uint8 and packed.shape == (2, f.width(n=len(codes), **p))
    assert packed[0].tolist() == want
    assert torch.equal(packed[1], f.pack(c[1], **p))
    out = f.unpack(packed, n=len(codes), **p)
    assert out.dtype == torch.int64 and torch.equal(out, c)


def test_frozen_bytes_of_the_replaced_packers():
    """The seeded rows the old packers were run on, drawn in the same order: the bytes must not move."""
    g = torch.Generator().manual_seed(0)
    for layout, p, n, digest in FROZEN:
        codes = _random_codes(layout, p, n, g)
        packed = LAYOUTS[layout].pack(codes, **p)
        assert hashlib.sha256(packed.numpy().tobytes()).hexdigest()[:16] == digest, (layout, p)
        assert torch.equal(LAYOUTS[layout].unpack(packed, n=n, **p), codes), (layout, p)


@pytest.mark.parametrize("w", [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16])
def test_bitstream_one_width_fast_path_same_bytes(w):
    """pack_bits / unpack_bits with one width take an int64-chunk path: the bytes equal the bit-by-bit
    layout (mixed widths that sum the same force the general path), and empty rows round-trip."""
    g = torch.Generator().manual_seed(w)
    for n in (1, 5, 13, 64):
        c = torch.randint(0, 1 << w, (3, n), generator=g)
        general = bitpack.pack_bits(torch.cat([c, torch.zeros(3, 1, dtype=torch.long)], 1), [w] * n + [0])
        assert torch.equal(bitpack.pack_bits(c, [w] * n), general)
        assert torch.equal(bitpack.unpack_bits(general, [w] * n), c)
    empty = torch.zeros(1, 2, 0, 4, dtype=torch.long)
    assert bitpack.pack_bits(empty, [w] * 4).shape == (1, 2, 0, -(-4 * w // 8))
    assert bitpack.unpack_bits(bitpack.pack_bits(empty, [w] * 4), [w] * 4).shape == (1, 2, 0, 4)
