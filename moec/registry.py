"""Codec registries: every KV codec and every weight codec is one registered spec.

A spec names, for one codec, everything the pipeline asks of it: the recipe config class, the
calibration hooks, the manifest section and tensor names, the runtime builders and kernels, and a
random stand-in for `moec pack --random`. Code that used to branch on codec names (`if codec ==
"nuq-outlier"`, allow-lists of codecs) looks the spec up here instead, so a new codec is one
`register_kv(...)` / `register_weight(...)` call, from any module (a test registers toy codecs from
the test module alone: tests/test_codec_registry.py).

Codecs outside the package: modules named in `MOEC_PLUGINS` (comma-separated) and the entry points of
group `moec.codecs` are imported at the registry's first lookup, so their `register_*` calls reach every
moec command (tests/test_codec_registry.py runs the CLI with MOEC_PLUGINS naming the test module).

A hook is either a callable or a "module:attribute" string resolved on first use: the built-in specs
below name their hooks by string so that importing the registry imports no codec module, and so that
the runtime never imports calibration code (`fit` hooks live in moec/calibrate/, builders in
moec/runtime/).

KV codec hooks (`args` is the model's runtime.config.ModelArgs, `cfg` the codec's config instance,
`section` the manifest `kv` section, a dict: asdict(cfg) plus shapes, see moec/formats/kvsection.py):
    config             dataclass of the recipe's `kv:` mapping for this codec (strict: keys it does
                       not declare are errors)
    check(args, cfg)   UserError for settings the model cannot take (before any work)
    sampler(cfg, seed) capture observer (calibrate/capture.py protocol) or None: no calibration
                       (with state_dict() / load_state_dict() so that `moec calibrate --resume` can
                       continue an interrupted run: calibrate/resume.py; without them, no checkpoints)
    fit(args, cfg, sampler, device) -> (tensors, report)   calibration tensors `kv.*`
    section(cfg, args) -> dict   derived manifest keys beyond asdict(cfg) and the shapes (optional)
    tensor_names(section, args) -> [names]   the `kv.*` tensors the runtime needs
    layer_codecs(section, tensors, args) -> [per-layer block codec]   for tiered block codecs: the
                       tiered cache (runtime/kvtiered.TieredKVCache) serves every such codec in each of
                       its modes (dynamic, static, simulated); FormatError on a mismatch with the model
    cache_factory(section, tensors, args, mode="dynamic") -> make(model, batch, max_len)
                       for codecs with a cache family of their own (latent, rvq): the family's one class
                       in `mode` (runtime/kvcache.py: dynamic, static for the CUDA-graph engine,
                       simulated); tiered codecs leave it None
    random_tensors(args, section, gen, device) -> {name: tensor}   stand-in calibration
    rope_pre(section) -> bool   keys encoded before RoPE (the tiered caches rotate around the codec)

Weight codec hooks (stored parts of a stacked matrix [E, O, I], formats/codecs.py):
    bits               the bit widths it takes
    quantize(W, H, rule) -> stored   calibration (W [E, O, I] fp32, H [E, I, I] or None)
    dequantize(bits, shape, stored) -> W_hat [E, O, I] fp32   the runtime reference
    random_stored(bits, shape, group_size, device, gen) -> stored   stand-in for --random
    lut(bits, stored) -> [E, O, G, K]   LUT codecs: the table the fused kernels read (optional)
    check_rule(rule)   UserError for a recipe rule's settings the codec cannot take (optional)
    kernel_mode        kernels/dequant.MODE_* when the fused MoE / qlinear kernels take it (else None)
    tunable            whether calibrate/tune.py can tune its codebooks / scales end to end
    concat_outputs     whether stacked matrices of this codec concatenate along their outputs into one
                       (the static engine's single q/k/v projection, runtime/decode.py _QuantQKV)
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import UserError

Hook = Callable | str | None


def resolve(hook: Hook) -> Any:
    """A hook: the callable itself, or the attribute a "module:attribute" string names."""
    if isinstance(hook, str):
        module, _, attr = hook.partition(":")
        return getattr(importlib.import_module(module), attr)
    return hook


@dataclass(frozen=True)
class KVCodecSpec:
    name: str
    config: Hook
    bits: tuple[int, ...]
    check: Hook = None
    sampler: Hook = None
    fit: Hook = None
    section: Hook = None
    tensor_names: Hook = None
    layer_codecs: Hook = None
    cache_factory: Hook = None
    random_tensors: Hook = None
    rope_pre: Hook = None
    description: str = ""

    def hook(self, name: str):
        return resolve(getattr(self, name))

    @property
    def tiered(self) -> bool:
        """A block codec of the tiered cache (runs in the static CUDA-graph engine as well)."""
        return self.layer_codecs is not None


@dataclass(frozen=True)
class WeightCodecSpec:
    name: str
    bits: tuple[int, ...]
    quantize: Hook = None
    dequantize: Hook = None
    random_stored: Hook = None
    lut: Hook = None
    check_rule: Hook = None
    kernel_mode: int | None = None
    tunable: bool = False
    concat_outputs: bool = True
    description: str = ""

    def hook(self, name: str):
        return resolve(getattr(self, name))


KV_CODECS: dict[str, KVCodecSpec] = {}
WEIGHT_CODECS: dict[str, WeightCodecSpec] = {}


def register_kv(spec: KVCodecSpec, replace: bool = False) -> KVCodecSpec:
    if spec.name in KV_CODECS and not replace:
        raise ValueError(f"KV codec {spec.name!r} is already registered")
    KV_CODECS[spec.name] = spec
    return spec


def register_weight(spec: WeightCodecSpec, replace: bool = False) -> WeightCodecSpec:
    if spec.name in WEIGHT_CODECS and not replace:
        raise ValueError(f"weight codec {spec.name!r} is already registered")
    WEIGHT_CODECS[spec.name] = spec
    return spec


def kv_codecs() -> dict[str, KVCodecSpec]:
    """Every registered KV codec, plugins included."""
    load_plugins()
    return KV_CODECS


def weight_codecs() -> dict[str, WeightCodecSpec]:
    """Every registered weight codec, plugins included."""
    load_plugins()
    return WEIGHT_CODECS


def _lookup(table: dict, what: str, name: str):
    spec = table.get(name)
    if spec is None:
        raise UserError(f"{what} codec {name!r} is not registered in this moec version "
                        f"(registered: {', '.join(table)})")
    return spec


def kv_codec(name: str) -> KVCodecSpec:
    return _lookup(kv_codecs(), "kv", name)


def weight_codec(name: str) -> WeightCodecSpec:
    return _lookup(weight_codecs(), "weights", name)


# -- built-in codecs ---------------------------------------------------------------------------------

_CFG = "moec.calibrate.kvconfig"
register_kv(KVCodecSpec("fp16", config=f"{_CFG}:FP16Config", bits=(16,), description="uncompressed cache"))
register_kv(KVCodecSpec(
    "kivi", config=f"{_CFG}:KIVIConfig", bits=(2, 4), check="moec.calibrate.kivi:check_kivi",
    layer_codecs="moec.runtime.kivi:kivi_layer_codecs",
    description="KIVI: per-channel keys over a block, per-token values, uniform levels"))
register_kv(KVCodecSpec(
    "nuq-outlier", config=f"{_CFG}:NUQConfig", bits=(2, 3),
    check="moec.calibrate.nuq:check_kv_recipe", sampler="moec.calibrate.nuq:nuq_sampler",
    fit="moec.calibrate.nuq:fit_kv_tensors", tensor_names="moec.runtime.nuq:nuq_tensor_names",
    layer_codecs="moec.runtime.nuq:nuq_layer_codecs", random_tensors="moec.runtime.nuq:random_nuq_tensors",
    rope_pre="moec.runtime.nuq:nuq_rope_pre",
    description="seed 003: non-uniform fitted levels, sparse fp16 outliers (KVQuant-style)"))
for _name in ("latent-head", "latent-layer"):
    register_kv(KVCodecSpec(
        _name, config=f"{_CFG}:LatentKVConfig", bits=(1, 2, 3, 4, 16),
        check="moec.calibrate.latent:check_latent_recipe", sampler="moec.calibrate.latent:latent_sampler",
        fit="moec.calibrate.latent:fit_latent_tensors", section="moec.runtime.latent:latent_section",
        tensor_names="moec.runtime.latent:latent_tensor_names",
        cache_factory="moec.runtime.latent:latent_cache_factory",
        random_tensors="moec.runtime.latent:random_latent_tensors",
        description="seeds 000/001: cross-head / cross-layer PCA latents"))
register_kv(KVCodecSpec(
    "rvq-tiered", config=f"{_CFG}:RVQKVConfig", bits=(1, 2, 3, 4),
    check="moec.calibrate.rvq:check_rvq_recipe", sampler="moec.calibrate.rvq:rvq_sampler",
    fit="moec.calibrate.rvq:fit_rvq_tensors", tensor_names="moec.runtime.rvq:rvq_tensor_names",
    cache_factory="moec.runtime.rvq:rvq_cache_factory",
    random_tensors="moec.runtime.rvq:random_rvq_tensors",
    description="seed 002: tiered residual VQ"))

_W = "moec.runtime.weightcodecs"
register_weight(WeightCodecSpec("keep", bits=tuple(range(1, 17)), description="stored as the source has it"))
for _name, _bits, _mode, _tunable in (("hls", (2, 3, 4), 0, True), ("rtn", (2, 3, 4), 1, False),
                                      ("fp3", (3,), 0, True)):
    register_weight(WeightCodecSpec(
        _name, bits=_bits, quantize=f"moec.calibrate.hls:quantize_{_name}", dequantize=f"{_W}:dequantize_lut_{_name}",
        random_stored=f"{_W}:random_{_name}", lut=f"{_W}:lut_{_name}", kernel_mode=_mode, tunable=_tunable))
register_weight(WeightCodecSpec(
    "fp8", bits=(8,), quantize="moec.calibrate.hls:quantize_fp8", dequantize=f"{_W}:dequantize_fp8",
    random_stored=f"{_W}:random_fp8", kernel_mode=2))
register_weight(WeightCodecSpec(
    "vq", bits=(2, 3, 4), quantize="moec.calibrate.vq:quantize_vq_rule", dequantize=f"{_W}:dequantize_vq",
    random_stored=f"{_W}:random_vq", check_rule="moec.calibrate.vq:check_vq_rule", kernel_mode=4, tunable=True,
    concat_outputs=False,
    description="vector codebooks: one code per group_size inputs, a codebook per matrix (GPTVQ-style)"))


_plugins_loaded = False


def load_plugins() -> None:
    """Import the codec plugins once, at the first lookup (not at import, so a bad `MOEC_PLUGINS` is a
    one-line usage error from the CLI, not a traceback): `MOEC_PLUGINS` modules, then `moec.codecs`
    entry points."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    for name in filter(None, (m.strip() for m in os.environ.get("MOEC_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise UserError(f"MOEC_PLUGINS: cannot import {name!r} ({e})") from None
    for ep in entry_points(group="moec.codecs"):
        ep.load()
