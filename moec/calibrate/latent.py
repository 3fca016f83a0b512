"""Calibration of the latent KV codecs (seed 000: cross-head latent; seed 001: cross-layer shared latent):
pure fp32/fp64 fitting functions plus the observer that keeps aligned K/V samples during the layer loop.

A group is G adjacent layers (G = 1 for latent-head; the last group of latent-layer may be smaller).
Per group and kind (k: keys pre- or post-RoPE as the recipe says, v: values), the samples of its layers
are concatenated per token, x = [layer, kv head, channel] flattened (D_g = G·K·d), and fitted by PCA
(Palu's SVD of the concatenated heads; xKV's SVD over adjacent layers):
    kv.groups.{g}.{k,v}_basis  [D_g, r]  orthonormal principal directions (W_up; W_down = W_up^T)
    kv.groups.{g}.{k,v}_mean   [D_g]     the sample mean (removed before projecting)
    kv.groups.{g}.{k,v}_scale  [r]       per-channel clip of the latent for the uniform quantizer
                                         (MSE-optimal over a grid; 1 for a 16-bit latent)
Rank rule: `rank_k` / `rank_v` when set (the same for every group), otherwise per group the smallest
multiple of 8 whose principal directions hold `energy` of the (mean-removed) variance.
The latent quantizer is uniform mid-rise with 2^b levels in [-scale, scale] per channel and no
per-token scale (the channel scales are offline, as KVQuant's key scales); what it clips, and what the
rank drops, the runtime's sparse fp16 residual (largest `outlier_frac` of each block) partly restores.
"""

from __future__ import annotations

import math

import torch

from ..errors import UserError
from ..progress import tracked
from ..runtime.latent import dequantize_latent, quantize_latent


class LatentSampler:
    """Keeps the first `max_tokens` token positions of each layer's k_pre, k and v: [N, K, d] fp32.

    The same positions for every layer (run_layers feeds the same batches to each), so a group's
    layers can be concatenated per token."""

    def __init__(self, names=("k_pre", "k", "v"), max_tokens: int = 8192):
        self.names, self.max_tokens = names, max_tokens
        self.samples: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.count: dict[tuple[int, str], int] = {}

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        if name not in self.names:
            return
        key = (layer, name)
        take = self.max_tokens - self.count.get(key, 0)
        if take <= 0:
            return
        x = t.detach().float().cpu().permute(0, 2, 1, 3).reshape(-1, t.shape[1], t.shape[3])[:take]  # [B·T, K, d]
        self.samples.setdefault(key, []).append(x)
        self.count[key] = self.count.get(key, 0) + x.shape[0]

    def get(self, layer: int, name: str) -> torch.Tensor:
        return torch.cat(self.samples[(layer, name)])

    def state_dict(self) -> dict:  # for a resumable calibration (resume.py)
        return {f"samples.{la}.{n}": torch.cat(xs) for (la, n), xs in self.samples.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.samples = {}
        for k, t in sd.items():
            layer, name = k.removeprefix("samples.").split(".", 1)
            self.samples[(int(layer), name)] = [t]
        self.count = {key: xs[0].shape[0] for key, xs in self.samples.items()}


def latent_sampler(kv, seed: int) -> LatentSampler:
    """Aligned K/V samples of every layer for the latent PCA (pre- or post-RoPE keys)."""
    return LatentSampler(("k_pre" if kv.rope == "pre" else "k", "v"))


def layer_groups(n_layers: int, group_layers: int) -> list[list[int]]:
    """Adjacent layers in groups of `group_layers`; the last group holds what remains."""
    return [list(range(i, min(i + group_layers, n_layers))) for i in range(0, n_layers, group_layers)]


def check_latent_recipe(args, kv) -> None:
    """Refuse latent settings the model's shapes cannot take (UserError naming the field)."""
    lat, L, K, d = kv.latent, args.n_layers, args.n_kv_heads, args.head_dim
    if lat.group_layers > L:
        raise UserError(f"kv.latent.group_layers {lat.group_layers} is larger than the model's {L} layers")
    dim = lat.group_layers * K * d
    for name in ("rank_k", "rank_v"):
        r = getattr(lat, name)
        if r > dim:
            raise UserError(f"kv.latent.{name} {r} exceeds the {dim} dims it compresses "
                            f"({lat.group_layers} layer(s) × {K} KV heads × head_dim {d})")


def concat_group(samples: list[torch.Tensor], field: str) -> torch.Tensor:
    """Per-layer samples [N, K, d] of one group -> [N, G·K·d]; the layers must share one KV shape."""
    shapes = {tuple(s.shape[1:]) for s in samples}
    if len(shapes) > 1:
        raise UserError(f"kv.latent.group_layers: cross-layer sharing needs one KV shape per group, the layers "
                        f"have {sorted(shapes)} ({field})")
    n = min(s.shape[0] for s in samples)
    return torch.cat([s[:n].reshape(n, -1) for s in samples], dim=1)


def pca(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, D] -> (mean [D], eigenvalues [D] descending, basis [D, D] columns) in fp32 (fit in fp64)."""
    x = x.double()
    mean = x.mean(0)
    xc = x - mean
    cov = xc.T @ xc / max(x.shape[0], 1)
    evals, evecs = torch.linalg.eigh(cov)
    order = evals.flip(0).clamp_min(0), evecs.flip(1)
    return mean.float(), order[0].float(), order[1].float().contiguous()


def rank_for_energy(evals: torch.Tensor, energy: float) -> int:
    """The smallest multiple of 8 (capped at D) whose leading eigenvalues hold `energy` of the total."""
    cum = evals.double().cumsum(0) / evals.double().sum().clamp_min(1e-30)
    r = int((cum < energy - 1e-12).sum().item()) + 1
    return min(int(math.ceil(r / 8) * 8), evals.numel())


def fit_scale(z: torch.Tensor, bits: int, grid: int = 48) -> torch.Tensor:
    """Per-channel clip of z [N, r] minimizing the squared rounding error, over multiples of the std."""
    std = z.std(0).clamp_min(1e-8)  # [r]
    best, best_err = std * 3, torch.full_like(std, float("inf"))
    for f in torch.linspace(0.5, 6.0, grid).tolist():
        s = std * f
        err = (dequantize_latent(quantize_latent(z, s, bits), s, bits) - z).pow(2).mean(0)
        better = err < best_err
        best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
    return best


def fit_group(x: torch.Tensor, rank: int, energy: float, bits: int) -> tuple[dict[str, torch.Tensor], dict]:
    """x [N, D_g] -> ({basis [D_g, r], mean [D_g], scale [r]}, report) for one group and kind."""
    mean, evals, basis = pca(x)
    r = min(rank, x.shape[1]) if rank else rank_for_energy(evals, energy)  # a short last group: all its dims
    u = basis[:, :r].contiguous()
    z = (x.float() - mean) @ u  # [N, r]
    scale = torch.ones(r) if bits >= 16 else fit_scale(z, bits)
    xr = (dequantize_latent(quantize_latent(z, scale, bits), scale, bits) if bits < 16 else z) @ u.T + mean
    err = (xr - x).pow(2).sum() / (x - mean).pow(2).sum().clamp_min(1e-30)
    rep = {"rank": r, "dims": x.shape[1], "energy": round(float(evals[:r].sum() / evals.sum().clamp_min(1e-30)), 5),
           "rel_mse": round(float(err), 5)}
    return {"basis": u, "mean": mean, "scale": scale.float()}, rep


def fit_latent_tensors(args, kv, sampler: LatentSampler, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    """All groups' tensors (`kv.groups.{g}.*`) and a report (rank, energy kept, relative MSE per group)."""
    lat = kv.latent
    check_latent_recipe(args, kv)
    kname = "k_pre" if kv.rope == "pre" else "k"
    tensors, report = {}, {"codec": kv.codec, "bits": kv.bits, "rope": kv.rope, "group_layers": lat.group_layers,
                           "outlier_frac": lat.outlier_frac, "groups": []}
    groups = layer_groups(args.n_layers, lat.group_layers)
    for g, layers in tracked(enumerate(groups), f"fitting the {kv.codec} KV cache", len(groups), "layer groups"):
        entry = {"group": g, "layers": layers}
        for kind, field, rank in (("k", kname, lat.rank_k), ("v", "v", lat.rank_v)):
            x = concat_group([sampler.get(i, field) for i in layers], field)
            fit, entry[kind] = fit_group(x, rank, lat.energy, kv.bits)
            for name, t in fit.items():
                tensors[f"kv.groups.{g}.{kind}_{name}"] = t.float().contiguous()
        report["groups"].append(entry)
    return tensors, report
