"""Decode attention over a static fp16 cache: moec/kernels/fp16_decode_attention.py (the new token's write
fused in) against the torch split-K path it replaces (runtime/kvcache.py split_attention plus the two index_put
writes) and torch SDPA (flash and default) on an exact-length fp16 cache. One step = all layers' caches
(Mixtral-8x7B: 32 layers, 32 query / 8 KV heads; Qwen3-30B-A3B: 48 layers, 32 / 4), CUDA-graph replays,
median of --reps; GB/s = the cache bytes read (slots <= pos, keys and values) / time; copy bandwidth from the
same run.

    python3 -m benchmarks.bench_fp16_attention --sweep --out $OUT/fp16_attention.json

Records: shape, context, batch, variant (kernel knobs | split_torch | sdpa_flash | sdpa_default), ms_median,
GBps, pct_of_copy_bw, speedup_vs_sdpa (kernel rows: against the faster SDPA of the same run), max_abs_err
(kernel vs SDPA output, first layer).
"""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.benchutil import copy_bandwidth, graph_times, stats
from moec.atomic import write_json
from moec.cli.common import base_record
from moec.kernels import fp16_decode_attention as fk
from moec.runtime.kvcache import split_attention

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {"mixtral-8x7b": (32, 32, 8, 128), "qwen3-30b-a3b": (48, 32, 4, 128)}  # layers, H, K, d
GRID = (("mixtral-8x7b", 4096, 1), ("mixtral-8x7b", 32768, 1), ("mixtral-8x7b", 32768, 16),
        ("mixtral-8x7b", 131072, 1), ("qwen3-30b-a3b", 32768, 1), ("qwen3-30b-a3b", 4096, 1))


def run_point(base, shape, S, B, knobs, reps, bw):
    L, H, K, d = SHAPES[shape]
    cap = ((S + 1 + 127) // 128) * 128  # the engine's static buffer: a multiple of its split
    caches = [(torch.randn(B, K, cap, d, device="cuda").half(), torch.randn(B, K, cap, d, device="cuda").half())
              for _ in range(L)]
    q = torch.randn(B, H, d, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(B, K, d, device="cuda", dtype=torch.bfloat16)
    vn = torch.randn(B, K, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((B,), S, device="cuda", dtype=torch.int64)
    nbytes = L * 2 * B * K * (S + 1) * d * 2
    rows = torch.arange(B, device="cuda")
    recs = []
    point = base | {"shape": shape, "context": S, "batch": B, "bytes_per_step": nbytes, "copy_GBps": bw}

    def add(variant, ts, **extra):
        r = point | {"variant": variant} | stats(ts) | extra
        r["GBps"] = nbytes / (r["ms_median"] / 1e3) / 1e9
        r["pct_of_copy_bw"] = 100 * r["GBps"] / bw  # bw: GB/s (bench_kv_attention.copy_bandwidth)
        recs.append(r)
        print(shape, S, B, variant, round(r["ms_median"], 4), round(r["GBps"]), flush=True)

    # SDPA on exact-length caches (what issue 15 compares against), default and flash backends
    exact = [(k[:, :, : S + 1], v[:, :, : S + 1]) for k, v in caches]
    q4 = q.half()[:, :, None]
    sdpa = {}
    for name, backends in (("flash", [torch.nn.attention.SDPBackend.FLASH_ATTENTION]), ("default", None)):
        def run(backends=backends):
            if backends is None:
                return [F.scaled_dot_product_attention(q4, k, v, enable_gqa=True) for k, v in exact]
            with torch.nn.attention.sdpa_kernel(backends):
                return [F.scaled_dot_product_attention(q4, k, v, enable_gqa=True) for k, v in exact]
        try:
            add(f"sdpa_{name}", graph_times(run, reps))
            sdpa[name] = recs[-1]["ms_median"]
        except Exception as e:
            recs.append(point | {"variant": f"sdpa_{name}", "error": repr(e)[:300]})
    best_sdpa = min(sdpa.values()) if sdpa else None

    def torch_step():
        for k, v in caches:
            k[rows, :, pos] = kn.half()
            v[rows, :, pos] = vn.half()
            split_attention(q.half().view(B, K, H // K, d), k, v, pos).to(q.dtype)
    add("split_torch", graph_times(torch_step, reps))

    for kw in knobs:
        try:
            out = fk.fp16_decode_attention(q, caches[0][0], caches[0][1], kn, vn, pos, **kw).float()
            ref = F.scaled_dot_product_attention(q4, exact[0][0], exact[0][1], enable_gqa=True)[:, :, 0].float()
            err = (out - ref).abs().max().item()
            add(f"kernel {kw}", graph_times(lambda kw=kw: [fk.fp16_decode_attention(q, k, v, kn, vn, pos, **kw)
                                                            for k, v in caches], reps),
                knobs=kw, max_abs_err=err)
            if best_sdpa:
                recs[-1]["speedup_vs_sdpa"] = best_sdpa / recs[-1]["ms_median"]
        except Exception as e:
            traceback.print_exc()
            recs.append(point | {"variant": f"kernel {kw}", "knobs": kw, "error": repr(e)[:400]})
    caches.clear()  # free the step's caches before the next point
    exact.clear()
    torch.cuda.empty_cache()
    return recs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sweep", action="store_true", help="launch knobs; otherwise the CONFIG defaults only")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    bw = copy_bandwidth()
    base = base_record("fp16-decode-attention", "cuda")
    if a.sweep:
        knobs = [dict(block_n=bn, num_warps=w, num_stages=st, n_splits=None)
                 for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
    else:
        knobs = [{}]
    records = []
    for shape, S, B in GRID:
        records += run_point(base, shape, S, B, knobs, a.reps, bw)
        write_json(a.out, records)
    if a.sweep:  # the split count, at the best knobs of the batch-1 32k point
        best = min((r for r in records if r.get("knobs") is not None and "ms_median" in r
                    and r["context"] == 32768 and r["batch"] == 1 and r["shape"] == "mixtral-8x7b"),
                   key=lambda r: r["ms_median"])
        for waves in (1, 2, 4, 8):
            fk.CONFIG["waves"] = waves
            for shape, S, B in (("mixtral-8x7b", 32768, 1), ("mixtral-8x7b", 4096, 1), ("mixtral-8x7b", 32768, 16)):
                kw = {k: v for k, v in best["knobs"].items() if k != "n_splits"}
                for r in run_point(base, shape, S, B, [kw], a.reps, bw):
                    if r["variant"].startswith("kernel"):
                        records.append(r | {"waves": waves})
        write_json(a.out, records)


if __name__ == "__main__":
    main()
