"""Recipes: typed parsing, unknown keys and wrong types named, resolved recipe round-trips."""

import pytest
import yaml

from moec.calibrate.recipe import Recipe, load_recipe, parse_recipe
from moec.errors import UserError


def test_fp16_recipe_resolves_defaults():
    r = load_recipe("moec/recipes/fp16.yaml")
    assert r.name == "fp16" and r.kv is None and r.weights == [] and r.calibration.seed == 0


def test_resolved_recipe_round_trips():
    r = parse_recipe({"kv": {"codec": "fp16"}, "weights": [{"targets": ["experts", r"layers\.0\."], "codec": "keep"}]})
    again = parse_recipe(yaml.safe_load(r.to_yaml()))
    assert again == r and isinstance(again, Recipe)


@pytest.mark.parametrize("data,needle", [
    ({"kv": {"codec": "fp16", "windw": 3}}, "recipe.kv: unknown key 'windw'"),
    ({"weights": [{"targets": ["experts"], "bits": "2"}]}, "recipe.weights[0].bits: expected int, got str"),
    ({"weights": [{"targets": ["experts"], "bits": True}]}, "expected int, got bool"),
    ({"weights": [{"codec": "rtn"}]}, "targets"),
    ({"weights": [{"targets": ["(unclosed"]}]}, "neither a known target"),
    ({"calibration": {"expert_policy": "guess"}}, "is not one of 'all-experts-for-stats'"),
    ({"calibration": {"seq_len": 1}}, "seq_len 0 or >= 2"),
    ({"calibration": {"samples": -2}}, "samples must be >= 0"),
    ({"kv": {"codec": "kivi", "bits": 2, "window": -1}}, "kv.window must be >= 0, got -1"),
    ({"kv": {"window": 8}}, "unknown key 'window' for codec 'fp16'"),
    ({"kv": {"codec": "kivi", "bits": 2, "rope": "post"}}, "recipe.kv: unknown key 'rope' for codec 'kivi'"),
    ({"kv": {"codec": "rvq-tiered", "bits": 2, "outlier_frac": 0.01}}, "unknown key 'outlier_frac' for codec"),
    ({"kv": {"codec": "zip"}}, "kv codec 'zip' is not registered"),
    ({"weights": [{"targets": ["experts"], "codec": "zip"}]}, "weights codec 'zip' is not registered"),
    ({"version": 3, "name": "x"}, "recipe.version: 3 is not a recipe version"),
    ({"colour": "red"}, "unknown key 'colour'"),
])
def test_bad_recipes_name_the_field(data, needle):
    with pytest.raises(UserError) as e:
        parse_recipe(data)
    assert needle in str(e.value)


def test_rules_first_match_wins():
    r = parse_recipe({"weights": [{"targets": [r"layers\.0\.moe\.w1$"], "codec": "keep", "bits": 8},
                                  {"targets": ["experts"], "codec": "keep", "bits": 16}]})
    assert r.rule_for("layers.0.moe.w1").bits == 8
    assert r.rule_for("layers.3.moe.w2").bits == 16
    assert r.rule_for("layers.3.attn.wq.weight") is None


def test_empty_recipe_is_an_error(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    with pytest.raises(UserError, match="the recipe is empty"):
        load_recipe(p)


def test_yaml_error_keeps_line_and_column(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nkv:\n  codec: kivi\n  bits: [2\n")
    with pytest.raises(UserError, match=r"at line \d+, column \d+"):
        load_recipe(p)


def test_version1_resolved_recipe_is_upgraded():
    """A CALIB_DIR/recipe.yaml written before recipe version 2 (one flat KV class, every key filled in)."""
    v1 = {"name": "old", "version": 1, "kv": {"codec": "kivi", "bits": 2, "window": 64, "sinks": 4, "block": 32,
                                               "group_size": 32, "outlier_frac": 0.01, "levels": "fitted",
                                               "rope": "pre", "k_center": False, "outlier_select": "magnitude",
                                               "k_scale_fit": "quantile", "latent": None, "rvq": None}}
    r = parse_recipe(v1)
    assert (r.kv.codec, r.kv.window, r.version) == ("kivi", 64, 2) and not hasattr(r.kv, "rope")
    with pytest.raises(UserError, match="unknown key 'rope' for codec 'kivi'"):  # chosen, not a v1 default
        parse_recipe(v1 | {"kv": v1["kv"] | {"rope": "post"}})
