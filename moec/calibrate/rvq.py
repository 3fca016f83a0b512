"""Calibration of the tiered residual-VQ KV cache (seed 002; moec/runtime/rvq.py): pure fp32 fitting.

Per layer, keys (post- or pre-RoPE, as `kv.rvq.rope` says) and values sampled during the layer loop
(nuq.KVSampler, [N, K, d]) are cut into P = d / dim sub-vectors; each sub-vector position (and
KV head, unless `shared_heads`) gets its own codebook per stage. Stage 1 is k-means on the
sub-vectors, stage s on the residuals stages 1..s-1 leave (residual VQ: Juang & Gray 1982; for KV,
Kumar 2024 and CommVQ). Written to calib.safetensors as

    kv.layers.{i}.{k|v}.{mid|arch}.{stage}   [Gc, P, C_stage, dim] fp32    (Gc = K, or 1 if shared)

The report holds per stage the relative error ‖x − x̂‖² / ‖x‖² on the calibration samples, the
archive tier's error when it re-encodes the middle tier's reconstruction (what the runtime does:
no fp16 copy is left) against encoding the original, and k-means seconds per layer.
"""

from __future__ import annotations

import time

import torch

from ..errors import UserError
from ..progress import tracked
from ..runtime.rvq import RVQTier
from .kmeans import kmeans


def rvq_sampler(kv, seed: int):
    """K/V samples for the residual-VQ codebooks (k-means runs on the calibration device)."""
    from .nuq import KVSampler

    return KVSampler(max_tokens=kv.rvq.max_samples, seed=seed)


def check_rvq_recipe(args, kv) -> None:
    """Refuse rvq settings the model's head_dim cannot take (UserError naming the field)."""
    d, rvq = args.head_dim, kv.rvq
    for name in ("mid_dim", "arch_dim"):
        dim = getattr(rvq, name)
        if d % dim:
            raise UserError(f"kv.rvq.{name} {dim} does not divide the model's head_dim {d}")


def fit_rvq(x: torch.Tensor, dim: int, sizes: list[int], iters: int = 20, seed: int = 0,
            shared_heads: bool = False) -> tuple[list[torch.Tensor], list[float]]:
    """x [N, K, d] -> (codebooks [Gc, P, C_s, dim] per stage, relative error after each stage).

    Stage s is fitted on the residual of stages < s (greedy nearest-centroid assignment)."""
    N, K, d = x.shape
    P = d // dim
    xs = x.float().permute(1, 0, 2)  # [K, N, d]
    if shared_heads:
        xs = xs.reshape(1, K * N, d)
    Gc, n = xs.shape[0], xs.shape[1]
    r = xs.reshape(Gc, n, P, dim).permute(0, 2, 1, 3).reshape(Gc * P, n, dim)  # one problem per (head, position)
    energy = r.pow(2).sum().item()
    books, errs = [], []
    for s, C in enumerate(sizes):
        c, idx, _ = kmeans(r, min(C, n), iters=iters, seed=seed + s)
        if c.shape[1] < C:  # fewer samples than centroids: pad with copies (never chosen twice)
            c = torch.cat([c, c[:, :1].expand(-1, C - c.shape[1], -1)], 1)
        r = r - c.gather(1, idx[..., None].expand(-1, -1, dim))
        books.append(c.view(Gc, P, C, dim).contiguous())
        errs.append(r.pow(2).sum().item() / max(energy, 1e-30))
    return books, errs


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).pow(2).sum() / x.pow(2).sum().clamp_min(1e-30)).item()


def tier_errors(x: torch.Tensor, mid: list[torch.Tensor], arch: list[torch.Tensor] | None) -> dict:
    """Relative errors of x [N, K, d] through the runtime's codec (fp16 codebooks): middle tier, and
    archive from the original vs from the middle tier's reconstruction."""
    xb = x.float().permute(1, 0, 2)[None]  # [1, K, N, d], the cache's layout
    m = RVQTier(mid)
    xm = m.decode(m.encode(xb))
    out = {"mid": rel_err(xb, xm)}
    if arch:
        a = RVQTier(arch)
        out["arch_from_original"] = rel_err(xb, a.decode(a.encode(xb)))
        out["arch_from_mid"] = rel_err(xb, a.decode(a.encode(xm)))
    return out


def fit_rvq_tensors(args, kv, sampler, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    """Per-layer rvq-tiered tensors (`kv.layers.{i}.*`) and a report of errors and k-means times."""
    rvq = kv.rvq
    tiers = [("mid", rvq.mid_sizes, rvq.mid_dim)] + ([("arch", rvq.arch_sizes, rvq.arch_dim)]
                                                     if rvq.archive_after else [])
    tensors, report = {}, {"codec": kv.codec, "rvq": {k: getattr(rvq, k) for k in rvq.__dataclass_fields__},
                           "device": device, "layers": []}
    total = 0.0
    for i in tracked(range(args.n_layers), f"fitting the {kv.codec} KV cache", args.n_layers, "layers"):
        entry = {"layer": i}
        for kind, src in (("k", "k_pre" if rvq.rope == "pre" else "k"), ("v", "v")):
            x = sampler.get(i, src)
            entry["samples"] = x.shape[0]
            books = {}
            for tier, sizes, dim in tiers:
                t0 = time.time()
                cbs, errs = fit_rvq(x.to(device), dim, sizes, rvq.iters, seed=1000 * i + (kind == "v"),
                                    shared_heads=rvq.shared_heads)
                if device != "cpu":
                    torch.cuda.synchronize()
                total += time.time() - t0
                books[tier] = [c.cpu() for c in cbs]
                entry[f"{kind}_{tier}_stage_err"] = [round(e, 5) for e in errs]
                for s, c in enumerate(books[tier]):
                    tensors[f"kv.layers.{i}.{kind}.{tier}.{s}"] = c.float().contiguous()
            errs = tier_errors(x, books["mid"], books.get("arch"))
            entry.update({f"{kind}_{n}_err": round(e, 5) for n, e in errs.items()})
        report["layers"].append(entry)
    report["kmeans_seconds"] = round(total, 2)
    return tensors, report
