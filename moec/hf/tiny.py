"""Tiny random configs for every MoE causal-LM type of transformers (5.17) that moec tests.

One override table (`TABLE`, model_type → overrides) on top of `COMMON` (the knobs most config classes
share: hidden 64, 4 layers, 8 experts, vocab 8192 so the built-in demo-moe tokenizer drives any of them).
`COMMON` keys are applied only where the type's config class declares them (a field or an
`attribute_map` alias); a `TABLE` key must be declared by the class (a typo is an error, not a silence).
Each entry keeps at least one of each special layer the type has: a leading dense layer, a sliding-window
layer (window 8, so a 16-token forward crosses it), a linear-attention or state-space layer, MLA with small
ranks.

    cfg = tiny_config("deepseek_v3")            # transformers PretrainedConfig
    model = tiny_model("gpt_oss", seed=0)      # seeded random weights, eval()
    save_tiny("qwen3_next", "/tmp/qn")         # an HF directory `moec calibrate` reads
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
from pathlib import Path

import torch

from ..atomic import atomic_dir
from ..errors import UserError

DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "builtin" / "demo-moe"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB = 8192  # the demo-moe tokenizer's vocabulary
BOS = EOS = 0  # its one special token, <|endoftext|>
WINDOW = 8  # sliding window: shorter than the 16-token test forward

# Linear input sizes are multiples of 32 (64, 128, and 32 for MLA ranks), so 4-bit recipes with groups of 32
# and per-row codebooks apply to every projection; head_dim 32 is a power of two that kivi's groups of 32
# divide.
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    shared_intermediate_size=64, num_local_experts=8, num_experts=8,
    max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None,
    num_nextn_predict_layers=0, tie_word_embeddings=False,
    initializer_range=0.125,  # 1/sqrt(hidden): activations, router and attention logits of order one
    # MLA (DeepSeek-V2/V3 family): small ranks and head parts
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
    # linear attention / state-space internals
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
    mamba_chunk_size=16, mamba_dt_rank=8, use_mamba_kernels=False,
)

# Lowered to these values only where the class default is larger: a type without a sliding window (None),
# group-limited routing (1 group) or leading dense layers (0) keeps it so, as its checkpoints have it.
SHRINK = dict(
    sliding_window=WINDOW, num_experts_per_tok=2,
    n_group=4, topk_group=2,  # group-limited routing: 4 groups of 2 experts, 2 groups taken
    first_k_dense_replace=1,
)

DENSE0 = ["dense", "sparse", "sparse", "sparse"]  # mlp_layer_types: one leading dense layer
SLIDING = ["sliding_attention", "full_attention"] * 2
SLIDING_2ND = ["full_attention", "sliding_attention"] * 2
LINEAR = ["linear_attention", "full_attention"] * 2
# the state-space step's clamp: transformers' default (0, inf) is written to config.json as
# {"__float__": "Infinity"}, which its own config class then refuses to read back (5.17); a finite bound no
# step reaches keeps the model's function and lets the saved directory load
DT_LIMIT = (0.0, 1e30)
INDEXER = dict(index_n_heads=2, index_head_dim=32, index_topk=8)  # DeepSeek sparse attention's indexer

# model_type -> overrides on top of COMMON / SHRINK: the type's special layers, its own names for shared
# experts and dense layers, and whatever its config validation needs at these sizes.
TABLE: dict[str, dict] = {
    "mixtral": {},
    "qwen2_moe": {},
    "qwen3_moe": {},
    "olmoe": {},
    "phimoe": {},
    "granitemoe": {},
    "granitemoeshared": {},
    "flex_olmo": {},
    "minimax_m2": {},
    "solar_open": {},
    "hunyuan_v1_moe": dict(num_experts_per_tok=2),  # the class default is one expert, top-1
    # MLA types keep as many KV heads as heads (their attention repeats K/V by heads // kv_heads)
    "deepseek_v2": dict(num_key_value_heads=2, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        topk_method="group_limited_greedy", n_group=4, topk_group=2),  # as DeepSeek-V2, not -Lite
    "deepseek_v3": dict(num_key_value_heads=2, n_shared_experts=1),
    "glm4_moe": dict(n_shared_experts=1),
    "glm4_moe_lite": dict(num_key_value_heads=2, n_shared_experts=1, mlp_layer_types=DENSE0),
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1),
    "ernie4_5_moe": dict(moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=3),
    "gpt_oss": dict(layer_types=SLIDING),
    "qwen3_next": dict(layer_types=LINEAR),
    "minimax": dict(layer_types=LINEAR, block_size=8),
    "afmoe": dict(num_dense_layers=1, num_shared_experts=1, layer_types=SLIDING),
    "cohere2_moe": dict(layer_types=SLIDING),
    "exaone_moe": dict(num_shared_experts=1, layer_types=SLIDING, mlp_layer_types=DENSE0),
    "mimo_v2_flash": dict(layer_types=SLIDING_2ND, mlp_layer_types=DENSE0, v_head_dim=32),
    "laguna": dict(layer_types=SLIDING_2ND, mlp_layer_types=DENSE0, num_attention_heads_per_layer=[2] * 4),
    "mellum": dict(layer_types=SLIDING_2ND),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"] * 2),
    "granitemoehybrid": dict(layer_types=LINEAR, mamba_n_heads=8, time_step_limit=DT_LIMIT),  # heads × dim = 2 × hidden
    "granitemoe_swa": dict(layer_types=SLIDING_2ND),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "kimi_linear": dict(num_key_value_heads=2, layer_types=LINEAR, mlp_layer_types=DENSE0, linear_head_dim=16,
                        linear_num_heads=4),
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                       n_routed_experts=8, n_shared_experts=1, moe_shared_expert_intermediate_size=64,
                       mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=16,
                       time_step_limit=DT_LIMIT),
    "deepseek_v32": dict(num_key_value_heads=2, n_shared_experts=1, mlp_layer_types=DENSE0, **INDEXER),
    "glm_moe_dsa": dict(num_key_value_heads=2, n_shared_experts=1, mlp_layer_types=DENSE0, **INDEXER),
    "hy_v3": dict(num_shared_experts=1, mlp_layer_types=DENSE0),
    "zaya": dict(sliding_window=WINDOW, router_hidden_size=32, layer_types=["hybrid", "hybrid_sliding"] * 2),
    "axk1": dict(num_key_value_heads=2, n_shared_experts=1),
    "axk2": dict(num_key_value_heads=2, n_shared_experts=1, mlp_layer_types=DENSE0, gated_norm_rank=8, **INDEXER),
    "hy_v4": dict(num_key_value_heads=2, n_shared_experts=1, mlp_layer_types=DENSE0, **INDEXER),
    "deepseek_v4": dict(num_key_value_heads=1, n_shared_experts=1, o_lora_rank=16, o_groups=2, **INDEXER),
    # text models of families whose main checkpoints are multimodal (MULTIMODAL_FAMILY)
    "qwen3_5_moe_text": dict(layer_types=LINEAR),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "qwen_sparse_attention"] * 2, hc_lowrank=8,
                           indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8,
                           indexer_compress_ratio=4),
    "gemma4_text": dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                        global_head_dim=64, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                        layer_types=SLIDING),
    "inkling_text": dict(swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=32, n_shared_experts=1),
    "minimax_m3_vl_text": dict(dense_intermediate_size=128, rotary_dim=16),
    "llama4_text": dict(intermediate_size_mlp=128, moe_layers=[1, 3], interleave_moe_layer_step=2,
                        attention_chunk_size=8, no_rope_layers=[1, 1, 1, 0]),
}
# config types that are the text model of a multimodal family (they count apart from text-only types)
MULTIMODAL_FAMILY = ("qwen3_5_moe_text", "qwen4_exp_text", "gemma4_text", "inkling_text", "minimax_m3_vl_text",
                     "llama4_text")


def _declared(cls) -> set[str]:
    """The keys a config class takes: its dataclass fields and its attribute_map aliases."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return names | set(getattr(cls, "attribute_map", {}))


def _default(cls, key: str):
    """The class default of `key` (a field or an alias of one), or None."""
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    f = fields.get(key) or fields.get(getattr(cls, "attribute_map", {}).get(key, key))
    return None if f is None or f.default is dataclasses.MISSING else f.default


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in TABLE:
        raise UserError(f"no tiny config for model type {model_type!r}: `python3 -c 'import moec.hf.tiny as t; "
                        f"print(*t.TINY_TYPES)'` lists the {len(TINY_TYPES)} supported ones")
    return CONFIG_MAPPING[model_type]


def tiny_config(model_type: str, **overrides):
    """The type's own config class with COMMON (where declared), then TABLE[model_type], then `overrides`."""
    cls = _config_class(model_type)
    declared = _declared(cls)
    own = {**TABLE[model_type], **overrides}
    # declared, or taken by the class's __post_init__ from its kwargs (gemma4's global_head_dim)
    unknown = sorted(k for k in set(own) - declared if f'"{k}"' not in inspect.getsource(cls))
    assert not unknown, f"{model_type}: {cls.__name__} declares no {unknown}"
    kwargs = {k: v for k, v in COMMON.items() if k in declared}
    for k, v in SHRINK.items():
        default = _default(cls, k)
        if k in declared and isinstance(default, int) and default > v:
            kwargs[k] = v
    amap = getattr(cls, "attribute_map", {})
    kwargs.update(own)
    # an alias that is not a field itself is passed under the field it names
    fields = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for k, v in kwargs.items():
        key = k if k in fields else amap.get(k, k)
        if key not in out or k in own:
            out[key] = v
    return cls(**out)


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Make every constant floating tensor of the state dict random around its value.

    transformers initializes norms to ones and biases, score-correction biases, sinks and some gates to
    zeros; a constant tensor hides layout mistakes (a transposed bias, a swapped norm) and makes a
    quantization test trivial. A constant tensor c becomes c + s·N(0, 1) with s = 0.1·|c| (norm weights
    around 1: N(1, 0.1²)) or 0.02 where c = 0 (biases). Non-constant tensors (the matrices, normal with std
    `initializer_range` = 1/sqrt(hidden); the state-space A_log / dt ranges) are left as initialized."""
    with torch.no_grad():
        for _name, t in model.state_dict(keep_vars=True).items():
            if not t.is_floating_point() or t.numel() == 0:
                continue
            flat = t.reshape(-1)
            if not bool((flat == flat[0]).all()):
                continue
            c = float(flat[0])
            s = 0.1 * abs(c) if c != 0 else 0.02
            t.copy_(c + s * torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))


def tiny_model(model_type: str, seed: int = 0, dtype=torch.float32):
    """`AutoModelForCausalLM.from_config(tiny_config(model_type))` with seeded random weights, in eval mode.

    transformers' own init runs under `torch.manual_seed(seed)` (matrices normal with std 1/sqrt(hidden), so
    activations and logits are of order one); then `_randomize` makes every constant tensor (norms, zero
    biases, sinks, score-correction biases) random around its value."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    _randomize(model, gen)
    return model.eval()


def save_tiny(model_type: str, path, seed: int = 0) -> Path:
    """A tiny random model saved as an HF directory (safetensors, config, generation config, the demo-moe
    tokenizer), written atomically."""
    model = tiny_model(model_type, seed=seed)
    path = Path(path)
    with atomic_dir(path, what="an HF model directory", is_output=lambda p: (p / "config.json").is_file()) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(DEMO_TOKENIZER / name, tmp / name)
        tok = json.loads((tmp / "tokenizer_config.json").read_text())
        assert tok["bos_token"] == tok["eos_token"] == "<|endoftext|>", tok
    return path


TINY_TYPES: tuple[str, ...] = tuple(TABLE)


def _runs(kinds: list[str]) -> str:
    """["sliding", "full", "sliding", "full"] → "sliding, full, sliding, full"; repeats of one → "full ×4"."""
    return f"{kinds[0]} ×{len(kinds)}" if len(set(kinds)) == 1 else ", ".join(kinds)


def model_types_table() -> str:
    """The markdown table of docs/model-types.md: every tiny type with its special layers, read from its
    ArchSpec (built on the meta device)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .archspec import arch_spec_from_config

    rows = ["| type | causal LM class | attention per layer | FFN per layer | router | experts layout | shared "
            "experts | KV recipes |", "|---|---|---|---|---|---|---|---|"]
    for t in TINY_TYPES:
        spec = arch_spec_from_config(tiny_config(t))
        attn = [layer.attention + ("+sinks" if layer.sinks else "") for layer in spec.layers]
        moe = next(layer for layer in spec.layers if layer.ffn == "moe")
        r, e = moe.router, moe.experts
        router = f"{r.score} top-{r.top_k}" + (" +bias" if r.bias else "") + \
            (f" groups {r.n_group}/{r.topk_group}" if r.n_group else "") + \
            (f" ×{r.scaling:g}" if r.scaling not in (None, 1.0) else "") + (" renorm" if r.renormalize else "")
        layout = ", ".join(x for x, on in (("transposed", e.is_transposed), ("bias", e.has_bias),
                                           ("no gate", not e.has_gate), ("undecorated", not e.decorated),
                                           ("own gate function", e.custom_gate)) if on)
        refusal = spec.kv_refusal()
        kv = "yes" if refusal is None else "refused: " + refusal.split(": ", 1)[1].split(" cannot")[0]
        name = f"`{t}`" + (" (text model of a multimodal family)" if t in MULTIMODAL_FAMILY else "") + \
            (" (moec engine)" if spec.engine else "")
        rows.append(f"| {name} | `{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t]}` | {_runs(attn)} | "
                    f"{_runs([layer.ffn for layer in spec.layers])} | {router} | {layout or 'standard'} | "
                    f"{max(layer.shared_experts for layer in spec.layers)} | {kv} |")
    return "\n".join(rows)
