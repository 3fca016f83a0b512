"""`moec pack`: apply the calibrated recipe to every tensor and write the packed checkpoint.

The recipe comes from CALIB_DIR/recipe.yaml (the one calibration resolved), so what is packed is
what was calibrated. The source model must be the one calibrated (checked by weight hash).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError
from ..formats import checkpoint
from ..formats.codecs import WEIGHT_PATTERN
from ..progress import tracked
from ..provenance import environment
from ..registry import default_weight, kv_codec, resolve, stored_as_is, weight_codec
from ..runtime.hf_layout import ST_DTYPES, HFCheckpoint, config_from_args
from .fit_experts import HEAD, check_kernel_rules
from .pack_kv import encode_kv_tensors
from .recipe import Recipe, load_recipe
from .sources import TOKENIZER_FILES
from .tune import TUNED

_LAYER = re.compile(r"layers\.(\d+)\.")


def read_calib(calib_dir: Path) -> tuple[Recipe, dict]:
    if not calib_dir.is_dir():
        raise UserError(f"calibration directory {calib_dir} does not exist")
    for f in ("report.json", "recipe.yaml", "calib.safetensors"):
        if not (calib_dir / f).is_file():
            raise UserError(f"{calib_dir}: missing {f} (not a complete `moec calibrate` output)")
    return load_recipe(calib_dir / "recipe.yaml"), json.loads((calib_dir / "report.json").read_text())


def encode_tensors(state: dict[str, torch.Tensor], recipe: Recipe, fitted: dict[str, torch.Tensor] | None = None,
                   allocation: list[dict] | None = None, ffn_kinds: list[str] | None = None) -> tuple[dict, dict]:
    """(stored tensors, per-tensor info) under the recipe's first-match rules (ffn_kinds: the model's,
    which tells `experts` from `mlp`, as calibration planned them).

    Quantized parameters are stored as the parts calibration fitted (`fit.<param>.<part>` in
    calib.safetensors, see formats/codecs.py), each named `<param>.<part>` and carrying `param`;
    `allocation`: the calibration report's records of its `allocate` rules, whose chosen candidate (codec, width,
    group size) each of their matrices is stored under (WeightRule.chosen).
    """
    tensors, info = {}, {}
    fitted = fitted or {}
    for name, t in tracked(state.items(), "packing tensors", len(state)):
        rule = recipe.rule_for(name, ffn_kinds)
        if rule is not None:
            rule = rule.chosen(name, allocation or [])
        spec = weight_codec(rule.codec) if rule else default_weight()
        codec = spec.name
        if spec.identity and f"{TUNED}{name}" in fitted:  # a norm gain tuned end to end (tune.py), fp32
            tensors[name] = fitted[f"{TUNED}{name}"]
            info[name] = {"codec": codec, "bits": 32, "param": name, "tuned": True}
            continue
        if spec.identity:  # exactly as the source stores it, dtype included: bit-exact and never larger
            tensors[name] = t
            info[name] = {"codec": codec, "bits": 8 * t.element_size(), "param": name}
            continue
        parts = {k.removeprefix(f"fit.{name}."): v for k, v in fitted.items() if k.startswith(f"fit.{name}.")}
        if not parts:
            raise UserError(f"calibration has no fitted tensors for {name!r} (codec {codec}); "
                            f"re-run `moec calibrate` with this recipe")
        for part, v in parts.items():
            tensors[f"{name}.{part}"] = v
            info[f"{name}.{part}"] = {"codec": codec, "bits": rule.bits, "param": name,
                                      "group_size": rule.group_size, "param_shape": list(t.shape)}
    return tensors, info


def effective_bits(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], info: dict) -> dict:
    """w_bits from the bytes stored for the decoder-layer matrices (codebooks and scales included)."""
    params = {n for n in state if WEIGHT_PATTERN.search(n)}
    stored = sum(t.numel() * t.element_size() for n, t in tensors.items() if info[n]["param"] in params)
    numel = sum(state[n].numel() for n in params)
    total_stored = sum(t.numel() * t.element_size() for t in tensors.values())
    total_numel = sum(t.numel() for t in state.values())
    qparams = {i["param"] for i in info.values() if not stored_as_is(i["codec"])}
    q_stored = sum(t.numel() * t.element_size() for n, t in tensors.items() if info[n]["param"] in qparams)
    q_numel = sum(state[n].numel() for n in qparams)
    return {"w_bits": 8.0 * stored / max(numel, 1), "w_params": numel,
            "q_bits": 8.0 * q_stored / q_numel if q_numel else None, "q_params": q_numel,
            "model_bits": 8.0 * total_stored / max(total_numel, 1), "model_bytes": total_stored}


def bind(args, recipe: Recipe) -> None:
    """The recipe bound to the model before any work (UserError, one line, naming the rule): the kernel rule of
    every quantized matrix's codec (fit_experts.check_kernel_rules) and the KV codec's own check."""
    from .run import check_kv_attention

    check_kernel_rules(args, recipe)
    check_kv_attention(args, recipe)
    if recipe.kv is not None and (kv_check := kv_codec(recipe.kv.codec).check) is not None:
        resolve(kv_check)(args, recipe.kv)


def pack(model_dir: Path, model_spec: str, calib_dir: Path, out_dir: Path) -> dict:
    recipe, report = read_calib(calib_dir)
    ckpt = HFCheckpoint(model_dir)
    bind(ckpt.args, recipe)
    fp = ckpt.fingerprint()
    if fp["weights_sha256"] != report.get("weights_sha256"):
        raise UserError(f"{calib_dir} was calibrated on another model ({report.get('model')!r}, weights "
                        f"sha256 {str(report.get('weights_sha256'))[:12]}...), not {model_spec!r}")
    # streamed: shards are planned from shapes and dtypes (meta tensors); each tensor is read when its
    # shard is written, the source one decoder layer at a time, the fitted parts from calib.safetensors
    state = ckpt.meta_state_dict()
    args, config = ckpt.args, ckpt.config
    head = recipe.rule_for(HEAD, args.ffn_kinds)
    if args.tie_embeddings and head is not None and not weight_codec(head.codec).identity:
        # a quantized head of a tied model is its own tensor: the packed model is untied, the input
        # embedding stays exactly as the source stores it (a gather reads it, not the head's matmul)
        state[HEAD] = state["tok_embeddings.weight"]
        args = dataclasses.replace(args, tie_embeddings=False)
        config = {**config, "tie_word_embeddings": False}
    calib_file = str(calib_dir / "calib.safetensors")
    tensors, info = encode_tensors(state, recipe, _meta_file(calib_file), report.get("allocation"), args.ffn_kinds)
    bits = effective_bits(state, tensors, info)
    kv_tensors, kv_info, kv_section = encode_kv_tensors(calib_dir, recipe, args)
    tensors.update(kv_tensors)
    info.update(kv_info)
    provenance = {k: report[k] for k in ("data", "split", "samples", "seq_len", "seed", "tokens", "created",
                                          "device", "expert_policy", "min_expert_tokens")}
    provenance["environment"] = report.get("environment")  # what calibrated it (None: an older calibration)
    if report.get("allocation"):  # what each matrix of an `allocate` rule got (calibrate/allocate.py)
        provenance["allocation"] = report["allocation"]
    provenance["expert_tokens"] = {str(x["layer"]): x["experts"]["tokens"] for x in report["layers"]
                                   if "experts" in x}
    manifest = {"source": {"model": model_spec, "path": str(model_dir), **fp},
                "model_args": args.to_dict(), "recipe": recipe.to_dict(),
                "calibration": provenance, "effective_bits": bits,
                "kv": kv_section, "environment": environment("cpu")}  # what packed it
    extra = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    checkpoint.write_packed(out_dir, tensors, info, manifest, config, extra_files=extra,
                            load=_source_loader(ckpt, set(state), calib_file))
    return manifest


def _meta_file(path: str) -> dict[str, torch.Tensor]:
    """{name: meta tensor} of a safetensors file, from its header, in load_file's order (by offset)."""
    with safe_open(path, "pt") as f:
        return {k: torch.empty(f.get_slice(k).get_shape(), dtype=ST_DTYPES[f.get_slice(k).get_dtype()],
                               device="meta") for k in f.offset_keys()}


def _source_loader(ckpt: HFCheckpoint, names: set[str], calib_file: str):
    """load(stored name) for write_packed: a source tensor (`names`: the canonical ones; its decoder layer
    read once and kept until the next one is asked for, as shards take tensors in state_dict order, the
    global tensors likewise), a fitted part (`<param>.<part>`, `fit.<param>.<part>` in calib) or a tuned norm
    gain (`tuned.<name>` in calib, stored under the source's name)."""
    held: dict = {"key": None, "sd": {}}
    with safe_open(calib_file, "pt") as f:
        tuned = {k.removeprefix(TUNED) for k in f.keys() if k.startswith(TUNED)}

    def load(name: str) -> torch.Tensor:
        if name not in names:
            with safe_open(calib_file, "pt") as f:
                return f.get_tensor(f"fit.{name}")
        if name in tuned:
            with safe_open(calib_file, "pt") as f:
                return f.get_tensor(f"{TUNED}{name}")
        m = _LAYER.match(name)
        key = int(m.group(1)) if m else "global"
        if held["key"] != key:
            held["key"], held["sd"] = None, {}  # the previous layer freed before the next is read
            held["key"], held["sd"] = key, ckpt.global_state() if m is None else ckpt.layer_state(key)
        return held["sd"][name]

    return load


def pack_random(args, shape_name: str, recipe: Recipe, out_dir: Path, device: str = "cpu", seed: int = 0) -> dict:
    """`moec pack --random SHAPE`: random weights at `args` packed with the recipe's codecs directly.

    No calibration: quantized experts get random codes and plausible codebooks/scales
    (runtime/latency.random_stored), KV codecs their stand-in calibration (runtime/latency.random_kv_tensors).
    Built on `device` (the GPU when there is one), written atomically like any packed checkpoint."""
    from ..runtime.experts import LINEAR_PARAM
    from ..runtime.latency import param_shapes, random_kv_tensors, random_rotation, random_stored
    from .pack_kv import kv_manifest, kv_tensor_info, kv_view

    bind(args, recipe)
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = param_shapes(args)
    tensors, info = {}, {}
    for name, shape in tracked(shapes.items(), f"random weights of {shape_name}", len(shapes), "tensors"):
        rule = recipe.rule_for(name, args.ffn_kinds)
        is_expert = ".moe." in name and name.rsplit(".", 1)[-1] in ("w1", "w2", "w3")
        is_attn = LINEAR_PARAM.search(name) is not None  # attention, shared experts, router, LM head
        if rule is not None and not weight_codec(rule.codec).identity:
            if not (is_expert or is_attn):
                raise UserError(f"--random packs quantized expert, attention, shared-expert, router and LM-head "
                                f"matrices only; recipe rule {rule.targets} ({rule.codec}) also matches {name!r}")
            stacked = shape if is_expert else (1, *shape)  # plain linear parts are stored without the E axis
            parts = {k: (v if is_expert else v[0]).cpu() for k, v in
                     random_stored(rule.codec, rule.bits, stacked, rule.group_size, device, gen,
                                   rule.shared_codebook).items()}
            for part, v in (parts | random_rotation(rule, name, shape[-1])).items():  # signs: no E axis
                tensors[f"{name}.{part}"] = v
                info[f"{name}.{part}"] = {"codec": rule.codec, "bits": rule.bits, "param": name,
                                          "group_size": rule.group_size, "param_shape": list(shape)}
            continue
        t = torch.ones(shape, dtype=torch.bfloat16, device=device) if "norm" in name else \
            torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0, shape[-1] ** -0.5, generator=gen)
        tensors[name] = t.cpu()
        info[name] = {"codec": default_weight().name, "bits": 16, "param": name}
    meta = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in shapes.items()}
    bits = effective_bits(meta, tensors, info)
    kv_section = kv_manifest(recipe, args)
    if kv_section is not None:
        kvt = random_kv_tensors(args, kv_view(recipe, kv_section))
        if kvt:
            tensors.update(kvt)
            info.update(kv_tensor_info(kvt))
            kv_section["tensors"] = sorted(kvt)
    manifest = {"source": {"model": f"random:{shape_name}", "path": None, "seed": seed},
                "model_args": args.to_dict(), "recipe": recipe.to_dict(),
                "calibration": {"data": None, "random": True, "seed": seed}, "effective_bits": bits, "kv": kv_section}
    hf_config = config_from_args(args) | {"moec_random_shape": shape_name}  # whole: transformers loads it
    checkpoint.write_packed(out_dir, tensors, info, manifest, hf_config)
    return manifest
