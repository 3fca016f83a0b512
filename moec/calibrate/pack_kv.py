"""`moec pack`, KV part: the manifest `kv` section and the calibrated KV-codec tensors.

The section holds what the KV codec needs beyond its recipe keys (those live in the manifest's `recipe`
only): the model's shapes, the tensor names and the keys the codec derives (moec/formats/kvsection.py);
the tensors the codec's spec names (moec/registry.py `tensor_names`) are copied from the calibration as
fitted (fp32) with manifest codec `kv-calib`. The runtime joins recipe and section in one function
(moec/runtime/loader.py `kv_section`) and builds its cache from that view and the tensors
(`kv_cache_factory`); `kv_view` here is the same join before the manifest is written.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError
from ..registry import kv_codec
from ..runtime.config import ModelArgs
from ..runtime.loader import kv_section
from .recipe import Recipe


def kv_tensor_names(view: dict, args: ModelArgs) -> list[str]:
    """The calibration tensors the runtime needs for this KV view (`kv_view`; none for kivi)."""
    spec = kv_codec(view["codec"])
    return [] if spec.tensor_names is None else spec.hook("tensor_names")(view, args)


def kv_manifest(recipe: Recipe, args: ModelArgs) -> dict | None:
    """The stored `kv` section for the recipe's KV config on this model (None: fp16 cache): the shapes and
    the codec's derived keys, no recipe key (`tensors` is added when they are known)."""
    if recipe.kv is None or kv_codec(recipe.kv.codec).identity:
        return None
    spec = kv_codec(recipe.kv.codec)
    section = {"n_layers": args.n_layers, "n_kv_heads": args.n_kv_heads, "head_dim": args.head_dim}
    if spec.section is not None:  # derived keys (latent: n_groups)
        section |= spec.hook("section")(recipe.kv, args)
    return section


def kv_view(recipe: Recipe, section: dict | None) -> dict | None:
    """The KV codec's view (runtime/loader.kv_section) of the recipe and the section about to be stored."""
    return kv_section({"recipe": recipe.to_dict(), "kv": section})


def kv_tensor_info(names) -> dict:
    return {n: {"codec": "kv-calib", "bits": 32, "param": n} for n in names}


def encode_kv_tensors(calib_dir: Path, recipe: Recipe, args: ModelArgs) -> tuple[dict, dict, dict | None]:
    """(tensors, per-tensor info, manifest `kv` section) for the recipe's KV codec."""
    section = kv_manifest(recipe, args)
    view = kv_view(recipe, section)
    names = [] if section is None else kv_tensor_names(view, args)
    if not names:
        return {}, {}, section
    tensors = {}
    with safe_open(str(calib_dir / "calib.safetensors"), "pt") as f:
        have = set(f.keys())
        for name in names:
            if name not in have:
                raise UserError(f"{calib_dir}: calibration has no {name!r}; re-run `moec calibrate` with "
                                f"this recipe (kv codec {view['codec']})")
            tensors[name] = f.get_tensor(name).to(torch.float32).contiguous()
        stale = sorted(n for n in have if n.startswith("kv.") and n not in tensors)
        if stale:  # calibrated for another KV codec or layer grouping than the recipe now asks for
            raise UserError(f"{calib_dir}: calibration tensor {stale[0]!r} does not belong to kv codec "
                            f"{view['codec']}; re-run `moec calibrate` with this recipe")
    section["tensors"] = sorted(tensors)
    return tensors, kv_tensor_info(tensors), section
