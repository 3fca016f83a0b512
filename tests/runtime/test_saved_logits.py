"""KL against baseline log-probs saved to disk (moec/runtime/saved_logits.py) equals KL against the
baseline model in memory.

Tolerance: the file stores log-probs in fp16, relative rounding 2^-11 ≈ 4.9e-4 per value. KL per
position is Σ q (log q − log p); a relative error ε on log q moves it by at most ε Σ q |log q| (1 +
|log q − log p|), i.e. ε × (entropy-sized terms ≈ 5 nats for a 300-token vocabulary): ≤ ~2.5e-3 nats
absolute as a worst case, far less on average as roundings of both signs cancel. We assert 1e-3
absolute on kld (the tiny model's kld against its perturbed copy is ~0.1, so the check is ~1%). ppl_base
is exp(mean −log q at the targets); this random model's log-probs all sit near −log 300 ≈ −5.7, where
fp16's step is 2^-8, so each moves by up to 2^-9 ≈ 0.002 nats and ppl_base by up to 0.2%: 2e-3 relative.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moec.cli.eval_cmd import eval_
from moec.errors import UserError
from moec.runtime.saved_logits import MATCH, SavedLogits

EVAL = dict(data="ptb", split="test", mode="both", max_windows=2, seq_len=48, old_window=None, batch_size=2,
            device="cpu", dtype="fp32", latency=False, random=None, recipe=None, batches="1", contexts="4k", steps=1,
            prefill_contexts="4k", bf16_peer=False, breakdown=False, plot=None, stream_layers=False, scheme=None,
            path="auto")


@pytest.fixture(scope="module")
def perturbed(tiny_moe_dir, tmp_path_factory):
    """The tiny MoE with noise on its expert weights and output head: a candidate whose KL to the original
    is ~0.1 (the random model's own logits are nearly flat, so expert noise alone moves KL by 1e-5)."""
    d = tmp_path_factory.mktemp("perturbed") / "model"
    shutil.copytree(tiny_moe_dir, d)
    f = next(d.glob("*.safetensors"))
    sd = load_file(str(f))
    g = torch.Generator().manual_seed(0)
    for k, t in sd.items():
        if "experts" in k or k == "lm_head.weight":
            noise = 0.3 * t.float().std() if "experts" in k else 0.1  # logit noise ~0.7 at dim 48
            sd[k] = (t.float() + noise * torch.randn(t.shape, generator=g)).to(t.dtype)
    save_file(sd, str(f), metadata={"format": "pt"})
    return d


def _eval(model, tmp_path, name, **kw) -> dict:
    out = tmp_path / f"{name}.json"
    eval_(str(model), json_out=out, **(EVAL | dict(baseline=None, save_logits=None, baseline_logits=None) | kw))
    return {r["mode"]: r for r in json.loads(out.read_text())}


def test_kl_from_saved_logits_equals_in_memory_baseline(tiny_moe_dir, perturbed, tmp_path):
    logits = tmp_path / "base.logits"
    saved = _eval(tiny_moe_dir, tmp_path, "base", save_logits=logits)
    direct = _eval(perturbed, tmp_path, "direct", baseline=str(tiny_moe_dir))
    via = _eval(perturbed, tmp_path, "via", baseline_logits=logits)
    for m in ("tf", "dec"):
        assert direct[m]["kld"] > 0.01, direct[m]  # a real difference to measure
        assert via[m]["kld"] == pytest.approx(direct[m]["kld"], abs=1e-3), (m, via[m]["kld"], direct[m]["kld"])
        assert via[m]["ppl_base"] == pytest.approx(direct[m]["ppl_base"], rel=2e-3)
        assert direct[m]["ppl_base"] == pytest.approx(saved[m]["ppl"], rel=1e-9)  # the same baseline evaluated
        assert via[m]["ppl"] == direct[m]["ppl"] and via[m]["scored_tokens"] == direct[m]["scored_tokens"]
        assert abs(via[m]["top1"] - direct[m]["top1"]) <= 1 / direct[m]["scored_tokens"]  # an fp16 tie at most
        assert via[m]["baseline"].endswith(f"(logits {logits})")
    manifest = json.loads(safe_open(str(logits), "pt").metadata()["manifest"])
    assert manifest["windows"] == 2 and manifest["window"] == 48 and manifest["modes"] == ["dec", "tf"]
    assert manifest["model"] == str(tiny_moe_dir) and len(manifest["model_sha256"]) == 64


def test_mismatched_or_foreign_logits_refused(tiny_moe_dir, tmp_path):
    """A file from another evaluation names each field that differs; a missing mode, both baselines, a
    foreign or unreadable file: one-line refusals. (File-level cases call SavedLogits directly: each
    eval_ call tokenizes the data, ~2 s.)"""
    logits = tmp_path / "base.logits"
    _eval(tiny_moe_dir, tmp_path, "base", save_logits=logits, mode="tf", max_windows=1)
    with pytest.raises(UserError, match=r"another evaluation: windows 1 \(file\) vs 2 \(now\); tokens_sha256"):
        _eval(tiny_moe_dir, tmp_path, "x", baseline_logits=logits, mode="tf")
    with pytest.raises(UserError, match="pass one"):
        _eval(tiny_moe_dir, tmp_path, "x", baseline_logits=logits, baseline=str(tiny_moe_dir))
    manifest = json.loads(safe_open(str(logits), "pt").metadata()["manifest"])
    expect = {k: manifest[k] for k in MATCH}
    assert SavedLogits(logits, expect, ["tf"]).manifest["modes"] == ["tf"]
    with pytest.raises(UserError, match=r"split 'test' \(file\) vs 'valid' \(now\); window 48 \(file\) vs 64"):
        SavedLogits(logits, expect | {"split": "valid", "window": 64}, ["tf"])
    with pytest.raises(UserError, match=r"holds modes \['tf'\], not dec; save it with --mode dec"):
        SavedLogits(logits, expect, ["dec"])
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other))
    with pytest.raises(UserError, match="not a moec logits file"):
        SavedLogits(other, expect, ["tf"])
    (tmp_path / "junk").write_bytes(b"\x00junk")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        SavedLogits(tmp_path / "junk", expect, ["tf"])
