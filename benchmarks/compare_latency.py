"""Per-row ratio of two latency_h200.json files (bench_latency.py output): the check that a rerun agrees.

    python3 -m benchmarks.compare_latency OLD.json NEW.json [--tol 0.05]

Rows are matched by (shape, recipe, batch, context) among decode records with an ms_median; prints each
ratio new/old and the rows outside 1 ± tol; exit status 1 if any.
"""

from __future__ import annotations

import argparse
import json
import sys


def rows(path: str) -> dict[tuple, float]:
    return {(r["shape"], r["recipe"], r["batch"], r["context"]): r["ms_median"] for r in json.load(open(path))
            if r.get("bench") == "moec-latency" and r.get("ms_median") is not None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--tol", type=float, default=0.05)
    a = ap.parse_args()
    old, new = rows(a.old), rows(a.new)
    out = []
    for key in sorted(old.keys() & new.keys()):
        ratio = new[key] / old[key]
        flag = "" if abs(ratio - 1) <= a.tol else "  <-- outside"
        print(f"{key[0]:14s} {key[1]:24s} b{key[2]:<3d} ctx {key[3]:6d}  {old[key]:8.2f} -> {new[key]:8.2f} ms"
              f"  x{ratio:.3f}{flag}")
        out.append(flag != "")
    only = sorted(old.keys() ^ new.keys())
    if only:
        print("rows in one file only:", only)
    print(f"{len(out)} rows, {sum(out)} outside ±{a.tol:.0%}")
    return 1 if any(out) else 0


if __name__ == "__main__":
    sys.exit(main())
