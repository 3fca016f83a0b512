"""Packs written by older moec versions load to the logits they had, or are refused in one line.

tests/fixtures/packed_fd46df9 is a tiny pack (2-layer Mixtral, 2-bit hls experts, 4-bit rtn attention,
2-bit nuq-outlier KV with pre-RoPE keys and outliers) written by moec at commit fd46df9 (packed format
version 2) with tests/fixtures/make_pack_fixture.py, beside the logits that tree's runtime computed on it
(teacher-forced, and decoded token by token through the compressed cache, so the history tier is used).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moec.errors import FormatError
from moec.formats.checkpoint import FORMAT_VERSION
from moec.runtime.loader import kv_cache_factory, load_model

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "packed_fd46df9"
EXPECTED = load_file(str(FIXTURE.parent / "packed_fd46df9.logits.safetensors"))


# The fixture's logits were computed on one CPU thread of CI's machine. On CPUs with other matmul kernels (AMX /
# AVX512-FP16: the last fp32 bits of 76% of the logits move by ≤ 1.2e-7, seen 2026-12-06) exact equality would
# test the CPU, not the format: the logits are compared to fp32 rounding.
LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def one_thread():
    """The fixture's logits were computed on one CPU thread (CI's setting); fp32 sums in another thread
    count round differently, so the comparison pins the count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@torch.no_grad()
def test_fd46df9_pack_loads_to_identical_logits(one_thread):
    model, info = load_model(FIXTURE)
    tokens = EXPECTED["tokens"]
    torch.testing.assert_close(model(tokens)[0], EXPECTED["logits_tf"], **LOGIT_TOL)
    cache = kv_cache_factory(info, model.args)(model, 1, tokens.shape[1])
    dec = [model(tokens[:, :8], cache, 0)[0, -1]]
    for t in range(8, tokens.shape[1] - 1):
        dec.append(model(tokens[:, t : t + 1], cache, t)[0, -1])
    torch.testing.assert_close(torch.stack(dec), EXPECTED["logits_dec"], **LOGIT_TOL)


def test_newer_format_is_refused_naming_both_versions(tmp_path):
    pack = tmp_path / "pack"
    shutil.copytree(FIXTURE, pack)
    manifest = json.loads((pack / "moec.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (pack / "moec.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=rf"format_version {FORMAT_VERSION + 1}.*\({FORMAT_VERSION}\)") as e:
        load_model(pack)
    assert "\n" not in str(e.value)


def _key_counts(x, counts: dict) -> dict:
    if isinstance(x, dict):
        for k, v in x.items():
            counts[k] = counts.get(k, 0) + 1
            _key_counts(v, counts)
    elif isinstance(x, list):
        for v in x:
            _key_counts(v, counts)
    return counts


def test_each_recipe_key_is_stored_once(tmp_path):
    """Format 3 (issue 30, "one value, one place"): the manifest's resolved recipe is the one home of every
    recipe key, KV keys included; the `kv` section holds none, the kv tensors' entries and effective_bits
    repeat none, no recipe.yaml is written (`moec inspect --recipe` prints the recipe, which parses back to
    the same recipe), and config.json's quantization_config is the mirror derived from the manifest."""
    import yaml

    from moec.calibrate.pack import pack_random
    from moec.calibrate.recipe import parse_recipe
    from moec.cli.app import run
    from moec.formats import checkpoint
    from moec.runtime.config import ModelArgs

    args = ModelArgs(arch="mixtral", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                     max_seq_len=128, n_experts=4, top_k=2, expert_dim=64)
    recipe = parse_recipe({"name": "once", "kv": {"codec": "nuq-outlier", "bits": 2, "window": 16, "sinks": 2,
                                                  "block": 8, "outlier_frac": 0.02},
                           "weights": [{"targets": ["experts"], "codec": "rtn", "bits": 4, "group_size": 16}]})
    pack_random(args, "tiny", recipe, tmp_path / "p")
    stored = json.loads((tmp_path / "p" / "moec.json").read_text())
    # every key of the KV codec's config, counted over the manifest but the weight rules' and tensors' own
    # codec and bits
    rest = {k: v for k, v in stored.items() if k not in ("tensors", "shards")}
    counts = _key_counts(rest | {"recipe": {k: v for k, v in stored["recipe"].items() if k != "weights"}}, {})
    assert {k: counts[k] for k in stored["recipe"]["kv"]} == {k: 1 for k in stored["recipe"]["kv"]}
    assert set(stored["kv"]) == {"n_layers", "n_kv_heads", "head_dim", "tensors"}
    assert {tuple(sorted(e)) for n, e in stored["tensors"].items() if n.startswith("kv.")} == \
        {("bits", "bytes", "codec", "dtype", "param", "shape", "shard")}
    assert not (tmp_path / "p" / "recipe.yaml").exists()
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    assert cfg["quantization_config"] == checkpoint.quantization_config(stored)
    assert cfg["quantization_config"]["kv_cache_scheme"]["window"] == 16
    r = run("inspect", tmp_path / "p", "--recipe")
    assert r.returncode == 0, r.stderr
    assert parse_recipe(yaml.safe_load(r.stdout)) == recipe
