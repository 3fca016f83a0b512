"""Bit allocation chosen again from a finished calibration, without refitting.

A weights rule with `allocate: {keep_candidates: true}` leaves every candidate width's fit in
calib.safetensors (`cand.<bits>.fit.<name>.*`) and each width's errors in report.json. `reallocate` runs the
same choice calibration ran (fit_experts.ExpertFitter.allocate_bits, the knapsack of allocate.py) on those
stored candidates at another budget or sensitivity and writes a calibration directory that `moec pack`
takes as it is: the chosen fits only, the candidates dropped, the rule's budget and sensitivity updated in
its recipe.yaml. benchmarks/bench_alloc.py scores several budgets of one calibration this way.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..runtime.hf_layout import HFCheckpoint
from .fit_experts import ExpertFitter, plan
from .recipe import load_recipe


def reallocate(model_dir: Path, calib: Path, out: Path, budget: float, sensitivity: str) -> tuple[dict, float]:
    """A calibration directory `out` like `calib` with the widths of its allocate rules that kept their
    candidates chosen again at `budget` / `sensitivity` (the candidates dropped; other rules as calibrated);
    returns (its report, seconds the choice took). `out` must not exist."""
    recipe = load_recipe(calib / "recipe.yaml")
    report = json.loads((calib / "report.json").read_text())
    kept = [r for r in recipe.weights if r.allocate is not None and r.allocate.keep_candidates]
    for rule in kept:
        rule.allocate = dataclasses.replace(rule.allocate, budget=budget, sensitivity=sensitivity,
                                            keep_candidates=False)
    args = HFCheckpoint(model_dir).args
    targets = {n: r for n, r in plan(args, recipe).items() if any(r is k for k in kept)}
    fitter = ExpertFitter(targets, lambda i: {}, recipe.calibration.expert_policy,
                          recipe.calibration.min_expert_tokens)
    fitter.tensors = load_file(str(calib / "calib.safetensors"))
    fitter.report = {x["layer"]: copy.deepcopy(x["weights"]) for x in report["layers"] if "weights" in x}
    t0 = time.time()
    fitter.allocate_bits()
    seconds = time.time() - t0
    for x in report["layers"]:
        if "weights" in x:
            x["weights"] = fitter.report[x["layer"]]
    report["allocation"] = fitter.allocation + [a for a in report["allocation"]
                                                if not any(n in targets for n in a["bits"])]
    out.mkdir(parents=True)
    save_file(fitter.tensors, str(out / "calib.safetensors"), metadata={"format": "moec-calib"})
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "recipe.yaml").write_text(recipe.to_yaml())
    return report, seconds
