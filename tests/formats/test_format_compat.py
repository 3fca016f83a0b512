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


@pytest.fixture
def one_thread():
    """The fixture's logits were computed on one CPU thread (CI's setting); fp32 sums in another thread
    count round differently, so the comparison pins the count and can then be exact."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@torch.no_grad()
def test_fd46df9_pack_loads_to_identical_logits(one_thread):
    model, info = load_model(FIXTURE)
    tokens = EXPECTED["tokens"]
    torch.testing.assert_close(model(tokens)[0], EXPECTED["logits_tf"], rtol=0, atol=0)
    cache = kv_cache_factory(info, model.args)(model, 1, tokens.shape[1])
    dec = [model(tokens[:, :8], cache, 0)[0, -1]]
    for t in range(8, tokens.shape[1] - 1):
        dec.append(model(tokens[:, t : t + 1], cache, t)[0, -1])
    torch.testing.assert_close(torch.stack(dec), EXPECTED["logits_dec"], rtol=0, atol=0)


def test_newer_format_is_refused_naming_both_versions(tmp_path):
    pack = tmp_path / "pack"
    shutil.copytree(FIXTURE, pack)
    manifest = json.loads((pack / "moec.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (pack / "moec.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=rf"format_version {FORMAT_VERSION + 1}.*\({FORMAT_VERSION}\)") as e:
        load_model(pack)
    assert "\n" not in str(e.value)
