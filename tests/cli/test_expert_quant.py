"""calibrate → pack → eval with quantized experts on the tiny MoE; bad recipes exit 2 with a message."""

import json
import re

import pytest
import torch
import yaml
from safetensors.torch import load_file

from moec.calibrate.fit_experts import plan
from moec.calibrate.pack import pack
from moec.calibrate.recipe import load_recipe, parse_recipe
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
