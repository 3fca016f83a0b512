"""calibrate → pack → load with incoherence processing (recipe `incoherence:`) on the tiny MoE: the
rotation signs travel exactly from the fit to the packed checkpoint, the loaded model computes the
source model with W_hat = W'_hat·Rᵀ in place of W, and a block that does not divide a matrix exits 2."""

import json
import shutil

import torch
import yaml
from safetensors.torch import load_file, save_file

from moec.calibrate.pack import pack
from moec.calibrate.recipe import parse_recipe
from moec.calibrate.run import calibrate
from moec.rotation import rotate, unpack_signs
from moec.runtime.experts import dequantize
from moec.runtime.hf_layout import HFCheckpoint
from moec.runtime.loader import load_model
from moec.runtime.model import build_model
from tests.cli.run import moec

RULES = [{"targets": ["experts"], "codec": "hls", "bits": 2, "group_size": 0, "incoherence": {}},  # auto: 16, 8
         {"targets": ["attention"], "codec": "rtn", "bits": 4, "group_size": 16, "incoherence": {"block": 16}}]


def test_incoherence_pipeline(tiny_moe_dir, tmp_path):
    calib, packed = tmp_path / "calib", tmp_path / "packed"
    recipe = parse_recipe({"name": "had", "weights": RULES,
                           "calibration": {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 0}})
    calibrate(tiny_moe_dir, "tiny", recipe, "ptb", "valid", 4, 64, 0, calib)
    pack(tiny_moe_dir, "tiny", calib, packed)
    fitted = load_file(str(calib / "calib.safetensors"))
    stored = {}
    for f in packed.glob("model-*.safetensors"):
        stored.update(load_file(str(f)))
    man = json.loads((packed / "moec.json").read_text())
    for layer in (0, 1):
        p = f"layers.{layer}.moe"
        # one bit per sign: uint8 [I / b, ceil(b / 8)] for blocks 16 (of 48 inputs) and 8 (of 40)
        assert stored[f"{p}.w1.had_signs"].shape == (3, 2) and stored[f"{p}.w2.had_signs"].shape == (5, 1)
        assert stored[f"{p}.w1.had_signs"].dtype == torch.uint8
        assert torch.equal(stored[f"{p}.w1.had_signs"], stored[f"{p}.w3.had_signs"])
        assert man["tensors"][f"{p}.w2.had_signs"]["param"] == f"{p}.w2"
    sign_parts = [k for k in stored if k.endswith(".had_signs")]
    assert len(sign_parts) == 2 * (3 + 4)  # w1 w3 w2 and wq wk wv wo of both layers
    for k in sign_parts:  # pack -> checkpoint exactly as fitted
        assert torch.equal(stored[k], fitted["fit." + k]), k

    # the loaded model == the source model with every quantized W replaced by W'_hat·Rᵀ
    src = HFCheckpoint(tiny_moe_dir).state_dict()
    for name in {man["tensors"][k]["param"] for k in sign_parts}:
        e = man["tensors"][f"{name}.had_signs"]
        parts = {k.removeprefix(name + "."): v for k, v in stored.items() if k.startswith(name + ".")}
        signs = unpack_signs(parts.pop("had_signs"), src[name].shape[-1])
        shape = tuple(src[name].shape) if src[name].dim() == 3 else (1, *src[name].shape)
        if len(shape) != src[name].dim():
            parts = {k: v[None] for k, v in parts.items()}
        W = rotate(dequantize(e["codec"], e["bits"], shape, parts), signs, inverse=True)  # W'_hat·Rᵀ
        src[name] = W.reshape(src[name].shape)
    model, _ = load_model(packed)
    ref = build_model(model.args, src, dtype=torch.float32)
    x = torch.randint(0, model.args.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)
    # a pack of before bit packing (int8 signs, 1 byte each) loads and computes the same logits, bit for bit
    old_calib, old_packed = tmp_path / "calib-int8", tmp_path / "packed-int8"
    shutil.copytree(calib, old_calib)
    t = {k: unpack_signs(v, src[k.removeprefix("fit.").removesuffix(".had_signs")].shape[-1])
         if k.endswith(".had_signs") else v for k, v in fitted.items()}
    save_file(t, str(old_calib / "calib.safetensors"), metadata={"format": "moec-calib"})
    pack(tiny_moe_dir, "tiny", old_calib, old_packed)
    old_man = json.loads((old_packed / "moec.json").read_text())
    assert all(old_man["tensors"][k]["dtype"] == "int8" for k in sign_parts)
    bits, old_bits = man["effective_bits"], old_man["effective_bits"]
    n_signs = sum(src[man["tensors"][k]["param"]].shape[-1] for k in sign_parts)
    assert bits["model_bytes"] == old_bits["model_bytes"] - n_signs + n_signs // 8  # I/8 bytes, not I (I % 8 == 0)
    old_model, _ = load_model(old_packed)
    with torch.no_grad():
        assert torch.equal(old_model(x), model(x))
    # no export format carries the rotation: refused, naming the matrix
    r = moec("export", packed, "--format", "ct", "-o", tmp_path / "exported")
    assert r.returncode == 2 and "fitted with incoherence processing" in r.stderr, (r.returncode, r.stderr)


def test_block_that_does_not_divide_exits_2(tiny_moe_dir, tmp_path):
    rec = tmp_path / "bad.yaml"
    rec.write_text(yaml.safe_dump({"weights": [{"targets": ["experts"], "codec": "hls", "bits": 2,
                                                "incoherence": {"block": 16}}]}))
    out = tmp_path / "calib"
    r = moec("calibrate", tiny_moe_dir, "--recipe", rec, "--data", "ptb", "--split", "valid", "--samples", "2",
             "--seq-len", "32", "-o", out)
    msg = "incoherence block 16 does not divide the input dim 40 of layers.0.moe.w2"
    assert r.returncode == 2 and msg in r.stderr, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and not out.exists()
