"""ModelArgs: the canonical description of every architecture the runtime runs.

Each supported Hugging Face architecture (Llama, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4.5)
maps onto these fields in `hf_layout.py`. A dense MLP is a single expert that every token takes, so dense and
MoE layers share one code path and one set of tensor names.

Multi-head latent attention (attn_kind "mla", DeepSeek-V2/V3): head_dim is the query/key head size
(qk_nope + qk_rope_dim), n_kv_heads = n_heads (the decompressed form), and a token's cache entry is the
kv_lora_rank-wide normed latent plus the qk_rope_dim RoPE key shared by all heads (model.MLAttention).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field

from ..errors import UserError


@dataclass
class ModelArgs:
    arch: str  # source model_type, e.g. "llama", "mixtral"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float = 1e-5
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", ...}; None = plain RoPE
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 style biases on q/k/v
    o_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (Qwen3: RMSNorm per head) | "full" (OLMoE: over all heads)
    clip_qkv: float | None = None  # OLMoE option
    # feed-forward: per layer, "moe" or "dense"
    ffn_kinds: list[str] = field(default_factory=list)
    dense_dim: int = 0  # intermediate size of dense MLP layers
    n_experts: int = 0
    top_k: int = 0
    expert_dim: int = 0
    norm_topk: bool = True  # renormalize the kept top-k router probabilities to sum to 1
    shared_dim: int = 0  # shared expert intermediate size (0: none)
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(x·g) scales the shared expert
    # routing beyond softmax top-k (DeepSeek): scores softmax | sigmoid; top-k over all experts (greedy) or
    # within the topk_group best of n_group groups, a group scored by its best expert (group_max, DeepSeek-V2)
    # or the sum of its best two biased scores (group_top2, DeepSeek-V3); router_bias: a per-expert bias
    # added to the scores for the choice only (DeepSeek-V3's e_score_correction_bias, tensor moe.score_bias);
    # routed_scale multiplies the kept weights (after norm_topk)
    router_score: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False
    routed_scale: float = 1.0
    # attention: "gqa" (wq/wk/wv/wo) or "mla" (module docstring)
    attn_kind: str = "gqa"
    q_lora_rank: int = 0  # MLA: 0 = one wq, else wq_a -> q_a_norm -> wq_b
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek) vs halves
    # partial rotary (GLM-4.5: partial_rotary_factor 0.5): RoPE turns the first rotary_dim dims of each head,
    # the rest pass through; 0 = the whole head
    rotary_dim: int = 0
    # gpt-oss: a learned logit per query head in every softmax's denominator (tensor attn.sinks [H]), and per
    # layer a sliding window of that many keys (the query's own included; 0: full attention)
    attn_sinks: bool = False
    layer_windows: list[int] = field(default_factory=list)
    # experts beyond silu(gate)·up: biases on gate/up/down (moe.b1, moe.b3 [E, I], moe.b2 [E, D]) and gpt-oss's
    # clamped SwiGLU (expert_act "clamped_swiglu": gate clamped above and up on both sides at swiglu_limit,
    # gate·sigmoid(1.702·gate)·(up + 1)); router_logit_bias: the router is a Linear with a bias (moe.router.bias)
    expert_bias: bool = False
    expert_act: str = "silu"
    swiglu_limit: float = 7.0
    router_logit_bias: bool = False

    def __post_init__(self):
        if not self.ffn_kinds:
            self.ffn_kinds = ["moe" if self.n_experts else "dense"] * self.n_layers
        assert len(self.ffn_kinds) == self.n_layers, (len(self.ffn_kinds), self.n_layers)
        assert all(k in ("moe", "dense") for k in self.ffn_kinds), self.ffn_kinds
        assert self.n_heads % self.n_kv_heads == 0, (self.n_heads, self.n_kv_heads)
        assert self.qk_norm in ("none", "head", "full"), self.qk_norm
        if "moe" in self.ffn_kinds:
            assert 0 < self.top_k <= self.n_experts and self.expert_dim > 0, self
        assert self.router_score in ROUTER_SCORES and self.topk_method in TOPK_METHODS, self
        assert self.attn_kind in ATTN_KINDS, self.attn_kind
        if self.topk_method != "greedy":
            assert self.n_experts % self.n_group == 0 and 0 < self.topk_group <= self.n_group, self
        assert 0 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0, self.rotary_dim
        if not any(self.layer_windows):  # all full attention: the list says nothing more than n_layers
            self.layer_windows = [0] * self.n_layers
        assert len(self.layer_windows) == self.n_layers and min(self.layer_windows) >= 0, self.layer_windows
        assert self.expert_act in EXPERT_ACTS, self.expert_act
        assert not ((self.attn_sinks or any(self.layer_windows)) and self.attn_kind == "mla"), "MLA without sinks"
        if self.attn_kind == "mla":
            assert 0 < self.qk_rope_dim < self.head_dim and self.qk_rope_dim % 2 == 0, self
            assert self.rotary_dim == 0, "MLA rotates qk_rope_dim"
            assert self.kv_lora_rank > 0 and self.v_head_dim > 0 and self.n_kv_heads == self.n_heads, self

    @property
    def is_moe(self) -> bool:
        return "moe" in self.ffn_kinds

    @property
    def has_windows(self) -> bool:
        return any(self.layer_windows)

    @property
    def is_mla(self) -> bool:
        return self.attn_kind == "mla"

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates per head: the whole head, its first rotary_dim (partial rotary), or MLA's
        qk_rope_dim."""
        return self.qk_rope_dim if self.is_mla else (self.rotary_dim or self.head_dim)

    @property
    def qk_nope_dim(self) -> int:
        return self.head_dim - self.qk_rope_dim

    @property
    def latent_dim(self) -> int:
        """MLA: one token's cache entry per layer (normed latent + RoPE key)."""
        return self.kv_lora_rank + self.qk_rope_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelArgs:
        """ModelArgs from a packed manifest's `model_args`: every key known, typed and in range (UserError
        naming the first that is not), so that a checkpoint from elsewhere cannot trip the asserts above."""
        if not isinstance(d, dict):
            raise UserError(f"model_args: expected a mapping, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in d.items():
            if key not in fields:
                raise UserError(f"model_args: unknown key {key!r}")
            if not _ARG_CHECKS[key](value):
                raise UserError(f"model_args.{key}: {value!r} is not {_ARG_RULES[key]}")
        missing = [k for k, f in fields.items() if k not in d and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise UserError(f"model_args: missing {', '.join(missing)}")
        if d.get("attn_kind", "gqa") == "mla":
            rope, nope_rope = d.get("qk_rope_dim", 0), d["head_dim"]
            if not (0 < rope < nope_rope and rope % 2 == 0 and d.get("kv_lora_rank", 0) > 0
                    and d.get("v_head_dim", 0) > 0 and d["n_kv_heads"] == d["n_heads"]):
                raise UserError("model_args: MLA needs 0 < qk_rope_dim < head_dim (even), kv_lora_rank > 0, "
                                "v_head_dim > 0 and n_kv_heads == n_heads")
        rd = d.get("rotary_dim", 0)
        if rd % 2 or rd > d["head_dim"] or (rd and d.get("attn_kind", "gqa") == "mla"):
            raise UserError(f"model_args.rotary_dim: {rd} must be even and <= head_dim {d['head_dim']} (0 with MLA)")
        if d.get("topk_method", "greedy") != "greedy":
            g, tg = d.get("n_group", 1), d.get("topk_group", 1)
            if d.get("n_experts", 0) % g or not 0 < tg <= g:
                raise UserError(f"model_args: grouped top-k needs n_experts divisible by n_group and "
                                f"0 < topk_group <= n_group, got {d.get('n_experts', 0)}, {g}, {tg}")
        windows = d.get("layer_windows") or []
        if windows and len(windows) != d["n_layers"]:
            raise UserError(f"model_args: {len(windows)} layer_windows for n_layers {d['n_layers']}")
        if (d.get("attn_sinks") or any(windows)) and d.get("attn_kind", "gqa") == "mla":
            raise UserError("model_args: attention sinks and sliding windows are not supported with MLA")
        kinds = d.get("ffn_kinds") or ["moe" if d.get("n_experts") else "dense"]  # empty: every layer alike
        if d.get("ffn_kinds") and len(kinds) != d["n_layers"]:
            raise UserError(f"model_args: {len(kinds)} ffn_kinds for n_layers {d['n_layers']}")
        if d["n_heads"] % d["n_kv_heads"]:
            raise UserError(f"model_args: n_heads {d['n_heads']} is not a multiple of n_kv_heads {d['n_kv_heads']}")
        top_k, n_experts, expert_dim = (d.get(k, 0) for k in ("top_k", "n_experts", "expert_dim"))
        if "moe" in kinds and not (0 < top_k <= n_experts and expert_dim > 0):
            raise UserError(f"model_args: MoE layers need 0 < top_k <= n_experts and expert_dim > 0, got top_k "
                            f"{top_k}, n_experts {n_experts}, expert_dim {expert_dim}")
        return cls(**d)


# softmax: over every expert, then top-k; sigmoid: per expert (DeepSeek-V3); softmax_topk: top-k of the logits,
# then a softmax over the kept ones (gpt-oss)
ROUTER_SCORES = ("softmax", "sigmoid", "softmax_topk")
EXPERT_ACTS = ("silu", "clamped_swiglu")
TOPK_METHODS = ("greedy", "group_max", "group_top2")
ATTN_KINDS = ("gqa", "mla")
_INT_MAX = 2**31 - 1  # token ids and kernel indices are int32: no dimension of a real model comes near


def _int(lo: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= _INT_MAX


def _positive_float(v) -> bool:
    """A number the fp32 model arithmetic can hold (clip_qkv 1e308 would overflow the clamp)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and 0 < v < _FP32_MAX


_FP32_MAX = 3.4e38


# The RoPE scalings the runtime applies (model.rope_inv_freq), with the numbers each one reads.
_ROPE_SCALING_KEYS = {"linear": ("factor",),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                      "yarn": ("factor", "original_max_position_embeddings")}
# yarn's optional numbers (transformers' _compute_yarn_parameters defaults when absent)
_YARN_OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def _rope_scaling(v) -> bool:
    if v is None:
        return True
    if not isinstance(v, dict) or not isinstance(v.get("rope_type"), str) or v["rope_type"] not in _ROPE_SCALING_KEYS:
        return False
    if not all(_positive_float(v.get(k)) for k in _ROPE_SCALING_KEYS[v["rope_type"]]):
        return False
    if v["rope_type"] == "yarn":
        return (all(v.get(k) is None or (_positive_float(v[k]) or v[k] == 0) for k in _YARN_OPTIONAL)
                and isinstance(v.get("truncate", True), bool))
    return v["rope_type"] != "llama3" or v["low_freq_factor"] != v["high_freq_factor"]  # llama3 divides by the gap


# model_args keys: (check, what the message says is expected)
_ARG_SPEC = {
    "arch": (lambda v: isinstance(v, str), "a string"),
    **{k: (_int(1), "an int in 1..2^31-1") for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                                                      "head_dim", "max_seq_len")},
    **{k: (_int(0), "an int in 0..2^31-1") for k in ("dense_dim", "n_experts", "top_k", "expert_dim", "shared_dim")},
    **{k: (_positive_float, "a number in (0, 3.4e38)") for k in ("norm_eps", "rope_theta")},
    "clip_qkv": (lambda v: v is None or _positive_float(v), "null or a number in (0, 3.4e38)"),
    "rope_scaling": (_rope_scaling, "null or a RoPE scaling the runtime applies (rope_type linear, llama3 or "
                                    "yarn with its factors)"),
    **{k: (lambda v: isinstance(v, bool), "true or false") for k in ("tie_embeddings", "qkv_bias", "o_bias",
                                                                     "norm_topk", "shared_gate", "router_bias",
                                                                     "rope_interleave", "attn_sinks", "expert_bias",
                                                                     "router_logit_bias")},
    **{k: (_int(0), "an int in 0..2^31-1") for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_dim", "v_head_dim",
                                                      "rotary_dim")},
    **{k: (_int(1), "an int in 1..2^31-1") for k in ("n_group", "topk_group")},
    "routed_scale": (_positive_float, "a number in (0, 3.4e38)"),
    "swiglu_limit": (_positive_float, "a number in (0, 3.4e38)"),
    "expert_act": (lambda v: v in EXPERT_ACTS, f"one of {', '.join(map(repr, EXPERT_ACTS))}"),
    "layer_windows": (lambda v: isinstance(v, list) and all(_int(0)(w) for w in v), "a list of ints >= 0"),
    "router_score": (lambda v: v in ROUTER_SCORES, f"one of {', '.join(map(repr, ROUTER_SCORES))}"),
    "topk_method": (lambda v: v in TOPK_METHODS, f"one of {', '.join(map(repr, TOPK_METHODS))}"),
    "attn_kind": (lambda v: v in ATTN_KINDS, f"one of {', '.join(map(repr, ATTN_KINDS))}"),
    "qk_norm": (lambda v: v in ("none", "head", "full"), "one of 'none', 'head', 'full'"),
    "ffn_kinds": (lambda v: isinstance(v, list) and all(k in ("moe", "dense") for k in v),
                  "a list of 'moe' / 'dense'"),
}
_ARG_CHECKS = {k: c for k, (c, _) in _ARG_SPEC.items()}
_ARG_RULES = {k: r for k, (_, r) in _ARG_SPEC.items()}
assert set(_ARG_SPEC) == {f.name for f in dataclasses.fields(ModelArgs)}, "a ModelArgs field without its check"


# Performance shapes of docs/architecture.md ("Models, shapes and data") (random weights; nothing is downloaded).
PRESETS: dict[str, ModelArgs] = {
    "mixtral-8x7b": ModelArgs(
        arch="mixtral", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        max_seq_len=131072, rope_theta=1e6, n_experts=8, top_k=2, expert_dim=14336,
    ),
    "qwen3-30b-a3b": ModelArgs(
        arch="qwen3_moe", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
        norm_eps=1e-6, max_seq_len=131072, rope_theta=1e6, qk_norm="head", n_experts=128, top_k=8,
        expert_dim=768,
    ),
    # DeepSeek-V2-Lite (15.7B, 2.4B active; config.json of deepseek-ai/DeepSeek-V2-Lite): MLA without q LoRA,
    # 64 routed experts top-6 (softmax, greedy, not renormalized) + 2 shared, one leading dense layer, YaRN
    "deepseek-v2-lite": ModelArgs(
        arch="deepseek_v2", vocab_size=102400, dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, head_dim=192,
        norm_eps=1e-6, max_seq_len=163840, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                      "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
        ffn_kinds=["dense"] + ["moe"] * 26, dense_dim=10944, n_experts=64, top_k=6, expert_dim=1408,
        norm_topk=False, shared_dim=2 * 1408, attn_kind="mla", kv_lora_rank=512, qk_rope_dim=64, v_head_dim=128,
        rope_interleave=True,
    ),
    # DeepSeek-V3 / R1 (671B, 37B active) at its real layer dimensions, all 61 layers (latency runs build as many
    # as fit: --layers); sigmoid routing with the correction bias, 8 groups top-4, top-8 of 256 + 1 shared
    "deepseek-v3": ModelArgs(
        arch="deepseek_v3", vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=192,
        norm_eps=1e-6, max_seq_len=163840, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        ffn_kinds=["dense"] * 3 + ["moe"] * 58, dense_dim=18432, n_experts=256, top_k=8, expert_dim=2048,
        shared_dim=2048, router_score="sigmoid", topk_method="group_top2", n_group=8, topk_group=4, router_bias=True,
        routed_scale=2.5, attn_kind="mla", q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64, v_head_dim=128,
        rope_interleave=True,
    ),
    # GLM-4.5-Air (106B, 12B active; zai-org's config): GQA 96/8 heads of 128 with q/k/v biases, RoPE on half
    # of each head (theta 1e6), one dense layer then 45 MoE layers of 128 experts top-8 (sigmoid + correction
    # bias, one group) + 1 shared expert
    "glm-4.5-air": ModelArgs(
        arch="glm4_moe", vocab_size=151552, dim=4096, n_layers=46, n_heads=96, n_kv_heads=8, head_dim=128,
        norm_eps=1e-5, max_seq_len=131072, rope_theta=1e6, qkv_bias=True, rotary_dim=64,
        ffn_kinds=["dense"] + ["moe"] * 45, dense_dim=10944, n_experts=128, top_k=8, expert_dim=1408,
        shared_dim=1408, router_score="sigmoid", topk_method="group_top2", n_group=1, topk_group=1, router_bias=True,
    ),
    # gpt-oss-120b (117B, 5.1B active; openai/gpt-oss-120b's config): 36 layers alternating a 128-token sliding
    # window and full attention, GQA 64/8 heads of 64 with biases and a learned sink per head, 128 experts top-4
    # (biased router, softmax over the kept logits), biased experts with the clamped SwiGLU, YaRN x32 untruncated
    "gpt-oss-120b": ModelArgs(
        arch="gpt_oss", vocab_size=201088, dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim=64,
        norm_eps=1e-5, max_seq_len=131072, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                      "beta_slow": 1.0, "truncate": False},
        qkv_bias=True, o_bias=True, attn_sinks=True, layer_windows=[128 if i % 2 == 0 else 0 for i in range(36)],
        n_experts=128, top_k=4, expert_dim=2880, norm_topk=False, router_score="softmax_topk",
        router_logit_bias=True, expert_bias=True, expert_act="clamped_swiglu", swiglu_limit=7.0,
    ),
    # The GPU smoke's model (benchmarks/gpu_smoke.py): every code path of the big shapes at a size that
    # builds and compiles in seconds. head_dim 128 as in both big shapes; one dense MLP layer then MoE
    # layers (so `mlp` and `experts` recipe targets both match); dim, heads·head_dim and the FFN widths are
    # multiples of 384, so every group size the shipped recipes use (64, 128, 192) divides them; four
    # layers hold one cross-layer latent group of 4; vocab 8192 is demo-moe's tokenizer, which the smoke
    # copies in so `moec generate` can run on the packed random model.
    "smoke-moe": ModelArgs(
        arch="qwen3_moe", vocab_size=8192, dim=768, n_layers=4, n_heads=6, n_kv_heads=2, head_dim=128,
        norm_eps=1e-6, max_seq_len=4096, rope_theta=1e6, qk_norm="head", ffn_kinds=["dense", "moe", "moe", "moe"],
        dense_dim=768, n_experts=4, top_k=2, expert_dim=768,
    ),
    # The GPU smoke's DeepSeek-V3-style model: MLA with q LoRA (ranks 384, multiples of every shipped group size),
    # sigmoid group routing with the correction bias, a shared expert, a leading dense layer, YaRN
    "smoke-mla": ModelArgs(
        arch="deepseek_v3", vocab_size=8192, dim=768, n_layers=4, n_heads=6, n_kv_heads=6, head_dim=192,
        norm_eps=1e-6, max_seq_len=4096, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0,
                      "mscale_all_dim": 1.0},
        ffn_kinds=["dense", "moe", "moe", "moe"], dense_dim=768, n_experts=8, top_k=2, expert_dim=768,
        shared_dim=768, router_score="sigmoid", topk_method="group_top2", n_group=4, topk_group=2, router_bias=True,
        routed_scale=2.5, attn_kind="mla", q_lora_rank=384, kv_lora_rank=384, qk_rope_dim=64, v_head_dim=128,
        rope_interleave=True,
    ),
    # The GPU smoke's GLM-4.5-style model: GQA with q/k/v biases and RoPE on half of each 128-wide head, a dense
    # layer, sigmoid group routing with the correction bias, a shared expert
    "smoke-glm": ModelArgs(
        arch="glm4_moe", vocab_size=8192, dim=768, n_layers=4, n_heads=6, n_kv_heads=2, head_dim=128,
        norm_eps=1e-5, max_seq_len=4096, rope_theta=1e6, qkv_bias=True, rotary_dim=64,
        ffn_kinds=["dense", "moe", "moe", "moe"], dense_dim=768, n_experts=8, top_k=2, expert_dim=768,
        shared_dim=768, router_score="sigmoid", topk_method="group_top2", n_group=4, topk_group=2, router_bias=True,
        routed_scale=2.5,
    ),
    # The GPU smoke's gpt-oss-style model: head_dim 64 as gpt-oss, a 128-token sliding window on layers 0 and 2
    # (the smoke's contexts pass it), sinks, biases everywhere, the softmax-after-top-k router, biased experts with
    # the clamped SwiGLU
    "smoke-oss": ModelArgs(
        arch="gpt_oss", vocab_size=8192, dim=768, n_layers=4, n_heads=12, n_kv_heads=4, head_dim=64,
        norm_eps=1e-5, max_seq_len=4096, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0,
                      "beta_slow": 1.0, "truncate": False},
        qkv_bias=True, o_bias=True, attn_sinks=True, layer_windows=[128, 0, 128, 0], n_experts=8, top_k=2,
        expert_dim=768, norm_topk=False, router_score="softmax_topk", router_logit_bias=True, expert_bias=True,
        expert_act="clamped_swiglu", swiglu_limit=7.0,
    ),
}
