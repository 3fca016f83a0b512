"""moec/rotation.py: the fast block-Hadamard apply against the dense rotation matrix."""

import pytest
import torch

from moec.errors import UserError
from moec.rotation import block_hadamard, hadamard_signs, pack_signs, rotate, rotate_hessian, unpack_signs


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
