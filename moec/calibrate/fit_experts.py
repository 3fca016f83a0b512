"""Weight fitting during `moec calibrate`: which tensors a recipe quantizes (experts, dense MLPs and
attention projections), the starved-expert policy, Hessian regularization, and the call into the pure
quantizers (hls.py).

For each targeted layer the capture observer (hessian.ExpertHessians) hands over H1 [E, D, D] (input
of w1/w3), H2 [E, I, I] (input of w2) and token counts; `ExpertFitter.on_layer` picks each expert's
Hessian (routed, all-tokens or identity), damps it, quantizes the layer's targeted matrices and keeps
only the stored tensors (`fit.<param>.<part>`) and a report entry. Attention projections take the
same path with E = 1: hessian.AttentionHessians hands over Hqkv [D, D] (input of wq/wk/wv) and Ho
[H·d, H·d] (input of wo) to `ExpertFitter.on_attention_layer`, and their parts are stored without
the E axis ([O, ...], as the runtime loads a quantized attention projection: runtime/experts.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch

from ..errors import UserError
from ..formats.codecs import ROTATION_PART
from ..progress import tracked
from ..registry import weight_codec, weight_codecs
from ..rotation import hadamard_signs, rotate, rotate_hessian
from ..runtime.config import ModelArgs
from ..runtime.experts import ATTN_PARAM
from ..runtime.model import Transformer
from . import hls
from .distributed import Dist
from .hessian import regularize
from .recipe import Recipe, WeightRule

EXPERT_PARAM = re.compile(r"layers\.(\d+)\.moe\.(w[123])$")
QUANTIZABLE = re.compile(rf"{EXPERT_PARAM.pattern}|{ATTN_PARAM.pattern}")
# which input a matrix reads: matrices of one layer reading the same input share its rotation
_INPUT_OF = {"w1": 0, "w3": 0, "w2": 1, "wq": 2, "wk": 2, "wv": 2, "wo": 3}


def rotation_signs(name: str, n: int, rule: WeightRule, seed: int) -> torch.Tensor | None:
    """The incoherence rotation of matrix `name` (input dim n) under `rule`, or None: its sign vector
    (rotation.hadamard_signs), seeded by (calibration seed, layer, input) so that gate and up of a layer
    share one rotation and every process of a distributed run draws the same."""
    if rule.incoherence is None:
        return None
    block = rule.incoherence.block_for(n)
    assert block, (name, n)  # plan() refused it
    layer, p = int(name.split(".")[1]), name.removesuffix(".weight").rsplit(".", 1)[-1]
    return hadamard_signs(n, block, (seed * 100_003 + layer) * 4 + _INPUT_OF[p])


def canonical_names(args: ModelArgs) -> dict[str, tuple]:
    with torch.device("meta"):
        m = Transformer(args)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def plan(args: ModelArgs, recipe: Recipe) -> dict[str, WeightRule]:
    """{param: rule} for every tensor a non-keep rule selects; user errors for what cannot be done."""
    names = canonical_names(args)
    targets: dict[str, WeightRule] = {}
    for ri, rule in enumerate(recipe.weights):
        if rule.codec == "keep":
            continue
        hit = [n for n in names if recipe.rule_for(n) is rule]
        if set(rule.targets) <= {"experts"} and not args.is_moe:
            hit = []  # "experts" on a dense model: nothing to target (say `mlp`)
        if set(rule.targets) <= {"mlp"} and "dense" not in args.ffn_kinds:
            hit = []
        if not hit:
            raise UserError(f"weights rule {ri} (targets {rule.targets}, codec {rule.codec}) selects no tensor of "
                            f"this model ({args.arch}: {'MoE' if args.is_moe else 'dense'} layers); "
                            f"targets that exist here: {'experts' if args.is_moe else 'mlp'}, attention")
        for n in hit:
            m = QUANTIZABLE.search(n)
            if not m:
                raise UserError(f"weights rule {ri}: codec {rule.codec!r} on {n!r}: this moec version quantizes "
                                f"only expert, dense-MLP and attention matrices (layers.*.moe.w1/w2/w3, "
                                f"layers.*.attn.wq/wk/wv/wo.weight)")
            I = names[n][-1]  # experts [E, O, I], attention [O, I]
            if rule.group_size and I % rule.group_size:
                divs = [d for d in range(8, I + 1, 8) if I % d == 0]
                raise UserError(f"weights rule {ri}: group_size {rule.group_size} does not divide the input dim "
                                f"{I} of {n} (divisors that are multiples of 8: {divs}; or 0 for one group per row)")
            if rule.incoherence is not None and not rule.incoherence.block_for(I):
                raise UserError(f"weights rule {ri}: incoherence block {rule.incoherence.block} does not divide the "
                                f"input dim {I} of {n} (powers of two that do: "
                                f"{[1 << k for k in range((I & -I).bit_length())]}; or 0 for auto)")
            targets[n] = rule
    return targets


class ExpertFitter:
    """The `on_layer` callback of ExpertHessians: fit, keep stored tensors and report, drop H."""

    def __init__(self, targets: dict[str, WeightRule], layer_state: Callable[[int], dict], policy: str,
                 min_tokens: int, dist: Dist | None = None, seed: int = 0):
        self.targets, self.layer_state, self.dist = targets, layer_state, dist or Dist()
        self.seed = seed  # of the incoherence rotations
        self.policy, self.min_tokens = policy, min_tokens
        self.tensors: dict[str, torch.Tensor] = {}
        self.report: dict[int, dict] = {}
        self.seconds = 0.0
        self.tune_report: dict | None = None

    def layers(self) -> set[int]:
        """Layers with a targeted expert/MLP matrix (for ExpertHessians)."""
        return {int(m.group(1)) for n in self.targets if (m := EXPERT_PARAM.search(n))}

    def attention_layers(self) -> set[int]:
        """Layers with a targeted attention projection (for AttentionHessians)."""
        return {int(m.group(1)) for n in self.targets if (m := ATTN_PARAM.search(n))}

    def _fit(self, name: str, W: torch.Tensor, H: torch.Tensor, rule: WeightRule) -> tuple[dict, dict]:
        """Quantize W [E, O, I] (or [O, I] with H [I, I]: an attention projection, one "expert") under
        `rule`; returns the stored parts {part: [E, ...]} (a 2-D parameter's without the E axis) and
        the report entry. With `rule.incoherence` the fit sees W·R and RᵀHR (the same output error, in the
        rotated basis) and the parts carry R's signs (ROTATION_PART, shared by the layer: no E axis)."""
        flat = W.dim() == 2
        W3, H3 = (W[None], H[None]) if flat else (W, H)
        signs = rotation_signs(name, W3.shape[-1], rule, self.seed)
        if signs is not None:
            W3, H3 = rotate(W3, signs.to(W3.device)), rotate_hessian(H3, signs.to(H3.device))
        spec = weight_codec(rule.codec)
        stored = spec.hook("quantize")(W3, H3, rule)
        W_hat = spec.hook("dequantize")(rule.bits, tuple(W3.shape), stored)
        assert torch.isfinite(W_hat).all(), f"{name}: non-finite dequantized weights"
        err = hls.output_error(W3, W_hat, H3)
        parts = {part: (t[0] if flat else t).cpu().contiguous() for part, t in stored.items()}
        entry = {"codec": rule.codec, "bits": rule.bits, "group_size": rule.group_size, "gptq": rule.gptq,
                 "rel_output_error": [round(x, 6) for x in err.tolist()]}
        if signs is not None:
            parts[ROTATION_PART] = signs
            entry["incoherence_block"] = signs.shape[1]
        return parts, entry

    def _hessians(self, stats: dict, key: str, experts: list[int]) -> tuple[torch.Tensor, list[dict]]:
        """The damped Hessians [n, m, m] of `experts` (stats[key] holds them in that order) and a note each.

        Damped in place: stats[key] becomes the result (the raw sums are not needed after this; a copy of
        the stack is 6.6 GB at the Mixtral shape), and the all-token sums are dropped once used."""
        H = stats[key]  # [n, m, m]
        notes = []
        count = stats["count"].tolist()
        for j, e in enumerate(experts):
            c, source = count[e], "routed"
            if c < self.min_tokens:
                if self.policy == "all-experts-for-stats" and f"{key}_all" in stats:
                    H[j] = stats[f"{key}_all"] if stats[f"{key}_all"].dim() == 2 else stats[f"{key}_all"][j]
                    source = "all-tokens"
                else:
                    H[j] = torch.eye(H.shape[-1], device=H.device)
                    source = "identity"
            Hd, note = regularize(H[j])
            H[j] = Hd
            if note["status"] in ("non-finite", "zero", "singular"):
                source = "identity"
            notes.append({"tokens": c, "hessian": source, **note})
        stats.pop(f"{key}_all", None)
        return H, notes

    def on_layer(self, layer: int, stats: dict) -> None:
        """Fit the layer's targeted matrices for the experts in stats["experts"] (all by default; an
        expert-parallel rank's share otherwise), then gather every rank's share on rank 0."""
        t0 = time.time()
        sd = self.layer_state(layer)
        experts = stats.get("experts", list(range(len(stats["count"]))))
        H1, n1 = self._hessians(stats, "H1", experts)
        H2, n2 = self._hessians(stats, "H2", experts)
        entry = {"experts": [{"tokens": a["tokens"], "hessian_w13": a["hessian"], "status_w13": a["status"],
                              "damp_w13": a["damp"], "hessian_w2": b["hessian"], "status_w2": b["status"],
                              "damp_w2": b["damp"]}
                             for a, b in zip(n1, n2, strict=True)]}
        tensors = {}
        for p in tracked(("w1", "w3", "w2"), f"layer {layer}: fitting {len(experts)} experts", 3, "matrices"):
            name = f"layers.{layer}.moe.{p}"
            rule = self.targets.get(name)
            if rule is None or not experts:  # a rank that owns no expert of this layer (a dense MLP's one)
                continue
            H = H2 if p == "w2" else H1
            # one expert at a time, so a fit's temporaries (GPTQ's Cholesky factors of I x I, the Lloyd
            # distance tables) are one expert's, not E times that; experts fit independently (the expert-
            # parallel ranks rely on it too), so the stored parts are the same as from one batched call.
            # Fits run where the statistics are (cpu or cuda).
            fits = [self._fit(name, sd[name][e : e + 1].to(H.device, torch.float32), H[j : j + 1], rule)
                    for j, e in enumerate(experts)]
            entry[p] = {**fits[0][1], "rel_output_error": [x for _, r in fits for x in r["rel_output_error"]]}
            # the rotation's signs are the layer's, not per expert: kept once
            tensors.update({f"fit.{name}.{part}": fits[0][0][part] if part == ROTATION_PART else
                            torch.cat([f[part] for f, _ in fits]) for part in fits[0][0]})
            del fits
        if self.dist.grouped:
            shares = self.dist.gather(tensors, {"entry": entry, "experts": experts})
            if shares is None:  # not rank 0: its share is sent, nothing kept
                self.seconds += time.time() - t0
                return
            tensors, entry = _merge(shares, len(stats["count"]))
        self.tensors.update(tensors)
        self.report.setdefault(layer, {}).update(entry)
        self.seconds += time.time() - t0

    def on_attention_layer(self, layer: int, stats: dict) -> None:
        """The `on_layer` callback of AttentionHessians: Hqkv / Ho damped (regularize), the layer's
        targeted projections fitted with them, statistics dropped by the caller."""
        t0 = time.time()
        sd = self.layer_state(layer)
        entry: dict = {"tokens": stats["count"]}
        Hs = {}
        for key, tag in (("Hqkv", "qkv"), ("Ho", "o")):
            Hs[key], note = regularize(stats[key])
            entry[f"status_{tag}"] = note["status"]  # non-finite / zero / singular: identity (least squares)
            entry[f"damp_{tag}"] = note["damp"]
        for p in ("wq", "wk", "wv", "wo"):
            name = f"layers.{layer}.attn.{p}.weight"
            rule = self.targets.get(name)
            if rule is None:
                continue
            H = Hs["Ho" if p == "wo" else "Hqkv"]
            parts, entry[p] = self._fit(name, sd[name].to(H.device, torch.float32), H, rule)
            self.tensors.update({f"fit.{name}.{part}": t for part, t in parts.items()})
        self.report.setdefault(layer, {})["attention"] = entry
        self.seconds += time.time() - t0

    def state_dict(self) -> dict:
        """Fitted tensors and report entries so far, for a resumable calibration (resume.py)."""
        return {**{f"tensors.{k}": t for k, t in self.tensors.items()}, "seconds": self.seconds,
                "report": {str(i): e for i, e in self.report.items()}, "tune_report": self.tune_report}

    def load_state_dict(self, sd: dict) -> None:
        self.tensors = {k.removeprefix("tensors."): t for k, t in sd.items() if k.startswith("tensors.")}
        self.report = {int(i): e for i, e in sd["report"].items()}
        self.seconds, self.tune_report = sd["seconds"], sd["tune_report"]

    def tune(self, args: ModelArgs, state: dict[str, torch.Tensor], tokens: torch.Tensor, cal, seed: int,
             device: str = "cpu") -> None:
        """End-to-end tuning of the fitted hls codebooks and fp3 scales (tune.py) under the recipe's
        calibration config `cal`; other codecs are left as fitted."""
        from .tune import tune_codebooks

        tuned = {n: r for n, r in self.targets.items() if weight_codec(r.codec).tunable}
        if not tuned:
            tunable = ", ".join(n for n, s in weight_codecs().items() if s.tunable)
            raise UserError(f"calibration.tune_steps tunes codebooks end to end, and no weights rule of this recipe "
                            f"uses a codec that has them ({tunable})")
        t0 = time.time()
        self.tune_report = tune_codebooks(args, state, self.tensors, {n: (r.codec, r.bits) for n, r in tuned.items()},
                                          tokens, cal.tune_steps, cal.tune_lr, cal.tune_batch, seed, device,
                                          holdout=cal.tune_holdout, eval_every=cal.tune_eval_every,
                                          patience=cal.tune_patience, lr_drops=cal.tune_lr_drops)
        self.tune_report["seconds"] = round(time.time() - t0, 2)


def _merge(shares: list[tuple[dict, dict]], n_experts: int) -> tuple[dict, dict]:
    """One layer's fitted parts and report entry from every rank's share (distributed.py): expert e's
    slice and per-expert report items come from the rank whose `experts` list holds it."""
    where = {e: (r, j) for r, (_, meta) in enumerate(shares) for j, e in enumerate(meta["experts"])}
    n = n_experts  # the MoE layer's experts, or 1 for a dense MLP
    assert sorted(where) == list(range(n)), sorted(where)  # every expert of the layer exactly once

    def interleave(items: list) -> list:
        return [items[r][j] for r, j in (where[e] for e in range(n))]

    tensors = {}
    for name in shares[0][0]:
        ts = [t.get(name) for t, _ in shares]  # None: a rank that owns no expert of this layer
        if name.endswith("." + ROTATION_PART):  # the layer's rotation, the same on every rank
            tensors[name] = next(t for t in ts if t is not None)
            continue
        out = torch.empty((n, *ts[0].shape[1:]), dtype=ts[0].dtype)
        for e, (r, j) in where.items():
            out[e] = ts[r][j]
        tensors[name] = out
    entries = [meta["entry"] for _, meta in shares]
    entry = {"experts": interleave([en["experts"] for en in entries])}
    for p in ("w1", "w3", "w2"):
        if p in entries[0]:
            errs = interleave([en.get(p, {}).get("rel_output_error") for en in entries])
            entry[p] = {**entries[0][p], "rel_output_error": errs}
    return tensors, entry
