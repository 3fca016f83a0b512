"""What e4m3 tensor-core products would cost the mla-nuq latent cache in quality (issue 35), on demo-mla.

    python3 -m benchmarks.studies.mla_nuq_fp8_products --out benchmarks/results/mla_nuq_fp8_products_demo-mla.json

Why: the 2-bit latent kernel is bound by its dequant, not its bytes (docs/results.md, "The MLA latent at 2 bits").
With fp8 operands a code becomes its level by one byte permute of a 4-entry e4m3 table held in one register (prmt:
four codes an instruction, nibble-aligned by one mask of the packed word), where fp16 operands need a permute per
two codes plus the selector arithmetic; the products then run on e4m3 tensor cores (mma k = 32). That design rounds
three things, simulated here on the history rows only (the fp16 window and sinks stay as they are):
  q8      the rotated query, e4m3 with one scale per head and query (amax -> 448), for the history scores;
  lv8     the 4 levels per part, e4m3 after one scale per part chosen so the 4 round with the least relative error;
  p8      p·s_c for the value product, e4m3 with one scale per head and query row (amax -> 448).
Rows: kv-mla-nuq2 as shipped, then q8 + lv8 (scores in fp8), then all three; each against the uncompressed latent
(runtime/mla.MLACache, fp32 rows) on PTB test 8 x 1024 and 2 x 4096 (perplexity, and the mean KL of each position's
next-token distribution to the uncompressed one's). Levels fitted as `moec calibrate` fits them (16 x 1024 PTB
train). CPU, fp32 otherwise; about 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from moec.runtime.mla import MLACache
from moec.runtime.mla_nuq import MLANUQCache

E4M3_MAX = 448.0


def e4m3(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """x rounded to e4m3 after a scale that maps its amax (over `dim`, or all of x) to 448, then unscaled."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim, keepdim=True)
    k = E4M3_MAX / amax.clamp_min(1e-30)
    return (x * k).to(torch.float8_e4m3fn).float() / k


def e4m3_levels(levels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The 4 levels of each part [2, 4] rounded to e4m3 after the scale in [1, 2) (1/1024 steps) that rounds them
    with the least worst relative error: (rounded levels, that error)."""
    out, worst = torch.empty_like(levels), 0.0
    for i, lv in enumerate(levels.float()):
        best = None
        for j in range(1024):
            k = 1.0 + j / 1024
            r = (lv * k).to(torch.float8_e4m3fn).float() / k
            err = ((r - lv).abs() / lv.abs().clamp_min(1e-30)).max().item()
            if best is None or err < best[0]:
                best = (err, r)
        out[i], worst = best[1], max(worst, best[0])
    return out, worst


class FP8ProductsCache(MLANUQCache):
    """MLANUQCache in simulated mode whose history products round their operands as an e4m3 kernel would."""

    def __init__(self, *a, q8: bool = True, lv8: bool = True, p8: bool = False, **kw):
        super().__init__(*a, **kw)
        self.q8, self.lv8, self.p8 = q8, lv8, p8

    def _attend_simulated(self, layer: int, qr: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The shipped simulated step (its output, and the codes and lengths dynamic decode would hold), then, with a
        flag set, the same attention with the history products' operands rounded."""
        shipped = super()._attend_simulated(layer, qr, y)
        if not (self.q8 or self.lv8 or self.p8):
            return shipped
        T, r, codec = y.shape[1], self.r, self.codecs[layer]
        codes, scales = codec.encode(y)
        levels = codec.levels
        if self.lv8:
            codec.levels = e4m3_levels(levels)[0]
        unit = codec.decode(codes, torch.ones_like(scales))  # the levels the kernel's products read (scales apart)
        codec.levels = levels
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        hist_end = torch.tensor([self.sinks + self.policy.blocks_at(t) * self.block for t in range(T)])[:, None]
        causal = j <= i
        in_hist = causal & (j >= self.sinks) & (j < hist_end)
        # the kernel's two score products (c and rope parts), each over unit-scale levels, then the token scales
        qh = torch.cat([e4m3(qr[..., :r], -1), e4m3(qr[..., r:], -1)], -1) if self.q8 else qr
        s_c = torch.matmul(qh[..., :r], unit[..., :r].transpose(1, 2)[:, None]) * scales[..., 0].float()[:, None, None]
        s_r = torch.matmul(qh[..., r:], unit[..., r:].transpose(1, 2)[:, None]) * scales[..., 1].float()[:, None, None]
        s_fp = torch.matmul(qr, y.transpose(1, 2)[:, None])
        s = (torch.where(in_hist, s_c + s_r, s_fp) * self.scale).masked_fill(~causal, float("-inf"))
        p = torch.softmax(s, -1)
        ph = torch.where(in_hist, p, 0.0) * scales[..., 0].float()[:, None, None]  # p·s_c: the kernel's A operand
        if self.p8:
            ph = e4m3(ph, -1)
        window = torch.matmul(torch.where(in_hist, 0.0, p), y[..., :r][:, None])
        return window + torch.matmul(ph, unit[..., :r][:, None])


def scored(model, windows: torch.Tensor, cache_fn, ref: list[torch.Tensor] | None = None):
    """(perplexity, mean KL to ref's log-probs or None, this run's log-probs per window)."""
    from moec.runtime.perplexity import CONTEXT

    nll, kl, n, logps = 0.0, 0.0, 0, []
    for k, w in enumerate(windows):
        x = w[None]
        lp = torch.log_softmax(model(x, cache_fn(x.shape[1]), 0)[0, CONTEXT - 1 : -1].float(), -1)
        t = x[0, CONTEXT:]
        nll -= lp.gather(-1, t[:, None]).sum().item()
        if ref is not None:
            kl += (ref[k].exp() * (ref[k] - lp)).sum().item()
        n += t.numel()
        logps.append(lp)
    return math.exp(nll / n), (kl / n if ref is not None else None), logps


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

    torch.manual_seed(0)
    t0 = time.time()
    d = resolve_model("demo-mla")
    model, _ = load_model(d)
    args = model.args
    tok = load_tokenizer(d)
    sampler = LatentSampler(seed=0)
    with torch.no_grad():
        for w in make_windows(tokenize(tok, load_text("ptb", "train")), 1024, 16):
            model(w[None], observer=sampler)
        tensors, _ = fit(args, MLANUQConfig(codec="mla-nuq"), sampler)
        codecs = build_codecs({}, tensors, args)
        level_err = max(e4m3_levels(c.levels)[1] for c in codecs)
        test = tokenize(tok, load_text("ptb", "test"))
        sets = {"8x1024": make_windows(test, 1024, 8), "2x4096": make_windows(test, 4096, 2)}
        base = {k: scored(model, w, lambda n: MLACache(args, 1, n, dtype=torch.float32, mode="simulated"))
                for k, w in sets.items()}
        rows = [("kv-mla-nuq2 (fp16 products)", dict(q8=False, lv8=False, p8=False)),
                ("q8 + lv8 (scores in e4m3)", dict(q8=True, lv8=True, p8=False)),
                ("q8 + lv8 + p8 (both products in e4m3)", dict(q8=True, lv8=True, p8=True))]
        records = []
        for name, flags in rows:
            def make(n, flags=flags):
                return FP8ProductsCache(args, 1, n, codecs, window=128, sinks=4, block=32, mode="simulated", **flags)

            rec = {"config": name, **flags}
            for k, w in sets.items():
                p, kl, _ = scored(model, w, make, base[k][2])
                rec[k] = {"ppl": p, "ppl_fp16_latent": base[k][0], "delta_pct": 100 * (p / base[k][0] - 1), "kl": kl}
            records.append(rec)
            print(f"{name}: " + ", ".join(f"{k} {rec[k]['delta_pct']:+.3f}% KL {rec[k]['kl']:.5f}" for k in sets),
                  f"({time.time() - t0:.0f} s)", flush=True)
    a.out.write_text(json.dumps({"model": "demo-mla", "calibration": "PTB train, 16 x 1024, seed 0",
                                 "test": "PTB test, positions 32.. of each window", "device": "cpu, fp32",
                                 "e4m3_level_worst_rel_error": level_err,
                                 "baseline_ppl": {k: v[0] for k, v in base.items()}, "records": records}, indent=1))
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
