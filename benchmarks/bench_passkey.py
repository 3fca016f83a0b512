"""Passkey retrieval through a compressed KV cache (issue 15): can the model still read back a 5-digit key
buried in filler text once the key's tokens have left the fp16 window?

Each trial: an instruction, filler sentences with "The pass key is KEY. Remember it. KEY is the pass key."
inserted at a depth of 10%..90% of the filler (the nine depths in turn), then "What is the pass key? The
pass key is", `--context` tokens in all. The prompt is prefilled (exact attention, as a server prefills),
its K/V enter the cache, whose tiered policy encodes everything but the sinks and the window into the
recipe's codec; then greedy decoding of 8 tokens attends through the compressed cache. A trial succeeds
when the key's digits appear in the decoded text. Keys and depths come from --seed, so every recipe sees
the same trials.

    python3 -m benchmarks.bench_passkey --model smollm2-135m --lengths 2048,4096,8192 --trials 18   (fp16)
    python3 -m benchmarks.bench_passkey --model smollm2-135m --lengths 4096 --trials 108 \\
        --recipes moec/recipes/kv-nuq2-rot.yaml moec/recipes/ablations/kv-nuq2-outlier.yaml ...

Writes benchmarks/results/passkey_<model>.json: one record per (recipe, context) with `recipe` (`fp16` for
the uncompressed cache), `context`, `trials`, `accuracy` (percent), accuracy per depth, and the cache's
kv_bits_32k. Calibration and packing as bench_kv_quality.py does them (PTB train, cached under --work).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from benchmarks.benchutil import ROOT, cli
from moec.calibrate.sources import load_tokenizer, resolve_model
from moec.cli.common import base_record, write_json_atomic
from moec.runtime.generate import generate
from moec.runtime.kvtiered import build_codecs, tiered_cache_factory
from moec.runtime.loader import load_model
from moec.runtime.perplexity import fp16_cache

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
DEPTHS = tuple(d / 10 for d in range(1, 10))


def make_trial(tok, context: int, key: int, depth: float) -> list[int]:
    """Token ids of one prompt of about `context` tokens (whole filler sentences) with the key at `depth`."""
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    fixed = len(enc(INTRO)) + len(enc(NEEDLE.format(key=key))) + len(enc(QUESTION))
    per = len(enc(FILLER * 8)) / 8
    n = max(2, int((context - fixed) / per))
    before = round(n * depth)
    text = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (n - before) + QUESTION
    return enc(text)[:context]


def trials(n: int, seed: int) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    return [(rng.randrange(10000, 100000), DEPTHS[i % len(DEPTHS)]) for i in range(n)]


def run(model, tok, factory, context: int, plan: list[tuple[int, float]]) -> dict:
    hits = {d: [0, 0] for d in DEPTHS}
    for key, depth in plan:
        ids = make_trial(tok, context, key, depth)
        out = generate(model, ids, 8, cache_factory=factory)
        ok = str(key) in tok.decode(out).replace(" ", "")
        hits[depth][0] += ok
        hits[depth][1] += 1
    n_ok = sum(h[0] for h in hits.values())
    return {"trials": len(plan), "accuracy": 100.0 * n_ok / len(plan),
            "accuracy_by_depth": {f"{d:.1f}": 100.0 * h[0] / h[1] for d, h in hits.items() if h[1]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="4096", help="comma-separated prompt lengths in tokens")
    ap.add_argument("--trials", type=int, default=108)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipes", nargs="*", default=[], help="KV recipes (fp16 is always run)")
    ap.add_argument("--no-fp16", action="store_true", help="skip the fp16 cache (already measured)")
    ap.add_argument("--samples", type=int, default=16, help="calibration windows (PTB train)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--work", type=Path, default=Path("/tmp/moec-kv-bench"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    out = a.out or ROOT / "benchmarks" / "results" / f"passkey_{a.model}.json"
    records = json.loads(out.read_text()) if out.exists() else []
    model_dir = resolve_model(a.model)
    tok = load_tokenizer(model_dir)
    lengths = [int(x) for x in a.lengths.split(",")]
    plan = trials(a.trials, a.seed)

    configs = [] if a.no_fp16 else [("fp16", None)]
    configs += [(Path(r).stem, Path(r)) for r in a.recipes]
    for name, recipe in configs:
        if recipe is None:
            model, _ = load_model(model_dir)
            factory, bits = fp16_cache, 16.0
        else:
            calib, packed = a.work / a.model / f"{name}-calib", a.work / a.model / name
            cli("calibrate", a.model, "--recipe", recipe, "--data", "ptb", "--split", "train", "--samples",
                a.samples, "--seq-len", a.seq_len, "-o", calib)
            cli("pack", a.model, calib, "-o", packed)
            model, info = load_model(packed)
            codecs = build_codecs(info["kv"], info["kv_tensors"], model.args)
            factory = tiered_cache_factory(info["kv"], codecs)
            bits = factory(model, 1, 32768 + 8).bits_at(32768) if 32768 + 8 <= model.args.max_seq_len else None
        for context in lengths:
            t0 = time.time()
            res = run(model, tok, factory, context, plan)
            rec = base_record("passkey", "cpu") | {
                "model": a.model, "recipe": name, "context": context, "seed": a.seed, "kv_bits_32k": bits,
                "protocol": "prefill exact, greedy 8 tokens through the cache; success = key digits in the output",
                **res, "seconds": round(time.time() - t0)}
            records = [r for r in records if not (r.get("recipe") == name and r.get("context") == context
                                                  and r.get("trials") == rec["trials"])] + [rec]
            write_json_atomic(out, records)
            print(json.dumps({k: rec[k] for k in ("recipe", "context", "trials", "accuracy", "seconds")}), flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
