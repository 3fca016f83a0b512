"""`moec recipes` and `--recipe NAME` / `--scheme NAME` wherever a command takes a recipe (issue 34, item 5).
No model is loaded: each command is stopped by the first thing after the recipe, which shows it resolved."""

from __future__ import annotations

import pytest

from moec.calibrate import catalog
from moec.calibrate.catalog import SCHEMES, shipped
from tests.cli.run import moec


def _one_error_line(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(n in errors[0] for n in needles), (needles, errors[0])
    return errors[0]


def test_recipes_lists_each_with_its_purpose():
    r = moec("recipes")
    assert r.returncode == 0, r.stderr
    main = {n for n, p in shipped().items() if p.parent.name != "ablations"}
    for name in main:
        (line,) = [ln for ln in r.stdout.splitlines() if f" {name} " in ln and "│" in ln and ln.split()[1] == name]
        assert len(line.split("│")[2].strip()) > 10, line  # a purpose beside the name, on the same line
    assert "experts/MLPs + attention 4-bit rtn, group 32" in r.stdout
    assert "kv-nuq2-outlier-sinks0" not in r.stdout and "moec recipes --ablations" in r.stdout
    for s in SCHEMES:
        assert f"│ {s} " in r.stdout, s
    assert "kv-nuq2-outlier-sinks0" in moec("recipes", "--ablations").stdout


@pytest.mark.parametrize("choice", [("--recipe", "experts-hls3"), ("--scheme", "fp8"), ("-r", "fp16")])
def test_calibrate_takes_a_name_or_a_scheme(tmp_path, choice):
    r = moec("calibrate", tmp_path / "no-model", *choice, "--samples", "2", "-o", tmp_path / "c")
    _one_error_line(r, "no-model")  # past the recipe: the model is what is missing


@pytest.mark.parametrize("args,needles", [
    (("calibrate", "demo-moe", "--recipe", "experts-hls5"), ["did you mean experts-hls", "`moec recipes`"]),
    (("calibrate", "demo-moe", "--scheme", "W5A16"), ["--scheme W5A16: unknown"]),
    (("calibrate", "demo-moe", "--recipe", "fp16", "--scheme", "fp8"), ["pass one"]),
    (("calibrate", "demo-moe"), ["--recipe NAME|FILE or --scheme NAME"]),
    (("pack", "--random", "smoke-moe", "--recipe", "nope"), ["'nope': no such file or shipped recipe"]),
    (("pack", "--random", "smoke-moe", "--scheme", "nope"), ["--scheme nope: unknown"]),
    (("eval", "--latency", "--random", "smoke-moe", "--scheme", "nope"), ["--scheme nope: unknown"]),
    (("eval", "demo-moe", "--recipe", "fp16"), ["are for --latency --random SHAPE"]),
])
def test_bad_recipe_choices_fail_in_one_line(tmp_path, args, needles):
    _one_error_line(moec(*args, "-o", tmp_path / "o") if args[0] != "eval" else moec(*args), *needles)


def test_pack_random_by_name_binds_before_any_work(tmp_path, monkeypatch):
    """A shipped recipe by name through pack --random, refused at bind time (group 512 does not divide the
    768 inputs of smoke-moe's attention) in one line naming the matrix; nothing written."""
    bad = tmp_path / "g512.yaml"
    bad.write_text("name: g512\nweights:\n  - {targets: [attention], codec: rtn, bits: 4, group_size: 512}\n")
    monkeypatch.setattr(catalog, "RECIPES_DIR", tmp_path)  # make it a "shipped" recipe
    out = tmp_path / "p"
    _one_error_line(moec("pack", "--random", "smoke-moe", "--recipe", "g512", "-o", out),
                    "group_size 512 does not divide the input dim 768 of layers.0.attn.wq.weight")
    assert not out.exists()
