"""Shipped recipes found by name, listed with their purpose, and the --scheme table (issue 34, item 5)."""

from __future__ import annotations

import re

import pytest
import yaml

from moec.calibrate import catalog
from moec.calibrate.catalog import RECIPES_DIR, SCHEMES, find_recipe, purpose, recipe_arg, scheme_recipe, shipped
from moec.calibrate.fit_experts import check_kernel_rules, plan
from moec.calibrate.recipe import load_recipe, parse_recipe
from moec.errors import UserError
from moec.runtime.config import ModelArgs

# SmolLM2-135M's shape (hidden 576, MLP 1536): no weights needed to bind a recipe
SMOLLM2 = ModelArgs(arch="llama", vocab_size=49152, dim=576, n_layers=2, n_heads=9, n_kv_heads=3, head_dim=64,
                    tie_embeddings=True, ffn_kinds=["dense"] * 2, dense_dim=1536)


def test_names_are_unique_over_the_two_folders():
    files = catalog.recipe_files(RECIPES_DIR)
    assert len(files) == len({p.stem for p in files}) == len(shipped()) > 30


def test_a_shipped_recipe_by_name_and_a_path_still_works(tmp_path, monkeypatch):
    assert find_recipe("experts-hls3") == RECIPES_DIR / "experts-hls3.yaml"
    assert find_recipe("kv-nuq2-outlier") == RECIPES_DIR / "ablations" / "kv-nuq2-outlier.yaml"
    assert load_recipe("experts-hls3").name == "experts-hls3"
    own = tmp_path / "experts-hls3"  # a file of that name in the working directory wins: a path is a path
    own.write_text("name: mine\n")
    monkeypatch.chdir(tmp_path)
    assert load_recipe("experts-hls3").name == "mine"
    assert load_recipe(own).name == "mine"


@pytest.mark.parametrize("spec,needles", [
    ("experts-hls5", ["'experts-hls5'", "did you mean experts-hls", "`moec recipes`"]),
    ("zzz", ["'zzz'", "no such file or shipped recipe", "`moec recipes`"]),
    ("experts-hls3.yaml", ["experts-hls3.yaml: no such file", "`moec recipes`"]),  # a path: not a name
    ("some/dir/r.yaml", ["some/dir/r.yaml: no such file"]),
])
def test_an_unknown_name_says_how_to_see_the_names(spec, needles):
    with pytest.raises(UserError) as e:
        load_recipe(spec)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


def test_purpose_is_one_line():
    for name, path in shipped().items():
        p = purpose(path)
        assert p and p != "-" and "\n" not in p, name
    assert purpose(RECIPES_DIR / "rtn4-g32-q4_1.yaml").startswith("experts/MLPs + attention 4-bit rtn")


def test_purpose_falls_back_to_the_leading_comment(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("# Two-bit experts for a quick try. More words\n# on a second line.\nname: r\n")
    assert purpose(p) == "Two-bit experts for a quick try."


def test_schemes():
    assert {"W4A16", "W8A16", "FP8", "NVFP4", "MXFP4", "moec-e2", "moec-e3"} <= set(SCHEMES)
    assert scheme_recipe("fp8") == scheme_recipe("FP8") == "experts-fp8"
    assert scheme_recipe("MOEC-E2") == "experts-hls2-had" and scheme_recipe("moec-e3") == "experts-hls3-had"
    for s in SCHEMES.values():  # a shipped recipe's name, or one that fails in one line (the next test)
        assert re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", s.recipe), s.recipe
    with pytest.raises(UserError, match=r"--scheme W5A16: unknown; schemes: W4A16, W8A16, FP8"):
        scheme_recipe("W5A16")


def test_a_scheme_whose_recipe_is_not_shipped_fails_in_one_line(monkeypatch):
    monkeypatch.setitem(SCHEMES, "INT3", catalog.Scheme("int3-not-here", "test"))
    with pytest.raises(UserError, match=r"^--scheme INT3: its recipe int3-not-here is not shipped with this moec"):
        scheme_recipe("int3")


def test_recipe_or_scheme():
    assert recipe_arg("fp16", None) == "fp16" and recipe_arg(None, "fp8") == "experts-fp8"
    assert recipe_arg(None, None, required=False) is None
    with pytest.raises(UserError, match="both choose the recipe"):
        recipe_arg("fp16", "fp8")
    with pytest.raises(UserError, match="--recipe NAME|FILE or --scheme NAME"):
        recipe_arg(None, None)


GROUP_128 = {"name": "g128", "weights": [{"targets": ["mlp", "attention"], "codec": "rtn", "bits": 4,
                                          "group_size": 128}]}
NAMED = "group_size 128 does not divide the input dim 576 of layers.0."


@pytest.mark.parametrize("bind", [plan, check_kernel_rules])  # calibrate, and pack / pack --random
def test_a_group_that_does_not_divide_is_refused_naming_the_matrix(bind):
    """W4A16's 128 on SmolLM2's 576: one line naming the matrix and its dim, at calibrate and at pack --random
    (check_kernel_rules let it through before issue 34)."""
    with pytest.raises(UserError, match=re.escape(NAMED)) as e:
        bind(SMOLLM2, parse_recipe(yaml.safe_load(yaml.safe_dump(GROUP_128))))
    assert "\n" not in str(e.value)
