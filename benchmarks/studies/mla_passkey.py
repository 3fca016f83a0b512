"""Passkey retrieval on demo-mla with its fp16 latent cache (issue 35: the latent-cache target asks for passkey
"if fp16 scores >= 80% there"), by the KV-retrieval issue's protocol (moec/runtime/retrieval.py: seeded trials,
the needle at spread depths, greedy answer through the cache).

    python3 -m benchmarks.studies.mla_passkey --out benchmarks/results/mla_passkey_demo-mla.json [--lengths 1024 4096]

The haystack is prefilled through runtime/mla.MLACache (dynamic mode: the absorbed attention over the cached
latent rows), then the question and NEW_TOKENS greedy tokens; a trial passes when the key's digits appear in
the answer. The latency-free CPU path; the fp16 rows are what a compressed latent codec would be measured
against.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moec.calibrate.sources import load_tokenizer, resolve_model
from moec.runtime.kvcache import dense_cache
from moec.runtime.loader import load_model
from moec.runtime.retrieval import answer, build, plan, wilson


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    # bench_retrieval.py's defaults: needles start at token 64 or later, end 640 tokens before the question
    ap.add_argument("--lo", type=int, default=64)
    ap.add_argument("--guard", type=int, default=640)
    a = ap.parse_args()
    d = resolve_model("demo-mla")
    model, _ = load_model(d)
    tok = load_tokenizer(d)
    records = []
    for length in a.lengths:
        t0 = time.time()
        hits = []
        for trial in plan("passkey", a.trials, a.seed):
            hay, q, _ = build(tok, "passkey", trial, length, a.lo, a.guard)
            cache = dense_cache(model.args, 1, length + 32, dtype=torch.float16)
            with torch.no_grad():
                model(torch.tensor([hay]), cache, 0)
                ids = answer(model, cache, torch.tensor([q]), len(hay))[0]
            hits.append(str(trial["keys"][0]) in tok.decode(ids).replace(" ", ""))
        lo, hi = wilson(sum(hits), len(hits))
        records.append({"model": "demo-mla", "task": "passkey", "length": length, "trials": len(hits),
                        "cache": "fp16 latent (runtime/mla.MLACache)", "accuracy": sum(hits) / len(hits),
                        "wilson95": [lo, hi], "hits": hits, "seconds": round(time.time() - t0, 1)})
        print(f"passkey {length}: {sum(hits)}/{len(hits)} [{lo:.2f}, {hi:.2f}] ({time.time() - t0:.0f} s)", flush=True)
        a.out.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
