"""`moec eval --stream-layers` (moec/runtime/stream_eval.py): teacher-forced perplexity with one layer's
weights at a time must equal the in-memory path's (perplexity.evaluate on load_model) within 1e-5
relative, for a source model (demo-moe) and a packed checkpoint with quantized experts and attention."""

from __future__ import annotations

import pytest
import torch

from moec.calibrate.pack import pack_random
from moec.calibrate.recipe import parse_recipe
from moec.calibrate.sources import resolve_model
from moec.runtime.config import ModelArgs
from moec.runtime.loader import load_model
from moec.runtime.perplexity import CONTEXT, evaluate
from moec.runtime.stream_eval import LayerSource, evaluate_streamed
from tests.cli.run import moec


def _windows(vocab: int, n: int = 3, W: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (n, W), generator=torch.Generator().manual_seed(0))


def _check(path) -> None:
    model, _ = load_model(path, torch.float32, "cpu")
    windows = _windows(model.args.vocab_size)
    ref = evaluate(model, windows, "tf")
    layers = []
    got = evaluate_streamed(LayerSource(path, torch.float32, "cpu"), windows, progress=layers.append)
    # every window's scored positions spread over the layers, reported per layer and window
    assert len(layers) == model.args.n_layers * windows.shape[0]
    assert sum(layers) == windows.shape[0] * (windows.shape[1] - CONTEXT)
    assert got["scored_tokens"] == ref["scored_tokens"]
    assert got["ppl"] == pytest.approx(ref["ppl"], rel=1e-5), (got["ppl"], ref["ppl"])


def test_streamed_source_model():
    _check(resolve_model("demo-moe"))


def test_streamed_packed_quantized(tmp_path):
    args = ModelArgs(arch="mixtral", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                     max_seq_len=128, n_experts=4, top_k=2, expert_dim=64)
    recipe = parse_recipe({"name": "stream-test", "weights": [
        {"targets": ["experts"], "codec": "hls", "bits": 2, "group_size": 0},
        {"targets": ["attention"], "codec": "rtn", "bits": 4, "group_size": 32}]})
    pack_random(args, "tiny", recipe, tmp_path / "packed")
    _check(tmp_path / "packed")


def test_stream_layers_refuses_dec_mode_and_a_baseline_model():
    r = moec("eval", "demo-moe", "--stream-layers", "--mode", "both", "--max-windows", "1")
    assert r.returncode == 2 and "--mode tf" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = moec("eval", "demo-moe", "--stream-layers", "--mode", "tf", "--baseline", "demo-moe", "--max-windows", "1")
    assert r.returncode == 2 and "--baseline-logits" in r.stderr and "Traceback" not in r.stderr, r.stderr
