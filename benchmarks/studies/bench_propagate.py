"""Effect of quantized propagation in calibration (issue 20): `moec calibrate --propagate fp` (the default:
every layer's statistics from the unquantized model) against `--propagate quantized` (layer i + 1 fed by
layer i with its fitted weights, llm-compressor's sequential pipeline), same recipe and data, then pack
and ppl_tf on the first 8 windows of PTB test against the source model (kld, top1).

    OMP_NUM_THREADS=1 python3 -m benchmarks.studies.bench_propagate --model demo-moe \\
        --recipe moec/recipes/experts-hls2.yaml --out benchmarks/results/propagate_demo-moe.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.benchutil import ROOT, cli
from moec.cli.common import base_record, write_json_atomic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo-moe")
    ap.add_argument("--recipe", type=Path, default=ROOT / "moec/recipes/experts-hls2.yaml")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    recs = []
    with tempfile.TemporaryDirectory() as tmp:
        for prop in ("fp", "quantized"):
            d = Path(tmp) / prop
            t0 = time.time()
            cli("calibrate", a.model, "--recipe", a.recipe, "--data", "ptb", "--split", "train", "--samples",
                a.samples, "--seq-len", a.seq_len, "--propagate", prop, "-o", d / "calib")
            seconds = time.time() - t0
            cli("pack", a.model, d / "calib", "-o", d / "packed")
            cli("eval", d / "packed", "--baseline", a.model, "--data", "ptb", "--split", "test", "--mode", "tf",
                "--max-windows", a.windows, "--json", d / "eval.json")
            ev = json.loads((d / "eval.json").read_text())[0]
            recs.append(base_record("calibrate-propagate", "cpu") | {
                "model": a.model, "method": f"propagate {prop}", "recipe": a.recipe.stem, "propagate": prop,
                "calib_samples": a.samples, "calib_seq_len": a.seq_len, "calibrate_s": round(seconds, 1),
                "context": ev["context"], "batch": ev["batch"], "mode": "tf", "dtype": ev["dtype"],
                "windows": ev["windows"], **{k: ev[k] for k in ("ppl", "ppl_base", "delta_pct", "kld", "top1",
                                                                 "w_bits", "q_bits")}, "peer": {}})
            print(recs[-1])
    write_json_atomic(a.out, recs)


if __name__ == "__main__":
    main()
