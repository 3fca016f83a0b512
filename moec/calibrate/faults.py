"""Numerical faults during `moec calibrate`: what is refused, what is repaired, and the report of both.

Refused (UserError, exit 2), because nothing downstream can be trusted once they happen:
  - non-finite source weights: each layer's tensors (and the embeddings) are checked once, as the
    capture loads them (`checked_layer_state`, `checked_global_state`); the message names the tensor,
    the first bad element and how many there are.
  - non-finite activations: hidden states are carried from layer to layer, so one NaN poisons every
    later layer's statistics, and clamping would fit codebooks to activations the model never
    produces. `FiniteActivations` (the first capture observer) and `check_final_hidden` name the
    layer and the stage (attention, FFN) where the values first stop being finite.
Repaired and reported (the run goes on; `fault_report` lists them under report.json "faults"):
  - a Hessian that is not positive definite (rank-deficient: fewer tokens than dims; negative
    eigenvalues from rounding): damped until Cholesky succeeds (hessian.regularize);
  - an all-zero Hessian (activations all zero, e.g. a text of padding tokens whose embedding is zero)
    or an expert that received no tokens: the identity (the weights alone, plain least squares), or,
    under `expert_policy: all-experts-for-stats`, the statistics of every token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..errors import UserError

log = logging.getLogger(__name__)

# Where an observed activation comes from: the stage to blame when it is the first non-finite one.
_STAGE = {
    "attn_in": "entering layer {i} (the output of {prev})",
    "k_pre": "in layer {i}'s attention (the q/k/v projections)",
    "q": "in layer {i}'s attention (the q/k/v projections)",
    "k": "in layer {i}'s attention (the q/k/v projections)",
    "v": "in layer {i}'s attention (the q/k/v projections)",
    "attn_out": "in layer {i}'s attention (the softmax-weighted values)",
    "ffn_in": "after layer {i}'s attention (its output projection and residual)",
    "router_logits": "in layer {i}'s router",
}


def _first_bad(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    bad = ~torch.isfinite(t)
    first = tuple(int(x) for x in bad.nonzero()[0].tolist())
    return int(bad.sum().item()), first


def _check_tensors(state: dict[str, torch.Tensor], where: str) -> None:
    for name, t in state.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            n, first = _first_bad(t)
            raise UserError(f"{where}: source weight {name} {list(t.shape)} holds {n} non-finite value(s) (NaN/inf), "
                            f"the first at index {first}; the checkpoint is corrupt or was saved from an overflowing "
                            f"dtype")


def checked_layer_state(layer_state: Callable[[int], dict], where: str) -> Callable[[int], dict]:
    """`layer_state` whose tensors are checked to be finite the first time each layer is read."""
    checked: set[int] = set()

    def read(i: int) -> dict:
        state = layer_state(i)
        if i not in checked:
            _check_tensors(state, where)
            checked.add(i)
        return state

    return read


def checked_global_state(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    _check_tensors(state, where)
    return state


class FiniteActivations:
    """Capture observer that refuses the first non-finite activation, naming the layer and stage.

    It must come first in the observer list, so no statistic has taken the bad values in."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        if name not in _STAGE or torch.isfinite(t).all():
            return
        n, _ = _first_bad(t)
        prev = "the embeddings" if layer == 0 else f"layer {layer - 1}'s FFN"
        raise UserError(f"non-finite activations (NaN/inf) {_STAGE[name].format(i=layer, prev=prev)}: {n} of "
                        f"{t.numel()} values of {name!r}; the model overflows {str(self.dtype).removeprefix('torch.')} "
                        f"on this calibration text (look for extreme weights in layer {layer}"
                        f"{'' if layer == 0 or name != 'attn_in' else f' or {layer - 1}'})")


def check_final_hidden(h: torch.Tensor, n_layers: int) -> None:
    """The normed output of the last layer, which no observer sees."""
    if not torch.isfinite(h).all():
        n, _ = _first_bad(h)
        raise UserError(f"non-finite activations (NaN/inf) after layer {n_layers - 1}'s FFN: {n} of {h.numel()} "
                        f"values of the final hidden states; the model overflows on this calibration text "
                        f"(look for extreme weights in layer {n_layers - 1})")


def fault_report(layers: list[dict]) -> list[dict]:
    """The repaired faults recorded in report.json's per-layer entries, one dict each; a warning per kind."""
    faults = []
    for entry in layers:
        i, w = entry["layer"], entry.get("weights", {})
        for e, ex in enumerate(w.get("experts", [])):
            if ex["tokens"] == 0:  # its Hessians are all zero by construction: one entry, not two
                faults.append({"layer": i, "expert": e, "fault": "no tokens",
                               "action": f"fitted with the {ex['hessian_w13']} Hessian"})
                continue
            for tag in ("w13", "w2"):
                if fault := _hessian_fault(ex[f"status_{tag}"], ex.get(f"damp_{tag}")):
                    faults.append({"layer": i, "expert": e, "matrix": tag, **fault})
        att = w.get("attention", {})
        for tag in ("qkv", "o"):
            if att and (fault := _hessian_fault(att[f"status_{tag}"], att.get(f"damp_{tag}"))):
                faults.append({"layer": i, "attention": tag, **fault})
    for kind in sorted({f["fault"] for f in faults}):
        log.warning("calibration: %d fault(s) %r repaired (report.json 'faults')",
                    sum(f["fault"] == kind for f in faults), kind)
    return faults


def _hessian_fault(status: str, damp: float | None) -> dict | None:
    """hessian.regularize's status as a report entry; None when nothing had to be done."""
    if status == "ok":
        return None
    if status == "extra-damped":
        return {"fault": "not positive definite", "action": f"damped with {damp:g}·mean(diag)·I"}
    if status == "zero":
        return {"fault": "all-zero Hessian", "action": "identity Hessian (weights alone)"}
    if status == "singular":
        return {"fault": "not positive definite after damping", "action": "identity Hessian (weights alone)"}
    return {"fault": f"{status} Hessian", "action": "identity Hessian (weights alone)"}
