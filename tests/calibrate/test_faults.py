"""Numerical faults during calibrate (moec/calibrate/faults.py): refused with a message naming where, or
repaired with a report entry; every test runs `calibrate` in-process on a modified copy of the tiny MoE."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moec.calibrate.faults import fault_report
from moec.calibrate.hessian import regularize
from moec.calibrate.recipe import parse_recipe
from moec.calibrate.run import calibrate
from moec.errors import UserError
from moec.runtime.hf_layout import HFCheckpoint

FP16 = parse_recipe({"name": "fp16"})
EXP = "model.layers.{i}.block_sparse_moe"


def _edited(src, dst, edit):
    """A copy of the HF directory `src` whose tensors `edit(state)` changed in place."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _hls(policy="damped-identity", min_tokens=0, kv=None, targets=("experts",)):
    r = {"name": "q", "weights": [{"targets": list(targets), "codec": "hls", "bits": 2, "group_size": 0}],
         "calibration": {"expert_policy": policy, "min_expert_tokens": min_tokens}}
    return parse_recipe(r | ({"kv": kv} if kv else {}))


def test_nan_source_weight_is_refused_naming_the_tensor(tiny_moe_dir, tmp_path):
    def edit(s):
        s[f"{EXP.format(i=1)}.experts.3.w2.weight"][5, 7] = float("nan")

    model = _edited(tiny_moe_dir, tmp_path / "m", edit)
    with pytest.raises(UserError, match=r"source weight layers\.1\.moe\.w2 \[5, 48, 40\] holds 1 non-finite.*"
                                        r"index \(3, 5, 7\)"):
        calibrate(model, "m", FP16, "ptb", "valid", 2, 32, 0, tmp_path / "calib")
    assert not (tmp_path / "calib").exists()


@pytest.mark.parametrize("layer,where", [(0, "entering layer 1 (the output of layer 0's FFN)"),
                                         (1, "after layer 1's FFN")])
def test_overflowing_activations_are_refused_naming_the_layer(tiny_moe_dir, tmp_path, layer, where):
    """Finite weights (1e30 fits bf16) whose FFN overflows fp32: silu(x·w1)·(x·w3) ~ 1e60."""
    def edit(s):
        for e in range(5):
            for w in ("w1", "w3"):
                s[f"{EXP.format(i=layer)}.experts.{e}.{w}.weight"].fill_(1e30)

    model = _edited(tiny_moe_dir, tmp_path / "m", edit)
    with pytest.raises(UserError, match=re.escape(f"non-finite activations (NaN/inf) {where}")):
        calibrate(model, "m", FP16, "ptb", "valid", 2, 32, 0, tmp_path / "calib")


@pytest.mark.parametrize("policy,min_tokens,source", [("damped-identity", 0, "identity"),
                                                      ("all-experts-for-stats", 1, "all-tokens")])
def test_expert_the_router_never_picks(tiny_moe_dir, tmp_path, policy, min_tokens, source):
    """Router rows s_e·u with s = (1, 2, 0, -1, -2): whatever the sign of x·u, two experts score above
    expert 2's constant 0, so top-2 never picks it. It is fitted from the policy's Hessian and reported."""
    def edit(s):
        gate = s[f"{EXP.format(i=0)}.gate.weight"]  # [E, D]
        gate.copy_(torch.tensor([1.0, 2.0, 0.0, -1.0, -2.0])[:, None] * gate[0])

    model = _edited(tiny_moe_dir, tmp_path / "m", edit)
    calib = tmp_path / "calib"
    report = calibrate(model, "m", _hls(policy, min_tokens), "ptb", "valid", 2, 32, 0, calib)
    layer0 = report["layers"][0]
    assert layer0["experts"]["tokens"][2] == 0 and min(layer0["experts"]["tokens"][:2]) > 0
    ex2 = layer0["weights"]["experts"][2]
    assert (ex2["hessian_w13"], ex2["hessian_w2"]) == (source, source), ex2
    assert {"layer": 0, "expert": 2, "fault": "no tokens", "action": f"fitted with the {source} Hessian"} \
        in report["faults"]
    saved = json.loads((calib / "report.json").read_text())
    assert saved["faults"] == report["faults"]
    fitted = load_file(str(calib / "calib.safetensors"))
    for p in ("w1", "w2", "w3"):  # a finite fit whose expert-2 error is a real least-squares error (< 1)
        assert all(torch.isfinite(v.float()).all() for k, v in fitted.items() if k.startswith(f"fit.layers.0.moe.{p}"))
        assert 0 < layer0["weights"][p]["rel_output_error"][2] < 1


def test_all_zero_calibration_batch(tiny_moe_dir, tmp_path):
    """A text of padding tokens whose embedding row is zero: every activation is zero, so every Hessian is
    zero. The fits fall back to the identity, the KV fit still writes finite tensors, the report says so."""
    model = _edited(tiny_moe_dir, tmp_path / "m", lambda s: s["model.embed_tokens.weight"][0].zero_())
    text = tmp_path / "pad.txt"
    text.write_text("<|endoftext|>" * 200)
    calib = tmp_path / "calib"
    recipe = _hls(kv={"codec": "nuq-outlier", "bits": 2}, targets=("experts", "attention"))
    report = calibrate(model, "m", recipe, str(text), "train", 2, 32, 0, calib)
    kinds = {f["fault"] for f in report["faults"]}
    assert kinds == {"all-zero Hessian", "no tokens"}, report["faults"]
    for i in range(2):
        att = {f["attention"] for f in report["faults"] if f["layer"] == i and "attention" in f}
        assert att == {"qkv", "o"}
        assert report["layers"][i]["k_absmax"] == 0
    assert all(torch.isfinite(v.float()).all() for v in load_file(str(calib / "calib.safetensors")).values())


def test_text_shorter_than_one_sample_is_refused_before_any_weight_is_read(tiny_moe_dir, tmp_path, monkeypatch):
    text = tmp_path / "short.txt"
    text.write_text("a short text of a few words")
    monkeypatch.setattr(HFCheckpoint, "get", lambda self, name: pytest.fail(f"read {name}"))  # no weight read
    with pytest.raises(UserError, match=r"the calibration text has \d+ tokens, fewer than --seq-len 64") as e:
        calibrate(tiny_moe_dir, "m", FP16, str(text), "train", 2, 64, 0, tmp_path / "calib")
    assert re.search(r"has (\d+) tokens.*pass a longer text or --seq-len \1 or less", str(e.value)), e.value


def _spd(eigs: list[float], seed: int = 0) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=torch.Generator().manual_seed(seed)))
    return q @ torch.diag(torch.tensor(eigs)) @ q.T


def test_hessians_that_are_not_positive_definite():
    # fewer tokens than dims (rank 4 of 32): the default damping (1% of mean(diag)) is enough
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    H, note = regularize(x.T @ x)
    assert torch.linalg.cholesky_ex(x.T @ x)[1].item() != 0
    assert note == {"status": "ok", "damp": 0.01} and torch.linalg.cholesky_ex(H)[1].item() == 0
    # a negative eigenvalue of 0.2 · mean(diag) (rounding gone wrong): damped ×10 twice, to 1.0
    bad = _spd([1.0] * 31 + [-0.2])
    H, note = regularize(bad)
    assert note["status"] == "extra-damped" and note["damp"] == pytest.approx(1.0), note
    assert torch.linalg.cholesky_ex(H)[1].item() == 0
    # hopeless (an eigenvalue of about -10^4 · mean(diag), beyond the last damping of 10^3): the identity
    H, note = regularize(_spd([1.0] * 31 + [-30.9]))
    assert note["status"] == "singular" and torch.equal(H, torch.eye(32))
    layers = [{"layer": 3, "weights": {"experts": [
        {"tokens": 9, "status_w13": "extra-damped", "damp_w13": 1.0, "hessian_w13": "routed",
         "status_w2": "singular", "damp_w2": None}]}}]
    assert fault_report(layers) == [
        {"layer": 3, "expert": 0, "matrix": "w13", "fault": "not positive definite",
         "action": "damped with 1·mean(diag)·I"},
        {"layer": 3, "expert": 0, "matrix": "w2", "fault": "not positive definite after damping",
         "action": "identity Hessian (weights alone)"}]
