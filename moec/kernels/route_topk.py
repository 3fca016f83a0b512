"""Top-k routing in one launch (issue 16: fewer kernels per decode layer; sigmoid group routing: issues 35, 36).

Shape legend: N = tokens, E = experts, A = experts per token (top_k).

    route_topk(logits [N, E], top_k, norm) -> weights [N, A] fp32, ids [N, A] int32
    route_gemv_topk(x [N, D], router [E, D], top_k, norm) -> the same, the router GEMV included
    route_sigmoid_topk(logits [N, E], score_bias [E] | None, top_k, norm, n_group, topk_group, scale)
        -> DeepSeek-V3 / GLM-4.5 routing (sigmoid scores, correction bias, group top-2) the same way

The same as `moec.runtime.model.route` after its router GEMV: softmax in fp32, the top_k largest
probabilities in descending order, optionally renormalized to sum 1. torch runs this as ~6 kernels at
decode (softmax, topk's gatherTopK + bitonicSort, sum, div, casts), a few microseconds each inside a CUDA
graph, 48 times a step on Qwen3; here one program per token does it in registers: k rounds of argmax,
each removing its winner (ties go to the lower expert index). `route_topk_ref` is the torch reference.

route_gemv_topk also does the router GEMV, which cuBLAS runs as a separate launch per layer at decode
(pure latency at Qwen3's [128, 2048] router; issue 16 asks for on-chip routing). A single program cannot
read the router fast enough (the whole router through one SM), so the GEMV is split over programs of
BLOCK_E experts × BLOCK_D inputs each (one load of the router per program); every program writes its partial
logits and takes a ticket from a counter, and the program that takes the last ticket (all partials written:
the ticket is an acq_rel atomic after a barrier) sums them in a fixed order, does the softmax/top-k for
every token (ranks from one comparison matrix, not k rounds of argmax) and puts the counter back to 0, so
the next launch (a CUDA-graph replay) finds it zeroed. Profiled on the H200 (bench_latency profiles, per
layer, CUDA graphs; docs/kernel-configs.md): faster than cuBLAS + route_topk for Mixtral's [8, 4096]
router, slower for Qwen3's [128, 2048] (the [128, 128] rank comparison in one program of 4 warps is the
slow part), so the engine uses it up to GEMV_MAX_EXPERTS experts. Launches sharing a counter must not
overlap: one counter per device, used by one stream (the decode step). The logits are rounded to x's dtype
before the softmax, as `x @ router.t()` rounds them in the torch path, so both pick the same experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import begin as pdl_begin


@triton.jit
def _topk_row(z, offs, mask, w_ptr, ids_ptr, n, E_P2: tl.constexpr, A: tl.constexpr, A_P2: tl.constexpr,
              NORM: tl.constexpr):
    """Softmax of one token's logits z [E_P2] (fp32, -inf past E), its top A, stored at row n."""
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


@triton.jit
def _route_topk_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_n,
                       A: tl.constexpr, A_P2: tl.constexpr, E_P2: tl.constexpr, NORM: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    n = tl.program_id(0)
    offs = tl.arange(0, E_P2)
    mask = offs < E
    z = tl.load(logits_ptr + n * stride_n + offs, mask=mask, other=float("-inf")).to(tl.float32)
    _topk_row(z, offs, mask, w_ptr, ids_ptr, n, E_P2, A, A_P2, NORM)


@triton.jit
def _topk_rank_row(z, offs, mask, w_ptr, ids_ptr, n, E_P2: tl.constexpr, A: tl.constexpr, NORM: tl.constexpr):
    """_topk_row in one step: each expert's rank (how many beat it; ties to the lower index) from one
    [E_P2, E_P2] comparison, the top A stored at their ranks. A rounds of argmax are 2A dependent
    reductions; this is one."""
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(mask, p, -1.0)
    offs_j = tl.arange(0, E_P2)
    beats = (p[None, :] > p[:, None]) | ((p[None, :] == p[:, None]) & (offs_j[None, :] < offs[:, None]))
    rank = tl.sum(beats.to(tl.int32), axis=1)  # [E_P2]
    sel = (rank < A) & mask
    if NORM:
        p = p / tl.sum(tl.where(sel, p, 0.0), axis=0)
    tl.store(w_ptr + n * A + rank, p, mask=sel)
    tl.store(ids_ptr + n * A + rank, offs, mask=sel)


@triton.jit
def _sigmoid_rank_row(z, offs, mask, bias_ptr, w_ptr, ids_ptr, n, E_P2: tl.constexpr, A: tl.constexpr,
                      NORM: tl.constexpr, HAS_BIAS: tl.constexpr, scale):
    """_route_sigmoid_kernel's routing without groups (one group: GLM-4.5), by ranks as _topk_rank_row: sigmoid
    scores, + the correction bias for the choice, the top A (ties to the lower index), their unbiased scores
    (renormalized) times scale, stored at their ranks in row n."""
    s = tl.sigmoid(z)
    c = s + tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32) if HAS_BIAS else s
    c = tl.where(mask, c, float("-inf"))
    offs_j = tl.arange(0, E_P2)
    beats = (c[None, :] > c[:, None]) | ((c[None, :] == c[:, None]) & (offs_j[None, :] < offs[:, None]))
    rank = tl.sum(beats.to(tl.int32), axis=1)
    sel = (rank < A) & mask
    if NORM:
        s = s / (tl.sum(tl.where(sel, s, 0.0), axis=0) + 1e-20)
    tl.store(w_ptr + n * A + rank, s * scale, mask=sel)
    tl.store(ids_ptr + n * A + rank, offs, mask=sel)


@triton.jit
def _route_gemv_topk_kernel(x_ptr, r_ptr, part_ptr, count_ptr, w_ptr, ids_ptr, N, E, D: tl.constexpr,
                            N_P2: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                            A: tl.constexpr, E_P2: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    """Program (e, c): partial logits [N, BLOCK_E] of experts e·BLOCK_E.. over inputs c·BLOCK_D.. into
    part_ptr [D/BLOCK_D, N, E] fp32 (one load of the router tile each); the last program to finish sums the
    partials in a fixed order (deterministic, unlike atomic adds) and routes every token."""
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    pe = tl.program_id(0)
    pc = tl.program_id(1)
    NC: tl.constexpr = (D + BLOCK_D - 1) // BLOCK_D
    offs_n = tl.arange(0, N_P2)
    offs_e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = pc * BLOCK_D + tl.arange(0, BLOCK_D)
    nmask = offs_n < N
    emask = offs_e < E
    dm = offs_d < D
    x = tl.load(x_ptr + offs_n[:, None] * D + offs_d[None, :], mask=nmask[:, None] & dm[None, :],
                other=0.0).to(tl.float32)  # [N_P2, BLOCK_D]
    r = tl.load(r_ptr + offs_e[:, None] * D + offs_d[None, :], mask=emask[:, None] & dm[None, :],
                other=0.0).to(tl.float32)  # [BLOCK_E, BLOCK_D]
    acc = tl.sum(x[:, None, :] * r[None, :, :], axis=2)  # [N_P2, BLOCK_E]
    tl.store(part_ptr + (pc * N + offs_n[:, None]) * E + offs_e[None, :], acc,
             mask=nmask[:, None] & emask[None, :])
    tl.debug_barrier()  # every thread's partials are stored before the ticket is taken
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last program: all partials are visible
        offs = tl.arange(0, E_P2)
        mask = offs < E
        for n in tl.static_range(N_P2):
            if n < N:
                z = tl.zeros([E_P2], dtype=tl.float32)
                for c in range(NC):
                    z += tl.load(part_ptr + (c * N + n) * E + offs, mask=mask, other=0.0, cache_modifier=".cg")
                z = z.to(x_ptr.dtype.element_ty).to(tl.float32)  # the torch path's logits are in x's dtype
                _topk_rank_row(tl.where(mask, z, float("-inf")), offs, mask, w_ptr, ids_ptr, n, E_P2, A, NORM)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")  # zeroed for the next launch


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
                             NORM=norm, num_warps=1 if E <= 128 else 4, **pdl.options(logits.device))
    return w, ids


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # one zeroed ticket counter per device (see the docstring)
GEMV_MAX_TOKENS = 4  # more tokens: cuBLAS's GEMM and route_topk (the GEMV tile holds [N, BLOCK_E, BLOCK_D])
GEMV_MAX_EXPERTS = 32  # more experts: cuBLAS + route_topk were faster (the module docstring)


def route_gemv_topk(x: torch.Tensor, router: torch.Tensor, top_k: int, norm: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [N, A] fp32 and ids [N, A] int32 of model.route(x, router): x [N, D] (N <= GEMV_MAX_TOKENS)
    and router [E, D] of one dtype, contiguous. Capturable (no host syncs; the counter is made on the first
    call, which must come before a capture, as the engine's warm-up step does)."""
    N, D = x.shape
    E = router.shape[0]
    assert router.shape == (E, D) and x.dtype == router.dtype, (x.shape, router.shape, x.dtype, router.dtype)
    assert x.is_contiguous() and router.is_contiguous() and 1 <= top_k <= E and 1 <= N <= GEMV_MAX_TOKENS
    count = _COUNTERS.get(x.device)
    if count is None:
        count = _COUNTERS[x.device] = torch.zeros(1, dtype=torch.int32, device=x.device)
    n_p2 = triton.next_power_of_2(N)
    block_d = min(256, triton.next_power_of_2(D))
    block_e = max(1, min(triton.next_power_of_2(E), 16 // n_p2))  # one [N, BLOCK_E] x BLOCK_D tile a program
    part = torch.empty(triton.cdiv(D, block_d), N, E, dtype=torch.float32, device=x.device)
    w = torch.empty(N, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(N, top_k, dtype=torch.int32, device=x.device)
    _route_gemv_topk_kernel[(triton.cdiv(E, block_e), triton.cdiv(D, block_d))](
        x, router, part, count, w, ids, N, E, D, N_P2=n_p2, BLOCK_E=block_e, BLOCK_D=block_d, A=top_k,
        E_P2=triton.next_power_of_2(E), NORM=norm, num_warps=4, **pdl.options(x.device))
    return w, ids


@triton.jit
def _route_sigmoid_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_n, scale,
                          G: tl.constexpr, G_P2: tl.constexpr, EG: tl.constexpr, EG_P2: tl.constexpr,
                          KG: tl.constexpr, A: tl.constexpr, A_P2: tl.constexpr, HAS_BIAS: tl.constexpr,
                          NORM: tl.constexpr, PDL: tl.constexpr = False):
    """One token: sigmoid scores, + the correction bias for the choice, the KG groups of largest top-2 sums kept
    (KG < G), the top A experts of those, their unbiased scores (renormalized) times `scale`. Experts as
    [G_P2, EG_P2] tiles: group g holds experts g·EG .. g·EG + EG - 1."""
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    n = tl.program_id(0)
    g = tl.arange(0, G_P2)
    j = tl.arange(0, EG_P2)
    m = (g[:, None] < G) & (j[None, :] < EG)
    e = g[:, None] * EG + j[None, :]
    s = tl.sigmoid(tl.load(logits_ptr + n * stride_n + e, mask=m, other=0.0).to(tl.float32))
    c = s + tl.load(bias_ptr + e, mask=m, other=0.0).to(tl.float32) if HAS_BIAS else s
    c = tl.where(m, c, float("-inf"))
    if KG < G:  # group_top2: a group's score is the sum of its two largest biased scores
        t1 = tl.max(c, axis=1)
        i1 = tl.min(tl.where(c == t1[:, None], j[None, :], EG_P2), axis=1)
        t2 = tl.max(tl.where(j[None, :] == i1[:, None], float("-inf"), c), axis=1)
        gs = tl.where(g < G, t1 + t2, float("-inf"))
        keep = g < 0
        for _ in tl.static_range(KG):
            best = tl.max(gs, axis=0)
            gi = tl.min(tl.where(gs == best, g, G_P2), axis=0)  # the lowest index among equals
            keep = keep | (g == gi)
            gs = tl.where(g == gi, float("-inf"), gs)
        c = tl.where(keep[:, None], c, float("-inf"))
    offs_a = tl.arange(0, A_P2)
    top_w = tl.zeros((A_P2,), dtype=tl.float32)
    top_i = tl.zeros((A_P2,), dtype=tl.int32)
    for a in tl.static_range(A):
        best = tl.max(tl.max(c, axis=1), axis=0)
        idx = tl.min(tl.min(tl.where(c == best, e, G_P2 * EG_P2), axis=1), axis=0)
        # m: a group's padding lanes (j >= EG) carry the ids of the next group's experts (e = g·EG + j)
        top_w = tl.where(offs_a == a, tl.sum(tl.sum(tl.where((e == idx) & m, s, 0.0), axis=1), axis=0), top_w)
        top_i = tl.where(offs_a == a, idx, top_i)
        c = tl.where(e == idx, float("-inf"), c)
    if NORM:
        top_w = top_w / (tl.sum(top_w, axis=0) + 1e-20)
    tl.store(w_ptr + n * A + offs_a, top_w * scale, mask=offs_a < A)
    tl.store(ids_ptr + n * A + offs_a, top_i, mask=offs_a < A)


def route_sigmoid_topk(logits: torch.Tensor, score_bias: torch.Tensor | None, top_k: int, norm: bool,
                       n_group: int = 1, topk_group: int = 1, scale: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [N, A] fp32 and ids [N, A] int32 of DeepSeek-V3 / GLM-4.5 routing (model.route with router_score
    sigmoid, topk_method greedy or group_top2) over logits [N, E]: one program per token instead of torch's ~15
    launches (sigmoid, bias add, two topks over groups, scatter, masked fill, topk, gather, sum, div, scale)."""
    N, E = logits.shape
    assert logits.stride(1) == 1 and E % n_group == 0 and 1 <= topk_group <= n_group, (logits.stride(), E, n_group)
    assert 1 <= top_k <= E // n_group * topk_group, (top_k, E, n_group, topk_group)
    eg = E // n_group
    w = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(N, top_k, dtype=torch.int32, device=logits.device)
    bias = score_bias if score_bias is not None else w  # not read without HAS_BIAS
    _route_sigmoid_kernel[(N,)](logits, bias, w, ids, logits.stride(0), float(scale), G=n_group,
                                G_P2=triton.next_power_of_2(n_group), EG=eg, EG_P2=triton.next_power_of_2(eg),
                                KG=topk_group, A=top_k, A_P2=triton.next_power_of_2(top_k),
                                HAS_BIAS=score_bias is not None, NORM=norm, num_warps=1 if E <= 128 else 4,
                                **pdl.options(logits.device))
    return w, ids


def route_topk_ref(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (moec.runtime.model.route after its GEMV): weights fp32, ids int32."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    return w, ids.to(torch.int32)


__all__ = ["route_gemv_topk", "route_sigmoid_topk", "route_topk", "route_topk_ref"]
