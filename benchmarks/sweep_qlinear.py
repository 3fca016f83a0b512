"""Launch-config sweep of the decode GEMV of quantized attention projections (moec/kernels/qlinear.py,
M = 1): 4-bit RTN groups of 128 at the Mixtral (4096 -> 4096, 4096 -> 1024) and Qwen3 (2048 -> 4096,
2048 -> 512, 4096 -> 2048) projection shapes, each timed as CUDA-graph replays over 16 separate weights
(more bytes than L2), against torch's bf16 linear on the same shapes.

    python3 -m benchmarks.sweep_qlinear --out X.json [--budget 200] [--write-config DIR]

Records: shape, config, ms (per call), gbps, pct_of_copy, max_rel_err_vs_ref (the config is refused above
1e-2); `phase: best` per shape. --write-config DIR: the config best on most shapes becomes this device's
qlinear GEMV config in DIR/<device>.json (moec/kernels/launch_config.py; MOEC_KERNEL_CONFIG_DIR=DIR uses it).
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from benchmarks.bench_moe_kernel import copy_bandwidth, graph_time, make_weight, nbytes, rel_err
from moec.cli.common import base_record, write_json_atomic
from moec.kernels import launch_config
from moec.kernels.qlinear import GEMV_CONFIG, qlinear, qlinear_ref

SHAPES = ((4096, 4096), (4096, 1024), (2048, 4096), (2048, 512), (4096, 2048))  # (K inputs, O outputs)
# block_k is capped at the group size's power-of-two divisor (128 here): the unroll is what varies the bytes
# in flight per loop step
GRID = [dict(block_o=bo, block_k=128, num_warps=nw, unroll=u)
        for bo, nw, u in itertools.product((4, 8, 16), (4, 8), (1, 2, 4, 8))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=200.0)
    ap.add_argument("--write-config", type=Path, help="write the winner into DIR/<device>.json")
    a = ap.parse_args()
    t0 = time.time()
    bw = copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    records = []
    for K, O in SHAPES:
        ws = [make_weight("rtn4", 1, O, K, g, group=128) for _ in range(16)]
        wb = [torch.randn(O, K, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(16)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = qlinear_ref(x, ws[0])
        act = nbytes(ws[0])
        base = base_record("moec-qlinear-sweep", "cuda") | dict(shape=f"{K}x{O}", batch=1, bytes=act, copy_gbps=bw)
        ms_bf16 = graph_time(lambda x=x, wb=wb: [torch.nn.functional.linear(x, w) for w in wb]) / 16
        records.append(base | dict(config="bf16-torch-linear", ms=ms_bf16, bytes=K * O * 2,
                                   pct_of_copy=100 * K * O * 2 / ms_bf16 / 1e6 / bw))
        best = None
        for cfg in [{}] + GRID:
            if time.time() - t0 > a.budget * (SHAPES.index((K, O)) + 1) / len(SHAPES):
                break
            rec = base | dict(config=cfg or "default")
            try:
                err = rel_err(qlinear(x, ws[0], **cfg), ref)
                rec["max_rel_err_vs_ref"] = err
                if err > 1e-2:
                    raise AssertionError(f"max rel err {err:.2e}")
                ms = graph_time(lambda cfg=cfg, x=x, ws=ws: [qlinear(x, w, **cfg) for w in ws]) / 16
                rec |= dict(ms=ms, gbps=act / ms / 1e6, pct_of_copy=100 * act / ms / 1e6 / bw,
                            speedup_vs_bf16=ms_bf16 / ms)
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            except Exception as ex:
                rec["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
            records.append(rec)
        if best:
            records.append(base | dict(phase="best", config=best[1], ms=best[0], default=GEMV_CONFIG,
                                       speedup_vs_bf16=ms_bf16 / best[0]))
            print(f"{K}x{O} bf16 {ms_bf16 * 1e3:.2f} us, best {best[0] * 1e3:.2f} us {best[1]}", flush=True)
        write_json_atomic(a.out, records)
    bests = [tuple(sorted(r["config"].items())) for r in records if r.get("phase") == "best" and r["config"]]
    if a.write_config and bests:
        path, dropped = launch_config.write_overrides(
            a.write_config, torch.cuda.get_device_name(), "qlinear", "gemv", dict(max(bests, key=bests.count)))
        print("wrote", path, "(left out:", dropped, ")", flush=True)


if __name__ == "__main__":
    main()
