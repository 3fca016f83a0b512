"""Recipes: YAML files parsed into typed configs; unknown keys and wrong types are errors.

    version: 2                # optional; 1 = a resolved recipe of an older moec (read, upgraded)
    kv:                       # omit for an uncompressed (fp16) cache
      codec: nuq-outlier      # a registered KV codec (moec/registry.py); its config class
      bits: 2                 # (moec/codecs/<family>.py) says which keys it takes: any other is an error
      window: 128
    weights:                  # rules, first match wins; unmatched tensors stay as they are
      - targets: [experts, shared_experts, mlp]   # or attention, router, lm_head, or a regex
                              # (experts: MoE layers', mlp: dense layers' (mlp_only_layers) matrices)
        codec: keep           # a registered weight codec: keep | hls | rtn | fp8 | fp3 | vq | intsym
        bits: 16
        group_size: 64        # must divide the input dim of every targeted matrix (checked at calibrate)
        gptq: true            # hls/fp3/intsym: GPTQ error feedback after the codebook / scale fit
        actorder: true        # GPTQ columns by decreasing h_jj (static groups: the stored layout is unchanged)
        incoherence: {block: 0}   # optional: fit in a randomized block-Hadamard basis (0: auto block)
        allocate: {budget: 3.0, bits: [2, 3, 4]}  # optional: per-matrix widths at an average q_bits budget
    calibration:
      expert_policy: all-experts-for-stats   # or damped-identity
      min_expert_tokens: 0    # experts below this many routed tokens follow expert_policy
      seed: 0
      samples: 0              # calibration sequences and their length when `moec calibrate` is not given
      seq_len: 0              # --samples / --seq-len (0: its defaults, 32 × 512)
      tune_steps: 0           # > 0: hls codebooks / fp3 scales tuned end to end (KL to the source model), tune.py
      tune_holdout: 0.0       # share of the calibration sequences held back: best held-back KL kept
      tune_eval_every: 10     # steps between held-back evaluations
      tune_patience: 0        # > 0: stop after this many evaluations without improvement
      tune_lr_drops: 0        # plateau restarts from the best state at lr / 3 before stopping
      tune_norms: false       # also tune the norm gains (packed in place of the source's)

The resolved recipe (every default filled in) is written beside every output (`recipe.yaml`). An
empty recipe is an error (the identity recipe is moec/recipes/fp16.yaml, `--recipe fp16`); YAML errors
keep their line and column. Shipped recipes are found by name (moec/calibrate/catalog.py).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from ..codecs.base import TieredConfig
from ..codecs.fp16 import FP16Config
from ..errors import UserError
from ..formats.codecs import TARGET_KIND, TARGET_PATTERNS
from ..registry import default_kv, kv_codec, resolve, weight_codec, weight_codecs
from ..typed import build
from .catalog import find_recipe, recipe_files

RECIPE_VERSION = 2  # 2: one config class per KV codec (moec/codecs/); 1: one flat KV class
# keys every v1 resolved recipe carried in `kv:` whatever its codec, with their v1 defaults: a v1
# recipe (a CALIB_DIR/recipe.yaml written by moec before format 2) may carry them for codecs that
# do not use them, and they are dropped when they hold the default
_V1_KV_DEFAULTS = {"bits": 16, "window": 128, "sinks": 4, "block": 32, "group_size": 32, "outlier_frac": 0.01,
                   "levels": "fitted", "rope": "pre", "k_center": False, "outlier_select": "magnitude",
                   "k_scale_fit": "quantile", "latent": None, "rvq": None}


@dataclass
class Incoherence:
    """Incoherence processing (QuIP#, Chee et al. 2023; QuaRot, Ashkboos et al. 2024): each targeted
    matrix is fitted as W·R in the basis of a randomized block-Hadamard rotation R of its inputs
    (moec/rotation.py), with the rotated Hessian RᵀHR, and the runtime rotates the input, x·R, before the
    quantized matmul: y = (x·R)(W·R)ᵀ = x·Wᵀ. The rotation spreads outlier input channels over a block,
    so the codebooks are not stretched by a few large weights. One rotation per (layer, input): gate and
    up of a layer share one (their input is the same x), every expert of the layer uses it.
    block: a power of two dividing each targeted matrix's input dim (checked at calibrate, naming the
    matrix); 0 = auto: the largest power of two dividing it, at most max_block (576 -> 64, 1536 -> 512)."""

    block: int = 0
    max_block: int = 512

    def __post_init__(self):
        for key in ("block", "max_block"):
            v = getattr(self, key)
            if v < 0 or (v & (v - 1)) or (key == "max_block" and v == 0):
                raise UserError(f"weights rule: incoherence.{key} must be a power of two"
                                f"{' or 0 (auto)' if key == 'block' else ''}, got {v}")

    def block_for(self, n: int) -> int:
        """The block for an input dim n (0: none fits, the caller names the matrix)."""
        if self.block:
            return self.block if n % self.block == 0 else 0
        return min(n & -n, self.max_block)


@dataclass
class Candidate:
    """One choice `allocate.candidates` offers every matrix of the rule: a width and, where they differ from the
    rule's, the codec and its settings (unset: the rule's)."""

    bits: int
    codec: str | None = None
    group_size: int | None = None
    shared_codebook: bool | None = None


@dataclass
class Allocate:
    """Per-matrix bit widths at a fixed budget (calibrate/allocate.py): each targeted matrix is fitted at
    every width in `bits` (the rule's codec), or under every entry of `candidates` (codec, width and settings
    each: allocation across codecs), and after the last layer one candidate per unit is chosen, minimizing the
    summed sensitivity while the average q_bits over the rule's matrices (stored bytes: codes, codebooks,
    scales, signs) stays ≤ budget. A budget outside what the candidates can reach is refused before any fitting.
    sensitivity: output (Σ tr(ΔW H ΔWᵀ), the fit's own output error) or relative (divided by tr(W H Wᵀ)).
    unit: matrix (each stored [E, O, I] projection / attention matrix alone), gate_up (a layer's w1 and w3 share
    one candidate, w2 has its own: what the fused MoE kernels take, one width for the gate/up launch and one for
    the down launch; with candidates of several codecs a layer's w2 also keeps its w1's codec, as the fused
    kernels read one codec per layer) or layer (a layer's matrices of this rule share one candidate).
    keep_candidates: also write every candidate fit to calib.safetensors (`cand.<key>.fit.<param>.<part>`, key
    the width, or WeightRule.candidate_rules' key), so allocate.reallocate can choose again at another budget or
    sensitivity without refitting."""

    budget: float
    bits: list[int] | None = None  # default [2, 3, 4]; with candidates: their widths (give one or the other)
    candidates: list[Candidate] | None = None
    sensitivity: Literal["output", "relative"] = "output"
    unit: Literal["matrix", "gate_up", "layer"] = "matrix"
    keep_candidates: bool = False

    def __post_init__(self):
        if self.candidates is not None:
            widths = sorted({c.bits for c in self.candidates})
            if not self.candidates:
                raise UserError("weights rule: allocate.candidates must list at least one candidate")
            if self.bits is not None and sorted(self.bits) != widths:
                raise UserError(f"weights rule: allocate.candidates gives the widths ({widths}); leave allocate.bits "
                                f"out (got {self.bits})")
            self.bits = widths
        elif self.bits is None:
            self.bits = [2, 3, 4]
        if not self.bits or len(set(self.bits)) != len(self.bits):
            raise UserError(f"weights rule: allocate.bits must list distinct candidate widths, got {self.bits}")
        self.bits = sorted(self.bits)
        if not self.budget > 0:
            raise UserError(f"weights rule: allocate.budget must be > 0 q_bits, got {self.budget}")


@dataclass
class WeightRule:
    targets: list[str]
    codec: str = "keep"  # a registered weight codec (moec/registry.py)
    bits: int = 16
    group_size: int = 0  # 0: one group per output row
    gptq: bool = True  # hls/fp3/intsym: GPTQ error feedback with the full Hessian after fitting the codebooks
    # GPTQ visits columns by decreasing h_jj (compressed-tensors' `actorder: weight`, "static"): the fit's order
    # only; groups and the stored layout stay as they are (the g_idx form, `actorder: group`, is gone from
    # compressed-tensors 0.20, so no export could carry it)
    actorder: bool = True
    incoherence: Incoherence | None = None  # fit and run in a randomized block-Hadamard basis (above)
    allocate: Allocate | None = None  # per-matrix widths at a budget (above); `bits` is then the widest
    # one codebook per layer's matrix shared by its experts instead of one per expert (codecs with shared_parts:
    # vq): the codebook's bytes are paid once, which is what small experts' bits are made of
    shared_codebook: bool = False

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
        spec = weight_codec(self.codec)
        allowed = None if spec.identity else spec.bits
        if self.allocate is not None and self.allocate.candidates is not None:
            if self.bits not in (16, max(self.allocate.bits)):
                raise UserError(f"weights rule: with allocate.candidates, give the widths there, not bits: {self.bits}")
            self.bits = max(self.allocate.bits)
            self.candidate_rules()  # each candidate checked as a rule of its own
        elif self.allocate is not None:
            if not spec.allocate:
                takers = ", ".join(n for n, s in weight_codecs().items() if s.allocate)
                raise UserError(f"weights rule: allocate chooses among the widths of a codec that takes several "
                                f"({takers}), not {self.codec!r}")
            if bad := [b for b in self.allocate.bits if b not in allowed]:
                raise UserError(f"weights rule: allocate.bits {bad} not taken by codec {self.codec!r} "
                                f"(it takes {{{', '.join(map(str, allowed))}}})")
            if self.bits not in (16, max(self.allocate.bits)):
                raise UserError(f"weights rule: with allocate, give the candidate widths in allocate.bits "
                                f"({self.allocate.bits}), not bits: {self.bits}")
            self.bits = max(self.allocate.bits)  # the widest a matrix may get; each matrix's own is reported
        if allowed is not None and self.bits not in allowed:
            raise UserError(f"weights rule: codec {self.codec!r} takes bits in {{{', '.join(map(str, allowed))}}}, "
                            f"got {self.bits} (weight bits must be one of 2, 3, 4, 8)")
        if not spec.identity and (check := spec.hook("check_rule")) is not None:
            check(self)
        if self.shared_codebook and not spec.shared_parts:
            takers = ", ".join(n for n, s in weight_codecs().items() if s.shared_parts)
            raise UserError(f"weights rule: shared_codebook shares a codebook between experts; codec {self.codec!r} "
                            f"has none to share (codecs with one: {takers})")
        if self.incoherence is not None and spec.identity:
            raise UserError(f"weights rule: incoherence applies to quantized weights; codec {self.codec} stores them "
                            f"as is")

    def candidate_rules(self) -> dict[str, WeightRule]:
        """The rules `allocate` chooses among, each without allocate, by key: the width for `allocate.bits`
        (`cand.2.fit.*`), else codec, width, `g<group_size>` where nonzero and `s` for a shared codebook
        (`cand.tcq2.fit.*`, `cand.vq2g4s.fit.*`); {} without allocate."""
        a = self.allocate
        if a is None:
            return {}
        if a.candidates is None:
            return {str(b): dataclasses.replace(self, bits=b, allocate=None) for b in a.bits}
        out: dict[str, WeightRule] = {}
        for i, c in enumerate(a.candidates):
            codec = c.codec or self.codec
            if weight_codec(codec).identity:
                raise UserError(f"weights rule: allocate.candidates[{i}]: codec {codec!r} stores weights as they are; "
                                f"a candidate quantizes")
            r = dataclasses.replace(self, codec=codec, bits=c.bits, allocate=None,
                                    group_size=self.group_size if c.group_size is None else c.group_size,
                                    shared_codebook=(self.shared_codebook and bool(weight_codec(codec).shared_parts)
                                                     if c.shared_codebook is None else c.shared_codebook))
            key = f"{r.codec}{r.bits}{f'g{r.group_size}' if r.group_size else ''}{'s' if r.shared_codebook else ''}"
            if key in out:
                raise UserError(f"weights rule: allocate.candidates lists {key} twice")
            out[key] = r
        return out

    def chosen(self, name: str, allocation: list[dict]) -> WeightRule:
        """The rule matrix `name` is stored under given a calibration's `allocation` records (report.json): the
        candidate chosen for it (`choice`: its candidate_rules key; records written before cross-codec allocation
        hold only `bits`, the key of a width), or this rule itself."""
        for a in allocation:
            if name in a["bits"]:
                return self.candidate_rules()[a.get("choice", {}).get(name, str(a["bits"][name]))]
        return self

    def patterns(self) -> list[re.Pattern]:
        return [re.compile(TARGET_PATTERNS.get(t, t)) for t in self.targets]

    def selects(self, tensor_name: str, ffn_kinds: list[str] | None = None) -> bool:
        """Whether a target of this rule names the tensor. With the model's ffn_kinds, `experts` selects
        the stacked matrices of MoE layers only and `mlp` those of dense layers only (their names are the
        same: formats/codecs.TARGET_KIND); without them (a model not known yet) either selects both."""
        for t, p in zip(self.targets, self.patterns(), strict=True):
            m = p.search(tensor_name)
            if m and (ffn_kinds is None or t not in TARGET_KIND
                      or ffn_kinds[int(tensor_name.split(".")[1])] == TARGET_KIND[t]):
                return True
        return False


@dataclass
class CalibrationConfig:
    expert_policy: Literal["all-experts-for-stats", "damped-identity"] = "all-experts-for-stats"
    min_expert_tokens: int = 0
    seed: int = 0
    # the calibration set's size when `moec calibrate` is not given --samples / --seq-len (0: its defaults):
    # post-RoPE key statistics depend on the position, so a KV recipe for long contexts is calibrated on
    # sequences as long as the contexts it serves
    samples: int = 0
    seq_len: int = 0
    # hls codebooks and fp3 scales tuned end to end after the layer-wise fit (calibrate/tune.py): Adam
    # steps on their values, indices fixed, minimizing KL(source || quantized) on the calibration tokens
    tune_steps: int = 0  # at most this many (fewer when the held-back KL stops improving)
    tune_lr: float = 5e-3  # relative to each codebook's largest magnitude
    tune_batch: int = 2  # calibration sequences per step
    # held-back calibration sequences (a seeded share, not tuned on): their KL every tune_eval_every
    # steps picks the state kept, and tune_patience evaluations without improvement end the tuning
    # (after tune_lr_drops restarts from the best state at a third of the learning rate)
    tune_holdout: float = 0.0
    tune_eval_every: int = 10
    tune_patience: int = 0  # 0: run every step, still keep the held-back best
    tune_lr_drops: int = 0
    # the model's norm gains (every `*norm.weight` the recipe keeps) tuned with the codebooks, the one fp
    # parameter per input channel in front of each quantized matmul; packed in place of the source's (fp32)
    tune_norms: bool = False

    def __post_init__(self):
        if self.samples < 0 or self.seq_len < 0 or self.seq_len == 1:
            raise UserError(f"calibration: samples must be >= 0 and seq_len 0 or >= 2 (0: the calibrate defaults), "
                            f"got {self.samples}, {self.seq_len}")
        if self.tune_steps < 0 or self.tune_lr <= 0 or self.tune_batch < 1:
            raise UserError(f"calibration: tune_steps must be >= 0, tune_lr > 0 and tune_batch >= 1, got "
                            f"{self.tune_steps}, {self.tune_lr}, {self.tune_batch}")
        if not 0 <= self.tune_holdout < 1:
            raise UserError(f"calibration: tune_holdout is the share of calibration sequences held back, in [0, 1), "
                            f"got {self.tune_holdout}")
        if self.tune_eval_every < 1 or self.tune_patience < 0 or self.tune_lr_drops < 0:
            raise UserError(f"calibration: tune_eval_every must be >= 1, tune_patience and tune_lr_drops >= 0, got "
                            f"{self.tune_eval_every}, {self.tune_patience}, {self.tune_lr_drops}")
        if (self.tune_patience or self.tune_lr_drops) and not self.tune_holdout:
            raise UserError("calibration: tune_patience and tune_lr_drops act on the held-back KL: set tune_holdout "
                            "(e.g. 0.25)")
        if self.tune_norms and not self.tune_steps:
            raise UserError("calibration: tune_norms tunes the norm gains with the codebooks: set tune_steps")
        if self.tune_lr_drops and not self.tune_patience:
            raise UserError("calibration: tune_lr_drops restarts on a plateau of tune_patience evaluations: set "
                            "tune_patience")


@dataclass
class Recipe:
    name: str = "unnamed"
    description: str = ""
    kv: TieredConfig | FP16Config | None = None  # the codec's config class (moec/codecs/), by `codec`
    weights: list[WeightRule] = field(default_factory=list)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    version: int = RECIPE_VERSION

    def kv_or_default(self) -> TieredConfig | FP16Config:
        return self.kv or resolve(default_kv().config)()

    def rule_for(self, tensor_name: str, ffn_kinds: list[str] | None = None) -> WeightRule | None:
        """The first rule selecting the tensor (WeightRule.selects; ffn_kinds: the model's, which tells
        `experts` from `mlp`), None: kept."""
        for rule in self.weights:
            if rule.selects(tensor_name, ffn_kinds):
                return rule
        return None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# -- typed parsing (moec/typed.py) ----------------------------------------------------------------------

def _build(cls, data, where: str):
    return build(cls, data, where, parsers={"kv": _parse_kv} if cls is Recipe else None)


def _parse_kv(data, where: str):
    """The `kv:` mapping as its codec's config class (registry lookup by `codec`, default fp16)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping, got {type(data).__name__}")
    codec = data.get("codec", default_kv().name)
    if not isinstance(codec, str):
        raise UserError(f"{where}.codec: expected a codec name, got {type(codec).__name__} {codec!r}")
    return build(resolve(kv_codec(codec).config), data, where, codec=codec)


def _upgrade_v1(data: dict) -> dict:
    """A version-1 resolved recipe: drop the flat KV keys its codec does not use while they hold the
    v1 default (they were filled in by resolution, not chosen); anything else is parsed strictly."""
    kv = data.get("kv")
    if not isinstance(kv, dict):
        return data
    known = {f.name for f in dataclasses.fields(resolve(kv_codec(kv.get("codec", default_kv().name)).config))}
    kv = {k: v for k, v in kv.items() if k in known or k not in _V1_KV_DEFAULTS or v != _V1_KV_DEFAULTS[k]}
    return {**data, "kv": kv, "version": RECIPE_VERSION}


def parse_recipe(data: dict, where: str = "recipe") -> Recipe:
    if not data:
        raise UserError(f"{where}: the recipe is empty (the identity recipe is the shipped fp16: `name: fp16`)")
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping, got {type(data).__name__}")
    version = data.get("version", RECIPE_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= RECIPE_VERSION:
        raise UserError(f"{where}.version: {version!r} is not a recipe version this moec reads "
                        f"(1..{RECIPE_VERSION}; a newer moec wrote it?)")
    if version == 1:
        data = _upgrade_v1(data)
    return _build(Recipe, data, where)


def load_recipe(path: str | Path) -> Recipe:
    """The recipe of a file, or of a shipped recipe by name (catalog.find_recipe: `load_recipe("experts-hls3")`)."""
    p = find_recipe(path)
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"recipe {p}: not valid YAML{at}: {what}") from None
    recipe = parse_recipe(data, where=p.name)
    if recipe.name == "unnamed":
        recipe.name = p.stem
    return recipe


def shipped_gpu_recipes(directory: str | Path) -> list[str]:
    """Names of the recipes of `directory` (recipe_files) whose GPU path ships and must be checked on the GPU
    (benchmarks/gpu_smoke.py): all but the identity (no kv and no weights: nothing on a GPU path) and the
    ablations of a single setting (a description starting "ablation of")."""
    out = []
    for p in recipe_files(directory):
        d = yaml.safe_load(p.read_text())
        if not d.get("kv") and not d.get("weights"):
            continue
        if str(d.get("description", "")).startswith("ablation of"):
            continue
        out.append(p.stem)
    return out
