"""Bad input: one clear line naming the problem, exit code 2, no traceback, no partial output."""

import json
import shutil

import pytest

from moec import atomic
from moec.formats.checkpoint import FORMAT_VERSION
from tests.cli.run import moec


def assert_clean_failure(r, *needles, outputs=()):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    err = r.stderr.strip().splitlines()[-1]
    assert errors == [err] and err.startswith("moec: error:"), r.stderr
    for n in needles:
        assert n in err, (n, err)
    for o in outputs:
        assert not o.exists(), f"{o} left behind"
        assert not atomic.temporaries(o), "temporary directory left behind"
        assert not atomic.lock_path(o).exists(), "lock file left behind"


def calibrate(model, out, *extra, recipe="moec/recipes/fp16.yaml"):
    return moec("calibrate", model, "--recipe", recipe, "--data", "ptb", "--split", "valid", "--samples", "2",
                "--seq-len", "32", "-o", out, *extra)


def test_missing_model_path(tmp_path):
    out = tmp_path / "calib"
    assert_clean_failure(calibrate(tmp_path / "nope", out), "nope", "no such path", outputs=[out])


def test_unknown_builtin(tmp_path):
    out = tmp_path / "calib"
    assert_clean_failure(calibrate("smollm3-1b", out), "'smollm3-1b'", "demo-moe", outputs=[out])


def test_unsupported_architecture(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    out = tmp_path / "calib"
    assert_clean_failure(calibrate(tmp_path / "m", out), "unsupported architecture 'gpt2'", "mixtral",
                         outputs=[out])


@pytest.mark.parametrize("body,needle", [
    ("kv:\n  codec: fp16\n  windw: 64\n", "unknown key 'windw'"),
    ("weights:\n  - targets: [experts]\n    bits: two\n", "expected int, got str 'two'"),
    ("kv:\n  codec: zip\n", "kv codec 'zip' is not registered"),
    ("calibration: [1, 2]\n", "expected a mapping"),
])
def test_bad_recipe(tiny_moe_dir, tmp_path, body, needle):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(body)
    out = tmp_path / "calib"
    assert_clean_failure(calibrate(tiny_moe_dir, out, recipe=recipe), needle, outputs=[out])


def test_data_path_missing_or_empty(tiny_moe_dir, tmp_path):
    out = tmp_path / "calib"
    r = moec("calibrate", tiny_moe_dir, "--recipe", "moec/recipes/fp16.yaml", "--data", tmp_path / "none.txt",
             "-o", out)
    assert_clean_failure(r, "none.txt", "does not exist", outputs=[out])
    (tmp_path / "empty.txt").write_text("")
    r = moec("calibrate", tiny_moe_dir, "--recipe", "moec/recipes/fp16.yaml", "--data", tmp_path / "empty.txt",
             "-o", out)
    assert_clean_failure(r, "empty.txt", "is empty", outputs=[out])


def test_seq_len_too_long(tiny_moe_dir, tmp_path):
    out = tmp_path / "calib"
    r = moec("calibrate", tiny_moe_dir, "--recipe", "moec/recipes/fp16.yaml", "--seq-len", "4096", "-o", out)
    assert_clean_failure(r, "--seq-len 4096", "512", outputs=[out])
    r = moec("eval", tiny_moe_dir, "--seq-len", "4096", "--max-windows", "1")
    assert_clean_failure(r, "--seq-len 4096", "512")


def test_calibrating_on_eval_split_is_refused(tiny_moe_dir, tmp_path):
    out = tmp_path / "calib"
    r = moec("calibrate", tiny_moe_dir, "--recipe", "moec/recipes/fp16.yaml", "--split", "test", "-o", out)
    assert_clean_failure(r, "evaluation split", outputs=[out])


@pytest.fixture(scope="module")
def packed(tiny_moe_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    r = moec("calibrate", tiny_moe_dir, "--recipe", "moec/recipes/fp16.yaml", "--split", "valid", "--samples", "2",
             "--seq-len", "32", "-o", d / "calib")
    assert r.returncode == 0, r.stderr
    r = moec("pack", tiny_moe_dir, d / "calib", "-o", d / "packed")
    assert r.returncode == 0, r.stderr
    return d / "packed"


def _copy(packed, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(packed, dst)
    return dst, next(dst.glob("model-*.safetensors"))


def test_truncated_shard(packed, tmp_path):
    ck, shard = _copy(packed, tmp_path)
    shard.write_bytes(shard.read_bytes()[:-100])
    assert_clean_failure(moec("eval", ck, "--max-windows", "1", "--seq-len", "64"), shard.name, "truncated")
    assert_clean_failure(moec("inspect", ck), shard.name, "truncated")


def test_changed_byte(packed, tmp_path):
    ck, shard = _copy(packed, tmp_path)
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x01
    shard.write_bytes(bytes(data))
    assert_clean_failure(moec("eval", ck, "--max-windows", "1", "--seq-len", "64"), shard.name, "sha256 mismatch")


def test_missing_manifest(packed, tmp_path):
    ck, _ = _copy(packed, tmp_path)
    (ck / "moec.json").unlink()
    assert_clean_failure(moec("inspect", ck), "missing manifest moec.json")


def test_newer_format_version(packed, tmp_path):
    ck, _ = _copy(packed, tmp_path)
    m = json.loads((ck / "moec.json").read_text())
    m["format_version"] = FORMAT_VERSION + 1
    (ck / "moec.json").write_text(json.dumps(m))
    assert_clean_failure(moec("eval", ck, "--max-windows", "1", "--seq-len", "64"),
                         f"format_version {FORMAT_VERSION + 1}", "newer than this moec reads")


def test_pack_with_wrong_model_leaves_nothing(tiny_moe_dir, packed, tmp_path):
    # the calibration of the tiny model, packed against a copy whose weights differ: refused
    other = tmp_path / "other"
    shutil.copytree(tiny_moe_dir, other)
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    out = tmp_path / "p2"
    r = moec("pack", other, packed.parent / "calib", "-o", out)
    assert_clean_failure(r, "calibrated on another model", outputs=[out])


@pytest.mark.parametrize("args,needle", [(("eval", "--nonsense"), "--nonsense"),
                                         (("eval", "demo-moe", "--baseline"), "--baseline")])
def test_usage_errors_are_one_line(args, needle):
    """Unknown options and missing option values: click's usage error (typer ships its own click copy,
    whose errors must not surface as an internal error)."""
    assert_clean_failure(moec(*args), needle)


def test_bad_codec_plugin_is_one_line(tiny_moe_dir, tmp_path, monkeypatch):
    """MOEC_PLUGINS naming a module that does not import: a usage error (exit 2) at the first codec lookup."""
    monkeypatch.setenv("MOEC_PLUGINS", "no_such_codec_module")
    out = tmp_path / "calib"
    assert_clean_failure(calibrate(tiny_moe_dir, out, recipe="moec/recipes/kv-kivi2.yaml"),
                         "MOEC_PLUGINS: cannot import 'no_such_codec_module'", outputs=[out])


def test_calibration_larger_than_memory_is_refused(tiny_moe_dir, tmp_path):
    """10^8 samples × 512 tokens: about 10 TB of hidden states; refused before any window is sampled."""
    out = tmp_path / "calib"
    r = calibrate(tiny_moe_dir, out, "--samples", "100000000", "--seq-len", "512")
    assert_clean_failure(r, "calibrating 100000000 × 512 tokens needs about host", "--samples", "would fit",
                         "MOEC_SKIP_MEMORY_CHECK=1", outputs=[out])



def test_uncached_hub_data_fails_before_the_model(tmp_path, monkeypatch):
    """Offline, an uncached hub data set is one line at once, before MODEL (absent here) is even looked at;
    the other data errors are checked in-process in tests/calibrate/test_dataspec.py."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # tests never use the network
    out = tmp_path / "calib"
    r = moec("calibrate", tmp_path / "no-model", "--recipe", "moec/recipes/fp16.yaml", "--data", "moec-tests/uncached",
             "--data-config", "c1", "-o", out)
    assert_clean_failure(r, "hub data set 'moec-tests/uncached' (config 'c1') is not in the local cache and "
                            "HF_HUB_OFFLINE is set", outputs=[out])
