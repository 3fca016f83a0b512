"""Turn the fp4 experts' fp16x2 GEMV and the router's dense route on by default when gpu_fp4h.sh's records say so.

    python3 -m benchmarks.studies.fp4h_flip --decide OUT      (on the GPU machine, before the smoke)
    python3 -m benchmarks.studies.fp4h_flip --apply fp4h [router] [mla_uv]   (here: the same edits)

--decide reads OUT's records and flips each switch whose evidence holds:
- fp4h (`moec/kernels/fp4_h2.py` ON_BY_DEFAULT): every check of fp4h_check.json ok, and latency_fp4h1.json against
  latency_fp4h0.json (MOEC_FP4H=1 / 0, rows matched by compare_latency.rows) no row slower than x1.01, one x0.97 or
  faster;
- router (launch config `qlinear.dense_gemv.router`): latency_fp4h1_router.json (MOEC_DENSE_GEMV_ROUTER=1) against
  latency_fp4h1.json no row slower than x1.01, one x0.99 or faster (the router is a small share of the step), and in
  dense_gemv_routers.json the tl GEMV at the config's tiles no slower than cuBLAS on every router shape (the flag
  moves every family's router, the A/B times gpt-oss's).
- mla_uv (`moec/runtime/model.py` MLA_UV_DEFAULT): latency_v2lite_uv1.json (MOEC_MLA_UV=1) against
  latency_v2lite_uv0.json (cuBLAS's bmm) no row slower than x1.01, one x0.99 or faster.
It prints each ratio and writes OUT/flip.json (what was flipped and why). --apply makes the named edits
unconditionally: the GPU machine flips its copy before the smoke, this checkout makes the same edits.

    python3 -m benchmarks.studies.fp4h_flip --decide-switches OUT    (gpu_final_1207.sh, gpu_launches_1207.sh)

Each switch of SWITCHES against the shipped tree: every OUT/latency_<shape>_<switch>.json (the step with the switch's
environment variable on) against OUT/latency_<shape>_base.json (the bf16 peer's rows are records too), no row
slower than x1.01 and one x0.995 or faster: early (`moec/kernels/qlinear.py` EARLY_DEFAULT, MOEC_GEMV_EARLY=1: the
dense GEMV's weights loaded ahead of the PDL wait), route_in_gemv (`moec/runtime/decode.py` ROUTE_IN_GEMV_DEFAULT,
MOEC_ROUTE_IN_GEMV=1: the router's GEMV routes in its epilogue), router_in_shared (decode.py
ROUTER_IN_SHARED_DEFAULT, MOEC_ROUTER_IN_SHARED=1: the router's rows in the shared expert's gate/up GEMV). Writes
OUT/flip_switches.json. (router_rows and dense_pad were decided this way on 2026-12-07 and are on; the norm's prmt
pairs, off then, were removed, as were the twelfth session's L2 prefetch and W_UV-in-combine, both slower.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.compare_latency import rows

ROOT = Path(__file__).resolve().parents[2]
EDITS = {  # switch: (file, text off, text on), each text once in its file
    "fp4h": (ROOT / "moec" / "kernels" / "fp4_h2.py", "ON_BY_DEFAULT = False", "ON_BY_DEFAULT = True"),
    "router": (ROOT / "moec" / "kernels" / "configs" / "nvidia_h200.json", '"on": true, "router": false',
               '"on": true, "router": true'),
    "mla_uv": (ROOT / "moec" / "runtime" / "model.py", "MLA_UV_DEFAULT = False", "MLA_UV_DEFAULT = True"),
    "router_rows": (ROOT / "moec" / "kernels" / "configs" / "nvidia_h200.json", '"router_block_o": null',
                    '"router_block_o": 1'),
    "dense_pad": (ROOT / "moec" / "kernels" / "configs" / "nvidia_h200.json", '"least_padding": false',
                  '"least_padding": true'),
    "early": (ROOT / "moec" / "kernels" / "qlinear.py", "EARLY_DEFAULT = False", "EARLY_DEFAULT = True"),
    "route_in_gemv": (ROOT / "moec" / "runtime" / "decode.py", "ROUTE_IN_GEMV_DEFAULT = False",
                      "ROUTE_IN_GEMV_DEFAULT = True"),
    "router_in_shared": (ROOT / "moec" / "runtime" / "decode.py", "ROUTER_IN_SHARED_DEFAULT = False",
                         "ROUTER_IN_SHARED_DEFAULT = True")}
SWITCHES = ("early", "route_in_gemv", "router_in_shared")


def flip(switch: str) -> None:
    path, off, on = EDITS[switch]
    text = path.read_text()
    if on in text:
        return
    if text.count(off) != 1:
        sys.exit(f"{path}: expected one '{off}'")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text.replace(off, on))
    tmp.replace(path)


def ratios(old_path: Path, new_path: Path) -> list[float]:
    if not (old_path.exists() and new_path.exists()):
        return []
    old, new = rows(str(old_path)), rows(str(new_path))
    out = []
    for key in sorted(old.keys() & new.keys()):
        out.append(new[key] / old[key])
        print(f"{new_path.name}: {key}  {old[key]:.3f} -> {new[key]:.3f} ms  x{out[-1]:.3f}")
    return out


def routers_win(path: Path) -> tuple[bool, list[str]]:
    """Whether the tl GEMV at the config's dense_gemv tiles is no slower than cuBLAS on every router shape."""
    if not path.exists():
        return False, ["no dense_gemv_routers.json"]
    cfg = json.loads(EDITS["router"][0].read_text())["qlinear"]["dense_gemv"]
    tiles = {k: cfg[k] for k in ("block_o", "block_k", "num_warps")}
    recs = [r for r in json.loads(path.read_text())["records"] if r.get("ms") is not None]
    notes, ok = [], True
    for shape in sorted({r["shape"] for r in recs}):
        cub = [r["ms"] for r in recs if r["shape"] == shape and r["path"] == "cublas"]
        tl = [r["ms"] for r in recs if r["shape"] == shape and r["path"] == "tl-dense"
              and all(r.get(k) == v for k, v in tiles.items())]
        if not (cub and tl):
            return False, notes + [f"{shape}: a path missing"]
        notes.append(f"{shape}: cuBLAS {cub[0] * 1e3:.2f} us, tl {tl[0] * 1e3:.2f} us")
        ok &= tl[0] <= cub[0]
    return ok and bool(notes), notes


def decide(out: Path) -> dict:
    res = {}
    checks = json.loads((out / "fp4h_check.json").read_text()) if (out / "fp4h_check.json").exists() else []
    r = ratios(out / "latency_fp4h0.json", out / "latency_fp4h1.json")
    ok = bool(checks) and all(c["ok"] for c in checks) and bool(r) and max(r) <= 1.01 and min(r) <= 0.97
    res["fp4h"] = {"on": ok, "checks_ok": sum(c["ok"] for c in checks), "checks": len(checks), "ratios": r}
    r = ratios(out / "latency_fp4h1.json", out / "latency_fp4h1_router.json")
    bench_ok, notes = routers_win(out / "dense_gemv_routers.json")
    ok = bool(r) and max(r) <= 1.01 and min(r) <= 0.99 and bench_ok
    res["router"] = {"on": ok, "ratios": r, "bench": notes}
    r = ratios(out / "latency_v2lite_uv0.json", out / "latency_v2lite_uv1.json")
    res["mla_uv"] = {"on": bool(r) and max(r) <= 1.01 and min(r) <= 0.99, "ratios": r}
    for switch, v in res.items():
        if v["on"]:
            flip(switch)
        print(f"{switch}: {'on' if v['on'] else 'stays off'}", *v.get("bench", []), sep="\n  ")
    (out / "flip.json").write_text(json.dumps(res, indent=1))
    return res


def decide_switches(out: Path) -> dict:
    res = {}
    for switch in SWITCHES:
        r = [x for base in sorted(out.glob("latency_*_base.json"))
             for x in ratios(base, base.with_name(base.name.replace("_base.json", f"_{switch}.json")))]
        res[switch] = {"on": bool(r) and max(r) <= 1.01 and min(r) <= 0.995, "ratios": r}
        if res[switch]["on"]:
            flip(switch)
        print(f"{switch}: {'on' if res[switch]['on'] else 'stays off'}")
    (out / "flip_switches.json").write_text(json.dumps(res, indent=1))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decide", type=Path, metavar="OUT")
    ap.add_argument("--decide-switches", type=Path, metavar="OUT")
    ap.add_argument("--apply", nargs="*", choices=sorted(EDITS), default=[])
    a = ap.parse_args()
    for switch in a.apply:
        flip(switch)
    if a.decide is not None:
        decide(a.decide)
    if a.decide_switches is not None:
        decide_switches(a.decide_switches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
