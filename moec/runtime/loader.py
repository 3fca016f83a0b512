"""Load a model for the runtime: an HF-layout directory or a moec packed checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..errors import FormatError, UserError
from ..formats import checkpoint
from ..formats.codecs import ROTATION_PART, WEIGHT_PATTERN
from ..registry import stored_as_is, weight_codec
from ..rotation import signs_layout_error
from ..typed import build
from .config import ModelArgs
from .experts import LINEAR_PARAM, attach, is_quant_expert, is_quant_linear, placeholders, pop_quant_experts
from .hf_layout import HFCheckpoint
from .model import Transformer, build_model


def weight_bits(tensors: dict[str, torch.Tensor]) -> float:
    """Effective bits per weight of the decoder-layer matrices, from the bytes held."""
    nbytes = numel = 0
    for name, t in tensors.items():
        if WEIGHT_PATTERN.search(name):
            nbytes += t.numel() * t.element_size()
            numel += t.numel()
    return 8.0 * nbytes / max(numel, 1)


def load_state(path: str | Path) -> tuple[ModelArgs, dict[str, torch.Tensor], dict]:
    """(args, canonical state dict, info) where info has kind, w_bits and, for packed, the manifest."""
    if checkpoint.is_packed(path):
        args, manifest = open_packed(path)
        state = checkpoint.load_tensors(path, manifest)
        kv_tensors = {n: state.pop(n) for n in [n for n in state if n.startswith("kv.")]}  # KV codec calibration
        return args, state, {"kind": "packed", "manifest": manifest, "kv": kv_section(manifest),
                             "kv_tensors": kv_tensors, "w_bits": manifest["effective_bits"]["w_bits"]}
    ckpt = HFCheckpoint(path)
    state = ckpt.state_dict()
    return ckpt.args, state, {"kind": "hf", "w_bits": weight_bits(state)}


def open_packed(path: str | Path) -> tuple[ModelArgs, dict]:
    """(args, manifest) of a packed checkpoint, verified and checked for what this runtime executes; no
    tensor is loaded (checkpoint.load_tensors reads them, all or by name)."""
    manifest = checkpoint.verify(path)
    if manifest.get("layout") == "hf":  # transformers' names and modeling code, not the engine's canonical model
        raise FormatError(f"{path}: packed on the transformers path (layout hf): moec's engine does not run it; "
                          f"`moec eval` / `moec generate` (--path auto) and transformers' from_pretrained do")
    checkpoint.check_model_fields(manifest, Path(path) / checkpoint.MANIFEST)
    stored_layers = len({n.split(".")[1] for n in manifest["tensors"] if n.startswith("layers.")})
    if manifest["model_args"].get("n_layers") != stored_layers:  # before ModelArgs builds per-layer lists
        raise FormatError(f"{path}: model_args.n_layers {manifest['model_args'].get('n_layers')!r}, but the "
                          f"checkpoint stores {stored_layers} layers")
    try:
        args = ModelArgs.from_dict(manifest["model_args"])
    except UserError as e:
        raise FormatError(f"{path}: {e}") from None
    for name, e in manifest["tensors"].items():
        if not stored_as_is(e["codec"]) and not name.startswith("kv.") and not is_quant_expert(name, e) \
                and not is_quant_linear(name, e):
            raise FormatError(f"{path}: tensor {name!r} uses codec {e['codec']!r}, which this runtime "
                              f"version cannot execute")
    check_quant_parts(path, manifest)
    return args, manifest


def load_model(path: str | Path, dtype: torch.dtype | None = torch.float32,
               device: str | torch.device = "cpu") -> tuple[Transformer, dict]:
    """The runtime model for `path`; compute dtype fp32 by default (the CPU reference)."""
    args, state, info = load_state(path)
    quant = pop_quant_experts(state, info.get("manifest"))  # quantized experts: built apart, then attached
    check_state_shapes(path, args, {n: t.shape for n, t in state.items()} |
                       {p: torch.Size(q.param_shape) for p, q in quant.items()})
    model = build_model(args, state | placeholders(quant, dtype, device), dtype=dtype, device=device)
    attach(model, quant, device)
    return model, info


def check_quant_parts(path, manifest: dict) -> None:
    """Each quantized matrix of a packed checkpoint has exactly the parts, shapes and dtypes its codec
    stores (FormatError otherwise), compared with the codec's own stand-in built on the meta device: so
    the runtime never indexes a part that is not there or a table of another size."""
    params: dict[str, dict[str, dict]] = {}
    for name, e in manifest["tensors"].items():
        if is_quant_expert(name, e) or is_quant_linear(name, e):
            params.setdefault(e["param"], {})[name.removeprefix(e["param"] + ".")] = e
    for param, parts in params.items():
        first = next(iter(parts.values()))
        codec, bits, shape, g = (first.get(k) for k in ("codec", "bits", "param_shape", "group_size"))
        where = f"{path}: {param} ({codec}, {bits} bits)"
        if any((e.get("codec"), e.get("bits"), e.get("param_shape"), e.get("group_size")) != (codec, bits, shape, g)
               for e in parts.values()):
            raise FormatError(f"{where}: its parts disagree on codec, bits, param_shape or group_size")
        spec = weight_codec(codec)
        if bits not in spec.bits:
            raise FormatError(f"{where}: codec {codec!r} takes bits {spec.bits}, not {bits}")
        attention = LINEAR_PARAM.search(param) is not None  # a plain [O, I] weight (attention and the like)
        if shape is None or len(shape) != (2 if attention else 3) or g is None:
            raise FormatError(f"{where}: param_shape {shape!r} / group_size {g!r} missing or not a "
                              f"{'[O, I]' if attention else '[E, O, I]'} matrix")
        if g and (g > shape[-1] or shape[-1] % g):
            raise FormatError(f"{where}: group_size {g} does not divide the {shape[-1]} inputs")
        if spec.random_stored is None:
            continue  # a plugin codec without a stand-in: its dequantize hook checks its own parts
        want = spec.hook("random_stored")(bits, (1, *shape) if attention else tuple(shape), g, "meta", None)
        want = {k: v[0] if attention else v for k, v in want.items()}
        rot = parts.pop(ROTATION_PART, None)  # an incoherence rotation's signs: shapes here, values at load
        if rot is not None and (err := signs_layout_error(rot["dtype"], rot["shape"], shape[-1])) is not None:
            raise FormatError(f"{where}: part {ROTATION_PART!r} is {err}")
        if set(parts) != set(want):
            raise FormatError(f"{where}: stored parts {sorted(parts)}, the codec stores {sorted(want)}")
        for k, e in parts.items():
            if k in spec.shared_parts and not attention and e["shape"][:1] == [1]:
                want[k] = want[k][:1]  # one for every expert of the matrix (a rule's shared_codebook)
            if (e["shape"], e["dtype"]) != (list(want[k].shape), checkpoint.dtype_name(want[k].dtype)):
                raise FormatError(f"{where}: part {k!r} is {e['dtype']} {e['shape']}, the codec stores "
                                  f"{checkpoint.dtype_name(want[k].dtype)} {list(want[k].shape)}")


def check_state_shapes(path, args: ModelArgs, shapes: dict[str, torch.Size]) -> None:
    """The checkpoint's tensors are exactly the parameters `args` describes, shape for shape, checked on the
    meta device before anything is allocated (model_args that declare a huge model meet a FormatError, not
    the memory limit)."""
    try:
        with torch.device("meta"):
            want = {n: t.shape for n, t in Transformer(args).state_dict().items()}
    except RuntimeError as e:  # sizes whose product overflows (each alone is in range: ModelArgs.from_dict)
        raise FormatError(f"{path}: model_args describe a model too large to build ({e})") from None
    for name in [*want, *sorted(shapes.keys() - want.keys())]:  # the model's order: the first mismatch named
        if name not in shapes:
            raise FormatError(f"{path}: tensor {name!r} is missing (model_args needs it)")
        if name not in want:
            raise FormatError(f"{path}: tensor {name!r} is not a parameter of the model that model_args describes")
        if shapes[name] != want[name]:
            raise FormatError(f"{path}: tensor {name!r} has shape {list(shapes[name])}, model_args needs "
                              f"{list(want[name])}")


def kv_section(manifest: dict) -> dict | None:
    """The KV codec's view of a packed checkpoint (None: an fp16 cache), the one place where its two homes
    join: the codec's config, built strictly from the manifest's `recipe.kv` (the one home of every recipe
    key: codec, bits, window, ...), as the writer resolves it (`asdict`: defaults filled in, nested configs
    whole), plus the `kv` section (shapes, tensor names, derived keys: formats/kvsection.py). The codecs'
    hooks take this dict (moec/registry.py). FormatError for a codec this runtime does not execute or
    values its config refuses."""
    section = manifest.get("kv")
    if not section:
        return None
    recipe_kv = manifest["recipe"]["kv"]  # kvsection.check: a mapping with codec and bits
    return {**dataclasses.asdict(kv_config(kv_codec_spec(recipe_kv), recipe_kv)), **section}


def kv_codec_spec(section: dict):
    """The registered spec of a checkpoint's KV codec (FormatError: a codec this moec does not know, or a
    section whose keys do not pass the codec's config class, the schema it was written from)."""
    from ..registry import kv_codecs

    codecs = kv_codecs()
    spec = codecs.get(section["codec"])
    if spec is None or spec.identity:
        raise FormatError(f"KV codec {section['codec']!r} is not one this runtime executes "
                          f"(registered: {', '.join(c for c, s in codecs.items() if not s.identity)})")
    kv_config(spec, section)
    return spec


def kv_config(spec, section: dict):
    """The codec's config instance from the section's keys that its class declares (the section holds
    those, plus shapes and derived keys), built strictly as a recipe is (FormatError)."""
    config = spec.hook("config")
    declared = {f.name for f in dataclasses.fields(config)}
    try:
        return build(config, {k: v for k, v in section.items() if k in declared}, "manifest recipe.kv", codec=spec.name)
    except UserError as e:
        raise FormatError(str(e)) from None


def kv_cache_factory(info: dict, args: ModelArgs):
    """The cache factory `evaluate` takes, for the KV codec a packed checkpoint records (None: fp16), from
    the codec's registered spec: the tiered cache for block codecs, the codec's own cache otherwise.

    Checks the checkpoint's KV calibration against the model's layer/head shapes (FormatError)."""
    section = info.get("kv")
    if not section:
        return None
    spec, tensors = kv_codec_spec(section), info.get("kv_tensors", {})  # section: kv_section's view
    model_shapes = {"n_layers": args.n_layers, "n_kv_heads": args.n_kv_heads, "head_dim": args.head_dim}
    for key, want in model_shapes.items():
        if section[key] != want:
            raise FormatError(f"manifest kv.{key} {section[key]} was calibrated for another model "
                              f"(model_args: {want})")
    block = section.get("block")  # the tiered caches allocate a block's buffers up front, whatever max_len
    if isinstance(block, int) and block > args.max_seq_len:
        raise FormatError(f"manifest kv.block {block} is longer than the model's context "
                          f"(max_seq_len {args.max_seq_len})")
    missing = [n for n in section.get("tensors", []) if n not in tensors]  # a list of str: kvsection.check
    if missing:
        raise FormatError(f"manifest kv.tensors: {missing[0]!r} is not a kv.* tensor of the checkpoint")
    if spec.tiered:
        from .kvtiered import build_codecs, tiered_cache_factory

        return tiered_cache_factory(section, build_codecs(section, tensors, args))
    return spec.hook("cache_factory")(section, tensors, args)
