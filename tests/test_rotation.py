"""moec/rotation.py: the fast block-Hadamard apply against the dense rotation matrix."""

import pytest
import torch

from moec.errors import UserError
from moec.rotation import (
    block_hadamard,
    hadamard_signs,
    pack_signs,
    rotate,
    rotate_hessian,
    signs_error,
    signs_layout_error,
    unpack_signs,
)


@pytest.mark.parametrize("n,block", [(576, 64), (1536, 512), (40, 8), (48, 16), (8, 1)])
def test_rotate_is_the_dense_orthogonal_matmul(n, block):
    R = block_hadamard(n, block, seed=7).double()  # built in fp32: entries ±1/√b to 1 ulp
    torch.testing.assert_close(R @ R.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-6)  # orthogonal
    s = hadamard_signs(n, block, seed=7)
    assert s.dtype == torch.int8 and s.shape == (n // block, block) and set(s.unique().tolist()) <= {-1, 1}
    x = torch.randn(3, 5, n, dtype=torch.float64)
    # float64 apply vs R's fp32 entries: agree to ~1e-7 of values ~1 (a wrong sign or block: errors ~1)
    torch.testing.assert_close(rotate(x, s), x @ R, rtol=0, atol=1e-5)
    torch.testing.assert_close(rotate(x, s, inverse=True), x @ R.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(rotate(rotate(x, s), s, inverse=True), x, rtol=0, atol=1e-12)
    if n > 576:
        return  # the dense Hessian products below cost seconds at n = 1536
    X = torch.randn(64, n, dtype=torch.float64)
    H = X.T @ X
    tol = 1e-6 * H.abs().max().item()
    torch.testing.assert_close(rotate_hessian(H, s), R.T @ H @ R, rtol=0, atol=tol)
    torch.testing.assert_close(rotate_hessian(H, s), (X @ R).T @ (X @ R), rtol=0, atol=tol)


def test_signs_are_seeded():
    assert torch.equal(hadamard_signs(64, 16, 3), hadamard_signs(64, 16, 3))
    assert not torch.equal(hadamard_signs(64, 16, 3), hadamard_signs(64, 16, 4))


def test_bad_block_is_a_user_error():
    with pytest.raises(UserError, match="must be a power of two dividing the dimension 576"):
        block_hadamard(576, 128)


@pytest.mark.parametrize("n,block", [(576, 64), (1536, 512), (40, 8), (48, 16), (12, 4), (6, 2), (5, 1)])
def test_signs_pack_round_trip(n, block):
    """had_signs are stored one bit each (uint8 [n / b, ceil(b / 8)]): pack -> unpack is exact, int8 signs
    (older packs) pass through, and the bytes are pinned: bit k % 8 of byte k // 8, 1 for −1."""
    s = hadamard_signs(n, block, 7)
    p = pack_signs(s)
    assert p.dtype == torch.uint8 and p.shape == (n // block, -(-block // 8))
    assert torch.equal(unpack_signs(p, n), s) and unpack_signs(p, n).dtype == torch.int8
    assert torch.equal(unpack_signs(s, n), s)
    bits = ((p[..., None].long() >> torch.arange(8)) & 1).flatten(-2)[:, :block]
    assert torch.equal(bits, (s < 0).long())


def test_block_hadamard_uses_hadamard_signs():
    """The dense R and the stored signs come from one generator: R's column signs are hadamard_signs."""
    R, k = block_hadamard(48, 16, seed=5), torch.arange(48)
    first = R[k // 16 * 16, k]  # each column's entry in the first row of its block: H_b's first row is all +1
    assert torch.equal(torch.sign(first), hadamard_signs(48, 16, 5).flatten().float())


@pytest.mark.parametrize("signs,n,reason", [
    (pack_signs(hadamard_signs(64, 16, 1)), 64, None),  # uint8 [4, 2]
    (pack_signs(hadamard_signs(12, 4, 1)), 12, None),  # uint8 [3, 1], b < 8: 4 bits used
    (hadamard_signs(64, 16, 1), 64, None),  # int8 ±1 [4, 16] (packs before bit packing)
    (torch.full((3, 1), 0xF0, dtype=torch.uint8), 12, "padding bits"),
    (torch.tensor([[1, -1, 0, 1]] * 2, dtype=torch.int8), 8, "other than ±1"),
    (torch.ones(3, 20, dtype=torch.int8), 60, "expected uint8"),  # block 20: not a power of two
    (torch.zeros(3, 3, dtype=torch.uint8), 60, "expected uint8"),  # block 20 (bit-packed)
    (torch.zeros(4, 3, dtype=torch.uint8), 64, "expected uint8"),  # block 16: 2 bytes wide, not 3
    (torch.ones(4, 8, dtype=torch.int8), 64, "expected uint8"),  # block 16: 16 signs wide, not 8
    (torch.ones(64, dtype=torch.int8), 64, "expected uint8"),  # 1-D
    (torch.zeros(4, 2, dtype=torch.int16), 64, "expected uint8"),  # another dtype
])
def test_signs_error(signs, n, reason):
    """One check of a stored had_signs part (loader, QuantMatrix and unpack_signs all use it)."""
    err = signs_error(signs, n)
    assert err is None if reason is None else reason in err, err
    if reason is None:
        unpack_signs(signs, n)
    else:
        with pytest.raises(ValueError, match="had_signs is"):
            unpack_signs(signs, n)
    layout = signs_layout_error(str(signs.dtype).removeprefix("torch."), list(signs.shape), n)
    assert (layout is None) == (reason is None or "expected" not in reason), layout  # values: not a layout error
