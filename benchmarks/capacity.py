"""How many tokens fit on one H200 (issue 31's capacity row), from stored bytes, no GPU needed: for the Mixtral-8x7B
and Qwen3-30B-A3B shapes, the weights of a recipe (runtime/latency.estimate_model_bytes: quantized matrices at
their stored bits, the rest bf16) plus, per sequence, the static cache's bytes per token of capacity
(kv_bytes_per_token, every layer, K and V) times the context and the fixed fp16 window (sinks + window + one
partial block), against the H200's memory less a 4 GiB reserve (what `moec eval --latency` keeps). The largest
batch at 32k and 128k, compressed (latency-hls2-nuq2) against the bf16 path (fp16 KV). Tokens/s at that batch is
a GPU measurement (bench_latency at the batch this file names), not made here.

    python3 -m benchmarks.capacity --out benchmarks/results/capacity_h200.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

from moec.atomic import write_json
from moec.calibrate.pack_kv import kv_manifest, kv_view
from moec.calibrate.recipe import load_recipe
from moec.runtime.config import PRESETS
from moec.runtime.kvtiered import build_codecs
from moec.runtime.latency import estimate_model_bytes, kv_bytes_per_token, random_kv_tensors

RECIPES = Path(__file__).resolve().parents[1] / "moec" / "recipes"
H200_BYTES = 143771 << 20  # nvidia-smi's 143,771 MiB per H200 (../.library/device/KINDS.md); the CUDA context's
# share of it comes out of RESERVE
RESERVE = 4 << 30


def row(shape: str, recipe: str | None, context: int) -> dict:
    args = PRESETS[shape]
    if recipe is None:  # the bf16 path: bf16 weights, fp16 KV
        r = load_recipe(RECIPES / "fp16.yaml")
        weights, per_tok, fixed = estimate_model_bytes(args, r.rule_for), kv_bytes_per_token(args, None, None), 0
    else:
        r = load_recipe(RECIPES / f"{recipe}.yaml")
        kv = kv_view(r, kv_manifest(r, args))
        per_tok = kv_bytes_per_token(args, kv, build_codecs(kv, random_kv_tensors(args, kv), args))
        weights = estimate_model_bytes(args, r.rule_for)
        win = kv.get("window", 0) + kv.get("sinks", 0) + kv.get("block", 0)
        fixed = 2 * args.n_layers * args.n_kv_heads * args.head_dim * 2 * win  # fp16 K and V window per row
    per_row = per_tok * context + fixed
    batch = int((H200_BYTES - RESERVE - weights) // per_row)
    return {"shape": shape, "config": recipe or "bf16-fp16kv", "context": context, "weights_GiB": weights / 2**30,
            "kv_bytes_per_token": per_tok, "kv_bits_per_value": 8 * per_tok / (2 * args.n_layers * args.n_kv_heads
                                                                               * args.head_dim),
            "fixed_window_bytes_per_row": fixed, "largest_batch": max(batch, 0),
            "tokens_that_fit": max(batch, 0) * context}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rows = [row(s, rec, ctx) for s in ("mixtral-8x7b", "qwen3-30b-a3b") for ctx in (32768, 131072)
            for rec in ("latency-hls2-nuq2", None)]
    for r in rows:
        print(f"{r['shape']:14} {r['config']:18} {r['context']:>6}: weights {r['weights_GiB']:6.1f} GiB, "
              f"{r['kv_bits_per_value']:5.2f} KV bits, largest batch {r['largest_batch']}")
    write_json(a.out, {"device_bytes": H200_BYTES, "reserve_bytes": RESERVE, "command":
                       "python3 -m benchmarks.capacity --out " + str(a.out), "rows": rows})


if __name__ == "__main__":
    main()
