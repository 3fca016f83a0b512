"""Decode attention speed: residual-VQ lookup-table kernel (tiered cache of seed 002) vs torch SDPA on an
fp16 cache and vs the nuq2 kernel, Mixtral-8x7B attention shape (32 q heads, 8 KV heads, head_dim 128).

Cache layout at context T (moec/recipes/kv-rvq-tiered.yaml): 4 sinks + 128 recent tokens fp16, the middle
tier (tokens up to 4096 back: 2 stages of 64 + 32 centroids over 4-dim sub-vectors, 2.75 bits) and
the archive tier (older: 128 centroids over 4 dims, 1.75 bits), random codes and codebooks.

One timed "pass" calls attention once on each of N separate layer buffers (N >= 32 and enough that the
buffers total >= 512 MB, so nothing is served from the 60 MB L2), captured in a CUDA graph when that
works (launch overhead removed; `graph` says), CUDA-event timed; ms per layer call = pass / N, median
of --reps passes; ms_32_layers = 32 × that. GB/s = code bytes (keys + values, both tiers) per call /
time; `bytes_per_call` adds the fp16 window and the q·centroid tables. Every config is run inside
try/except: a failure is recorded in its row and the next config runs.

    python3 -m benchmarks.bench_rvq_attention --out $OUT/rvq_attention_h200.json      # ~1-2 min on an H200
    TRITON_INTERPRET=1 python3 -m benchmarks.bench_rvq_attention --device cpu --tiny --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.benchutil import time_step
from moec.cli.common import base_record, write_json_atomic
from moec.kernels.rvq_lut_attention import CodeSegment, rvq_lut_attention, rvq_lut_attention_ref

ROOT = Path(__file__).resolve().parents[1]

MID, ARCH, DIM, ARCH_AFTER, WIN = [64, 32], [128], 4, 4096, 132 + 16  # window: sinks + 128 + a partial block


def make_cache(B, T, H, K, d, dev, gen):
    """Random tiered RVQ cache at context T: (segments, win_k, win_v, win_len, code bytes)."""
    n_mid = min(T, ARCH_AFTER) - WIN
    n_arch = max(0, T - ARCH_AFTER)
    segs, code_bytes = [], 0
    for n, sizes in ((n_arch, ARCH), (n_mid, MID)):
        if n <= 0:
            continue
        rb = -(-sum(int(math.log2(c)) for c in sizes) * (d // DIM) // 8)
        ck = torch.randint(0, 256, (B, K, n, rb), dtype=torch.uint8, device=dev, generator=gen)
        cv = torch.randint(0, 256, (B, K, n, rb), dtype=torch.uint8, device=dev, generator=gen)
        cbs = [[torch.randn(K, d // DIM, c, DIM, device=dev, generator=gen).half() for c in sizes] for _ in "kv"]
        full = lambda x: torch.full((B,), x, dtype=torch.int32, device=dev)  # noqa: E731
        segs.append(CodeSegment(ck, cv, full(0), full(n), *cbs))
        code_bytes += 2 * ck.numel()
    wk = torch.randn(B, K, WIN, d, device=dev, generator=gen).half()
    wv = torch.randn(B, K, WIN, d, device=dev, generator=gen).half()
    return segs, wk, wv, torch.full((B,), WIN, dtype=torch.int32, device=dev), code_bytes


def timed(fn, reps: int, dev: str) -> tuple[list[float], bool]:
    """ms per call of fn() (one pass over all buffers), CUDA graph when possible; -> (times, graph)."""
    fn()
    if dev != "cuda":
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - t))
        return out, False
    torch.cuda.synchronize()
    graph = None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception:  # noqa: BLE001 (any capture failure: time eagerly and say so)
        graph, run = None, fn
    return time_step(run, reps), graph is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes for a CPU smoke run (TRITON_INTERPRET=1)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rvq_attention_h200.json")
    a = ap.parse_args()
    dev = a.device
    torch.set_grad_enabled(False)
    if a.tiny:
        global ARCH_AFTER, WIN
        H, K, d, min_bufs, min_bytes = 4, 2, 16, 2, 0
        ARCH_AFTER, WIN = 96, 20
        configs, reps = [(200, 1), (64, 2)], 1
    else:
        H, K, d, min_bufs, min_bytes = 32, 8, 128, 32, 512 << 20
        configs, reps = [(4096, 1), (4096, 16), (32768, 1), (32768, 16), (131072, 1)], a.reps
    nuq = None
    try:
        from benchmarks.bench_kv_attention import args_of, make_layer
        from moec.kernels.kv_decode_attention import kv_decode_attention
        nuq = (make_layer, args_of, kv_decode_attention)
    except Exception as e:  # noqa: BLE001
        nuq_error = f"{type(e).__name__}: {e}"
    records = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for T, B in configs:
        rec = base_record("rvq_attention", dev) | {
            "shape": f"attention H={H} K={K} d={d}", "method": "rvq-lut", "recipe": "kv-rvq-tiered",
            "model": "mixtral-8x7b" if not a.tiny else "tiny", "context": T, "batch": B, "peer": {}}
        t0 = time.time()
        try:
            one = make_cache(B, T, H, K, d, dev, gen)
            per = one[4] + 2 * one[1].numel() * 2
            n = max(min_bufs, -(-min_bytes // per)) if not a.tiny else min_bufs
            n = min(n, 256)
            bufs = [one] + [make_cache(B, T, H, K, d, dev, gen) for _ in range(n - 1)]
            q = torch.randn(B, H, d, device=dev, generator=gen)
            # correctness at this size (first buffer) against the torch reference
            out = rvq_lut_attention(q, one[0], *one[1:4], max_len=T)
            if T * B <= 32768 * 16:
                ref = rvq_lut_attention_ref(q, one[0], *one[1:4])
                rec["max_abs_err_vs_ref"] = (out - ref).abs().max().item()

            def step(bufs=bufs, q=q, T=T):
                for segs, wk, wv, wl, _ in bufs:
                    rvq_lut_attention(q, segs, wk, wv, wl, max_len=T)

            ms, graph = timed(step, reps, dev)
            ms = [x / n for x in ms]
            med = statistics.median(ms)
            lut_bytes = B * H * sum(seg.cb_k[0].shape[1] * sum(c.shape[2] for c in seg.cb_k) for seg in one[0]) * 4
            rec.update(ms_median=med, ms_p10=min(ms) if len(ms) < 10 else statistics.quantiles(ms, n=10)[0],
                       ms_p90=max(ms) if len(ms) < 10 else statistics.quantiles(ms, n=10)[-1],
                       ms_32_layers=32 * med, buffers=n, graph=graph, code_bytes=one[4],
                       bytes_per_call=one[4] + 2 * one[1].numel() * 2 + lut_bytes,
                       gbps_codes=one[4] / med / 1e6, bits_codes=8 * one[4] / (2 * B * K * d * max(T - WIN, 1)))
            del bufs
        except Exception as e:  # noqa: BLE001 (record and go on)
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()[-2000:]
        # peers: SDPA on an fp16 cache, and the nuq2 kernel, same buffers-per-pass rule
        try:
            kv_bytes = 2 * B * K * T * d * 2
            n = min(256, max(min_bufs, -(-min_bytes // kv_bytes)) if not a.tiny else min_bufs)
            caches = [(torch.randn(B, K, T, d, device=dev, generator=gen).half(),
                       torch.randn(B, K, T, d, device=dev, generator=gen).half()) for _ in range(n)]
            q16 = torch.randn(B, H, 1, d, device=dev, generator=gen).half()

            def sdpa(caches=caches, q16=q16):
                for k, v in caches:
                    F.scaled_dot_product_attention(q16, k, v, enable_gqa=True)

            ms, graph = timed(sdpa, reps, dev)
            med = statistics.median(ms) / n
            rec["peer"]["sdpa_fp16"] = {"ms_median": med, "bytes": kv_bytes, "gbps": kv_bytes / med / 1e6,
                                        "graph": graph, "buffers": n}
            del caches
        except Exception as e:  # noqa: BLE001
            rec["peer"]["sdpa_fp16"] = {"error": f"{type(e).__name__}: {e}"}
        if nuq is None:
            rec["peer"]["nuq2_kernel"] = {"error": nuq_error}
        elif not a.tiny:
            try:
                make_layer, args_of, kv_decode_attention = nuq
                layers = [make_layer(B, T, 2, dev=dev) for _ in range(min_bufs)]
                q = torch.randn(B, H, d, device=dev).half()

                def nuq_step(layers=layers, q=q, args_of=args_of, attn=kv_decode_attention):
                    for t in layers:
                        attn(*args_of(t, q), 2, 32)

                ms, graph = timed(nuq_step, reps, dev)
                rec["peer"]["nuq2_kernel"] = {"ms_median": statistics.median(ms) / len(layers), "graph": graph,
                                              "note": "2-bit codes + 1% outliers, 32 layer buffers"}
                del layers
            except Exception as e:  # noqa: BLE001
                rec["peer"]["nuq2_kernel"] = {"error": f"{type(e).__name__}: {e}"}
        if "ms_median" in rec and "ms_median" in rec["peer"].get("sdpa_fp16", {}):
            rec["speedup_vs_sdpa"] = rec["peer"]["sdpa_fp16"]["ms_median"] / rec["ms_median"]
        rec["seconds"] = round(time.time() - t0, 1)
        records.append(rec)
        print({k: rec.get(k) for k in ("context", "batch", "ms_median", "gbps_codes", "speedup_vs_sdpa", "error")},
              flush=True)
        write_json_atomic(a.out, records)
        if dev == "cuda":
            torch.cuda.empty_cache()
    write_json_atomic(a.out, records)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
