"""Bit allocation at a fixed budget (recipe `allocate:`, calibrate/recipe.Allocate): every targeted matrix
is fitted under each candidate during the layer loop (fit_experts.ExpertFitter): each bit width of the rule's
codec, or each codec-width-settings entry of `allocate.candidates` (recipe.WeightRule.candidate_rules), and
once every layer is fitted one candidate per allocation unit is chosen so that the average q_bits over the rule's
matrices (stored bytes: codes, codebooks, scales, signs) stays within the budget while the summed
sensitivity is smallest (HAWQ-V2, Dong et al. 2020; the error-vs-bytes knapsack of mixed-precision
quantizers such as SqueezeLLM's and Slim-LLM's allocation).

Sensitivity of a matrix at a width (what `sensitivity` picks):
    output    Σ_e tr(ΔW_e H_e ΔW_eᵀ): the Hessian-weighted output error of the fit (the layer-wise
              objective the fit minimizes), summed over experts;
    relative  the same divided by the matrix's output energy Σ_e tr(W_e H_e W_eᵀ): the scale of
              activations grows with depth and differs between gate/up and down, so absolute output
              errors of different matrices are in different units.
A unit is one stored matrix (`unit: matrix`: one [E, O, I] projection tensor, w1, w2 or w3 of a layer, or
one attention projection; the stored format holds one bits value per such tensor, so experts of one
projection share it), a layer's w1 and w3 together with w2 alone (`unit: gate_up`: the fused MoE kernels
take one bits value for the gate/up launch and one for the down launch, so a MoE layer whose w1 and w3
differ runs the unfused path on CUDA) or the rule's matrices of one layer together (`unit: layer`). With
candidates of several codecs, `unit: gate_up` also keeps a layer's w2 in its w1's codec (the fused kernels
read one codec per layer, widths may differ): the layer's two units become one whose options are the pairs
of same-codec candidates.

The choice is an exact dynamic program over the Pareto frontier of (bytes, error) of the units taken so
far (bytes rounded up to `resolution`, so the budget is always met; exact when the resolution is 1).
Pure functions: no file, model or Hessian is read here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..formats.bitpack import bitstream_width
from ..registry import weight_codec

_LAYER = re.compile(r"layers\.(\d+)\.")
MAX_FRONTIER = 200_000  # partial solutions kept per step at most (the resolution grows past it)


@dataclass(frozen=True)
class Option:
    """One choice for a unit: what it picks (a candidate key, or a tuple of them for a unit of several parts),
    its stored bytes and sensitivity (summed over the unit's matrices)."""

    key: object
    nbytes: int
    error: float


def choose(units: Sequence[Sequence[Option]], budget_bytes: int, resolution: int = 1) -> list[int]:
    """Index of the chosen option per unit, minimizing Σ error subject to Σ nbytes ≤ budget_bytes.

    units[u]: the options of unit u (any order). Exact over bytes rounded up to multiples of `resolution`
    (the rounded sum bounds the true one, so the budget holds); AssertionError when even the smallest
    options exceed the budget (check_budget refuses such a recipe before fitting)."""
    assert units and all(units), "every unit needs at least one option"
    res = max(1, int(resolution))
    cost = [[-(-o.nbytes // res) for o in opts] for opts in units]
    cap = budget_bytes // res
    assert sum(min(c) for c in cost) <= cap, (sum(min(c) for c in cost) * res, budget_bytes)
    # frontier: bytes -> (error, back-pointer chain of choices); only non-dominated entries survive
    front: dict[int, tuple[float, tuple | None]] = {0: (0.0, None)}
    for u, opts in enumerate(units):
        nxt: dict[int, tuple[float, tuple | None]] = {}
        for b, (e, chain) in front.items():
            for k, o in enumerate(opts):
                nb = b + cost[u][k]
                if nb > cap:
                    continue
                ne = e + o.error
                if nb not in nxt or ne < nxt[nb][0]:
                    nxt[nb] = (ne, (k, chain))
        front, best = {}, float("inf")
        for b in sorted(nxt):  # keep an entry only if it has less error than every cheaper one
            if nxt[b][0] < best:
                best = nxt[b][0]
                front[b] = nxt[b]
        if len(front) > MAX_FRONTIER:  # coarser bytes for the rest; still within the budget (rounded up)
            return choose(units, budget_bytes, res * 4)
    _, (_, chain) = min(front.items(), key=lambda kv: (kv[1][0], kv[0]))
    picks = []
    while chain is not None:
        picks.append(chain[0])
        chain = chain[1]
    return picks[::-1]


def unit_key(param: str, unit: str) -> str:
    """The allocation unit of a matrix: itself, its layer's w1 and w3 together, or its layer's matrices together."""
    if unit == "matrix":
        return param
    if unit == "gate_up":
        return re.sub(r"\.w3$", ".w1", param)  # w1 and w3 of a layer (experts or dense MLP) share a key
    return f"layers.{_LAYER.search(param).group(1)}"


def candidate_bytes(codec: str, bits: int, shape: tuple[int, ...], group_size: int, signs_block: int,
                    shared: bool = False) -> int:
    """Bytes a matrix of `shape` ([E, O, I], or [O, I] for attention) stores under `codec` at `bits`,
    from the codec's own stand-in on the meta device (the shapes and dtypes it stores; `shared`: the codec's
    shared_parts once for all experts), plus the bit-packed rotation signs when signs_block > 0
    (rotation.pack_signs)."""
    stacked = tuple(shape) if len(shape) == 3 else (1, *shape)
    spec = weight_codec(codec)
    parts = spec.hook("random_stored")(bits, stacked, group_size, "meta", None)
    n = sum((t[:1] if shared and k in spec.shared_parts else t).numel() * t.element_size() for k, t in parts.items())
    if signs_block:
        n += shape[-1] // signs_block * bitstream_width([1] * signs_block)
    return n


def check_budget(ri: int, rule, shapes: dict[str, tuple[int, ...]]) -> tuple[float, float]:
    """(min, max) q_bits the rule's candidates can reach over its matrices `shapes` ({param: shape});
    UserError (before any fitting) when the budget is outside that range."""
    a = rule.allocate
    n = sum(torch.Size(s).numel() for s in shapes.values())
    per = {k: sum(candidate_bytes(r.codec, r.bits, s, r.group_size,
                                  r.incoherence.block_for(s[-1]) if r.incoherence else 0, r.shared_codebook)
                  for s in shapes.values()) for k, r in rule.candidate_rules().items()}
    lo, hi = 8.0 * min(per.values()) / n, 8.0 * max(per.values()) / n
    if not lo <= a.budget <= hi:
        what = f"bits {a.bits}" if a.candidates is None else f"candidates {', '.join(per)}"
        least, most = min(per, key=per.get), max(per, key=per.get)
        raise UserError(f"weights rule {ri}: allocate.budget {a.budget} q_bits cannot be met by {what} "
                        f"on its {len(shapes)} matrices: achievable {lo:.4f} (all {least}"
                        f"{'-bit' if a.candidates is None else ''}) to {hi:.4f} "
                        f"(all {most}{'-bit' if a.candidates is None else ''}) q_bits")
    return lo, hi


def check_budgets(recipe, targets: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """check_budget for every rule of `recipe` with `allocate` over the matrices it targets (plan())."""
    for ri, rule in enumerate(recipe.weights):
        if rule.allocate is not None:
            check_budget(ri, rule, {n: shapes[n] for n, r in targets.items() if r is rule})


def _ffn_of(param: str) -> str | None:
    """The MoE block / dense MLP a w1, w2 or w3 belongs to (None: any other matrix)."""
    head, _, tail = param.rpartition(".")
    return head if tail in ("w1", "w2", "w3") else None


def allocate(cands: dict[str, dict], budget: float, unit: str, sensitivity: str,
             codec_of: dict | None = None) -> dict:
    """The chosen candidate per matrix for one rule. cands: {param: {key: {"nbytes", "numel", "output_error",
    "output_energy"}}} (sums over experts; key: a width or a candidate_rules key); codec_of: {key: codec} where
    the keys span several codecs. Returns {"budget", "q_bits" (achieved), "choice": {param: key}, "error": the
    chosen total sensitivity}."""
    groups: dict[str, list[str]] = {}
    for p in cands:
        groups.setdefault(unit_key(p, unit), []).append(p)
    common = set.intersection(*(set(c) for c in cands.values()))
    keys = [k for k in next(iter(cands.values())) if k in common]

    def options(ps: list[str]) -> list[Option]:
        return [Option(k, sum(cands[p][k]["nbytes"] for p in ps),
                       sum(cands[p][k]["output_error"] / (cands[p][k]["output_energy"] if sensitivity == "relative"
                                                         else 1.0) for p in ps)) for k in keys]

    # units: (the params of each part, the options; an option's key holds one candidate key per part)
    units = [([ps], [Option((o.key,), o.nbytes, o.error) for o in options(ps)]) for ps in groups.values()]
    if unit == "gate_up" and codec_of and len({codec_of[k] for k in keys}) > 1:  # one codec per MoE / MLP block
        by_block: dict[str, list] = {}
        for ps, opts in units:
            by_block.setdefault(_ffn_of(ps[0][0]) or ps[0][0], []).append((ps, opts))
        units = []
        for parts in by_block.values():
            if len(parts) == 1:
                units.append(parts[0])
                continue
            (pa, oa), (pb, ob) = parts
            units.append((pa + pb, [Option(x.key + y.key, x.nbytes + y.nbytes, x.error + y.error)
                                    for x in oa for y in ob if codec_of[x.key[0]] == codec_of[y.key[0]]]))
    numel = sum(next(iter(c.values()))["numel"] for c in cands.values())
    budget_bytes = int(budget * numel / 8)
    total_min = sum(min(o.nbytes for o in opts) for _, opts in units)
    picks = choose([opts for _, opts in units], budget_bytes, resolution=max(1, (budget_bytes - total_min) // 20_000))
    choice = {p: key for (parts, opts), k in zip(units, picks, strict=True)
              for ps, key in zip(parts, opts[k].key, strict=True) for p in ps}
    return {"budget": budget, "q_bits": 8.0 * sum(opts[k].nbytes for (_, opts), k in zip(units, picks, strict=True))
            / numel, "choice": choice, "error": sum(opts[k].error for (_, opts), k in zip(units, picks, strict=True))}
