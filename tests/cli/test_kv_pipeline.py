"""calibrate → pack → eval with compressed KV caches, through the CLI, on the tiny MoE (head_dim 8)."""

import json

import pytest
import torch
import yaml

from moec.errors import FormatError
from moec.runtime.hf_layout import HFCheckpoint
from moec.runtime.kvtiered import build_codecs
from moec.runtime.loader import load_model
from tests.cli.run import moec


def _recipe(tmp_path, name, **kv):
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump({"name": name, "kv": kv}))
    return p


@pytest.fixture(scope="module")
def nuq_packed(tiny_moe_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv")
    recipe = _recipe(tmp, "nuq2", codec="nuq-outlier", bits=2, window=16, sinks=2, outlier_frac=0.02)
    calib, packed = tmp / "calib", tmp / "packed"
    r = moec("calibrate", tiny_moe_dir, "--recipe", recipe, "--data", "ptb", "--split", "valid", "--samples", "4",
             "--seq-len", "64", "-o", calib)
    assert r.returncode == 0, r.stderr
    r = moec("pack", tiny_moe_dir, calib, "-o", packed)
    assert r.returncode == 0, r.stderr
    return packed


def test_nuq_pipeline(nuq_packed, tiny_moe_dir, tmp_path):
    manifest = json.loads((nuq_packed / "moec.json").read_text())
    kv, recipe_kv = manifest["kv"], manifest["recipe"]["kv"]  # shapes / recipe keys, each stored once
    assert (recipe_kv["codec"], recipe_kv["bits"], kv["n_kv_heads"], kv["head_dim"]) == ("nuq-outlier", 2, 2, 8)
    assert manifest["tensors"]["kv.layers.1.k_scale"]["shape"] == [2, 8]
    # a KV-only recipe keeps every weight as the bf16 source stores it, never upcast (issue 18)
    kept = {n: e["dtype"] for n, e in manifest["tensors"].items() if e["codec"] == "keep"}
    source = HFCheckpoint(tiny_moe_dir).state_dict()
    assert kept == {n: str(t.dtype).removeprefix("torch.") for n, t in source.items()}, kept
    assert set(kept.values()) == {"bfloat16"}
    out = tmp_path / "eval.json"
    r = moec("eval", nuq_packed, "--mode", "dec", "--max-windows", "2", "--seq-len", "128", "--baseline",
             tiny_moe_dir, "--json", out)
    assert r.returncode == 0, r.stderr
    (rec,) = json.loads(out.read_text())
    assert rec["kv_codec"] == "nuq-outlier"
    # 128 tokens: 2 sinks + 3 blocks of 32 + 30 in the window; the fp16 window dominates at this length
    assert 6 < rec["kv_bits"] < 9, rec["kv_bits"]
    assert 2 < rec["kv_bits_32k"] < 4, rec["kv_bits_32k"]
    # the compressed cache changes the logits, but only a little on this near-uniform random model
    assert 0 < rec["kld"] < 0.05 and rec["top1"] > 0.8 and abs(rec["delta_pct"]) < 5, rec
    assert rec["scored_tokens"] == 2 * 96


def test_kv_shape_mismatch_is_a_format_error(nuq_packed):
    _, info = load_model(nuq_packed)
    args = load_model(nuq_packed)[0].args
    bad = {n: (t[:1] if n.endswith("k_scale") else t) for n, t in info["kv_tensors"].items()}
    with pytest.raises(FormatError, match="k_scale has shape"):
        build_codecs(info["kv"], bad, args)
    with pytest.raises(FormatError, match="KV calibration is for"):
        build_codecs(dict(info["kv"], n_kv_heads=4), info["kv_tensors"], args)


def test_kv_mismatch_at_eval_is_one_line(nuq_packed, tmp_path, tiny_moe_dir):
    """A checkpoint whose kv section disagrees with its model: exit 2 and one clear line."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(nuq_packed, bad)
    m = json.loads((bad / "moec.json").read_text())
    m["kv"]["head_dim"] = 16
    (bad / "moec.json").write_text(json.dumps(m))
    r = moec("eval", bad, "--mode", "dec", "--max-windows", "1", "--seq-len", "64")
    # refused by the manifest check (formats/checkpoint.check_model_fields) before the cache is built
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err and "Traceback" not in err, r.stderr
    assert "kv.head_dim 16" in err and "another model" in err, err


def test_kivi_group_must_divide_head_dim(tiny_moe_dir, tmp_path):
    recipe = _recipe(tmp_path, "kivi", codec="kivi", bits=2, group_size=32)
    r = moec("calibrate", tiny_moe_dir, "--recipe", recipe, "--data", "ptb", "--split", "valid", "--samples", "1",
             "--seq-len", "16", "-o", tmp_path / "c")
    assert r.returncode == 2 and "kv.group_size" in r.stderr, r.stderr


def test_kivi_pipeline_decodes(tiny_moe_dir, tmp_path):
    recipe = _recipe(tmp_path, "kivi4", codec="kivi", bits=4, group_size=8, window=16, sinks=0)
    calib, packed, out = tmp_path / "c", tmp_path / "p", tmp_path / "e.json"
    assert moec("calibrate", tiny_moe_dir, "--recipe", recipe, "--data", "ptb", "--split", "valid", "--samples",
                "1", "--seq-len", "16", "-o", calib).returncode == 0
    assert moec("pack", tiny_moe_dir, calib, "-o", packed).returncode == 0
    r = moec("eval", packed, "--mode", "dec", "--max-windows", "1", "--seq-len", "128", "--baseline", tiny_moe_dir,
             "--json", out)
    assert r.returncode == 0, r.stderr
    (rec,) = json.loads(out.read_text())
    # 4-bit KIVI, history: keys 4 + fp16 scale/zero per channel per 32-token block (1) = 5 bits, values
    # 4 + fp16 scale/zero per 8 channels (4) = 8 bits: 6.5 on average, plus the fp16 window at 32k
    assert rec["kv_codec"] == "kivi" and 6.5 < rec["kv_bits_32k"] < 6.6, rec
    assert 0 < rec["kld"] < 0.01 and abs(rec["delta_pct"]) < 1, rec
    assert torch.isfinite(torch.tensor(rec["ppl"]))
