"""The manifest `kv` section: format-1 sections are read (latent keys moved under `latent`), broken ones
named, and the version rules hold."""

import json

import pytest

from moec.errors import FormatError
from moec.formats import checkpoint, kvsection

V1_LATENT = {"codec": "latent-layer", "bits": 4, "window": 128, "sinks": 4, "block": 32, "group_size": 32,
             "outlier_frac": 0.005, "levels": "fitted", "rope": "pre", "n_layers": 4, "n_kv_heads": 2,
             "head_dim": 32, "group_layers": 2, "n_groups": 2, "rank_k": 64, "rank_v": 96, "energy": 0.99,
             "tensors": []}


def _manifest_dir(tmp_path, version, kv):
    (tmp_path / checkpoint.MANIFEST).write_text(json.dumps({"format": checkpoint.FORMAT, "format_version": version,
                                                             "kv": kv}))
    return tmp_path


def test_v1_latent_section_is_upgraded(tmp_path):
    m = checkpoint.read_manifest(_manifest_dir(tmp_path, 1, V1_LATENT))
    kv = m["kv"]
    assert kv["latent"] == {"rank_k": 64, "rank_v": 96, "energy": 0.99, "group_layers": 2, "outlier_frac": 0.005}
    assert "outlier_frac" not in kv and kv["n_groups"] == 2 and kv["codec"] == "latent-layer"


def test_v2_section_is_read_as_written(tmp_path):
    kv = {"codec": "kivi", "bits": 2, "window": 16, "sinks": 2, "block": 16, "group_size": 8, "n_layers": 2,
          "n_kv_heads": 2, "head_dim": 8, "tensors": []}
    assert checkpoint.read_manifest(_manifest_dir(tmp_path, 2, kv))["kv"] == kv


@pytest.mark.parametrize("kv,needle", [
    ({"bits": 2, "n_layers": 2, "n_kv_heads": 2, "head_dim": 8}, "missing 'codec'"),
    ({"codec": "kivi", "bits": "2", "n_layers": 2, "n_kv_heads": 2, "head_dim": 8}, "kv.bits: expected int"),
    ([1, 2], "expected a mapping"),
])
def test_broken_sections_are_named(tmp_path, kv, needle):
    with pytest.raises(FormatError, match=needle):
        checkpoint.read_manifest(_manifest_dir(tmp_path, 2, kv))


def test_version_zero_is_refused(tmp_path):
    with pytest.raises(FormatError, match="not a version number"):
        checkpoint.read_manifest(_manifest_dir(tmp_path, 0, None))


def test_upgrade_leaves_other_codecs():
    nuq = {"codec": "nuq-outlier", "bits": 2, "outlier_frac": 0.01}
    assert kvsection.upgrade(nuq, 1) == nuq and kvsection.upgrade(None, 1) is None
