"""Hardware counters of the decode kernels that miss their bandwidth targets (issues 31 and 32), under Nsight Compute.

Run under ncu (benchmarks/studies/ncu_kernels.sh does, and exports the report as CSV):

    ncu --profile-from-start off --set full -o R python3 -m benchmarks.studies.ncu_kernels --cases all

Each case builds its inputs first, then runs its kernels once between cudaProfilerStart and cudaProfilerStop, so
only those launches are profiled (ncu replays each one per metric pass, with the caches flushed between passes:
a cold-L2 read, as a decode step over more layers than the L2 holds sees). The case order, and which launches each
case makes, are printed as JSON lines (`case`), so the report's kernel IDs can be matched to them.

Cases (batch 1, the shapes of bench_gluon_moe.py and bench_gluon_kv_attention.py):
  moe-mixtral-gluon-gu, -gu-tiled, -down, -down-tiled: the Gluon 2-bit hls MoE kernels one at a time;
  moe-mixtral-tl: the `tl` prmt kernels (gate/up, down) as the runtime launches them; moe-qwen3-gluon, -tl likewise;
  kv-mixtral-32k-w4, -w1: the Gluon KV attention kernel at 4 warps (the H100 config) and 1, with its split
  combine; kv-qwen3-32k-w4; fp16-mixtral-32k: the fp16 cache's kernel (what the issue compares against).
"""

from __future__ import annotations

import argparse
import json

import torch

CASES = ["moe-mixtral-gluon-gu", "moe-mixtral-gluon-gu-tiled", "moe-mixtral-gluon-down", "moe-mixtral-gluon-down-tiled",
         "moe-mixtral-tl", "moe-qwen3-gluon", "moe-qwen3-tl", "kv-mixtral-32k-w4", "kv-mixtral-32k-w1",
         "kv-qwen3-32k-w4", "fp16-mixtral-32k"]


def _moe(shape: str):
    from benchmarks.bench_gluon_moe import SHAPES, hls2

    E, A, D, I, _ = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (hls2(E, I, D, gen), hls2(E, I, D, gen), hls2(E, D, I, gen))
    x = (torch.randn(1, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    ids = torch.randperm(E, device="cuda", generator=gen)[:A][None].int()
    wts = torch.softmax(torch.randn(1, A, device="cuda", generator=gen), -1)
    return A, w, x, ids, wts


def build(case: str):
    """-> a function launching the case's kernels (inputs built here, outside the profiled range)."""
    from moec.kernels import gluon_moe_decode as gmd
    from moec.kernels.moe_decode import moe_decode

    if case.startswith("moe-"):
        shape = "mixtral-8x7b" if "mixtral" in case else "qwen3-30b-a3b"
        A, (w1, w3, w2), x, ids, wts = _moe(shape)
        I, D = w1.data.shape[1], w1.n_in
        h = torch.empty(A, I, dtype=torch.float16, device="cuda")
        out = torch.zeros(1, D, device="cuda")
        tiled = case.endswith("-tiled")
        t = tuple(gmd.tile_codes(w.data) for w in (w1, w3, w2)) if tiled else None
        if case.endswith("-tl"):
            return lambda: moe_decode(x, ids, wts, w1, w3, w2)
        if "-gu" in case:
            return lambda: gmd.launch_gate_up(x, ids, wts, w1, w3, h, A, tiled=t[:2] if t else None)
        if "-down" in case:
            gmd.launch_gate_up(x, ids, wts, w1, w3, h, A)
            return lambda: gmd.launch_down(h, ids, wts, w2, out, A, split=2, tiled=t[2] if t else None)
        return lambda: gmd.gluon_moe_decode(x, ids, wts, w1, w3, w2, A)
    from benchmarks.bench_gluon_kv_attention import SHAPES, gluon_call, make_cache

    H, K, _ = SHAPES["mixtral" if "mixtral" in case else "qwen3"]
    if case.startswith("fp16-"):
        from moec.kernels.fp16_decode_attention import fp16_decode_attention

        S = 32768 + 132
        kc = torch.randn(1, K, S, 128, device="cuda").half()
        vc = torch.randn(1, K, S, 128, device="cuda").half()
        q = torch.randn(1, H, 128, device="cuda").half()
        kn = torch.randn(1, K, 128, device="cuda").half()
        pos = torch.full((1,), S - 1, dtype=torch.int32, device="cuda")
        return lambda: fp16_decode_attention(q, kc, vc, kn, kn, pos)
    c = make_cache(1, H, K, 32768, 132, seed=100)
    warps = 4 if case.endswith("-w4") else 1
    return lambda: gluon_call(c, warps=warps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="all", help="comma-separated, or all: " + ", ".join(CASES))
    args = ap.parse_args()
    cases = CASES if args.cases == "all" else args.cases.split(",")
    rt = torch.cuda.cudart()
    for case in cases:
        fn = build(case)
        fn()  # compile and warm (unprofiled)
        torch.cuda.synchronize()
        rt.cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        rt.cudaProfilerStop()
        print(json.dumps({"case": case}), flush=True)


if __name__ == "__main__":
    main()
