"""Attach llama.cpp's decode time to moec's latency records: `peer.llamacpp` and `speedup_vs_llamacpp` on every
batch-1 row at a depth llama-bench timed (4096 and 32768), as docs/benchmarks.md defines them.

    python3 -m benchmarks.peers.speedup_vs_llamacpp LATENCY.json LLAMA_BENCH_DIR OUT.json [--same-device]

LATENCY.json: bench_latency.py's records; LLAMA_BENCH_DIR: llamacpp_peer.sh's llama_bench_<shape>[_<type>][_L<n>].json
(llama-bench's own JSON: `avg_ts` tokens/s over 64 tokens generated after `n_depth`). The llama.cpp time per
token is 1000 / avg_ts. A row is paired only where both ran on the same GPU model (`device` against llama-bench's
`gpu_info`); --same-device makes a mismatch an error instead of a skipped row. Prints one line per pair and
writes the latency records with the peer attached (atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SHAPES = {"mixtral-8x7b": "mixtral", "qwen3-30b-a3b": "qwen3",  # bench_latency shape -> llamacpp_moe.py shape
          "deepseek-v2-lite": "deepseek-v2-lite", "glm-4.5-air": "glm-4.5-air", "gpt-oss-120b": "gpt-oss-120b"}
# the llama.cpp type a recipe is compared with (the matching format); Q2_K for every other (2-bit) recipe
RECIPE_TYPES = {"experts-mxfp4": "MXFP4"}


def parse_name(stem: str) -> tuple[str, str, int | None] | None:
    """llama_bench_SHAPE[_TYPE][_LN] (llamacpp_peer.sh's names) -> (peer shape, type, layers or None)."""
    rest = stem.removeprefix("llama_bench_")
    shape = max((s for s in SHAPES.values() if rest == s or rest.startswith(s + "_")), key=len, default=None)
    if shape is None:
        return None
    qtype, layers = "Q2_K", None
    for tok in filter(None, rest[len(shape):].split("_")):
        if tok[0] == "L" and tok[1:].isdigit():
            layers = int(tok[1:])
        else:
            qtype = tok
    return shape, qtype, layers


def llamacpp_ms(directory: Path) -> dict[tuple[str, str, int | None, int], dict]:
    """(peer shape, type, layers, depth) -> {ms, gpu, test_time, file, n_gen, type}."""
    out = {}
    for path in sorted(directory.glob("llama_bench_*.json")):
        key = parse_name(path.stem)
        if key is None:
            continue
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError as e:  # llama-bench cut mid-write: say which file
            raise SystemExit(f"speedup_vs_llamacpp: {path}: not llama-bench's JSON ({e})") from None
        shape, qtype, _ = key
        what = "experts, attention F16" if shape == "gpt-oss-120b" else "experts and attention"
        for r in rows:
            if r.get("n_prompt", 0) == 0 and r.get("n_gen", 0) > 0 and r.get("avg_ts"):
                out[(*key, int(r["n_depth"]))] = {"ms": 1000.0 / r["avg_ts"], "gpu": r.get("gpu_info", ""),
                                                  "test_time": r.get("test_time"), "file": path.name,
                                                  "n_gen": r["n_gen"], "type": f"{qtype} {what}, f16 KV, "
                                                  "flash attention"}
    return out


def attach(records: list[dict], peer: dict, same_device: bool) -> list[str]:
    """A record of shape S (or S@N: its first N layers) and recipe R pairs with the file of S at R's type
    (RECIPE_TYPES) and N layers."""
    lines = []
    for r in records:
        if r.get("bench") != "moec-latency" or r.get("batch") != 1 or "ms_median" not in r:
            continue
        base, _, n = r["shape"].partition("@")
        key = (SHAPES.get(base, ""), RECIPE_TYPES.get(r.get("recipe"), "Q2_K"), int(n) if n else None, r["context"])
        p = peer.get(key)
        if p is None:
            continue
        if p["gpu"] not in r.get("device", ""):
            msg = f"{r['shape']} {r['context']}: moec ran on {r.get('device')!r}, llama.cpp on {p['gpu']!r}"
            if same_device:
                raise SystemExit(f"speedup_vs_llamacpp: {msg}")
            lines.append(f"skipped ({msg})")
            continue
        r.setdefault("peer", {})["llamacpp"] = {k: p[k] for k in ("ms", "gpu", "test_time", "file", "n_gen", "type")}
        r["speedup_vs_llamacpp"] = p["ms"] / r["ms_median"]
        lines.append(f"{r['shape']:14s} {r['recipe']:24s} ctx {r['context']:6d}  moec {r['ms_median']:6.3f} ms  "
                     f"llama.cpp {p['ms']:6.3f} ms  x{r['speedup_vs_llamacpp']:.2f}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("latency", type=Path)
    ap.add_argument("llama_bench_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--same-device", action="store_true")
    a = ap.parse_args()
    try:
        records = json.loads(a.latency.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"speedup_vs_llamacpp: cannot read {a.latency}: {e}", file=sys.stderr)
        return 2
    peer = llamacpp_ms(a.llama_bench_dir)
    if not peer:
        print(f"speedup_vs_llamacpp: no llama_bench_<shape>.json in {a.llama_bench_dir}", file=sys.stderr)
        return 2
    lines = attach(records, peer, a.same_device)
    print("\n".join(lines) or "no batch-1 row at a timed depth")
    tmp = a.out.with_name(a.out.name + ".partial")
    tmp.write_text(json.dumps(records, indent=1))
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
