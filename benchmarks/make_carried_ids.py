"""Pre-tokenized calibration and test windows for a GPU machine that has no tokenizer stack or text sets
(benchmarks/data/<model>_ptb_ids.pt), made here by the calibration's own text path:

    OMP_NUM_THREADS=1 python3 -m benchmarks.make_carried_ids --model smollm2-135m \\
        --out benchmarks/data/smollm2-135m_ptb_ids.pt

calib = the windows `moec calibrate --data ptb --split train --samples 32 --seq-len 512 --seed 0` samples
(run.calibrate's parse_data → tokenize → sample_mix), test_windows = the first 8 non-overlapping 1024-token
windows of PTB test (runtime/perplexity.make_windows), text_tokens = the training text's length. int32 ids
(int16 cannot hold a 49152-entry vocabulary); the format of demo-moe_ptb_ids.pt otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moec.atomic import atomic_file
from moec.calibrate.data import load_text
from moec.calibrate.dataspec import parse_data, resolve_columns, sample_mix
from moec.calibrate.sources import load_tokenizer, resolve_model, tokenize
from moec.runtime.perplexity import make_windows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--test-windows", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    tok = load_tokenizer(resolve_model(a.model))
    sources = resolve_columns(parse_data("ptb", "train", None, None))
    ids = [tokenize(tok, load_text(s.name, s.split, s.config, s.column, tok)) for s in sources]
    calib, _ = sample_mix(ids, sources, a.samples, a.seq_len, 0)
    test = make_windows(tokenize(tok, load_text("ptb", "test")), 1024, a.test_windows)
    data = {"calib": calib.to(torch.int32), "test_windows": test.to(torch.int32), "text_tokens": int(ids[0].numel()),
            "note": f"{a.model} tokenizer; calib = sample_mix(ptb/train ids, {a.samples}, {a.seq_len}, seed 0); "
                    f"test_windows = make_windows(ptb/test ids, 1024, {a.test_windows})"}
    with atomic_file(a.out) as tmp:
        torch.save(data, tmp)
    print(a.out, {k: tuple(v.shape) for k, v in data.items() if isinstance(v, torch.Tensor)})


if __name__ == "__main__":
    main()
