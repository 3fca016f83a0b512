"""Recipes: typed parsing, unknown keys and wrong types named, resolved recipe round-trips."""

import pytest
import yaml

from moec.calibrate.recipe import Recipe, load_recipe, parse_recipe
from moec.errors import UserError


def test_fp16_recipe_resolves_defaults():
    r = load_recipe("recipes/fp16.yaml")
    assert r.name == "fp16" and r.kv is None and r.weights == [] and r.calibration.seed == 0
    r.require_implemented()


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
    ({"kv": {"window": -1}}, "kv.window must be >= 0, got -1"),
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


def test_unimplemented_codec_is_refused_by_name(monkeypatch):
    import moec.calibrate.recipe as recipe_mod

    r = parse_recipe({"kv": {"codec": "rvq-tiered", "bits": 2}})
    r.require_implemented()  # every codec the design names is implemented now: pretend one is not
    monkeypatch.setattr(recipe_mod, "IMPLEMENTED_KV", tuple(c for c in recipe_mod.IMPLEMENTED_KV if c != "rvq-tiered"))
    with pytest.raises(UserError, match="kv codec 'rvq-tiered' is not implemented"):
        r.require_implemented()
