"""The `tl` 2-bit MoE decode's launch grid at batch 1 (issue 32): Nsight Compute found Qwen3's down kernel on one
program an SM (128 programs of 8 warps, stalled on memory latency), and the H200 breakdown has it at 1.5x the time
of its gate/up for half the bytes. Times the whole MoE (prmt_pairs, gate/up, down: what a decode step launches)
per layer over L layers' weights, CUDA-graph replays: each down launch (rows a program, warps, input splits; the
splits with 256-input chunks) with the default gate/up, then each gate/up launch with the default down; both
shapes of bench_gluon_moe.py.

    python3 -m benchmarks.studies.moe_grid_sweep --out moe_grid_sweep_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.bench_gluon_moe import SHAPES, hls2
from benchmarks.benchutil import graph_times
from moec.kernels.moe_decode import moe_decode, moe_decode_ref

DOWN = [(bo, w, s) for bo in (4, 8, 16) for w in (4, 8) for s in (1, 2)] + [(8, 4, 3), (16, 8, 3)]
GATE_UP = [(bo, w) for bo in (8, 16, 32) for w in (4, 8)]


def run_shape(res, shape, gen, batch):
    E, A, D, I, L = SHAPES[shape]
    layers = [(hls2(E, I, D, gen), hls2(E, I, D, gen), hls2(E, D, I, gen)) for _ in range(L)]
    x = (torch.randn(batch, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:A] for _ in range(batch)]).int()
    wts = torch.softmax(torch.randn(batch, A, device="cuda", generator=gen), -1)
    want = moe_decode_ref(x, ids, wts, *layers[0])

    def one(kw):
        for a, b, c in layers:
            moe_decode(x, ids, wts, a, b, c, **kw)

    def rec(kind, kw):
        r = dict(shape=shape, batch=batch, kind=kind, **kw)
        try:
            got = moe_decode(x, ids, wts, *layers[0], **kw)
            r["max_rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
            r["us"] = statistics.median(graph_times(lambda: one(kw), 30)) / L * 1e3
        except Exception as e:  # noqa: BLE001 - recorded
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(r), flush=True)
        res["records"].append(r)

    rec("default", {})
    for bo, w, s in DOWN:  # an input split needs chunks of fewer than I / split inputs
        rec("down", dict(block_o_down=bo, num_warps_down=w, split=s) | ({"block_k_down": 256} if s > 1 else {}))
    for bo, w in GATE_UP:
        rec("gate_up", dict(block_o=bo, num_warps=w))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1")
    args = ap.parse_args()
    res = {"study": "moe_grid_sweep", "device": torch.cuda.get_device_name(), "records": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in map(int, args.batches.split(",")):
        for shape in SHAPES:
            run_shape(res, shape, gen, batch)
            torch.cuda.empty_cache()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
