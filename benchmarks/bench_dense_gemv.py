"""The bf16 projections of the decode step: cuBLAS (torch's linear) against qlinear's `tl` GEMV on dense weights.

    python3 -m benchmarks.bench_dense_gemv --out benchmarks/results/dense_gemv_h100.json [--budget 240]

Why: the projections that stay bf16 (attention in experts-hls2, shared experts, every projection of the bf16 peer)
go through cuBLAS, whose batch-1 kernels pick a split-K plus a separate reduce on some shapes: gpt-oss-120b's o
projection takes a GEMV and a `splitKreduce_kernel` each layer, and DeepSeek-V2-Lite's bf16 step spends 1.29 ms
on 2.07 GB of them at 32k (53% of copy; `results/four_patches_vs_c3ed355_h100/`). qlinear's GEMV
(kernels/qlinear.py `_gemv_kernel`) reads MODE_DENSE weights as the fused MoE kernels' dense mode does, which
streams the bf16 experts at 78-99% of copy (`down_split_experts.py --kinds bf16`). This measures whether it beats
cuBLAS on the projections themselves before the runtime routes any of them through it.

Shapes (K -> O, batch 1, bias where the model has one): gpt-oss-120b q/k/v 2880 -> 5120 and o 4096 -> 2880 (with
bias); DeepSeek-V2-Lite q 2048 -> 3072, kv_a 2048 -> 576, o 2048 -> 2048, shared gate/up 2048 -> 5632, shared down
2816 -> 2048; GLM-4.5-Air q/k/v 4096 -> 14336 (bias) and o 12288 -> 4096; Mixtral q/k/v 4096 -> 6144 and o
4096 -> 4096; Qwen3 q/k/v 2048 -> 5120 and o 4096 -> 2048. Each call runs L weights of its own (>= 256 MB: the L2
holds none of a replay's) in one CUDA graph, the median of 50 replays per call. The `tl` GEMV is swept over rows a
program (block_o), inputs a tile (block_k) and warps, each setting checked against torch first (`max_rel_err` =
max |err| / max |ref|, fp32 reference). `pct_of_copy`: the weight's bytes / time against a device-to-device copy
(read + write) in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.benchutil import copy_bandwidth, graph_times, recorder
from moec.atomic import write_json
from moec.kernels.dequant import MODE_DENSE, QWeight
from moec.kernels.qlinear import qlinear
from moec.provenance import environment

SHAPES = {  # name: (K, O, bias)
    "gpt-oss-qkv": (2880, 5120, True), "gpt-oss-o": (4096, 2880, True),
    "v2lite-q": (2048, 3072, False), "v2lite-kv-a": (2048, 576, False), "v2lite-o": (2048, 2048, False),
    "v2lite-shared-gu": (2048, 5632, False), "v2lite-shared-down": (2816, 2048, False),
    "glm-qkv": (4096, 14336, True), "glm-o": (12288, 4096, False),
    "mixtral-qkv": (4096, 6144, False), "mixtral-o": (4096, 4096, False),
    "qwen3-qkv": (2048, 5120, False), "qwen3-o": (4096, 2048, False),
    # routers where routing is not one kernel with its GEMV (over 32 experts, or a logit bias): decode._route
    "gpt-oss-router": (2880, 128, True), "glm-router": (4096, 128, False), "v3-router": (7168, 256, False),
    "v2lite-router": (2048, 64, False)}
# the tl GEMV's sweep: (block_o, block_k, num_warps); unroll stays the config's (halved where K needs it)
CONFIGS = list(itertools.product((4, 8, 16), (512, 1024), (4, 8)))


def bench_shape(record, copy: float, shape: str, K: int, O: int, has_bias: bool, gen, deadline: float) -> None:
    L = max(2, -(-256 << 20) // (O * K * 2))
    ws = [torch.randn(O, K, device="cuda", generator=gen, dtype=torch.bfloat16) * K ** -0.5 for _ in range(L)]
    qs = [QWeight(MODE_DENSE, 16, K, w[None]) for w in ws]
    bias = torch.randn(O, device="cuda", generator=gen, dtype=torch.bfloat16) if has_bias else None
    x = torch.randn(1, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    want = x.float() @ ws[0].float().t() + (bias.float() if has_bias else 0)
    base = dict(shape=shape, K=K, O=O, batch=1, bias=has_bias)

    def timed(path, fn, max_rel_err=None, **cfg):
        ms = statistics.median(graph_times(fn, 50)) / L
        record(**base, path=path, **cfg, ms=ms, us=ms * 1e3, max_rel_err=max_rel_err,
               pct_of_copy=100 * O * K * 2 / (ms * 1e-3) / (copy * 1e9))

    def err(got):
        return ((got.float() - want).abs().max() / want.abs().max()).item()

    def cublas():
        for w in ws:
            F.linear(x, w, bias)

    timed("cublas", cublas, err(F.linear(x, ws[0], bias)))
    for bo, bk, nw in CONFIGS:
        if time.time() > deadline:
            record(**base, path="tl-dense", error="budget spent: the remaining settings not run")
            return
        cfg = dict(block_o=bo, block_k=bk, num_warps=nw)

        def tl(cfg=cfg):
            for q in qs:
                qlinear(x, q, bias, **cfg)

        try:
            timed("tl-dense", tl, err(qlinear(x, qs[0], bias, **cfg)), **cfg)
        except Exception as ex:  # a setting that does not compile here: recorded, not fatal
            record(**base, path="tl-dense", **cfg, error=f"{type(ex).__name__}: {str(ex)[:300]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; no setting starts after this")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_dense_gemv: needs a CUDA GPU")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        raise SystemExit(f"bench_dense_gemv: unknown shape {unknown[0]!r} (one of {', '.join(SHAPES)})")
    t0 = time.time()
    copy = copy_bandwidth()
    res = {"bench": "dense_gemv", "device": torch.cuda.get_device_name(), "environment": environment("cuda"),
           "copy_gbs": copy, "records": []}
    record = recorder(res, args.out)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        bench_shape(record, copy, shape, *SHAPES[shape], gen, t0 + args.budget)
        torch.cuda.empty_cache()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)
    best = {}
    for r in res["records"]:
        if "ms" in r:
            k = (r["shape"], r["path"])
            best[k] = min(best.get(k, r), r, key=lambda q: q["ms"])
    for shape in args.shapes.split(","):
        cb, tl = best.get((shape, "cublas")), best.get((shape, "tl-dense"))
        if cb and tl:
            print(f"{shape:20} cuBLAS {cb['us']:6.1f} us ({cb['pct_of_copy']:.0f}%)  tl {tl['us']:6.1f} us "
                  f"({tl['pct_of_copy']:.0f}%, block_o {tl['block_o']}, block_k {tl['block_k']}, "
                  f"{tl['num_warps']} warps)  x{cb['us'] / tl['us']:.2f}")


if __name__ == "__main__":
    main()
