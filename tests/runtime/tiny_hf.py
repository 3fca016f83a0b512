"""Tiny random Hugging Face models of every supported architecture, saved to disk as HF saves them."""

import torch
import transformers as T


def tiny_configs() -> dict:
    common = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    mla = common | dict(num_key_value_heads=6, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                        v_head_dim=12)
    return {
        "llama": T.LlamaConfig(**common, intermediate_size=40, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64}),
        "mixtral": T.MixtralConfig(**common, intermediate_size=40, num_local_experts=5, num_experts_per_tok=2),
        "qwen2_moe": T.Qwen2MoeConfig(**common, intermediate_size=56, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=32, num_experts=6, num_experts_per_tok=3,
                                      mlp_only_layers=[1], norm_topk_prob=False),
        "qwen3_moe": T.Qwen3MoeConfig(**common, intermediate_size=56, moe_intermediate_size=24, head_dim=16,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        "olmoe": T.OlmoeConfig(**common, intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                               clip_qkv=8.0),
        # MLA (no q LoRA, interleaved RoPE as complex pairs), group-limited softmax routing, a leading dense
        # layer, a shared expert, routed_scaling_factor
        "deepseek_v2": T.DeepseekV2Config(**mla, intermediate_size=40, moe_intermediate_size=24, n_routed_experts=8,
                                          num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
                                          topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                          q_lora_rank=None, routed_scaling_factor=1.5),
        # q LoRA, sigmoid + correction bias + group top-2 routing, YaRN with DeepSeek's mscale pair
        "deepseek_v3": T.DeepseekV3Config(**mla, intermediate_size=40, moe_intermediate_size=24, n_routed_experts=8,
                                          num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1,
                                          n_group=4, topk_group=2, q_lora_rank=20, routed_scaling_factor=2.5,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                           "original_max_position_embeddings": 64,
                                                           "mscale": 0.707, "mscale_all_dim": 0.707,
                                                           "beta_fast": 32, "beta_slow": 1}),
        # GQA with q/k/v biases and per-head q/k norm, partial rotary (half of head_dim 16), DeepSeek-V3's routing
        # (sigmoid + correction bias + group top-2), a leading dense layer, a shared expert
        "glm4_moe": T.Glm4MoeConfig(**common, head_dim=16, attention_bias=True, use_qk_norm=True,
                                    intermediate_size=40, moe_intermediate_size=24, n_routed_experts=8,
                                    num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                                    topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                     "partial_rotary_factor": 0.5}),
        # learned sinks, biases everywhere, 8-token sliding windows on alternate layers, a biased router with the
        # softmax after top-k, biased experts with the clamped SwiGLU (gate/up interleaved), YaRN untruncated
        "gpt_oss": T.GptOssConfig(**common, head_dim=16, intermediate_size=24, num_local_experts=6,
                                  num_experts_per_tok=2, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"],
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 4.0,
                                                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                   "original_max_position_embeddings": 64}),
    }


def make_tiny(arch: str, path, seed: int = 0, **overrides):
    """Random-weight HF model saved to `path`; returns the in-memory transformers model (fp32).
    overrides: config fields set on the tiny config (e.g. vocab_size to match a tokenizer)."""
    torch.manual_seed(seed)
    cfg = tiny_configs()[arch]
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = "eager"
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    # Default init (std 0.02) gives near-uniform routers; a wider spread makes routing decisive and
    # exercises real top-k choices instead of near ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and p.dim() >= 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return model
