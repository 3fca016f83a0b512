"""`moec eval --latency` on models moec's engine does not run (issue 33, item 3), on the GPU.

    python3 -m benchmarks.bench_hf_latency [--types deepseek_v3 gpt_oss ...]
        [--out benchmarks/results/hf_latency_h200.json]

Per model type: a tiny random model (moec/hf/tiny.py, the coverage tests' configs) is saved, calibrated with
`experts-hls2` on the transformers path and packed; then `moec eval --latency` runs, as a user would (a
separate process), on the source and on the pack. For an engine type (qwen3_moe) the source is also calibrated
and packed on the engine path and timed on moec's engine, so the record shows both paths on one model. The CLI's
notice (that the transformers path is timed, not moec's engine) is kept in the record (`notice`; the
2026-12-05 record has the first stdout line instead, `stdout_first_line`).

Tiny models time launch overhead, not bandwidth: these rows show that the path runs and what it costs per step
against the engine, not a % of floor. Writes one JSON list (docs/metrics.md's moec-latency records plus
`type`, `model`: source|packed, `notice`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.benchutil import ROOT, cli

TYPES = ["deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_next", "qwen3_moe"]
ENGINE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
OUT = ROOT / "benchmarks" / "results" / "hf_latency_h200.json"


def eval_latency(model: Path, out: Path, path: str, batches: str, contexts: str) -> tuple[list[dict], str]:
    env = dict(os.environ, MOEC_PROGRESS="0", COLUMNS="200")
    r = subprocess.run([sys.executable, "-m", "moec.cli.app", "eval", str(model), "--latency", "--batches", batches,
                        "--contexts", contexts, "--steps", "20", "--path", path, "--no-bf16-peer", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"eval --latency {model} failed: {r.stderr.strip().splitlines()[-1:]}")
    # the notice that the transformers path is timed, not moec's engine: the CLI's message stream (stderr)
    notice = next((ln for ln in r.stderr.splitlines() if "timing the transformers path" in ln), None)
    return json.loads(out.read_text()), notice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="128,384")  # the tiny configs hold 512 positions
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--work", type=Path, help="build the models and packs here, or reuse them from here (the GPU "
                    "image has no `datasets` for calibration text: build on the CPU with --build-only, then carry)")
    ap.add_argument("--build-only", action="store_true", help="build under --work and stop (no GPU needed)")
    a = ap.parse_args()
    records = []
    text = Path(tempfile.mkdtemp(prefix="hf-latency-data-")) / "text.txt"  # calibration text: any will do
    text.write_text((ROOT / "README.md").read_text() * 4)
    for t in a.types:
        tmp = a.work / t if a.work else Path(tempfile.mkdtemp(prefix=f"hf-latency-{t}-"))
        t0 = time.time()
        try:
            if not (tmp / "packed" / "moec.json").is_file():  # else built before (--build-only)
                _build(t, tmp, text)
            if a.build_only:
                continue
            runs = [("source", tmp / "src", "transformers"), ("packed", tmp / "packed", "transformers")]
            if t in ENGINE_TYPES:
                runs += [("packed", tmp / "packed-engine", "engine")]
            for which, model, path in runs:
                try:
                    recs, notice = eval_latency(model, tmp / f"{which}-{path}.json", path, a.batches, a.contexts)
                    for r in recs:
                        records.append(r | {"type": t, "model": which, "path": path, "notice": notice})
                except Exception as e:  # recorded; the next model still runs
                    records.append({"type": t, "model": which, "path": path, "error": str(e)[:400]})
        except Exception as e:
            records.append({"type": t, "error": f"{type(e).__name__}: {str(e)[-400:]}"})
        print(f"{t}: {time.time() - t0:.0f} s", flush=True)
    if a.build_only:
        return
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(records, indent=1))
    for r in records:
        print(r.get("type"), r.get("model"), r.get("path"), r.get("batch"), r.get("context"),
              r.get("ms_median", r.get("error")))


def _build(t: str, tmp: Path, text: Path) -> None:
    """The tiny source of type t, its experts-hls2 pack on the transformers path and, for an engine type, on the
    engine path (calibrated and packed on its own path)."""
    from moec.hf.tiny import save_tiny

    save_tiny(t, tmp / "src")
    for path, suffix in (("transformers", ""), *((("engine", "-engine"),) if t in ENGINE_TYPES else ())):
        cli("calibrate", tmp / "src", "--recipe", "experts-hls2", "--samples", "4", "--seq-len", "64",
            "--data", text, "-o", tmp / f"calib{suffix}", "--path", path)
        cli("pack", tmp / "src", tmp / f"calib{suffix}", "-o", tmp / f"packed{suffix}")


if __name__ == "__main__":
    main()
