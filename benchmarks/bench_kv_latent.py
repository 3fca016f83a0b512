"""Latent KV caches (issue 6): frontier of Δppl against effective KV bits for the cross-head latent
(latent-head, seed 000) and the cross-layer shared latent (latent-layer, seed 001), over ranks, latent
bit widths, outlier fractions and pre- vs post-RoPE keys.

Protocol (docs/benchmarks.md): PTB test, windows of W tokens (first --max-windows), positions 32..W−1
scored, fp32 on the CPU, against the same model with an fp16 KV cache (FP16Cache), decoded the same way.

Evaluation mode `chunk` (default): after the 32-token prefill, each window is fed in chunks of
`window` (128) tokens through the compressed cache; LatentKVCache gives every query of a chunk its own
decode-mode view (the blocks it would see compressed, fp16 for the rest; moec/runtime/latent.py),
so this equals token-by-token decode up to float summation order, at the cost of ~8 forwards per window.
`--validate N` decodes the first N windows token by token (`dec`) for the first config too and
records both, so the equality is measured, not assumed. `--mode dec` decodes everything token by token.

Calibration: PTB train (--samples × --seq-len tokens, seed 0), keys pre- and post-RoPE and values
captured once (moec/calibrate/latent.py LatentSampler); each config is then fitted from those
samples with the same functions `moec calibrate` uses. `--recipes` additionally runs recipe files end
to end through the CLI (calibrate → pack → load the packed checkpoint's cache) and evaluates them
the same way.

    python3 -m benchmarks.bench_kv_latent --model smollm2-135m --grid smollm2 --recipes moec/recipes/kv-latent-*.yaml

Writes benchmarks/results/kv_latent_<model>.json (a list of records, docs/benchmarks.md fields; kv_bits at
the evaluated context for the evaluation batch, kv_bits_32k projected by the same stored-byte formula).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.benchutil import ROOT, cli
from moec.calibrate.capture import run_layers
from moec.calibrate.data import load_text, sample_windows
from moec.calibrate.latent import LatentSampler, fit_latent_tensors
from moec.calibrate.pack_kv import kv_manifest, kv_view
from moec.calibrate.recipe import Recipe
from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
from moec.cli.common import base_record, write_json_atomic
from moec.codecs.latent import LatentConfig, LatentKVConfig
from moec.runtime.hf_layout import HFCheckpoint
from moec.runtime.latent import latent_cache_factory
from moec.runtime.loader import kv_cache_factory, load_model
from moec.runtime.perplexity import CONTEXT, Totals, fp16_cache, make_windows

# (codec, rope, bits, rank_k, rank_v, group_layers, outlier_frac); ranks are multiples of 8
GRIDS = {
    "smollm2": [  # 30 layers, 3 KV heads × head_dim 64: 192 dims per layer; most telling configs first
        ("latent-head", "post", 4, 32, 64, 1, 0.005),
        ("latent-layer", "post", 4, 48, 48, 4, 0.005),
        ("latent-head", "pre", 4, 32, 64, 1, 0.005),
        ("latent-head", "post", 4, 64, 128, 1, 0.005),
        ("latent-head", "post", 2, 64, 128, 1, 0.005),
        ("latent-head", "post", 4, 32, 64, 1, 0.0),
        ("latent-head", "post", 16, 32, 64, 1, 0.005),
        ("latent-head", "post", 4, 96, 160, 1, 0.005),
        ("latent-head", "pre", 4, 64, 128, 1, 0.005),
        ("latent-layer", "post", 16, 48, 48, 4, 0.005),
        ("latent-layer", "pre", 4, 48, 48, 4, 0.005),
        ("latent-layer", "post", 4, 192, 384, 4, 0.005),
        ("latent-layer", "post", 4, 96, 192, 2, 0.005),
        ("latent-head", "post", 3, 64, 128, 1, 0.005),
        ("latent-head", "post", 2, 96, 160, 1, 0.005),
        ("latent-layer", "post", 4, 64, 128, 2, 0.005),
        ("latent-head", "post", 2, 32, 64, 1, 0.005),
    ],
    "smollm2-pre": [  # the cross-layer configs of the frontier with pre-RoPE keys, and sub-1.25-bit ones
        ("latent-layer", "pre", 4, 64, 128, 2, 0.005),
        ("latent-layer", "pre", 4, 192, 384, 4, 0.005),
        ("latent-layer", "pre", 4, 96, 192, 2, 0.005),
        ("latent-layer", "pre", 4, 96, 96, 4, 0.005),
        ("latent-head", "pre", 2, 32, 64, 1, 0.005),
        ("latent-head", "pre", 4, 32, 64, 1, 0.0),
    ],
    "demo-moe": [  # 4 layers, 2 KV heads × head_dim 32: 64 dims per layer
        ("latent-head", "post", 4, 16, 32, 1, 0.005),
        ("latent-head", "pre", 4, 16, 32, 1, 0.005),
        ("latent-head", "post", 16, 16, 32, 1, 0.005),
        ("latent-head", "post", 2, 16, 32, 1, 0.005),
        ("latent-head", "post", 4, 16, 32, 1, 0.0),
        ("latent-head", "post", 4, 32, 48, 1, 0.005),
        ("latent-head", "pre", 4, 32, 48, 1, 0.005),
        ("latent-head", "post", 3, 32, 48, 1, 0.005),
        ("latent-head", "post", 2, 32, 48, 1, 0.005),
        ("latent-layer", "post", 4, 16, 16, 4, 0.005),
        ("latent-layer", "pre", 4, 16, 16, 4, 0.005),
        ("latent-layer", "post", 16, 16, 16, 4, 0.005),
        ("latent-layer", "post", 4, 64, 96, 4, 0.005),
        ("latent-layer", "post", 4, 32, 64, 2, 0.005),
    ],
}

@torch.no_grad()
def run_windows(model, windows: torch.Tensor, factory, batch: int, chunk: int | None):
    """Per batch of windows: (logits [B, W-CONTEXT, V] at the scored positions, targets, cache).
    chunk None: token by token after the prefill (decode mode); else chunks of `chunk` tokens."""
    for s in range(0, windows.shape[0], batch):
        x = windows[s : s + batch]
        B, W = x.shape
        cache = factory(model, B, W)
        out = [model(x[:, :CONTEXT], cache, 0)[:, -1:]]
        step = chunk or 1
        for t in range(CONTEXT, W - 1, step):
            n = min(step, W - 1 - t)
            out.append(model(x[:, t : t + n], cache, t))
        yield torch.cat(out, 1), x[:, CONTEXT:], cache


def score(model, windows, factory, base, batch, chunk):
    tot, bits, cache = Totals(), [], None
    for (lg, tg, cache), blg in zip(run_windows(model, windows, factory, batch, chunk), base, strict=True):
        tot.add(lg, tg, blg)
        bits.append(cache.bits_per_element())
    r = tot.result(True)
    return r, sum(bits) / len(bits), cache.bits_at(32768)


def kv_config(codec, rope, bits, rank_k, rank_v, group, frac, window=128) -> LatentKVConfig:
    return LatentKVConfig(codec=codec, bits=bits, window=window, sinks=4, block=32, rope=rope,
                    latent=LatentConfig(rank_k=rank_k, rank_v=rank_v, group_layers=group, outlier_frac=frac))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo-moe")
    ap.add_argument("--grid", choices=sorted(GRIDS), default=None, help="default: by model")
    ap.add_argument("--only", type=int, nargs="*", default=None, help="indices into the grid")
    ap.add_argument("--recipes", nargs="*", default=[])
    ap.add_argument("--max-windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16, help="calibration windows (PTB train)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--mode", choices=("chunk", "dec"), default="chunk")
    ap.add_argument("--validate", type=int, default=0, help="windows also decoded token by token (first config)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moec-kv-latent"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--append", action="store_true", help="keep the records already in --out")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    out = a.out or ROOT / "benchmarks" / "results" / f"kv_latent_{a.model}.json"
    grid = GRIDS[a.grid or ("smollm2" if "smollm2" in a.model else "demo-moe")]
    if a.only is not None:
        grid = [grid[i] for i in a.only]
    chunk = 128 if a.mode == "chunk" else None

    model_dir = resolve_model(a.model)
    tok = load_tokenizer(model_dir)
    windows = make_windows(tokenize(tok, load_text("ptb", "test")), a.window, a.max_windows)
    n = windows.shape[0]
    wdesc = f"{n} windows (0-{n - 1}) of {a.window}, scored {CONTEXT}..{a.window - 1}"
    model, info = load_model(model_dir)
    t0 = time.time()
    base = [lg for lg, _, _ in run_windows(model, windows, fp16_cache, a.batch, chunk)]
    tot = Totals()
    for lg, x in zip(base, windows.split(a.batch), strict=True):
        tot.add(lg, x[:, CONTEXT:], lg)
    ppl_base = tot.result(True)["ppl"]
    print(f"baseline (fp16 cache, {a.mode}) ppl {ppl_base:.4f} in {time.time() - t0:.0f}s", flush=True)

    common = {"model": a.model, "context": a.window, "batch": a.batch, "windows": wdesc, "mode": a.mode,
              "dtype": "fp32", "data": "ptb", "split": "test", "w_bits": info["w_bits"], "ppl_base": ppl_base,
              "calibration": f"ptb train, {a.samples} x {a.seq_len} tokens, seed 0",
              "peer": {"kv_quality": f"benchmarks/results/kv_quality_{a.model}.json (kivi, nuq-outlier)"}}
    records = json.loads(out.read_text()) if a.append and out.is_file() else []
    records.append(base_record("kv_latent", "cpu") | common | {
        "method": "fp16", "recipe": "fp16", "kv_codec": "fp16", "ppl": ppl_base, "delta_pct": 0.0, "kld": 0.0,
        "top1": 1.0, "kv_bits": 16.0, "kv_bits_32k": 16.0})

    def record(name, kv: dict, factory, t_start, extra=None, m=model):
        r, bits, bits32 = score(m, windows, factory, base, a.batch, chunk)
        lat = kv.get("latent", kv)  # a packed manifest nests the latent settings (schema 2), a grid config not
        rec = base_record("kv_latent", "cpu") | common | {
            "method": f"{kv['codec']}-{kv['rope']}-b{kv['bits']}-k{lat['rank_k']}v{lat['rank_v']}"
                      f"-G{lat['group_layers']}-o{lat['outlier_frac']}",
            "recipe": name, "kv_codec": kv["codec"], "kv": {k: v for k, v in kv.items() if k != "tensors"},
            "ppl": r["ppl"], "delta_pct": 100.0 * (r["ppl"] / ppl_base - 1.0), "kld": r["kld"], "top1": r["top1"],
            "kv_bits": bits, "kv_bits_32k": bits32, "compression_32k": 16.0 / bits32} | (extra or {})
        rec["seconds"] = round(time.time() - t_start)
        records.append(rec)
        print(json.dumps({k: rec[k] for k in ("method", "ppl", "delta_pct", "kld", "top1", "kv_bits", "kv_bits_32k",
                                                "seconds")}), flush=True)
        write_json_atomic(out, records)
        return rec

    if grid:
        t0 = time.time()
        ckpt = HFCheckpoint(model_dir)
        ids = tokenize(tok, load_text("ptb", "train"))
        sampler = LatentSampler(("k_pre", "k", "v"), max_tokens=a.samples * a.seq_len)
        run_layers(ckpt.args, ckpt.global_state(), ckpt.layer_state, sample_windows(ids, a.samples, a.seq_len, 0),
                   [sampler])
        print(f"captured K/V in {time.time() - t0:.0f}s", flush=True)
    for j, cfg in enumerate(grid):
        t0 = time.time()
        try:
            kvc = kv_config(*cfg)
            tensors, fit_report = fit_latent_tensors(model.args, kvc, sampler)
            grid_recipe = Recipe(name="grid", kv=kvc)
            section = kv_view(grid_recipe, kv_manifest(grid_recipe, model.args))
            factory = latent_cache_factory(section, tensors, model.args)
            extra = {"fit": {k: [g[k] for g in fit_report["groups"]] for k in ("k", "v")}}
            if j == 0 and a.validate and chunk is not None:  # chunked vs token-by-token decode, same windows
                tv = Totals()
                for (lg, tg, _), blg in zip(run_windows(model, windows[: a.validate], factory, a.batch, None),
                                            base, strict=False):
                    tv.add(lg, tg, blg[: lg.shape[0]])
                tc = Totals()
                for (lg, tg, _), blg in zip(run_windows(model, windows[: a.validate], factory, a.batch, chunk),
                                            base, strict=False):
                    tc.add(lg, tg, blg[: lg.shape[0]])
                rv, rc = tv.result(True), tc.result(True)
                extra["validation"] = {"windows": a.validate, "ppl_dec": rv["ppl"], "ppl_chunk": rc["ppl"],
                                       "rel_diff": abs(rv["ppl"] / rc["ppl"] - 1), "kld_dec": rv["kld"],
                                       "kld_chunk": rc["kld"]}
                print("validation", json.dumps(extra["validation"]), flush=True)
            record("grid", section, factory, t0, extra)
        except Exception as e:  # record and go on: one bad config must not lose the sweep
            records.append(base_record("kv_latent", "cpu") | common | {"method": str(cfg), "error": repr(e)})
            print(f"config {cfg} failed: {e!r}", flush=True)
            write_json_atomic(out, records)

    for recipe in a.recipes:
        name = Path(recipe).stem
        calib, packed = a.work / a.model / f"{name}-calib", a.work / a.model / name
        t0 = time.time()
        cli("calibrate", a.model, "--recipe", recipe, "--data", "ptb", "--split", "train", "--samples", a.samples,
            "--seq-len", a.seq_len, "-o", calib)
        cli("pack", a.model, calib, "-o", packed)
        pmodel, pinfo = load_model(packed)
        assert pmodel.args == model.args
        record(name, pinfo["kv"], kv_cache_factory(pinfo, model.args), t0, {"pipeline": "moec calibrate -> pack"},
               pmodel)
    write_json_atomic(out, records)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
