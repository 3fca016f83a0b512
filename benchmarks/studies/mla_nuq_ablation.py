"""Ablations of the mla-nuq latent codec (issue 35) on demo-mla, with the shipped codec itself.

    python3 -m benchmarks.studies.mla_nuq_ablation --out benchmarks/results/mla_nuq_ablation_demo-mla.json

Each configuration is runtime/mla_nuq.MLANUQCache in simulated mode (one forward per window giving each query the
view dynamic decode gives it; tests/runtime/test_mla_nuq.py checks the two agree), on PTB test (8 x 1024 and
2 x 4096, positions 32..), against the uncompressed latent (runtime/mla.MLACache, fp32 rows). Levels are fitted as `moec
calibrate` fits them (calibrate/mla_nuq.fit) on 16 x 1024 PTB train tokens. Rows:
  kv-mla-nuq2         fitted levels, window 128, 4 sinks (the recipe)
  gaussian levels     the unit Gaussian's Lloyd-Max levels instead of fitted ones
  window 32 / 0       a shorter fp16 window; 0 with no sinks: every full block of 32 tokens from the codes
  unrotated           no Hadamard rotation (identity R; levels refitted on the unrotated, rms-normalized rows)
bits: KV bits per latent number at 32k for demo-mla's 128 + 32 (MLANUQCache.bits_at).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.studies.mla_latent_screen import ppl
from moec.runtime.mla import MLACache
from moec.runtime.mla_nuq import LatentRowCodec, MLANUQCache


def unrotated(codec: LatentRowCodec, rows: torch.Tensor) -> LatentRowCodec:
    """The same codec with R = I and levels refitted on the unrotated rows [N, L]."""
    from moec.calibrate.mla_nuq import fit_levels

    out = LatentRowCodec(codec.r, codec.rp, codec.signs["c"], codec.signs["rope"], codec.levels[0], codec.levels[1])
    out.R, out.Rc, out.Rr = torch.eye(codec.L), torch.eye(codec.r), torch.eye(codec.rp)
    y = rows.half().float()
    lev = []
    for sl in (slice(0, codec.r), slice(codec.r, codec.L)):
        p = y[:, sl]
        lev.append(fit_levels(p / p.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-8)))
    out.levels = torch.stack(lev)
    out._mid = (out.levels[:, 1:] + out.levels[:, :-1]) / 2
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    from moec.calibrate.data import load_text
    from moec.calibrate.mla_nuq import LatentSampler, fit
    from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
    from moec.codecs.mla_nuq import MLANUQConfig
    from moec.runtime.loader import load_model
    from moec.runtime.mla_nuq import build_codecs
    from moec.runtime.perplexity import make_windows

    t0 = time.time()
    d = resolve_model("demo-mla")
    model, _ = load_model(d)
    args = model.args
    tok = load_tokenizer(d)
    train = make_windows(tokenize(tok, load_text("ptb", "train")), 1024, 16)
    sampler = LatentSampler(seed=0)
    with torch.no_grad():
        for w in train:
            model(w[None], observer=sampler)
    codecs = {}
    for levels in ("fitted", "gaussian"):
        tensors, _ = fit(args, MLANUQConfig(codec="mla-nuq", levels=levels), sampler)
        codecs[levels] = build_codecs({}, tensors, args)
    codecs["unrotated"] = [unrotated(c, sampler.get(i)) for i, c in enumerate(codecs["fitted"])]
    print(f"calibrated in {time.time() - t0:.0f} s", flush=True)

    test = tokenize(tok, load_text("ptb", "test"))
    sets = {"8x1024": make_windows(test, 1024, 8), "2x4096": make_windows(test, 4096, 2)}
    base = {k: ppl(model, w, lambda n: MLACache(args, 1, n, dtype=torch.float32, mode="simulated"))
            for k, w in sets.items()}
    configs = [("kv-mla-nuq2", "fitted", 128, 4), ("gaussian levels", "gaussian", 128, 4),
               ("window 32", "fitted", 32, 4), ("window 0, no sinks", "fitted", 0, 0),
               ("unrotated", "unrotated", 128, 4)]
    records = []
    for name, which, window, sinks in configs:
        def make(n, which=which, window=window, sinks=sinks):
            return MLANUQCache(args, 1, n, codecs[which], window=window, sinks=sinks, block=32, mode="simulated")

        rec = {"config": name, "codecs": which, "window": window, "sinks": sinks,
               "bits_32k": make(64).bits_at(32768)}
        for k, w in sets.items():
            p = ppl(model, w, make)
            rec[k] = {"ppl": p, "ppl_fp16": base[k], "delta_pct": 100 * (p / base[k] - 1)}
        records.append(rec)
        print(f"{name}: bits@32k {rec['bits_32k']:.3f}, " + ", ".join(f"{k} {rec[k]['delta_pct']:+.2f}%" for k in sets),
              f"({time.time() - t0:.0f} s)", flush=True)
        a.out.write_text(json.dumps({"model": "demo-mla", "calibration": "PTB train, 16 x 1024",
                                     "baseline": base, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
