"""Calibration of the mla-nuq latent cache (moec/runtime/mla_nuq.py): per layer, the rotation signs (seeded:
runtime/mla_nuq.SIGN_SEED) and the 4 levels of each part (c, k_rope), Lloyd k-means of the rotated latent rows
normalized by their per-token rms, over a random sample of calibration tokens."""

from __future__ import annotations

import torch

from ..errors import UserError
from ..formats.kvsection import layer_tensor
from ..progress import tracked
from ..runtime.mla_nuq import GAUSSIAN_LEVELS, LEVELS, SIGN_SEED, LatentRowCodec, signs_for
from .nuq import kmeans_1d

CLIP = 4.0  # normalized values are fitted on [-CLIP, CLIP] (a 2-bit level past 4 rms serves nothing)


def check_recipe(args, kv) -> None:
    if not args.is_mla:
        raise UserError(f"kv codec mla-nuq compresses the MLA latent cache; {args.arch} has per-head keys and "
                        f"values (use nuq-outlier, kivi, ...)")
    if args.kv_lora_rank % 16 or args.qk_rope_dim % 16:
        raise UserError(f"kv codec mla-nuq packs the latent in 16-wide planes: kv_lora_rank {args.kv_lora_rank} "
                        f"and qk_rope_head_dim {args.qk_rope_dim} must be multiples of 16")


class LatentSampler:
    """Up to `max_tokens` random latent rows [N, r + rope] per layer from the 'kv_latent' events (resumable)."""

    def __init__(self, max_tokens: int = 8192, seed: int = 0):
        self.max_tokens, self.gen = max_tokens, torch.Generator().manual_seed(seed)
        self.samples: dict[int, list[torch.Tensor]] = {}
        self.count: dict[int, int] = {}

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        if name != "kv_latent":
            return
        x = t.detach().float().cpu().reshape(-1, t.shape[-1])  # [B·T, r + rope]
        have = self.count.get(layer, 0)
        take = min(self.max_tokens - have, x.shape[0])
        if take <= 0:
            return
        idx = torch.randperm(x.shape[0], generator=self.gen)[:take]
        self.samples.setdefault(layer, []).append(x[idx])
        self.count[layer] = have + take

    def get(self, layer: int) -> torch.Tensor:
        return torch.cat(self.samples[layer])

    def state_dict(self) -> dict:
        sd: dict = {"gen": self.gen.get_state(), "count": {str(la): c for la, c in self.count.items()}}
        sd.update({f"samples.{la}": torch.cat(xs) for la, xs in self.samples.items()})
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.gen.set_state(sd["gen"])
        self.count = {int(k): c for k, c in sd["count"].items()}
        self.samples = {int(k.split(".")[1]): [t] for k, t in sd.items() if k.startswith("samples.")}


def sampler(kv, seed: int) -> LatentSampler:
    return LatentSampler(seed=seed)


def fit_levels(u: torch.Tensor) -> torch.Tensor:
    """4 increasing levels for rms-normalized values u (Lloyd k-means on [-CLIP, CLIP])."""
    return kmeans_1d(u.clamp(-CLIP, CLIP) / CLIP, LEVELS) * CLIP


def fit(args, kv, sampler: LatentSampler, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    r, rp = args.kv_lora_rank, args.qk_rope_dim
    tensors, report = {}, {"codec": kv.codec, "bits": kv.bits, "levels": kv.levels, "layers": []}
    gauss = torch.tensor(GAUSSIAN_LEVELS)
    for i in tracked(range(args.n_layers), f"fitting the {kv.codec} latent cache", args.n_layers, "layers"):
        if i not in sampler.samples:
            raise ValueError(f"layer {i}: no MLA latents were captured for the mla-nuq levels")
        x = sampler.get(i)
        signs = {"c": signs_for(r, SIGN_SEED["c"] + i), "rope": signs_for(rp, SIGN_SEED["rope"] + i)}
        probe = LatentRowCodec(r, rp, signs["c"], signs["rope"], gauss, gauss)
        y = probe.rotate(x).half().float()  # what the window holds and the history encodes
        levels, row = {}, {"layer": i, "samples": x.shape[0]}
        for part, sl in (("c", slice(0, r)), ("rope", slice(r, r + rp))):
            p = y[:, sl]
            u = p / p.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-8)
            levels[part] = fit_levels(u) if kv.levels == "fitted" else gauss.clone()
            row[f"{part}_levels"] = [round(v, 4) for v in levels[part].tolist()]
        codec = LatentRowCodec(r, rp, signs["c"], signs["rope"], levels["c"], levels["rope"])
        deq = codec.decode(*codec.encode(y))
        for part, sl in (("c", slice(0, r)), ("rope", slice(r, r + rp))):  # relative MSE of the round trip
            row[f"{part}_rel_mse"] = round(float((deq[:, sl] - y[:, sl]).pow(2).sum() / y[:, sl].pow(2).sum()), 5)
        for part in ("c", "rope"):
            tensors[layer_tensor(i, f"{part}_signs")] = signs[part].float()
            tensors[layer_tensor(i, f"{part}_levels")] = levels[part].float().contiguous()
        report["layers"].append(row)
    return tensors, report
