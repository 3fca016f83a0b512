"""The trellis fit's Viterbi search in one launch (calibrate/tcq.py, codec tcq): one program per row keeps the
row's 2^L path costs in registers for all T steps and writes only each step's backpointers (one byte per
predecessor group), then walks them back to the row's states in the same program.

The torch version (calibrate/tcq.viterbi) runs ~6 launches per input over [rows, 2^L] costs that live in
global memory (and keeps every step's costs for its traceback): on a GPU each step reads and writes ~4
times the cost array. Here a step touches global memory only for the input, its weight and 2^(L-k) bytes of
backpointers. The arithmetic is the torch version's, operation for operation ((x - c)² · w, then + the best
predecessor's cost, ties to the lowest index), compiled without fused multiply-adds, so both give the same
states bit for bit.

    viterbi_rows(x [N, T] fp32, table [2^L] fp32, k, weight [T] fp32 | None, start [N] int64 | None)
        -> states [N, T] int64

State s at step t reads its predecessors p = ((s mod 2^(L-k)) << k) | h, h < 2^k: the best of a group of 2^k
consecutive costs, shared by the 2^k states that end in the same low L - k bits.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# the torch version rounds (x - c)² · w and then adds: no fused multiply-add on the GPU (the interpreter has none)
_NO_FMA = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


@triton.jit
def _viterbi_kernel(x_ptr, w_ptr, table_ptr, start_ptr, bp_ptr, out_ptr, T: tl.constexpr,
                    S: tl.constexpr, K: tl.constexpr, KBITS: tl.constexpr, HAS_START: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    LOW: tl.constexpr = S // K
    offs = tl.arange(0, S)
    lows = tl.arange(0, LOW)
    table = tl.load(table_ptr + offs)
    xr = x_ptr + row * T
    bpr = bp_ptr + row * T * LOW
    d = tl.load(xr) - table
    cost = d * d * tl.load(w_ptr)
    if HAS_START:  # s_0's low L - k bits are the previous state's top ones
        st = tl.load(start_ptr + row)
        cost = tl.where((offs & (LOW - 1)) == (st >> KBITS), cost, float("inf"))
    for t in range(1, T):
        groups = tl.reshape(cost, (LOW, K))  # state p = low · K + h
        best = tl.min(groups, axis=1)
        tl.store(bpr + t * LOW + lows, tl.argmin(groups, axis=1).to(tl.uint8))
        d = tl.load(xr + t) - table
        err = d * d * tl.load(w_ptr + t)
        cost = tl.reshape(tl.reshape(err, (K, LOW)) + best[None, :], (S,))  # s = top · LOW + low
    s = tl.argmin(cost, axis=0).to(tl.int64)
    tl.debug_barrier()  # every thread's backpointers written before the walk back reads them
    outr = out_ptr + row * T
    tl.store(outr + T - 1, s)
    for i in range(1, T):
        t = T - i
        low = s & (LOW - 1)
        s = (low << KBITS) | tl.load(bpr + t * LOW + low).to(tl.int64)
        tl.store(outr + t - 1, s)


def viterbi_rows(x: torch.Tensor, table: torch.Tensor, k: int, weight: torch.Tensor | None = None,
                 start: torch.Tensor | None = None) -> torch.Tensor:
    """states [N, T] int64 of each row's least (column-weighted) squared-error path (module docstring)."""
    N, T = x.shape
    S = table.numel()
    assert S & (S - 1) == 0 and k >= 1 and S >> k >= 1, (S, k)
    x = x.float().contiguous()
    w = torch.ones(T, device=x.device) if weight is None else weight.float().contiguous()
    out = torch.empty(N, T, dtype=torch.int64, device=x.device)
    if N == 0:
        return out
    bp = torch.empty(N, T, S >> k, dtype=torch.uint8, device=x.device)
    st = start.contiguous() if start is not None else out  # not read without HAS_START
    # T is a compile-time constant (a fit's blocks take a handful of lengths; Triton's interpreter loops only
    # over constant bounds)
    _viterbi_kernel[(N,)](x, w, table.float().contiguous(), st, bp, out, T=T, S=S, K=1 << k, KBITS=k,
                          HAS_START=start is not None, num_warps=8, **_NO_FMA)
    return out
