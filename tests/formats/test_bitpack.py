"""Bit packing: exact round trips, and the documented physical layouts byte for byte."""

import pytest
import torch

from moec.formats.bitpack import LAYOUT_FOR_BITS, PackLayout, pack, packed_row_bytes, unpack


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
    assert LAYOUT_FOR_BITS[2] is PackLayout.U2X4


def test_u3x8_layout():
    idx = torch.tensor([[7, 0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 5]])
    # row 0: v = 7 -> bytes 7, 0, 0. row 1: v = 1 << 6 | 5 << 21 -> 64, 0, 160.
    assert pack(idx, 3).tolist() == [[7, 0, 0], [64, 0, 5 << 5]]


def test_u4x2_layout():
    assert pack(torch.tensor([[15, 1, 2]]), 4).tolist() == [[15 | 1 << 4, 2]]


def test_out_of_range_index_rejected():
    with pytest.raises(AssertionError):
        pack(torch.tensor([[4]]), 2)
