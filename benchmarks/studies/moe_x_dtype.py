"""What the 2-bit MoE decode kernels pay for a bf16 input (issue 32): Nsight Compute put the bf16 -> fp16
conversion of x at 72 of the 515 SASS instructions of the Gluon gate/up loop (benchmarks/studies/ncu_kernels.py).
Times, per layer (CUDA-graph replays over L layers' weights, bench_gluon_moe.py's shapes, batch 1): the Gluon
gate/up kernel and the whole `tl` MoE with x in bf16 and in fp16, so whether feeding the experts fp16 is worth it.

    python3 -m benchmarks.studies.moe_x_dtype --out moe_x_dtype_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.bench_gluon_moe import SHAPES, hls2
from benchmarks.benchutil import graph_times
from moec.kernels import gluon_moe_decode as gmd
from moec.kernels.moe_decode import moe_decode


def run_shape(res, shape, gen):
    E, A, D, I, L = SHAPES[shape]
    layers = [(hls2(E, I, D, gen), hls2(E, I, D, gen), hls2(E, D, I, gen)) for _ in range(L)]
    x32 = torch.randn(1, D, device="cuda", generator=gen) * 0.5
    ids = torch.randperm(E, device="cuda", generator=gen)[:A][None].int()
    wts = torch.softmax(torch.randn(1, A, device="cuda", generator=gen), -1)
    hs = [torch.empty(A, I, dtype=torch.float16, device="cuda") for _ in range(L)]

    def gate_up(x):
        for (a, b, _), h in zip(layers, hs, strict=True):
            gmd.launch_gate_up(x, ids, wts, a, b, h, A)

    def tl_moe(x):
        for a, b, c in layers:
            moe_decode(x, ids, wts, a, b, c)

    for dt in (torch.bfloat16, torch.float16):
        x = x32.to(dt)
        gu = statistics.median(graph_times(lambda x=x: gate_up(x), 50)) / L
        tl_ = statistics.median(graph_times(lambda x=x: tl_moe(x), 50)) / L
        rec = dict(shape=shape, x_dtype=str(dt), gluon_gate_up_us=gu * 1e3, tl_moe_us=tl_ * 1e3)
        print(json.dumps(rec), flush=True)
        res["records"].append(rec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = {"study": "moe_x_dtype", "device": torch.cuda.get_device_name(), "records": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in SHAPES:
        run_shape(res, shape, gen)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
