"""Tiered residual-VQ KV cache (seed 002) quality: ppl / KL / top-1 against the fp16 cache, effective bits.

For each recipe: `moec calibrate` (PTB train) -> `moec pack` (cached under --work), then per window
length W (1024: first --windows-short windows; the model's maximum up to 8192: first --windows-long
windows, decoded as a batch) the perplexity through the checkpoint's rvq-tiered cache.

Mode `sim` (every quality row): one forward per window in which each query sees exactly the keys and
values the decode-mode cache holds at its step (moec/runtime/rvq.py RVQTieredCache mode="simulated": fp16 sinks
and window, middle-tier and archive reconstructions), attended in chunks of queries. It is validated
against real token-by-token decode (`dec`) on a sample first: the tiered recipe with its archive
boundary moved to 512 tokens (so all three tiers are exercised inside a 1024-token window), one
window, both modes, same numbers expected up to float summation order; the validation rows carry
mode `dec` and `sim` and the max |logit| difference.

The baseline is the same model with an fp16 cache (keys/values rounded to fp16, one forward). Logits
are computed in chunks from kept final hidden states (an 8192-token window of SmolLM2 has 1.6 G logits).

    OMP_NUM_THREADS=1 python3 -m benchmarks.bench_kv_rvq --model smollm2-135m \\
        --recipes moec/recipes/kv-rvq-tiered.yaml moec/recipes/ablations/kv-rvq2.yaml \
                  moec/recipes/ablations/kv-rvq1.yaml

Writes benchmarks/results/kv_rvq_<model>.json (docs/benchmarks.md records; `kmeans_seconds` from calibration).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.benchutil import ROOT, cli
from moec.atomic import atomic_file
from moec.calibrate.data import load_text
from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
from moec.cli.common import base_record, write_json_atomic
from moec.runtime.loader import load_model
from moec.runtime.model import rope_cos_sin
from moec.runtime.perplexity import CONTEXT, Totals, make_windows
from moec.runtime.rvq import rvq_cache_factory


class FP16Cache:
    """The baseline in one forward: causal attention over fp16-rounded keys/values (what an fp16 cache holds)."""

    codec = "fp16"

    def attend(self, layer, q, k, v, start_pos):
        assert start_pos == 0
        return F.scaled_dot_product_attention(q, k.half().to(q.dtype), v.half().to(q.dtype), is_causal=True,
                                              enable_gqa=True)


@torch.no_grad()
def hidden(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Final normed hidden states [B, S, D] of one forward (Transformer.forward without the lm_head)."""
    x = model.tok_embeddings(tokens)
    cos, sin = rope_cos_sin(model.args, torch.arange(tokens.shape[1]), x.dtype)
    for block in model.layers:
        x = block(x, cos, sin, cache, 0)
    return model.norm(x)


@torch.no_grad()
def decode_hidden(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Real decode: prefill CONTEXT tokens, then one token at a time; hidden states [B, S-1, D] of the
    positions 0..S-2 (those that predict a next token; the prefill's first CONTEXT-1 are its own)."""
    outs = []

    def run(x, start):
        h = model.tok_embeddings(x)
        cos, sin = rope_cos_sin(model.args, torch.arange(start, start + x.shape[1]), h.dtype)
        for block in model.layers:
            h = block(h, cos, sin, cache, start)
        return model.norm(h)

    outs.append(run(tokens[:, :CONTEXT], 0))
    for t in range(CONTEXT, tokens.shape[1] - 1):
        outs.append(run(tokens[:, t : t + 1], t))
    return torch.cat(outs, 1)


def score(model, h: torch.Tensor, hb: torch.Tensor, tokens: torch.Tensor, tot: Totals, chunk: int = 512) -> float:
    """Add positions CONTEXT-1..S-2 (predicting CONTEXT..S-1) to `tot`; returns max |logit - base logit|."""
    S, worst = tokens.shape[1], 0.0
    for p in range(CONTEXT - 1, S - 1, chunk):
        e = min(p + chunk, S - 1)
        lg, bl = model.lm_head(h[:, p:e]), model.lm_head(hb[:, p:e])
        tot.add(lg, tokens[:, p + 1 : e + 1], bl)
        worst = max(worst, (lg - bl).abs().max().item())
    return worst


def run_windows(model, windows, factory, base_h: list, batch: int, sim: bool = True):
    tot, bits, bits32, cache = Totals(), [], None, None
    for i, s in enumerate(range(0, windows.shape[0], batch)):
        x = windows[s : s + batch]
        cache = factory(model, x.shape[0], x.shape[1])
        h = hidden(model, x, cache) if sim else decode_hidden(model, x, cache)
        score(model, h, base_h[i], x, tot)
        bits.append(cache.bits_at(x.shape[1]))
        bits32 = cache.bits_at(32768)
    return tot.result(True), sum(bits) / len(bits), bits32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo-moe")
    ap.add_argument("--recipes", nargs="+", required=True)
    ap.add_argument("--windows-short", type=int, default=8, help="windows of 1024 tokens")
    ap.add_argument("--windows-long", type=int, default=2, help="windows of min(8192, model max) tokens")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16, help="calibration windows (PTB train)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--validate", default="moec/recipes/kv-rvq-tiered.yaml",
                    help="recipe whose sim mode is checked against real decode on one 1024-token window ('' skips)")
    ap.add_argument("--only-validate", action="store_true", help="run only the sim-vs-dec validation")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moec-kv-rvq"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    out = a.out or ROOT / "benchmarks" / "results" / f"kv_rvq_{a.model}.json"

    model_dir = resolve_model(a.model)
    ids = tokenize(load_tokenizer(model_dir), load_text("ptb", "test"))
    base_model, info = load_model(model_dir)
    long_w = min(8192, base_model.args.max_seq_len)
    sets = {1024: make_windows(ids, 1024, a.windows_short)}
    if a.windows_long > 0:  # 0: skip the long windows (a CPU-budget escape; the long rows are the headline)
        sets[long_w] = make_windows(ids, long_w, a.windows_long)
    # calibrate + pack every recipe first (cached under --work), then the baselines, then the evals
    for recipe in a.recipes:
        name = Path(recipe).stem
        calib, pk = a.work / a.model / f"{name}-calib", a.work / a.model / name
        if not (pk / "moec.json").is_file():
            t0 = time.time()
            if not (calib / "report.json").is_file():
                cli("calibrate", a.model, "--recipe", recipe, "--data", "ptb", "--split", "train", "--samples",
                    a.samples, "--seq-len", a.seq_len, "-o", calib)
            cli("pack", a.model, calib, "-o", pk)
            print(f"{name}: calibrated and packed in {time.time() - t0:.0f}s", flush=True)
    base = {}
    # baseline hidden states per batch (fp16 cache), kept for KL (cached on disk)
    for W, win in ({} if a.only_validate else sets).items():
        t0 = time.time()
        f = a.work / a.model / f"base_W{W}_n{win.shape[0]}_b{a.batch}.pt"
        if f.is_file():
            base[W] = torch.load(f, weights_only=True)
        else:
            base[W] = [hidden(base_model, win[s : s + a.batch], FP16Cache()) for s in range(0, win.shape[0], a.batch)]
            with atomic_file(f) as tmp:
                torch.save(base[W], tmp)
        print(f"baseline W={W}: {time.time() - t0:.0f}s", flush=True)
    records = []

    def record(name, W, r, bits, bits32, mode, extra=None):
        n = sets[W].shape[0]
        rec = base_record("kv_rvq", "cpu") | {
            "model": a.model, "method": name, "recipe": name, "context": W, "batch": a.batch, "mode": mode,
            "windows": f"{n} windows (0-{n - 1}) of {W}, scored {CONTEXT}..{W - 1}", "dtype": "fp32",
            "data": "ptb", "split": "test", "w_bits": info["w_bits"], "ppl": r["ppl"], "ppl_base": r["ppl_base"],
            "delta_pct": r["delta_pct"], "kld": r["kld"], "top1": r["top1"], "kv_bits": bits, "kv_bits_32k": bits32,
            "peer": {}} | (extra or {})
        records.append(rec)
        print(json.dumps({k: rec[k] for k in ("recipe", "context", "mode", "ppl", "delta_pct", "kld", "top1",
                                                "kv_bits", "kv_bits_32k")}), flush=True)
        write_json_atomic(out, records)

    for W in base:
        tot = Totals()
        for i, s in enumerate(range(0, sets[W].shape[0], a.batch)):
            score(base_model, base[W][i], base[W][i], sets[W][s : s + a.batch], tot)
        record("fp16", W, tot.result(True), 16.0, 16.0, "sim")

    packed = {}
    for recipe in [] if a.only_validate else a.recipes:
        name = Path(recipe).stem
        calib, pk = a.work / a.model / f"{name}-calib", a.work / a.model / name
        t0 = time.time()
        rep = json.loads((calib / "report.json").read_text())["kv"]
        model, pinfo = load_model(pk)
        packed[recipe] = (model, pinfo)
        errs = {k: round(sum(x[k] for x in rep["layers"]) / len(rep["layers"]), 5)
                for k in rep["layers"][0] if k.endswith("_err") and not k.endswith("stage_err")}
        extra = {"kv": {k: v for k, v in pinfo["kv"].items() if k != "tensors"},
                 "kmeans_seconds": rep["kmeans_seconds"], "kmeans_device": rep["device"], "calib_rel_err_mean": errs}
        for W in sets:
            t1 = time.time()
            factory = rvq_cache_factory(pinfo["kv"], pinfo["kv_tensors"], model.args, mode="simulated")
            r, bits, bits32 = run_windows(model, sets[W], factory, base[W], a.batch)
            record(name, W, r, bits, bits32, "sim", extra | {"seconds": round(time.time() - t1)})
        print(f"{name}: {time.time() - t0:.0f}s", flush=True)

    if a.validate:  # sim vs real decode on one 1024-token window, archive boundary moved to 512 tokens
        name = Path(a.validate).stem
        model, pinfo = packed.get(a.validate) or load_model(a.work / a.model / name)
        sec = copy.deepcopy(pinfo["kv"])
        sec["rvq"]["archive_after"] = 512
        win = sets[1024][:1]
        hb = [hidden(base_model, win, FP16Cache())]
        hs = {}
        for mode in ("dec", "sim"):
            t1 = time.time()
            factory = rvq_cache_factory(sec, pinfo["kv_tensors"], model.args,
                                        mode="simulated" if mode == "sim" else "dynamic")
            cache = factory(model, 1, 1024)
            hs[mode] = hidden(model, win, cache) if mode == "sim" else decode_hidden(model, win, cache)
            tot = Totals()
            score(model, hs[mode], hb[0], win, tot)
            record(f"{name}-archive512", 1024, tot.result(True), cache.bits_at(1024), cache.bits_at(32768), mode,
                   {"validation": "sim vs dec, window 0, archive_after 512", "seconds": round(time.time() - t1)})
        hd, hsim = hs["dec"], hs["sim"][:, :1023]  # dec holds positions 0..1022
        diff = max((model.lm_head(hd[:, p : p + 256]) - model.lm_head(hsim[:, p : p + 256])).abs().max().item()
                   for p in range(CONTEXT - 1, 1023, 256))
        for rec in records[-2:]:
            rec["max_logit_diff_sim_vs_dec"] = diff
            rec["rel_diff_ppl_sim_vs_dec"] = records[-1]["ppl"] / records[-2]["ppl"] - 1.0
            rec["rel_diff_kld_sim_vs_dec"] = records[-1]["kld"] / records[-2]["kld"] - 1.0
        records[-1]["windows"] = records[-2]["windows"] = f"1 window (0) of 1024, scored {CONTEXT}..1023"
        print(f"sim vs dec: max |logit diff| {diff:.2e}", flush=True)
    write_json_atomic(out, records)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
