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
Issues 35 and 36 (added 2026-12-06, fourth session): moe-glm-tl (GLM-4.5-Air's top-8 experts of 1408: its down
GEMV ran at 16% of copy in the step against gate/up's 47%), qlinear-glm-qkv / -o (the Gluon 4-bit GEMV at 46-53% in
the step), mla-v2lite-32k (the fp16 latent kernel at 69% of copy, bar 70%) and mla-nuq-v2lite-32k (the 2-bit
latent kernel, 0.5x of it where the bar is 2x), each with its split combine.
"""

from __future__ import annotations

import argparse
import json

import torch

CASES = ["moe-mixtral-gluon-gu", "moe-mixtral-gluon-gu-tiled", "moe-mixtral-gluon-down", "moe-mixtral-gluon-down-tiled",
         "moe-mixtral-tl", "moe-qwen3-gluon", "moe-qwen3-tl", "kv-mixtral-32k-w4", "kv-mixtral-32k-w1",
         "kv-qwen3-32k-w4", "fp16-mixtral-32k", "moe-glm-tl", "qlinear-glm-qkv", "qlinear-glm-o", "mla-v2lite-32k",
         "mla-v2lite-32k-half", "mla-nuq-v2lite-32k"]
GLM_MOE = (128, 8, 4096, 1408)  # E, A, D, I


def _moe(shape: str):
    from benchmarks.bench_gluon_moe import SHAPES, hls2

    E, A, D, I = GLM_MOE if shape == "glm-4.5-air" else SHAPES[shape][:4]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (hls2(E, I, D, gen), hls2(E, I, D, gen), hls2(E, D, I, gen))
    x = (torch.randn(1, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    ids = torch.randperm(E, device="cuda", generator=gen)[:A][None].int()
    wts = torch.softmax(torch.randn(1, A, device="cuda", generator=gen), -1)
    return A, w, x, ids, wts


def _mla(case: str):
    """DeepSeek-V2-Lite's absorbed attention at 32k, batch 1 (16 heads, latent 512 + 64): the fp16 latent kernel, or
    the mla-nuq kernel over a 2-bit cache (gluon_mla_nuq.py's setup)."""
    import math

    from moec.kernels.mla_decode_attention import mla_decode_attention

    H, R, RP, ctx = 16, 512, 64, 32768
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, H, R + RP, device="cuda", dtype=torch.bfloat16, generator=gen)
    new = torch.randn(1, R + RP, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 1 / math.sqrt(192)
    if case.startswith("mla-v2lite-32k"):  # -half: fp16 partials (half_partials, pdl/half patches)
        rows = torch.randn(1, ctx + 64, R + RP, device="cuda", dtype=torch.float16, generator=gen)
        pos = torch.full((1,), ctx, device="cuda", dtype=torch.long)
        kw = {"half_partials": True} if case.endswith("-half") else {}
        return lambda: mla_decode_attention(q, rows, new, pos, R, scale, **kw)
    from moec.kernels.mla_nuq_decode_attention import mla_nuq_decode_attention
    from moec.runtime.config import ModelArgs
    from moec.runtime.mla_nuq import MLANUQCache, build_codecs, random_tensors

    args = ModelArgs(arch="deepseek_v2", vocab_size=64, dim=64, n_layers=1, n_heads=H, n_kv_heads=H, head_dim=192,
                     max_seq_len=1 << 16, attn_kind="mla", kv_lora_rank=R, qk_rope_dim=RP, v_head_dim=128)
    codec = build_codecs({}, random_tensors(args, {}, torch.Generator().manual_seed(0), "cpu"), args)[0].to("cuda")
    cache = MLANUQCache(args, 1, ctx + 64, [codec], window=128, sinks=4, block=32, device="cuda", mode="static")
    cache.fill_random(0, ctx, torch.Generator(device="cuda").manual_seed(0))
    hist = cache.hist_len[:1]
    wl = (torch.tensor(cache.length[:1], device="cuda") + 1 - hist).to(torch.int32)
    return lambda: mla_nuq_decode_attention(q, cache.codes[0], cache.scales[0], codec.levels, hist, cache.win[0],
                                            new, wl, R, scale, rope_rotation=codec.Rr)


def build(case: str):
    """-> a function launching the case's kernels (inputs built here, outside the profiled range)."""
    from moec.kernels import gluon_moe_decode as gmd
    from moec.kernels.moe_decode import moe_decode

    if case.startswith("qlinear-"):
        from benchmarks.bench_gluon_qlinear import SHAPES, rtn4
        from moec.kernels.qlinear import qlinear

        K, O = SHAPES[case.removeprefix("qlinear-")]
        w = rtn4(O, K, torch.Generator(device="cuda").manual_seed(0))
        x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
        return lambda: qlinear(x, w, gluon=True)
    if case.startswith("mla-"):
        return _mla(case)
    if case.startswith("moe-"):
        shape = "mixtral-8x7b" if "mixtral" in case else "glm-4.5-air" if "glm" in case else "qwen3-30b-a3b"
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
