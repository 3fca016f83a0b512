"""Check simulated decode (the tiered cache's simulated mode) against real decode mode on a sample (docs/benchmarks.md).

For each packed checkpoint (as written by benchmarks/bench_kv_quality.py under --work), decode the
first N windows of W tokens of PTB test twice: token by token through TieredKVCache (the eval's
`--mode dec` path) and with one simulated forward per window; record ppl, kld/top1 against the fp16
cache (same mode), the largest logit difference and the relative ppl difference.

    python3 -m benchmarks.bench_kv_sim_check --model smollm2-135m --window 320 --max-windows 1 \\
        --packed /tmp/moec-kv-bench/smollm2-135m/kv-nuq2-outlier ...
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.bench_kv_quality import decode
from moec.calibrate.data import load_text
from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
from moec.cli.common import base_record, write_json_atomic
from moec.runtime.kvcache import FP16Cache
from moec.runtime.kvtiered import build_codecs, tiered_cache_factory
from moec.runtime.loader import load_model
from moec.runtime.perplexity import CONTEXT, Totals, fp16_cache, make_windows

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo-moe")
    ap.add_argument("--packed", nargs="+", type=Path, required=True)
    ap.add_argument("--window", type=int, default=320)
    ap.add_argument("--max-windows", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    out = a.out or ROOT / "benchmarks" / "results" / f"kv_sim_vs_dec_{a.model}.json"
    model_dir = resolve_model(a.model)
    windows = make_windows(tokenize(load_tokenizer(model_dir), load_text("ptb", "test")), a.window, a.max_windows)
    n = windows.shape[0]
    base_model, _ = load_model(model_dir)
    base = {
        "dec": [lg for lg, _, _ in decode(base_model, windows, fp16_cache, a.batch, False)],
        "sim": [lg for lg, _, _ in decode(base_model, windows, lambda m, b, n: FP16Cache(
                    m.args, b, n, device=m.tok_embeddings.weight.device, mode="simulated"),
                                          a.batch, True)]}
    records = []
    for packed in a.packed:
        model, info = load_model(packed)
        kv = info["kv"]
        codecs = build_codecs(kv, info["kv_tensors"], model.args)
        res, logits = {}, {}
        for mode in ("dec", "sim"):
            t0 = time.time()
            tot, lgs, bits = Totals(), [], []
            factory = tiered_cache_factory(kv, codecs, "simulated" if mode == "sim" else "dynamic")
            cand = decode(model, windows, factory, a.batch, mode == "sim")
            for (lg, tg, cache), blg in zip(cand, base[mode], strict=True):
                tot.add(lg, tg, blg)
                lgs.append(lg)
                bits.append(cache.bits_per_element())
            res[mode] = tot.result(True) | {"kv_bits": sum(bits) / len(bits), "seconds": round(time.time() - t0, 1)}
            logits[mode] = torch.cat(lgs)
        diff = (logits["dec"] - logits["sim"]).abs().max().item()
        rec = base_record("kv_sim_vs_dec", "cpu") | {
            "model": a.model, "method": f"{kv['codec']}-{kv['bits']}", "recipe": packed.name, "context": a.window,
            "batch": a.batch, "windows": f"{n} windows (0-{n - 1}) of {a.window}, scored {CONTEXT}..{a.window - 1}",
            "dtype": "fp32", "kv": {k: v for k, v in kv.items() if k != "tensors"},
            "note": "simulated decode (TieredKVCache mode simulated, one forward per window) vs real decode mode "
                    "(token by token through TieredKVCache, the `moec eval --mode dec` path), same checkpoint",
            "dec": res["dec"], "sim": res["sim"], "max_abs_logit_diff": diff,
            "max_abs_logit": logits["dec"].abs().max().item(),
            "rel_diff_ppl": res["sim"]["ppl"] / res["dec"]["ppl"] - 1.0,
            "rel_diff_kld": res["sim"]["kld"] / max(res["dec"]["kld"], 1e-30) - 1.0, "peer": {}}
        records.append(rec)
        print({k: rec[k] for k in ("recipe", "max_abs_logit_diff", "rel_diff_ppl", "rel_diff_kld")},
              {m: round(res[m]["ppl"], 4) for m in res}, flush=True)
        write_json_atomic(out, records)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
