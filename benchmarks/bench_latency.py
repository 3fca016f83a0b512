"""Decode latency of the whole runtime at real shapes against the HBM floor (issue 5), one script.

    python3 -m benchmarks.bench_latency --out benchmarks/results/latency_h200.json            (~150-230 s)
    python3 -m benchmarks.bench_latency --out /tmp/latency.json --quick                        (~60-90 s)

Shapes mixtral-8x7b and qwen3-30b-a3b (moec/runtime/config.py PRESETS) with random weights built in
memory on the GPU (bf16 Mixtral is 93 GB: more than the GPU machine's disk, so nothing is packed to
disk here; `moec pack --random` writes the same tensors). Configurations per shape:
    latency-hls2-nuq2  2-bit HLS experts (fused MoE kernel) + 2-bit rotated NUQ KV (kv-nuq2-rot codec)
                       (fused decode-attention kernel over the packed history), attention kept bf16
    latency-hls2-nuq2-attn4   the same + 4-bit RTN attention projections (qlinear kernel)
    bf16               the project's bf16 path: bf16 experts, fp16 KV, the same engine (peer)
Each at batch 1 and 16 (a batch that does not fit falls back to the largest graph bucket that does,
recorded as batch_requested), contexts 4k/32k/128k (history filled with random codes; the step is
the real one), CUDA graphs, median/p10/p90 over --steps replays; prefill timed with the real
forward at 4k (and 32k without --quick); a per-kernel breakdown at batch 1, 32k (torch.profiler).
HF transformers at these shapes: the issue's quoted number (34.4 / 26.9 ms at 32k) on every batch-1
32k row, and with --hf also timed here (bf16, sdpa, StaticCache, eager steps, batch 1, contexts up
to 32k; built after our configurations are freed, skipped when the budget is spent).
Every (config, batch, context) is isolated: an OOM or error is recorded and the sweep goes on; the
JSON is rewritten after every configuration, and configurations that would start past --budget
seconds are recorded as skipped.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

import torch

from moec.cli.common import base_record, write_json_atomic
from moec.cli.latency_cmd import attach_peers, build_config, print_table, run_config
from moec.runtime.latency import copy_bandwidth

RECIPES = Path(__file__).resolve().parents[1] / "moec" / "recipes"
HLS2, ATTN4 = RECIPES / "latency-hls2-nuq2.yaml", RECIPES / "latency-hls2-nuq2-attn4.yaml"
SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b")


def hf_config(args):
    """The transformers config of a preset shape (Mixtral or Qwen3-MoE)."""
    import transformers as T

    common = dict(vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
                  num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
                  max_position_embeddings=args.max_seq_len, rms_norm_eps=args.norm_eps,
                  num_experts_per_tok=args.top_k,
                  rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta})
    if args.arch == "mixtral":
        return T.MixtralConfig(**common, intermediate_size=args.expert_dim, num_local_experts=args.n_experts)
    return T.Qwen3MoeConfig(**common, moe_intermediate_size=args.expert_dim, intermediate_size=args.expert_dim,
                            num_experts=args.n_experts, norm_topk_prob=args.norm_topk)


@torch.no_grad()
def hf_peer(args, contexts: list[int], steps: int, device: str = "cuda") -> list[dict]:
    """HF transformers decode ms/token at batch 1 (bf16, sdpa, StaticCache; eager `model(...)` steps at
    position `context` over a cache of that length). Random weights built on the device."""
    import transformers as T

    cfg = hf_config(args)
    with torch.device(device):
        model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    out = []
    for ctx in contexts:
        rec = {"context": ctx, "batch": 1}
        try:
            cache = T.StaticCache(config=cfg, max_cache_len=ctx + steps + 16)
            tok = torch.zeros(1, 1, dtype=torch.long, device=device)
            ms = []
            for i in range(steps + 3):
                pos = torch.tensor([ctx + i], device=device)
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                logits = model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits
                tok = logits[:, -1:].argmax(-1)
                if device == "cuda":
                    torch.cuda.synchronize()
                ms.append(1e3 * (time.perf_counter() - t))
            ms = sorted(ms[3:])
            rec |= {"ms_median": ms[len(ms) // 2], "ms_p10": ms[len(ms) // 10], "ms_p90": ms[len(ms) * 9 // 10],
                    "steps": len(ms)}
            del cache
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        out.append(rec)
        if device == "cuda":
            torch.cuda.empty_cache()
    del model
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="batch 1 and 16 at 4k/32k, 20 steps, prefill 4k, no 128k")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated presets; SHAPE@N: its first N layers")
    ap.add_argument("--budget", type=float, default=190.0, help="seconds; no configuration starts after this")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers (bf16, sdpa, StaticCache), batch 1")
    ap.add_argument("--contexts", default=None, help="comma-separated decode contexts (default 4k, 32k, 128k)")
    ap.add_argument("--prefill", default=None, help="comma-separated prefill lengths, or 'none'")
    ap.add_argument("--no-peer", action="store_true", help="with --recipes: leave the bf16 peer out")
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default 1,16)")
    ap.add_argument("--recipes", nargs="+", type=Path, default=None,
                    help="time these recipes (and the bf16 peer) instead of the latency-* plan")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_latency: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    # "128k" is 131072 - 256: the presets' maximum is 131072 positions and the timed decode steps
    # (plus warm-up) must fit after the context.
    contexts = [4096, 32768] if a.quick else [4096, 32768, 131072 - 256]
    if a.contexts:
        contexts = [int(c) for c in a.contexts.split(",")]
    batches = [int(b) for b in a.batches.split(",")]
    steps = a.steps or (20 if a.quick else 50)
    prefill = [4096] if a.quick else [4096, 32768]
    if a.prefill:
        prefill = [] if a.prefill == "none" else [int(c) for c in a.prefill.split(",")]
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    records: list[dict] = []
    shapes = a.shapes.split(",")
    from moec.runtime.config import PRESETS

    from .bench_layers import truncated

    for s in shapes:  # SHAPE@N: the preset's first N layers (a peer timed at the same layer count)
        base, _, n = s.partition("@")
        if n and s not in PRESETS:
            PRESETS[s] = truncated(base, int(n))
    # in order of importance, so a run cut by the budget keeps the headline rows (None: the bf16 peer)
    plan = [(s, r) for s in shapes for r in (HLS2, None)] + [(s, ATTN4) for s in shapes]
    if a.recipes:
        plan = [(s, r) for s in shapes for r in (*a.recipes, *(() if a.no_peer else (None,)))]
    for shape, recipe in plan:
        peer = recipe is None
        name = "bf16" if peer else recipe.stem
        if time.time() - t0 > a.budget:
            records.append(base_record("moec-latency", "cuda") | {"shape": shape, "recipe": name,
                                                                  "method": "skipped", "peer": {},
                                                                  "error": "skipped: time budget"})
            continue
        tc = time.time()
        try:
            m, kv, codecs, desc = build_config(None, shape, recipe, "cuda", bf16_peer=peer)
            torch.cuda.synchronize()
            built = time.time() - tc
            bd = None if a.no_breakdown else 32768
            recs = run_config(m, kv, codecs, desc, batches, contexts, steps, prefill, bw, breakdown_context=bd)
            for r in recs:
                r["build_s"] = built
            records += recs
        except Exception as e:  # the configuration could not be built: record it and go on
            traceback.print_exc()
            records.append(base_record("moec-latency", "cuda") | {"shape": shape, "recipe": name,
                                                                  "method": "error", "peer": {},
                                                                  "error": f"{type(e).__name__}: {e}"[:300]})
        m = kv = codecs = None  # free this configuration before the next one is built
        gc.collect()
        torch.cuda.empty_cache()
        print(f"[{shape} {name}] {time.time() - tc:.1f} s (total {time.time() - t0:.1f} s)", flush=True)
        attach_peers(records)
        write_json_atomic(a.out, records)
    if a.hf:  # HF transformers peer at batch 1, after our configurations are freed (it needs the memory)
        from moec.runtime.config import PRESETS

        for shape in shapes:
            if time.time() - t0 > a.budget:
                break
            tc = time.time()
            try:
                recs = hf_peer(PRESETS[shape], [c for c in contexts if c <= 32768], max(10, steps // 2))
            except Exception as e:
                recs = [{"error": f"{type(e).__name__}: {e}"[:300]}]
            for r in recs:
                records.append(base_record("moec-latency", "cuda") | {"shape": shape, "recipe": "hf-transformers",
                                                                      "method": "hf-bf16-sdpa-static", "peer": {}} | r)
            gc.collect()
            torch.cuda.empty_cache()
            print(f"[{shape} hf] {time.time() - tc:.1f} s", flush=True)
        hf = {(r["shape"], r["context"]): r["ms_median"] for r in records
              if r.get("recipe") == "hf-transformers" and "ms_median" in r}
        for r in records:
            if r["bench"] == "moec-latency" and r.get("batch") == 1 and (r["shape"], r.get("context")) in hf \
                    and "ms_median" in r and r["recipe"] != "hf-transformers":
                r["peer"]["hf_transformers"] = {"ms_median": hf[(r["shape"], r["context"])], "measured": True}
                r["speedup_vs_hf_measured"] = hf[(r["shape"], r["context"])] / r["ms_median"]
        write_json_atomic(a.out, records)
    print_table(records)
    for r in records:
        if r["bench"] == "moec-latency-breakdown" and "ms_by_group" in r:
            print(r["shape"], r["recipe"], {k: round(v, 3) for k, v in r["ms_by_group"].items()})
    print(f"wrote {a.out} ({len(records)} records) in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
