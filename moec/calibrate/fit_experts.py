"""Weight fitting during `moec calibrate`: which tensors a recipe quantizes (experts, dense MLPs,
attention projections, shared experts, routers and the LM head), the starved-expert policy, Hessian
regularization, and the call into the pure quantizers (hls.py).

For each targeted layer the capture observer (hessian.ExpertHessians) hands over H1 [E, D, D] (input
of w1/w3), H2 [E, I, I] (input of w2) and token counts; `ExpertFitter.on_layer` picks each expert's
Hessian (routed, all-tokens or identity), damps it, quantizes the layer's targeted matrices and keeps
only the stored tensors (`fit.<param>.<part>`) and a report entry. Attention projections take the
same path with E = 1: hessian.AttentionHessians hands over Hqkv [D, D] (input of wq/wk/wv) and Ho
[H·d, H·d] (input of wo) to `ExpertFitter.on_attention_layer`, and their parts are stored without
the E axis ([O, ...], as the runtime loads a quantized attention projection: runtime/experts.py).
Shared experts and routers likewise (E = 1, stored [O, ...]): hessian.SharedHessians hands over Hx
[D, D] (the normed x entering the MoE block, every token: input of the router and of the shared w1/w3)
and Hs [S, S] (input of the shared w2) to `on_shared_layer`. The LM head's Hessian is the final norm's
output (`fit_head`, called by run.py at the end of the layer loop); on a tied model its source is the
embedding table, fitted as a separate `output.weight` (pack.py unties the packed model; the input
embedding stays as it is).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

import torch

from ..errors import UserError
from ..formats.codecs import ROTATION_PART
from ..progress import tracked
from ..registry import weight_codec, weight_codecs
from ..rotation import hadamard_signs, pack_signs, rotate, rotate_hessian
from ..runtime.config import ModelArgs
from ..runtime.experts import ATTN_PARAM, HEAD_PARAM, ROUTER_PARAM, SHARED_PARAM
from ..runtime.model import Transformer
from . import allocate, hls
from .distributed import Dist
from .hessian import regularize
from .recipe import Recipe, WeightRule

log = logging.getLogger(__name__)
EXPERT_PARAM = re.compile(r"layers\.(\d+)\.moe\.(w[123])$")
QUANTIZABLE = re.compile(rf"{EXPERT_PARAM.pattern}|{ATTN_PARAM.pattern}|{SHARED_PARAM.pattern}|"
                         rf"{ROUTER_PARAM.pattern}|{HEAD_PARAM.pattern}")
HEAD = "output.weight"
# which input a matrix reads: matrices of one layer reading the same input share its rotation (the
# router and the shared w1/w3 read the experts' x; the shared w2 its own intermediate: rotation_signs)
_INPUT_OF = {"w1": 0, "w3": 0, "w2": 1, "wq": 2, "wk": 2, "wv": 2, "wo": 3, "router": 0, "wq_a": 2, "wkv_a": 2}
# MLA's inner inputs (q_a_norm's output, the latent c): seeds apart from the four per-layer inputs above
_MLA_INNER = {"wq_b": 0, "wkv_b": 1}
# each attention projection's input statistic (hessian.AttentionHessians)
_ATTN_INPUT = {"wq": "Hqkv", "wk": "Hqkv", "wv": "Hqkv", "wq_a": "Hqkv", "wkv_a": "Hqkv", "wq_b": "Hqb",
               "wkv_b": "Hkvb", "wo": "Ho"}


def rotation_signs(name: str, n: int, rule: WeightRule, seed: int) -> torch.Tensor | None:
    """The incoherence rotation of matrix `name` (input dim n) under `rule`, or None: its sign vector
    (rotation.hadamard_signs), seeded by (calibration seed, layer, input) so that gate and up of a layer
    share one rotation and every process of a distributed run draws the same."""
    if rule.incoherence is None:
        return None
    block = rule.incoherence.block_for(n)
    assert block, (name, n)  # plan() refused it
    if name == HEAD:  # the final norm's output: a seed no layer's input takes
        return hadamard_signs(n, block, (1 << 41) + seed)
    layer, p = int(name.split(".")[1]), name.removesuffix(".weight").rsplit(".", 1)[-1]
    if name.endswith("shared.w2.weight"):  # inputs 0..3 keep the seeds they had before shared experts
        return hadamard_signs(n, block, (1 << 40) + seed * 100_003 + layer)
    if p in _MLA_INNER:
        return hadamard_signs(n, block, (1 << 42) + (seed * 100_003 + layer) * 2 + _MLA_INNER[p])
    return hadamard_signs(n, block, (seed * 100_003 + layer) * 4 + _INPUT_OF[p])


def canonical_names(args: ModelArgs) -> dict[str, tuple]:
    """{name: shape} of the model's parameters; a tied model also lists `output.weight` (the LM head a
    recipe may quantize apart from the embedding it shares weights with)."""
    with torch.device("meta"):
        m = Transformer(args)
    names = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    if args.tie_embeddings:
        names[HEAD] = names["tok_embeddings.weight"]
    return names


def existing_targets(args: ModelArgs) -> list[str]:
    """The named targets that select a tensor of this model (for error messages)."""
    kinds = set(args.ffn_kinds)
    return [*(["experts"] if "moe" in kinds else []), *(["shared_experts"] if args.shared_dim and "moe" in kinds
                                                         else []),
            *(["mlp"] if "dense" in kinds else []), "attention", *(["router"] if "moe" in kinds else []), "lm_head"]


def check_kernel_rule(ri: int, rule: WeightRule, name: str, n_in: int) -> None:
    """UserError (one line) when rule `ri` on matrix `name` (n_in inputs) has groups that do not divide n_in
    (W4A16's 128 on SmolLM2's 576, named with the matrix and its dim), or breaks a rule of the kernels that
    read its codec (WeightCodecSpec.kernel_rule: e.g. LUT groups of multiples of 16 inputs), for every width
    the rule may give it; checked before any work instead of a silent torch fallback at run time."""
    for r in rule.candidate_rules().values() or [rule]:
        if r.group_size and n_in % r.group_size:  # every grouped codec (the fitters and packers assume it)
            divs = [d for d in range(8, n_in + 1, 8) if n_in % d == 0]
            raise UserError(f"weights rule {ri} (codec {r.codec}): group_size {r.group_size} does not divide the "
                            f"input dim {n_in} of {name} (divisors that are multiples of 8: {divs}; or 0 for one "
                            f"group per row)")
        if (why := weight_codec(r.codec).kernel_error(r.bits, n_in, r.group_size)) is not None:
            raise UserError(f"weights rule {ri} (codec {r.codec}, bits {r.bits}, group_size {r.group_size}) on "
                            f"{name}: {why}")


def check_kernel_rules(args: ModelArgs, recipe: Recipe) -> None:
    """check_kernel_rule for every quantized matrix of the model the recipe selects (`moec pack` and
    `pack --random` bind the recipe to the model here; calibrate through plan())."""
    for n, shape in canonical_names(args).items():
        rule = recipe.rule_for(n, args.ffn_kinds)
        if rule is not None and not weight_codec(rule.codec).identity and QUANTIZABLE.search(n):
            check_kernel_rule(next(i for i, r in enumerate(recipe.weights) if r is rule), rule, n, shape[-1])


def plan(args: ModelArgs, recipe: Recipe) -> dict[str, WeightRule]:
    """{param: rule} for every tensor a non-keep rule selects; user errors for what cannot be done."""
    names = canonical_names(args)
    targets: dict[str, WeightRule] = {}
    for ri, rule in enumerate(recipe.weights):
        if weight_codec(rule.codec).identity:
            continue
        hit = [n for n in names if recipe.rule_for(n, args.ffn_kinds) is rule]
        if not hit:
            layers = "+".join(sorted(set(args.ffn_kinds), reverse=True))
            raise UserError(f"weights rule {ri} (targets {rule.targets}, codec {rule.codec}) selects no tensor of "
                            f"this model ({args.arch}: {layers} layers{', shared experts' if args.shared_dim else ''})"
                            f"; targets that exist here: {', '.join(existing_targets(args))}")
        for n in hit:
            m = QUANTIZABLE.search(n)
            if not m:
                raise UserError(f"weights rule {ri}: codec {rule.codec!r} on {n!r}: this moec version quantizes "
                                f"only expert, dense-MLP, shared-expert, attention, router and LM-head matrices "
                                f"(layers.*.moe.w1/w2/w3, layers.*.moe.shared.w1/w2/w3.weight, "
                                f"layers.*.attn.wq/wk/wv/wo.weight or MLA's wq_a/wq_b/wkv_a/wkv_b, "
                                f"layers.*.moe.router.weight, output.weight)")
            I = names[n][-1]  # experts [E, O, I], the others [O, I]
            check_kernel_rule(ri, rule, n, I)
            if rule.incoherence is not None and not rule.incoherence.block_for(I):
                raise UserError(f"weights rule {ri}: incoherence block {rule.incoherence.block} does not divide the "
                                f"input dim {I} of {n} (powers of two that do: "
                                f"{[1 << k for k in range((I & -I).bit_length())]}; or 0 for auto)")
            targets[n] = rule
    beyond = [n for n in targets if not (EXPERT_PARAM.search(n) or ATTN_PARAM.search(n))]
    if recipe.calibration.tune_steps and beyond:  # tune.py rebuilds experts and attention only
        raise UserError(f"calibration.tune_steps tunes expert, dense-MLP and attention codebooks; this recipe also "
                        f"quantizes {beyond[0]} (shared expert, router or LM head): set tune_steps: 0 or keep it")
    alloc_beyond = [n for n in beyond if targets[n].allocate is not None]
    if alloc_beyond:  # allocate_bits reads per-layer expert/attention report entries
        raise UserError(f"weights rule with `allocate` selects {alloc_beyond[0]}: allocation covers expert, dense-MLP "
                        f"and attention matrices; give shared experts, the router and the LM head their own rule")
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
        self.allocation: list[dict] | None = None  # per allocate rule: what each matrix got (allocate_bits)
        self.head_report: dict | None = None

    def layers(self) -> set[int]:
        """Layers with a targeted expert/MLP matrix (for ExpertHessians)."""
        return {int(m.group(1)) for n in self.targets if (m := EXPERT_PARAM.search(n))}

    def attention_layers(self) -> set[int]:
        """Layers with a targeted attention projection (for AttentionHessians)."""
        return {int(m.group(1)) for n in self.targets if (m := ATTN_PARAM.search(n))}

    def shared_layers(self) -> set[int]:
        """Layers with a targeted shared-expert matrix or router (for SharedHessians)."""
        return {int(m.group(1)) for n in self.targets if (m := SHARED_PARAM.search(n) or ROUTER_PARAM.search(n))}

    def shared_down_layers(self) -> set[int]:
        """Layers whose shared w2 is targeted (SharedHessians accumulates its input's H only there)."""
        return {int(m.group(1)) for n in self.targets if (m := SHARED_PARAM.search(n)) and m.group(2) == "w2"}

    def rotation_signs(self, name: str, n: int, rule: WeightRule) -> torch.Tensor | None:
        """The incoherence rotation of matrix `name` (n inputs) under `rule` (module-level rotation_signs)."""
        return rotation_signs(name, n, rule, self.seed)

    def _fit(self, name: str, W: torch.Tensor, H: torch.Tensor, rule: WeightRule) -> tuple[dict, dict]:
        """Quantize W [E, O, I] (or [O, I] with H [I, I]: an attention projection, one "expert") under
        `rule`; returns the stored parts {part: [E, ...]} (a 2-D parameter's without the E axis) and
        the report entry. With `rule.incoherence` the fit sees W·R and RᵀHR (the same output error, in the
        rotated basis) and the parts carry R's signs (ROTATION_PART bit-packed, rotation.pack_signs; shared by
        the layer: no E axis)."""
        flat = W.dim() == 2
        W3, H3 = (W[None], H[None]) if flat else (W, H)
        signs = self.rotation_signs(name, W3.shape[-1], rule)
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
            parts[ROTATION_PART] = pack_signs(signs)  # one bit per sign (formats/codecs.py)
            entry["incoherence_block"] = signs.shape[1]
        return parts, entry

    def _fit_widths(self, name: str, Ws: list[torch.Tensor], Hs: list[torch.Tensor], rule: WeightRule,
                    H_all: torch.Tensor | None = None) -> tuple[dict, dict]:
        """Fit W [1, O, I] (or [O, I]) of each expert (Ws, with its Hessian in Hs) under `rule`: the stored
        tensors ({f"fit.{name}.{part}"}: the experts concatenated, the rotation signs once) and the report
        entry. A rule with `allocate` is fitted under each candidate (WeightRule.candidate_rules), stored as
        `cand.<key>.fit.<name>.*`, its entry holding each candidate's errors per expert (allocate_bits chooses
        once every layer is fitted). A rule with a shared codebook fits every expert at once (H_all: the
        Hessians stacked, as the caller holds them, else Hs concatenated)."""
        cands = rule.candidate_rules() or {"": rule}
        tensors, entry = {}, {}
        if rule.allocate is not None:  # tr(W H Wᵀ) per expert (the same in the rotated basis: R is orthogonal)
            energy = [float(x) for W, H in zip(Ws, Hs, strict=True)
                      for x in torch.einsum("...oi,...ij,...oj->...", W, H, W).reshape(-1)]
        for key, r in cands.items():
            if r.shared_codebook and len(Ws) > 1:  # one codebook: the experts in one fit
                fits = [self._fit(name, torch.cat(Ws), torch.cat(Hs) if H_all is None else H_all, r)]
            else:
                fits = [self._fit(name, W, H, r) for W, H in zip(Ws, Hs, strict=True)]
            pre = "fit" if rule.allocate is None else f"cand.{key}.fit"
            # the rotation's signs are the layer's, not per expert: kept once
            # attention (one 2-D matrix): its parts as they are; experts: concatenated along E
            tensors.update({f"{pre}.{name}.{part}": fits[0][0][part] if part == ROTATION_PART or Ws[0].dim() == 2
                            else torch.cat([f[part] for f, _ in fits]) for part in fits[0][0]})
            e = {**fits[0][1], "rel_output_error": [x for _, r_ in fits for x in r_["rel_output_error"]]}
            if rule.allocate is None:
                entry = e
                continue
            entry.setdefault("candidates", {})[key] = {
                "rel_output_error": e["rel_output_error"], "output_energy": energy,
                "output_error": [x * y for x, y in zip(e["rel_output_error"], energy, strict=True)]}
            entry.update({k: v for k, v in e.items() if k not in ("codec", "bits", "group_size", "rel_output_error")})
        return tensors, entry

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
            # parallel ranks rely on it too), so the stored parts are the same as from one batched call;
            # a shared codebook is the exception: one fit of every expert (run.calibrate refuses it sharded).
            # Fits run where the statistics are (cpu or cuda).
            Ws = [sd[name][e : e + 1].to(H.device, torch.float32) for e in experts]
            fitted, entry[p] = self._fit_widths(name, Ws, [H[j : j + 1] for j in range(len(experts))], rule, H_all=H)
            del Ws
            if rule.allocate is not None:
                entry[p]["shape"] = list(sd[name].shape)  # all experts' (a rank fits its share)
            tensors.update(fitted)
            del fitted
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
        for key, tag in (("Hqkv", "qkv"), ("Ho", "o"), ("Hqb", "q_b"), ("Hkvb", "kv_b")):
            if key not in stats:  # Hqb / Hkvb: MLA only
                continue
            Hs[key], note = regularize(stats[key])
            entry[f"status_{tag}"] = note["status"]  # non-finite / zero / singular: identity (least squares)
            entry[f"damp_{tag}"] = note["damp"]
        for p, key in _ATTN_INPUT.items():
            name = f"layers.{layer}.attn.{p}.weight"
            rule = self.targets.get(name)
            if rule is None:
                continue
            H = Hs[key]
            fitted, entry[p] = self._fit_widths(name, [sd[name].to(H.device, torch.float32)], [H], rule)
            if rule.allocate is not None:
                entry[p]["shape"] = list(sd[name].shape)
            self.tensors.update(fitted)
        self.report.setdefault(layer, {})["attention"] = entry
        self.seconds += time.time() - t0

    def on_shared_layer(self, layer: int, stats: dict) -> None:
        """The `on_layer` callback of SharedHessians: Hx (router, shared w1/w3; every token) and Hs (shared
        w2) damped, the layer's targeted router and shared-expert matrices fitted with them (E = 1,
        stored [O, ...] like attention projections)."""
        t0 = time.time()
        sd = self.layer_state(layer)
        entry: dict = {"tokens": stats["count"]}
        Hs = {}
        for key, tag in (("Hx", "x"), ("Hs", "shared_w2")):
            if key in stats:
                Hs[key], note = regularize(stats[key])
                entry[f"status_{tag}"], entry[f"damp_{tag}"] = note["status"], note["damp"]
        for p, key in (("router", "Hx"), ("shared.w1", "Hx"), ("shared.w3", "Hx"), ("shared.w2", "Hs")):
            name = f"layers.{layer}.moe.{p}.weight"
            rule = self.targets.get(name)
            if rule is None:
                continue
            H = Hs[key]
            parts, entry[p] = self._fit(name, sd[name].to(H.device, torch.float32), H, rule)
            self.tensors.update({f"fit.{name}.{part}": t for part, t in parts.items()})
        self.report.setdefault(layer, {})["shared"] = entry
        self.seconds += time.time() - t0

    def fit_head(self, W: torch.Tensor, H: torch.Tensor, tokens: int) -> None:
        """The LM head W [V, D] (the embedding table on a tied model) with H = Σ hhᵀ over the final norm's
        outputs (run.py, at the end of the layer loop)."""
        t0 = time.time()
        Hd, note = regularize(H)
        parts, entry = self._fit(HEAD, W.to(Hd.device, torch.float32), Hd, self.targets[HEAD])
        self.tensors.update({f"fit.{HEAD}.{part}": t for part, t in parts.items()})
        self.head_report = {"tokens": tokens, "status": note["status"], "damp": note["damp"], **entry}
        self.seconds += time.time() - t0

    def state_dict(self) -> dict:
        """Fitted tensors and report entries so far, for a resumable calibration (resume.py)."""
        return {**{f"tensors.{k}": t for k, t in self.tensors.items()}, "seconds": self.seconds,
                "report": {str(i): e for i, e in self.report.items()}, "tune_report": self.tune_report,
                "allocation": self.allocation,
                "head_report": self.head_report}

    def load_state_dict(self, sd: dict) -> None:
        self.tensors = {k.removeprefix("tensors."): t for k, t in sd.items() if k.startswith("tensors.")}
        self.report = {int(i): e for i, e in sd["report"].items()}
        self.seconds, self.tune_report = sd["seconds"], sd["tune_report"]
        self.allocation = sd.get("allocation")
        self.head_report = sd.get("head_report")  # None: a checkpoint of an older moec

    def _entry(self, name: str) -> dict:
        """The report entry of matrix `name` (expert/MLP: the layer's, attention: under "attention")."""
        layer = self.report[int(name.split(".")[1])]
        m = ATTN_PARAM.search(name)
        return layer["attention"][m.group(2)] if m else layer[name.rsplit(".", 1)[-1]]

    def rule_of(self, name: str) -> WeightRule:
        """The rule matrix `name` is stored under: its rule, or the candidate allocate_bits chose for it."""
        return self.targets[name].chosen(name, self.allocation or [])

    def allocate_bits(self) -> None:
        """Once every layer is fitted: per rule with `allocate`, one width per unit at the rule's budget
        (allocate.py); the chosen candidate's tensors become the matrix's `fit.*` tensors (the others are
        dropped unless keep_candidates), and the report says what each matrix got. Idempotent (resume)."""
        if self.allocation is not None:
            return
        t0 = time.time()
        self.allocation = []
        rules = list({id(r): r for r in self.targets.values() if r.allocate is not None}.values())
        for rule in rules:
            params = [n for n, r in self.targets.items() if r is rule]
            cands = {}
            for n in params:
                entry = self._entry(n)
                numel = 1
                for d in entry["shape"]:
                    numel *= d
                cands[n] = {key: {"nbytes": sum(t.numel() * t.element_size() for k, t in self.tensors.items()
                                                if k.startswith(f"cand.{key}.fit.{n}.")),
                                  "numel": numel, "output_error": sum(c["output_error"]),
                                  "output_energy": sum(c["output_energy"])}
                            for key, c in entry["candidates"].items()}
            a = rule.allocate
            crules = rule.candidate_rules()
            res = allocate.allocate(cands, a.budget, a.unit, a.sensitivity,
                                    codec_of={k: r.codec for k, r in crules.items()})
            res["bits"] = {n: crules[k].bits for n, k in res["choice"].items()}
            for n in params:
                key = res["choice"][n]
                for k in [k for k in self.tensors if k.startswith(f"cand.{key}.fit.{n}.")]:
                    t = self.tensors[k].clone() if a.keep_candidates else self.tensors.pop(k)
                    self.tensors[k.removeprefix(f"cand.{key}.")] = t
                if not a.keep_candidates:
                    for k in [k for k in self.tensors if k.startswith("cand.") and f".fit.{n}." in k]:
                        del self.tensors[k]
                entry = self._entry(n)
                r = crules[key]
                entry.update(codec=r.codec, bits=r.bits, group_size=r.group_size,
                             rel_output_error=entry["candidates"][key]["rel_output_error"])
            mixed = sorted({int(n.split(".")[1]) for n in params if EXPERT_PARAM.search(n) and n.endswith(".w1")
                            and res["bits"].get(n[:-1] + "3", res["bits"][n]) != res["bits"][n]})
            if mixed:
                log.info("allocate: layers %s hold w1 and w3 of different widths; a routed-expert (MoE) layer "
                         "then runs the unfused path on CUDA (unit: gate_up keeps them together)", mixed)
            self.allocation.append({
                "targets": rule.targets, "codec": rule.codec, "budget": a.budget, "candidates": a.bits,
                "sensitivity": a.sensitivity, "unit": a.unit, "q_bits": round(res["q_bits"], 6),
                "error": res["error"], "bits": res["bits"], "choice": res["choice"],
                "q_bits_per_matrix": {n: round(8.0 * c[res["choice"][n]]["nbytes"] / c[res["choice"][n]]["numel"], 6)
                                      for n, c in cands.items()},
                "histogram": {k: sum(1 for n in params if res["choice"][n] == k) for k in crules}})
        self.seconds += time.time() - t0

    def tune(self, args: ModelArgs, state: dict[str, torch.Tensor], tokens: torch.Tensor, cal, seed: int,
             device: str = "cpu") -> None:
        """End-to-end tuning of the fitted hls codebooks and fp3 scales (tune.py) under the recipe's
        calibration config `cal`; other codecs are left as fitted."""
        from .tune import tune_codebooks

        tuned = {n: self.rule_of(n) for n in self.targets}
        tuned = {n: r for n, r in tuned.items() if weight_codec(r.codec).tunable}
        if not tuned:
            tunable = ", ".join(n for n, s in weight_codecs().items() if s.tunable)
            raise UserError(f"calibration.tune_steps tunes codebooks end to end, and no weights rule of this recipe "
                            f"uses a codec that has them ({tunable})")
        t0 = time.time()
        codecs = {n: (r.codec, r.bits) for n, r in tuned.items()}  # allocate's choice where made
        self.tune_report = tune_codebooks(args, state, self.tensors, codecs, tokens, cal.tune_steps, cal.tune_lr,
                                          cal.tune_batch, seed, device, holdout=cal.tune_holdout,
                                          eval_every=cal.tune_eval_every, patience=cal.tune_patience,
                                          lr_drops=cal.tune_lr_drops, norms=cal.tune_norms)
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
            if "candidates" in entries[0][p]:  # allocate: each width's per-expert lists
                entry[p]["candidates"] = {b: {k: interleave([en[p]["candidates"][b][k] if p in en else None
                                                             for en in entries]) for k in c}
                                          for b, c in entries[0][p]["candidates"].items()}
    return tensors, entry
