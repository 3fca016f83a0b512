"""The compressed MLA latent kernel against the fp16 latent kernel, same process, same points (issue 35: the
compressed latent kernel >= 2x faster than the fp16 one).

    python3 -m benchmarks.bench_mla_nuq_attention --out benchmarks/results/mla_nuq_attention_h100.json [--sweep]

Per point (shape's heads, batch 1 and 16, contexts 4k and 32k; kv_lora_rank 512 + 64 RoPE dims, one layer):
  ms_fp16   kernels/mla_decode_attention.py over fp16 rows (its launch config), with its split combine
  ms_nuq    kernels/mla_nuq_decode_attention.py over the mla-nuq cache of kv-mla-nuq2 (history: whole blocks of
            2-bit codes + per-token scales; sinks + window: fp16 rows), the query's RoPE part rotated in the
            kernel, with its combine
  ms_step   runtime/mla_nuq.MLANUQCache's whole static step: the new row's rotation (one matmul) + ms_nuq
Bytes read per step: ms_nuq's = codes + scales + fp16 window + q and output; pct_of_copy against the copy
bandwidth (read + write counted, docs/benchmarks.md's floor). Timed as CUDA-graph replays of 20 calls, median of
10 (bench_mla_attention.time_graph). --sweep times each setting of SWEEP for the compressed kernel and records the
best beside the default. max_rel_err: the kernel against its torch reference (fp32 math). *_half_partials: both
kernels with their split partials as fp16 acc / l (half_partials), the same launches otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_mla_attention import time_graph, triton_cdiv

SHAPES = {"deepseek-v2-lite": 16, "deepseek-v3": 128}
R, RP, SINKS, WINDOW, BLOCK = 512, 64, 4, 128, 32
# (block_n 16 and num_stages 1 or 3 never won on DeepSeek-V2-Lite's heads: mla_nuq_attention_v2_h100.json)
SWEEP = dict(block_n=(32, 64), num_warps=(4, 8), num_stages=(2,), waves=(1, 2, 4))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the sweeps")
    ap.add_argument("--shapes", default="deepseek-v2-lite", help="comma-separated, of " + ", ".join(SHAPES))
    ap.add_argument("--batches", default="1,16")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_mla_nuq_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    from moec.cli.common import base_record, write_json_atomic
    from moec.kernels import launch_config
    from moec.kernels.mla_decode_attention import mla_decode_attention
    from moec.kernels.mla_nuq_decode_attention import mla_nuq_decode_attention, mla_nuq_decode_attention_ref
    from moec.runtime.config import ModelArgs
    from moec.runtime.latency import copy_bandwidth
    from moec.runtime.mla_nuq import MLANUQCache, build_codecs, random_tensors

    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    t0 = time.time()
    records = []
    scale = 1 / math.sqrt(192)
    args1 = ModelArgs(arch="deepseek_v2", vocab_size=64, dim=64, n_layers=1, n_heads=16, n_kv_heads=16,
                      head_dim=192, max_seq_len=1 << 16, attn_kind="mla", kv_lora_rank=R, qk_rope_dim=RP,
                      v_head_dim=128)
    codec = build_codecs({}, random_tensors(args1, {}, torch.Generator().manual_seed(0), "cpu"), args1)[0]
    codec = codec.to("cuda")
    shapes = {k: SHAPES[k] for k in a.shapes.split(",")}
    batches = [int(b) for b in a.batches.split(",")]
    for (shape, H), B, ctx in itertools.product(shapes.items(), batches, (4096, 32768)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, R + RP, device="cuda", dtype=torch.bfloat16, generator=g)
        new = torch.randn(B, R + RP, device="cuda", dtype=torch.bfloat16, generator=g)
        # the fp16 latent kernel
        rows = torch.randn(B, ctx + 64, R + RP, device="cuda", dtype=torch.float16, generator=g)
        pos = torch.full((B,), ctx, device="cuda", dtype=torch.long)
        ms_fp16 = time_graph(functools.partial(mla_decode_attention, q, rows, new, pos, R, scale))
        ms_fp16_half = time_graph(functools.partial(mla_decode_attention, q, rows, new, pos, R, scale,
                                                    half_partials=True))  # fp16 split partials
        del rows
        # the compressed cache at `ctx` tokens as kv-mla-nuq2 holds it
        a_sh = dataclasses.replace(args1, n_heads=H, n_kv_heads=H)
        cache = MLANUQCache(a_sh, B, ctx + 64, [codec], window=WINDOW, sinks=SINKS, block=BLOCK, device="cuda",
                            mode="static")
        for r in range(B):
            cache.fill_random(r, ctx, torch.Generator(device="cuda").manual_seed(r))
        hist = cache.hist_len[:B]
        wl = (torch.tensor(cache.length[:B], device="cuda") + 1 - hist).to(torch.int32)  # the new row's slot + 1
        win, codes, scales = cache.win[0], cache.codes[0], cache.scales[0]
        want = mla_nuq_decode_attention_ref(codec.rotate_query(q), codes, scales, codec, hist, win.clone(), new, wl,
                                            R, scale)
        got = mla_nuq_decode_attention(q, codes, scales, codec.levels, hist, win, new, wl, R, scale,
                                       rope_rotation=codec.Rr, out_dtype=torch.float32)
        err = (got - want).abs().max().item() / want.abs().max().item()
        run = functools.partial(mla_nuq_decode_attention, q, codes, scales, codec.levels, hist, win, new, wl, R, scale,
                                rope_rotation=codec.Rr)
        ms_nuq = time_graph(run)
        # the compressed kernel with fp16 split partials (half_partials), the same launch otherwise
        got16 = mla_nuq_decode_attention(q, codes, scales, codec.levels, hist, win, new, wl, R, scale,
                                         rope_rotation=codec.Rr, out_dtype=torch.float32, half_partials=True)
        err16 = (got16 - want).abs().max().item() / want.abs().max().item()
        ms_nuq_half = time_graph(functools.partial(run, half_partials=True))
        cache.pos = torch.full((B,), ctx, device="cuda", dtype=torch.long)
        cache.begin_step(B)
        ms_step = time_graph(functools.partial(cache.attend, 0, q[:, :, None], new[:, None, None]))
        cache.end_step()
        h = int(hist[0])
        nbytes = B * (h * (codes.shape[-1] + 4) + (ctx + 1 - h) * (R + RP) * 2) + q.numel() * 2 + B * H * R * 2
        rec = base_record("mla-nuq-attention", "cuda") | {
            "shape": shape, "heads": H, "batch": B, "context": ctx, "history_tokens": h, "window_tokens": ctx - h,
            "config": launch_config.config("mla_nuq_decode_attention", q.device)["launch"],
            "ms_fp16": ms_fp16, "ms_nuq": ms_nuq, "ms_step": ms_step, "speedup_vs_fp16": ms_fp16 / ms_nuq,
            "speedup_step_vs_fp16": ms_fp16 / ms_step, "bytes": nbytes, "gbps": nbytes / ms_nuq / 1e6,
            "copy_gbps": bw / 1e9, "pct_of_copy": 100 * nbytes / ms_nuq / 1e-3 / bw, "max_rel_err": err,
            "ms_fp16_half_partials": ms_fp16_half, "ms_nuq_half_partials": ms_nuq_half,
            "max_rel_err_half_partials": err16}
        if a.sweep:
            best = None
            for vals in itertools.product(*SWEEP.values()):
                if time.time() - t0 > a.budget:
                    rec["sweep_cut"] = True
                    break
                kw = dict(zip(SWEEP, vals, strict=True))
                waves = kw.pop("waves")
                bh = min(16, max(16, H))
                n_splits = max(1, min(triton_cdiv(codes.shape[1], kw["block_n"]),
                                      int(waves * launch_config.num_sms(q.device)) // (B * triton_cdiv(H, bh))))
                try:
                    t = time_graph(functools.partial(run, n_splits=n_splits, block_h=bh, **kw))
                except Exception as e:  # a setting that does not compile (registers, shared memory)
                    print(f"  {kw} waves {waves}: {type(e).__name__}", flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, kw | {"waves": waves, "block_h": bh})
            if best:
                rec |= {"best_ms": best[0], "best_config": best[1], "best_speedup_vs_fp16": ms_fp16 / best[0],
                        "best_pct_of_copy": 100 * nbytes / best[0] / 1e-3 / bw}
        records.append(rec)
        print(f"{shape} b{B} {ctx}: fp16 {ms_fp16:.4f} ms, nuq {ms_nuq:.4f} ms ({rec['pct_of_copy']:.0f}% of copy, "
              f"{ms_fp16 / ms_nuq:.2f}x), step {ms_step:.4f} ms, err {err:.2g}"
              + (f", best {rec['best_ms']:.4f} ms {rec['best_config']}" if "best_ms" in rec else ""), flush=True)
        write_json_atomic(a.out, records)
        del cache, q, new
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
