"""The transformers path (moec/hf/generic.py, calibrate/generic_capture.py, generic_pack.py) on tiny random
models of four MoE types (moec.hf.tiny's table: hidden 64, 8 experts, vocab 8192 = the demo-moe tokenizer's): mixtral,
qwen3_moe (a dense layer through mlp_only_layers), deepseek_v3 (MLA, shared experts, a leading dense layer,
group-limited sigmoid routing), gpt_oss (transposed biased experts with a clamped gate, sinks, a sliding layer).

Per type, one module-scoped build: the source saved as transformers saves it, an identity pack (the shipped fp16 recipe)
and a calibrated pack (experts hls 2-bit, attention / dense / shared MLPs rtn 4-bit, router fp8) on 2 x 16 tokens.
Checks: the identity pack's logits equal the source's (fp32, <= 1e-5 relative); the quantized pack's logits equal
the source model with its quantized matrices replaced by their dequantized values (<= 1e-4 relative);
`AutoModelForCausalLM.from_pretrained` of the pack gives moec.hf.from_pretrained's logits.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

import moec.hf
from moec.calibrate.generic_capture import calibrate_generic
from moec.calibrate.generic_pack import pack_any, pack_generic
from moec.calibrate.recipe import load_recipe, parse_recipe
from moec.errors import UserError
from moec.formats import checkpoint
from moec.hf import generic, tiny

TYPES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")  # plain; shared experts + a dense layer; MLA + groups;
# transposed biased experts with a clamped gate, sinks and a sliding layer (every type: tests/hf/test_types.py)
RECIPE = {"name": "t-generic", "weights": [
    {"targets": ["experts"], "codec": "hls", "bits": 2, "group_size": 0},
    {"targets": ["attention", "mlp", "shared_experts"], "codec": "rtn", "bits": 4, "group_size": 0},
    {"targets": ["router"], "codec": "fp8", "bits": 8}],
    "calibration": {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 8}}


def save_tiny(model_type: str, path, seed: int = 0):
    """moec.hf.tiny's model of `model_type` saved at `path` (with the demo-moe tokenizer), loaded back in fp32."""
    tiny.save_tiny(model_type, path, seed)
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=TYPES)
def built(request, tmp_path_factory, short_ptb):
    mt = request.param
    tmp = tmp_path_factory.mktemp(mt)
    src = tmp / "src"
    model = save_tiny(mt, src)
    pack_generic(src, mt, load_recipe("fp16"), tmp / "fp16")
    calibrate_generic(src, mt, parse_recipe(RECIPE), "ptb", "train", 2, 16, 0, tmp / "calib", batch_size=2)
    pack_any(src, mt, tmp / "calib", tmp / "q")
    return mt, model, tmp


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


X = torch.randint(0, 8192, (2, 12), generator=torch.Generator().manual_seed(1))


def test_identity_pack_equals_source(built):
    mt, model, tmp = built
    manifest = checkpoint.verify(tmp / "fp16")
    assert manifest["layout"] == "hf" and "model_args" not in manifest
    packed = moec.hf.from_pretrained(tmp / "fp16")
    assert _rel(_logits(packed, X), _logits(model, X)) <= 1e-5, mt
    # every stored tensor is the source's in-memory tensor, bit for bit
    sd = model.state_dict()
    got = checkpoint.load_tensors(tmp / "fp16", manifest)
    assert all(torch.equal(got[n], sd[n]) for n in got), mt


def dequantized_reference(model, packed_dir):
    """(reference, packed model, manifest): hf/generic.dequantized_reference of the pack at `packed_dir`."""
    manifest = checkpoint.verify(packed_dir)
    packed = moec.hf.from_pretrained(packed_dir)
    return generic.dequantized_reference(model, packed, manifest), packed, manifest


def test_quantized_pack_equals_dequantized_reference(built):
    mt, model, tmp = built
    ref, packed, manifest = dequantized_reference(model, tmp / "q")
    codecs = {e["codec"] for e in manifest["tensors"].values()}
    assert {"hls", "rtn", "fp8"} <= codecs, (mt, codecs)
    want = _logits(ref, X)
    assert _rel(_logits(packed, X), want) <= 1e-4, mt
    assert _rel(want, _logits(model, X)) > 1e-4, mt  # the quantization did change the model
    auto = T.AutoModelForCausalLM.from_pretrained(tmp / "q", dtype=torch.float32)
    assert _rel(_logits(auto, X), want) <= 1e-4, mt


def test_transposed_stacks_are_recorded(built):
    mt, model, tmp = built
    manifest = checkpoint.verify(tmp / "q")
    transposed = manifest["hf"]["transposed"]
    assert bool(transposed) == (mt == "gpt_oss"), (mt, transposed)
    for name in transposed:
        e = next(v for k, v in manifest["tensors"].items() if v["param"] == name)
        E, I, O = model.get_parameter(name).shape
        assert e["param_shape"] == [E, O, I]


def test_generic_refuses_kv_recipe_and_bad_rules(tmp_path, short_ptb):
    mt, tmp = "mixtral", tmp_path
    save_tiny(mt, tmp / "src")
    save_tiny("gpt_oss", tmp / "oss")
    kv = parse_recipe({"name": "kv", "kv": {"codec": "kivi", "bits": 4}})
    with pytest.raises(UserError, match="kv codec kivi: gpt_oss layer 0 .*cannot"):  # sinks, a sliding window
        calibrate_generic(tmp / "oss", "gpt_oss", kv, "ptb", "train", 1, 8, 0, tmp / "kv")
    pre = parse_recipe({"name": "pre", "kv": {"codec": "nuq-outlier", "bits": 2, "rope": "pre"}})
    with pytest.raises(UserError, match="rope: pre"):
        pack_generic(tmp / "src", mt, pre, tmp / "kv")
    bad = parse_recipe({"name": "bad", "weights": [{"targets": ["shared_experts"], "codec": "rtn", "bits": 4}]})
    with pytest.raises(UserError, match="selects no matrix"):
        calibrate_generic(tmp / "src", mt, bad, "ptb", "train", 1, 8, 0, tmp / "bad")
    assert not (tmp / "kv").exists() and not (tmp / "bad").exists()
