"""Bit allocation at several budgets from one calibration (recipe `allocate:`, calibrate/allocate.py):
calibrate → (choose again at each budget and sensitivity) → pack → ppl_tf on PTB test (docs/benchmarks.md).

    python3 -m benchmarks.bench_alloc --model smollm2-135m \
        --recipe moec/recipes/ablations/smollm2-mlp-alloc23-had-sweep.yaml --budgets 2.25 2.3 \
        --sensitivities output relative [--windows 8]

The recipe's allocate rule must set `keep_candidates: true`: every candidate fit is then in
calib.safetensors, and each (budget, sensitivity) pair is chosen from it without refitting
(moec.calibrate.reallocate: the same ExpertFitter.allocate_bits that calibration runs, on the stored
candidates and report). One record per pair, merged into benchmarks/results/expert_alloc_<model>.json with
the fields of bench_expert_quality.py plus `allocation` (what each matrix got); `calibration.seconds` is the
one shared calibration (all candidates fitted), `calibration.alloc_seconds` the choice alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

from moec.calibrate.data import load_text
from moec.calibrate.pack import pack
from moec.calibrate.reallocate import reallocate
from moec.calibrate.recipe import load_recipe
from moec.calibrate.run import calibrate
from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
from moec.cli.common import base_record, write_json_atomic
from moec.runtime.loader import load_model
from moec.runtime.perplexity import make_windows, reference_logits, score_tf, windows_label

W = 1024  # window length (docs/benchmarks.md protocol, as bench_expert_quality.py)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", required=True, type=Path)
    ap.add_argument("--budgets", nargs="+", type=float, required=True)
    ap.add_argument("--sensitivities", nargs="+", default=["output"], choices=["output", "relative"])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--calib", type=Path, default=None, help="reuse this calibration (with candidates) instead")
    ap.add_argument("--keep", type=Path, default=None, help="keep calib/packed dirs here")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    model_dir = resolve_model(a.model)
    recipe = load_recipe(a.recipe)
    rules = [r for r in recipe.weights if r.allocate is not None]
    assert rules and all(r.allocate.keep_candidates for r in rules), "the recipe's allocate rule must keep_candidates"
    ids = tokenize(load_tokenizer(model_dir), load_text("ptb", "test"))
    windows = make_windows(ids, W, a.windows)
    out = a.out or Path(__file__).parent / "results" / f"expert_alloc_{a.model}.json"
    base, _ = load_model(model_dir)
    base_logits = reference_logits(base, windows)
    del base
    work = a.keep or Path(tempfile.mkdtemp(prefix="bench-alloc-"))
    calib, calib_s, fit_s = a.calib, None, None
    if calib is None:
        calib = work / f"calib-{recipe.name}"
        t0 = time.time()
        rep = calibrate(model_dir, a.model, recipe, "ptb", "train", a.samples, a.seq_len, recipe.calibration.seed,
                        calib)
        calib_s, fit_s = round(time.time() - t0, 1), rep.get("fit_seconds")
        print(json.dumps({"calibrated": recipe.name, "seconds": calib_s, "fit_seconds": fit_s}), flush=True)
    records = json.loads(out.read_text()) if out.is_file() else []
    for budget in a.budgets:
        for sens in a.sensitivities:
            name = f"{recipe.name}@{budget}-{sens}"
            sub, packed = work / f"calib-{name}", work / f"packed-{name}"
            shutil.rmtree(sub, ignore_errors=True)
            shutil.rmtree(packed, ignore_errors=True)
            report, alloc_s = reallocate(model_dir, calib, sub, budget, sens)
            manifest = pack(model_dir, a.model, sub, packed)
            model, _ = load_model(packed)
            t0 = time.time()
            r = score_tf(model, windows, base_logits)
            eval_s = time.time() - t0
            bits = manifest["effective_bits"]
            rule = rules[0]
            rec = base_record("expert-alloc", "cpu") | {
                "model": a.model, "method": f"{rule.codec}-alloc{rule.allocate.bits}", "recipe": name,
                "recipe_file": str(a.recipe), "targets": rule.targets, "group_size": rule.group_size,
                "gptq": rule.gptq, "incoherence": rule.incoherence and dataclasses.asdict(rule.incoherence),
                "budget": budget, "sensitivity": sens, "unit": rule.allocate.unit,
                "context": W, "batch": 1, "mode": "tf", "dtype": "fp32", "data": "ptb/test",
                "windows": windows_label(windows.shape[0], W),
                "ppl": r["ppl"], "ppl_base": r["ppl_base"], "delta_pct": r["delta_pct"], "kld": r["kld"],
                "top1": r["top1"], "kv_bits": 16.0, "w_bits": bits["w_bits"], "q_bits": bits.get("q_bits"),
                "calibration": {"data": "ptb/train", "samples": a.samples, "seq_len": a.seq_len,
                                "seconds": calib_s, "fit_seconds": fit_s, "alloc_seconds": round(alloc_s, 2),
                                "note": "one calibration (every candidate width fitted) for all budgets"},
                "allocation": report["allocation"], "eval_seconds": round(eval_s, 1), "peer": {},
            }
            print(json.dumps({k: rec[k] for k in ("recipe", "q_bits", "ppl", "delta_pct", "kld", "top1")}
                             | {"histogram": report["allocation"][0]["histogram"]}), flush=True)
            records = [x for x in records if not (x["model"] == a.model and x["recipe"] == name
                                                  and x["windows"] == rec["windows"])] + [rec]
            write_json_atomic(out, records)
            if a.keep is None:
                shutil.rmtree(sub, ignore_errors=True)
                shutil.rmtree(packed, ignore_errors=True)
    if a.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
