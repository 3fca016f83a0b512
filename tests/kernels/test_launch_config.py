"""Launch constants as data (moec/kernels/launch_config.py): the per-device JSON ships in the package, a
device without a file of its own gets the defaults, a device file overrides single knobs, typos are errors,
and the kernel modules launch with what the loader returns for their device."""

from __future__ import annotations

import fnmatch
import json
import os
import tomllib
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the CPU runs the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.errors import UserError
from moec.kernels import launch_config as lc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(lc.ENV_DIR, raising=False)
    lc.clear_cache()
    yield
    lc.clear_cache()


def test_defaults_ship_as_package_data():
    """The JSON is found through importlib.resources (as from an installed wheel), and pyproject.toml's
    package-data covers every file of the config directory, so a wheel carries them."""
    files = lc.config_files()
    names = sorted(f.name for f in files.iterdir() if f.name.endswith(".json"))
    assert f"{lc.DEFAULT_KEY}.json" in names, names
    data = json.loads(files.joinpath(f"{lc.DEFAULT_KEY}.json").read_text())
    assert data["device"] == {"name": "NVIDIA H200", "sms": 132}
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["moec.kernels"]
    for name in names:
        assert any(fnmatch.fnmatch(f"configs/{name}", p) for p in patterns), (name, patterns)


def test_device_key():
    assert lc.device_key("NVIDIA H200") == lc.DEFAULT_KEY
    assert lc.device_key("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert lc.device_key("  AMD Instinct MI300X ") == "amd_instinct_mi300x"


def test_unknown_device_gets_the_defaults():
    got = lc.for_key("some_future_gpu")
    assert got == lc.defaults()
    for kernel in ("moe_decode", "moe_prefill", "qlinear", "kv_decode_attention", "fp16_decode_attention",
                   "latent_decode_attention", "rvq_lut_attention"):
        assert got[kernel] is lc.defaults()[kernel]  # the same objects: edits by a benchmark take effect
    assert lc.config("qlinear", "cpu") is lc.defaults()["qlinear"]
    assert lc.config("qlinear", None) is lc.defaults()["qlinear"]
    assert lc.num_sms("cpu") == lc.num_sms(None) == 132


def test_kernel_modules_expose_the_defaults():
    from moec.kernels import (
        fp16_decode_attention,
        kv_decode_attention,
        latent_decode_attention,
        moe_decode,
        moe_prefill,
        qlinear,
    )
    d = lc.defaults()
    assert moe_decode.DECODE_CONFIG is d["moe_decode"]["prmt"] and moe_decode.VQ_CONFIG is d["moe_decode"]["vq"]
    assert moe_prefill.SMALL_CONFIG is d["moe_prefill"]["small"]
    assert qlinear.GEMV_CONFIG is d["qlinear"]["gemv"]
    assert kv_decode_attention.CONFIG is d["kv_decode_attention"]["residual"]
    assert fp16_decode_attention.CONFIG is d["fp16_decode_attention"]["launch"]
    assert latent_decode_attention.CONFIG is d["latent_decode_attention"]["launch"]
    assert latent_decode_attention.BLOCK_N == d["latent_decode_attention"]["launch"]["block_res"]


def test_device_file_overrides_a_knob(tmp_path, monkeypatch):
    (tmp_path / "test_gpu_x.json").write_text(json.dumps({
        "_about": "a sweep's output", "device": {"sms": 78},
        "qlinear": {"gemv": {"block_o": 8}},
        "moe_decode": {"vq": {"num_warps": 4}}}))
    monkeypatch.setenv(lc.ENV_DIR, str(tmp_path))
    got, base = lc.for_key("test_gpu_x"), lc.defaults()
    assert got["qlinear"]["gemv"] == base["qlinear"]["gemv"] | {"block_o": 8}
    assert got["qlinear"]["gemm"] is base["qlinear"]["gemm"]  # untouched configs are the defaults
    assert got["moe_decode"]["vq"]["num_warps"] == 4 and got["moe_decode"]["vq"]["block_o"] == 8
    assert got["kv_decode_attention"] is base["kv_decode_attention"]
    assert got["device"] == {"name": "NVIDIA H200", "sms": 78}
    assert base["qlinear"]["gemv"]["block_o"] == 4 and base["moe_decode"]["vq"]["num_warps"] == 8  # not edited


def test_device_file_is_read_through_the_cuda_device_name(tmp_path, monkeypatch):
    """config(kernel, device) names the device's file from torch.cuda.get_device_name, once per device."""
    (tmp_path / "fake_gpu_9000.json").write_text(json.dumps({"fp16_decode_attention": {"launch": {"waves": 3}}}))
    monkeypatch.setenv(lc.ENV_DIR, str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: calls.append(dev) or "Fake GPU 9000")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: type("P", (), {"multi_processor_count": 7})())
    for _ in range(3):
        assert lc.config("fp16_decode_attention", torch.device("cuda", 0))["launch"]["waves"] == 3
    assert len(calls) == 1
    assert lc.num_sms(torch.device("cuda", 0)) == 7
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter: the defaults whatever the device
    assert lc.config("fp16_decode_attention", torch.device("cuda", 0))["launch"]["waves"] == 2
    assert lc.num_sms(torch.device("cuda", 0)) == 132


@pytest.mark.parametrize("over,needle", [
    ({"qlinear": {"gemv": {"block_0": 8}}}, "qlinear.gemv: unknown knobs ['block_0']"),
    ({"qlinear": {"gemvv": {"block_o": 8}}}, "qlinear: unknown config 'gemvv'"),
    ({"qlinaer": {}}, "unknown kernel 'qlinaer'"),
])
def test_device_file_typos_are_errors(tmp_path, monkeypatch, over, needle):
    (tmp_path / "typo_gpu.json").write_text(json.dumps(over))
    monkeypatch.setenv(lc.ENV_DIR, str(tmp_path))
    with pytest.raises(UserError) as e:  # bad input: one line at the CLI, exit 2
        lc.for_key("typo_gpu")
    assert needle in str(e.value) and "typo_gpu.json" in str(e.value) and "\n" not in str(e.value)


def test_device_file_that_is_not_json_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "broken_gpu.json").write_text("{not json")
    monkeypatch.setenv(lc.ENV_DIR, str(tmp_path))
    with pytest.raises(UserError, match=r"broken_gpu.json: not valid JSON"):
        lc.for_key("broken_gpu")


def test_launch_reads_the_device_config(monkeypatch):
    """qlinear takes its GEMV block from launch_config.config for its input's device at each launch (here
    the defaults, edited in place as a benchmark would)."""
    from moec.kernels import qlinear as ql
    from tests.kernels.moe_cases import qweight
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = qweight("rtn4", 1, 32, 64, 1, torch.Generator().manual_seed(0), dev)
    x = torch.randn(1, 64, device=dev, dtype=torch.bfloat16)
    seen = []
    real = ql.pick_block_k
    monkeypatch.setattr(ql, "pick_block_k", lambda K, gs, bk, C: seen.append(bk) or real(K, gs, bk, C))
    ql.qlinear(x, w)
    monkeypatch.setitem(lc.defaults()["qlinear"]["gemv"], "block_k", 512)
    ql.qlinear(x, w)
    assert seen == [1024, 512], seen


def test_a_sweep_writes_a_device_file_the_loader_reads(tmp_path, monkeypatch):
    """write_overrides (the sweeps' --write-config) merges knobs into DIR/<device>.json, leaves out knobs the
    config does not have, and the loader reads the file back through MOEC_KERNEL_CONFIG_DIR."""
    path, dropped = lc.write_overrides(tmp_path, "Fake GPU 9000", "moe_decode", "prmt",
                                       {"block_o": 32, "num_warps": 4, "split": 1})
    assert Path(path) == tmp_path / "fake_gpu_9000.json" and dropped == {"split": 1}
    lc.write_overrides(tmp_path, "Fake GPU 9000", "qlinear", "gemv", {"unroll": 2})
    monkeypatch.setenv(lc.ENV_DIR, str(tmp_path))
    got = lc.for_key("fake_gpu_9000")
    assert got["moe_decode"]["prmt"] == lc.defaults()["moe_decode"]["prmt"] | {"block_o": 32, "num_warps": 4}
    assert got["qlinear"]["gemv"]["unroll"] == 2 and got["device"]["name"] == "Fake GPU 9000"


def test_kernel_comments_quote_no_measured_figures():
    """Timings and other measured figures belong in benchmarks/results/ (docs/kernel-configs.md), not in the
    kernels' comments and docstrings, where they go stale with the next change (the regex of
    tests/test_recipe_comments.py)."""
    import io
    import tokenize

    from tests.test_recipe_comments import measured_figures
    bad = []
    for p in sorted((ROOT / "moec" / "kernels").glob("*.py")):
        for tok in tokenize.generate_tokens(io.StringIO(p.read_text()).readline):
            if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU")[:3] in
                                                ('"""', "'''")):
                bad += [f"{p.name}:{tok.start[0] + j}: {measured_figures(line)}"
                        for j, line in enumerate(tok.string.splitlines()) if measured_figures(line)]
    assert not bad, "\n".join(bad)


def test_moe_decode_reads_the_fp4_slot_for_fp4_experts(monkeypatch):
    """mxfp4 / nvfp4 experts launch with moe_decode.fp4 (their own sweep's slot), other non-prmt modes keep legacy:
    an fp4 slot whose gate/up tile is not a power of two fails an fp4 call and leaves an rtn4 call as it was."""
    from moec.kernels import moe_decode as md
    from moec.kernels.dequant import MODE_FP4, MODE_FP8, MODE_LUT, MODE_VQ
    from tests.kernels.moe_cases import moe_case

    d = lc.defaults()
    assert md.FP4_CONFIG is d["moe_decode"]["fp4"]
    assert [md.config_name(True, MODE_LUT), md.config_name(False, MODE_FP4), md.config_name(False, MODE_VQ),
            md.config_name(False, MODE_FP8)] == ["prmt", "fp4", "vq", "legacy"]
    bad = d["moe_decode"] | {"fp4": d["moe_decode"]["fp4"] | {"block_o": 3}}
    real = lc.config
    monkeypatch.setattr(md.launch_config, "config", lambda k, dev: bad if k == "moe_decode" else real(k, dev))
    x, ids, wts, w1, w3, w2 = moe_case("rtn4", 1, 2, 3, 64, 32, 1, 1, "cpu", seed=1)
    want = md.moe_decode_ref(x, ids, wts, w1, w3, w2)
    assert (md.moe_decode(x, ids, wts, w1, w3, w2) - want).abs().max() <= 1e-4 * want.abs().max()
    x, ids, wts, w1, w3, w2 = moe_case("mxfp4", 1, 2, 3, 64, 32, 0, 0, "cpu", seed=1)
    with pytest.raises(Exception, match="power of 2"):
        md.moe_decode(x, ids, wts, w1, w3, w2)
