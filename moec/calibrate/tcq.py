"""Trellis-coded quantization of weights (QTIP-style; issue 38): the fit of the tcq weight codec (moec/codecs/tcq.py;
the trellis, the computed code and the stored stream in runtime/tcq.py) and its end-to-end tunable row scales.

A row is one path through a bitshift trellis of L-bit states (each weight's k-bit symbol enters at the top of the
state); the fit chooses the path whose codes, times the row's scale, best match the row.

Fitting: Viterbi over the 2^L states (vectorized over rows: for each new state the best of its 2^k predecessors),
in column blocks of `block` inputs carried from one block's final state to the next; with a Hessian the blocks are
fitted in order with GPTQ's block update (the error of block j, (X_j − Q_j)·U_jj⁻¹, moved onto the later columns
through U = chol(H⁻¹), upper), i.e. block LDLQ with the trellis as the block quantizer, each column's squared error
weighted by the diagonal of the block's loss, U_jj⁻¹·U_jj⁻ᵀ; without one, plain squared error. Each block's path
is searched over the block and the next `lookahead` columns (their targets before the block's feedback) and kept
to the block's end: a path cut at the block's end alone would end in the state best for that block only.
benchmarks/studies/bench_hls_study.py (method `tcq`) measured the choices (block 8, weighted, lookahead 32).
"""

from __future__ import annotations

import os

import torch

from ..formats.codecs import TCQ_STATE_BITS
from ..runtime.tcq import CODE_STD, code_of, code_table, pack_states, row_scale, unpack_states, with_lead_scale

BLOCK = 8  # inputs per block-LDLQ step (a rule's group_size 0)
LOOKAHEAD = 32
# The row scale over rms / CODE_STD the paths are searched at: on Gaussian rows the trellis's squared error is
# least near 1.0 at 2 bits and near 1.1 at 3 and 4 bits (0.0188 vs 0.0193 of the variance at 3 bits; L = 12)
SCALE_GAIN = {2: 1.0, 3: 1.1, 4: 1.1}


# The cost history a Viterbi call of the torch search keeps (rows are searched in chunks under it), and the rows one
# call of the fit searches: on a GPU (the Viterbi kernel: 2^(L-k) bytes of backpointers per row and input) wide calls
# fill the device, on a CPU 512 rows already fill the cores
HISTORY_BYTES = {"cpu": 512 << 20, "cuda": 4 << 30}
FIT_ROWS = {"cpu": 512, "cuda": 8192}


def viterbi(x: torch.Tensor, L: int, k: int, start: torch.Tensor | None, table: torch.Tensor,
            weight: torch.Tensor | None = None, workspace: list | None = None) -> torch.Tensor:
    """x [N, T] (targets in code units) -> states [N, T] int64 of the path of least (column-weighted: weight [T])
    squared error. start [N]: the state before x[:, 0] (the path continues it), or None (any first state).
    workspace: a list the caller keeps between calls (the cost history's buffer is reused from it). On CUDA the
    Triton kernel of kernels/tcq_viterbi.py gives the same states (MOEC_TCQ_VITERBI=torch: this code there too)."""
    if x.device.type == "cuda" and os.environ.get("MOEC_TCQ_VITERBI") != "torch":
        # one launch, the path costs in registers (kernels/tcq_viterbi.py): the same states, ~6 launches per
        # input fewer and no cost history in global memory
        from ..kernels.tcq_viterbi import viterbi_rows

        return viterbi_rows(x, table, k, weight, start)
    N, T = x.shape
    rows = max(1, HISTORY_BYTES.get(x.device.type, HISTORY_BYTES["cpu"]) // (T * (4 << L)))
    if N > rows:
        return torch.cat([viterbi(x[r : r + rows], L, k, None if start is None else start[r : r + rows], table,
                                  weight, workspace) for r in range(0, N, rows)])
    S, low, K = 1 << L, 1 << (L - k), 1 << k
    dev = x.device
    w = torch.ones(T, device=dev) if weight is None else weight
    # Forward pass with the best predecessor's cost only (amin): the costs of every step are kept and the
    # traceback re-finds each step's predecessor among its 2^k candidates (argmin over the last small dimension
    # costs ~4x amin on CPU). The history lives in one buffer reused across calls: fresh pages for every step
    # cost more than the step's arithmetic.
    ws = workspace if workspace is not None else []
    if not ws or ws[0].device != dev or ws[0].numel() < T * N * S:
        ws[:] = [torch.empty(T * N * S, device=dev)]
    history = ws[0][: T * N * S].view(T, N, S)
    cost = torch.sub(x[:, :1], table[None], out=history[0]).square_().mul_(w[0])
    if start is not None:  # s_0's low L − k bits are the previous state's top ones
        allowed = (torch.arange(S, device=dev)[None] & (low - 1)) == (start[:, None] >> k)
        cost.masked_fill_(~allowed, float("inf"))
    best = torch.empty(N, low, device=dev)
    for t in range(1, T):
        # s's predecessors are p = ((s mod 2^(L−k)) << k) | h: the best over h for each s mod 2^(L−k)
        # (a chain of minimums over the strided candidates: 1.6x amin's speed at 2^k = 4 on CPU, equal at 8)
        pred = cost.view(N, low, K)
        torch.minimum(pred[..., 0], pred[..., 1], out=best)
        for h in range(2, K):
            torch.minimum(best, pred[..., h], out=best)
        err = torch.sub(x[:, t : t + 1], table[None], out=history[t]).square_().mul_(w[t])
        cost = err.view(N, K, low).add_(best[:, None, :]).view(N, S)  # s = top · 2^(L−k) + low
    states = torch.empty(N, T, dtype=torch.int64, device=dev)
    s = cost.argmin(dim=1)
    states[:, -1] = s
    h = torch.arange(K, device=dev)
    for t in range(T - 1, 0, -1):
        pred = ((s & (low - 1)) << k)[:, None] | h  # [N, 2^k] the candidates
        s = pred.gather(1, history[t - 1].gather(1, pred).argmin(dim=1, keepdim=True))[:, 0]
        states[:, t - 1] = s
    return states


def fit(W: torch.Tensor, H: torch.Tensor | None, k: int, L: int = TCQ_STATE_BITS, block: int = BLOCK,
        lookahead: int = LOOKAHEAD, weighted: bool = True,
        batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [E, O, I] (H [E, I, I] or None) -> (states [E, O, I] int64, row scales [E, O] fp32 holding fp16 values):
    W_hat = code(states) · scale. weighted: False fits each block by its plain squared error (the study's
    ablation). batch: rows per Viterbi call (None: FIT_ROWS of the device)."""
    E, O, I = W.shape
    dev = W.device
    batch = batch or FIT_ROWS.get(dev.type, FIT_ROWS["cpu"])
    table = code_table(L).to(dev)
    workspace: list = []
    all_states = torch.empty(E, O, I, dtype=torch.int64, device=dev)
    scales = torch.empty(E, O, device=dev)
    for e in range(E):
        Wf = W[e].float().clone()
        rms = Wf.pow(2).mean(1, keepdim=True).sqrt()
        scale = (rms * SCALE_GAIN.get(k, 1.0) / CODE_STD).clamp_min(1e-7).half().float()  # [O, 1]
        U = None
        if H is not None:
            He = H[e].double()
            damp = 0.01 * He.diagonal().mean()
            Hinv = torch.cholesky_inverse(torch.linalg.cholesky(He + damp * torch.eye(I, dtype=He.dtype, device=dev)))
            U = torch.linalg.cholesky(Hinv, upper=True).float()
        state = None
        for c0 in range(0, I, block):
            c1 = min(I, c0 + block)
            c2 = min(I, c1 + lookahead)
            X = Wf[:, c0:c2] / scale
            weight = None
            if U is not None and weighted:  # the block's loss (X − Q)·U⁻¹·U⁻ᵀ·(X − Q)ᵀ: its diagonal, per column
                weight = torch.linalg.inv(U[c0:c2, c0:c2]).pow(2).sum(1)
                weight = weight / weight.mean()
            finals = []
            for r0 in range(0, O, batch):
                st = viterbi(X[r0 : r0 + batch], L, k, None if state is None else state[r0 : r0 + batch], table,
                             weight, workspace)
                all_states[e, r0 : r0 + batch, c0:c1] = st[:, : c1 - c0]
                finals.append(st[:, c1 - c0 - 1])
            state = torch.cat(finals)
            Qb = table[all_states[e, :, c0:c1]] * scale
            if U is not None and c1 < I:  # GPTQ's block update: the block's error onto the later columns
                err = torch.linalg.solve_triangular(U[c0:c1, c0:c1], (Wf[:, c0:c1] - Qb).T, upper=True,
                                                    left=True).T
                Wf[:, c1:] -= err @ U[c0:c1, c1:]
        scales[e] = scale[:, 0]
    return all_states, scales


def quantize_tcq_rule(W: torch.Tensor, H: torch.Tensor | None, rule) -> dict:
    """The registry's `quantize` hook: stored parts {codes uint8 [E, O, 4 · row words]}, the fp16 row scales in the
    rows' lead words (formats/codecs.py WeightCodec.TCQ). group_size: the block-LDLQ step (0: BLOCK); `gptq:
    false` fits each row by plain squared error without error feedback."""
    states, scale = fit(W, H if rule.gptq else None, rule.bits, block=rule.group_size or BLOCK)
    return {"codes": pack_states(states, rule.bits, scale.half())}


class TunedTCQ:
    """A tcq matrix's tunable values (calibrate/tune.py protocol; the registry's `tune` hook): delta_s [E, O] on the
    row scales (relative to each), stored back as fp16 into the lead words; the trellis paths stay fixed."""

    def __init__(self, bits: int, shape: tuple, parts: dict, flat: bool, dev: torch.device):
        E, O, I = shape
        self.flat = flat
        parts = {p: v.to(dev)[None] if flat else v.to(dev) for p, v in parts.items()}  # [E, ...]
        self.code = code_of(unpack_states(parts["codes"], bits, I))  # [E, O, I] fp32
        self.codes = None if "row_scale" in parts else parts["codes"]  # a stop-50 pack keeps its row_scale part
        self.base_s = row_scale(parts).float()
        self.ref_s = self.base_s.abs().clamp_min(1e-12)
        self.delta_s = torch.zeros_like(self.base_s, requires_grad=True)
        self.deltas = [self.delta_s]

    def scale(self) -> torch.Tensor:
        return self.base_s + self.ref_s * self.delta_s

    def weight(self) -> torch.Tensor:
        """W_hat [E, O, I] (the stored basis: W·R under incoherence)."""
        return self.code * self.scale()[..., None]

    @torch.no_grad()
    def round_to_stored(self) -> None:
        self.delta_s.copy_((self.scale().half().float() - self.base_s) / self.ref_s)

    @torch.no_grad()
    def stored(self) -> dict[str, torch.Tensor]:
        sc = self.scale()
        assert torch.isfinite(sc).all(), "non-finite row scales after tuning"
        if self.codes is None:
            return {"row_scale": (sc.half()[0] if self.flat else sc.half()).cpu().contiguous()}
        codes = with_lead_scale(self.codes, sc.half())
        return {"codes": (codes[0] if self.flat else codes).cpu().contiguous()}
