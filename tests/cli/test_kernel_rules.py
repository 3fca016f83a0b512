"""Kernel constraints are declared by the codec (WeightCodecSpec.kernel_rule) and checked when a recipe is bound
to a model, before any work: `moec calibrate` (fit_experts.plan), `moec pack` and `moec pack --random`
(fit_experts.check_kernel_rules) refuse a recipe the fused kernels cannot read in one line naming the rule
(exit 2), instead of a silent torch fallback at run time. Every shipped recipe binds on the models it is for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from moec.calibrate.fit_experts import check_kernel_rules
from moec.calibrate.recipe import load_recipe
from moec.calibrate.run import check_kv_attention
from moec.calibrate.sources import DEMO_MOE_DIR
from moec.errors import UserError
from moec.registry import kv_codec, resolve, weight_codec
from moec.runtime.config import PRESETS, ModelArgs
from moec.runtime.hf_layout import HFCheckpoint
from tests.cli.run import moec

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "moec" / "recipes").glob("*.yaml")) + sorted((ROOT / "moec" / "recipes" / "ablations").glob(
    "*.yaml"))
# SmolLM2-135M (calibrate/sources.py; the weights are not needed to bind a recipe): hidden 576, MLP 1536
SMOLLM2 = ModelArgs(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                    tie_embeddings=True, ffn_kinds=["dense"] * 30, dense_dim=1536)
BAD = {"name": "bad-group", "weights": [{"targets": ["experts"], "codec": "hls", "bits": 2, "group_size": 8}]}
RULE = "the fused kernels read LUT codes in tiles of 16 inputs: group_size must be a multiple of 16"


def test_the_lut_rule_is_the_codecs():
    spec = weight_codec("hls")
    assert spec.kernel_error(2, 160, 32) is None and spec.kernel_error(2, 1536, 192) is None
    assert spec.kernel_error(3, 160, 0) is None and spec.kernel_error(4, 40, 40) is None  # one group per row
    assert RULE in spec.kernel_error(2, 160, 8)
    assert weight_codec("vq").kernel_error(2, 64, 4) is None and weight_codec("keep").kernel_error(2, 64, 8) is None


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_binds(recipe):
    """On every model a recipe may be run on here: the built-in demo-moe, SmolLM2, and the --random shapes
    (with the KV codec's own check, which pack --random runs too)."""
    r = load_recipe(recipe)
    models = {"demo-moe": HFCheckpoint(DEMO_MOE_DIR).args, "smollm2-135m": SMOLLM2, **PRESETS}
    # the models it is written for: SmolLM2's recipes; the scheme-standard group of 128 (w4a16, as llm-compressor
    # writes W4A16) for the real shapes only, since demo-moe's 160 and SmolLM2's 576 are not multiples of 128
    homes = ({"smollm2-135m"} if recipe.stem.startswith("smollm2-") else
             {"mixtral-8x7b", "qwen3-30b-a3b"} if any(w.group_size == 128 for w in r.weights) else {"demo-moe"})
    for name, args in models.items():
        try:
            check_kernel_rules(args, r)
        except UserError as e:  # elsewhere only a group that does not divide that model's dims (as at calibrate)
            assert name not in homes and re.search(r"group_size \d+ does not divide the input dim", str(e)), (name, e)
        if name in PRESETS and r.kv is not None and (check := kv_codec(r.kv.codec).check) is not None:
            if kv_codec(r.kv.codec).mla != args.is_mla:  # the MLA latent codec and per-head codecs: refused both ways
                with pytest.raises(UserError, match="MLA latent|per-head keys"):
                    check_kv_attention(args, r)
                continue
            resolve(check)(args, r.kv)


@pytest.mark.parametrize("cmd", ["pack-random", "calibrate"])
def test_a_recipe_the_kernels_cannot_read_is_refused_in_one_line(tmp_path, cmd):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump(BAD))
    out = tmp_path / "out"
    if cmd == "pack-random":
        r = moec("pack", "--random", "smoke-moe", "--recipe", recipe, "-o", out)
    else:
        r = moec("calibrate", "demo-moe", "--recipe", recipe, "--samples", "2", "--seq-len", "32", "-o", out)
    assert r.returncode == 2, (r.returncode, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    last = r.stderr.strip().splitlines()[-1]
    assert errors == [last] and last.startswith("moec: error: weights rule 0") and RULE in last, r.stderr
    assert not out.exists()
