"""`moec calibrate --propagate quantized` (capture.run_layers requantize): layer i + 1 sees the outputs of
layer i computed with its fitted weights. Layer 0's statistics cannot change (its inputs are the
embeddings); layer 1's must (its inputs moved by layer 0's quantization error); rtn fits, which read no
statistics, stay the same; the default stays the fp pipeline.
Also --offload-activations, which must not change a byte (on the CPU it only exercises the path)."""

from __future__ import annotations

import json

import torch
import yaml
from safetensors.torch import load_file

from moec.calibrate.recipe import load_recipe
from moec.calibrate.run import calibrate
from tests.cli.run import moec

RECIPE = {"name": "propagate-test", "weights": [{"targets": ["experts"], "codec": "rtn", "bits": 2, "group_size": 0}],
          "calibration": {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 0, "seed": 0}}


def test_quantized_propagation_changes_only_later_layers(tiny_moe_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    r = load_recipe(recipe)
    outs = {}
    for tag, kw in (("fp", {}), ("offload", {"offload": True}), ("quantized", {"propagate": "quantized"})):
        calibrate(tiny_moe_dir, str(tiny_moe_dir), r, "ptb", "valid", 2, 16, 0, tmp_path / tag, **kw)
        outs[tag] = load_file(str(tmp_path / tag / "calib.safetensors"))
    fp, q = outs["fp"], outs["quantized"]
    assert all(torch.equal(fp[k], outs["offload"][k]) for k in fp)
    # rtn fits see no activations: what layer 1 saw shows in its K/V ranges, the statistics of its inputs
    assert all(torch.equal(fp[k], q[k]) for k in fp if k.startswith("layers.0.") or k.startswith("fit."))
    assert not torch.equal(fp["layers.1.k_absmax"], q["layers.1.k_absmax"])
    assert json.loads((tmp_path / "quantized" / "report.json").read_text())["propagate"] == "quantized"


def test_bad_propagate_exits_2(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    r = moec("calibrate", "demo-moe", "--recipe", recipe, "--propagate", "int4", "-o", tmp_path / "c")
    assert r.returncode == 2 and "--propagate must be fp or quantized" in r.stderr and "Traceback" not in r.stderr
