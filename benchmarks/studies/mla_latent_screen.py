"""Screen: what compressing the MLA latent cache costs on demo-mla (issue 35, before a codec is built).

    python3 -m benchmarks.studies.mla_latent_screen --out benchmarks/results/mla_latent_screen_demo-mla.json

Each configuration quantizes the cached latent rows [c (kv_lora_rank), k_rope (qk_rope_dim)] of every layer the way
a tiered codec would hold them: fp16 sinks (the first tokens) and an fp16 window (the most recent ones), everything
older as per-token codes — optionally after a randomized block-Hadamard rotation of c and/or of k_rope (seeded per
layer), with a per-token fp16 scale (the rms) and Lloyd-Max levels of a unit Gaussian (2 or 3 bits), or per-token
absmax uniform levels (4 bits). Simulated decode: one teacher-forced forward per window in which query i attends to
the quantized rows of tokens older than its window and the fp16 rows of the rest, the absorbed attention of
runtime/model.MLAttention (what the dynamic cache would give, ageing token by token instead of in blocks). Controls:
the same codes with no fp16 window or sinks, and the history dropped (zero rows beyond the window: how much the
model reads past it at all). ppl over positions 32.. of PTB test windows (8 x 1024 and 2 x 4096) against the fp16
latent; bits = stored bits per latent number of a history row (codes + scales), the window at 16 bits projected to
32k (docs/metrics.md's KV bits, issue 35's latent definition).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from moec.rotation import block_hadamard
from moec.runtime.kvcache import MODES
from moec.runtime.mla import MLACache

# Lloyd-Max levels of N(0, 1): the centroids of the optimal 4- and 8-level quantizers
LLOYD = {2: (0.4528, 1.5104), 3: (0.2451, 0.7560, 1.3440, 2.1520)}


def quantize(x: torch.Tensor, bits: int, rot: torch.Tensor | None) -> torch.Tensor:
    """Fake-quantize rows x [..., n] per token (dequantized values returned, fp32)."""
    if bits >= 16:
        return x.half().float()
    if bits == 0:  # the control: the history dropped (zero rows)
        return torch.zeros_like(x, dtype=torch.float32)
    y = x.float() @ rot if rot is not None else x.float()
    if bits in LLOYD:
        lv = torch.tensor(LLOYD[bits], dtype=torch.float32)
        lv = torch.cat([-lv.flip(0), lv])
        s = y.pow(2).mean(-1, keepdim=True).sqrt().half().float().clamp_min(1e-8)  # fp16 scale
        q = lv[(y / s)[..., None].sub(lv).abs().argmin(-1)] * s
    else:
        m = 2 ** (bits - 1) - 1
        s = (y.abs().amax(-1, keepdim=True) / m).half().float().clamp_min(1e-8)
        q = (y / s).round().clamp(-m - 1, m) * s
    return q @ rot.T if rot is not None else q


class ScreenCache(MLACache):
    """MLACache in simulated mode whose history rows (outside sinks + window) are fake-quantized."""

    def __init__(self, args, batch, max_len, cfg: dict):
        super().__init__(args, batch, max_len, dtype=torch.float32, mode="simulated")
        self.cfg = cfg
        r, rp = args.kv_lora_rank, args.qk_rope_dim
        self.rots = [(block_hadamard(r, 0, 1000 + i) if cfg["rot_c"] else None,
                      block_hadamard(rp, 0, 2000 + i) if cfg["rot_r"] else None) for i in range(args.n_layers)]

    def attend(self, layer, q, kv, v=None, start_pos=None):
        assert start_pos == 0 and self.mode in MODES
        r = self.args.kv_lora_rank
        rows = kv[:, 0].float()  # [B, T, r + rope]
        rc, rr = self.rots[layer]
        qrows = torch.cat([quantize(rows[..., :r], self.cfg["bits_c"], rc),
                           quantize(rows[..., r:], self.cfg["bits_r"], rr)], -1)
        T = rows.shape[1]
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        causal = j <= i
        exact = causal & ((i - j < self.cfg["window"]) | (j < self.cfg["sinks"]))  # fp16 rows for query i
        s_fp = torch.matmul(q.float(), rows.half().float().transpose(1, 2)[:, None]) * self.scale
        s_q = torch.matmul(q.float(), qrows.transpose(1, 2)[:, None]) * self.scale
        s = torch.where(exact, s_fp, s_q).masked_fill(~causal, float("-inf"))
        p = torch.softmax(s, -1)
        out = torch.matmul(torch.where(exact, p, 0.0), rows.half().float()[..., :r][:, None]) + \
            torch.matmul(torch.where(exact | ~causal, 0.0, p), qrows[..., :r][:, None])
        return out.to(q.dtype)


def bits(args, cfg: dict, context: int = 32768) -> float:
    """Stored bits per latent number at `context` tokens: history codes + per-token fp16 scales (one per part
    that is quantized), sinks + window at 16 bits."""
    r, rp = args.kv_lora_rank, args.qk_rope_dim
    hist = sum(n * b + (16 if 0 < b < 16 else 0) for n, b in ((r, cfg["bits_c"]), (rp, cfg["bits_r"]))) / (r + rp)
    fp = min(context, cfg["window"] + cfg["sinks"])
    return (hist * (context - fp) + 16 * fp) / context


@torch.no_grad()
def ppl(model, windows: torch.Tensor, cache_fn) -> float:
    from moec.runtime.perplexity import CONTEXT

    nll, n = 0.0, 0
    for w in windows:
        x = w[None]
        logits = model(x, cache_fn(x.shape[1]), 0)[0, CONTEXT - 1 : -1].float()
        t = x[0, CONTEXT:]
        nll += torch.nn.functional.cross_entropy(logits, t, reduction="sum").item()
        n += t.numel()
    return math.exp(nll / n)


CONFIGS = [
    dict(bits_c=2, bits_r=16, rot_c=False, rot_r=False),
    dict(bits_c=2, bits_r=16, rot_c=True, rot_r=False),
    dict(bits_c=2, bits_r=4, rot_c=True, rot_r=True),
    dict(bits_c=2, bits_r=3, rot_c=True, rot_r=True),
    dict(bits_c=2, bits_r=2, rot_c=True, rot_r=True),
    dict(bits_c=3, bits_r=3, rot_c=True, rot_r=True),
    dict(bits_c=3, bits_r=4, rot_c=True, rot_r=True),
    dict(bits_c=4, bits_r=4, rot_c=True, rot_r=True),
    # sensitivity: no fp16 window or sinks (every older token from the codes), and the history dropped
    dict(bits_c=2, bits_r=16, rot_c=False, rot_r=False, window=0, sinks=0),
    dict(bits_c=2, bits_r=16, rot_c=True, rot_r=False, window=0, sinks=0),
    dict(bits_c=2, bits_r=4, rot_c=True, rot_r=True, window=0, sinks=0),
    dict(bits_c=2, bits_r=2, rot_c=True, rot_r=True, window=0, sinks=0),
    dict(bits_c=0, bits_r=0, rot_c=False, rot_r=False),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=4)
    a = ap.parse_args()
    from moec.calibrate.data import load_text
    from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
    from moec.runtime.loader import load_model
    from moec.runtime.perplexity import make_windows

    d = resolve_model("demo-mla")
    model, _ = load_model(d)
    ids = tokenize(load_tokenizer(d), load_text("ptb", "test"))
    sets = {"8x1024": make_windows(ids, 1024, 8), "2x4096": make_windows(ids, 4096, 2)}
    args = model.args
    t0 = time.time()
    base = {k: ppl(model, w, lambda n: MLACache(args, 1, n, dtype=torch.float32, mode="simulated"))
            for k, w in sets.items()}
    print("fp16 latent", base, flush=True)
    records = []
    for c in CONFIGS:
        cfg = {"window": a.window, "sinks": a.sinks} | c
        rec = {"config": cfg, "bits_32k": bits(args, cfg), "bits_history": bits(args, cfg | {"window": 0,
                                                                                             "sinks": 0})}
        for k, w in sets.items():
            p = ppl(model, w, lambda n, cfg=cfg: ScreenCache(args, 1, n, cfg))
            rec[k] = {"ppl": p, "ppl_fp16": base[k], "delta_pct": 100 * (p / base[k] - 1)}
        records.append(rec)
        print(f"{cfg} bits@32k {rec['bits_32k']:.3f}: " + ", ".join(f"{k} {rec[k]['delta_pct']:+.2f}%" for k in sets),
              f"({time.time() - t0:.0f} s)", flush=True)
        a.out.write_text(json.dumps({"model": "demo-mla", "windows": list(sets), "baseline": base,
                                     "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
