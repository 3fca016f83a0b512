"""calibrate → pack → eval with quantized experts on the tiny MoE; bad recipes exit 2 with a message."""

import json
import re

import pytest
import torch
import yaml
from safetensors.torch import load_file

from moec.calibrate.fit_experts import ExpertFitter, plan
from moec.calibrate.pack import pack
from moec.calibrate.recipe import WeightRule, load_recipe, parse_recipe
from moec.calibrate.run import calibrate
from moec.errors import UserError
from moec.runtime.experts import dequantize
from moec.runtime.hf_layout import HFCheckpoint
from moec.runtime.loader import load_model
from moec.runtime.model import build_model
from tests.cli.run import moec


def _recipe(tmp_path, name="q", calibration=None, **rule):
    r = {"name": name, "weights": [{"targets": ["experts"], "codec": "hls", "bits": 2, "group_size": 0, **rule}],
         "calibration": calibration or {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 0}}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(r))
    return p


def _calibrate(model_dir, recipe, out):
    return moec("calibrate", model_dir, "--recipe", recipe, "--data", "ptb", "--split", "valid", "--samples", "4",
                "--seq-len", "64", "-o", out)


def test_hls2_pipeline(tiny_moe_dir, tmp_path):
    calib, packed = tmp_path / "calib", tmp_path / "packed"
    # calibrate and pack in-process (the CLI wrappers are covered by test_pipeline.py); eval via the CLI
    calibrate(tiny_moe_dir, "tiny", load_recipe(_recipe(tmp_path)), "ptb", "valid", 4, 64, 0, calib)
    report = json.loads((calib / "report.json").read_text())
    for layer in report["layers"]:
        w = layer["weights"]
        assert [x["hessian_w13"] for x in w["experts"]] == ["routed"] * 5, w["experts"]
        for p in ("w1", "w3", "w2"):  # relative output error of a 2-bit fit: well below 1, above 0
            assert all(0 < e < 0.5 for e in w[p]["rel_output_error"]), w[p]
    pack(tiny_moe_dir, "tiny", calib, packed)
    man = json.loads((packed / "moec.json").read_text())
    # tiny dims (D = 48, I = 40): per-row int8 codebook + fp16 scale = 48 bits per row on top of 2 bits
    want = (2 * (2 + 48 / 48) + (2 + 48 / 40)) / 3
    assert man["effective_bits"]["q_bits"] == pytest.approx(want)
    assert man["tensors"]["layers.0.moe.w2.codes"]["param"] == "layers.0.moe.w2"

    # The runtime's quantized experts compute what the source model computes with W_hat in place of W.
    model, _ = load_model(packed)
    stored = load_file(str(next(packed.glob("model-*.safetensors"))))
    src = HFCheckpoint(tiny_moe_dir).state_dict()
    for name in [n for n in src if n.endswith(("moe.w1", "moe.w2", "moe.w3"))]:
        parts = {k.removeprefix(name + "."): v for k, v in stored.items() if k.startswith(name + ".")}
        src[name] = dequantize("hls", 2, tuple(src[name].shape), parts)
    ref = build_model(model.args, src, dtype=torch.float32)
    x = torch.randint(0, model.args.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)
        assert not torch.allclose(model(x), build_model(model.args, HFCheckpoint(tiny_moe_dir).state_dict(),
                                                        dtype=torch.float32)(x), atol=1e-3)

    out = tmp_path / "eval.json"
    r = moec("eval", packed, "--mode", "tf", "--max-windows", "1", "--window", "128", "--baseline", tiny_moe_dir,
             "--json", out)
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())[0]
    assert rec["kld"] > 0 and rec["ppl"] > 0


@pytest.mark.parametrize("policy,source", [("all-experts-for-stats", "all-tokens"), ("damped-identity", "identity")])
def test_starved_expert_policy_reported(tiny_moe_dir, tmp_path, policy, source):
    recipe = parse_recipe({"weights": [{"targets": ["experts"], "codec": "rtn", "bits": 3}],
                           "calibration": {"expert_policy": policy, "min_expert_tokens": 10**6}})
    report = calibrate(tiny_moe_dir, "tiny", recipe, "ptb", "valid", 2, 32, 0, tmp_path / "calib")
    for layer in report["layers"]:
        assert layer["experts_under_policy"] == [0, 1, 2, 3, 4]
        assert {x["hessian_w13"] for x in layer["weights"]["experts"]} == {source}
        assert {x["hessian_w2"] for x in layer["weights"]["experts"]} == {source}


@pytest.mark.parametrize("rule,message", [
    ({"bits": 5}, "bits in {2, 3, 4}"),
    ({"codec": "fp8", "bits": 4}, "bits in {8}"),
    ({"group_size": 7}, "does not divide the input dim"),
    ({"targets": ["mlp"]}, "selects no tensor"),
    ({"targets": ["attention"]}, "quantizes only expert and dense-MLP"),
])
def test_bad_weight_rules(tiny_moe_dir, rule, message):
    args = HFCheckpoint(tiny_moe_dir).args
    with pytest.raises(UserError, match=re.escape(message)):
        plan(args, parse_recipe({"weights": [{"targets": ["experts"], "codec": "hls", "bits": 2, **rule}]}))


def test_bad_weight_rule_exits_2(tiny_moe_dir, tmp_path):
    r = _calibrate(tiny_moe_dir, _recipe(tmp_path, bits=5), tmp_path / "calib")
    assert r.returncode == 2 and "bits in {2, 3, 4}" in r.stderr, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("rule,message", [  # bits outside {2, 3, 4, 8}: test_bad_weight_rule_exits_2
    ({"group_size": 7}, "does not divide the input dim"),
    ({"targets": ["mlp"]}, "selects no tensor"),  # no dense MLP in a MoE model: nothing the rule can target
])
def test_bad_weight_rules_exit_2(tiny_moe_dir, tmp_path, rule, message):
    out = tmp_path / "calib"
    r = _calibrate(tiny_moe_dir, _recipe(tmp_path, **rule), out)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and not out.exists()


@pytest.mark.parametrize("bad", ["nan", "inf", "singular"])
def test_bad_expert_hessian_is_damped_and_reported(bad):
    """An expert whose Hessian holds NaN/inf falls back to the identity, a rank-deficient one is damped;
    the fit still writes finite weights and the report says what happened to that expert."""
    E, D, I = 3, 16, 8
    g = torch.Generator().manual_seed(0)
    sd = {"layers.0.moe.w1": torch.randn(E, I, D, generator=g), "layers.0.moe.w3": torch.randn(E, I, D, generator=g),
          "layers.0.moe.w2": torch.randn(E, D, I, generator=g)}
    x, a = torch.randn(64, D, generator=g), torch.randn(64, I, generator=g)
    stats = {"H1": (x.T @ x).expand(E, D, D).clone(), "H2": (a.T @ a).expand(E, I, I).clone(),
             "count": torch.full((E,), 64)}
    if bad == "singular":
        stats["H1"][1] = x[:2].T @ x[:2]  # rank 2 of 16
    else:
        stats["H1"][1, 0, 0] = float(bad)
        stats["H2"][1, 2, 3] = float(bad)
    rule = WeightRule(targets=["experts"], codec="hls", bits=2, group_size=0, gptq=True)
    fitter = ExpertFitter({f"layers.0.moe.{p}": rule for p in ("w1", "w2", "w3")}, lambda i: sd,
                          "all-experts-for-stats", 0)
    fitter.on_layer(0, stats)
    ex = fitter.report[0]["experts"]
    if bad == "singular":
        assert ex[1]["hessian_w13"] == "routed" and ex[1]["status_w13"] in ("ok", "extra-damped"), ex[1]
    else:
        assert (ex[1]["hessian_w13"], ex[1]["status_w13"]) == ("identity", "non-finite"), ex[1]
        assert (ex[1]["hessian_w2"], ex[1]["status_w2"]) == ("identity", "non-finite"), ex[1]
    assert [e["status_w13"] for i, e in enumerate(ex) if i != 1] == ["ok", "ok"]
    for p in ("w1", "w2", "w3"):
        parts = {k.split(".")[-1]: v for k, v in fitter.tensors.items() if k.startswith(f"fit.layers.0.moe.{p}.")}
        W_hat = dequantize("hls", 2, tuple(sd[f"layers.0.moe.{p}"].shape), parts)
        assert torch.isfinite(W_hat).all() and all(torch.isfinite(v.float()).all() for v in parts.values())
        assert all(0 < e < 1 for e in fitter.report[0][p]["rel_output_error"]), fitter.report[0][p]


def test_demo_moe_hls3_perplexity_bound(tmp_path):
    """experts-hls3.yaml on the trained demo-moe with a small calibration set (8 × 256 tokens), eval on
    2 windows. On the full protocol hls3 measures about +4% (benchmarks/results/expert_quality_demo-moe.json)
    and per-row RTN at 3 bits +18%; the bound (+12%) leaves room for the smaller calibration set and
    catches a fit, pack or runtime dequant that is wrong (those land at RTN level or far above)."""
    calib, packed, out = tmp_path / "calib", tmp_path / "packed", tmp_path / "eval.json"
    r = moec("calibrate", "demo-moe", "--recipe", "recipes/experts-hls3.yaml", "--data", "ptb", "--split", "train",
             "--samples", "8", "--seq-len", "256", "-o", calib)
    assert r.returncode == 0, r.stderr
    assert moec("pack", "demo-moe", calib, "-o", packed).returncode == 0
    man = json.loads((packed / "moec.json").read_text())
    assert man["effective_bits"]["q_bits"] == pytest.approx((2 * (3 + 80 / 256) + (3 + 80 / 160)) / 3)
    r = moec("eval", packed, "--baseline", "demo-moe", "--max-windows", "2", "--mode", "tf", "--json", out)
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())[0]  # measured: +6.5%, kld 0.154 (8 × 256 calibration tokens)
    assert -2.0 < rec["delta_pct"] < 12.0 and 0 < rec["kld"] < 0.2, rec


def test_codebook_tuning_lowers_kl(tiny_moe_dir, tmp_path):
    """calibration.tune_steps: codebooks tuned end to end, same stored layout, lower KL on the calibration data."""
    cal = {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 0, "tune_steps": 12, "tune_lr": 0.02}
    plain = calibrate(tiny_moe_dir, "tiny", load_recipe(_recipe(tmp_path, "plain")), "ptb", "valid", 4, 32, 0,
                      tmp_path / "c0")
    report = calibrate(tiny_moe_dir, "tiny", load_recipe(_recipe(tmp_path, "tuned", calibration=cal)), "ptb",
                       "valid", 4, 32, 0, tmp_path / "c1")
    assert "tune" not in plain and report["tune"]["steps"] == 12
    assert report["tune"]["kl_last"] < report["tune"]["kl_first"], report["tune"]
    a, b = load_file(str(tmp_path / "c0" / "calib.safetensors")), load_file(str(tmp_path / "c1" / "calib.safetensors"))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    assert torch.equal(a["fit.layers.0.moe.w2.codes"], b["fit.layers.0.moe.w2.codes"])  # indices stay
    assert not torch.equal(a["fit.layers.0.moe.w2.codebook"], b["fit.layers.0.moe.w2.codebook"])
    pack(tiny_moe_dir, "tiny", tmp_path / "c1", tmp_path / "packed")
    model, _ = load_model(tmp_path / "packed")
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, model.args.vocab_size, (1, 16)))).all()
