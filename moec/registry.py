"""Codec registries: every KV codec and every weight codec is one registered spec.

A spec names, for one codec, everything the pipeline asks of it: the recipe config class, the
calibration hooks, the manifest section and tensor names, the runtime builders and kernels, the kernel
constraints, and a random stand-in for `moec pack --random`. Code that used to branch on codec names
(`if codec == "nuq-outlier"`, allow-lists of codecs) reads the spec instead (tests/test_registry_dispatch.py
fails on a comparison against a codec name outside a codec's own files), so a new codec is one
`register_kv(...)` / `register_weight(...)` call, from any module.

Where codecs register: each built-in codec family registers in its own module of moec/codecs/ (beside
its config class and its kernel constraints); this module imports them all at the first lookup (not at
import: `import moec.registry` imports nothing of moec). Codecs outside the package: modules named in
`MOEC_PLUGINS` (comma-separated) and the entry points of group `moec.codecs` are imported next, so their
`register_*` calls reach every moec command (tests/test_codec_registry.py registers toy codecs from the
test module alone and runs the CLI with MOEC_PLUGINS naming it).

A hook is either a callable or a "module:attribute" string resolved on first use: the built-in specs
name the hooks of their calibration and runtime halves by string so that reading a spec imports neither
(`fit` hooks live in moec/calibrate/, builders in moec/runtime/). The hooks the runtime resolves
(RUNTIME_HOOKS of each spec class) never point into moec/calibrate (tests/test_import_rules.py).

Own files: a codec's `family` is the stem of the files that hold its code (nuq-outlier: moec/codecs/nuq.py,
calibrate/nuq.py, runtime/nuq.py; kernels/<family>_*.py): only those and this module may compare codec
names (tests/test_registry_dispatch.py).

KV codec hooks (`args` is the model's runtime.config.ModelArgs, `cfg` the codec's config instance,
`section` the KV view, a dict: asdict(cfg) of the manifest's recipe.kv plus the `kv` section's shapes and derived
keys, joined by moec/runtime/loader.kv_section; see moec/formats/kvsection.py):
    config             dataclass of the recipe's `kv:` mapping for this codec (strict: keys it does
                       not declare are errors)
    identity           the uncompressed cache (fp16): nothing to calibrate, pack or load
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
    mla                True for a codec of the MLA latent row (DeepSeek: mla-nuq); only those serve an MLA
                       model, and they serve nothing else (calibrate/run.check_kv_attention)

Weight codec hooks (stored parts of a stacked matrix [E, O, I], formats/codecs.py):
    bits               the bit widths it takes
    identity           stores the tensor as the source has it (keep): nothing fitted, no parts
    quantize(W, H, rule) -> stored   calibration (W [E, O, I] fp32, H [E, I, I] or None)
    dequantize(bits, shape, stored) -> W_hat [E, O, I] fp32   the runtime reference
    random_stored(bits, shape, group_size, device, gen) -> stored   stand-in for --random
    lut(bits, stored) -> [E, O, G, K]   LUT codecs: the table the fused kernels read (optional)
    check_rule(rule)   UserError for a recipe rule's settings the codec cannot take (optional)
    allocate           calibrate/allocate.py may choose a width per matrix among `bits`
    fit_onehot         its fit solves the one-hot normal equations of a table refit (hls: calibrate/hls.refit_lut),
                       counted by the memory estimate (calibrate/memory.py)
    tune(bits, shape, parts, flat, device) -> tunable parameters (calibrate/tune.py protocol: deltas,
                       weight(), round_to_stored(), stored()) for end-to-end codebook tuning (optional)
    hold(bits, stored) -> {buffer: tensor}   what runtime/experts.QuantMatrix holds at run time (default:
                       the stored parts as they are, dequantized by `dequantize`)
    held_dequantize(bits, shape, held) -> W_hat [e, O, I] fp32   the reference from the held buffers of
                       some experts (every held buffer leads with E); with `hold`
    held_group(shape, held) -> int   the group size (inputs per group or per code) the held buffers encode
    kernel_mode        kernels/dequant.MODE_* when the fused MoE / qlinear kernels take it (else None)
    kernel_parts       the held buffers the kernels read, in kernels/dequant.QWeight's order (a, b, c)
    kernel_rule(bits, n_in, group_size) -> None or the rule the kernels need that these settings break
                       (checked when a recipe is bound to a model: calibrate, pack, pack --random)
    rows_concat        every held kernel part is per output row ([E, O, ...]): matrices of this codec reading one
                       input concatenate along the outputs into one launch (q/k/v: runtime/decode.py); vq's
                       per-matrix codebook does not
    exports            {export format: hook(param) -> None or why it cannot carry it} (moec/export)
    export_tensors     {export format: hook(param, names) -> (tensors, scheme)} (moec/export)
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

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
    identity: bool = False
    check: Hook = None
    sampler: Hook = None
    fit: Hook = None
    section: Hook = None
    tensor_names: Hook = None
    layer_codecs: Hook = None
    cache_factory: Hook = None
    random_tensors: Hook = None
    rope_pre: Hook = None
    ct_kv_cache: Hook = None  # (model args, kv.* tensors) -> (ct kv_cache_scheme, {HF name: tensor}): ct carries it
    description: str = ""
    family: str = ""  # the stem of its own files (default: the name)
    mla: bool = False  # holds the MLA latent row (DeepSeek) instead of per-head keys and values

    # hooks that moec/runtime resolves (never pointing into moec/calibrate: tests/test_import_rules.py)
    RUNTIME_HOOKS: ClassVar[tuple[str, ...]] = ("config", "section", "tensor_names", "layer_codecs",
                                                "cache_factory", "random_tensors", "rope_pre")

    def hook(self, name: str):
        return resolve(getattr(self, name))

    @property
    def tiered(self) -> bool:
        """A block codec of the tiered cache (runs in the static CUDA-graph engine as well)."""
        return self.layer_codecs is not None

    @property
    def own(self) -> str:
        return self.family or self.name


@dataclass(frozen=True)
class WeightCodecSpec:
    name: str
    bits: tuple[int, ...]
    identity: bool = False
    quantize: Hook = None
    dequantize: Hook = None
    random_stored: Hook = None
    lut: Hook = None
    check_rule: Hook = None
    allocate: bool = False
    fit_onehot: bool = False
    tune: Hook = None
    hold: Hook = None
    held_dequantize: Hook = None
    held_group: Hook = None
    kernel_mode: int | None = None
    kernel_parts: tuple[str, ...] = ()
    kernel_rule: Hook = None
    rows_concat: bool = False
    # parts a rule with `shared_codebook` stores once for all experts of a matrix (leading axis 1 instead of E)
    shared_parts: tuple[str, ...] = ()
    exports: dict[str, Hook] = field(default_factory=dict)
    export_tensors: dict[str, Hook] = field(default_factory=dict)
    description: str = ""
    family: str = ""

    RUNTIME_HOOKS: ClassVar[tuple[str, ...]] = ("dequantize", "random_stored", "lut", "hold", "held_dequantize",
                                                "held_group", "kernel_rule")

    def hook(self, name: str):
        return resolve(getattr(self, name))

    @property
    def tunable(self) -> bool:
        """Whether calibrate/tune.py can tune its codebooks / scales end to end."""
        return self.tune is not None

    @property
    def own(self) -> str:
        return self.family or self.name

    def kernel_error(self, bits: int, n_in: int, group_size: int) -> str | None:
        """The kernel rule that (bits, n_in, group_size) breaks, or None (also None: no kernel reads it)."""
        if self.kernel_mode is None or self.kernel_rule is None:
            return None
        return self.hook("kernel_rule")(bits, n_in, group_size)


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


def default_kv() -> KVCodecSpec:
    """The KV codec of a recipe without `kv:` (the identity: the uncompressed cache)."""
    return next(s for s in kv_codecs().values() if s.identity)


def default_weight() -> WeightCodecSpec:
    """The weight codec of a tensor no recipe rule selects (the identity: stored as the source has it)."""
    return next(s for s in weight_codecs().values() if s.identity)


def stored_as_is(codec: str) -> bool:
    """Whether a manifest entry's weight codec stores the tensor as the source has it (an unregistered name,
    e.g. the kv-calib tensors of a KV codec, is not)."""
    spec = weight_codecs().get(codec)
    return spec is not None and spec.identity


_plugins_loaded = False


def load_plugins() -> None:
    """Import the codecs once, at the first lookup (not at import, so a bad `MOEC_PLUGINS` is a one-line
    usage error from the CLI, not a traceback): the built-in moec/codecs/ modules, then `MOEC_PLUGINS`
    modules, then `moec.codecs` entry points."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    import pkgutil
    from importlib.metadata import entry_points

    from . import codecs

    for m in pkgutil.iter_modules(codecs.__path__):  # the built-in codecs, each registered in its own module
        importlib.import_module(f"{codecs.__name__}.{m.name}")

    for name in filter(None, (m.strip() for m in os.environ.get("MOEC_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise UserError(f"MOEC_PLUGINS: cannot import {name!r} ({e})") from None
    for ep in entry_points(group="moec.codecs"):
        ep.load()
