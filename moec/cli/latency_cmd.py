"""`moec eval --latency`: decode ms/token against the HBM floor, prefill time, peers, table/JSON/plot.

Configurations: a packed checkpoint (its codecs) or `--random SHAPE --recipe R.yaml` (random weights
built in memory on the GPU, no disk: bf16 Mixtral is 93 GB, more than the GPU machine's disk), plus
the project's bf16 peer on the same shape (bf16 experts, fp16 KV, same engine). Each configuration is
built, measured at every (batch, context) and freed before the next, so peers never share memory.
Timing, bytes and floor: moec/runtime/latency.py. HF transformers' own numbers for these shapes are
carried as quoted peers (issue 5: measured on this machine at batch 1, 32k); benchmarks/bench_latency.py
can also time HF itself where it fits.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path

import torch
from rich.table import Table

from ..atomic import atomic_file
from ..errors import UserError
from .common import base_record, show_table

log = logging.getLogger(__name__)

HF_QUOTED = {"mixtral-8x7b": 34.4, "qwen3-30b-a3b": 26.9}  # ms/token, batch 1, 32k, bf16 static cache (issue 5)


class _Keep:
    codec = "keep"


def build_config(model: str | None, random: str | None, recipe: str | None, device: str, bf16_peer: bool = False):
    """(model, kv section, static cache builder, description) for a packed/HF model or a random shape + recipe."""
    from ..runtime.config import PRESETS
    from ..runtime.decode import static_cache_factory
    from ..runtime.latency import random_kv_tensors, random_model

    if random is not None:
        if random not in PRESETS:
            raise UserError(f"--random: unknown shape {random!r}; presets: {', '.join(PRESETS)}")
        args = PRESETS[random]
        if bf16_peer or recipe is None:
            m = random_model(args, lambda n: None, device)
            return m, None, static_cache_factory(None, {}, args), {"shape": random, "method": "bf16",
                                                                  "recipe": "bf16-fp16kv"}
        from ..calibrate.pack_kv import kv_manifest, kv_view
        from ..calibrate.recipe import load_recipe
        from ..calibrate.run import check_kv_attention

        r = load_recipe(recipe)
        check_kv_attention(args, r)
        kv = kv_view(r, kv_manifest(r, args))
        caches = static_cache_factory(kv, random_kv_tensors(args, kv) if kv else {}, args)
        m = random_model(args, r.rule_for, device)
        return m, kv, caches, {"shape": random, "method": "packed-random", "recipe": r.name}
    from ..calibrate.sources import resolve_model
    from ..runtime.loader import load_model

    m, info = load_model(resolve_model(model), torch.bfloat16, device)
    kv = info.get("kv")
    caches = static_cache_factory(kv, info.get("kv_tensors", {}), m.args)
    recipe_name = info["manifest"]["recipe"]["name"] if info["kind"] == "packed" else "source"
    return m, kv, caches, {"shape": model, "method": info["kind"], "recipe": recipe_name}


def run_config(m, kv, caches, desc: dict, batches: list[int], contexts: list[int], steps: int,
               prefill_contexts: list[int], bandwidth: float, breakdown_context: int | None = None) -> list[dict]:
    """Records for one configuration; a (batch, context) that does not fit or fails is recorded as an error."""
    from ..runtime.latency import check_fits, kernel_breakdown, measure_decode, measure_prefill, static_bytes_per_token

    def cache_fn(b, n):
        return caches(m, b, n)

    per_tok = static_bytes_per_token(cache_fn)
    recs = []
    for b in batches:
        for ctx in contexts:
            rec = base_record("moec-latency", "cuda") | desc | {"context": ctx, "batch": b, "dtype": "bf16",
                                                                "kv_codec": (kv or {}).get("codec", "fp16"),
                                                                "copy_bw_GBps": bandwidth / 1e9, "peer": {}}
            t0 = time.perf_counter()
            try:
                bb = b
                while True:  # a batch that does not fit: the largest graph bucket below it that does
                    try:
                        check_fits(m.args, bb, ctx, per_tok, "cuda")
                        break
                    except ValueError as e:
                        if bb == 1:
                            raise
                        rec.setdefault("fit_note", str(e))
                        bb = max(x for x in (1, 2, 4, 8, 16, 32) if x < bb)
                if bb != b:
                    rec["batch_requested"], rec["batch"] = b, bb
                rec |= measure_decode(m, cache_fn, bb, ctx, steps=steps, bandwidth=bandwidth)
                rec["fused_step"] = os.environ.get("MOEC_FUSE", "1") != "0"
                if bb == 1 and ctx == breakdown_context and rec["fused_step"]:  # what the step fusions give
                    os.environ["MOEC_FUSE"] = "0"
                    try:
                        plain = measure_decode(m, cache_fn, bb, ctx, steps=steps, bandwidth=bandwidth)
                        rec["unfused"] = {k: plain[k] for k in ("ms_median", "ms_p10", "ms_p90") if k in plain}
                    finally:
                        del os.environ["MOEC_FUSE"]
            except Exception as e:  # OOM, a context that does not fit, a capture failure: record and go on
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                log.warning("%s %s batch %d context %d: %s", desc["shape"], desc["recipe"], b, ctx, rec["error"])
                torch.cuda.empty_cache()
            rec["wall_s"] = time.perf_counter() - t0
            recs.append(rec)
    for ctx in prefill_contexts:
        rec = base_record("moec-latency-prefill", "cuda") | desc | {"context": ctx, "batch": 1, "dtype": "bf16",
                                                                    "kv_codec": (kv or {}).get("codec", "fp16"),
                                                                    "peer": {}}
        try:
            check_fits(m.args, 1, ctx, per_tok, "cuda", reserve=12 << 30)
            rec |= measure_prefill(m, cache_fn, ctx)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            torch.cuda.empty_cache()
        recs.append(rec)
    if breakdown_context:
        rec = base_record("moec-latency-breakdown", "cuda") | desc | {"context": breakdown_context, "batch": 1,
                                                                      "peer": {}}
        step = next((r for r in recs if r.get("batch") == 1 and r.get("context") == breakdown_context
                     and "bytes_kv" in r), None)
        try:
            rec |= kernel_breakdown(m, cache_fn, breakdown_context, bandwidth=bandwidth, step_bytes=step and {
                k: step[k] for k in ("bytes_kv", "bytes_experts", "bytes_non_expert")})
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        recs.append(rec)
    return recs


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def attach_peers(records: list[dict]) -> None:
    """peer: the bf16 path's ms_median at the same shape/batch/context, and HF's quoted number at batch 1, 32k."""
    bf16 = {(r["shape"], r["batch"], r["context"]): r for r in records
            if r["bench"] == "moec-latency" and r["method"] == "bf16" and "ms_median" in r}
    for r in records:
        if r["bench"] != "moec-latency" or r["method"] == "bf16" or "ms_median" not in r:
            continue
        p = bf16.get((r["shape"], r["batch"], r["context"]))
        if p is not None:
            r["peer"]["bf16"] = {"ms_median": p["ms_median"], "pct_of_floor": p.get("pct_of_floor")}
            r["speedup_vs_bf16"] = p["ms_median"] / r["ms_median"]
        if r["batch"] == 1 and r["context"] == 32768 and r["shape"] in HF_QUOTED:
            r["peer"]["hf_transformers_quoted"] = {"ms_median": HF_QUOTED[r["shape"]],
                                                   "source": "issue 5, measured on this machine"}
            r["speedup_vs_hf"] = HF_QUOTED[r["shape"]] / r["ms_median"]


def print_table(records: list[dict]) -> None:
    t = Table(title="decode latency (CUDA graphs; median over steps; floor = bytes / measured copy bandwidth)")
    for c in ("shape", "config", "batch", "context", "ms/tok", "p10", "p90", "GB/step", "floor ms", "% floor",
              "x bf16", "tok/s"):
        t.add_column(c, justify="right")
    for r in records:
        if r["bench"] != "moec-latency" or ("error" not in r and "bytes_per_step" not in r):
            continue  # prefill rows, and peers (HF) timed without a byte count
        if "error" in r:
            t.add_row(str(r.get("shape")), str(r.get("recipe")), str(r.get("batch", "-")), str(r.get("context", "-")),
                      "[red]" + r["error"][:60] + "[/red]", *[""] * 7)
            continue
        t.add_row(r["shape"], r["recipe"], str(r["batch"]), str(r["context"]), f"{r['ms_median']:.3f}",
                  f"{r['ms_p10']:.3f}", f"{r['ms_p90']:.3f}", f"{r['bytes_per_step'] / 1e9:.2f}",
                  f"{r.get('floor_ms', float('nan')):.3f}", f"{r.get('pct_of_floor', float('nan')):.0f}",
                  f"{r['speedup_vs_bf16']:.2f}" if "speedup_vs_bf16" in r else "-", f"{r['tokens_per_s']:.0f}")
    show_table(t)
    pre = [r for r in records if r["bench"] == "moec-latency-prefill"]
    if pre:
        t = Table(title="prefill (batch 1, real forward)")
        for c in ("shape", "config", "context", "seconds", "tok/s"):
            t.add_column(c, justify="right")
        for r in pre:
            t.add_row(r["shape"], r["recipe"], str(r["context"]), *(
                [f"{r['prefill_s']:.2f}", f"{r['prefill_tokens_per_s']:.0f}"] if "prefill_s" in r else
                [r.get("error", "")[:60], ""]))
        show_table(t)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple, list] = {}
    for r in records:
        if r["bench"] == "moec-latency" and "ms_median" in r:
            series.setdefault((r["shape"], r["recipe"], r["batch"]), []).append((r["context"], r["ms_median"]))
    for (shape, recipe, b), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{shape} {recipe} b={b}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms / token")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_file(path) as tmp:  # the temporary keeps path's suffix: savefig takes the format from it
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def parse_ints(text: str, what: str) -> list[int]:
    """'1,16' or '4k,32k,128k' -> [ints] (k = 1024)."""
    vals = []
    for x in text.split(","):
        x = x.strip().lower()
        if not x:
            continue
        try:
            vals.append(int(x.removesuffix("k")) * (1024 if x.endswith("k") else 1))
        except ValueError:
            raise UserError(f"{what} must be a comma-separated list of integers (4k = 4096), got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise UserError(f"{what} must list positive integers, got {text!r}")
    return vals


def latency(model: str | None, random: str | None, recipe: str | None, batches: str, contexts: str, steps: int,
            prefill: str, bf16_peer: bool, breakdown: bool, json_out: Path | None, plot_out: Path | None) -> list[dict]:
    """The `moec eval --latency` command body."""
    from ..runtime.latency import copy_bandwidth

    if not torch.cuda.is_available():
        raise UserError("--latency needs a CUDA GPU (docs/metrics.md: CPU timings are not reported as speed)")
    if (model is None) == (random is None):
        raise UserError("--latency takes MODEL (a packed checkpoint) or --random SHAPE --recipe R.yaml")
    if steps < 10:
        raise UserError(f"--steps must be at least 10, got {steps}")
    bs, cs = parse_ints(batches, "--batches"), parse_ints(contexts, "--contexts")
    pcs = parse_ints(prefill, "--prefill-contexts") if prefill else []
    from ..runtime.config import PRESETS

    if random is not None and random in PRESETS:  # bad contexts: a clear error before building anything
        too_long = [c for c in cs + pcs if c + 64 > PRESETS[random].max_seq_len]
        if too_long:
            raise UserError(f"--contexts {too_long[0]} exceeds {random}'s maximum of {PRESETS[random].max_seq_len} "
                            "tokens (minus 64 decode steps)")
    if random is not None and random in PRESETS and recipe is not None:
        _check_memory(random, recipe, max(cs + pcs))  # larger than memory: UserError before any allocation
    bw = copy_bandwidth("cuda")
    records = []
    configs = [False] + ([True] if bf16_peer and random is not None and recipe is not None else [])
    for peer in configs:
        m, kv, caches, desc = build_config(model, random, recipe, "cuda", bf16_peer=peer)
        if model is not None:
            too_long = [c for c in cs if c + 64 > m.args.max_seq_len]
            if too_long:
                raise UserError(f"--contexts {too_long[0]} exceeds the model's maximum of {m.args.max_seq_len} tokens")
        records += run_config(m, kv, caches, desc, bs, cs, steps, pcs, bw,
                              breakdown_context=32768 if breakdown and 32768 + 64 <= m.args.max_seq_len else None)
        del m, kv, caches  # free this configuration before the next one is built
        free()
    attach_peers(records)
    print_table(records)
    if json_out is not None:
        from .common import write_json_atomic

        write_json_atomic(json_out, records)
    if plot_out is not None:
        plot(records, plot_out)
    return records


def _check_memory(shape: str, recipe: str, context: int) -> None:
    """Before any allocation: the random model + a batch-1 cache of `context` tokens must fit in free memory
    (larger batches that do not fit fall back to smaller graph buckets, recorded per row)."""
    from ..calibrate.pack_kv import kv_manifest, kv_view
    from ..calibrate.recipe import load_recipe
    from ..runtime.config import PRESETS
    from ..runtime.kvtiered import build_codecs
    from ..runtime.latency import estimate_model_bytes, kv_bytes_per_token, largest_context, random_kv_tensors

    args, r = PRESETS[shape], load_recipe(recipe)
    kv = kv_view(r, kv_manifest(r, args))
    from ..runtime.loader import kv_codec_spec

    if kv and kv_codec_spec(kv).tiered:
        per_tok = kv_bytes_per_token(args, kv, build_codecs(kv, random_kv_tensors(args, kv), args))
    else:  # fp16; the latent / RVQ static caches keep a dequantized mirror beside their codes: at most 2x fp16
        per_tok = kv_bytes_per_token(args, None, None) * (2 if kv else 1)
    weights = estimate_model_bytes(args, r.rule_for)
    free, _ = torch.cuda.mem_get_info()
    reserve = 4 << 30
    if weights + per_tok * (context + 64) + reserve > free:
        fit = largest_context(args, 1, free - weights, per_tok, reserve + 64 * per_tok)
        need = f"{shape} with {r.name} needs {weights / 2**30:.1f} GiB of weights"
        if not fit:
            raise UserError(f"{need}, {free / 2**30:.1f} GiB free")
        raise UserError(f"context {context}: {need} + {per_tok * (context + 64) / 2**30:.1f} GiB of KV cache, "
                        f"{free / 2**30:.1f} GiB free; the largest context that fits at batch 1 is {fit}")
