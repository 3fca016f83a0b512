"""Resumable calibration (moec/calibrate/resume.py) and determinism (moec/provenance.py).

The end-to-end tests run `moec calibrate` on the tiny random MoE with a recipe that fits experts (hls 2-bit,
GPTQ, codebook tuning), attention (rtn) and a KV codec (nuq-outlier, fitted levels, Hadamard rotation,
score bias: the KV sampler draws with its own generator), kill it with SIGKILL at fixed checkpoints
(MOEC_TEST_KILL_AFTER) and compare the resumed output with an uninterrupted run byte for byte.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import yaml

from moec.calibrate import resume
from moec.calibrate.capture import ExpertTokenCounts, KVRange
from moec.calibrate.fit_experts import ExpertFitter
from moec.calibrate.latent import LatentSampler
from moec.calibrate.nuq import KVSampler
from moec.calibrate.pack import pack
from moec.calibrate.recipe import load_recipe, parse_recipe
from moec.calibrate.run import calibrate
from moec.errors import UserError
from tests.cli.run import moec

RECIPE = {
    "name": "resume-test",
    "weights": [{"targets": ["experts"], "codec": "hls", "bits": 2, "group_size": 0, "gptq": True},
                {"targets": ["attention"], "codec": "rtn", "bits": 4}],
    "kv": {"codec": "nuq-outlier", "bits": 2, "outlier_frac": 0.0, "levels": "fitted", "rope": "post",
           "k_center": True, "k_scale_fit": "mse", "rotate": "hadamard", "score_bias": True},
    "calibration": {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 0, "seed": 0, "tune_steps": 3,
                    "tune_batch": 2},
}
RUN = ("--data", "ptb", "--split", "valid", "--samples", "4", "--seq-len", "32")
TIME_FIELDS = ("created", "capture_seconds", "fit_seconds", "seconds")  # report.json fields that measure time


def _without_time(x):
    if isinstance(x, dict):
        return {k: _without_time(v) for k, v in x.items() if k not in TIME_FIELDS}
    if isinstance(x, list):
        return [_without_time(v) for v in x]
    return x


@pytest.fixture
def recipe_file(tmp_path):
    p = tmp_path / "resume-test.yaml"
    p.write_text(yaml.safe_dump(RECIPE))
    return p


def test_killed_and_resumed_matches_uninterrupted(tiny_moe_dir, recipe_file, tmp_path, monkeypatch):
    """Killed (SIGKILL) after layer 0 and again after the tuning step, then resumed: the same bytes as an
    uninterrupted run. The kills run the CLI in a subprocess; the rest runs in-process (cheaper)."""
    ref, out = tmp_path / "ref", tmp_path / "calib"
    partial = resume.partial_dir(out)

    def run(out_dir, resume=False):
        return calibrate(tiny_moe_dir, str(tiny_moe_dir), load_recipe(recipe_file), "ptb", "valid", 4, 32, 0,
                         out_dir, resume=resume)

    run(ref)
    assert not resume.partial_dir(ref).exists()  # success removes the partial state

    # killed once layer 0 is done: the checkpoint holds the hidden states entering layer 1
    monkeypatch.setenv(resume.KILL_ENV, "layer-0")
    r = moec("calibrate", tiny_moe_dir, "--recipe", recipe_file, *RUN, "-o", out)
    assert r.returncode == -9, (r.returncode, r.stderr)
    assert not out.exists() and json.loads((partial / "state.json").read_text())["layer"] == 0
    monkeypatch.delenv(resume.KILL_ENV)
    with pytest.raises(UserError, match=r"layers 0..0 done\); pass --resume"):  # the partial state is kept
        run(out)

    # resumed at layer 1, killed again after the post-loop tuning step (before the KV fit)
    monkeypatch.setenv(resume.KILL_ENV, "tune")
    r = moec("calibrate", tiny_moe_dir, "--recipe", recipe_file, *RUN, "-o", out, "--resume")
    assert r.returncode == -9, (r.returncode, r.stderr)
    assert json.loads((partial / "state.json").read_text())["stage"] == "tune"
    monkeypatch.delenv(resume.KILL_ENV)

    run(out, resume=True)
    assert not partial.exists()
    assert (out / "calib.safetensors").read_bytes() == (ref / "calib.safetensors").read_bytes()
    got, want = (json.loads((d / "report.json").read_text()) for d in (out, ref))
    assert got["tune"]["steps"] == 3 and got["kv"]["codec"] == "nuq-outlier"  # the post-loop steps ran
    assert got["layers"][1]["weights"]["attention"]["wq"]["codec"] == "rtn"
    assert _without_time(got) == _without_time(want)
    assert (out / "recipe.yaml").read_text() == (ref / "recipe.yaml").read_text()


def test_same_seed_same_bytes(tiny_moe_dir, tmp_path, monkeypatch):
    """Two calibrate + pack runs of one recipe and seed: identical tensors, shards and manifests (time
    fields from SOURCE_DATE_EPOCH; report.json's durations aside)."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    recipe = parse_recipe({k: v for k, v in RECIPE.items() if k != "weights"} | {
        "weights": RECIPE["weights"][:1], "calibration": {"min_expert_tokens": 0}})
    outs = []
    for i in range(2):
        calib, packed = tmp_path / f"calib{i}", tmp_path / f"packed{i}"
        # --resume without a partial state starts from the first layer
        calibrate(tiny_moe_dir, "tiny", recipe, "ptb", "valid", 4, 32, 0, calib, resume=bool(i))
        pack(tiny_moe_dir, "tiny", calib, packed)
        outs.append((calib, packed))
    (c0, p0), (c1, p1) = outs
    assert (c0 / "calib.safetensors").read_bytes() == (c1 / "calib.safetensors").read_bytes()
    shards = sorted(f.name for f in p0.glob("*.safetensors"))
    assert shards and shards == sorted(f.name for f in p1.glob("*.safetensors"))
    for s in shards:
        assert (p0 / s).read_bytes() == (p1 / s).read_bytes(), s
    m0, m1 = (json.loads((p / "moec.json").read_text()) for p in (p0, p1))
    assert m0 == m1 and m0["created"] == "2023-11-14T22:13:20Z" == m0["calibration"]["created"]
    env = m0["calibration"]["environment"]
    assert env["torch"] == torch.__version__ and env["device"].startswith("cpu") and env["triton"] and \
        env["transformers"] and m0["environment"]["threads"] >= 1
    r0, r1 = (json.loads((c / "report.json").read_text()) for c in (c0, c1))
    assert _without_time(r0) == _without_time(r1) and r0["created"] == r1["created"]


# --- unit level: the key, the refusals, the checkpoint files ------------------------------------------------

FP = {"weights_sha256": "a" * 64, "config_sha256": "b" * 64}


def _key(**change):
    args = dict(fingerprint=FP, recipe=parse_recipe(RECIPE), data="ptb", split="valid",
                tokens=torch.arange(64).view(4, 16), seed=0, samples=4, seq_len=16, device="cpu")
    args.update(change)
    return resume.run_key(**args)


def _observers():
    """Observers with some state: counts and ranges of layer 0, K/V samples drawn with the generator."""
    from moec.runtime.config import ModelArgs

    args = ModelArgs(arch="mixtral", vocab_size=16, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4,
                     n_experts=3, top_k=2, expert_dim=8)
    counts, kv, sampler, latent = ExpertTokenCounts(args), KVRange(), KVSampler(max_tokens=6, seed=3), LatentSampler()
    fitter = ExpertFitter({}, None, "all-experts-for-stats", 0)
    return {"counts": counts, "kv_range": kv, "kv_sampler": sampler, "latent": latent, "fitter": fitter}


def _feed(parts, layer, seed):
    g = torch.Generator().manual_seed(seed)
    for name in ("k_pre", "k", "v"):
        t = torch.randn(2, 1, 4, 4, generator=g)  # [B, K, T, d]
        for p in ("kv_range", "kv_sampler", "latent"):
            parts[p](layer, name, t)
    parts["kv_sampler"](layer, "q", torch.randn(2, 2, 4, 4, generator=g))
    parts["counts"](layer, "expert_ids", torch.randint(0, 3, (8, 2), generator=g))
    parts["fitter"].tensors[f"fit.layers.{layer}.moe.w1.codes"] = torch.randint(0, 255, (3, 4), dtype=torch.uint8)
    parts["fitter"].report[layer] = {"w1": {"rel_output_error": [0.1 * layer, float("nan")]}}


def test_checkpoint_round_trip_and_continue(tmp_path):
    """Observers restored from a checkpoint continue exactly as the originals (the KV sampler's generator
    included), and a partial save killed mid-way leaves the previous checkpoint readable."""
    out = tmp_path / "calib"
    orig = _observers()
    _feed(orig, 0, seed=1)
    torch.manual_seed(5)
    h = torch.randn(2, 4, 8)
    state = resume.PartialState(out, _key(), orig)
    state.save("layers", 0, 1.5, hidden=h)
    rng_after_save = torch.rand(3)
    # what a kill during the next save leaves: a half-written tensor file and a temporary index
    (state.dir / "state-00002.safetensors").write_bytes(b"\0garbage")
    (state.dir / "state.json.tmp").write_text("{")

    copy = _observers()
    resumed = resume.PartialState(out, _key(), copy).open(resume=True)
    assert (resumed.stage, resumed.layer, resumed.elapsed) == ("layers", 0, 1.5) and torch.equal(resumed.hidden, h)
    assert torch.equal(torch.rand(3), rng_after_save)  # the global RNG continues where the run left it
    assert copy["fitter"].report[0]["w1"]["rel_output_error"][0] == 0.0
    for parts in (orig, copy):
        _feed(parts, 1, seed=2)
    for name in ("k_pre", "k", "v"):
        for layer in (0, 1):
            assert torch.equal(orig["kv_sampler"].get(layer, name), copy["kv_sampler"].get(layer, name))
            assert torch.equal(orig["latent"].get(layer, name), copy["latent"].get(layer, name))
            assert torch.equal(orig["kv_range"].stats[(layer, name)], copy["kv_range"].stats[(layer, name)])
    assert orig["kv_sampler"].count == copy["kv_sampler"].count and orig["kv_sampler"].q_n == copy["kv_sampler"].q_n
    for layer in (0, 1):
        assert torch.equal(orig["kv_sampler"].q_outer[layer], copy["kv_sampler"].q_outer[layer])
        assert torch.equal(orig["counts"].counts[layer], copy["counts"].counts[layer])
    assert orig["fitter"].tensors.keys() == copy["fitter"].tensors.keys()


@pytest.mark.parametrize("change,named", [
    ({"fingerprint": {**FP, "weights_sha256": "c" * 64}}, "model "),
    ({"recipe": parse_recipe({**RECIPE, "name": "other"})}, "recipe resume-test@"),
    ({"data": "bible"}, "data ptb/valid → bible/valid"),
    ({"split": "train"}, "data ptb/valid → ptb/train"),
    ({"seed": 1}, "seed 0 → 1"),
    ({"samples": 8, "seq_len": 32}, "samples 4 → 8, seq_len 16 → 32"),
    ({"tokens": torch.arange(64).view(4, 16).flip(0)}, "the data's content changed"),
    ({"device": "cuda"}, "device cpu ("),
])
def test_resume_refuses_another_run(tmp_path, change, named):
    out = tmp_path / "calib"
    resume.PartialState(out, _key(), {}).save("layers", 0, 0.0)
    with pytest.raises(UserError, match="cannot resume") as e:
        resume.PartialState(out, _key(**change), {}).open(resume=True)
    assert named in str(e.value) and "delete" in str(e.value), str(e.value)
    if "seed" in change:  # the seed is its own field, not a recipe change too
        assert "recipe" not in str(e.value)


def test_resume_refuses_other_code_or_torch(tmp_path, monkeypatch):
    out = tmp_path / "calib"
    resume.PartialState(out, _key(), {}).save("layers", 0, 0.0)
    monkeypatch.setattr(resume, "source_hash", lambda: "0" * 16)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    with pytest.raises(UserError) as e:
        resume.PartialState(out, _key(), {}).open(resume=True)
    assert "code moec" in str(e.value) and "source 0000000000000000" in str(e.value), str(e.value)
    assert f"torch {torch.__version__}" not in str(e.value) and "→ 9.9.9" in str(e.value)


def test_partial_state_presence(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=resume.__name__)
    out = tmp_path / "calib"
    assert resume.PartialState(out, _key(), {}).open(resume=True) is None  # none: start fresh, say so
    assert "no partial state" in caplog.text
    resume.partial_dir(out).mkdir()
    (resume.partial_dir(out) / "state-00001.safetensors").write_bytes(b"")  # first save killed: nothing to lose
    assert resume.PartialState(out, _key(), {}).open(resume=False) is None
    assert not resume.partial_dir(out).exists()
    resume.PartialState(out, _key(), {}).save("tune", 1, 0.0)
    with pytest.raises(UserError, match=r"all layers and the tune step done\); pass --resume"):
        resume.PartialState(out, _key(), {}).open(resume=False)
    with pytest.raises(UserError, match=r"all layers and the tune step done\); pass --resume"):
        resume.refuse_without_resume(out)  # the early check calibrate makes before hashing the weights

