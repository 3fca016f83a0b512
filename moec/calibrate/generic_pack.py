"""`moec pack` on the transformers path: a packed checkpoint of layout "hf" (moec/hf/generic.py) from an HF
directory and a calibration made by calibrate/generic_capture.py.

Streamed like calibrate/pack.py: shards are planned from the meta model's parameter shapes and dtypes, and a
source tensor is read when its shard is written, one decoder layer at a time (moec/hf/stream.SourceModel,
transformers' own checkpoint conversions), the fitted parts from calib.safetensors. Rules are matched by the
target groups of moec.hf.generic.param_groups (hf/generic.rule_for); quantized expert stacks are stored
[E, O, I] (transposed where transformers holds them [E, I, O]).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError
from ..formats import checkpoint
from ..hf.generic import (
    LAYOUT,
    attention_modules,
    experts_modules,
    kv_args,
    param_groups,
    quantizable,
    rule_for,
    tied_names,
)
from ..hf.stream import SourceModel
from ..provenance import environment
from ..registry import default_weight, kv_codec, stored_as_is, weight_codec
from .pack_kv import encode_kv_tensors, kv_manifest, kv_view
from .recipe import Recipe
from .sources import TOKENIZER_FILES

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
MATRIX_GROUPS = ("experts", "shared_experts", "mlp", "attention", "router")  # what w_bits counts
HEAD = "lm_head.weight"


def plan_generic(model, recipe: Recipe) -> dict:
    """{param: rule} for every matrix a non-keep rule selects on transformers model `model` (meta is fine);
    UserError (one line, naming the rule) for what the transformers path cannot do."""
    groups, quant = param_groups(model), quantizable(model)
    targets = {}
    for ri, rule in enumerate(recipe.weights):
        if weight_codec(rule.codec).identity:
            continue
        if rule.allocate is not None:
            raise UserError(f"weights rule {ri} ({rule.codec}): allocate is not done on the transformers path yet; "
                            f"drop it from the rule")
        hit = [n for n, shape in quant.items() if rule_for(recipe, n, groups.get(n, "other")) is rule]
        if not hit:
            have = sorted({groups.get(n, "other") for n in quant})
            raise UserError(f"weights rule {ri} (targets {rule.targets}, codec {rule.codec}) selects no matrix of "
                            f"this model ({type(model).__name__}); targets that exist here: {', '.join(have)}")
        for n in hit:
            I = quant[n][-1]
            if rule.group_size and I % rule.group_size:
                raise UserError(f"weights rule {ri}: group_size {rule.group_size} does not divide the input dim "
                                f"{I} of {n}")
            spec = weight_codec(rule.codec)
            if (why := spec.kernel_error(rule.bits, I, rule.group_size)) is not None:
                raise UserError(f"weights rule {ri} (codec {rule.codec}, bits {rule.bits}, group_size "
                                f"{rule.group_size}) on {n}: {why}")
            if rule.incoherence is not None and not rule.incoherence.block_for(I):
                raise UserError(f"weights rule {ri}: incoherence block {rule.incoherence.block} does not divide the "
                                f"input dim {I} of {n} (powers of two that do: "
                                f"{[1 << k for k in range((I & -I).bit_length())]}; or 0 for auto)")
            targets[n] = rule
    if recipe.calibration.tune_steps and targets:
        raise UserError("calibration.tune_steps: end-to-end tuning is not done on the transformers path; set it to 0")
    return targets


def bind_kv(model, recipe: Recipe):
    """The recipe's KV codec bound to the transformers model (None: an fp16 cache), before any work: UserError
    (one line) for an attention the KV codecs cannot hold (moec.hf.archspec's kv_refusal: MLA latents, linear
    attention, sliding windows, sinks; expert and linear rules still apply), a codec that encodes keys before
    RoPE (transformers' attention interface sees them after it) or one whose cache is not the tiered one
    MoecCache serves; else the kv_args (hf/generic.kv_args) the codec is fitted and run with."""
    if recipe.kv is None or kv_codec(recipe.kv.codec).identity:
        return None
    spec = kv_codec(recipe.kv.codec)
    try:
        from ..hf.archspec import arch_spec
    except ImportError:
        arch_spec = None
    if arch_spec is not None and (why := arch_spec(model).kv_refusal()):
        raise UserError(f"kv codec {recipe.kv.codec}: {why}")
    if arch_spec is None:  # until moec.hf.archspec is there: the same refusals, read off the attention modules
        atts = attention_modules(model)
        odd = [i for i in range(model.config.get_text_config().num_hidden_layers) if i not in atts or
               hasattr(atts[i], "kv_a_proj_with_mqa") or getattr(atts[i], "sliding_window", None) or
               "sinks" in atts[i]._parameters]
        if odd:
            raise UserError(f"kv codec {recipe.kv.codec}: {model.config.model_type} layer {odd[0]} (an MLA latent, "
                            f"linear attention, sliding window or sinks) cannot be held by moec's KV codecs; use a "
                            f"recipe without `kv:` (expert and linear rules still apply)")
    args = kv_args(model)
    section = kv_view(recipe, kv_manifest(recipe, args))
    if spec.rope_pre is not None and spec.hook("rope_pre")(section):
        raise UserError(f"kv codec {recipe.kv.codec}: rope: pre encodes keys before RoPE, and the transformers path "
                        f"sees them after it; use rope: post")
    if not spec.tiered:
        raise UserError(f"kv codec {recipe.kv.codec}: its cache is not one transformers' Cache API can hold "
                        f"(moec.hf.MoecCache serves the tiered block codecs); use it on moec's engine")
    if spec.check is not None:
        spec.hook("check")(args, recipe.kv)
    return args


def stored_state(model, targets: dict) -> dict[str, torch.Tensor]:
    """{name: meta tensor as stored} of what a pack stores of the model: every parameter and persistent buffer
    in transformers' names, tied ones once (a quantized LM head of a tied model is its own), quantized expert
    stacks in their [E, O, I] shape."""
    tied = tied_names(model) - ({HEAD} if HEAD in targets else set())
    experts = experts_modules(model)
    out = {}
    for n, t in model.state_dict(keep_vars=True).items():
        if n in tied:
            continue
        mod_path = n.rpartition(".")[0]
        if n in targets and mod_path in experts and experts[mod_path].is_transposed:
            t = t.transpose(-1, -2)
        out[n] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return out


def encode_generic(state: dict[str, torch.Tensor], targets: dict, fitted: dict[str, torch.Tensor]) -> tuple:
    """(stored tensors (meta for kept ones), per-tensor info) under the planned targets."""
    tensors, info = {}, {}
    for name, t in state.items():
        rule = targets.get(name)
        if rule is None:
            tensors[name] = t
            info[name] = {"codec": default_weight().name, "bits": 8 * t.element_size(), "param": name}
            continue
        parts = {k.removeprefix(f"fit.{name}."): v for k, v in fitted.items() if k.startswith(f"fit.{name}.")}
        if not parts:
            raise UserError(f"calibration has no fitted tensors for {name!r} (codec {rule.codec}); re-run "
                            f"`moec calibrate` with this recipe")
        for part, v in parts.items():
            tensors[f"{name}.{part}"] = v
            info[f"{name}.{part}"] = {"codec": rule.codec, "bits": rule.bits, "param": name,
                                      "group_size": rule.group_size, "param_shape": list(t.shape)}
    return tensors, info


def effective_bits_generic(state: dict, tensors: dict, info: dict, groups: dict) -> dict:
    """w_bits over the decoder matrices (groups MATRIX_GROUPS, 2-D and up), q_bits over the quantized ones,
    model_bits over everything (as calibrate/pack.effective_bits for canonical packs)."""
    def nbytes(t):
        return t.numel() * t.element_size()

    params = {n for n, t in state.items() if groups.get(n) in MATRIX_GROUPS and t.dim() >= 2}
    qparams = {i["param"] for i in info.values() if not stored_as_is(i["codec"])}
    stored = sum(nbytes(t) for n, t in tensors.items() if info[n]["param"] in params)
    numel = sum(state[n].numel() for n in params)
    q_stored = sum(nbytes(t) for n, t in tensors.items() if info[n]["param"] in qparams)
    q_numel = sum(state[n].numel() for n in qparams)
    total = sum(nbytes(t) for t in tensors.values())
    return {"w_bits": 8.0 * stored / max(numel, 1), "w_params": numel,
            "q_bits": 8.0 * q_stored / q_numel if q_numel else None, "q_params": q_numel,
            "model_bits": 8.0 * total / max(sum(t.numel() for t in state.values()), 1), "model_bytes": total}


def pack_generic(model_dir: Path, model_spec: str, recipe: Recipe, out_dir: Path, calib_dir: str | None = None,
                 report: dict | None = None) -> dict:
    """Write the layout-"hf" packed checkpoint of HF directory `model_dir` under `recipe`, the quantized parts
    from `calib_dir` (a transformers-path CALIB_DIR; None: an identity recipe that fits nothing)."""
    src = SourceModel(model_dir)  # the source dtype: kept tensors are stored bit for bit
    model = src.model
    targets = plan_generic(model, recipe)
    args = bind_kv(model, recipe)
    if args is not None and calib_dir is None:
        raise UserError(f"recipe {recipe.name} has a KV codec: pack a calibration (`moec calibrate` first)")
    fp = src.fingerprint()
    if report is not None and fp["weights_sha256"] != report.get("weights_sha256"):
        raise UserError(f"the calibration was made on another model ({report.get('model')!r}, weights sha256 "
                        f"{str(report.get('weights_sha256'))[:12]}...), not {model_spec!r}")
    if targets and calib_dir is None:
        raise UserError(f"recipe {recipe.name} quantizes weights: pack a calibration (`moec calibrate` first)")
    groups = param_groups(model)
    state = stored_state(model, targets)
    fitted = _fitted(calib_dir) if calib_dir else {}
    tensors, info = encode_generic(state, targets, fitted)
    bits = effective_bits_generic(state, tensors, info, groups)
    kv_section = None
    if args is not None:
        kv_tensors, kv_info, kv_section = encode_kv_tensors(Path(calib_dir), recipe, args)
        tensors.update(kv_tensors)
        info.update(kv_info)
    experts = experts_modules(model)
    transposed = sorted(n for n in targets if n.rpartition(".")[0] in experts and experts[n.rpartition(".")[0]]
                        .is_transposed)
    config = dict(src.config_dict)
    if HEAD in targets and tied_names(model):
        config["tie_word_embeddings"] = False  # the quantized head is its own tensor; the embedding is kept as is
    provenance = {"data": None, "seed": recipe.calibration.seed}
    if report is not None:
        provenance = {k: report.get(k) for k in ("data", "split", "samples", "seq_len", "seed", "tokens", "created",
                                                  "device", "expert_policy", "min_expert_tokens", "environment")}
        provenance["expert_tokens"] = {str(x["layer"]): x["experts"]["tokens"] for x in report["layers"]
                                       if "experts" in x}
    manifest = {"layout": LAYOUT, "source": {"model": model_spec, "path": str(model_dir), **fp},
                "hf": {"model_type": config.get("model_type"), "architectures": config.get("architectures"),
                       "transposed": transposed, "groups": {n: groups.get(n, "other") for n in state},
                       "kv_args": None if args is None else args.to_dict()},
                "recipe": recipe.to_dict(), "calibration": provenance, "effective_bits": bits, "kv": kv_section,
                "environment": environment("cpu")}
    extra = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    checkpoint.write_packed(out_dir, tensors, info, manifest, config, extra_files=extra,
                            load=_loader(src, set(state), fitted))
    return manifest


def _fitted(calib_dir: str) -> dict[str, torch.Tensor]:
    """{name: meta tensor} of every fitted part of a transformers-path CALIB_DIR (its per-layer fit files and
    calib.safetensors), each tagged with the file holding it (`_moec_file`)."""
    from .pack import _meta_file as meta

    out = {}
    for f in sorted(Path(calib_dir).glob("*.safetensors")):
        for k, v in meta(str(f)).items():
            if k.startswith("fit."):
                v._moec_file = str(f)
                out[k] = v
    return out


def _loader(src: SourceModel, names: set[str], fitted: dict[str, torch.Tensor]):
    """load(stored name) for write_packed: a kept source tensor (its decoder layer materialised once and
    released when the next is asked for; the global modules loaded once) or a fitted part."""
    held = {"layer": None, "globals": False}
    params = {n for n, _ in src.model.named_parameters(remove_duplicate=False)}

    def load(name: str) -> torch.Tensor:
        if name not in names:
            with safe_open(fitted[f"fit.{name}"]._moec_file, "pt") as f:
                return f.get_tensor(f"fit.{name}")
        m = _LAYER.match(name)
        if m is None:
            if not held["globals"]:
                src.load_globals()
                held["globals"] = True
        else:
            i = int(m.group(1))
            if held["layer"] != i:
                if held["layer"] is not None:
                    src.release(src.layers[held["layer"]])
                src.load_layer(i)
                held["layer"] = i
        return src.model.get_parameter(name) if name in params else src.model.get_buffer(name)

    return load


def pack_any(model_dir: Path, model_spec: str, calib_dir: Path, out_dir: Path) -> dict:
    """`moec pack` of a calibration made on the transformers path (report.json `path: transformers`)."""
    from .pack import read_calib

    recipe, report = read_calib(calib_dir)
    return pack_generic(model_dir, model_spec, recipe, out_dir, str(calib_dir), report)
