"""Trellis-coded quantization of weights (QTIP-style; issue 38): the fitter of a candidate 2-bit codec, measured
against hls2 by benchmarks/studies/bench_hls_study.py (method `tcq2`) before any format or kernel exists for it.

A row is one path through a bitshift trellis of L-bit states: each weight appends k bits to the state
(s_t = ((s_{t-1} << k) | b_t) mod 2^L) and decodes to code(s_t) times the row's fp16 scale, with code() computed
from the state's bits, no table (QTIP's "1MAD": x = 34038481·s + 76625530 mod 2^32, the sum of x's four bytes,
centred and scaled to unit variance: a near-Gaussian value). Storage: k bits per weight, the first state's other
L − k bits and the fp16 scale per row.

Fitting: Viterbi over the 2^L states (vectorized over rows: for each new state the best of its 2^k predecessors),
in column blocks of `block` inputs carried from one block's final state to the next; with a Hessian the blocks are
fitted in order with GPTQ's block update (the error of block j, (X_j − Q_j)·U_jj⁻¹, moved onto the later columns
through U = chol(H⁻¹), upper), i.e. block LDLQ with the trellis as the block quantizer (`weighted`: each column's
squared error weighted by the diagonal of the block's loss, U_jj⁻¹·U_jj⁻ᵀ); without one, plain MSE.
Not a registered codec yet (no stored format, no kernel): pure functions, fp32, the CPU.
"""

from __future__ import annotations

import torch

MAD_A, MAD_B = 34038481, 76625530
_MEAN, _STD = 4 * 127.5, (4 * (256**2 - 1) / 12) ** 0.5  # the sum of 4 uniform bytes


def codes(L: int) -> torch.Tensor:
    """code(s) for every L-bit state s [2^L] fp32 (QTIP's 1MAD)."""
    s = torch.arange(1 << L, dtype=torch.int64)
    x = (MAD_A * s + MAD_B) & 0xFFFFFFFF
    total = sum((x >> (8 * i)) & 0xFF for i in range(4)).float()
    return (total - _MEAN) / _STD


def viterbi(x: torch.Tensor, L: int, k: int, start: torch.Tensor | None, table: torch.Tensor,
            weight: torch.Tensor | None = None):
    """x [N, T] (unit-scale targets) -> states [N, T] int64 of the path of least (column-weighted: weight [T])
    squared error. start [N]: the state before x[:, 0] (the path must continue it), or None (any first state)."""
    N, T = x.shape
    S, low = 1 << L, 1 << (L - k)
    w = torch.ones(T) if weight is None else weight
    if start is None:
        cost = w[0] * (x[:, :1] - table[None]) ** 2
    else:  # the first state's high L − k bits are the previous state's low ones
        allowed = (torch.arange(S)[None] >> k) == (start[:, None] & (low - 1))
        cost = torch.where(allowed, w[0] * (x[:, :1] - table[None]) ** 2, torch.full((), float("inf")))
    back = torch.empty(T, N, low, dtype=torch.uint8)
    for t in range(1, T):
        best, arg = cost.view(N, 1 << k, low).min(dim=1)  # predecessor p = h·2^(L−k) + (s >> k): min over h
        back[t] = arg.to(torch.uint8)
        cost = best.repeat_interleave(1 << k, dim=1) + w[t] * (x[:, t : t + 1] - table[None]) ** 2
    states = torch.empty(N, T, dtype=torch.int64)
    s = cost.argmin(dim=1)
    states[:, -1] = s
    rows = torch.arange(N)
    for t in range(T - 1, 0, -1):
        lo = s >> k
        s = back[t][rows, lo].long() * low + lo
        states[:, t - 1] = s
    return states


def quantize(W: torch.Tensor, H: torch.Tensor | None, k: int = 2, L: int = 12, block: int = 64,
             lookahead: int = 32, weighted: bool = False, batch: int = 512) -> tuple[torch.Tensor, float]:
    """W [E, O, I] (H [E, I, I] or None) -> (W_hat [E, O, I], bits per weight stored). Each block's path is found
    over the block and the next `lookahead` columns (their targets before the block's feedback), and kept up to the
    block's end: a path cut at the block's end alone would end in the state best for that block only. weighted:
    each column's squared error weighted as below (else plain squared error within a block)."""
    E, O, I = W.shape
    table = codes(L)
    out = torch.empty_like(W, dtype=torch.float32)
    for e in range(E):
        Wf = W[e].float().clone()
        scale = Wf.pow(2).mean(1, keepdim=True).sqrt().clamp_min(1e-12).half().float()  # [O, 1]
        U = None
        if H is not None:
            He = H[e].double()
            damp = 0.01 * He.diagonal().mean()
            Hinv = torch.cholesky_inverse(torch.linalg.cholesky(He + damp * torch.eye(I, dtype=He.dtype)))
            U = torch.linalg.cholesky(Hinv, upper=True).float()
        state = None
        Q = torch.empty_like(Wf)
        for c0 in range(0, I, block):
            c1 = min(I, c0 + block)
            c2 = min(I, c1 + lookahead)
            X = Wf[:, c0:c2] / scale
            weight = None
            if U is not None and weighted:  # the block's loss (X − Q)·U⁻¹·U⁻ᵀ·(X − Q)ᵀ: its diagonal, per column
                Ui = torch.linalg.inv(U[c0:c2, c0:c2])
                weight = Ui.pow(2).sum(1)
                weight = weight / weight.mean()
            parts, finals = [], []
            for r0 in range(0, O, batch):
                st = viterbi(X[r0 : r0 + batch], L, k, None if state is None else state[r0 : r0 + batch], table,
                             weight)
                parts.append(table[st[:, : c1 - c0]])
                finals.append(st[:, c1 - c0 - 1])
            Qb = torch.cat(parts) * scale
            state = torch.cat(finals)
            Q[:, c0:c1] = Qb
            if U is not None and c1 < I:  # GPTQ's block update: the block's error onto the later columns
                err = torch.linalg.solve_triangular(U[c0:c1, c0:c1], (Wf[:, c0:c1] - Qb).T, upper=True,
                                                    left=True).T
                Wf[:, c1:] -= err @ U[c0:c1, c1:]
        out[e] = Q
    bits = k + (16 + (L - k)) / I  # codes, the fp16 row scale, the first state's other bits
    return out, bits
