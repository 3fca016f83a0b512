"""`moec pack`, KV part: copy the calibrated KV-codec tensors into the packed checkpoint.

Tensors `kv.layers.{i}.{k_scale, k_levels, v_levels}` (nuq-outlier; kivi needs none) or
`kv.groups.{g}.{k,v}_{basis, mean, scale}` (latent-head / latent-layer) are stored as
fitted (fp32) with manifest codec `kv-calib`; the manifest's `kv` section holds the codec settings
the runtime builds its cache from (moec/runtime/loader.py `kv_cache_factory`) and the shapes it
checks against the model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError
from ..runtime.config import ModelArgs
from .recipe import Recipe

KV_PARTS = ("k_scale", "k_levels", "v_levels")
# latent-head / latent-layer (moec/calibrate/fit_latent.py): per group of layers, keys and values
LATENT_PARTS = tuple(f"{kind}_{p}" for kind in "kv" for p in ("basis", "mean", "scale"))


def kv_tensor_names(section: dict, args: ModelArgs) -> list[str]:
    """The calibration tensors the runtime needs for this `kv` manifest section (none for kivi)."""
    if section["codec"] == "nuq-outlier":
        parts = KV_PARTS + (("k_center",) if section.get("k_center") else ()) + (
            ("k_weight",) if section.get("outlier_select") == "weighted-error" else ())
        return [f"kv.layers.{i}.{p}" for i in range(args.n_layers) for p in parts]
    if section["codec"] in ("latent-head", "latent-layer"):
        return [f"kv.groups.{g}.{p}" for g in range(section["n_groups"]) for p in LATENT_PARTS]
    if section["codec"] == "rvq-tiered":  # kv.layers.{i}.{k|v}.{mid|arch}.{stage} codebooks
        from ..runtime.kvrvq import tensor_names

        return tensor_names(section["rvq"], args.n_layers)
    return []


def kv_manifest(recipe: Recipe, args: ModelArgs) -> dict | None:
    if recipe.kv is None or recipe.kv.codec == "fp16":
        return None
    kv = recipe.kv
    extra = {}
    if kv.latent is not None:
        lat = kv.latent
        extra = {"group_layers": lat.group_layers, "n_groups": -(-args.n_layers // lat.group_layers),
                 "outlier_frac": lat.outlier_frac, "rank_k": lat.rank_k, "rank_v": lat.rank_v, "energy": lat.energy}
    return {"codec": kv.codec, "bits": kv.bits, "window": kv.window, "sinks": kv.sinks, "block": kv.block,
            "group_size": kv.group_size, "outlier_frac": kv.outlier_frac, "levels": kv.levels, "rope": kv.rope,
            "n_layers": args.n_layers, "n_kv_heads": args.n_kv_heads, "head_dim": args.head_dim} | extra | (
            {"k_center": kv.k_center, "outlier_select": kv.outlier_select, "k_scale_fit": kv.k_scale_fit}
            if kv.codec == "nuq-outlier" else {}) | (
            {"rvq": dataclasses.asdict(kv.rvq)} if kv.rvq is not None else {})


def encode_kv_tensors(calib_dir: Path, recipe: Recipe, args: ModelArgs) -> tuple[dict, dict, dict | None]:
    """(tensors, per-tensor info, manifest `kv` section) for the recipe's KV codec."""
    section = kv_manifest(recipe, args)
    names = [] if section is None else kv_tensor_names(section, args)
    if not names:
        return {}, {}, section
    tensors, info = {}, {}
    with safe_open(str(calib_dir / "calib.safetensors"), "pt") as f:
        have = set(f.keys())
        for name in names:
            if name not in have:
                raise UserError(f"{calib_dir}: calibration has no {name!r}; re-run `moec calibrate` with "
                                f"this recipe (kv codec {section['codec']})")
            tensors[name] = f.get_tensor(name).to(torch.float32).contiguous()
            info[name] = {"codec": "kv-calib", "bits": 32, "param": name, "kv_codec": section["codec"],
                          "kv_bits": section["bits"]}
        stale = sorted(n for n in have if n.startswith("kv.") and n not in tensors)
        if stale:  # calibrated for another KV codec or layer grouping than the recipe now asks for
            raise UserError(f"{calib_dir}: calibration tensor {stale[0]!r} does not belong to kv codec "
                            f"{section['codec']}; re-run `moec calibrate` with this recipe")
    section["tensors"] = sorted(tensors)
    return tensors, info, section
