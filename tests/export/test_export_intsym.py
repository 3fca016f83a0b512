"""intsym exports (moec/export/to_ct.py, to_gguf.py): compressed-tensors' own decompressor and gguf-py's own
dequantizer give exactly the weights moec's runtime uses, for int4 and int8, grouped and per channel; what a
format cannot carry is refused naming the matrix."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from gguf.quants import dequantize

from moec.errors import UserError
from moec.export import export
from moec.export.to_gguf import gguf_name, permute_rope_rows

from .packs import ARGS, pack, rule, runtime_weights
from .test_export_ct import _check_exact


def test_intsym_exports_to_symmetric_pack_quantized_exactly(tmp_path):
    p = pack(tmp_path / "p", rule(["experts"], "intsym", 4, 32), rule(["attention"], "intsym", 8, 0))
    info = export(p, "ct", tmp_path / "c")
    assert info["quantization_format"] == "pack-quantized"
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    schemes = sorted((g["weights"]["num_bits"], g["weights"]["strategy"], g["weights"]["symmetric"])
                     for g in cfg["config_groups"].values())
    assert schemes == [(4, "group", True), (8, "channel", True)]
    # the experts' group targets the class Linear as llm-compressor writes a MoE (transformers fuses the experts:
    # per-expert names would match nothing there), after the attention group's anchored regexes; the kept
    # router and LM head ignored
    attn, experts = cfg["config_groups"].values()
    assert experts["targets"] == ["Linear"] and experts["weights"]["num_bits"] == 4
    assert attn["targets"][0] == r"re:^model\.layers\.0\.self_attn\.q_proj$" and len(attn["targets"]) == 8
    assert set(cfg["ignore"]) == {"lm_head", *(f"model.layers.{i}.block_sparse_moe.gate" for i in (0, 1))}
    assert _check_exact(p, tmp_path / "c") == info["quantized_modules"] == 2 * (3 * 4 + 4)
    # and compressed-tensors' own packing of those weights is byte for byte the export's (the layout vLLM reads)
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    qc = QuantizationConfig.model_validate(cfg)
    with safe_open(tmp_path / "c" / "model.safetensors", "pt") as h:
        for scheme in qc.config_groups.values():
            compressor = BaseCompressor.get_value_from_registry(scheme.format)
            named = [t.removeprefix("re:^").removesuffix("$").replace("\\", "") for t in scheme.targets] \
                if scheme.targets != ["Linear"] else \
                [f"model.layers.{i}.block_sparse_moe.experts.{e}.w{j}" for i in (0, 1) for e in (0, 3) for j in (1, 2)]
            for m in named:
                sd = {k: h.get_tensor(f"{m}.{k}") for k in ("weight_packed", "weight_scale", "weight_shape")}
                w = compressor.decompress(sd, scheme)["weight"]
                again = compressor.compress({"weight": w, "weight_scale": sd["weight_scale"]}, scheme)
                assert set(again) == set(sd) and all(torch.equal(again[k], sd[k]) for k in sd), m


@pytest.mark.parametrize(("bits", "qtype"), [(4, gguf.GGMLQuantizationType.Q4_0),
                                             (8, gguf.GGMLQuantizationType.Q8_0)])
def test_intsym_g32_exports_to_q4_0_q8_0_exactly(tmp_path, bits, qtype):
    p = pack(tmp_path / "p", rule(["experts", "attention"], "intsym", bits, 32))
    info = export(p, "gguf", tmp_path / "g")
    assert info["quantized_tensors"] == {qtype.name: ARGS.n_layers * 7}
    r = gguf.GGUFReader(tmp_path / "g" / info["file"])
    assert r.fields["general.file_type"].contents() == gguf.LlamaFileType[f"MOSTLY_{qtype.name}"]
    got = {t.name: t for t in r.tensors}
    for param, w in runtime_weights(p).items():  # [E, O, I] fp32, the runtime's dequant_ref
        t = got[gguf_name(param, dense=False)]
        assert t.tensor_type == qtype, (param, t.tensor_type)
        back = torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(w.shape)
        if param.endswith(("wq.weight", "wk.weight")):
            w = permute_rope_rows(w[0], ARGS.n_heads if "wq" in param else ARGS.n_kv_heads)[None]
        assert torch.equal(back, w), (param, (back - w).abs().max())


def test_intsym_other_groups_are_refused_by_gguf(tmp_path):
    p = pack(tmp_path / "p", rule(["experts"], "intsym", 4, 64))
    with pytest.raises(UserError, match=r"layers\.0\.moe\.w1: codec intsym 4-bit cannot be exported as gguf: "
                                        r"Q4_0 / Q8_0 hold .* groups of 32; this is 4-bit in groups of 64; "
                                        r"it exports to --format ct"):
        export(p, "gguf", tmp_path / "g")
    assert not (tmp_path / "g").exists()
