"""Turn the fused step's bf16 projections route on (launch config `qlinear.dense_gemv.on`) when its A/B says so.

    python3 -m benchmarks.studies.dense_gemv_flip --decide OUT/latency_*_dense0.json OUT/latency_*_dense1.json
    python3 -m benchmarks.studies.dense_gemv_flip --apply

--decide pairs each `*_dense0.json` (cuBLAS) with its `*_dense1.json` (qlinear's GEMV, MOEC_DENSE_GEMV=1) by row
(benchmarks.compare_latency.rows), prints the ratios, and flips the config only when no row got slower than x1.01
and one got x0.97 or faster (exit 0 when flipped, 1 when not). --apply makes the same one-line edit unconditionally:
the GPU machine flips its copy before the smoke, this checkout makes the same edit so both have one source_tree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.compare_latency import rows

CONFIG = Path(__file__).resolve().parents[2] / "moec" / "kernels" / "configs" / "nvidia_h200.json"
OFF, ON = '"dense_gemv": {"on": false', '"dense_gemv": {"on": true'


def flip() -> None:
    text = CONFIG.read_text()
    if ON in text:
        return
    if text.count(OFF) != 1:
        sys.exit(f"{CONFIG}: expected one '{OFF}'")
    tmp = CONFIG.with_suffix(".tmp")
    tmp.write_text(text.replace(OFF, ON))
    tmp.replace(CONFIG)


def ratios(paths: list[str]) -> list[float]:
    out = []
    for p in paths:
        if not p.endswith("_dense1.json"):
            continue
        base = p.replace("_dense1.json", "_dense0.json")
        if not Path(base).exists():
            continue
        old, new = rows(base), rows(p)
        for key in sorted(old.keys() & new.keys()):
            out.append(new[key] / old[key])
            print(f"{key}  {old[key]:.3f} -> {new[key]:.3f} ms  x{new[key] / old[key]:.3f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decide", nargs="*", metavar="JSON")
    ap.add_argument("--apply", action="store_true")
    a = ap.parse_args()
    if a.apply:
        flip()
        return 0
    r = ratios(a.decide or [])
    if r and max(r) <= 1.01 and min(r) <= 0.97:
        flip()
        print(f"route on: {len(r)} rows, x{min(r):.3f} to x{max(r):.3f}")
        return 0
    print(f"route stays off: {len(r)} rows" + (f", x{min(r):.3f} to x{max(r):.3f}" if r else ""))
    return 1


if __name__ == "__main__":
    sys.exit(main())
