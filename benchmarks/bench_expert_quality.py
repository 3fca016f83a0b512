"""Weight quantization quality (experts / MLPs / attention projections): calibrate → pack → ppl_tf on
PTB test (docs/benchmarks.md).

    python3 -m benchmarks.bench_expert_quality --model demo-moe \
        --recipes moec/recipes/experts-hls2.yaml moec/recipes/ablations/experts-rtn2.yaml ... \
        [--windows 8] [--samples 32]

For each recipe: `moec calibrate` (PTB train) and `moec pack` in-process, then teacher-forced
perplexity of the packed model over the first N windows of 1024 tokens of PTB test (positions
32..1023 scored), fp32 on the CPU, KL(p_base || p_q) and top-1 agreement against the source model
(whose logits are computed once and reused). The same is scored out of domain on the first N windows
of `--ood` (default kjv/test, the New Testament; "" to skip), reported as `ood` beside the PTB
numbers: calibration (and codebook tuning) sees PTB train only, so this shows what a recipe costs on
text it was not fitted to (demo-moe's training text holds the whole KJV: for it the New Testament is out of
the calibration domain, not out of the model's training data). Records are merged into
benchmarks/results/expert_quality_<model>.json (a record with the same model and recipe is
replaced). `w_bits` covers every decoder-layer matrix; `q_bits` only the quantized ones, both from
the bytes stored in the packed checkpoint. `method`, `targets` and `group_size` describe the first
weights rule, `rules` every rule of the recipe. The HQQ peer (`--hqq`) quantizes the expert/MLP
matrices only (benchmarks/studies/bench_hls_study.py --scope all has HQQ on attention too, by fake quant).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from moec.calibrate.data import eval_windows, load_text
from moec.calibrate.pack import pack
from moec.calibrate.recipe import load_recipe
from moec.calibrate.run import calibrate
from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
from moec.cli.common import base_record, write_json_atomic
from moec.runtime.loader import load_model
from moec.runtime.perplexity import CONTEXT, make_windows, reference_logits, score_tf, windows_label

W = W_LEN = 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo-moe")
    ap.add_argument("--recipes", nargs="*", default=[])
    ap.add_argument("--hqq", nargs="*", type=int, default=[], help="peer: HQQ (PyPI hqq) at these bits, same rows")
    ap.add_argument("--hqq-group", type=int, default=0, help="HQQ group size (0: one group per row)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--score-from", type=int, default=CONTEXT,
                    help="first scored position (32 by docs/benchmarks.md; 1 = the llama.cpp peers' protocol)")
    ap.add_argument("--keep", type=Path, default=None, help="keep calib/packed dirs here")
    ap.add_argument("--ood", default="kjv", help="out-of-domain data set scored beside PTB test (its eval split; "
                                                 "'' to skip)")
    a = ap.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    model_dir = resolve_model(a.model)
    tokenizer = load_tokenizer(model_dir)
    windows = make_windows(tokenize(tokenizer, load_text("ptb", "test")), W, a.windows)
    ood = eval_windows(tokenizer, a.ood, a.windows, W) if a.ood else None
    out = a.out or Path(__file__).parent / "results" / f"expert_quality_{a.model}.json"
    base, _ = load_model(model_dir)
    t0 = time.time()
    base_logits = reference_logits(base, windows, a.score_from)
    base_s = time.time() - t0
    ood_base = reference_logits(base, ood[1], a.score_from) if ood else None
    del base
    work = a.keep or Path(tempfile.mkdtemp(prefix="bench-eq-"))
    records = json.loads(out.read_text()) if out.is_file() else []
    for rpath in a.recipes:
        recipe = load_recipe(rpath)
        calib, packed = work / f"calib-{recipe.name}", work / f"packed-{recipe.name}"
        t0 = time.time()
        report = calibrate(model_dir, a.model, recipe, "ptb", "train", a.samples, a.seq_len, recipe.calibration.seed,
                           calib)
        calib_s = time.time() - t0
        manifest = pack(model_dir, a.model, calib, packed)
        model, info = load_model(packed)
        t0 = time.time()
        r = score_tf(model, windows, base_logits, a.score_from)
        eval_s = time.time() - t0
        r_ood = score_tf(model, ood[1], ood_base, a.score_from) if ood else None
        rule = recipe.weights[0] if recipe.weights else None
        bits = manifest["effective_bits"]
        under = sum(len(x.get("experts_under_policy", [])) for x in report["layers"])
        rec = base_record("expert-quality", "cpu") | {
            "model": a.model, "method": f"{rule.codec}{rule.bits}" if rule else "keep", "recipe": recipe.name,
            "targets": rule.targets if rule else [], "group_size": rule.group_size if rule else None,
            "gptq": rule.gptq if rule else None,
            "rules": [{"targets": x.targets, "codec": x.codec, "bits": x.bits, "group_size": x.group_size,
                       "gptq": x.gptq, "incoherence": x.incoherence and dataclasses.asdict(x.incoherence)}
                      for x in recipe.weights],
            "context": W, "batch": 1, "mode": "tf", "dtype": "fp32",
            "data": "ptb/test", "windows": windows_label(windows.shape[0], W, a.score_from),
            "ppl": r["ppl"], "ppl_base": r["ppl_base"], "delta_pct": r["delta_pct"], "kld": r["kld"],
            "top1": r["top1"], "kv_bits": 16.0, "w_bits": bits["w_bits"], "q_bits": bits.get("q_bits"),
            "calibration": {"data": "ptb/train", "samples": a.samples, "seq_len": a.seq_len,
                            "expert_policy": recipe.calibration.expert_policy,
                            "min_expert_tokens": recipe.calibration.min_expert_tokens,
                            "experts_under_policy": under, "seconds": round(calib_s, 1),
                            "fit_seconds": report.get("fit_seconds"), "seed": recipe.calibration.seed,
                            **({"tune": report["tune"]} if "tune" in report else {})},
            "eval_seconds": round(eval_s, 1), "baseline_eval_seconds": round(base_s, 1), "peer": {},
        }
        if report.get("allocation"):  # what each matrix got (allocate rules)
            rec["allocation"] = [{k: x[k] for k in ("budget", "unit", "sensitivity", "q_bits", "bits", "histogram")}
                                 for x in report["allocation"]]
        if r_ood is not None:
            rec["ood"] = ood_record(ood, r_ood, a.score_from)
        print(json.dumps({k: rec[k] for k in ("recipe", "q_bits", "ppl", "ppl_base", "delta_pct", "kld", "top1")}
                         | ({"ood_delta_pct": rec["ood"]["delta_pct"]} if r_ood else {})), flush=True)
        records = [x for x in records if not (x["model"] == a.model and x["recipe"] == recipe.name
                                              and x["windows"] == rec["windows"])] + [rec]
        write_json_atomic(out, records)
        if a.keep is None:
            shutil.rmtree(calib, ignore_errors=True)
            shutil.rmtree(packed, ignore_errors=True)
    for b in a.hqq:
        records = [x for x in records if not (x["model"] == a.model and x["recipe"] == f"hqq{b}-g{a.hqq_group}")]
        records.append(hqq_record(a, model_dir, windows, base_logits, b, base_s))
        write_json_atomic(out, records)
    if a.keep is None:
        shutil.rmtree(work, ignore_errors=True)


def ood_record(ood: tuple, r: dict, score_from: int) -> dict:
    """The out-of-domain numbers of a record: the same metrics on `ood`'s windows."""
    name, windows = ood
    return {"data": name, "windows": windows_label(*windows.shape, score_from),
            **{k: r[k] for k in ("ppl", "ppl_base", "delta_pct", "kld", "top1")}}


def hqq_record(a, model_dir, windows, base_logits, bits: int, base_s: float) -> dict:
    """The HQQ peer (Badri & Shaji 2023, PyPI `hqq`, installed with --no-deps): half-quadratic
    optimized zero-point/scale, uniform levels, on the same expert/MLP matrices, group `--hqq-group`
    along the input dim (0: per row), evaluated with its dequantized weights. Bits: b + 32/g (fp16
    scale and zero per group, as HQQ stores them for fp16 models)."""
    from hqq.core.quantize import Quantizer

    from moec.runtime.hf_layout import HFCheckpoint
    from moec.runtime.model import build_model

    ck = HFCheckpoint(model_dir)
    state = ck.state_dict()
    t0 = time.time()
    n_q = 0
    bits_sum = 0.0
    for name in [n for n in state if n.endswith(("moe.w1", "moe.w2", "moe.w3"))]:
        W = state[name].float()
        E, O, I = W.shape
        g = a.hqq_group or I
        q, meta = Quantizer.quantize(W.reshape(E * O, I), nbits=bits, channel_wise=True, group_size=g, optimize=True,
                                     round_zero=False, axis=1, device="cpu", compute_dtype=torch.float32)
        state[name] = Quantizer.dequantize(q, meta).reshape(E, O, I).float()
        n_q += W.numel()
        bits_sum += W.numel() * (bits + 32 / g)
    fit_s = time.time() - t0
    model = build_model(ck.args, state, dtype=torch.float32)
    r = score_tf(model, windows, base_logits, a.score_from)
    rec = base_record("expert-quality", "cpu") | {
        "model": a.model, "method": f"hqq{bits}", "recipe": f"hqq{bits}-g{a.hqq_group}", "targets": ["experts", "mlp"],
        "group_size": a.hqq_group, "gptq": False, "context": W_LEN, "batch": 1, "mode": "tf", "dtype": "fp32",
        "data": "ptb/test", "windows": windows_label(windows.shape[0], W_LEN, a.score_from),
        "ppl": r["ppl"], "ppl_base": r["ppl_base"], "delta_pct": r["delta_pct"], "kld": r["kld"], "top1": r["top1"],
        "kv_bits": 16.0, "w_bits": None, "q_bits": bits_sum / n_q, "q_bits_note": "b + 32/g (fp16 scale, zero)",
        "calibration": {"data": None, "seconds": round(fit_s, 1)}, "baseline_eval_seconds": round(base_s, 1),
        "peer": {"hqq": {"version": "0.2.8.post1", "optimize": True, "axis": 1}},
    }
    print(json.dumps({k: rec[k] for k in ("recipe", "q_bits", "ppl", "ppl_base", "delta_pct", "kld", "top1")}),
          flush=True)
    return rec


if __name__ == "__main__":
    main()
