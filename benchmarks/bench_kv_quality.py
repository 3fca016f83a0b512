"""KV-cache quality: decode-mode perplexity, KL and top-1 against the fp16 cache, and effective KV bits.

For each recipe: `moec calibrate` (PTB train) → `moec pack` (cached under --work), then decode-mode
perplexity on PTB test through the checkpoint's compressed cache (docs/benchmarks.md protocol: windows
of W tokens, prefill 32, then one token at a time, positions 32..W−1 scored). The baseline (same
model, fp16 cache, same windows and batch) is decoded once and its logits kept, instead of in
lockstep for every recipe: the numbers equal `moec eval --mode dec --baseline` (deterministic CPU
fp32), at half the cost.

    python3 -m benchmarks.bench_kv_quality --model smollm2-135m --max-windows 2 \\
        --recipes moec/recipes/kv-kivi2.yaml moec/recipes/ablations/kv-nuq2-outlier.yaml ...

A recipe may also be a composite of recipe files as benchmarks/bench_retrieval.py reads them (`A+B`: A's keys
with B's values; `A~B:L1,L2`: B on the listed layers, A elsewhere; each part calibrated and packed once under
--work, shared with the retrieval bench): so a per-layer mix screened on retrieval gets its perplexity rows
from the same codecs.

Writes benchmarks/results/kv_quality_<model>.json (a list of records, docs/benchmarks.md fields).
HF transformers' QuantizedCache peers (quanto / HQQ) run in benchmarks/bench_kv_peers.py on the
same windows and scored positions (needs the `bench` extra; results kv_peers_<model>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.benchutil import ROOT, cli
from moec.calibrate.data import load_text
from moec.calibrate.recipe import load_recipe
from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
from moec.cli.common import base_record, console, write_json_atomic
from moec.cli.progress import install as show_progress
from moec.errors import UserError
from moec.progress import track
from moec.runtime.kvcache import FP16Cache
from moec.runtime.kvtiered import build_codecs, tiered_cache_factory
from moec.runtime.loader import load_model
from moec.runtime.perplexity import CONTEXT, Totals, fp16_cache, layer_progress, make_windows


def _score(model, windows, factory, batch, sim, name, base):
    """(Totals result, mean bits per element over the windows, the last cache)."""
    tot, bits, cache = Totals(), [], None
    for (lg, tg, cache), (blg, _) in zip(decode(model, windows, factory, batch, sim, name), base, strict=True):
        tot.add(lg, tg, blg)
        bits.append(cache.bits_per_element())
    return tot.result(True), sum(bits) / len(bits), cache


def composite(spec: str, a, windows, base, sim: bool, common: dict) -> dict:
    """The record of a composite spec (bench_retrieval's `A+B`, `A~B:layers`): its parts' codecs per layer in
    one tiered cache; the calibration of each part as its own recipe records it."""
    from benchmarks.bench_retrieval import _codecs, label

    t0 = time.time()
    model, info, codecs = _codecs(spec, a.model, a.work, a.samples, a.seq_len or 512)
    factory = tiered_cache_factory(info["kv"], codecs, "simulated" if sim else "dynamic")
    r, bits, cache = _score(model, windows, factory, a.batch, sim, label(spec), base)
    rec = base_record("kv_quality", "cpu") | common | {
        "method": "composite", "recipe": label(spec), "kv_codec": "composite", "spec": spec,
        "ppl": r["ppl"], "delta_pct": 100.0 * (r["ppl"] / common["ppl_base"] - 1.0), "kld": r["kld"],
        "top1": r["top1"], "kv_bits": bits, "kv_bits_32k": cache.bits_at(32768), "seconds": round(time.time() - t0),
        "calibration": "each part's own recipe calibration (PTB train), packed under --work as bench_retrieval does"}
    print(json.dumps({k: rec[k] for k in ("recipe", "ppl", "delta_pct", "kld", "top1", "kv_bits", "kv_bits_32k",
                                            "seconds")}), flush=True)
    return rec


@torch.no_grad()
def decode(model, windows: torch.Tensor, factory, batch: int, sim: bool, label: str):
    """Per batch of windows: yields (logits [B, W-CONTEXT, V] at the scored positions, targets, cache).
    Progress in scored positions, inside a batch too (moec/runtime/perplexity.py)."""
    n, W = windows.shape
    with track(f"{label} ({'sim' if sim else 'dec'})", n * (W - CONTEXT), "positions") as advance:
        for s in range(0, n, batch):
            x = windows[s : s + batch]
            B = x.shape[0]
            cache = factory(model, B, W)
            if sim:  # one forward: logits at p predict token p+1
                with layer_progress(model, advance, B * (W - CONTEXT)):
                    logits = model(x, cache, 0)[:, CONTEXT - 1 : W - 1]
                yield logits, x[:, CONTEXT:], cache
                continue
            out = [model(x[:, :CONTEXT], cache, 0)[:, -1]]
            advance(B)
            for t in range(CONTEXT, W - 1):
                out.append(model(x[:, t : t + 1], cache, t)[:, -1])
                advance(B)
            yield torch.stack(out, 1), x[:, CONTEXT:], cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo-moe")
    ap.add_argument("--recipes", nargs="+", required=True)
    ap.add_argument("--max-windows", type=int, default=2)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--samples", type=int, default=None,
                    help="calibration windows (PTB train); default: the recipe's calibration.samples, else 16")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="their length; default: the recipe's calibration.seq_len, else 512")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moec-kv-bench"))
    ap.add_argument("--reuse", action="store_true",
                    help="reuse a recipe's packed checkpoint already under --work (its calibration as recorded there) "
                         "instead of calibrating again: one calibration measured at several contexts")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--mode", choices=("dec", "sim"), default="dec",
                    help="dec: token by token through the cache; sim: one forward per window with the same "
                         "keys/values per query (the caches' simulated mode), validated against dec")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    show_progress(console)  # timestamped progress lines on stderr (a bar on a terminal), as the CLI shows them
    out = a.out or ROOT / "benchmarks" / "results" / f"kv_quality_{a.model}.json"

    model_dir = resolve_model(a.model)
    windows = make_windows(tokenize(load_tokenizer(model_dir), load_text("ptb", "test")), a.window, a.max_windows)
    n = windows.shape[0]
    wdesc = f"{n} windows (0-{n - 1}) of {a.window}, scored {CONTEXT}..{a.window - 1}"
    base_model, info = load_model(model_dir)
    t0 = time.time()
    sim = a.mode == "sim"
    base_factory = fp16_cache
    if sim:
        base_factory = lambda m, b, n: FP16Cache(m.args, b, n, device=m.tok_embeddings.weight.device,  # noqa: E731
                                                 mode="simulated")
    # decode the baseline once and keep its logits (fp32: windows × W × vocab × 4 bytes)
    base = [(lg, tg) for lg, tg, _ in decode(base_model, windows, base_factory, a.batch, sim, "baseline")]
    print(f"baseline (fp16 cache) decoded in {time.time() - t0:.0f}s", flush=True)
    tot = Totals()
    for lg, tg in base:
        tot.add(lg, tg, lg)
    ppl_base = tot.result(True)["ppl"]
    common = {"model": a.model, "context": a.window, "batch": a.batch, "windows": wdesc, "mode": a.mode,
              "dtype": "fp32", "data": "ptb", "split": "test", "w_bits": info["w_bits"], "ppl_base": ppl_base,
              "peer": {"hf_quantized_cache": f"benchmarks/results/kv_peers_{a.model}.json (bench_kv_peers.py)"}}
    records = [base_record("kv_quality", "cpu") | common | {
        "method": "fp16", "recipe": "fp16", "kv_codec": "fp16", "ppl": ppl_base, "delta_pct": 0.0, "kld": 0.0,
        "top1": 1.0, "kv_bits": 16.0, "kv_bits_32k": 16.0}]

    for recipe in a.recipes:
        if "~" in recipe or "+" in recipe:
            records.append(composite(recipe, a, windows, base, sim, common))
            write_json_atomic(out, records)
            continue
        name = Path(recipe).stem
        calib, packed = a.work / a.model / f"{name}-calib", a.work / a.model / name
        t0 = time.time()
        if not (a.reuse and (packed / "moec.json").is_file()):
            cal = load_recipe(Path(recipe)).calibration  # a recipe's own calibration size wins over the defaults
            size = [*(("--samples", a.samples or 16) if a.samples or not cal.samples else ()),
                    *(("--seq-len", a.seq_len or 512) if a.seq_len or not cal.seq_len else ())]
            cli("calibrate", a.model, "--recipe", recipe, "--data", "ptb", "--split", "train", *size, "-o", calib)
            cli("pack", a.model, calib, "-o", packed)
        cal = json.loads((calib / "report.json").read_text())
        model, pinfo = load_model(packed)
        factory = tiered_cache_factory(pinfo["kv"], build_codecs(pinfo["kv"], pinfo["kv_tensors"], model.args),
                                       "simulated" if sim else "dynamic")
        r, mean_bits, cache = _score(model, windows, factory, a.batch, sim, name, base)
        kv = pinfo["kv"]
        rec = base_record("kv_quality", "cpu") | common | {
            "method": f"{kv['codec']}-{kv['bits']}", "recipe": name, "kv_codec": kv["codec"],
            "kv": {k: v for k, v in kv.items() if k != "tensors"},
            "ppl": r["ppl"], "delta_pct": 100.0 * (r["ppl"] / ppl_base - 1.0), "kld": r["kld"], "top1": r["top1"],
            "kv_bits": mean_bits, "kv_bits_32k": cache.bits_at(32768), "seconds": round(time.time() - t0),
            "calibration": {k: cal[k] for k in ("data", "split", "samples", "seq_len", "seed", "tokens")}}
        assert abs(r["ppl_base"] - ppl_base) < 1e-9 * ppl_base
        records.append(rec)
        print(json.dumps({k: rec[k] for k in ("recipe", "ppl", "delta_pct", "kld", "top1", "kv_bits",
                                                "kv_bits_32k", "seconds")}), flush=True)
        write_json_atomic(out, records)
    write_json_atomic(out, records)
    print(f"wrote {out}")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:  # a bad recipe or spec: one line, before any record is written for it
        sys.exit(f"bench_kv_quality: {e}")
