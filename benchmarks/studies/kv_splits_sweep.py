"""How many history splits the Gluon KV decode-attention kernel should use at batch 1 once the split combine is
cheap (issue 31), on the GPU: for the Mixtral (8 KV heads, G 4, 32 layers) and Qwen3 (4 KV heads, G 8, 48
layers) attention shapes at 32k, each (warps, splits) pair is timed kernel-only and with its combine (the Hadamard
rotation undone in it, as the latency recipe's cache does), per layer, CUDA-graph replays over all layers' caches;
the fp16 cache's attention beside it. First the correctness cases of bench_gluon_kv_attention.check (center,
score bias and rotation on and off, ragged lengths), which the score terms now added in the combine must pass.

    python3 -m benchmarks.studies.kv_splits_sweep --out kv_splits_sweep_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_gluon_kv_attention import SHAPES, D, check, gluon_call, make_cache
from benchmarks.benchutil import copy_bandwidth, graph_times
from moec.atomic import write_json
from moec.kernels import gluon_kv_attention as gka
from moec.kernels.fp16_decode_attention import fp16_decode_attention

GRID = {1: (33, 66, 131, 262), 4: (132, 264, 528)}  # one-warp splits a KV head (warps 4: 4 per program)


def sweep_shape(res, name, args, R, bw):
    """One attention shape: every (warps, splits) of GRID, kernel-only and with the combine; then the fp16 cache."""
    H, K, L = SHAPES[name]
    layers = [make_cache(1, H, K, args.context, 132, seed=100 + i) for i in range(L)]
    nbytes = sum(sum(c[k].numel() * c[k].element_size() for k in ("q", "k_codes", "v_codes", "v_scale", "win_k",
                                                                     "win_v")) for c in layers)

    def attend(splits, warps, combine):
        for c in layers:
            gluon_call(c, rotation=R, combine=combine, n_splits=splits, warps=warps)

    for warps, splits_list in GRID.items():
        for splits in splits_list:
            rec = dict(shape=name, warps=warps, n_splits=splits)
            try:
                kern = statistics.median(graph_times(lambda s=splits, w=warps: attend(s, w, False), args.reps)) / L
                full = statistics.median(graph_times(lambda s=splits, w=warps: attend(s, w, True), args.reps)) / L
                rec |= dict(kernel_us=kern * 1e3, group_us=full * 1e3, combine_us=(full - kern) * 1e3,
                            kernel_pct_of_copy=100 * nbytes / L / (kern * 1e-3) / 1e9 / bw)
            except Exception as e:  # noqa: BLE001 - recorded
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(rec), flush=True)
            res["records"].append(rec)
    layers.clear()
    torch.cuda.empty_cache()
    S = args.context + 132
    kc = [torch.randn(1, K, S, D, device="cuda").half() for _ in range(L)]
    vc = [torch.randn(1, K, S, D, device="cuda").half() for _ in range(L)]
    q = torch.randn(1, H, D, device="cuda").half()
    kn = torch.randn(1, K, D, device="cuda").half()
    pos = torch.full((1,), S - 1, dtype=torch.int32, device="cuda")

    def fp16():
        for i in range(L):
            fp16_decode_attention(q, kc[i], vc[i], kn, kn, pos)

    ms = statistics.median(graph_times(fp16, args.reps)) / L
    for r in res["records"]:
        if r.get("shape") == name and "group_us" in r and "path" not in r:
            r["speedup_vs_fp16"] = ms * 1e3 / r["group_us"]
    rec = dict(shape=name, path="fp16", group_us=ms * 1e3)
    print(json.dumps(rec), flush=True)
    res["records"].append(rec)
    kc.clear()
    vc.clear()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    t0 = time.time()
    res = {"study": "kv_splits_sweep", "device": torch.cuda.get_device_name(), "context": args.context, "checks": [],
           "records": []}
    check(res["checks"])
    res["all_checks_ok"] = all(r.get("ok") for r in res["checks"])
    res["copy_GBps"] = bw = copy_bandwidth()

    def save():
        write_json(args.out, res)

    R = torch.linalg.qr(torch.randn(D, D, device="cuda"))[0].contiguous()
    for name in SHAPES:
        sweep_shape(res, name, args, R, bw)
        save()
    res["default_splits"] = {n: gka.default_splits(1, args.context, 32, gka.launch_config.config(
        "kv_decode_attention", torch.device("cuda"))["gluon"], gka.launch_config.num_sms(torch.device("cuda")))
        for n in SHAPES}
    res["seconds"] = time.time() - t0
    save()


if __name__ == "__main__":
    main()
