"""hf_layout.config_from_args is the inverse of args_from_config: every preset shape and one ModelArgs per
supported architecture survive ModelArgs -> config.json dict -> ModelArgs unchanged."""

import pytest

from moec.runtime.config import PRESETS, ModelArgs
from moec.runtime.hf_layout import SUPPORTED, args_from_config, config_from_args

COMMON = dict(vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=256)
CASES = {
    "llama": ModelArgs(arch="llama", **COMMON, dense_dim=128, qkv_bias=True, o_bias=True, tie_embeddings=True),
    "mixtral": ModelArgs(arch="mixtral", **COMMON, n_experts=4, top_k=2, expert_dim=80, rope_theta=1e6),
    "qwen2_moe": ModelArgs(arch="qwen2_moe", **COMMON, ffn_kinds=["dense", "moe", "moe"], dense_dim=96, n_experts=4,
                           top_k=2, expert_dim=48, norm_topk=False, qkv_bias=True, shared_dim=64, shared_gate=True),
    "qwen3_moe": ModelArgs(arch="qwen3_moe", **COMMON, ffn_kinds=["moe", "dense", "moe"], dense_dim=96, n_experts=8,
                           top_k=2, expert_dim=48, qk_norm="head"),
    "olmoe": ModelArgs(arch="olmoe", **COMMON, n_experts=4, top_k=2, expert_dim=48, qk_norm="full", clip_qkv=8.0,
                       norm_topk=False),
    # MLA without q LoRA, V2's group-limited softmax routing, a shared expert, linear RoPE scaling
    "deepseek_v2": ModelArgs(arch="deepseek_v2", **COMMON | dict(n_kv_heads=4, head_dim=24), ffn_kinds=["dense", "moe",
                             "moe"], dense_dim=96, n_experts=8, top_k=2, expert_dim=48, norm_topk=False,
                             shared_dim=96, topk_method="group_max", n_group=4, topk_group=2, routed_scale=1.5,
                             attn_kind="mla", kv_lora_rank=32, qk_rope_dim=8, v_head_dim=16, rope_interleave=True,
                             rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # q LoRA, sigmoid + bias + group top-2, no interleave (a V3 config may turn it off)
    "deepseek_v3": ModelArgs(arch="deepseek_v3", **COMMON | dict(n_kv_heads=4, head_dim=24), ffn_kinds=["dense", "moe",
                             "moe"], dense_dim=96, n_experts=8, top_k=2, expert_dim=48, shared_dim=48,
                             router_score="sigmoid", topk_method="group_top2", n_group=2, topk_group=1,
                             router_bias=True, routed_scale=2.5, attn_kind="mla", q_lora_rank=32, kv_lora_rank=32,
                             qk_rope_dim=8, v_head_dim=16),
    # q/k/v biases, per-head q/k norm, partial rotary, DeepSeek-V3's routing, a leading dense layer, a shared expert
    "glm4_moe": ModelArgs(arch="glm4_moe", **COMMON, ffn_kinds=["dense", "moe", "moe"], dense_dim=96, n_experts=8,
                          top_k=2, expert_dim=48, shared_dim=48, qkv_bias=True, qk_norm="head", rotary_dim=8,
                          router_score="sigmoid", topk_method="group_top2", n_group=2, topk_group=1, router_bias=True,
                          routed_scale=2.5),
    # sinks, sliding windows on alternate layers, biases everywhere, the biased softmax-after-top-k router, biased
    # experts with the clamped SwiGLU, untruncated YaRN
    "gpt_oss": ModelArgs(arch="gpt_oss", **COMMON, n_experts=8, top_k=2, expert_dim=48, norm_topk=False,
                         qkv_bias=True, o_bias=True, attn_sinks=True, layer_windows=[128, 0, 128],
                         router_score="softmax_topk", router_logit_bias=True, expert_bias=True,
                         expert_act="clamped_swiglu", swiglu_limit=7.0,
                         rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
}


@pytest.mark.parametrize("args", [*PRESETS.values(), *CASES.values()], ids=[*PRESETS, *CASES])
def test_config_round_trip(args):
    assert args_from_config(config_from_args(args)).to_dict() == args.to_dict()


def test_every_supported_architecture_has_a_case():
    assert set(CASES) == set(SUPPORTED)
