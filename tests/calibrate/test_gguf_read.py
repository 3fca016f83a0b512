"""GGUF files are read exactly or refused in one line (issue 34, "no silent failure"): a MoE GGUF (llama with
experts as llama.cpp and moec's exporter store Mixtral, qwen3moe) is read as a MoE whose logits are those of
the source model with gguf-py's own dequantization of each stored tensor; an architecture or a tensor moec
does not map is refused, naming it. Tiny files written here with gguf-py: 2 layers, 4 experts, hidden 64."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers as T
from gguf.quants import dequantize, quantize

from moec.calibrate.sources import resolve_model
from moec.errors import UserError
from moec.export.to_gguf import permute_rope_rows
from moec.runtime.loader import load_model

Q8 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32
SIZES = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=128, num_experts_per_tok=2, rms_norm_eps=1e-5)


def _hf_model(arch: str):
    torch.manual_seed(0)
    if arch == "llama":  # Mixtral, which llama.cpp stores as llama with experts
        cfg = T.MixtralConfig(**SIZES, intermediate_size=64, num_local_experts=4)
        return T.MixtralForCausalLM(cfg).eval()
    if arch == "qwen2moe":  # q/k/v biases, a gated shared expert
        cfg = T.Qwen2MoeConfig(**SIZES, moe_intermediate_size=64, intermediate_size=96, num_experts=4,
                               shared_expert_intermediate_size=32, norm_topk_prob=False, decoder_sparse_step=1,
                               mlp_only_layers=[], qkv_bias=True)
        return T.Qwen2MoeForCausalLM(cfg).eval()
    cfg = T.Qwen3MoeConfig(**SIZES, moe_intermediate_size=64, intermediate_size=96, num_experts=4,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return T.Qwen3MoeForCausalLM(cfg).eval()


def write_gguf(path, arch: str, model, extra: dict | None = None) -> None:
    """`model` stored as llama.cpp's converter stores it (q/k rows permuted for llama), experts in Q8_0 (so
    the reader must dequantize); each stored tensor replaced in `model` by what the file holds."""
    c, sd = model.config, model.state_dict()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    if arch != "llama":
        w.add_expert_feed_forward_length(64)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(32)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                 "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
                 "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
                 **{f"mlp.shared_expert.{h}_proj.weight": f"ffn_{h}_shexp.weight" for h in ("gate", "up", "down")},
                 **{f"self_attn.{h}_proj.bias": f"attn_{h}.bias" for h in "qkv"}}
    for i in range(c.num_hidden_layers):
        names |= {f"model.layers.{i}.{h}": f"blk.{i}.{g}" for h, g in per_layer.items()}
    stored = {}
    for name, t in sd.items():
        t = t.float().numpy()
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, D]: gate rows, then up
            blk = f"blk.{name.split('.')[2]}."
            half = t.shape[1] // 2
            stored[blk + "ffn_gate_exps.weight"] = (t[:, :half], Q8, name, slice(0, half))
            stored[blk + "ffn_up_exps.weight"] = (t[:, half:], Q8, name, slice(half, None))
        elif name.endswith("experts.down_proj"):  # [E, D, I]
            stored[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = (t, Q8, name, slice(None))
        else:
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
                t = permute_rope_rows(torch.from_numpy(t), heads).numpy()
            stored[names[name]] = (t.reshape(-1) if name.endswith("shared_expert_gate.weight") else t, F32, name, None)
    for gname, (t, qtype, hf_name, rows) in (stored | (extra or {})).items():
        if qtype == F32:
            w.add_tensor(gname, np.ascontiguousarray(t))
            continue
        q = quantize(np.ascontiguousarray(t), qtype)
        w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qtype)
        with torch.no_grad():  # the model now holds what the file holds: gguf-py's own dequantization
            sd[hf_name][:, rows] = torch.from_numpy(dequantize(q, qtype).reshape(t.shape))
    model.load_state_dict(sd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2moe", "qwen3moe"])
def test_moe_gguf_is_read_as_a_moe(tmp_path, monkeypatch, arch):
    monkeypatch.setenv("MOEC_CACHE", str(tmp_path / "cache"))
    model = _hf_model(arch)
    write_gguf(tmp_path / "m.gguf", arch, model)
    rt, _ = load_model(resolve_model(str(tmp_path / "m.gguf")))
    want = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}[arch]
    assert (rt.args.arch, rt.args.n_experts, rt.args.top_k) == (want, 4, 2)
    x = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(rt(x), model(x).logits, rtol=1e-4, atol=1e-4)


def _stub(path, arch: str, **kv):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for key, value in kv.items():
        w.add_string(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unmapped_architecture_and_tensor_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match="architecture 'phi3' is not one moec reads") as e:
        resolve_model(str(_stub(tmp_path / "phi.gguf", "phi3")))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="RoPE scaling 'yarn'"):  # transformers' llama mapping drops it
        resolve_model(str(_stub(tmp_path / "yarn.gguf", "llama", **{"rope.scaling.type": "yarn"})))
    # a shared-expert gate, which qwen3moe has not: dropping it would change the model
    extra = {"blk.0.ffn_gate_inp_shexp.weight": (np.zeros(64, np.float32), F32, None, None)}
    write_gguf(tmp_path / "x.gguf", "qwen3moe", _hf_model("qwen3moe"), extra)
    with pytest.raises(UserError, match="tensor 'blk.0.ffn_gate_inp_shexp.weight' of GGUF architecture 'qwen3moe'"):
        resolve_model(str(tmp_path / "x.gguf"))


def test_moec_gguf_export_reads_back_as_the_packed_moe(tmp_path, monkeypatch):
    """moec's own export (llama with experts, Q4_1 experts and attention) is read back as the MoE it was: the
    logits of moec's runtime on the packed checkpoint."""
    from moec.export import export
    from tests.export.packs import pack, rule

    monkeypatch.setenv("MOEC_CACHE", str(tmp_path / "cache"))
    p = pack(tmp_path / "p", rule(["experts", "attention"], "rtn", 4, 32))
    info = export(p, "gguf", tmp_path / "g")
    back, _ = load_model(resolve_model(str(tmp_path / "g" / info["file"])))
    packed, _ = load_model(p)
    assert (back.args.arch, back.args.n_experts) == ("mixtral", packed.args.n_experts)
    x = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(x), packed(x), rtol=1e-4, atol=1e-4)
