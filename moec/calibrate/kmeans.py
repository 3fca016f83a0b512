"""Batched k-means in torch (pure functions, fp32): G independent problems solved at once.

    kmeans(x [G, N, v], k) -> (centroids [G, k, v], assign [G, N], inertia [G])

Greedy k-means++ initialisation (Arthur & Vassilvitskii 2007) then Lloyd iterations. Deterministic for a
given `seed` and device (the sampling generator lives on x's device). Distances are computed in
blocks of points so memory stays at about `max_elems` floats whatever N·k is
(‖x‖² − 2·x·c + ‖c‖², one batched matmul per block). Runs on the CPU or CUDA. An empty cluster
keeps its previous centroid (k-means++ makes them rare; a stale centroid costs nothing but a code).
Used by moec/calibrate/rvq.py for the residual VQ codebooks of the KV cache.
"""

from __future__ import annotations

import math

import torch


def _block_rows(G: int, k: int, max_elems: int) -> int:
    return max(1, max_elems // max(G * k, 1))


def assign(x: torch.Tensor, c: torch.Tensor, max_elems: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid: x [G, N, v], c [G, k, v] -> (index [G, N] int64, squared distance [G, N])."""
    G, N, v = x.shape
    cn = c.pow(2).sum(-1)  # [G, k]
    idx = torch.empty(G, N, dtype=torch.long, device=x.device)
    dist = torch.empty(G, N, dtype=x.dtype, device=x.device)
    step = _block_rows(G, c.shape[1], max_elems)
    for s in range(0, N, step):
        xb = x[:, s : s + step]
        if v <= 8:  # a matmul with inner dim v <= 8 runs far below peak on the CPU: v fused multiply-adds
            d = cn[:, None].expand(G, xb.shape[1], -1).clone()  # [G, n, k]
            for e in range(v):
                d.addcmul_(xb[:, :, e : e + 1], c[:, None, :, e], value=-2.0)
        else:
            d = torch.baddbmm(cn[:, None], xb, c.transpose(1, 2), alpha=-2.0)  # [G, n, k]
        m = d.min(-1)  # ‖x‖² is the same for every centroid: added after the argmin
        idx[:, s : s + step] = m.indices
        dist[:, s : s + step] = (m.values + xb.pow(2).sum(-1)).clamp_min(0)
    return idx, dist


def kmeans_pp(x: torch.Tensor, k: int, gen: torch.Generator, trials: int | None = None) -> torch.Tensor:
    """Greedy k-means++ seeding: x [G, N, v] -> centroids [G, k, v]. The first centroid is uniform; each
    next one is the best (lowest total D²) of `trials` candidates drawn ∝ D² (2 + ln k by default, as
    scikit-learn does: plain k-means++ often seeds two centroids in one cluster)."""
    G, N, v = x.shape
    trials = trials or 2 + int(math.log(k))
    ar = torch.arange(G, device=x.device)
    first = torch.randint(0, N, (G,), generator=gen, device=x.device)
    c = torch.empty(G, k, v, dtype=x.dtype, device=x.device)
    c[:, 0] = x[ar, first]
    d2 = (x - c[:, :1]).pow(2).sum(-1)  # [G, N] squared distance to the nearest chosen centroid
    xn = x.pow(2).sum(-1)  # [G, N]
    for j in range(1, k):
        cdf = (d2 + 1e-30).cumsum(1)  # sample ∝ D² by inverting the CDF (all-duplicate data: uniform)
        u = torch.rand(G, trials, generator=gen, device=x.device, dtype=x.dtype) * cdf[:, -1:]
        cand = torch.searchsorted(cdf, u).clamp_max(N - 1)  # [G, T]
        cx = x[ar[:, None], cand]  # [G, T, v]
        dx = xn[:, None] - 2 * torch.bmm(cx, x.transpose(1, 2)) + cx.pow(2).sum(-1)[..., None]  # [G, T, N]
        dc = torch.minimum(d2[:, None], dx.clamp_min_(0))
        best = dc.sum(-1).argmin(1)  # [G]
        c[:, j] = cx[ar, best]
        d2 = dc[ar, best]
    return c


def kmeans(x: torch.Tensor, k: int, iters: int = 25, seed: int = 0, tol: float = 1e-4,
           max_elems: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lloyd's k-means on G independent point sets x [G, N, v] (fp32) with k-means++ init.

    Returns (centroids [G, k, v], assignment [G, N], inertia [G] = mean squared distance).
    Stops early when no problem's inertia improves by more than `tol` (relative)."""
    assert x.dim() == 3 and 1 <= k <= x.shape[1], (tuple(x.shape), k)
    x = x.float().contiguous()
    G, N, v = x.shape
    gen = torch.Generator(device=x.device).manual_seed(seed)
    c = kmeans_pp(x, k, gen)
    idx, dist = assign(x, c, max_elems)
    prev = dist.mean(1)
    flat = (idx + torch.arange(G, device=x.device)[:, None] * k).flatten()  # [G·N] into [G·k]
    for _ in range(iters):
        sums = torch.zeros(G * k, v, device=x.device).index_add_(0, flat, x.reshape(G * N, v))
        cnt = torch.zeros(G * k, device=x.device).index_add_(0, flat, torch.ones(G * N, device=x.device))
        new = sums / cnt.clamp_min(1)[:, None]
        c = torch.where(cnt[:, None] > 0, new, c.reshape(G * k, v)).view(G, k, v)
        idx, dist = assign(x, c, max_elems)
        flat = (idx + torch.arange(G, device=x.device)[:, None] * k).flatten()
        inertia = dist.mean(1)
        if ((prev - inertia) <= tol * prev.clamp_min(1e-30)).all():
            prev = inertia
            break
        prev = inertia
    return c, idx, prev
