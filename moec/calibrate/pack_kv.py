"""`moec pack`, KV part: copy the calibrated KV-codec tensors into the packed checkpoint.

Tensors `kv.layers.{i}.{k_scale, k_levels, v_levels}` (nuq-outlier; kivi needs none) are stored as
fitted (fp32) with manifest codec `kv-calib`; the manifest's `kv` section holds the codec settings
the runtime builds its cache from (moec/runtime/loader.py `kv_cache_factory`) and the shapes it
checks against the model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError
from ..runtime.config import ModelArgs
from .recipe import Recipe

KV_PARTS = ("k_scale", "k_levels", "v_levels")


def kv_manifest(recipe: Recipe, args: ModelArgs) -> dict | None:
    if recipe.kv is None or recipe.kv.codec == "fp16":
        return None
    kv = recipe.kv
    return {"codec": kv.codec, "bits": kv.bits, "window": kv.window, "sinks": kv.sinks, "block": kv.block,
            "group_size": kv.group_size, "outlier_frac": kv.outlier_frac, "levels": kv.levels, "rope": kv.rope,
            "n_layers": args.n_layers, "n_kv_heads": args.n_kv_heads, "head_dim": args.head_dim}


def encode_kv_tensors(calib_dir: Path, recipe: Recipe, args: ModelArgs) -> tuple[dict, dict, dict | None]:
    """(tensors, per-tensor info, manifest `kv` section) for the recipe's KV codec."""
    section = kv_manifest(recipe, args)
    if section is None or section["codec"] != "nuq-outlier":
        return {}, {}, section
    tensors, info = {}, {}
    with safe_open(str(calib_dir / "calib.safetensors"), "pt") as f:
        have = set(f.keys())
        for i in range(args.n_layers):
            for part in KV_PARTS:
                name = f"kv.layers.{i}.{part}"
                if name not in have:
                    raise UserError(f"{calib_dir}: calibration has no {name!r}; re-run `moec calibrate` with "
                                    f"this recipe (kv codec {section['codec']})")
                tensors[name] = f.get_tensor(name).to(torch.float32).contiguous()
                info[name] = {"codec": "kv-calib", "bits": 32, "param": name, "kv_codec": section["codec"],
                              "kv_bits": section["bits"]}
    section["tensors"] = sorted(tensors)
    return tensors, info, section
