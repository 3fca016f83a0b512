"""`moec pack`: apply the calibrated recipe to every tensor and write the packed checkpoint.

The recipe comes from CALIB_DIR/recipe.yaml (the one calibration resolved), so what is packed is
what was calibrated. The source model must be the one calibrated (checked by weight hash).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError
from ..formats import checkpoint
from ..formats.codecs import WEIGHT_PATTERN, WeightCodec
from ..runtime.hf_layout import HFCheckpoint
from .recipe import Recipe, load_recipe
from .sources import TOKENIZER_FILES


def read_calib(calib_dir: Path) -> tuple[Recipe, dict]:
    if not calib_dir.is_dir():
        raise UserError(f"calibration directory {calib_dir} does not exist")
    for f in ("report.json", "recipe.yaml", "calib.safetensors"):
        if not (calib_dir / f).is_file():
            raise UserError(f"{calib_dir}: missing {f} (not a complete `moec calibrate` output)")
    return load_recipe(calib_dir / "recipe.yaml"), json.loads((calib_dir / "report.json").read_text())


def encode_tensors(state: dict[str, torch.Tensor], recipe: Recipe) -> tuple[dict, dict]:
    """(stored tensors, per-tensor info) under the recipe's first-match rules."""
    tensors, info = {}, {}
    for name, t in state.items():
        rule = recipe.rule_for(name)
        codec = WeightCodec(rule.codec) if rule else WeightCodec.KEEP
        if codec is WeightCodec.KEEP:
            tensors[name] = t
            info[name] = {"codec": codec.value, "bits": 8 * t.element_size(), "param": name}
        else:  # recipe.require_implemented() refused these already
            raise AssertionError(codec)
    return tensors, info


def effective_bits(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], info: dict) -> dict:
    """w_bits from the bytes stored for the decoder-layer matrices (codebooks and scales included)."""
    params = {n for n in state if WEIGHT_PATTERN.search(n)}
    stored = sum(t.numel() * t.element_size() for n, t in tensors.items() if info[n]["param"] in params)
    numel = sum(state[n].numel() for n in params)
    total_stored = sum(t.numel() * t.element_size() for t in tensors.values())
    total_numel = sum(t.numel() for t in state.values())
    return {"w_bits": 8.0 * stored / max(numel, 1), "w_params": numel,
            "model_bits": 8.0 * total_stored / max(total_numel, 1), "model_bytes": total_stored}


def pack(model_dir: Path, model_spec: str, calib_dir: Path, out_dir: Path) -> dict:
    recipe, report = read_calib(calib_dir)
    recipe.require_implemented()
    ckpt = HFCheckpoint(model_dir)
    fp = ckpt.fingerprint()
    if fp["weights_sha256"] != report.get("weights_sha256"):
        raise UserError(f"{calib_dir} was calibrated on another model ({report.get('model')!r}, weights "
                        f"sha256 {str(report.get('weights_sha256'))[:12]}...), not {model_spec!r}")
    state = ckpt.state_dict()
    tensors, info = encode_tensors(state, recipe)
    bits = effective_bits(state, tensors, info)
    kv = recipe.kv_or_default()
    bits["kv_bits_nominal"] = float(kv.bits)
    provenance = {k: report[k] for k in ("data", "split", "samples", "seq_len", "seed", "tokens", "created",
                                          "device", "expert_policy", "min_expert_tokens")}
    provenance["expert_tokens"] = {str(x["layer"]): x["experts"]["tokens"] for x in report["layers"]
                                   if "experts" in x}
    manifest = {"source": {"model": model_spec, "path": str(model_dir), **fp},
                "model_args": ckpt.args.to_dict(), "recipe": recipe.to_dict(),
                "calibration": provenance, "effective_bits": bits}
    quant = {"quant_method": "moec", "format": checkpoint.FORMAT, "format_version": checkpoint.FORMAT_VERSION,
             "config_groups": {f"group_{i}": {"targets": r.targets, "weights": {
                 "codec": r.codec, "num_bits": r.bits, "group_size": r.group_size or None,
                 "strategy": "group" if r.group_size else "channel"}} for i, r in enumerate(recipe.weights)},
             "kv_cache_scheme": None if recipe.kv is None else {"codec": kv.codec, "num_bits": kv.bits,
                                                                "window": kv.window, "sinks": kv.sinks},
             "ignore": [], "w_bits": bits["w_bits"]}
    extra = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    checkpoint.write_packed(out_dir, tensors, info, manifest, ckpt.config, quant, extra_files=extra,
                            extra_texts={"recipe.yaml": recipe.to_yaml()})
    return manifest
