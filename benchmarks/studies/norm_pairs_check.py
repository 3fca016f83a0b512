"""The fused step's FFN norm writing the 2-bit experts' prmt_pairs input (MOEC_NORM_PAIRS=1) against its own launch, on
the GPU, where the prmt GEMV runs (the CPU interpreter cannot: tests check the norm's output and the plumbing).

    python3 -m benchmarks.studies.norm_pairs_check --out OUT.json      (~15 s)

A small random model (Mixtral-style, 2-bit HLS experts, bf16, CUDA graphs off), a prefill and 6 greedy steps with the
switch off and on: `equal` (the logits bit for bit: the pairs are the same bits either way) and `layers_on` (the layers
whose norm wrote them). benchmarks/studies/fp4h_flip.py --decide-switches wants equal and every layer on.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from moec.atomic import write_json
from moec.calibrate.recipe import load_recipe
from moec.provenance import environment
from moec.runtime.config import ModelArgs
from moec.runtime.decode import DecodeEngine
from moec.runtime.kvcache import FP16Cache
from moec.runtime.latency import random_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    args = ModelArgs(arch="mixtral", vocab_size=512, dim=512, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=64,
                     max_seq_len=128, n_experts=8, top_k=2, expert_dim=1024)
    model = random_model(args, load_recipe("experts-hls2").rule_for, "cuda", torch.bfloat16, seed=1)
    prompt = torch.arange(3, 19)
    out, layers = [], []
    for pairs in ("0", "1"):
        os.environ["MOEC_NORM_PAIRS"] = pairs
        eng = DecodeEngine(model, FP16Cache(args, 1, 64, device="cuda", dtype=torch.bfloat16, mode="static"),
                           graphs=False, fuse=True)
        layers.append(sum(eng.norm_pairs))
        logits = [eng.prefill(0, prompt)]
        eng.tokens[:1] = logits[0].argmax()
        for _ in range(6):
            logits.append(eng.step(1, feed_next=True)[0].clone())
        out.append(torch.stack(logits))
    equal = bool(torch.equal(out[0], out[1]))
    res = {"bench": "norm-pairs-check", "env": environment("cuda"), "equal": equal, "layers": args.n_layers,
           "layers_on": layers[1], "layers_on_without": layers[0],
           "max_abs_diff": (out[0] - out[1]).abs().max().item(), "ok": equal and layers[1] == args.n_layers}
    write_json(a.out, res)
    print(res)


if __name__ == "__main__":
    main()
