"""compressed-tensors export (moec/export/to_ct.py): the library itself (PyPI compressed-tensors) parses the
exported quantization_config and decompresses every quantized module to exactly the weights moec's
runtime uses; rtn whose zero is not an integer level is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moec.errors import UserError
from moec.export import export
from moec.export.to_ct import hf_names
from moec.runtime import weightcodecs
from moec.runtime.config import ModelArgs

from .packs import ARGS, ct_decompressed, integer_zero_rtn, pack, rule, runtime_weights


def _check_exact(packed, out) -> int:
    got = ct_decompressed(out)
    n = 0
    for param, w in runtime_weights(packed).items():  # [E, O, I] fp32
        for e, name in enumerate(hf_names(param, ARGS)):
            back = got.pop(name.removesuffix(".weight"))
            assert back.dtype == torch.float32 and torch.equal(back, w[e]), (name, (back - w[e]).abs().max())
            n += 1
    assert not got, f"modules the runtime does not quantize: {sorted(got)}"
    return n


def test_integer_zero_rtn_exports_to_pack_quantized_exactly(tmp_path, monkeypatch):
    # 3-bit groups of 16 (codes straddle int32 words; with expert_dim 48 a w2 row's 144 bits end mid-word)
    # and 4-bit one group per row (channel strategy)
    monkeypatch.setattr(weightcodecs, "random_rtn", integer_zero_rtn)
    p = pack(tmp_path / "p", rule(["experts"], "rtn", 3, 16), rule(["attention"], "rtn", 4, 0),
             args=ModelArgs(**{**ARGS.to_dict(), "expert_dim": 48}))
    info = export(p, "ct", tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == info["quantization_format"] == "pack-quantized"
    strategies = sorted(g["weights"]["strategy"] for g in cfg["config_groups"].values())
    assert strategies == ["channel", "group"]
    assert _check_exact(p, tmp_path / "c") == info["quantized_modules"] == 2 * (3 * 4 + 4)


def test_fp8_exports_to_float_quantized_exactly(tmp_path):
    p = pack(tmp_path / "p", rule(["experts"], "fp8", 8))
    info = export(p, "ct", tmp_path / "c")
    assert info["quantization_format"] == "float-quantized"
    assert _check_exact(p, tmp_path / "c") == 2 * 3 * 4
    with safe_open(tmp_path / "c" / "model.safetensors", "pt") as h:  # kept tensors under their HF names
        assert h.get_tensor("model.layers.1.block_sparse_moe.gate.weight").dtype == torch.bfloat16
        assert h.get_tensor("model.layers.0.self_attn.q_proj.weight").shape == (64, 64)


def test_fractional_zero_rtn_is_refused(tmp_path):
    p = pack(tmp_path / "p", rule(["experts"], "rtn", 4, 32))  # pack_random's rtn: zero = -7.5·scale
    with pytest.raises(UserError, match=r"layers\.0\.moe\.w1: codec rtn 4-bit cannot be exported as ct: "
                                        r"pack-quantized needs an integer zero point.*--format gguf"):
        export(p, "ct", tmp_path / "c")


def _hf_config(a: ModelArgs) -> dict:
    """The HF config.json of `a` (what runtime/hf_layout.args_from_config reads; pack --random writes less)."""
    cfg = {"model_type": a.arch, "vocab_size": a.vocab_size, "hidden_size": a.dim, "num_hidden_layers": a.n_layers,
           "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
           "tie_word_embeddings": a.tie_embeddings, "attention_bias": a.qkv_bias, "qkv_bias": a.qkv_bias,
           "rms_norm_eps": a.norm_eps, "max_position_embeddings": a.max_seq_len}
    if a.arch == "llama":
        return {**cfg, "intermediate_size": a.dense_dim}
    moe = {"num_experts_per_tok": a.top_k, "num_local_experts" if a.arch == "mixtral" else "num_experts": a.n_experts}
    if a.arch in ("mixtral", "olmoe"):
        return {**cfg, **moe, "intermediate_size": a.expert_dim}
    return {**cfg, **moe, "moe_intermediate_size": a.expert_dim, "intermediate_size": a.dense_dim,
            "mlp_only_layers": [i for i, k in enumerate(a.ffn_kinds) if k == "dense"],
            "shared_expert_intermediate_size": a.shared_dim}


_SMALL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=64)
_MOE = dict(n_experts=3, top_k=2, expert_dim=16)


@pytest.mark.parametrize("args", [
    ModelArgs(arch="llama", **_SMALL, dense_dim=24, tie_embeddings=True),
    ModelArgs(arch="mixtral", **_SMALL, **_MOE),
    ModelArgs(arch="olmoe", **_SMALL, **_MOE, qk_norm="full", norm_topk=False),
    ModelArgs(arch="qwen2_moe", **_SMALL, **_MOE, qkv_bias=True, ffn_kinds=["dense", "moe"], dense_dim=24,
              shared_dim=8, shared_gate=True, norm_topk=False),
    ModelArgs(arch="qwen3_moe", **_SMALL, **_MOE, qk_norm="head", norm_topk=False),
], ids=lambda a: a.arch)
def test_ct_names_are_the_hf_names_moec_reads(tmp_path, args):
    """A kept-only export, read back by moec's own HF reader (runtime/hf_layout.py), gives every packed tensor."""
    from moec.formats.checkpoint import load_tensors, read_manifest
    from moec.runtime.hf_layout import HFCheckpoint

    p = pack(tmp_path / "p", args=args)
    export(p, "ct", tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text(json.dumps(_hf_config(args)))
    ck = HFCheckpoint(tmp_path / "c")
    assert ck.args == args
    back, packed = ck.state_dict(), load_tensors(p, read_manifest(p))
    assert back.keys() == packed.keys()
    assert all(torch.equal(back[k], packed[k]) for k in packed)


def test_fp8_kv_exports_as_kv_cache_scheme(tmp_path, caplog):
    """The fp8 KV codec's per-layer scales become compressed-tensors' kv_cache_scheme and self_attn.k_scale /
    v_scale: the library parses the scheme, transformers loads every scale into its attention modules exactly
    (no missing or unexpected keys), and GGUF, which cannot carry it, says so."""
    import logging

    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    from moec.calibrate.pack import pack_random
    from moec.calibrate.recipe import parse_recipe
    from moec.formats.checkpoint import load_tensors, read_manifest

    from .packs import ARGS

    p = tmp_path / "p"
    pack_random(ARGS, "tiny", parse_recipe({"name": "fp8-kv", "weights": [rule(["experts"], "fp8", 8)],
                                            "kv": {"codec": "fp8", "bits": 8, "window": 0, "sinks": 0}}), p)
    export(p, "ct", tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(cfg).kv_cache_scheme
    assert (scheme.num_bits, scheme.type, scheme.strategy, scheme.dynamic) == (8, "float", "tensor", False)
    kv = {n: t for n, t in load_tensors(p, read_manifest(p)).items() if n.startswith("kv.")}
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    for i, layer in enumerate(hf.model.layers):
        for kind in ("k", "v"):
            assert torch.equal(getattr(layer.self_attn, f"{kind}_scale").data.float().reshape(1),
                               kv[f"kv.layers.{i}.{kind}_scale"].float().reshape(1)), (i, kind)
    q = tmp_path / "q"  # GGUF: int8 experts export (Q8_0), the fp8 KV codec does not
    pack_random(ARGS, "tiny", parse_recipe({"name": "kv-only", "weights": [rule(["experts"], "intsym", 8, 32)],
                                            "kv": {"codec": "fp8", "bits": 8, "window": 0, "sinks": 0}}), q)
    with caplog.at_level(logging.WARNING):
        export(q, "gguf", tmp_path / "g")
    assert "KV codec fp8 is a runtime setting of moec: --format gguf does not carry it" in caplog.text
