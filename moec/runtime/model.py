"""The canonical MoE transformer: one model file for every supported architecture (gpt-fast style).

Shape legend:
    B = batch, T = tokens in this call, S = tokens in the cache, D = model dim, V = vocab,
    H = query heads, K = KV heads, d = head dim, N = B·T flattened tokens, E = experts,
    A = experts activated per token (top-k), I = expert intermediate size.

Experts are stacked tensors `w1, w3: [E, I, D]` (gate, up) and `w2: [E, D, I]` (down); a dense MLP is
the same module with E = 1 and no router. The forward is plain torch: it is the reference the Triton
kernels are compared against, and the path `moec eval` takes on a CPU.

An optional `observer(layer, name, tensor)` sees internal activations: 'attn_in' (normed input of
wq/wk/wv), 'k_pre' (keys before RoPE), 'q', 'k', 'v' (after RoPE), 'attn_out' (input of wo),
'ffn_in', 'router_logits', 'expert_ids'; calibration capture uses it so the layer loop lives in one
place (moec/calibrate/capture.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs

Observer = Callable[[int, str, torch.Tensor], None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in fp32 and scale in the input dtype, as the HF reference implementations do.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(args: ModelArgs, device=None) -> torch.Tensor:
    """Inverse frequencies [d/2], with the RoPE scaling of the source config applied."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    sc = args.rope_scaling
    if not sc:
        return inv
    kind = sc["rope_type"]
    if kind == "linear":
        return inv / sc["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between.
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old_ctx = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        return torch.where(is_mid, mid, scaled)
    raise AssertionError(f"rope_type {kind!r} should have been rejected by the adapter")


def rope_cos_sin(args: ModelArgs, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin: [T, d] for integer positions [T] (half-rotation layout, as in HF Llama)."""
    inv = rope_inv_freq(args, positions.device)
    freqs = positions.float()[:, None] * inv[None, :]  # [T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, d]; cos/sin: [T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H, K, d, D = args.n_heads, args.n_kv_heads, args.head_dim, args.dim
        self.wq = nn.Linear(D, H * d, bias=args.qkv_bias)
        self.wk = nn.Linear(D, K * d, bias=args.qkv_bias)
        self.wv = nn.Linear(D, K * d, bias=args.qkv_bias)
        self.wo = nn.Linear(H * d, D, bias=args.o_bias)
        if args.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(d, args.norm_eps), RMSNorm(d, args.norm_eps)
        elif args.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(H * d, args.norm_eps), RMSNorm(K * d, args.norm_eps)

    def forward(self, x, cos, sin, layer: int, cache=None, start_pos: int = 0, observer=None):
        a = self.args
        B, T, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # [B, T, H·d], [B, T, K·d] ×2
        if a.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q = q.view(B, T, a.n_heads, a.head_dim)
        k = k.view(B, T, a.n_kv_heads, a.head_dim)
        v = v.view(B, T, a.n_kv_heads, a.head_dim)
        if a.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|K, T, d]
        if observer is not None:
            observer(layer, "k_pre", k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if observer is not None:
            observer(layer, "q", q)
            observer(layer, "k", k)
            observer(layer, "v", v)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = cache.attend(layer, q, k, v, start_pos)  # [B, H, T, d]
        out = out.transpose(1, 2).reshape(B, T, a.n_heads * a.head_dim)  # [B, T, H·d]
        if observer is not None:
            observer(layer, "attn_out", out)  # the input of wo
        return self.wo(out)


class FFN(nn.Module):
    """A plain SwiGLU MLP (the shared expert)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool):
    """Softmax top-k routing in fp32. x: [N, D], router: [E, D] -> logits [N, E], weights, ids [N, A]."""
    logits = x @ router.t()
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return logits, weights, ids


def combine_experts(expert: Callable[[int, torch.Tensor], torch.Tensor], x: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """Σ_a weights[n, a] · expert(ids[n, a], x[n]): the reference combine over the experts taken.
    x: [N, D], weights/ids: [N, A] -> [N, D]. Shared with moec/hf (transformers' experts module)."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        y = expert(e, x[tok]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(x.dtype))
    return out


class MoE(nn.Module):
    """Router + stacked experts (+ optional shared expert). A dense MLP is E = 1 without a router."""

    def __init__(self, args: ModelArgs, kind: str):
        super().__init__()
        self.args, self.kind = args, kind
        E, I = (args.n_experts, args.expert_dim) if kind == "moe" else (1, args.dense_dim)
        D = args.dim
        if kind == "moe":
            self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, I, D))
        self.w3 = nn.Parameter(torch.empty(E, I, D))
        self.w2 = nn.Parameter(torch.empty(E, D, I))
        self.codec = None  # runtime/experts.ExpertWeights once a packed checkpoint quantizes these experts
        if kind == "moe" and args.shared_dim:
            self.shared = FFN(D, args.shared_dim)
            if args.shared_gate:
                self.shared_gate = nn.Linear(D, 1, bias=False)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.codec is not None:
            return self.codec.expert(e, x)
        return F.silu(x @ self.w1[e].t()) * (x @ self.w3[e].t()) @ self.w2[e].t()

    def forward(self, x: torch.Tensor, layer: int, observer=None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        if self.kind == "dense":
            return self.expert(0, x).view(shape)
        a = self.args
        logits, weights, ids = route(x, self.router.weight, a.top_k, a.norm_topk)  # [N, E], [N, A] ×2
        if observer is not None:
            observer(layer, "router_logits", logits)
            observer(layer, "expert_ids", ids)
        out = self.codec.fused(x, weights, ids) if self.codec is not None else None  # Triton decode on CUDA
        if out is None:
            out = combine_experts(self.expert, x, weights, ids)
        if hasattr(self, "shared"):
            s = self.shared(x)
            if hasattr(self, "shared_gate"):
                s = torch.sigmoid(self.shared_gate(x)) * s
            out = out + s
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args, args.ffn_kinds[layer])

    def forward(self, x, cos, sin, cache=None, start_pos: int = 0, observer=None):
        h = self.attn_norm(x)
        if observer is not None:
            observer(self.layer, "attn_in", h)
        x = x + self.attn(h, cos, sin, self.layer, cache, start_pos, observer)
        h = self.ffn_norm(x)
        if observer is not None:
            observer(self.layer, "ffn_in", h)
        return x + self.moe(h, self.layer, observer)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        if not args.tie_embeddings:
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        if self.args.tie_embeddings:
            return h @ self.tok_embeddings.weight.t()
        return self.output(h)  # an nn.Linear, or a QLinear once a packed checkpoint quantizes the head

    def forward(self, tokens: torch.Tensor, cache=None, start_pos: int = 0, observer=None) -> torch.Tensor:
        """tokens: [B, T] -> logits [B, T, V]. Without a cache, T tokens from position 0 (causal)."""
        B, T = tokens.shape
        assert start_pos + T <= self.args.max_seq_len, (start_pos, T, self.args.max_seq_len)
        assert cache is not None or start_pos == 0, "positions > 0 need a cache"
        x = self.tok_embeddings(tokens)  # [B, T, D]
        pos = torch.arange(start_pos, start_pos + T, device=tokens.device)
        cos, sin = rope_cos_sin(self.args, pos, x.dtype)
        for block in self.layers:
            x = block(x, cos, sin, cache, start_pos, observer)
        return self.lm_head(self.norm(x))


def build_model(args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                device: str | torch.device = "cpu") -> Transformer:
    """Construct on the meta device and adopt `state` (canonical names) without copies when possible."""
    with torch.device("meta"):
        model = Transformer(args)
    if dtype is not None or device != "cpu":
        state = {k: v.to(device=device, dtype=dtype or v.dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
