"""calibrate → pack → eval (decode mode) with the latent KV caches, through the CLI, on demo-moe."""

import json

import yaml

from tests.cli.run import moec


def _pipeline(tmp_path, kv: dict) -> tuple:
    """calibrate (PTB valid, 2 x 64 tokens) -> pack -> eval --mode dec (1 window of 128) on demo-moe:
    (calibration report's kv section, pack manifest, eval record)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "kv": kv}))
    calib, packed, out = tmp_path / "c", tmp_path / "p", tmp_path / "e.json"
    r = moec("calibrate", "demo-moe", "--recipe", recipe, "--data", "ptb", "--split", "valid", "--samples", "2",
             "--seq-len", "64", "-o", calib)
    assert r.returncode == 0, r.stderr
    r = moec("pack", "demo-moe", calib, "-o", packed)
    assert r.returncode == 0, r.stderr
    r = moec("eval", packed, "--mode", "dec", "--max-windows", "1", "--seq-len", "128", "--baseline", "demo-moe",
             "--json", out)
    assert r.returncode == 0, r.stderr
    (rec,) = json.loads(out.read_text())
    return (json.loads((calib / "report.json").read_text())["kv"], json.loads((packed / "moec.json").read_text()),
            rec)


def test_latent_layer_pipeline_on_demo_moe(tmp_path):
    # cross-layer (G = 3 of demo-moe's 4 layers: a full group and a short last one), pre-RoPE keys
    rep, manifest, rec = _pipeline(tmp_path, {
        "codec": "latent-layer", "bits": 4, "window": 32, "sinks": 2, "block": 16, "rope": "pre",
        "latent": {"rank_k": 64, "rank_v": 96, "group_layers": 3, "outlier_frac": 0.005}})
    assert [g["layers"] for g in rep["groups"]] == [[0, 1, 2], [3]] and rep["groups"][1]["v"]["rank"] == 64
    assert manifest["recipe"]["kv"]["codec"] == "latent-layer"
    assert manifest["tensors"]["kv.groups.0.k_basis"]["shape"] == [192, 64]
    # 128 tokens, batch 1: the fp16 window and the bases (fp16, ~100 KB) dominate (can exceed 16); at 32k:
    # (64 + 96 latent dims of 3 layers, 64 + 64 of 1) × 4 bits per 512 elements = 2.25, + 0.16 outliers + bases
    assert rec["kv_codec"] == "latent-layer" and rec["kv_bits"] > 8 and 2.3 < rec["kv_bits_32k"] < 2.7, rec
    # demo-moe (ppl ~38) with 2 × 64 calibration tokens: kld ~0.05 on this window (0.02 with the benchmark's
    # 8k-token calibration); a broken cache (wrong positions, basis or rotation) moves it far more
    assert 0 < rec["kld"] < 0.1 and rec["top1"] > 0.8 and abs(rec["delta_pct"]) < 5, rec


def test_ternary_latent_pipeline_on_demo_moe(tmp_path):
    """Seed 001's sub-2-bit option (latent bits 1 = ternary, five trits per byte) end to end."""
    _, manifest, rec = _pipeline(tmp_path, {
        "codec": "latent-layer", "bits": 1, "window": 32, "sinks": 2, "block": 16, "rope": "post",
        "latent": {"rank_k": 48, "rank_v": 48, "group_layers": 2, "outlier_frac": 0.005}})
    assert manifest["recipe"]["kv"]["bits"] == 1
    # at 32k: 48 trits = 10 bytes per token, group (2 layers × 2 heads × 32 = 128 dims) and kind: 0.625 bits,
    # + outliers 0.005 × 32 bits = 0.16, + the fp16 window and the fp16 bases (~0.1)
    assert 0.75 < rec["kv_bits_32k"] < 1.0, rec
    assert 0 < rec["kld"] < 0.3 and rec["top1"] > 0.6, rec


def test_latent_rank_too_large_is_one_line(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump({"kv": {"codec": "latent-head", "bits": 4, "latent": {"rank_k": 72}}}))
    r = moec("calibrate", "demo-moe", "--recipe", recipe, "--data", "ptb", "--split", "valid", "--samples", "1",
             "--seq-len", "16", "-o", tmp_path / "c")
    assert r.returncode == 2 and "kv.latent.rank_k 72 exceeds the 64 dims" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

