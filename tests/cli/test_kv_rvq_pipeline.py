"""calibrate → pack → eval (decode mode) with the tiered residual-VQ KV cache, through the CLI, on demo-moe.

Small codebooks and a 160-token window with the archive boundary at 80 tokens, so all three tiers
(fp16 window, middle RVQ, archive re-encoded from the middle tier) are used within the test budget."""

import json

import pytest
import torch
import yaml

from moec.errors import FormatError
from moec.runtime.loader import load_model
from moec.runtime.rvq import build_rvq_codecs
from tests.cli.run import moec


@pytest.fixture(scope="module")
def rvq_packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rvq")
    recipe = tmp / "rvq.yaml"
    recipe.write_text(yaml.safe_dump({"name": "rvq-test", "kv": {
        "codec": "rvq-tiered", "bits": 2, "window": 32, "sinks": 4, "block": 16,
        "rvq": {"mid_sizes": [32, 16], "mid_dim": 4, "archive_after": 80, "arch_sizes": [32], "arch_dim": 4,
                "iters": 4, "max_samples": 512}}}))
    calib, packed = tmp / "calib", tmp / "packed"
    r = moec("calibrate", "demo-moe", "--recipe", recipe, "--data", "ptb", "--split", "valid", "--samples", "2",
             "--seq-len", "128", "-o", calib)
    assert r.returncode == 0, r.stderr
    rep = json.loads((calib / "report.json").read_text())["kv"]
    layer = rep["layers"][0]
    assert layer["k_mid_stage_err"][1] < layer["k_mid_stage_err"][0] < 1  # residual stage lowers the error
    assert layer["k_arch_from_mid_err"] >= layer["k_arch_from_original_err"] - 1e-6
    r = moec("pack", "demo-moe", calib, "-o", packed)
    assert r.returncode == 0, r.stderr
    return packed


def test_rvq_pipeline_decodes(rvq_packed, tmp_path):
    manifest = json.loads((rvq_packed / "moec.json").read_text())
    assert manifest["recipe"]["kv"]["codec"] == "rvq-tiered" and manifest["recipe"]["kv"]["rvq"]["archive_after"] == 80
    assert manifest["tensors"]["kv.layers.3.v.arch.0"]["shape"] == [2, 8, 32, 4]  # demo-moe: 2 KV heads, d 32
    out = tmp_path / "eval.json"
    r = moec("eval", rvq_packed, "--mode", "dec", "--max-windows", "1", "--seq-len", "160", "--baseline", "demo-moe",
             "--json", out)
    assert r.returncode == 0, r.stderr
    (rec,) = json.loads(out.read_text())
    assert rec["kv_codec"] == "rvq-tiered" and rec["scored_tokens"] == 128
    # codes: 2.25 bits middle, 1.25 archive (almost all of 32k tokens); at 160 tokens the fp16 window and
    # the codebooks dominate
    assert 1.25 < rec["kv_bits_32k"] < 1.45 and rec["kv_bits"] > 4, rec
    # small codebooks cost a little on demo-moe (a trained model): KL and delta bounded
    assert 0 < rec["kld"] < 0.05 and abs(rec["delta_pct"]) < 6 and torch.isfinite(torch.tensor(rec["ppl"])), rec


def test_rvq_shape_mismatch_is_a_format_error(rvq_packed):
    model, info = load_model(rvq_packed)
    bad = dict(info["kv_tensors"])
    bad["kv.layers.1.k.mid.0"] = bad["kv.layers.1.k.mid.0"][:1]
    with pytest.raises(FormatError, match=r"kv.layers.1.k.mid.0 has shape \[1, 8, 32, 4\]"):
        build_rvq_codecs(info["kv"], bad, model.args)
    with pytest.raises(FormatError, match="is missing"):
        build_rvq_codecs(info["kv"], {k: v for k, v in info["kv_tensors"].items() if k != "kv.layers.2.v.arch.0"},
                         model.args)
