"""The compressed MLA latent kernel's launch for many query heads (issue 35: DeepSeek-V3's 128), on the GPU.

    python3 -m benchmarks.studies.mla_nuq_heads_sweep --out OUT.json [--write] [--fp16]

At DeepSeek-V2-Lite's 16 heads one head block holds every head; at V3's 128 the shipped block of 16 heads makes
8 programs re-read and re-unpack every history tile. This sweeps the head block (16, 32, 64) with warps and
waves at batch 1 (4k, 32k) and batch 16 (32k), each setting checked against the torch reference
(max_rel_err) and timed as bench_mla_nuq_attention times the kernel (CUDA-graph replays, its combine included).
The best setting by geometric mean of the time ratios to the shipped `many_heads` launch, none of its points more
than 3% slower, is the winner if it gains more than 3%; --write puts it into moec/kernels/configs/nvidia_h200.json
(`mla_nuq_decode_attention.many_heads`, the defaults every device without its own entry uses). --fp16 also
times the fp16 latent kernel (kernels/mla_decode_attention.py, the compressed one's yardstick) over the same
head blocks, warps and waves at its own tile length and stages, each against its reference: whether its launch
for many heads should change too (it has no `many_heads` entry yet; records `kernel` "fp16", `shipped` marking
its current launch).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import re
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_mla_attention import time_graph, triton_cdiv
from benchmarks.bench_mla_nuq_attention import BLOCK, RP, SINKS, WINDOW, R

H = 128
POINTS = [(1, 4096), (1, 32768), (16, 32768)]
GRID = dict(block_h=(16, 32, 64), num_warps=(4, 8), block_n=(32,), waves=(1, 2))  # block_n 64: no win at 16 heads
MAX_REL_ERR = 2e-2  # bf16 products over 576 channels; the shipped launch measures ~7e-3 (mla_nuq_attention_h100.json)
CONFIG_FILE = Path(__file__).resolve().parents[2] / "moec" / "kernels" / "configs" / "nvidia_h200.json"


def write_many_heads(knobs: dict) -> None:
    """Rewrite the many_heads entry of the defaults file in place, its layout kept."""
    from moec.atomic import write_text as atomic_write_text

    text = CONFIG_FILE.read_text()
    body = (f'"many_heads": {{"min_heads": {knobs["min_heads"]}, "block_n": {knobs["block_n"]}, '
            f'"block_h": {knobs["block_h"]}, "num_warps": {knobs["num_warps"]},\n'
            f'                                              "num_stages": {knobs["num_stages"]}, '
            f'"waves": {knobs["waves"]}}}')
    new, n = re.subn(r'"many_heads": \{[^}]*\}', body, text)
    assert n == 1, "many_heads entry not found once"
    atomic_write_text(CONFIG_FILE, new)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--fp16", action="store_true", help="also the fp16 latent kernel over the same head blocks")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("mla_nuq_heads_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    from moec.atomic import write_json
    from moec.kernels import launch_config
    from moec.kernels.mla_decode_attention import mla_decode_attention, mla_decode_attention_ref
    from moec.kernels.mla_nuq_decode_attention import mla_nuq_decode_attention, mla_nuq_decode_attention_ref
    from moec.provenance import environment
    from moec.runtime.config import ModelArgs
    from moec.runtime.mla_nuq import MLANUQCache, build_codecs, random_tensors

    t0 = time.time()
    shipped = dict(launch_config.config("mla_nuq_decode_attention", "cuda")["many_heads"])
    args1 = ModelArgs(arch="deepseek_v2", vocab_size=64, dim=64, n_layers=1, n_heads=H, n_kv_heads=H,
                      head_dim=192, max_seq_len=1 << 16, attn_kind="mla", kv_lora_rank=R, qk_rope_dim=RP,
                      v_head_dim=128)
    codec = build_codecs({}, random_tensors(args1, {}, torch.Generator().manual_seed(0), "cpu"), args1)[0].to("cuda")
    sms = launch_config.num_sms(torch.device("cuda"))
    scale = 1 / math.sqrt(192)
    res = {"study": "mla_nuq_heads_sweep", "device": torch.cuda.get_device_name(), "environment": environment("cuda"),
           "date": time.strftime("%Y-%m-%d"), "heads": H, "shipped": shipped, "records": []}
    settings = [dict(zip(GRID, v, strict=True)) for v in itertools.product(*GRID.values())]
    shipped_key = {k: shipped[k] for k in GRID}
    if shipped_key not in settings:
        settings.insert(0, shipped_key)
    times: dict[tuple, dict] = {}
    for B, ctx in POINTS:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, R + RP, device="cuda", dtype=torch.bfloat16, generator=g)
        new = torch.randn(B, R + RP, device="cuda", dtype=torch.bfloat16, generator=g)
        cache = MLANUQCache(dataclasses.replace(args1), B, ctx + 64, [codec], window=WINDOW, sinks=SINKS,
                            block=BLOCK, device="cuda", mode="static")
        for r in range(B):
            cache.fill_random(r, ctx, torch.Generator(device="cuda").manual_seed(r))
        hist = cache.hist_len[:B]
        wl = (torch.tensor(cache.length[:B], device="cuda") + 1 - hist).to(torch.int32)
        win, codes, scales = cache.win[0], cache.codes[0], cache.scales[0]
        want = mla_nuq_decode_attention_ref(codec.rotate_query(q), codes, scales, codec, hist, win.clone(), new, wl,
                                            R, scale)
        for s in settings:
            n_hb = triton_cdiv(H, s["block_h"])
            n_splits = max(1, min(triton_cdiv(codes.shape[1], s["block_n"]), int(s["waves"] * sms) // (B * n_hb)))
            run = functools.partial(mla_nuq_decode_attention, q, codes, scales, codec.levels, hist, win, new, wl, R,
                                    scale, rope_rotation=codec.Rr, n_splits=n_splits, block_h=s["block_h"],
                                    block_n=s["block_n"], num_warps=s["num_warps"],
                                    num_stages=shipped["num_stages"])
            rec = dict(kernel="mla-nuq", batch=B, context=ctx, **s, n_splits=n_splits)
            try:
                got = run(out_dtype=torch.float32)
                rec["max_rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
                rec["ms"] = time_graph(run)
                times.setdefault(tuple(s.values()), {})[(B, ctx)] = rec["ms"]
            except Exception as e:  # a setting that does not compile (registers, shared memory)
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            res["records"].append(rec)
            print(rec, flush=True)
        if a.fp16:  # the fp16 latent kernel over the same head blocks (its baseline at many heads)
            cfg16 = launch_config.config("mla_decode_attention", "cuda")["launch"]
            rows = torch.randn(B, ctx + 64, R + RP, device="cuda", dtype=torch.float16, generator=g)
            pos = torch.full((B,), ctx, device="cuda", dtype=torch.long)
            want16 = mla_decode_attention_ref(q, rows.clone(), new, pos, R, scale)
            for s in settings:
                n_hb = triton_cdiv(H, s["block_h"])
                n_splits = max(1, min(triton_cdiv(ctx + 64, cfg16["block_n"]),
                                      int(s["waves"] * sms) // (B * n_hb)))
                run = functools.partial(mla_decode_attention, q, rows, new, pos, R, scale, n_splits=n_splits,
                                        block_n=cfg16["block_n"], block_h=s["block_h"], num_warps=s["num_warps"],
                                        num_stages=cfg16["num_stages"])
                rec = dict(kernel="fp16", batch=B, context=ctx, **(s | {"block_n": cfg16["block_n"]}),
                           n_splits=n_splits, shipped=s["block_h"] == cfg16["block_h"]
                           and s["num_warps"] == cfg16["num_warps"] and s["waves"] == cfg16["waves"])
                try:
                    got = run(out_dtype=torch.float32)
                    rec["max_rel_err"] = ((got - want16).abs().max() / want16.abs().max()).item()
                    rec["ms"] = time_graph(run)
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                res["records"].append(rec)
                print(rec, flush=True)
            del rows, want16
        del cache, q, new, want
        torch.cuda.empty_cache()
    base = times.get(tuple(shipped_key.values()), {})
    worst_err: dict[tuple, float] = {}
    for rec in res["records"]:
        if "ms" in rec and rec["kernel"] == "mla-nuq":
            key = tuple(rec[k] for k in GRID)
            err = rec["max_rel_err"]  # NaN counts as the worst (max() would drop it)
            worst_err[key] = max(worst_err.get(key, 0.0), err if err == err else math.inf)
    ranked = []
    for key, t in times.items():  # settings that ran at every point, within the reference's tolerance
        if len(t) == len(POINTS) == len(base) and worst_err[key] < MAX_REL_ERR:
            ratios = [t[p] / base[p] for p in base]
            ranked.append((math.prod(ratios) ** (1 / len(ratios)), max(ratios), key))
    ranked.sort()
    res["ranked"] = [dict(zip(GRID, k, strict=True)) | {"geomean": gm, "worst": w} for gm, w, k in ranked[:10]]
    win_ = next(((gm, w, k) for gm, w, k in ranked if w <= 1.03), None)
    if win_ and win_[0] < 0.97:
        chosen = shipped | dict(zip(GRID, win_[2], strict=True))
        res["chosen"] = chosen
        print(f"winner {chosen}: geomean x{win_[0]:.3f}, worst x{win_[1]:.3f}", flush=True)
        if a.write:
            write_many_heads(chosen)
    else:
        print("shipped many_heads launch kept", flush=True)
    res["seconds"] = time.time() - t0
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
