"""Read a Hugging Face checkpoint directory (config.json + safetensors) into the canonical layout.

The runtime reads HF checkpoints itself (no transformers import): an adapter per architecture maps
config fields onto ModelArgs and HF tensor names onto canonical names, stacking per-expert tensors
into [E, ...] as it loads. Experts may be saved per expert (`experts.3.w1.weight`, as HF checkpoints
on disk are) or fused (`experts.gate_up_proj [E, 2I, D]`, as transformers 5 holds them in memory).
Tensors load lazily, one layer at a time, so calibration can stream a model larger than memory.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError
from ..progress import track
from .config import ModelArgs

ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
SUPPORTED = ("llama", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe",
             "gpt_oss")
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
SHARED_EXPERTS_ARCHS = (*DEEPSEEK, "glm4_moe")  # `mlp.shared_experts` (an n × I MLP); Qwen2-MoE: `mlp.shared_expert`
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope(cfg: dict) -> tuple[float, dict | None]:
    # transformers 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in _ROPE_TYPES:
            raise UserError(f"RoPE scaling type {kind!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
    return float(theta), scaling


def args_from_config(cfg: dict) -> ModelArgs:
    """ModelArgs from an HF config.json dict; unsupported architectures get a UserError."""
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise UserError(f"unsupported architecture {mt!r}; supported: {', '.join(SUPPORTED)}")
    L, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    theta, scaling = _rope(cfg)
    common = dict(
        arch=mt, vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=L, n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        norm_eps=cfg.get("rms_norm_eps", 1e-6), max_seq_len=cfg.get("max_position_embeddings", 4096),
        rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if mt in DEEPSEEK:
        return _deepseek_args(cfg, common)
    if mt == "glm4_moe":
        return _glm4_moe_args(cfg, common)
    if mt == "gpt_oss":
        return _gpt_oss_args(cfg, common)
    if mt == "llama":
        if cfg.get("mlp_bias"):
            raise UserError("Llama checkpoints with mlp_bias=true are not supported")
        bias = bool(cfg.get("attention_bias", False))
        return ModelArgs(**common, qkv_bias=bias, o_bias=bias, dense_dim=cfg["intermediate_size"])
    if mt == "mixtral":
        return ModelArgs(**common, n_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                         expert_dim=cfg["intermediate_size"], norm_topk=True)
    if cfg.get("use_sliding_window"):
        raise UserError(f"{mt} checkpoints with use_sliding_window=true are not supported")
    E = cfg.get("num_experts", cfg.get("num_local_experts"))  # Qwen3-MoE in transformers 5
    A = cfg["num_experts_per_tok"]
    norm_topk = bool(cfg.get("norm_topk_prob", False))
    if mt == "olmoe":
        return ModelArgs(**common, qk_norm="full", clip_qkv=cfg.get("clip_qkv"),
                         qkv_bias=bool(cfg.get("attention_bias")), o_bias=bool(cfg.get("attention_bias")),
                         n_experts=E, top_k=A, expert_dim=cfg["intermediate_size"], norm_topk=norm_topk)
    # Qwen2-MoE / Qwen3-MoE: some layers may be dense (mlp_only_layers, decoder_sparse_step).
    step, dense_layers = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    kinds = ["moe" if (i not in dense_layers and E > 0 and (i + 1) % step == 0) else "dense" for i in range(L)]
    extra = dict(ffn_kinds=kinds, dense_dim=cfg.get("intermediate_size", 0), n_experts=E, top_k=A,
                 expert_dim=cfg["moe_intermediate_size"], norm_topk=norm_topk)
    if mt == "qwen2_moe":
        return ModelArgs(**common, **extra, qkv_bias=bool(cfg.get("qkv_bias", True)),
                         shared_dim=cfg.get("shared_expert_intermediate_size", 0), shared_gate=True)
    bias = bool(cfg.get("attention_bias", False))
    return ModelArgs(**common, **extra, qk_norm="head", qkv_bias=bias, o_bias=bias)


_V2_TOPK = {"greedy": "greedy", "group_limited_greedy": "group_max"}


def _deepseek_args(cfg: dict, common: dict) -> ModelArgs:
    """DeepSeek-V2/V3 (and the checkpoints that reuse their types: Kimi K2, Moonlight): MLA, routed experts
    after the first first_k_dense_replace dense layers, shared experts, V2's softmax (optionally group-limited)
    or V3's sigmoid + correction bias + group top-2 routing."""
    mt, heads = cfg["model_type"], cfg["num_attention_heads"]
    if (cfg.get("num_key_value_heads") or heads) != heads:
        raise UserError(f"{mt}: num_key_value_heads {cfg['num_key_value_heads']} != num_attention_heads {heads} "
                        "(MLA decompresses one key and value per head)")
    if cfg.get("mlp_bias"):
        raise UserError(f"{mt} checkpoints with mlp_bias=true are not supported")
    L, E = cfg["num_hidden_layers"], cfg.get("n_routed_experts") or 0
    first_dense = cfg.get("first_k_dense_replace", 3 if mt == "deepseek_v3" else 0)
    kinds = ["moe" if (E and i >= first_dense) else "dense" for i in range(L)]
    moe_dim = cfg.get("moe_intermediate_size", 0)
    if mt == "deepseek_v2":
        method = cfg.get("topk_method", "greedy")
        if method not in _V2_TOPK:
            raise UserError(f"deepseek_v2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        routing = dict(router_score="softmax", topk_method=_V2_TOPK[method], norm_topk=bool(cfg.get("norm_topk_prob")))
        interleave = True  # V2 rotates (x0, x1) pairs as complex numbers
    else:
        if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
            raise UserError("deepseek_v3 checkpoints route by sigmoid scores with topk_method noaux_tc only")
        routing = dict(router_score="sigmoid", topk_method="group_top2", router_bias=True,
                       norm_topk=bool(cfg.get("norm_topk_prob", True)))
        interleave = bool(cfg.get("rope_interleave", True))
    if routing["topk_method"] != "greedy":
        routing |= dict(n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1)
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    bias = bool(cfg.get("attention_bias", False))
    common = common | dict(n_kv_heads=heads, head_dim=nope + rope)
    return ModelArgs(**common, attn_kind="mla", q_lora_rank=cfg.get("q_lora_rank") or 0,
                     kv_lora_rank=cfg["kv_lora_rank"], qk_rope_dim=rope, v_head_dim=cfg["v_head_dim"],
                     rope_interleave=interleave, qkv_bias=bias, o_bias=bias, ffn_kinds=kinds,
                     dense_dim=cfg.get("intermediate_size", 0), n_experts=E, top_k=cfg.get("num_experts_per_tok") or 0,
                     expert_dim=moe_dim, shared_dim=moe_dim * (cfg.get("n_shared_experts") or 0),
                     routed_scale=float(cfg.get("routed_scaling_factor", 1.0)), **routing)


def _partial_rotary(cfg: dict, head_dim: int) -> int:
    """rotary_dim of a config's partial_rotary_factor (top level or in rope_parameters; 1.0: 0, the whole head)."""
    factor = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    rd = int(head_dim * float(factor))
    if not 0 < rd <= head_dim or rd % 2:
        raise UserError(f"partial_rotary_factor {factor} of head_dim {head_dim} does not give an even rotary dim")
    return 0 if rd == head_dim else rd


def _glm4_moe_args(cfg: dict, common: dict) -> ModelArgs:
    """GLM-4.5 / GLM-4.5-Air: GQA with q/k/v biases (attention_bias), optional per-head q/k norm (use_qk_norm),
    partial rotary in halves layout; DeepSeek-V3's routing (sigmoid + correction bias + group top-2,
    routed_scaling_factor) after first_k_dense_replace dense layers, shared experts."""
    if cfg.get("mlp_bias"):
        raise UserError("glm4_moe checkpoints with mlp_bias=true are not supported")
    L, E = cfg["num_hidden_layers"], cfg.get("n_routed_experts") or 0
    first_dense = cfg.get("first_k_dense_replace", 1)
    moe_dim = cfg.get("moe_intermediate_size", 0)
    bias = bool(cfg.get("attention_bias", False))
    return ModelArgs(**common, qkv_bias=bias, qk_norm="head" if cfg.get("use_qk_norm") else "none",
                     rotary_dim=_partial_rotary(cfg, common["head_dim"]),
                     ffn_kinds=["moe" if (E and i >= first_dense) else "dense" for i in range(L)],
                     dense_dim=cfg.get("intermediate_size", 0), n_experts=E, top_k=cfg.get("num_experts_per_tok") or 0,
                     expert_dim=moe_dim, shared_dim=moe_dim * (cfg.get("n_shared_experts") or 0),
                     norm_topk=bool(cfg.get("norm_topk_prob", True)), router_score="sigmoid", topk_method="group_top2",
                     n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1, router_bias=True,
                     routed_scale=float(cfg.get("routed_scaling_factor", 1.0)))


def _gpt_oss_args(cfg: dict, common: dict) -> ModelArgs:
    """gpt-oss: GQA with biases on every projection and a learned sink logit per head, sliding-window layers
    (layer_types), every layer MoE: a biased router, top-k of the logits then a softmax over them, biased experts
    with the clamped SwiGLU."""
    L = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    if len(types) != L or not set(types) <= {"sliding_attention", "full_attention"}:
        raise UserError(f"gpt_oss layer_types must be {L} of sliding_attention / full_attention")
    window = cfg.get("sliding_window") or 0
    bias = bool(cfg.get("attention_bias", True))
    return ModelArgs(**common, qkv_bias=bias, o_bias=bias, attn_sinks=True,
                     layer_windows=[window if t == "sliding_attention" else 0 for t in types],
                     n_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                     expert_dim=cfg["intermediate_size"], norm_topk=False, router_score="softmax_topk",
                     router_logit_bias=True, expert_bias=True, expert_act="clamped_swiglu",
                     swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


def _gpt_oss_config(a: ModelArgs, cfg: dict) -> dict:
    windows = {w for w in a.layer_windows if w}
    if len(windows) > 1:
        raise UserError(f"gpt_oss has one sliding_window; these layers use {sorted(windows)}")
    return cfg | {"num_local_experts": a.n_experts, "num_experts_per_tok": a.top_k, "intermediate_size": a.expert_dim,
                  "attention_bias": a.qkv_bias, "sliding_window": windows.pop() if windows else None,
                  "layer_types": ["sliding_attention" if w else "full_attention" for w in a.layer_windows],
                  "swiglu_limit": a.swiglu_limit}


def _glm4_moe_config(a: ModelArgs, cfg: dict) -> dict:
    first_dense = next((i for i, k in enumerate(a.ffn_kinds) if k == "moe"), a.n_layers)
    assert all(k == "moe" for k in a.ffn_kinds[first_dense:]), a.ffn_kinds
    factor = (a.rotary_dim or a.head_dim) / a.head_dim
    rope = cfg["rope_parameters"] | {"partial_rotary_factor": factor}
    return cfg | {"attention_bias": a.qkv_bias, "use_qk_norm": a.qk_norm == "head", "partial_rotary_factor": factor,
                  "rope_parameters": rope, "intermediate_size": a.dense_dim, "moe_intermediate_size": a.expert_dim,
                  "n_routed_experts": a.n_experts, "num_experts_per_tok": a.top_k,
                  "n_shared_experts": a.shared_dim // a.expert_dim if a.expert_dim else 0,
                  "first_k_dense_replace": first_dense, "norm_topk_prob": a.norm_topk,
                  "routed_scaling_factor": a.routed_scale, "n_group": a.n_group, "topk_group": a.topk_group}


def _deepseek_config(a: ModelArgs, cfg: dict) -> dict:
    first_dense = next((i for i, k in enumerate(a.ffn_kinds) if k == "moe"), a.n_layers)
    assert all(k == "moe" for k in a.ffn_kinds[first_dense:]), a.ffn_kinds
    out = cfg | {"num_key_value_heads": a.n_heads, "head_dim": a.qk_rope_dim, "q_lora_rank": a.q_lora_rank or None,
                 "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_dim, "qk_rope_head_dim": a.qk_rope_dim,
                 "v_head_dim": a.v_head_dim, "attention_bias": a.qkv_bias, "intermediate_size": a.dense_dim,
                 "moe_intermediate_size": a.expert_dim, "n_routed_experts": a.n_experts,
                 "num_experts_per_tok": a.top_k,
                 "n_shared_experts": a.shared_dim // a.expert_dim if a.expert_dim else 0,
                 "first_k_dense_replace": first_dense, "norm_topk_prob": a.norm_topk,
                 "routed_scaling_factor": a.routed_scale, "n_group": a.n_group, "topk_group": a.topk_group}
    if a.arch == "deepseek_v2":
        return out | {"topk_method": {v: k for k, v in _V2_TOPK.items()}[a.topk_method], "mlp_bias": False}
    return out | {"rope_interleave": a.rope_interleave}


def config_from_args(args: ModelArgs) -> dict:
    """The HF config.json dict of `args` (the inverse of args_from_config for the fields it reads), so a
    `pack --random` checkpoint loads in transformers like a packed real one."""
    a = args
    cfg = {"model_type": a.arch, "architectures": [ARCHITECTURES[a.arch]], "vocab_size": a.vocab_size,
           "hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
           "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "rms_norm_eps": a.norm_eps,
           "max_position_embeddings": a.max_seq_len, "tie_word_embeddings": a.tie_embeddings,
           "hidden_act": "silu", "rope_theta": a.rope_theta,
           "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta, **(a.rope_scaling or {})}}
    if a.rope_scaling:
        cfg["rope_scaling"] = dict(a.rope_scaling)
    if a.arch in DEEPSEEK:
        return _deepseek_config(a, cfg)
    if a.arch == "glm4_moe":
        return _glm4_moe_config(a, cfg)
    if a.arch == "gpt_oss":
        return _gpt_oss_config(a, cfg)
    if a.arch == "llama":
        return cfg | {"intermediate_size": a.dense_dim, "attention_bias": a.qkv_bias, "mlp_bias": False}
    moe = {"num_experts_per_tok": a.top_k, "norm_topk_prob": a.norm_topk}
    if a.arch == "mixtral":
        return cfg | moe | {"num_local_experts": a.n_experts, "intermediate_size": a.expert_dim}
    moe |= {"num_experts": a.n_experts}
    if a.arch == "olmoe":
        return cfg | moe | {"intermediate_size": a.expert_dim, "clip_qkv": a.clip_qkv, "attention_bias": a.qkv_bias}
    moe |= {"moe_intermediate_size": a.expert_dim, "intermediate_size": a.dense_dim, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, k in enumerate(a.ffn_kinds) if k == "dense"], "use_sliding_window": False}
    if a.arch == "qwen2_moe":
        return cfg | moe | {"qkv_bias": a.qkv_bias, "shared_expert_intermediate_size": a.shared_dim}
    return cfg | moe | {"attention_bias": a.qkv_bias}


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}

# MLA projections: canonical name -> transformers' (DeepSeek) module name
MLA_LINEARS = {"wq": "q_proj", "wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa",
               "wkv_b": "kv_b_proj", "wo": "o_proj"}
MLA_NORMS = {"q_a_norm": "q_a_layernorm", "kv_a_norm": "kv_a_layernorm"}


def attention_names(args: ModelArgs) -> dict[str, str]:
    """The layer's attention projections present in `args`: canonical -> transformers module name."""
    if not args.is_mla:
        return {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
    drop = ("wq",) if args.q_lora_rank else ("wq_a", "wq_b")
    return {c: h for c, h in MLA_LINEARS.items() if c not in drop}


def _moe_prefix(arch: str) -> str:
    return "block_sparse_moe" if arch == "mixtral" else "mlp"


class HFCheckpoint:
    """Lazy canonical view of an HF directory: `args`, `layer_state(i)`, `global_state()`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise UserError(f"{self.path}: no config.json (expected a Hugging Face model directory)")
        self.config = json.loads(cfg_file.read_text())
        self.args = args_from_config(self.config)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = sorted({self.path / f for f in weight_map.values()})
        else:
            self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise UserError(f"{self.path}: no *.safetensors weights (pickled .bin checkpoints are not read)")
        self._where: dict[str, Path] = {}
        self._meta = False
        for f in self.files:
            with safe_open(f, "pt") as h:
                for k in h.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                    self._where[k] = f

    # -- raw access -------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise UserError(f"{self.path}: tensor {name!r} missing from the checkpoint")
        with safe_open(self._where[name], "pt") as h:
            if self._meta:  # shape and dtype from the header, no data read (meta_state_dict)
                sl = h.get_slice(name)
                return torch.empty(sl.get_shape(), dtype=ST_DTYPES[sl.get_dtype()], device="meta")
            return h.get_tensor(name)

    # -- canonical views --------------------------------------------------------------------------
    def global_state(self) -> dict[str, torch.Tensor]:
        out = {"tok_embeddings.weight": self.get("model.embed_tokens.weight"),
               "norm.weight": self.get("model.norm.weight")}
        if not self.args.tie_embeddings:
            out["output.weight"] = self.get("lm_head.weight")
        return out

    def layer_state(self, i: int) -> dict[str, torch.Tensor]:
        a, p = self.args, f"model.layers.{i}."
        out = {"attn_norm.weight": self.get(p + "input_layernorm.weight"),
               "ffn_norm.weight": self.get(p + "post_attention_layernorm.weight")}
        for c, h in attention_names(a).items():
            out[f"attn.{c}.weight"] = self.get(f"{p}self_attn.{h}.weight")
            biased = ("wq_a", "wkv_a") if a.is_mla else ("wq", "wk", "wv")
            has_bias = a.o_bias if c == "wo" else a.qkv_bias and c in biased
            if has_bias:
                out[f"attn.{c}.bias"] = self.get(f"{p}self_attn.{h}.bias")
        if a.is_mla:
            for c, h in MLA_NORMS.items():
                if c != "q_a_norm" or a.q_lora_rank:
                    out[f"attn.{c}.weight"] = self.get(f"{p}self_attn.{h}.weight")
        if a.attn_sinks:
            out["attn.sinks"] = self.get(p + "self_attn.sinks")
        if a.qk_norm != "none":
            out["attn.q_norm.weight"] = self.get(p + "self_attn.q_norm.weight")
            out["attn.k_norm.weight"] = self.get(p + "self_attn.k_norm.weight")
        if a.ffn_kinds[i] == "dense":
            for c, h in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                out[f"moe.{c}"] = self.get(f"{p}mlp.{h}.weight")[None]
        else:
            out.update(self._experts(i))
        return {f"layers.{i}.{k}": v for k, v in out.items()}

    def _gpt_oss_experts(self, i: int) -> dict[str, torch.Tensor]:
        """gpt-oss's experts: gate_up_proj [E, D, 2I] with gate and up interleaved along the outputs (gate 0::2,
        up 1::2), down_proj [E, I, D] (inputs first, as transformers holds them), their biases; or, as
        OpenAI ships them, MXFP4 `*_blocks` / `*_scales` with the outputs as rows, dequantized exactly here."""
        m = f"model.layers.{i}.mlp."
        out = {"moe.router.weight": self.get(m + "router.weight"), "moe.router.bias": self.get(m + "router.bias")}
        e = m + "experts."
        if self.has(e + "gate_up_proj_blocks"):
            gate_up = self._mxfp4(e + "gate_up_proj")  # [E, 2I, D]
            out["moe.w1"], out["moe.w3"] = gate_up[:, 0::2].contiguous(), gate_up[:, 1::2].contiguous()
            out["moe.w2"] = self._mxfp4(e + "down_proj")  # [E, D, I]
        else:
            gate_up = self.get(e + "gate_up_proj")  # [E, D, 2I]
            out["moe.w1"] = gate_up[:, :, 0::2].transpose(1, 2).contiguous()
            out["moe.w3"] = gate_up[:, :, 1::2].transpose(1, 2).contiguous()
            out["moe.w2"] = self.get(e + "down_proj").transpose(1, 2).contiguous()
        bias = self.get(e + "gate_up_proj_bias")  # [E, 2I]
        out["moe.b1"], out["moe.b3"] = bias[:, 0::2].contiguous(), bias[:, 1::2].contiguous()
        out["moe.b2"] = self.get(e + "down_proj_bias")
        return out

    def _mxfp4(self, name: str) -> torch.Tensor:
        """[..., O, I] bf16 of an MXFP4 `<name>_blocks` / `<name>_scales` pair (e2m1 × 2^(e − 127): exact in bf16)."""
        from .fp4 import dequantize_mxfp4, mxfp4_from_blocks

        blocks, scales = self.get(name + "_blocks"), self.get(name + "_scales")
        shape = (*blocks.shape[:-2], blocks.shape[-2] * 32)
        if self._meta:
            return torch.empty(shape, dtype=torch.bfloat16, device="meta")
        parts = mxfp4_from_blocks(blocks, scales, name)
        return dequantize_mxfp4(4, shape, parts).to(torch.bfloat16)

    def _experts(self, i: int) -> dict[str, torch.Tensor]:
        a = self.args
        if a.arch == "gpt_oss":
            return self._gpt_oss_experts(i)
        m = f"model.layers.{i}.{_moe_prefix(a.arch)}."
        out = {"moe.router.weight": self.get(m + "gate.weight")}
        if a.router_bias:
            out["moe.score_bias"] = self.get(m + "gate.e_score_correction_bias")
        if self.has(m + "experts.gate_up_proj"):  # fused layout: gate rows first, then up
            gate_up = self.get(m + "experts.gate_up_proj")  # [E, 2I, D]
            out["moe.w1"], out["moe.w3"] = (t.contiguous() for t in gate_up.chunk(2, dim=1))
            out["moe.w2"] = self.get(m + "experts.down_proj")  # [E, D, I]
        else:
            names = ({"w1": "w1", "w3": "w3", "w2": "w2"} if a.arch == "mixtral"
                     else {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})
            for c, h in names.items():
                out[f"moe.{c}"] = torch.stack([self.get(f"{m}experts.{e}.{h}.weight") for e in range(a.n_experts)])
        if a.shared_dim:
            shared = "shared_experts" if a.arch in SHARED_EXPERTS_ARCHS else "shared_expert"
            for c, h in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                out[f"moe.shared.{c}.weight"] = self.get(f"{m}{shared}.{h}.weight")
            if a.shared_gate:
                out["moe.shared_gate.weight"] = self.get(m + "shared_expert_gate.weight")
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = self.global_state()
        for i in range(self.args.n_layers):
            out.update(self.layer_state(i))
        return out

    def meta_state_dict(self) -> dict[str, torch.Tensor]:
        """state_dict() as meta tensors: the canonical names in the same order, with their shapes and
        dtypes, read from the safetensors headers only (what a streamed pack plans its shards from)."""
        self._meta = True
        try:
            return self.state_dict()
        finally:
            self._meta = False

    def fingerprint(self) -> dict:
        """sha256 of config.json and of the weight files, for provenance in every output."""
        return fingerprint(self.path, self.files)


def fingerprint(path: Path, files: list[Path]) -> dict:
    """sha256 of `path`/config.json and of the weight `files` (in order): a source model's provenance."""
    h = hashlib.sha256()
    with track(f"hashing {path.name} weights", sum(f.stat().st_size for f in files), "B") as advance:
        for f in files:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
                    advance(len(chunk))
    return {"config_sha256": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(),
            "weights_sha256": h.hexdigest()}
