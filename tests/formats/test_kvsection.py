"""The manifest `kv` section: format-3 sections hold no recipe key (their home is `recipe.kv`), format-2 and
format-1 sections are read (recipe keys moved to `recipe.kv`, format-1 latent keys nested under `latent`
first), broken ones named, and the version rules hold."""

import json

import pytest

from moec.errors import FormatError
from moec.formats import checkpoint, kvsection

V1_LATENT = {"codec": "latent-layer", "bits": 4, "window": 128, "sinks": 4, "block": 32, "group_size": 32,
             "outlier_frac": 0.005, "levels": "fitted", "rope": "pre", "n_layers": 4, "n_kv_heads": 2,
             "head_dim": 32, "group_layers": 2, "n_groups": 2, "rank_k": 64, "rank_v": 96, "energy": 0.99,
             "tensors": []}
V1_RECIPE_KV = {k: V1_LATENT[k] for k in ("codec", "bits", "window", "sinks", "block", "group_size", "outlier_frac",
                                         "levels", "rope")} | {"latent": None, "rvq": None}
SHAPES = {"n_layers": 2, "n_kv_heads": 2, "head_dim": 8, "tensors": []}
KIVI = {"codec": "kivi", "bits": 2, "window": 16, "sinks": 2, "block": 16, "group_size": 8}


def _manifest_dir(tmp_path, version, kv, recipe_kv=None):
    (tmp_path / checkpoint.MANIFEST).write_text(json.dumps({"format": checkpoint.FORMAT, "format_version": version,
                                                             "recipe": {"name": "r", "kv": recipe_kv}, "kv": kv}))
    return tmp_path


def test_v1_latent_section_is_upgraded(tmp_path):
    m = checkpoint.read_manifest(_manifest_dir(tmp_path, 1, V1_LATENT, V1_RECIPE_KV))
    kv, recipe_kv = m["kv"], m["recipe"]["kv"]
    assert recipe_kv["latent"] == {"rank_k": 64, "rank_v": 96, "energy": 0.99, "group_layers": 2,
                                   "outlier_frac": 0.005}
    assert recipe_kv["codec"] == "latent-layer" and recipe_kv["window"] == 128
    assert kv == {"n_layers": 4, "n_kv_heads": 2, "head_dim": 32, "n_groups": 2, "tensors": []}


def test_v2_section_keeps_only_what_is_not_a_recipe_key(tmp_path):
    """Format 2 stored each recipe key twice (section and recipe.kv); the section's value is what a format-2
    reader read, so it wins."""
    m = checkpoint.read_manifest(_manifest_dir(tmp_path, 2, KIVI | SHAPES, KIVI | {"window": 99}))
    assert m["kv"] == SHAPES and m["recipe"]["kv"] == KIVI


def test_v3_section_is_read_as_written(tmp_path):
    assert checkpoint.read_manifest(_manifest_dir(tmp_path, 3, SHAPES, KIVI))["kv"] == SHAPES


@pytest.mark.parametrize("kv,recipe_kv,needle", [
    (SHAPES, {"bits": 2}, "recipe.kv: missing 'codec'"),
    (SHAPES, {"codec": "kivi", "bits": "2"}, "recipe.kv.bits: expected int"),
    (SHAPES, None, "recipe.kv: expected the KV codec's mapping"),
    ({"n_layers": 2, "n_kv_heads": 2}, KIVI, "kv: missing 'head_dim'"),
    ([1, 2], KIVI, "expected a mapping"),
    (SHAPES | {"window": 16}, KIVI, "kv.window: stored twice"),
])
def test_broken_sections_are_named(tmp_path, kv, recipe_kv, needle):
    with pytest.raises(FormatError, match=needle) as e:
        checkpoint.read_manifest(_manifest_dir(tmp_path, 3, kv, recipe_kv))
    assert "\n" not in str(e.value)


def test_version_zero_is_refused(tmp_path):
    with pytest.raises(FormatError, match="not a version number"):
        checkpoint.read_manifest(_manifest_dir(tmp_path, 0, None))


def test_upgrade_leaves_other_codecs_and_none():
    nuq = {"codec": "nuq-outlier", "bits": 2, "outlier_frac": 0.01}
    m = kvsection.upgrade({"recipe": {"kv": dict(nuq)}, "kv": nuq | SHAPES}, 1)
    assert m["recipe"]["kv"] == nuq and m["kv"] == SHAPES
    assert kvsection.upgrade({"kv": None}, 1) == {"kv": None}
