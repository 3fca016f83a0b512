"""The Gluon 4-bit decode GEMV (moec/kernels/gluon_qlinear.py) against the `tl` GEMV and torch's bf16 linear, H100/H200.

    python3 -m benchmarks.bench_gluon_qlinear --out benchmarks/results/gluon_qlinear_h100.json     (~1 min cold)

Attention projections at batch 1 and 4: Mixtral-8x7B (q/k/v fused 4096 -> 6144, o 4096 -> 4096), Qwen3-30B-A3B
(2048 -> 5120, 4096 -> 2048), GLM-4.5-Air (4096 -> 14336, 12288 -> 4096); 4-bit RTN, groups of 128 (the
`latency-hls2-nuq2-attn4` codec), random codes and fp16 scales (zero = -8·scale). Each call runs L weights of its
own (more bytes than the L2) in one CUDA graph, per call the median of 50 replays. The Gluon kernel is swept over
rows per program (BM) and warps splitting the inputs (KW), each setting checked against qlinear_ref first
(`max_rel_err` = max |err| / max |ref|). `pct_of_copy`: bytes (codes, scales, zeros; bf16: the weight) / time
against a device-to-device copy (read + write) in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.benchutil import copy_bandwidth, graph_times, recorder
from moec.atomic import write_json
from moec.kernels import gluon_qlinear as gq
from moec.kernels.dequant import MODE_AFFINE, QWeight
from moec.kernels.qlinear import qlinear, qlinear_ref
from moec.provenance import environment

SHAPES = {"mixtral-qkv": (4096, 6144), "mixtral-o": (4096, 4096), "qwen3-qkv": (2048, 5120), "qwen3-o": (4096, 2048),
          "glm-qkv": (4096, 14336), "glm-o": (12288, 4096)}
# (BM, KW). Variants prefetching the next chunk (results/gluon_qlinear_variants_h100.json: `prefetch` 1 and 2)
# were no faster and were removed.
CONFIGS = [(16, 8), (16, 4), (32, 8), (32, 4), (16, 16), (32, 16)]


def rtn4(O: int, K: int, gen) -> QWeight:
    codes = torch.randint(0, 256, (1, O, K // 2), dtype=torch.uint8, device="cuda", generator=gen)
    scale = (torch.rand(1, O, K // 128, device="cuda", generator=gen) * 0.01 + 1e-3).half()
    return QWeight(MODE_AFFINE, 4, K, codes, scale, (-8 * scale.float()).half())


def bench_shape(record, copy: float, shape: str, K: int, O: int, gen) -> None:
    L = max(2, -(-256 << 20) // (O * K // 2))  # >= 256 MB of codes: the L2 holds none of a replay's
    ws = [rtn4(O, K, gen) for _ in range(L)]
    dense = [torch.randn(O, K, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2)]
    q_bytes = O * K // 2 + 2 * O * (K // 128) * 2

    def batch(M: int) -> None:
        x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
        y = torch.empty(M, O, dtype=x.dtype, device="cuda")
        want = qlinear_ref(x, ws[0])
        base = dict(shape=shape, K=K, O=O, batch=M)

        def err(got):
            return ((got.float() - want).abs().max() / want.abs().max()).item()

        def timed(path, fn, nbytes, max_rel_err=None, n=L, **cfg):
            ms = statistics.median(graph_times(fn, 50)) / n
            record(**base, path=path, **cfg, ms=ms, us=ms * 1e3, max_rel_err=max_rel_err,
                   pct_of_copy=100 * nbytes / (ms * 1e-3) / (copy * 1e9))

        def bf16():
            for d in dense:
                F.linear(x, d)

        timed("bf16", bf16, O * K * 2, n=len(dense))

        def tl():
            for w in ws:
                qlinear(x, w)

        timed("tl", tl, q_bytes, err(qlinear(x, ws[0])))
        for bm, kw in CONFIGS:
            def glu(bm=bm, kw=kw):
                for w in ws:
                    gq.gluon_qlinear(x, w, None, y, bm, kw)
            try:
                e = err(gq.gluon_qlinear(x, ws[0], None, y, bm, kw))
                timed("gluon", glu, q_bytes, e, block_m=bm, warps=kw)
            except Exception as ex:  # a setting that does not compile here: recorded, not fatal
                record(**base, path="gluon", block_m=bm, warps=kw, error=f"{type(ex).__name__}: {str(ex)[:300]}")

    for M in (1, 4):
        batch(M)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    t0 = time.time()
    copy = copy_bandwidth()
    res = {"bench": "gluon_qlinear", "device": torch.cuda.get_device_name(), "environment": environment("cuda"),
           "copy_gbs": copy, "records": []}

    record = recorder(res, args.out)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape, (K, O) in SHAPES.items():
        bench_shape(record, copy, shape, K, O, gen)
        torch.cuda.empty_cache()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
