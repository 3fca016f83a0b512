"""GGUF export (moec/export/to_gguf.py): read back with gguf-py, Q4_1 dequantizes (gguf.quants.dequantize)
to exactly the weights moec's runtime uses; what GGUF cannot carry is refused with the formats that can."""

from __future__ import annotations

import sys

import gguf
import pytest
import torch
from gguf.quants import dequantize

from moec.cli import app as cli
from moec.errors import UserError
from moec.export import export
from moec.export.to_gguf import gguf_name, permute_rope_rows
from moec.formats.checkpoint import load_tensors, read_manifest
from moec.runtime.config import ModelArgs

from .packs import ARGS, pack, rule, runtime_weights


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def test_rtn4_g32_exports_to_q4_1_exactly(tmp_path):
    p = pack(tmp_path / "p", rule(["experts", "attention"], "rtn", 4, 32))
    info = export(p, "gguf", tmp_path / "g")
    r = gguf.GGUFReader(tmp_path / "g" / info["file"])
    got = {t.name: t for t in r.tensors}
    ref = runtime_weights(p)
    assert len(ref) == info["q4_1_tensors"] == ARGS.n_layers * 7
    for param, w in ref.items():  # [E, O, I] fp32, the runtime's dequant_ref
        t = got[gguf_name(param, dense=False)]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1, (param, t.tensor_type)
        back = torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(w.shape)
        if param.endswith(("wq.weight", "wk.weight")):  # rows in GGML's interleaved RoPE order
            w = permute_rope_rows(w[0], ARGS.n_heads if "wq" in param else ARGS.n_kv_heads)[None]
        assert torch.equal(back, w), (param, (back - w).abs().max())
    kept = load_tensors(p, read_manifest(p), ["tok_embeddings.weight", "layers.1.ffn_norm.weight",
                                              "layers.0.moe.router.weight"])
    emb = got["token_embd.weight"]
    assert emb.tensor_type == gguf.GGMLQuantizationType.BF16
    assert torch.equal(torch.from_numpy(emb.data.copy()).view(torch.bfloat16).reshape(64, 64),
                       kept["tok_embeddings.weight"])
    for name, gname in (("layers.1.ffn_norm.weight", "blk.1.ffn_norm.weight"),
                        ("layers.0.moe.router.weight", "blk.0.ffn_gate_inp.weight")):
        assert got[gname].tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(torch.from_numpy(got[gname].data.copy()).reshape(kept[name].shape), kept[name].float())
    assert _field(r, "general.architecture") == "llama"
    assert (_field(r, "llama.expert_count"), _field(r, "llama.expert_used_count")) == (4, 2)
    assert (_field(r, "llama.attention.head_count"), _field(r, "llama.attention.head_count_kv")) == (4, 2)
    assert _field(r, "llama.feed_forward_length") == ARGS.expert_dim


def test_dense_llama_mlp_goes_as_plain_ffn_matrices(tmp_path):
    args = ModelArgs(**{**ARGS.to_dict(), "arch": "llama", "n_experts": 0, "top_k": 0, "expert_dim": 0,
                        "ffn_kinds": [], "dense_dim": 96, "tie_embeddings": True})
    p = pack(tmp_path / "p", rule(["mlp"], "rtn", 4, 32), args=args)
    r = gguf.GGUFReader(tmp_path / "g" / export(p, "gguf", tmp_path / "g")["file"])
    got = {t.name: t for t in r.tensors}
    assert "output.weight" not in got and "llama.expert_count" not in r.fields  # tied: llama.cpp reuses token_embd
    for param, w in runtime_weights(p).items():  # [1, O, I]
        t = got[gguf_name(param, dense=True)]
        assert t.name.startswith("blk.") and "_exps" not in t.name
        assert torch.equal(torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(w.shape), w), param


def test_bpe_tokenizer_goes_in_as_llamacpp_gpt2_vocabulary(tmp_path):
    import shutil

    from tests.conftest import _tiny_tokenizer

    V = _tiny_tokenizer(tmp_path / "tok")  # byte-level BPE, ~300 entries, <|endoftext|> special (id 0)
    p = pack(tmp_path / "p", rule(["experts"], "rtn", 4, 32), args=ModelArgs(**{**ARGS.to_dict(), "vocab_size": V}))
    for f in (tmp_path / "tok").iterdir():  # where `moec pack` puts the source's tokenizer files
        shutil.copy(f, p / f.name)
    info = export(p, "gguf", tmp_path / "g")
    r = gguf.GGUFReader(tmp_path / "g" / info["file"])
    assert info["tokenizer"] and _field(r, "tokenizer.ggml.model") == "gpt2"
    tokens, types = _field(r, "tokenizer.ggml.tokens"), _field(r, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == V and tokens[0] == "<|endoftext|>"
    assert types[0] == gguf.TokenType.CONTROL and set(types[1:]) == {gguf.TokenType.NORMAL}
    assert len(_field(r, "tokenizer.ggml.merges")) > 0 and _field(r, "tokenizer.ggml.eos_token_id") == 0


@pytest.mark.parametrize(("rules", "says"), [
    ([rule(["experts"], "rtn", 4, 64)], ["layers.0.moe.w1", "rtn 4-bit", "groups of 64",
                                         "no export format carries it exactly"]),
    ([rule(["experts"], "fp8", 8)], ["layers.0.moe.w1", "fp8", "no e4m3 type", "--format ct"]),
    ([rule(["attention"], "hls", 2)], ["layers.0.attn.wq.weight", "hls 2-bit", "no export format"]),
])
def test_what_gguf_cannot_carry_is_refused(tmp_path, rules, says):
    p = pack(tmp_path / "p", *rules)
    with pytest.raises(UserError) as e:
        export(p, "gguf", tmp_path / "g")
    assert all(s in str(e.value) for s in says), str(e.value)
    assert not (tmp_path / "g").exists()


def test_cli_export_refusal_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    p = pack(tmp_path / "p", rule(["experts"], "fp8", 8))
    monkeypatch.setattr(sys, "argv", ["moec", "export", str(p), "--format", "gguf", "-o", str(tmp_path / "g")])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--format ct" in err, err
