"""MLA latent decode attention on the GPU: kernels/mla_decode_attention.py against the torch path it replaces
(runtime/mla.MLACache's static step without kernels) and against the copy bandwidth (issue 35: the fp16 latent
kernel >= 70% of copy).

    python3 -m benchmarks.bench_mla_attention --out benchmarks/results/mla_attention_h100.json [--sweep]

Shapes: DeepSeek-V2-Lite (16 heads) and DeepSeek-V3 (128 heads), kv_lora_rank 512 + 64 RoPE dims, one layer's
latent rows in fp16, contexts 4k and 32k, batch 1 and 16. Bytes = the rows a step reads (context + 1 per batch
row, 576 fp16 each) + q and the output; pct_of_copy = bytes / time / copy bandwidth (read + write counted, as
docs/benchmarks.md's floor). Timed as CUDA-graph replays of 20 calls (the kernel and its split combine), median of
10. --sweep times every launch setting in SWEEP at each point and records the best beside the default.
`ms_half_partials`: the default launch with half_partials (fp16 normalized partials), its error beside.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
import time
from pathlib import Path

import torch

SHAPES = {"deepseek-v2-lite": 16, "deepseek-v3": 128}
R, RP = 512, 64
# block_n 16 and waves 4 never won on DeepSeek-V2-Lite's heads (mla_attention_h100.json, first sweep)
SWEEP = dict(block_n=(32, 64), block_h=(16, 32, 64), num_warps=(4, 8), num_stages=(2, 3), waves=(1, 2))


def time_graph(fn, reps: int = 20, trials: int = 10) -> float:
    """Median ms per call of fn, from CUDA-graph replays of `reps` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    ms = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b) / reps)
    return sorted(ms)[len(ms) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the sweep")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_mla_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    from moec.cli.common import base_record, write_json_atomic
    from moec.kernels import launch_config
    from moec.kernels.mla_decode_attention import mla_decode_attention, mla_decode_attention_ref
    from moec.runtime.latency import copy_bandwidth

    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    t0 = time.time()
    records = []
    scale = 1 / math.sqrt(192)
    shapes = {k: SHAPES[k] for k in a.shapes.split(",")}
    for (shape, H), B, ctx in itertools.product(shapes.items(), (1, 16), (4096, 32768)):
        g = torch.Generator(device="cuda").manual_seed(0)
        rows = torch.randn(B, ctx + 64, R + RP, device="cuda", dtype=torch.float16, generator=g)
        q = torch.randn(B, H, R + RP, device="cuda", dtype=torch.bfloat16, generator=g)
        new = torch.randn(B, R + RP, device="cuda", dtype=torch.bfloat16, generator=g)
        pos = torch.full((B,), ctx, device="cuda", dtype=torch.long)
        nbytes = B * (ctx + 1) * (R + RP) * 2 + q.numel() * 2 + B * H * R * 2
        want = mla_decode_attention_ref(q, rows.clone(), new, pos, R, scale)
        got = mla_decode_attention(q, rows, new, pos, R, scale)
        err = (got.float() - want).abs().max().item() / want.abs().max().item()
        ms = time_graph(functools.partial(mla_decode_attention, q, rows, new, pos, R, scale))
        cfg = launch_config.config("mla_decode_attention", q.device)["launch"]
        n_hb = triton_cdiv(H, min(cfg["block_h"], max(16, H)))
        ceil_splits = max(1, min(triton_cdiv(ctx, cfg["block_n"]),  # the first rule: splits rounded up
                                 triton_cdiv(int(cfg["waves"] * launch_config.num_sms(q.device)), B * n_hb)))
        ms_ceil = time_graph(functools.partial(mla_decode_attention, q, rows, new, pos, R, scale, n_splits=ceil_splits))
        ms_torch = time_graph(functools.partial(torch_step, q, rows, new, pos, scale))
        # the splits' partials as fp16 acc / l (half_partials): the same launch otherwise
        got16 = mla_decode_attention(q, rows, new, pos, R, scale, half_partials=True)
        err16 = (got16.float() - want).abs().max().item() / want.abs().max().item()
        ms_half = time_graph(functools.partial(mla_decode_attention, q, rows, new, pos, R, scale, half_partials=True))
        rec = base_record("mla-attention", "cuda") | {
            "shape": shape, "heads": H, "batch": B, "context": ctx, "kv_lora_rank": R, "rope_dim": RP,
            "config": launch_config.config("mla_decode_attention", q.device)["launch"], "ms": ms,
            "ms_torch": ms_torch, "speedup_vs_torch": ms_torch / ms, "ms_splits_rounded_up": ms_ceil, "bytes": nbytes,
            "gbps": nbytes / ms / 1e6, "copy_gbps": bw / 1e9, "pct_of_copy": 100 * nbytes / ms / 1e-3 / bw,
            "max_rel_err": err, "ms_half_partials": ms_half,
            "pct_of_copy_half_partials": 100 * nbytes / ms_half / 1e-3 / bw, "max_rel_err_half_partials": err16}
        if a.sweep:
            best = None
            for vals in itertools.product(*SWEEP.values()):
                if time.time() - t0 > a.budget:
                    rec["sweep_cut"] = True
                    break
                kw = dict(zip(SWEEP, vals, strict=True))
                if kw["block_h"] > max(16, H):
                    continue
                waves = kw.pop("waves")
                n_splits = max(1, min(triton_cdiv(ctx, kw["block_n"]),
                                      triton_cdiv(int(waves * launch_config.num_sms(q.device)),
                                                  B * triton_cdiv(H, kw["block_h"]))))
                try:
                    t = time_graph(functools.partial(mla_decode_attention, q, rows, new, pos, R, scale,
                                                     n_splits=n_splits, **kw))
                except Exception as e:  # a setting that does not compile (registers, shared memory)
                    print(f"  {kw} waves {waves}: {type(e).__name__}", flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, kw | {"waves": waves})
            if best:
                rec |= {"best_ms": best[0], "best_config": best[1],
                        "best_pct_of_copy": 100 * nbytes / best[0] / 1e-3 / bw}
        records.append(rec)
        print(f"{shape} b{B} {ctx}: {ms:.4f} ms ({rec['pct_of_copy']:.0f}% of copy), splits rounded up "
              f"{ms_ceil:.4f} ms, torch {ms_torch:.4f} ms, half partials {ms_half:.4f} ms (err {err16:.2g}), "
              f"err {err:.2g}" + (f", best {rec['best_ms']:.4f} ms {rec['best_config']}" if "best_ms" in rec else ""),
              flush=True)
        write_json_atomic(a.out, records)
        del rows, q, new
        torch.cuda.empty_cache()
    return 0


def torch_step(q, rows, new, pos, scale):
    """runtime/mla.MLACache._step's torch path on fp16 rows: the write, scores, mask, softmax, P·c."""
    B = q.shape[0]
    rows[torch.arange(B, device=q.device), pos] = new.to(rows.dtype)
    s = torch.matmul(q.to(rows.dtype), rows.transpose(1, 2)).float() * scale
    s = s.masked_fill((torch.arange(rows.shape[1], device=q.device)[None, :] > pos[:, None])[:, None], float("-inf"))
    return torch.matmul(torch.softmax(s, -1).to(rows.dtype), rows[..., :R])


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    sys.exit(main())
