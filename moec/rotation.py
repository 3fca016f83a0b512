"""Randomized (block-)Hadamard rotations: the orthogonal transforms of incoherence processing (QuIP#,
QuaRot). Rotating a vector by R = blockdiag(H_b)·diag(±1)/√b spreads each channel's energy over the
b channels of its block, so a few large channels (RoPE's low-frequency key pairs, massive value
channels) no longer set the quantization scale of everything else. Orthogonality makes the rotation
free for attention: (qR)·(kR) = q·k and Σ p·(vR) = (Σ p·v)R.

Real dimensions are not all powers of two (576 = 9·64): the block is the largest power of two dividing
the dimension (or a given one), one Hadamard per block.
"""

from __future__ import annotations

import torch

from .errors import UserError


def pow2_block(n: int) -> int:
    """The largest power of two dividing n."""
    return n & -n


def block_hadamard(n: int, block: int = 0, seed: int = 0) -> torch.Tensor:
    """R [n, n] fp32, orthogonal: blockdiag(Sylvester Hadamard of `block`) · diag(random ±1) / √block;
    block 0: the largest power of two dividing n. Rotate row vectors as x @ R, undo with @ R.T."""
    block = block or pow2_block(n)
    if block < 1 or block & (block - 1) or n % block:
        raise UserError(f"Hadamard block {block}: must be a power of two dividing the dimension {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    return torch.block_diag(*[h] * (n // block)) * signs[None, :] / block**0.5
