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
from .formats.bitpack import pack_bits, unpack_bits


def pow2_block(n: int) -> int:
    """The largest power of two dividing n."""
    return n & -n


def block_hadamard(n: int, block: int = 0, seed: int = 0) -> torch.Tensor:
    """R [n, n] fp32, orthogonal: blockdiag(Sylvester Hadamard of `block`) · diag(random ±1) / √block;
    block 0: the largest power of two dividing n. Rotate row vectors as x @ R, undo with @ R.T. The signs
    are hadamard_signs(n, block, seed): the dense R of the rotation that rotate() applies."""
    block = block or pow2_block(n)
    if block < 1 or block & (block - 1) or n % block:
        raise UserError(f"Hadamard block {block}: must be a power of two dividing the dimension {n}")
    signs = hadamard_signs(n, block, seed).flatten().float()
    return torch.block_diag(*[hadamard(block)] * (n // block)) * signs[None, :] / block**0.5


def hadamard(block: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The Sylvester Hadamard matrix H_b [b, b] (entries ±1, b a power of two), unnormalized."""
    h = torch.ones(1, 1, device=device, dtype=dtype)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_signs(n: int, block: int, seed: int) -> torch.Tensor:
    """The ±1 sign vector of a randomized block-Hadamard rotation of n channels, as int8 [n / block, block]
    (the shape carries the block: this is what a packed checkpoint stores, runtime/experts.QuantMatrix).
    Same signs as block_hadamard(n, block, seed)."""
    assert block >= 1 and block & (block - 1) == 0 and n % block == 0, (n, block)
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return signs.to(torch.int8).view(n // block, block)


def pack_signs(signs: torch.Tensor) -> torch.Tensor:
    """±1 signs [n / b, b] (any dtype) -> uint8 [n / b, ceil(b / 8)], one bit per sign: sign k of block j is
    bit k % 8 of byte [j, k // 8] (formats/bitpack.Layout.BITSTREAM with 1-bit codes), 1 for −1, 0 for +1;
    a block of fewer than 8 signs takes one byte. What a checkpoint stores as `had_signs` (formats/codecs.py):
    n / 8 bytes instead of the n of int8 signs. The block is the input dim over the number of rows."""
    nb, b = signs.shape
    return pack_bits((signs < 0).to(torch.int64), [1] * b)


def signs_layout_error(dtype_name: str, shape: list | tuple, n: int) -> str | None:
    """Why a stored `had_signs` part of dtype `dtype_name` (checkpoint.dtype_name: "uint8", "int8") and
    `shape` is not the sign vector of a rotation over n inputs, or None when it is: bit-packed uint8
    [n / b, ceil(b / 8)] (pack_signs) or int8 [n / b, b] (packs before bit packing), b = n / rows a power
    of two. Shapes only: the loader checks a manifest with it before any tensor is read."""
    rows = shape[0] if isinstance(shape, (list, tuple)) and len(shape) == 2 else 0
    b = n // rows if isinstance(rows, int) and rows > 0 and n % rows == 0 else 0
    width = {"uint8": -(-b // 8), "int8": b}.get(dtype_name) if isinstance(dtype_name, str) else None
    if b > 0 and not b & (b - 1) and width is not None and shape[1] == width:
        return None
    return (f"{dtype_name} {list(shape) if isinstance(shape, (list, tuple)) else shape!r}, expected uint8 "
            f"[{n} / b, ceil(b / 8)] (bit-packed) or int8 [{n} / b, b], b a power of two")


def signs_error(signs: torch.Tensor, n: int) -> str | None:
    """Why `signs` is not a stored `had_signs` part over n inputs (signs_layout_error, then the values:
    int8 entries ±1; uint8 padding bits zero when b < 8, so that a part has one encoding), or None."""
    dtype = str(signs.dtype).removeprefix("torch.")
    err = signs_layout_error(dtype, list(signs.shape), n)
    if err is not None:
        return err
    b = n // signs.shape[0]
    if signs.dtype == torch.int8 and not bool(((signs == 1) | (signs == -1)).all()):
        return f"int8 {list(signs.shape)} with entries other than ±1"
    if signs.dtype == torch.uint8 and b < 8 and bool((signs >> b).any()):
        return f"uint8 {list(signs.shape)} with padding bits set (a block of {b} signs uses the low {b} bits)"
    return None


def unpack_signs(stored: torch.Tensor, n: int) -> torch.Tensor:
    """A stored `had_signs` part -> int8 ±1 signs [n / b, b] for a matrix of n inputs: bit-packed uint8
    [n / b, ceil(b / 8)] (pack_signs, b = n / rows), or int8 ±1 [n / b, b] as checkpoints before bit
    packing stored them (returned as is). The dtype tells the two apart; ValueError (signs_error's
    reason) on anything else."""
    err = signs_error(stored, n)
    if err is not None:
        raise ValueError(f"had_signs is {err}")
    if stored.dtype == torch.int8:
        return stored
    return (1 - 2 * unpack_bits(stored, [1] * (n // stored.shape[0]))).to(torch.int8)


def rotate(x: torch.Tensor, signs: torch.Tensor, h: torch.Tensor | None = None,
           inverse: bool = False) -> torch.Tensor:
    """x @ R (inverse: x @ Rᵀ) along the last dim for R = blockdiag(H_b)·diag(signs)/√b, without forming
    R: x [..., n], signs [n / b, b] (±1, any dtype) -> [..., n] in x's dtype. Cost n·b per row (one
    batched matmul); `h` is a cached hadamard(b) in x's dtype/device. No host sync (CUDA-graph safe)."""
    nb, b = signs.shape
    if h is None:
        h = hadamard(b, x.device, x.dtype)
    s = signs.to(x.dtype) * b**-0.5
    xb = x.reshape(*x.shape[:-1], nb, b)
    y = (xb * s) @ h if inverse else (xb @ h) * s  # Rᵀ = diag(s) H_b / √b (H_b symmetric)
    return y.reshape(x.shape)


def rotate_hessian(H: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Rᵀ H R for H [..., n, n] symmetric: the second moment of x @ R when H is that of x."""
    HR = rotate(H, signs)  # H R
    return rotate(HR.transpose(-1, -2), signs)  # (H R)ᵀ R = Rᵀ H R
