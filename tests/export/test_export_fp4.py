"""FP4 exports (moec/export): nvfp4 -> compressed-tensors `nvfp4-pack-quantized`, decoded by the library's own
NVFP4 compressor, and mxfp4 -> GGUF MXFP4, decoded by gguf-py, each equal bit for bit to the weights moec's
runtime uses; each codec refused by the format that cannot carry it, naming the one that can."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from gguf.quants import dequantize

from moec.errors import UserError
from moec.export import export
from moec.export.to_ct import hf_names
from moec.export.to_gguf import gguf_name, permute_rope_rows
from moec.runtime import fp4
from moec.runtime.config import ModelArgs

from .packs import ARGS, ct_decompressed, pack, rule, runtime_weights

_RANDOM_MX, _RANDOM_NV = fp4.random_mxfp4, fp4.random_nvfp4  # the stand-ins the varied ones below start from


def varied_mxfp4(bits, shape, group_size, device, gen=None):
    """mxfp4 parts with every code and e8m0 scales spread over [0, 130] (0 and 1: the subnormal 2^-127, 2^-126)."""
    E, O, I = shape
    parts = _RANDOM_MX(bits, shape, group_size, device, gen)
    parts["scale"] = torch.randint(100, 131, (E, O, I // 32), dtype=torch.uint8, device=device, generator=gen)
    parts["scale"].view(-1)[:2] = torch.tensor([0, 1], dtype=torch.uint8, device=device)
    return parts


def varied_nvfp4(bits, shape, group_size, device, gen=None):
    """nvfp4 parts with every code, e4m3 scales over every positive finite value, global scales 2^10 .. 2^14."""
    E, O, I = shape
    parts = _RANDOM_NV(bits, shape, group_size, device, gen)
    b = torch.randint(1, 0x7F, (E, O, I // 16), dtype=torch.uint8, device=device, generator=gen)
    parts["scale"] = b.view(torch.float8_e4m3fn)
    parts["global_scale"] = 2.0 ** torch.randint(10, 15, (E,), device=device, generator=gen).float()
    return parts


def test_nvfp4_exports_to_nvfp4_pack_quantized_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(fp4, "random_nvfp4", varied_nvfp4)
    p = pack(tmp_path / "p", rule(["experts", "attention"], "nvfp4", 4, 16))
    info = export(p, "ct", tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == info["quantization_format"] == "nvfp4-pack-quantized"

    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert {g["format"] for g in qc["config_groups"].values()} == {"nvfp4-pack-quantized"}
    got = ct_decompressed(tmp_path / "c")
    n = 0
    for param, w in runtime_weights(p).items():  # [E, O, I] fp32
        for e, name in enumerate(hf_names(param, ARGS)):
            back = got.pop(name.removesuffix(".weight"))
            # the library decodes into bf16; moec's weights are bf16 values (power-of-two global scales)
            assert back.dtype == torch.bfloat16, (name, back.dtype)
            assert torch.equal(back.float(), w[e]), (name, (back.float() - w[e]).abs().max())
            n += 1
    assert not got and n == info["quantized_modules"] == 2 * (3 * 4 + 4)


def test_mxfp4_exports_to_gguf_mxfp4_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(fp4, "random_mxfp4", varied_mxfp4)
    p = pack(tmp_path / "p", rule(["experts", "attention"], "mxfp4", 4, 32))
    info = export(p, "gguf", tmp_path / "g")
    assert info["quantized_tensors"] == {"MXFP4": ARGS.n_layers * 7} and info["q4_1_tensors"] == 0
    r = gguf.GGUFReader(tmp_path / "g" / info["file"])
    got = {t.name: t for t in r.tensors}
    assert r.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    for param, w in runtime_weights(p).items():
        t = got[gguf_name(param, dense=False)]
        assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4, (param, t.tensor_type)
        back = torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(w.shape)
        if param.endswith(("wq.weight", "wk.weight")):  # rows in GGML's interleaved RoPE order
            w = permute_rope_rows(w[0], ARGS.n_heads if "wq" in param else ARGS.n_kv_heads)[None]
        assert torch.equal(back, w), (param, (back - w).abs().max())


@pytest.mark.parametrize(("codec", "group", "fmt", "other", "why"), [
    ("nvfp4", 16, "gguf", "ct", "GGUF has no type for nvfp4"),
    ("mxfp4", 32, "ct", "gguf", "compressed-tensors has no format for mxfp4"),
])
def test_fp4_refused_by_the_other_format(tmp_path, codec, group, fmt, other, why):
    p = pack(tmp_path / "p", rule(["experts"], codec, 4, group))
    with pytest.raises(UserError, match=rf"layers\.0\.moe\.w1: codec {codec} 4-bit cannot be exported as {fmt}: "
                                        rf"{why}.*--format {other}"):
        export(p, fmt, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_nvfp4_ct_export_loads_in_transformers(tmp_path, monkeypatch):
    """A dense Llama with nvfp4 MLPs and attention: transformers loads the export (compressed-tensors decompresses
    it, into bf16 weights) with every quantized weight equal to moec's; in fp32 the logits equal moec's
    dequantized model's. compressed-tensors 0.20 gives bf16 weights even under dtype=float32 (the forward then
    fails on the dtype), so the fp32 check upcasts the loaded weights; the Mixtral experts are not loaded by
    transformers 5.17 from any ct export (per-expert Linears against its fused experts: moec/export/to_ct.py)."""
    from transformers import AutoModelForCausalLM

    from moec.runtime.loader import load_model

    monkeypatch.setattr(fp4, "random_nvfp4", varied_nvfp4)
    args = ModelArgs(**{**ARGS.to_dict(), "arch": "llama", "n_experts": 0, "top_k": 0, "expert_dim": 0,
                        "ffn_kinds": ["dense"] * 2, "dense_dim": 96})
    p = pack(tmp_path / "p", rule(["mlp", "attention"], "nvfp4", 4, 16), args=args)
    export(p, "ct", tmp_path / "c")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=torch.bfloat16)
    tokens = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(hf(tokens).logits).all()  # the first forward decompresses the modules in place
    mods = dict(hf.named_modules())
    for param, w in runtime_weights(p).items():
        for e, name in enumerate(hf_names(param, args)):
            got = mods[name.removesuffix(".weight")].weight
            assert got.dtype == torch.bfloat16 and torch.equal(got.float(), w[e]), name
    for prm in hf.parameters():
        prm.data = prm.data.float()
    model, _ = load_model(p)
    want = model(tokens).float()
    assert (hf(tokens).logits - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_nvfp4_with_a_global_scale_that_rounds_is_refused(tmp_path, monkeypatch):
    """A global scale that is not a power of two makes products the library's bf16 decode would round."""
    def odd(*a, **k):
        parts = varied_nvfp4(*a, **k)
        parts["global_scale"] = parts["global_scale"] * 1.3
        return parts

    monkeypatch.setattr(fp4, "random_nvfp4", odd)
    p = pack(tmp_path / "p", rule(["experts"], "nvfp4", 4, 16))
    with pytest.raises(UserError, match=r"layers\.0\.moe\.w1: codec nvfp4 4-bit cannot be exported as ct: "
                                        r"compressed-tensors decodes nvfp4 into bf16"):
        export(p, "ct", tmp_path / "c")
