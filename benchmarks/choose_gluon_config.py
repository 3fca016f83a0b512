"""Pick the Gluon KV kernel's launch knobs for the device a bench ran on, from bench_gluon_kv_attention's sweep:
the candidate (4 warps per program; benchmarks/studies/gluon_prefetch2.patch adds two tiles in flight) that is
fastest in geometric mean over the timed (shape, context, batch) cases, adopted only where it is faster by at least
--min-gain there and no case is slower than the shipped default by more than --max-loss; its checks against the
torch reference must all have passed.

    python3 -m benchmarks.choose_gluon_config BENCH.json CONFIG_DIR [--min-gain 0.03] [--max-loss 0.03]

Writes CONFIG_DIR/<device key>.json (launch_config.write_overrides: merged into the file if it exists; for the
H200 that is the defaults file itself), and prints the decision with every case's ratio. Run on the GPU before
the smoke, with CONFIG_DIR = moec/kernels/configs, so the smoke covers the configuration that ships.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from moec.kernels import launch_config

# sweep knobs (bench_gluon_kv_attention.py) -> the config knobs they stand for; n_splits sweeps are not candidates
CANDIDATES = {"warps 4": ({"warps": 4}, {"warps": 4})}


def cases(timings: list[dict]) -> dict[tuple, dict]:
    """(shape, context, batch) -> {"default": ms, candidate name: ms} from the rows with the split combine."""
    out: dict[tuple, dict] = {}
    for r in timings:
        if "ms_median" not in r:
            continue
        key = (r["shape"], r["context"], r["batch"])
        if r["path"] == "gluon":
            out.setdefault(key, {})["default"] = r["ms_median"]
        elif r["path"] == "gluon-sweep":
            knobs = {k: r[k] for k in ("warps", "prefetch", "n_splits", "outc") if k in r}
            for name, (sweep, _) in CANDIDATES.items():
                if knobs == sweep:
                    out.setdefault(key, {})[name] = r["ms_median"]
    return out


def choose(bench: dict, min_gain: float, max_loss: float) -> tuple[str | None, list[str]]:
    lines = []
    if not bench.get("all_checks_ok"):
        return None, ["checks against the torch reference did not all pass: nothing adopted"]
    by_case = cases(bench["timings"])
    best, best_gm = None, 1.0
    for name in CANDIDATES:
        ratios = {k: v[name] / v["default"] for k, v in by_case.items() if name in v and "default" in v}
        if not ratios:
            continue
        gm = math.exp(sum(map(math.log, ratios.values())) / len(ratios))
        worst = max(ratios.values())
        ok = gm <= 1 - min_gain and worst <= 1 + max_loss
        lines.append(f"{name}: geometric mean x{gm:.3f}, worst x{worst:.3f} "
                     f"({', '.join(f'{s} {c} b{b} x{r:.3f}' for (s, c, b), r in sorted(ratios.items()))})"
                     f"{'  -> eligible' if ok else ''}")
        if ok and gm < best_gm:
            best, best_gm = name, gm
    return best, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench")
    ap.add_argument("config_dir")
    ap.add_argument("--min-gain", type=float, default=0.03)
    ap.add_argument("--max-loss", type=float, default=0.03)
    a = ap.parse_args()
    try:
        bench = json.loads(open(a.bench).read())
    except (OSError, json.JSONDecodeError) as e:
        print(f"choose_gluon_config: cannot read {a.bench}: {e}", file=sys.stderr)
        return 2
    best, lines = choose(bench, a.min_gain, a.max_loss)
    print("\n".join(lines))
    if best is None:
        print(f"{bench.get('device')}: shipped configuration kept")
        return 0
    path, _ = launch_config.write_overrides(a.config_dir, bench["device"], "kv_decode_attention", "gluon",
                                            CANDIDATES[best][1])
    print(f"{bench.get('device')}: {best} adopted -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
