"""ModelArgs: the canonical description of every architecture the runtime runs.

Each supported Hugging Face architecture (Llama, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) maps onto
these fields in `hf_layout.py`. A dense MLP is a single expert that every token takes, so dense and
MoE layers share one code path and one set of tensor names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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

    def __post_init__(self):
        if not self.ffn_kinds:
            self.ffn_kinds = ["moe" if self.n_experts else "dense"] * self.n_layers
        assert len(self.ffn_kinds) == self.n_layers, (len(self.ffn_kinds), self.n_layers)
        assert all(k in ("moe", "dense") for k in self.ffn_kinds), self.ffn_kinds
        assert self.n_heads % self.n_kv_heads == 0, (self.n_heads, self.n_kv_heads)
        assert self.qk_norm in ("none", "head", "full"), self.qk_norm
        if "moe" in self.ffn_kinds:
            assert 0 < self.top_k <= self.n_experts and self.expert_dim > 0, self

    @property
    def is_moe(self) -> bool:
        return "moe" in self.ffn_kinds

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelArgs:
        return cls(**d)


# Performance shapes from DESIGN.md (random weights; nothing is downloaded).
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
}
