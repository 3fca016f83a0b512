"""Softmax top-k routing in one launch (issue 16: fewer kernels per decode layer).

Shape legend: N = tokens, E = experts, A = experts per token (top_k).

    route_topk(logits [N, E], top_k, norm) -> weights [N, A] fp32, ids [N, A] int32

The same as `moec.runtime.model.route` after its router GEMV: softmax in fp32, the top_k largest
probabilities in descending order, optionally renormalized to sum 1. torch runs this as ~6 kernels at
decode (softmax, topk's gatherTopK + bitonicSort, sum, div, casts), a few microseconds each inside a CUDA
graph, 48 times a step on Qwen3; here one program per token does it in registers: k rounds of argmax,
each removing its winner (ties go to the lower expert index). `route_topk_ref` is the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_topk_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_n,
                       A: tl.constexpr, A_P2: tl.constexpr, E_P2: tl.constexpr, NORM: tl.constexpr):
    n = tl.program_id(0)
    offs = tl.arange(0, E_P2)
    mask = offs < E
    z = tl.load(logits_ptr + n * stride_n + offs, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)  # softmax over the experts, fp32
    p = tl.where(mask, p, -1.0)  # padding never wins
    offs_a = tl.arange(0, A_P2)
    top_w = tl.zeros((A_P2,), dtype=tl.float32)
    top_i = tl.zeros((A_P2,), dtype=tl.int32)
    for a in tl.static_range(A):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, E_P2), axis=0)  # the lowest index among equals
        top_w = tl.where(offs_a == a, best, top_w)
        top_i = tl.where(offs_a == a, idx, top_i)
        p = tl.where(offs == idx, -1.0, p)
    if NORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(w_ptr + n * A + offs_a, top_w, mask=offs_a < A)
    tl.store(ids_ptr + n * A + offs_a, top_i, mask=offs_a < A)


def route_topk(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [N, A] fp32 and ids [N, A] int32 of softmax top-k routing over logits [N, E] (any float
    dtype; rows may be strided)."""
    N, E = logits.shape
    assert logits.stride(1) == 1, logits.stride()
    assert 1 <= top_k <= E, (top_k, E)
    w = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(N, top_k, dtype=torch.int32, device=logits.device)
    _route_topk_kernel[(N,)](logits, w, ids, E, logits.stride(0), A=top_k, A_P2=triton.next_power_of_2(top_k),
                             E_P2=triton.next_power_of_2(E),
                             NORM=norm, num_warps=1 if E <= 128 else 4)
    return w, ids


def route_topk_ref(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (moec.runtime.model.route after its GEMV): weights fp32, ids int32."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    return w, ids.to(torch.int32)


__all__ = ["route_topk", "route_topk_ref"]
