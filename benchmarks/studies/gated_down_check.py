"""The shared expert's down GEMV reading silu(g)·u itself (qlinear gated) against silu_mul then the GEMV, on the GPU.

    python3 -m benchmarks.studies.gated_down_check --out OUT.json      (~20 s)

Shapes: the shared experts' down projections of DeepSeek-V2-Lite (2816 -> 2048, bf16 through the dense `tl` GEMV, as
the fused step's _DenseGEMV runs it) and GLM-4.5-Air (1408 -> 4096, 4-bit RTN groups of 128 through the Gluon GEMV,
as latency-hls2-nuq2-lin4 runs it; and bf16). Batch 1. Each pair is checked for equality (the gated loads round as
silu_mul does, so the outputs should be bit-identical) and timed in one CUDA graph over L weights of its own (more
bytes than the L2), the median of 50 replays per call: `us_gated` (one launch) against `us_two` (silu_mul + GEMV).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.bench_gluon_qlinear import rtn4
from benchmarks.benchutil import graph_times, recorder
from moec.kernels.dequant import MODE_DENSE, QWeight
from moec.kernels.fused_decode import silu_mul
from moec.kernels.qlinear import qlinear
from moec.provenance import environment

SHAPES = [("deepseek-v2-lite-shared-down", 2816, 2048, "bf16"), ("glm-4.5-air-shared-down", 1408, 4096, "rtn4"),
          ("glm-4.5-air-shared-down", 1408, 4096, "bf16")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    res = {"bench": "gated-down-check", "env": environment("cuda"), "records": []}
    record = recorder(res, a.out)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape, K, O, kind in SHAPES:
        per = O * K // 2 if kind == "rtn4" else O * K * 2
        L = max(2, (256 << 20) // per)
        if kind == "rtn4":
            ws, gluon = [rtn4(O, K, gen) for _ in range(L)], True
        else:
            ws = [QWeight(MODE_DENSE, 16, K, torch.randn(1, O, K, device="cuda", generator=gen, dtype=torch.bfloat16))
                  for _ in range(L)]
            gluon = False
        gu = (torch.randn(1, 2 * K, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        got = qlinear(gu, ws[0], gluon=gluon, gated=True)
        want = qlinear(silu_mul(gu), ws[0], gluon=gluon)
        equal = bool(torch.equal(got, want))
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()

        def gated(ws=ws, gu=gu, gluon=gluon):
            for w in ws:
                qlinear(gu, w, gluon=gluon, gated=True)

        def two(ws=ws, gu=gu, gluon=gluon):
            for w in ws:
                qlinear(silu_mul(gu), w, gluon=gluon)

        us = {name: statistics.median(graph_times(fn, 50)) / L * 1e3 for name, fn in (("gated", gated), ("two", two))}
        record(shape=shape, K=K, O=O, kind=kind, path="gluon" if gluon else "tl", equal=equal, max_rel_err=err,
               us_gated=us["gated"], us_two=us["two"], ratio=us["gated"] / us["two"])


if __name__ == "__main__":
    main()
