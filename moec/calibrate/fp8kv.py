"""Calibration side of the fp8 KV codec (moec/runtime/fp8kv.py): the amax of the post-RoPE keys and of the
values per layer over every calibration token (not a sample: an unseen larger value would saturate), and
scale = amax / 448, as llm-compressor's static fp8 KV observer computes it."""

from __future__ import annotations

import torch

from ..formats.kvsection import layer_tensor
from ..runtime.fp8kv import E4M3_MAX


class AmaxObserver:
    """Running max |x| per (layer, "k" | "v") of what the model hands its cache; resumable (state_dict)."""

    def __init__(self):
        self.amax: dict[tuple[int, str], float] = {}
        self.tokens: dict[int, int] = {}

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        if name not in ("k", "v"):
            return
        key = (layer, name)
        self.amax[key] = max(self.amax.get(key, 0.0), float(t.detach().abs().amax()))
        if name == "k":
            self.tokens[layer] = self.tokens.get(layer, 0) + t.shape[0] * t.shape[2]

    def state_dict(self) -> dict:
        return {"amax": {f"{la}.{n}": a for (la, n), a in self.amax.items()},
                "tokens": {str(la): n for la, n in self.tokens.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.amax = {(int(k.split(".")[0]), k.split(".")[1]): a for k, a in sd["amax"].items()}
        self.tokens = {int(k): n for k, n in sd["tokens"].items()}


def fp8_sampler(kv, seed: int) -> AmaxObserver:
    return AmaxObserver()


def fit_fp8(args, kv, sampler: AmaxObserver, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    tensors, layers = {}, []
    for i in range(args.n_layers):
        if (i, "k") not in sampler.amax:
            raise ValueError(f"layer {i}: no keys were captured for the fp8 KV scales")
        row = {"layer": i, "tokens": sampler.tokens.get(i, 0)}
        for kind in ("k", "v"):
            amax = max(sampler.amax[(i, kind)], 1e-6)
            tensors[layer_tensor(i, f"{kind}_scale")] = torch.tensor([amax / E4M3_MAX], dtype=torch.float32)
            row[f"{kind}_amax"] = amax
        layers.append(row)
    return tensors, {"codec": kv.codec, "bits": 8, "scale": "amax / 448 over every calibration token",
                     "layers": layers}
