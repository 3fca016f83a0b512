"""The packed checkpoint: exact round trip, sharding, atomic writes, and the loader's checks."""

import json

import pytest
import torch

from moec.errors import FormatError
from moec.formats import checkpoint


def _write(tmp_path, tensors, **kw):
    info = {n: {"codec": "keep", "bits": 8 * t.element_size(), "param": n} for n, t in tensors.items()}
    return checkpoint.write_packed(tmp_path / "ck", tensors, info, {"note": "test"}, {"model_type": "x"}, **kw)


def test_round_trip_exact_across_dtypes_and_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 1000)  # force several shards
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(17, 9, generator=g), "b": torch.randn(300, generator=g).to(torch.bfloat16),
               "c": torch.randint(0, 255, (41, 3), generator=g, dtype=torch.uint8),
               "d": torch.randn(5, generator=g).to(torch.float16)}
    out = _write(tmp_path, tensors)
    m = checkpoint.verify(out)
    assert len(m["shards"]) > 1 and m["format_version"] == checkpoint.FORMAT_VERSION and m["note"] == "test"
    back = checkpoint.load_tensors(out, m)
    for n, t in tensors.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n
    cfg = json.loads((out / "config.json").read_text())  # derived: checkpoint.hf_config_json
    assert cfg["quantization_config"]["quant_method"] == "moec" and cfg["model_type"] == checkpoint.MODEL_TYPE
    assert checkpoint.source_hf_config(cfg) == {"model_type": "x"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temporary, no lock file
    # the standard shard index transformers reads names every tensor's shard, as the manifest does
    index = json.loads((out / checkpoint.HF_INDEX).read_text())
    assert index["weight_map"] == {n: e["shard"] for n, e in m["tensors"].items()}


def test_stale_index_is_a_format_error_and_no_index_is_read(tmp_path):
    out = _write(tmp_path, {"a": torch.zeros(3), "b": torch.ones(2)})
    f = out / checkpoint.HF_INDEX
    index = json.loads(f.read_text())
    f.write_text(json.dumps({**index, "weight_map": {"a": index["weight_map"]["a"]}}))
    with pytest.raises(FormatError, match="weight_map does not list"):
        checkpoint.verify(out)
    f.unlink()  # a checkpoint packed before the index existed
    assert set(checkpoint.verify(out)["tensors"]) == {"a", "b"}


def test_failed_write_leaves_nothing(tmp_path):
    tensors = {"a": torch.zeros(3)}
    with pytest.raises(KeyError):  # info for a tensor is missing: the writer fails midway
        checkpoint.write_packed(tmp_path / "ck", tensors, {}, {}, {})
    assert list(tmp_path.iterdir()) == []


def test_rewrite_replaces_whole_checkpoint(tmp_path):
    _write(tmp_path, {"a": torch.zeros(3)})
    out = _write(tmp_path, {"b": torch.ones(2)})
    assert list(checkpoint.verify(out)["tensors"]) == ["b"]


def test_shape_and_dtype_checked(tmp_path):
    out = _write(tmp_path, {"a": torch.zeros(3, 2)})
    m = json.loads((out / "moec.json").read_text())
    m["tensors"]["a"]["shape"] = [2, 3]
    (out / "moec.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match=r"tensor 'a' has shape \[3, 2\], manifest says \[2, 3\]"):
        checkpoint.verify(out)
    m["tensors"]["a"]["shape"], m["tensors"]["a"]["dtype"] = [3, 2], "float16"
    (out / "moec.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="has dtype float32, manifest says float16"):
        checkpoint.verify(out)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "moec.json").write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        checkpoint.read_manifest(tmp_path)
    (tmp_path / "moec.json").write_text(json.dumps({"format": "other", "format_version": 1}))
    with pytest.raises(FormatError, match="format 'other', expected 'moec-packed'"):
        checkpoint.read_manifest(tmp_path)
