"""Tiny deepseek2 and gpt-oss GGUF files in llama.cpp's layout (names, shapes, metadata keys as llama.cpp
0.3.36's loader asks for them; see moec/calibrate/gguf_generic.py), written with gguf-py from a transformers
model. Expert stacks are quantized (Q8_0, or MXFP4 as gpt-oss ships), and the model is then given back what
the file holds (gguf-py's own dequantization), so a reader is exact when its logits equal the model's.

Used by tests/calibrate/test_gguf_generic.py and by benchmarks/studies/gguf_read_llamacpp.py, which checks
the same files against llama.cpp itself.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf.quants import dequantize, quantize

F32 = gguf.GGMLQuantizationType.F32
Q8 = gguf.GGMLQuantizationType.Q8_0
MXFP4 = gguf.GGMLQuantizationType.MXFP4


class _Writer(gguf.GGUFWriter):
    """GGUFWriter that leaves out the tensors named in `drop` and adds `extra` ({name: fp32 array}): files
    that differ from a faithful one in one tensor, for the refusal tests."""

    def __init__(self, path, arch: str, drop=(), extra=None):
        super().__init__(str(path), arch)
        self.drop, self.extra = set(drop), dict(extra or {})

    def add_tensor(self, name, *args, **kwargs):
        if name not in self.drop:
            super().add_tensor(name, *args, **kwargs)


def tiny_model(model_type: str, **overrides):
    """moec.hf.tiny's config of `model_type` with `overrides`, as a seeded random transformers model."""
    import transformers

    from moec.hf.tiny import tiny_config

    cfg = tiny_config(model_type)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _add_tensor(w, name: str, t: np.ndarray, qtype) -> np.ndarray:
    """Store `t` [rows, ...] under `name`; return what the file holds, dequantized (as gguf-py reads it)."""
    t = np.ascontiguousarray(t, dtype=np.float32)
    if qtype == F32:
        w.add_tensor(name, t)
        return t
    q = quantize(t, qtype)
    w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    return dequantize(q, qtype).reshape(t.shape)


def _finish(w) -> None:
    for name, t in w.extra.items():
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _common(w, arch: str, c, n_experts: int, tokenizer: bool) -> None:
    """Metadata both architectures share; `tokenizer`: the built-in demo-moe BPE vocabulary (8192 tokens, the
    tiny models' vocabulary) as moec's GGUF export writes it (llama.cpp needs one to load a file)."""
    if tokenizer:
        import json

        from moec.export.to_gguf import _add_tokenizer
        from moec.hf.tiny import DEMO_TOKENIZER

        _add_tokenizer(w, DEMO_TOKENIZER, c.vocab_size, json.loads((DEMO_TOKENIZER / "config.json").read_text()))
    w.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    w.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    w.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    w.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    w.add_uint32(f"{arch}.expert_count", n_experts)
    w.add_uint32(f"{arch}.expert_used_count", c.num_experts_per_tok)
    w.add_uint32(f"{arch}.vocab_size", c.vocab_size)


def _globals(w, sd: dict, new: dict) -> None:
    for hf, g in (("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
                  ("lm_head.weight", "output.weight")):
        new[hf] = _add_tensor(w, g, sd[hf], F32)


def write_deepseek2(path, model, *, mla: bool = True, yarn: dict | None = None, expert_qtype=Q8, drop=(),
                    extra=None, tokenizer: bool = False) -> None:
    """A DeepSeek-V2/V3 model (transformers in-memory layout) as llama.cpp stores it: MLA files split kv_b
    into attn_k_b [H, r, nope] (transposed per head) and attn_v_b [H, v, r]; legacy files keep attn_kv_b.
    `yarn`: {factor, original, mscale_all_dim} written as llama.cpp's converter writes them."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    arch, H = "deepseek2", c.num_attention_heads
    sigmoid = c.model_type == "deepseek_v3"
    E = c.n_routed_experts
    w = _Writer(path, arch, drop, extra)
    _common(w, arch, c, E, tokenizer)
    w.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.expert_feed_forward_length", c.moe_intermediate_size)
    w.add_uint32(f"{arch}.expert_shared_count", c.n_shared_experts)
    w.add_uint32(f"{arch}.leading_dense_block_count", c.first_k_dense_replace)
    w.add_uint32(f"{arch}.attention.kv_lora_rank", c.kv_lora_rank)
    if c.q_lora_rank:
        w.add_uint32(f"{arch}.attention.q_lora_rank", c.q_lora_rank)
    w.add_uint32(f"{arch}.rope.dimension_count", c.qk_rope_head_dim)
    if mla:  # llama.cpp's MLA files: the cache is the latent, one "head" of kv_lora + rope
        w.add_uint32(f"{arch}.attention.head_count_kv", 1)
        w.add_uint32(f"{arch}.attention.key_length", c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_uint32(f"{arch}.attention.value_length", c.kv_lora_rank)
        w.add_uint32(f"{arch}.attention.key_length_mla", c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_uint32(f"{arch}.attention.value_length_mla", c.v_head_dim)
    else:
        w.add_uint32(f"{arch}.attention.head_count_kv", H)
        w.add_uint32(f"{arch}.attention.key_length", c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_uint32(f"{arch}.attention.value_length", c.v_head_dim)
    w.add_float32(f"{arch}.expert_weights_scale", c.routed_scaling_factor)
    w.add_bool(f"{arch}.expert_weights_norm", bool(c.norm_topk_prob))
    w.add_uint32(f"{arch}.expert_gating_func", 2 if sigmoid else 1)
    if c.n_group:
        w.add_uint32(f"{arch}.expert_group_count", c.n_group)
        w.add_uint32(f"{arch}.expert_group_used_count", c.topk_group)
    if yarn:
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", yarn["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", yarn["original"])
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1 * yarn["mscale_all_dim"])
    new: dict[str, np.ndarray] = {}
    _globals(w, sd, new)
    per = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
           "self_attn.q_a_layernorm.weight": "attn_q_a_norm", "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm",
           "self_attn.q_a_proj.weight": "attn_q_a", "self_attn.q_b_proj.weight": "attn_q_b",
           "self_attn.q_proj.weight": "attn_q", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa",
           "self_attn.o_proj.weight": "attn_output", "mlp.gate.weight": "ffn_gate_inp",
           "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
           **{f"mlp.shared_experts.{h}_proj.weight": f"ffn_{h}_shexp" for h in ("gate", "up", "down")}}
    nope, v = c.qk_nope_head_dim, c.v_head_dim
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, g in per.items():
            if p + hf in sd:
                new[p + hf] = _add_tensor(w, b + g + ".weight", sd[p + hf], F32)
        if p + "mlp.gate.e_score_correction_bias" in sd:
            new[p + "mlp.gate.e_score_correction_bias"] = _add_tensor(w, b + "exp_probs_b.bias",
                                                                       sd[p + "mlp.gate.e_score_correction_bias"], F32)
        kv = sd[p + "self_attn.kv_b_proj.weight"]  # [H·(nope + v), r]
        if mla:
            kvh = kv.reshape(H, nope + v, -1)
            kb = _add_tensor(w, b + "attn_k_b.weight", kvh[:, :nope].transpose(0, 2, 1), F32)  # [H, r, nope]
            vb = _add_tensor(w, b + "attn_v_b.weight", kvh[:, nope:], F32)  # [H, v, r]
            new[p + "self_attn.kv_b_proj.weight"] = np.concatenate([kb.transpose(0, 2, 1), vb], 1).reshape(kv.shape)
        else:
            new[p + "self_attn.kv_b_proj.weight"] = _add_tensor(w, b + "attn_kv_b.weight", kv, F32)
        if p + "mlp.experts.gate_up_proj" in sd:  # [E, 2I, D]: gate rows, then up
            gu, half = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.gate_up_proj"].shape[1] // 2
            gate = _add_tensor(w, b + "ffn_gate_exps.weight", gu[:, :half], expert_qtype)
            up = _add_tensor(w, b + "ffn_up_exps.weight", gu[:, half:], expert_qtype)
            new[p + "mlp.experts.gate_up_proj"] = np.concatenate([gate, up], 1)
            new[p + "mlp.experts.down_proj"] = _add_tensor(w, b + "ffn_down_exps.weight",
                                                           sd[p + "mlp.experts.down_proj"], expert_qtype)
    _finish(w)
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(t)) for k, t in new.items()}, strict=True)


def write_gpt_oss(path, model, *, expert_qtype=MXFP4, drop=(), extra=None, tokenizer: bool = False) -> None:
    """A gpt-oss model as llama.cpp stores it: experts apart ([E, I, D] gate and up, [E, D, I] down, their
    biases), sinks as attn_sinks.weight, the post-attention norm as post_attention_norm."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    arch = "gpt-oss"
    w = _Writer(path, arch, drop, extra)
    _common(w, arch, c, c.num_local_experts, tokenizer)
    w.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    w.add_uint32(f"{arch}.attention.key_length", c.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", c.head_dim)
    w.add_uint32(f"{arch}.rope.dimension_count", c.head_dim)
    w.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.expert_feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    r = c.rope_parameters
    if r.get("rope_type") == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", r["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", r["original_max_position_embeddings"])
    new: dict[str, np.ndarray] = {}
    _globals(w, sd, new)
    per = {"input_layernorm.weight": "attn_norm.weight",
           "post_attention_layernorm.weight": "post_attention_norm.weight",
           "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
           "mlp.router.bias": "ffn_gate_inp.bias",
           **{f"self_attn.{h}_proj.{s}": f"attn_{g}.{s}" for h, g in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                     ("o", "output")) for s in ("weight", "bias")}}
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, g in per.items():
            new[p + hf] = _add_tensor(w, b + g, sd[p + hf], F32)
        gu, gub = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.gate_up_proj_bias"]  # [E,D,2I], [E,2I]
        gate = _add_tensor(w, b + "ffn_gate_exps.weight", gu[..., 0::2].transpose(0, 2, 1), expert_qtype)
        up = _add_tensor(w, b + "ffn_up_exps.weight", gu[..., 1::2].transpose(0, 2, 1), expert_qtype)
        down = _add_tensor(w, b + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1),
                           expert_qtype)  # [E, D, I]
        gb = _add_tensor(w, b + "ffn_gate_exps.bias", gub[:, 0::2], F32)
        ub = _add_tensor(w, b + "ffn_up_exps.bias", gub[:, 1::2], F32)
        new[p + "mlp.experts.down_proj_bias"] = _add_tensor(w, b + "ffn_down_exps.bias",
                                                            sd[p + "mlp.experts.down_proj_bias"], F32)
        gu_new, gub_new = np.empty_like(gu), np.empty_like(gub)
        gu_new[..., 0::2], gu_new[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        gub_new[:, 0::2], gub_new[:, 1::2] = gb, ub
        new[p + "mlp.experts.gate_up_proj"], new[p + "mlp.experts.gate_up_proj_bias"] = gu_new, gub_new
        new[p + "mlp.experts.down_proj"] = down.transpose(0, 2, 1)
    _finish(w)
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(t)) for k, t in new.items()}, strict=True)
