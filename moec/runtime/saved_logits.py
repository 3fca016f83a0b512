"""Baseline logits saved once to disk (`moec eval --save-logits` / `--baseline-logits`).

KL against a baseline needs the baseline's distribution at every scored position. Keeping a second
model in memory doubles what an eval holds (two Mixtral-8x7B do not fit one GPU); evaluating the
baseline once and storing its outputs costs n × (W − CONTEXT) × V values instead.

File: safetensors, tensors `logprobs.<mode>` [n, W − CONTEXT, V] fp16 (mode tf and/or dec; row k of
window i is the distribution predicting token CONTEXT + k, the positions perplexity.evaluate scores),
and metadata {"format": "moec-logits", "version": "1", "manifest": JSON} where the manifest records
what was evaluated: model (as given) and model_sha256, data, split, windows, window, context, vocab,
tokens_sha256 (the windows' token ids), modes, dtype. A baseline file is used only if data, split,
windows, window, context, vocab and tokens match the current eval; each difference is named.

Why log-probabilities in fp16: log_softmax ≤ 0 with the likely tokens near 0, where fp16 is finest
(relative rounding 2^-11); raw logits carry an arbitrary offset that would spend those bits. bf16
(2^-8) would put the KL error above the KL of a good 4-bit model. A 32k-vocabulary, 8-window eval at
W = 1024 is 0.5 GB per mode.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..atomic import atomic_file
from ..errors import UserError

FORMAT, VERSION = "moec-logits", "1"
MATCH = ("data", "split", "windows", "window", "context", "vocab", "tokens_sha256")  # must equal the eval's


def tokens_sha(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


class LogitRecorder:
    """Collects the evaluated model's log-probabilities per scored position (perplexity.evaluate's `record`)."""

    def __init__(self, n: int, scored: int, vocab: int):
        self.shape = (n, scored, vocab)
        self.modes: dict[str, torch.Tensor] = {}

    def __call__(self, mode: str, rows: slice, cols: slice, logits: torch.Tensor) -> None:
        """logits [len(rows), len(cols), V] for windows `rows` at scored positions `cols`."""
        if mode not in self.modes:
            self.modes[mode] = torch.zeros(self.shape, dtype=torch.float16)
        self.modes[mode][rows, cols] = torch.log_softmax(logits.float(), -1).half().cpu()

    def save(self, path: Path, manifest: dict) -> None:
        manifest = manifest | {"modes": sorted(self.modes)}
        size = sum(t.numel() * 2 for t in self.modes.values())
        with atomic_file(path, size_hint=size) as tmp:
            save_file({f"logprobs.{m}": t for m, t in self.modes.items()}, str(tmp),
                      metadata={"format": FORMAT, "version": VERSION, "manifest": json.dumps(manifest)})


class SavedLogits:
    """A --baseline-logits file, checked against the current eval; rows read lazily (safe_open slices)."""

    def __init__(self, path: Path, expect: dict, modes: list[str]):
        self.path = path
        try:
            self.f = safe_open(str(path), "pt")
            meta = self.f.metadata() or {}
        except (SafetensorError, OSError) as e:
            raise UserError(f"--baseline-logits {path}: not a readable safetensors file ({e})") from None
        if meta.get("format") != FORMAT:
            raise UserError(f"--baseline-logits {path}: not a moec logits file (format {meta.get('format')!r}); "
                            f"write one with `moec eval BASELINE --save-logits {path.name}`")
        if meta.get("version") != VERSION:
            raise UserError(f"--baseline-logits {path}: version {meta.get('version')}, this moec reads {VERSION}")
        try:
            self.manifest = json.loads(meta["manifest"])
        except (KeyError, ValueError):
            raise UserError(f"--baseline-logits {path}: its manifest is missing or not JSON") from None
        diffs = [f"{k} {self.manifest.get(k)!r} (file) vs {expect[k]!r} (now)" for k in MATCH
                 if self.manifest.get(k) != expect[k]]
        if diffs:
            raise UserError(f"--baseline-logits {path} was saved from another evaluation: {'; '.join(diffs)}")
        missing = [m for m in modes if m not in self.manifest.get("modes", [])]
        if missing:
            raise UserError(f"--baseline-logits {path} holds modes {self.manifest.get('modes')}, not "
                            f"{', '.join(missing)}; save it with --mode {'both' if len(modes) > 1 else modes[0]}")
        want = [expect["windows"], expect["window"] - expect["context"], expect["vocab"]]
        for m in modes:
            sl = self.f.get_slice(f"logprobs.{m}")
            if sl.get_shape() != want or sl.get_dtype() != "F16":
                raise UserError(f"--baseline-logits {path}: logprobs.{m} is {sl.get_dtype()} {sl.get_shape()}, "
                                f"expected F16 {want}")

    def __call__(self, mode: str, rows: slice, cols: slice) -> torch.Tensor:
        """Log-probabilities [len(rows), len(cols), V] fp16 of windows `rows` at scored positions `cols`."""
        return self.f.get_slice(f"logprobs.{mode}")[rows, cols]
