"""Retrieval through a compressed KV cache (issue 37): passkey and a multi-key needle read back from the
compressed history, cheap enough to run often.

Protocol (docs/benchmarks.md, "Retrieval"; the trials, the shared prefill and the intervals are
moec/runtime/retrieval.py). A trial is a haystack of exactly `length - 32` tokens: an
instruction, filler sentences and the needle — one 5-digit pass key (`passkey`), or the keys of two
(--needle-keys) named people of which one is asked (`needle`) — placed at token depths past the sinks and at least
`--guard` tokens before the end of the haystack, so every key sits in the compressed history of every
recipe compared (window ≤ guard − 64). Then the question (≤ 24 tokens) and 8 greedy tokens; success = the
asked key's digits appear in the answer.

Cost. The haystack's prefill (attention over fp16-rounded keys and values, as the caches' own prefills)
is computed once per trial, batched over trials, and its per-layer post-RoPE keys and values are handed
to each recipe's cache (`load_prefill`: the cache stores them as its own prefill would, encoding what
leaves the window); only the question chunk and the 8 decode steps run per recipe, through that recipe's
real dynamic cache (`mode: dec`: the cache `moec eval --mode dec` and `moec generate` use). The answers
equal a prefill through the recipe's own cache (head_dim-rotated caches round in their basis: logits
within ~1e-3), counted by `--check-prefill N`. CPU seconds are recorded per record.

Statistics: accuracy with its Wilson 95% interval; the paired difference to fp16 (same trials) with
Newcombe's hybrid-score interval for paired proportions (method 10). A task counts only where fp16 scores
≥ 80% (`counts`).

    python3 -m benchmarks.bench_retrieval --lengths 4096 --trials 20 \\
        --recipes kv-nuq2-rot-w512 kv-latent-layer-g4-r192 [--tasks passkey needle] [--batch 4]

Writes benchmarks/results/retrieval_<model>.json: one record per (task, length, recipe), replacing the
records of the same (task, length, recipe, trials, seed).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.benchutil import ROOT, cli
from moec.calibrate.catalog import find_recipe
from moec.calibrate.sources import load_tokenizer, resolve_model
from moec.cli.common import base_record, write_json_atomic
from moec.runtime.kvcache import FP16Cache
from moec.runtime.loader import kv_cache_factory, load_model
from moec.runtime.retrieval import (
    NAMES,
    NEW_TOKENS,
    RESERVE,
    TASKS,
    KeysValuesApart,
    PrefillRecorder,
    WorstTokensExact,
    answer,
    build,
    load_prefill,
    paired_diff,
    plan,
    wilson,
)


def label(name: str) -> str:
    """A recipe's name in records and pack directories: a recipe file's stem, else the name itself; a
    keys+values pair labelled part by part."""
    if "!" in name:
        spec, n = name.rsplit("!", 1)
        return f"{label(spec)}!{n}"
    if "~" in name:
        base, rest = name.split("~")
        high, layers = rest.rsplit(":", 1)
        return f"{label(base)}~{label(high)}:{layers}"
    if "+" in name:
        return "+".join(label(n) for n in name.split("+"))
    return Path(name).stem if name.endswith(".yaml") else name


def recipe_factory(name: str, model_name: str, work: Path, samples: int | None, seq_len: int):
    """(model, cache factory, kv_bits_32k, window) of a KV recipe, calibrated and packed once under `work`;
    NAME_K+NAME_V: the keys of NAME_K's codec with the values of NAME_V's (KeysValuesApart); BASE~HIGH:L1,L2:
    HIGH's codec on layers L1, L2, BASE's on the others (a per-layer bit allocation; BASE and HIGH may be K+V
    pairs); SPEC!N: SPEC with the N
    worst-reconstructed tokens of every block kept in fp16 (WorstTokensExact)."""
    from moec.runtime.kvtiered import tiered_cache_factory

    spec, exact = (name.rsplit("!", 1)[0], int(name.rsplit("!", 1)[1])) if "!" in name else (name, 0)
    if "~" not in spec and "+" not in spec and not exact:  # a plain recipe: the cache its checkpoint builds
        model, info = _packed(spec, model_name, work, samples, seq_len)
        factory = kv_cache_factory(info, model.args)
    else:
        model, info, codecs = _codecs(spec, model_name, work, samples, seq_len)
        if exact:
            codecs = [WorstTokensExact(c, exact, model.args.head_dim) for c in codecs]
        factory = tiered_cache_factory(info["kv"], codecs, use_kernel=False)
    bits = factory(model, 1, 256).bits_at(32768)  # arithmetic on the stored-byte formula: any max_len
    return model, factory, bits, info["kv"]["window"]


def _codecs(spec: str, model_name: str, work: Path, samples: int | None, seq_len: int):
    """(model, info, per-layer codecs) of a plain, K+V or per-layer-mixed recipe spec."""
    from moec.runtime.kvtiered import build_codecs

    def built(n):
        m, i = _packed(n, model_name, work, samples, seq_len)
        return m, i, build_codecs(i["kv"], i["kv_tensors"], m.args)

    if "~" in spec:  # BASE~HIGH:L1,L2,...: the layers listed take HIGH's codec, the others BASE's
        base_name, rest = spec.split("~")
        high_name, layers = rest.rsplit(":", 1)
        (model, info, base), (_, ih, high) = (_codecs(n, model_name, work, samples, seq_len)
                                              for n in (base_name, high_name))
        _same_tiers(spec, info["kv"], ih["kv"])
        chosen = {int(x) for x in layers.split(",")}
        return model, info, [h if i in chosen else b for i, (b, h) in enumerate(zip(base, high, strict=True))]
    if "+" in spec:
        (_, ik, keys), (model, info, values) = (built(n) for n in spec.split("+"))
        _same_tiers(spec, ik["kv"], info["kv"])
        try:
            return model, info, [KeysValuesApart(a, b) for a, b in zip(keys, values, strict=True)]
        except ValueError as e:  # the two recipes' head_dim rotations differ
            raise SystemExit(f"{spec}: {e}") from None
    return built(spec)


def _prefill(base, hay: torch.Tensor, a, task: str, length: int, first: int) -> PrefillRecorder:
    """The fp16 prefill of one batch of trials, computed or, with --prefill-cache, read back from the file an
    earlier run with the same model, task, length, seed, trials, batch and needle placement wrote (the keys
    and values exactly as recorded, fp32): a screen of recipes then pays only their own question and decode.
    The file name holds every setting the haystack depends on; the haystack's ids are stored and checked."""
    if a.prefill_cache is None:
        rec = PrefillRecorder()
        base(hay, rec, 0)
        return rec
    from safetensors.torch import load_file, save_file

    key = (f"{a.model}-{task}-{length}-seed{a.seed}-of{a.trials}-b{a.batch}-g{a.guard}-s{a.sinks_guard}"
           f"-k{a.needle_keys if task == 'needle' else 0}-{first}.safetensors")
    f = a.prefill_cache / key
    if f.is_file():
        saved = load_file(f)
        if torch.equal(saved["hay"], hay):
            rec = PrefillRecorder()
            n = sum(1 for name in saved if name.startswith("k."))
            rec.k, rec.v = ({i: saved[f"{kind}.{i}"] for i in range(n)} for kind in "kv")
            a.prefills_read += 1
            return rec
    rec = PrefillRecorder()
    base(hay, rec, 0)
    a.prefill_cache.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    save_file({"hay": hay.contiguous()} | {f"k.{i}": t.contiguous() for i, t in rec.k.items()}
              | {f"v.{i}": t.contiguous() for i, t in rec.v.items()}, str(tmp))
    tmp.replace(f)
    return rec


def _same_tiers(name: str, a: dict, b: dict) -> None:
    """Two recipes combined in one cache must share window, sinks, block and where keys are encoded."""
    same = ("window", "sinks", "block", "rope")
    get = lambda kv, k: kv.get(k, "post" if k == "rope" else None)  # noqa: E731  a codec without `rope`: post
    if any(get(a, k) != get(b, k) for k in same):
        raise SystemExit(f"{name}: the two recipes differ in {same}")


def _packed(name: str, model_name: str, work: Path, samples: int | None, seq_len: int):
    calib, packed = work / model_name / f"{label(name)}-calib", work / model_name / label(name)
    if not (packed / "moec.json").is_file():
        sizes = [] if samples is None else ["--samples", samples, "--seq-len", seq_len]  # None: the recipe's own
        cli("calibrate", model_name, "--recipe", find_recipe(name), "--data", "ptb", "--split", "train", *sizes,
            "-o", calib)
        cli("pack", model_name, calib, "-o", packed)
    return load_model(packed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--lengths", default="4096", help="comma-separated lengths in tokens (haystack + 32)")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipes", nargs="*", default=["kv-nuq2-rot-w512"], help="KV recipes, names or files (fp16 "
                    "always runs); K_RECIPE+V_RECIPE: the keys of one with the values of the other")
    ap.add_argument("--needle-keys", type=int, default=2, choices=range(2, len(NAMES) + 1),
                    help="keys in a needle trial (SmolLM2-135M's fp16 recall: 2 keys ~85%%, 3-4 keys ~75%% at 1k)")
    ap.add_argument("--batch", type=int, default=4, help="trials per prefill / decode batch")
    ap.add_argument("--prefill-cache", type=Path, help="keep each batch's fp16 prefill here and reuse it in later "
                    "runs (~190 MB per trial at 4096 tokens for SmolLM2-135M)")
    ap.add_argument("--guard", type=int, default=640, help="needles end at least this many tokens before the "
                    "question (every recipe's fp16 window must be shorter)")
    ap.add_argument("--sinks-guard", type=int, default=64, help="needles start at or after this token")
    ap.add_argument("--samples", type=int, default=None, help="calibration windows (PTB train); default: the "
                    "recipe's calibration section (or moec calibrate's default)")
    ap.add_argument("--seq-len", type=int, default=512, help="with --samples: tokens per calibration window")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moec-kv-bench"))
    ap.add_argument("--check-prefill", type=int, default=0, help="also prefill the first N trials through the "
                    "first recipe's own cache and count the answers that differ from the shared prefill's (0)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    a.prefills_read = 0  # batches whose prefill came from --prefill-cache (recorded: their CPU is not counted)
    torch.set_grad_enabled(False)
    out = a.out or ROOT / "benchmarks" / "results" / f"retrieval_{a.model}.json"
    model_dir = resolve_model(a.model)
    tok = load_tokenizer(model_dir)
    lengths = [int(x) for x in a.lengths.split(",")]
    cpu0 = time.process_time()

    base, _ = load_model(model_dir)
    recipes = {}
    for name in a.recipes:
        m, factory, bits, window = recipe_factory(name, a.model, a.work, a.samples, a.seq_len)
        if window + 64 > a.guard:
            raise SystemExit(f"{name}: window {window} + 64 exceeds --guard {a.guard}: its needles would be fp16")
        recipes[name] = (m, factory, bits, window)
    calib_cpu = time.process_time() - cpu0

    records = json.loads(out.read_text()) if out.exists() else []
    for task in a.tasks:
        trials = plan(task, a.trials, a.seed, a.needle_keys)
        for length in lengths:
            if length > base.args.max_seq_len:
                raise SystemExit(f"--lengths {length} exceeds {a.model}'s {base.args.max_seq_len} tokens")
            built = [build(tok, task, t, length, a.sinks_guard, a.guard) for t in trials]
            ok = {name: [] for name in ["fp16", *recipes]}
            cpu = {name: 0.0 for name in ["fp16", *recipes]}
            cpu["prefill"] = 0.0
            answers = {name: [] for name in ok}
            for i in range(0, len(built), a.batch):
                chunk, tr = built[i: i + a.batch], trials[i: i + a.batch]
                hay = torch.tensor([c[0] for c in chunk])
                n = hay.shape[1]
                c0 = time.process_time()
                rec = _prefill(base, hay, a, task, length, i)
                cpu["prefill"] += time.process_time() - c0
                for name in ok:
                    c0 = time.process_time()
                    if name == "fp16":
                        m = base
                        cache = FP16Cache(m.args, len(chunk), length, dtype=torch.float16)
                    else:
                        m, factory = recipes[name][0], recipes[name][1]
                        cache = factory(m, len(chunk), length)
                    load_prefill(cache, rec, m.args.n_layers, m.args.n_heads)
                    qlen = max(len(c[1]) for c in chunk)
                    if any(len(c[1]) != qlen for c in chunk):  # one chunk per row length: run rows apart
                        raise AssertionError("questions of one task must tokenize to one length")
                    toks = answer(m, cache, torch.tensor([c[1] for c in chunk]), n)
                    for t, ids in zip(tr, toks, strict=True):
                        text = tok.decode(ids).replace(" ", "")
                        ok[name].append(str(t["keys"][t["asked"]]) in text)
                        answers[name].append(ids)
                    cpu[name] += time.process_time() - c0
                print(f"{task} {length}: {i + len(chunk)}/{len(built)} trials; "
                      + ", ".join(f"{k} {sum(v)}" for k, v in ok.items()), flush=True)
            mismatch = {}
            for name in list(recipes)[: 1 if a.check_prefill else 0]:
                mismatch[name] = _check_prefill(recipes[name], built[: a.check_prefill], answers[name], length)
            base_ok = ok["fp16"]
            for name, hits in ok.items():
                k = sum(hits)
                lo, hi = wilson(k, len(hits))
                rec_ = base_record("retrieval", "cpu") | {
                    "model": a.model, "task": task, "recipe": label(name), "context": length, "trials": len(hits),
                    "seed": a.seed, "mode": "dec",
                    "needle_keys": a.needle_keys if task == "needle" else None, "accuracy": 100.0 * k / len(hits),
                    "ci95": [100 * lo, 100 * hi], "hits": [int(h) for h in hits],
                    "window": None if name == "fp16" else recipes[name][3],
                    "kv_bits_32k": 16.0 if name == "fp16" else recipes[name][2],
                    "counts": 100.0 * sum(base_ok) / len(base_ok) >= 80.0,
                    "cpu_seconds": round(cpu[name] + (cpu["prefill"] if name == "fp16" else 0.0), 1),
                    "protocol": {"haystack": length - RESERVE, "guard": a.guard, "sinks_guard": a.sinks_guard,
                                 "new_tokens": NEW_TOKENS, "question": "one chunk through the cache",
                                 "prefill": "attention over fp16-rounded K/V, shared by every recipe (the fp16 "
                                            "row's cpu_seconds include it)",
                                 "prefill_batches_read_from_cache": a.prefills_read},
                }
                if name != "fp16":
                    d, dlo, dhi = paired_diff(base_ok, hits)
                    rec_["diff_fp16"] = {"points": 100 * d, "ci95": [100 * dlo, 100 * dhi]}
                if name in mismatch:
                    rec_["prefill_check"] = mismatch[name]
                records = [r for r in records if not (r.get("task") == task and r.get("recipe") == label(name) and
                                                      r.get("context") == length and r.get("trials") == len(hits)
                                                      and r.get("seed") == a.seed)] + [rec_]
                print(json.dumps({k: rec_.get(k) for k in ("task", "recipe", "context", "trials", "accuracy",
                                                           "ci95", "diff_fp16", "cpu_seconds")}), flush=True)
            write_json_atomic(out, records)
    total = time.process_time() - cpu0
    print(f"cpu-hours: {total / 3600:.3f} (calibration {calib_cpu / 3600:.3f}); wrote {out}")


def _check_prefill(recipe, built, answers, length: int) -> dict:
    """The shortcut against the cache's own prefill on the first trials: a fresh cache prefilled by the model
    through its own attention (then the window's ageing), then the same question and decode.
    How many answers differ from the shared-prefill path's (expected 0)."""
    m, factory = recipe[0], recipe[1]
    diff = 0
    for (hay, q, _), want in zip(built, answers, strict=False):
        cache = factory(m, 1, length)
        m(torch.tensor([hay]), cache, 0)
        diff += answer(m, cache, torch.tensor([q]), len(hay))[0] != want
    return {"trials": len(built), "answers_differ": diff}


if __name__ == "__main__":
    main()
