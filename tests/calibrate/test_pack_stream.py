"""Streamed `moec pack` (issue 20): shards planned from shapes and dtypes, tensors read from the source
layer by layer and from calib.safetensors as each shard is written. The output must be the bytes of
the in-memory pack (the whole state dict and every fitted part loaded first: the code before the
change, reproduced here by handing pack real tensors where it now plans from meta ones)."""

from __future__ import annotations

import hashlib

import pytest
import yaml
from safetensors.torch import load_file

from moec.calibrate import pack as pack_mod
from moec.calibrate.recipe import load_recipe
from moec.calibrate.run import calibrate
from moec.formats import checkpoint
from moec.runtime.hf_layout import HFCheckpoint

RECIPE = {"name": "pack-stream", "weights": [{"targets": ["experts"], "codec": "rtn", "bits": 2, "group_size": 0}],
          "calibration": {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 0, "seed": 0}}


def _digests(d) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_streamed_pack_is_the_in_memory_pack(tiny_moe_dir, tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    calib = tmp_path / "calib"
    calibrate(tiny_moe_dir, str(tiny_moe_dir), load_recipe(recipe), "ptb", "valid", 2, 16, 0, calib)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 40_000)  # several shards, a layer split across two
    loaded = []
    real_loader = pack_mod._source_loader

    def counting_loader(*a):
        load = real_loader(*a)
        return lambda name: loaded.append(name) or load(name)

    monkeypatch.setattr(pack_mod, "_source_loader", counting_loader)
    pack_mod.pack(tiny_moe_dir, "tiny", calib, tmp_path / "streamed")
    streamed = _digests(tmp_path / "streamed")
    assert sum(n.startswith("model-") for n in streamed) >= 3, sorted(streamed)
    m = checkpoint.read_manifest(tmp_path / "streamed")
    assert sorted(loaded) == sorted(n for n in m["tensors"] if "absmax" not in n)  # everything came through load

    # the in-memory pack: real tensors where the streamed one has meta tensors, so load is never called
    monkeypatch.setattr(HFCheckpoint, "meta_state_dict", HFCheckpoint.state_dict)
    monkeypatch.setattr(pack_mod, "_meta_file", load_file)
    loaded.clear()
    pack_mod.pack(tiny_moe_dir, "tiny", calib, tmp_path / "in-memory")
    assert loaded == []
    assert _digests(tmp_path / "in-memory") == streamed


def test_bad_source_tensor_is_caught(tmp_path):
    """write_packed checks what load returns against the planned shape and dtype."""
    import torch

    meta = {"a": torch.empty(4, dtype=torch.float16, device="meta")}
    with pytest.raises(AssertionError):
        checkpoint.write_packed(tmp_path / "out", meta, {"a": {"codec": "keep", "bits": 16, "param": "a"}}, {}, {},
                                load=lambda n: torch.zeros(5, dtype=torch.float16))
