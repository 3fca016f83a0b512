"""Per-layer decode time of a shape too large for one GPU, and its projection to the whole model (issue 35:
deepseek-v3 compressed; issue 36: the bf16 peers "on the layer count that fits, compared per layer").

    python3 -m benchmarks.bench_layers --out OUT.json --shape deepseek-v3 \
        --recipe moec/recipes/latency-hls2-mla2.yaml --layers 8,16 [--contexts 4096,32768]
    python3 -m benchmarks.bench_layers --out OUT.json --shape deepseek-v3 --bf16 --layers 4,5
    python3 -m benchmarks.bench_layers --shape glm-4.5-air --bf16 --layers 2,4 --dry-run   # memory only (CPU)

The preset is truncated to N layers (its first N `ffn_kinds`, so the leading dense layers stay), registered under
"SHAPE@N" in this process only, and timed as bench_latency times a shape (moec/cli/latency_cmd.build_config +
run_config: random weights in GPU memory, CUDA graphs, batch 1). With two layer counts N1 < N2 (both past the
dense layers):
    per_layer_ms  = (t(N2) - t(N1)) / (N2 - N1)            the time of one more MoE layer
    per_layer_pct_of_floor = 100 · (floor(N2) - floor(N1)) / (N2 - N1) / per_layer_ms   (floor: bytes / copy bw)
    projected_ms  = t(N2) + (L - N2) · per_layer_ms         the whole model's step, L = the preset's layers
(the embedding, LM head and dense layers are in both t(N) and cancel in the difference). --dry-run prints each
truncated shape's weight bytes (runtime/latency.estimate_model_bytes) without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


def truncated(shape: str, n: int):
    from moec.runtime.config import PRESETS

    full = PRESETS[shape]
    if not 0 < n <= full.n_layers:
        raise SystemExit(f"bench_layers: --layers {n}: {shape} has {full.n_layers} layers")
    return dataclasses.replace(full, n_layers=n, ffn_kinds=list(full.ffn_kinds[:n]),
                               layer_windows=list(full.layer_windows[:n]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shape", required=True)
    ap.add_argument("--recipe", type=Path, help="the compressed configuration (omit with --bf16)")
    ap.add_argument("--bf16", action="store_true", help="the bf16 peer (fp16 KV cache) instead of a recipe")
    ap.add_argument("--layers", default="4,8", help="two layer counts N1,N2")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    from moec.runtime.config import PRESETS

    if a.shape not in PRESETS:
        raise SystemExit(f"bench_layers: unknown shape {a.shape!r}; presets: {', '.join(PRESETS)}")
    if a.bf16 == (a.recipe is not None):
        raise SystemExit("bench_layers: give --recipe R or --bf16")
    n1, n2 = (int(x) for x in a.layers.split(","))
    if not n1 < n2:
        raise SystemExit("bench_layers: --layers N1,N2 with N1 < N2")
    L = PRESETS[a.shape].n_layers
    for n in (n1, n2):
        PRESETS[f"{a.shape}@{n}"] = truncated(a.shape, n)
    if a.dry_run:
        from moec.calibrate.recipe import load_recipe
        from moec.runtime.latency import estimate_model_bytes

        rule_for = (lambda name: None) if a.bf16 else load_recipe(str(a.recipe)).rule_for
        for n in (n1, n2, L):
            args = truncated(a.shape, n)
            print(f"{a.shape} {n} layers ({args.ffn_kinds.count('dense')} dense): "
                  f"{estimate_model_bytes(args, rule_for) / 2**30:.1f} GiB of weights")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_layers: needs a CUDA GPU (--dry-run does not)", file=sys.stderr)
        return 2
    import gc

    from moec.cli.common import write_json_atomic
    from moec.cli.latency_cmd import build_config, run_config
    from moec.runtime.latency import copy_bandwidth

    bw = copy_bandwidth("cuda")
    contexts = [int(c) for c in a.contexts.split(",")]
    records, t, floor = [], {}, {}
    for n in (n1, n2):
        m, kv, caches, desc = build_config(None, f"{a.shape}@{n}", None if a.bf16 else str(a.recipe), "cuda",
                                           bf16_peer=a.bf16)
        recs = run_config(m, kv, caches, desc | {"layers": n}, [1], contexts, a.steps, [], bw)
        for r in recs:
            if "ms_median" in r:
                t[(n, r["context"])] = r["ms_median"]
                floor[(n, r["context"])] = r.get("floor_ms")
        records += recs
        m = kv = caches = None
        gc.collect()
        torch.cuda.empty_cache()
    for ctx in contexts:
        if (n1, ctx) in t and (n2, ctx) in t:
            per = (t[(n2, ctx)] - t[(n1, ctx)]) / (n2 - n1)
            records.append({"bench": "moec-layers", "shape": a.shape, "recipe": "bf16" if a.bf16 else a.recipe.stem,
                            "context": ctx, "batch": 1, "layers": [n1, n2], "ms": [t[(n1, ctx)], t[(n2, ctx)]],
                            "per_layer_ms": per, "model_layers": L, "projected_ms": t[(n2, ctx)] + (L - n2) * per})
            if floor.get((n1, ctx)) is not None and floor.get((n2, ctx)) is not None:
                # the floor of one more layer: its weight and KV bytes at copy bandwidth, the same difference
                per_floor = (floor[(n2, ctx)] - floor[(n1, ctx)]) / (n2 - n1)
                records[-1] |= {"per_layer_floor_ms": per_floor, "per_layer_pct_of_floor": 100 * per_floor / per}
            print(f"{a.shape} {ctx}: {per:.3f} ms per layer "
                  f"({records[-1].get('per_layer_pct_of_floor', float('nan')):.0f}% of its floor), "
                  f"projected {records[-1]['projected_ms']:.2f} ms for {L} layers", flush=True)
    if a.out:
        write_json_atomic(a.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
