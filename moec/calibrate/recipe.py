"""Recipes: YAML files parsed into typed configs; unknown keys and wrong types are errors.

    kv:                       # omit for an uncompressed (fp16) cache
      codec: fp16             # fp16 | kivi | nuq-outlier | latent-head | latent-layer | rvq-tiered
      bits: 16
      window: 128             # recent tokens kept in fp16
      sinks: 4                # first tokens kept in fp16
      latent: {rank_k: 32, rank_v: 64, group_layers: 1, outlier_frac: 0.005}   # latent-head/-layer only
    weights:                  # rules, first match wins; unmatched tensors stay as they are
      - targets: [experts, shared_experts, mlp]   # or attention, router, lm_head, or a regex
        codec: keep           # keep | hls | rtn | fp8 | fp3
        bits: 16
        group_size: 64        # must divide the input dim of every targeted matrix (checked at calibrate)
        gptq: true            # hls/fp3: GPTQ error feedback (act-order) after the codebook fit
    calibration:
      expert_policy: all-experts-for-stats   # or damped-identity
      min_expert_tokens: 0    # experts below this many routed tokens follow expert_policy
      seed: 0
      tune_steps: 0           # > 0: hls codebooks tuned end to end (KL to the source model), tune.py

The resolved recipe (every default filled in) is written beside every output (`recipe.yaml`).
Codecs named by the design but not yet implemented parse, and are refused by `require_implemented`
when a command would have to execute them, naming what is implemented.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from ..errors import UserError
from ..formats.codecs import TARGET_PATTERNS

KVCodecName = Literal["fp16", "kivi", "nuq-outlier", "latent-head", "latent-layer", "rvq-tiered"]
WeightCodecName = Literal["keep", "hls", "rtn", "fp8", "fp3"]
IMPLEMENTED_KV = ("fp16", "kivi", "nuq-outlier", "latent-head", "latent-layer", "rvq-tiered")
# bits each implemented KV codec supports (fp16: 16 only; latent codecs: the bits of the latent codes)
KV_CODEC_BITS = {"fp16": (16,), "kivi": (2, 4), "nuq-outlier": (2, 3), "latent-head": (1, 2, 3, 4, 16),
                 "latent-layer": (1, 2, 3, 4, 16), "rvq-tiered": (1, 2, 3, 4)}  # rvq: a nominal label
# latent bits 1 = ternary latent codes (three levels, five per byte: 1.6 bits per latent element)


@dataclass
class LatentConfig:
    """Low-rank latent KV (seeds 000/001; Palu, xKV): keys and values of a group of `group_layers`
    adjacent layers (1 for latent-head) projected by a PCA basis fitted on calibration activations
    to `rank_k` / `rank_v` dims (0: the smallest multiple of 8 reaching `energy` of the variance,
    per group), the latent stored at kv.bits with an offline per-channel scale, plus the largest
    `outlier_frac` of each block's reconstruction residual in fp16 (moec/calibrate/fit_latent.py)."""

    rank_k: int = 0
    rank_v: int = 0
    energy: float = 0.99
    group_layers: int = 1
    outlier_frac: float = 0.005

    def __post_init__(self):
        for name in ("rank_k", "rank_v"):
            r = getattr(self, name)
            if r < 0 or r % 8:
                raise UserError(f"kv.latent.{name} must be a positive multiple of 8 (0: by energy), got {r}")
        if not 0.0 < self.energy <= 1.0:
            raise UserError(f"kv.latent.energy must be in (0, 1], got {self.energy}")
        if self.group_layers < 1:
            raise UserError(f"kv.latent.group_layers must be >= 1, got {self.group_layers}")
        if not 0.0 <= self.outlier_frac <= 0.1:
            raise UserError(f"kv.latent.outlier_frac must be in [0, 0.1], got {self.outlier_frac}")
IMPLEMENTED_WEIGHTS = ("keep", "hls", "rtn", "fp8", "fp3")


@dataclass
class RVQConfig:
    """Tiered residual VQ KV (seed 002; moec/runtime/kvrvq.py): the middle tier (blocks leaving the fp16
    window) is a residual VQ with `mid_sizes` centroids per stage over sub-vectors of `mid_dim` channels
    (Σ log2(size) / dim bits per element); blocks whose tokens are all `archive_after` or more tokens
    back are re-encoded into the archive tier (`arch_sizes`, `arch_dim`); archive_after 0: one tier.
    Codebooks per layer, per sub-vector position, per KV head (or `shared_heads`), fitted by k-means on
    post- or pre-RoPE keys (`rope`) and values (moec/calibrate/fit_rvq.py)."""

    mid_sizes: list[int] = field(default_factory=lambda: [64, 64])
    mid_dim: int = 4
    archive_after: int = 4096
    arch_sizes: list[int] = field(default_factory=lambda: [128])
    arch_dim: int = 4
    rope: Literal["pre", "post"] = "post"
    shared_heads: bool = False
    iters: int = 10  # Lloyd iterations per stage (at most; stops when the error stops falling)
    max_samples: int = 4096  # calibration tokens per layer the codebooks are fitted on

    def __post_init__(self):
        for name in ("mid_sizes", "arch_sizes"):
            sizes = getattr(self, name)
            if not sizes and (name == "mid_sizes" or self.archive_after):
                raise UserError(f"kv.rvq.{name} must list at least one codebook size")
            for c in sizes:
                if c < 2 or c > 2**16 or c & (c - 1):
                    raise UserError(f"kv.rvq.{name}: codebook size {c} is not a power of two in 2..65536")
        for name in ("mid_dim", "arch_dim"):
            if getattr(self, name) < 1:
                raise UserError(f"kv.rvq.{name} must be >= 1, got {getattr(self, name)}")
        if self.archive_after < 0:
            raise UserError(f"kv.rvq.archive_after must be >= 0 (0: no archive tier), got {self.archive_after}")
        if self.iters < 1 or self.max_samples < 16:
            raise UserError(f"kv.rvq.iters must be >= 1 and kv.rvq.max_samples >= 16, got {self.iters}, "
                            f"{self.max_samples}")


@dataclass
class KVConfig:
    codec: KVCodecName = "fp16"
    bits: int = 16
    window: int = 128
    sinks: int = 4
    # Tiered caches (kivi, nuq-outlier): tokens leave the window in blocks of `block` tokens, each
    # encoded once (KIVI's key group is the block; outliers are selected per block).
    block: int = 32
    group_size: int = 32  # kivi: channels per value group (must divide head_dim)
    outlier_frac: float = 0.01  # nuq-outlier: fraction of each block's elements kept as fp16 residuals
    levels: Literal["fixed", "fitted"] = "fitted"  # nuq-outlier: seed grid, or weighted k-means on calibration
    rope: Literal["pre", "post"] = "pre"  # nuq-outlier, latent-*: quantize keys before or after RoPE
    # nuq-outlier options (kvquant.NUQCenteredCodec; the defaults are the plain seed-003 codec):
    k_center: bool = False  # per-channel key center calibrated offline (asymmetric keys)
    outlier_select: Literal["magnitude", "weighted-error"] = "magnitude"  # key outliers: largest |k/scale|,
    # or largest rounding error weighted by the channel's calibrated query RMS
    k_scale_fit: Literal["quantile", "mse"] = "quantile"  # key scale: quantile of |k|, or MSE-searched multiple
    latent: LatentConfig | None = None  # latent-head / latent-layer settings (defaults when omitted)
    rvq: RVQConfig | None = None  # rvq-tiered settings (defaults when omitted)

    def __post_init__(self):
        if self.window < 0:
            raise UserError(f"kv.window must be >= 0, got {self.window}")
        if self.sinks < 0:
            raise UserError(f"kv.sinks must be >= 0, got {self.sinks}")
        if not 1 <= self.bits <= 16:
            raise UserError(f"kv.bits must be in 1..16, got {self.bits}")
        allowed = KV_CODEC_BITS.get(self.codec)
        if allowed is not None and self.bits not in allowed:
            raise UserError(f"kv.bits: codec {self.codec!r} supports bits {' or '.join(map(str, allowed))}, "
                            f"got {self.bits}")
        if not 0.0 <= self.outlier_frac <= 0.1:
            raise UserError(f"kv.outlier_frac must be in [0, 0.1], got {self.outlier_frac}")
        if self.block < 8 or self.block % 8:
            raise UserError(f"kv.block must be a positive multiple of 8, got {self.block}")
        if self.group_size < 1:
            raise UserError(f"kv.group_size must be >= 1, got {self.group_size}")
        for name, default in (("k_center", False), ("outlier_select", "magnitude"), ("k_scale_fit", "quantile")):
            if self.codec != "nuq-outlier" and getattr(self, name) != default:
                raise UserError(f"kv.{name}: only the nuq-outlier codec takes it, not {self.codec!r}")
        if self.codec.startswith("latent-"):
            if self.latent is None:
                self.latent = LatentConfig(group_layers=4 if self.codec == "latent-layer" else 1)
            if self.codec == "latent-head" and self.latent.group_layers != 1:
                raise UserError(f"kv.latent.group_layers: codec 'latent-head' shares nothing across layers "
                                f"(1), got {self.latent.group_layers}; use codec 'latent-layer'")
        elif self.latent is not None:
            raise UserError(f"kv.latent: only the latent-head / latent-layer codecs take it, not {self.codec!r}")
        if self.codec == "rvq-tiered":
            self.rvq = self.rvq or RVQConfig()
            if self.rvq.archive_after and self.rvq.archive_after <= self.window + self.block:
                raise UserError(f"kv.rvq.archive_after {self.rvq.archive_after} must exceed kv.window + kv.block "
                                f"({self.window} + {self.block}): tier boundaries out of order")
        elif self.rvq is not None:
            raise UserError(f"kv.rvq: only the rvq-tiered codec takes it, not {self.codec!r}")


@dataclass
class WeightRule:
    targets: list[str]
    codec: WeightCodecName = "keep"
    bits: int = 16
    group_size: int = 0  # 0: one group per output row
    gptq: bool = True  # hls/fp3: GPTQ error feedback with the full Hessian after fitting the codebooks

    def __post_init__(self):
        if not self.targets:
            raise UserError("weights rule: targets must name at least one target")
        for t in self.targets:
            if t not in TARGET_PATTERNS:
                try:
                    re.compile(t)
                except re.error as e:
                    raise UserError(f"weights rule: target {t!r} is neither a known target "
                                    f"({', '.join(TARGET_PATTERNS)}) nor a valid regex ({e})") from None
        if not 1 <= self.bits <= 16:
            raise UserError(f"weights rule: bits must be in 1..16, got {self.bits}")
        if self.group_size < 0:
            raise UserError(f"weights rule: group_size must be >= 0, got {self.group_size}")
        allowed = {"keep": None, "hls": (2, 3, 4), "rtn": (2, 3, 4), "fp3": (3,), "fp8": (8,)}[self.codec]
        if allowed is not None and self.bits not in allowed:
            raise UserError(f"weights rule: codec {self.codec!r} takes bits in {{{', '.join(map(str, allowed))}}}, "
                            f"got {self.bits} (weight bits must be one of 2, 3, 4, 8)")

    def patterns(self) -> list[re.Pattern]:
        return [re.compile(TARGET_PATTERNS.get(t, t)) for t in self.targets]


@dataclass
class CalibrationConfig:
    expert_policy: Literal["all-experts-for-stats", "damped-identity"] = "all-experts-for-stats"
    min_expert_tokens: int = 0
    seed: int = 0
    # hls codebooks tuned end to end after the layer-wise fit (calibrate/tune.py): Adam steps on the
    # codebook values, indices fixed, minimizing KL(source || quantized) on the calibration tokens
    tune_steps: int = 0
    tune_lr: float = 5e-3  # relative to each codebook's largest magnitude
    tune_batch: int = 2  # calibration sequences per step

    def __post_init__(self):
        if self.tune_steps < 0 or self.tune_lr <= 0 or self.tune_batch < 1:
            raise UserError(f"calibration: tune_steps must be >= 0, tune_lr > 0 and tune_batch >= 1, got "
                            f"{self.tune_steps}, {self.tune_lr}, {self.tune_batch}")


@dataclass
class Recipe:
    name: str = "unnamed"
    description: str = ""
    kv: KVConfig | None = None
    weights: list[WeightRule] = field(default_factory=list)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    version: int = 1

    def kv_or_default(self) -> KVConfig:
        return self.kv or KVConfig()

    def rule_for(self, tensor_name: str) -> WeightRule | None:
        for rule in self.weights:
            if any(p.search(tensor_name) for p in rule.patterns()):
                return rule
        return None

    def require_implemented(self) -> None:
        kv = self.kv_or_default()
        if kv.codec not in IMPLEMENTED_KV:
            raise UserError(f"kv codec {kv.codec!r} is not implemented in this moec version "
                            f"(implemented: {', '.join(IMPLEMENTED_KV)})")
        for rule in self.weights:
            if rule.codec not in IMPLEMENTED_WEIGHTS:
                raise UserError(f"weights codec {rule.codec!r} is not implemented in this moec version "
                                f"(implemented: {', '.join(IMPLEMENTED_WEIGHTS)})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# -- typed parsing ------------------------------------------------------------------------------------

def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _convert(value, tp, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _convert(value, args[0], where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise UserError(f"{where}: {value!r} is not {_type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return [_convert(v, typing.get_args(tp)[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise UserError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise UserError(f"{where}: unknown key {key!r} (known keys: {', '.join(sorted(known))})")
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise UserError(f"{where}: {e}") from None


def parse_recipe(data: dict, where: str = "recipe") -> Recipe:
    return _build(Recipe, data or {}, where)


def load_recipe(path: str | Path) -> Recipe:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"recipe {p}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"recipe {p}: not valid YAML ({str(e).splitlines()[0]})") from None
    recipe = parse_recipe(data, where=p.name)
    if recipe.name == "unnamed":
        recipe.name = p.stem
    return recipe
