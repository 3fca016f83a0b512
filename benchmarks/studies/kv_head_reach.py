"""Which KV heads read far back? (issue 37: per-head / per-layer bit allocation for retrieval)

Retrieval fails when the keys of the heads that fetch from the distant history are too coarse. This study
measures, on calibration text (PTB train, never the retrieval trials), each KV head's *reach*: the attention
mass its query heads put on tokens more than `--near` positions back, sinks (the first 4 tokens) excluded,
averaged over the last `--queries` positions of each window (max over the query heads that share the KV
head), and its *peak*: the largest single far token's probability, averaged the same way (a head that
fetches one distant token, as retrieval does, against one that spreads its mass over the history).
High-peak heads are the candidates for more key bits; streaming heads (sinks + local) can take fewer.

    python3 -m benchmarks.studies.kv_head_reach [--model smollm2-135m] [--windows 2] [--seq-len 4096]

Writes benchmarks/results/kv_head_reach_<model>.json: reach [layers, kv_heads] and per-layer max.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.benchutil import ROOT

SINKS = 4


class ReachRecorder:
    """A cache for one causal prefill from position 0 (the model hands `attend` its post-RoPE q, k, v) that
    accumulates each KV head's far attention mass over the last `queries` positions."""

    def __init__(self, n_layers: int, n_kv: int, near: int, queries: int):
        self.reach = torch.zeros(n_layers, n_kv, dtype=torch.float64)
        self.peak = torch.zeros(n_layers, n_kv, dtype=torch.float64)
        self.near, self.queries, self.windows = near, queries, 0

    def attend(self, layer: int, q, k, v, start_pos: int = 0):
        assert start_pos == 0
        B, H, T, d = q.shape
        K = k.shape[1]
        qs = q[:, :, T - self.queries:].float()  # [B, H, Q, d]
        kk = k.float().repeat_interleave(H // K, dim=1)  # [B, H, T, d]
        s = qs @ kk.transpose(-1, -2) / d**0.5  # [B, H, Q, T]
        pos_q = torch.arange(T - self.queries, T)[:, None]
        pos_k = torch.arange(T)[None, :]
        s = s.masked_fill(pos_k > pos_q, float("-inf"))
        p = s.softmax(-1)
        far = (pos_k < pos_q - self.near) & (pos_k >= SINKS)  # [Q, T]
        mass = (p * far).sum(-1).mean(-1)  # [B, H]
        per_kv = mass.view(B, K, H // K).amax(-1).mean(0)  # [K]
        self.reach[layer] += per_kv.double()
        # peak: the largest single far token's probability (a head that fetches one distant token, as
        # retrieval does, against one that spreads its mass over the whole history)
        peak = (p * far).amax(-1).mean(-1)  # [B, H]
        self.peak[layer] += peak.view(B, K, H // K).amax(-1).mean(0).double()
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def main() -> None:
    from moec.calibrate.data import load_text
    from moec.calibrate.sources import load_tokenizer, resolve_model
    from moec.runtime.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--near", type=int, default=256)
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    t0 = time.time()
    model_dir = resolve_model(a.model)
    model, _ = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    ids = torch.tensor(tok(load_text("ptb", "train"), add_special_tokens=False)["input_ids"])
    rec = ReachRecorder(model.args.n_layers, model.args.n_kv_heads, a.near, a.queries)
    with torch.no_grad():
        for w in range(a.windows):  # windows spread over the text, as calibration draws them
            start = (w * (len(ids) - a.seq_len)) // max(1, a.windows - 1) if a.windows > 1 else 0
            model(ids[start: start + a.seq_len][None], rec, 0)
    reach, peak = rec.reach / a.windows, rec.peak / a.windows
    order = torch.argsort(peak.amax(1), descending=True).tolist()
    out = a.out or ROOT / "benchmarks" / "results" / f"kv_head_reach_{a.model}.json"
    rec_ = {"bench": "kv_head_reach", "date": time.strftime("%Y-%m-%d"), "model": a.model, "data": "ptb:train",
            "windows": a.windows, "seq_len": a.seq_len, "near": a.near, "queries": a.queries, "sinks": SINKS,
            "reach": [[round(float(x), 5) for x in row] for row in reach],
            "layer_max": [round(float(x), 5) for x in reach.amax(1)],
            "peak": [[round(float(x), 5) for x in row] for row in peak],
            "layer_peak_max": [round(float(x), 5) for x in peak.amax(1)], "layers_by_peak": order,
            "seconds": round(time.time() - t0, 1),
            "command": f"python3 -m benchmarks.studies.kv_head_reach --model {a.model} --windows {a.windows} "
                       f"--seq-len {a.seq_len} --near {a.near} --queries {a.queries}"}
    out.write_text(json.dumps(rec_, indent=1))
    print(json.dumps({k: rec_[k] for k in ("layer_max", "layer_peak_max", "layers_by_peak", "seconds")}))


if __name__ == "__main__":
    main()
