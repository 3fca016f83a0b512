"""Calibration of the nuq-outlier KV codec (seed 003, after KVQuant): pure fp32 fitting functions,
plus the observer that samples keys/values during the layer loop (moec/calibrate/capture.py).

Fitted per layer (stored in calib.safetensors, copied by `moec pack` into the checkpoint):
    kv.layers.{i}.k_scale   [K, d]   per-channel key scale: the (1 − outlier_frac) quantile of |k|
                                     per channel (pre- or post-RoPE keys, as the recipe says), so about
                                     outlier_frac of each channel lies beyond it: the outlier candidates
    kv.layers.{i}.k_levels  [2^b]    levels in [-1, 1] for k / k_scale
    kv.layers.{i}.v_levels  [2^b]    levels in [-1, 1] for v / per-token absmax
    kv.layers.{i}.k_center  [K, d]   (`k_center: true`) per-channel key center: the midpoint of the
                                     outlier_frac/2 and 1 − outlier_frac/2 quantiles, k_scale then
                                     being half their distance (asymmetric keys)
    kv.layers.{i}.k_weight  [K, d]   (`outlier_select: weighted-error`) RMS of the queries of the
                                     KV head's group per channel, averaged over each RoPE pair
    kv.layers.{i}.k_err2    [K, d]   (`score_bias`) mean squared key rounding error per channel on the
                                     calibration keys (outside the largest outlier_frac errors, which
                                     the outliers keep), pair-averaged for pre-RoPE keys
    kv.layers.{i}.rotation  [d, d]   (`rotate: hadamard`) the layer's randomized Hadamard R
                                     (moec/rotation.py, seed = layer index): everything above is
                                     fitted on k·R and v·R, the basis the cache stores and attends in
With `k_scale_fit: mse` the key scale is the multiple (0.4..1.3) of the quantile scale that minimizes,
per channel, the squared rounding error of the calibration keys outside the largest outlier_frac
(those are kept as outliers); levels are refitted for it.
Levels are the seed's fixed grid (`levels: fixed`) or fitted by weighted 1-D k-means (Lloyd) on a
histogram of the normalized calibration values, the bin counts being the weights (`levels: fitted`).
Values beyond the scale (|x/scale| > 1, the outliers the runtime keeps in fp16) are left out of the fit.
"""

from __future__ import annotations

import torch

from ..errors import UserError
from ..progress import tracked
from ..rotation import block_hadamard
from ..runtime.nuq import FIXED_LEVELS
from .kivi import check_packs


class KVSampler:
    """Keeps a random subset of up to `max_tokens` token positions per layer of k_pre, k, v: [N, K, d],
    and the sums of squared queries per layer over all tokens ([H, d], for `query_rms`; [H, d, d] outer
    products too, for the query RMS in a rotated basis)."""

    def __init__(self, max_tokens: int = 4096, seed: int = 0):
        self.max_tokens, self.gen = max_tokens, torch.Generator().manual_seed(seed)
        self.samples: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.count: dict[tuple[int, str], int] = {}
        self.q_sq: dict[int, torch.Tensor] = {}
        self.q_outer: dict[int, torch.Tensor] = {}
        self.q_n: dict[int, int] = {}

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        if name == "q":  # [B, H, T, d]
            qf = t.detach().float()
            self.q_sq[layer] = self.q_sq.get(layer, 0) + qf.pow(2).sum((0, 2)).cpu()
            self.q_outer[layer] = self.q_outer.get(layer, 0) + torch.einsum("bhtc,bhte->hce", qf, qf).cpu()
            self.q_n[layer] = self.q_n.get(layer, 0) + t.shape[0] * t.shape[2]
            return
        if name not in ("k_pre", "k", "v"):
            return
        x = t.detach().float().cpu().permute(0, 2, 1, 3).reshape(-1, t.shape[1], t.shape[3])  # [B·T, K, d]
        key = (layer, name)
        have = self.count.get(key, 0)
        take = min(self.max_tokens - have, x.shape[0])
        if take <= 0:
            return
        idx = torch.randperm(x.shape[0], generator=self.gen)[:take]
        self.samples.setdefault(key, []).append(x[idx])
        self.count[key] = have + take

    def get(self, layer: int, name: str) -> torch.Tensor:
        return torch.cat(self.samples[(layer, name)])

    def state_dict(self) -> dict:
        """Samples, query sums and the sampling generator's state, for a resumable calibration (resume.py):
        tensors, and plain JSON values."""
        sd: dict = {"gen": self.gen.get_state(), "count": {f"{la}.{n}": c for (la, n), c in self.count.items()},
                    "q_n": {str(la): n for la, n in self.q_n.items()}}
        sd.update({f"samples.{la}.{n}": torch.cat(xs) for (la, n), xs in self.samples.items()})
        sd.update({f"q_sq.{la}": t for la, t in self.q_sq.items()})
        sd.update({f"q_outer.{la}": t for la, t in self.q_outer.items()})
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.gen.set_state(sd["gen"])
        self.count = {_layer_name(k): c for k, c in sd["count"].items()}
        self.q_n = {int(k): n for k, n in sd["q_n"].items()}
        for kind, table in (("q_sq", self.q_sq), ("q_outer", self.q_outer)):
            table.clear()
            table.update({int(k.split(".")[1]): t for k, t in sd.items() if k.startswith(kind + ".")})
        self.samples = {_layer_name(k.removeprefix("samples.")): [t] for k, t in sd.items()
                        if k.startswith("samples.")}


def _layer_name(key: str) -> tuple[int, str]:
    """'3.k_pre' -> (3, 'k_pre'): the (layer, name) keys of a sampler's state_dict."""
    layer, name = key.split(".", 1)
    return int(layer), name


def channel_scale(x: torch.Tensor, outlier_frac: float) -> torch.Tensor:
    """x: [N, K, d] -> [K, d]: the (1 − outlier_frac) quantile of |x| over N (absmax when 0)."""
    a = x.abs().float()
    if outlier_frac <= 0:
        return a.amax(0)
    k = max(1, min(a.shape[0], int(round((1.0 - outlier_frac) * a.shape[0]))))
    return a.kthvalue(k, dim=0).values.clamp_min(1e-6)


def center_scale(x: torch.Tensor, outlier_frac: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, K, d] -> (center, scale) [K, d]: midpoint and half-range of the outlier_frac/2 and
    1 − outlier_frac/2 quantiles over N (min and max when 0)."""
    x = x.float()
    n = x.shape[0]
    lo = x.kthvalue(max(1, min(n, int(round(outlier_frac / 2 * n)))), dim=0).values
    hi = x.kthvalue(max(1, min(n, int(round((1 - outlier_frac / 2) * n)))), dim=0).values
    return (hi + lo) / 2, ((hi - lo) / 2).clamp_min(1e-6)


def query_rms(sampler: KVSampler, layer: int, n_kv_heads: int, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """[K, d]: RMS over tokens and the KV head's query group of each query channel, averaged over the
    RoPE rotation pairs (c, c + d/2), whose energy rotation preserves: the same weight pre- or post-RoPE.
    With a head_dim `rotation` R: the RMS of the channels of q·R (post-RoPE; no pair averaging, R mixes
    the pairs), from the queries' second moments."""
    if rotation is not None:
        outer = sampler.q_outer[layer] / sampler.q_n[layer]  # [H, d, d]
        ms = torch.einsum("ce,hcf,fe->he", rotation, outer, rotation)  # diag(Rᵀ C R) per head
        H, d = ms.shape
        return ms.view(n_kv_heads, H // n_kv_heads, d).mean(1).clamp_min(0).sqrt()
    ms = sampler.q_sq[layer] / sampler.q_n[layer]  # [H, d]
    H, d = ms.shape
    ms = ms.view(n_kv_heads, H // n_kv_heads, d).mean(1)
    return ((ms + ms.roll(d // 2, -1)) / 2).sqrt()


def mse_scale(x: torch.Tensor, center: torch.Tensor | float, scale: torch.Tensor, levels: torch.Tensor,
              outlier_frac: float, grid: tuple = tuple(0.4 + 0.05 * i for i in range(19))) -> torch.Tensor:
    """Per-channel multiple of `scale` [K, d] (from `grid`) minimizing the squared rounding error of
    x [N, K, d] − center over the samples outside the largest outlier_frac errors (the outliers)."""
    xc = x.float() - center
    keep = max(1, int(round((1 - outlier_frac) * xc.shape[0])))
    best, best_a = None, None
    for a in grid:
        s = scale * a
        idx = torch.bucketize((xc / s).contiguous(), (levels[1:] + levels[:-1]) / 2)
        err = (levels[idx] * s - xc).pow(2).sort(dim=0).values[:keep].sum(0)  # [K, d]
        if best is None:
            best, best_a = err, torch.full_like(err, a)
        else:
            better = err < best
            best, best_a = torch.where(better, err, best), torch.where(better, a, best_a)
    return scale * best_a


def kmeans_1d(x: torch.Tensor, n_levels: int, bins: int = 4096, iters: int = 200) -> torch.Tensor:
    """Weighted Lloyd k-means of values x in [-1, 1] on a `bins`-bin histogram -> sorted levels [n_levels]."""
    x = x.float().clamp(-1, 1).flatten()
    counts = torch.histc(x, bins=bins, min=-1.0, max=1.0).double()
    centers = torch.linspace(-1, 1, bins + 1, dtype=torch.float64)
    centers = (centers[1:] + centers[:-1]) / 2
    cdf = counts.cumsum(0) / counts.sum()
    q = (torch.arange(n_levels, dtype=torch.float64) + 0.5) / n_levels
    levels = centers[torch.searchsorted(cdf, q).clamp(max=bins - 1)]  # quantile initialisation
    for _ in range(iters):
        assign = torch.bucketize(centers, (levels[1:] + levels[:-1]) / 2)
        w = torch.zeros(n_levels, dtype=torch.float64).index_add_(0, assign, counts)
        s = torch.zeros(n_levels, dtype=torch.float64).index_add_(0, assign, counts * centers)
        new = torch.where(w > 0, s / w.clamp_min(1e-30), levels)
        new = new.sort().values
        if torch.allclose(new, levels, atol=1e-9):
            break
        levels = new
    return levels.float()


def normalized_keys(k: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Core elements (|k/scale| <= 1) of k [N, K, d] normalized by scale [K, d], flattened."""
    xn = (k / scale[None]).flatten()
    return xn[xn.abs() <= 1]


def normalized_values(v: torch.Tensor, outlier_frac: float) -> torch.Tensor:
    """v [N, K, d] divided by its per-token absmax after dropping the largest outlier_frac of |v|."""
    a = v.abs()
    if outlier_frac > 0:
        thr = a.flatten().kthvalue(max(1, int(round((1 - outlier_frac) * a.numel())))).values
        core = torch.where(a <= thr, v, torch.zeros_like(v))
    else:
        core = v
    s = core.abs().amax(-1, keepdim=True).clamp_min(1e-6)
    xn = (core / s).flatten()
    return xn[(a <= (thr if outlier_frac > 0 else a.max())).flatten()]


def fit_layer(k: torch.Tensor, v: torch.Tensor, bits: int, outlier_frac: float, levels: str,
              k_center: bool = False, k_scale_fit: str = "quantile") -> dict:
    """k (pre- or post-RoPE), v: [N, K, d] -> {k_scale [K, d], k_levels [2^b], v_levels [2^b]
    (, k_center [K, d])} in fp32."""
    if k_center:
        center, scale = center_scale(k, outlier_frac)
    else:
        center, scale = 0.0, channel_scale(k, outlier_frac)
    kc = k - center
    grid = torch.tensor(FIXED_LEVELS[bits])
    if levels == "fixed":
        k_lev, v_lev = grid.clone(), grid.clone()
    else:
        k_lev, v_lev = kmeans_1d(normalized_keys(kc, scale), 2**bits), kmeans_1d(normalized_values(v, outlier_frac),
                                                                                 2**bits)
    if k_scale_fit == "mse":
        scale = mse_scale(k, center, scale, k_lev, outlier_frac)
        if levels != "fixed":
            k_lev = kmeans_1d(normalized_keys(kc, scale), 2**bits)
    out = {"k_scale": scale, "k_levels": k_lev, "v_levels": v_lev}
    if k_center:
        out["k_center"] = center
    return out


def key_error_power(k: torch.Tensor, fit: dict, outlier_frac: float, rope_pre: bool) -> torch.Tensor:
    """[K, d]: mean squared error of rounding the keys k [N, K, d] with `fit`'s center, scale and levels,
    the largest outlier_frac of the squared errors (those the outliers keep exactly) counted as 0; averaged
    over each RoPE pair (c, c + d/2) for pre-RoPE keys, whose error RoPE rotates within the pair."""
    kc = k.float() - fit.get("k_center", 0.0)
    scale, lev = fit["k_scale"], fit["k_levels"]
    idx = torch.bucketize((kc / scale).contiguous(), (lev[1:] + lev[:-1]) / 2)
    err2 = (lev[idx] * scale - kc).pow(2)
    if outlier_frac > 0:
        thr = err2.flatten().kthvalue(max(1, int(round((1 - outlier_frac) * err2.numel())))).values
        err2 = torch.where(err2 > thr, torch.zeros_like(err2), err2)
    err2 = err2.mean(0)
    if rope_pre:
        err2 = (err2 + err2.roll(err2.shape[-1] // 2, -1)) / 2
    return err2


def quant_error(x: torch.Tensor, levels: torch.Tensor) -> float:
    """Mean squared error of rounding normalized values x to the nearest of `levels`."""
    idx = torch.bucketize(x.contiguous(), (levels[1:] + levels[:-1]) / 2)
    return (levels[idx] - x).pow(2).mean().item()


def check_kv_recipe(args, kv) -> None:
    """Refuse nuq-outlier settings the model's shapes cannot take (UserError naming the field)."""
    check_packs(args, kv)
    if kv.block * args.head_dim > 32767:
        raise UserError(f"kv.block {kv.block}: block × head_dim must fit int16 outlier indices (≤ 32767)")


def nuq_sampler(kv, seed: int) -> KVSampler:
    """K/V samples (and query statistics) for the nuq-outlier scales and levels."""
    return KVSampler(seed=seed)


def fit_kv_tensors(args, kv, sampler: KVSampler, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    """Per-layer nuq-outlier tensors (names `kv.layers.{i}.*`) and a report of normalized-domain MSEs."""
    tensors, report = {}, {"codec": kv.codec, "bits": kv.bits, "rope": kv.rope, "levels": kv.levels,
                           "outlier_frac": kv.outlier_frac, "k_center": kv.k_center,
                           "outlier_select": kv.outlier_select, "k_scale_fit": kv.k_scale_fit,
                           "rotate": kv.rotate, "score_bias": kv.score_bias, "layers": []}
    for i in tracked(range(args.n_layers), f"fitting the {kv.codec} KV cache", args.n_layers, "layers"):
        k = sampler.get(i, "k_pre" if kv.rope == "pre" else "k")
        v = sampler.get(i, "v")
        rot = block_hadamard(args.head_dim, seed=i) if kv.rotate == "hadamard" else None
        if rot is not None:
            k, v = k @ rot, v @ rot
        fit = fit_layer(k, v, kv.bits, kv.outlier_frac, kv.levels, kv.k_center, kv.k_scale_fit)
        if kv.outlier_select == "weighted-error":
            if i not in sampler.q_sq:
                raise ValueError(f"layer {i}: no query statistics were captured for outlier_select weighted-error")
            fit["k_weight"] = query_rms(sampler, i, args.n_kv_heads, rot)
        if kv.score_bias:
            fit["k_err2"] = key_error_power(k, fit, kv.outlier_frac, kv.rope == "pre")
        if rot is not None:
            fit["rotation"] = rot
        kc = k - fit["k_center"] if "k_center" in fit else k
        for name, t in fit.items():
            tensors[f"kv.layers.{i}.{name}"] = t.float().contiguous()
        report["layers"].append({
            "layer": i, "samples": k.shape[0],
            "k_levels": [round(x, 4) for x in fit["k_levels"].tolist()],
            "v_levels": [round(x, 4) for x in fit["v_levels"].tolist()],
            "k_mse_norm": quant_error(normalized_keys(kc, fit["k_scale"]), fit["k_levels"]),
            "v_mse_norm": quant_error(normalized_values(v, kv.outlier_frac), fit["v_levels"])})
    return tensors, report
