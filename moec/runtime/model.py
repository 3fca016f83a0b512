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
'ffn_in', 'router_logits', 'expert_ids'; MLA layers send 'q_lat' (input of wq_b) and 'kv_latent' (the
cached row [c, k_rope] [B, 1, T, r + rope], whose c is the input of wkv_b) instead of 'k_pre', 'q', 'k', 'v'.
Calibration capture uses it so the layer loop lives in one place (moec/calibrate/capture.py).
"""

from __future__ import annotations

import math
import os
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1·mscale·ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(args: ModelArgs) -> float:
    """The factor YaRN applies to cos/sin (1 for every other scaling): the config's attention_factor, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (DeepSeek), else mscale(factor)."""
    sc = args.rope_scaling
    if not sc or sc["rope_type"] != "yarn":
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    if sc.get("mscale") and sc.get("mscale_all_dim"):
        return yarn_mscale(sc["factor"], sc["mscale"]) / yarn_mscale(sc["factor"], sc["mscale_all_dim"])
    return yarn_mscale(sc["factor"])


def _yarn_inv_freq(inv: torch.Tensor, d: int, base: float, sc: dict) -> torch.Tensor:
    """YaRN: interpolate (divide by factor) the low frequencies, keep the high ones, ramp linearly between the
    dimensions that turn beta_slow and beta_fast times over the original context."""
    factor, ctx = sc["factor"], sc["original_max_position_embeddings"]
    fast, slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def dim_of(rotations):  # the dimension index whose wavelength fits `rotations` turns into ctx
        return d * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_of(fast), dim_of(slow)
    if sc.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv.device) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return inv / factor * (1 - keep) + inv * keep


def rope_inv_freq(args: ModelArgs, device=None) -> torch.Tensor:
    """Inverse frequencies [rope_dim/2], with the RoPE scaling of the source config applied."""
    d = args.rope_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    sc = args.rope_scaling
    if not sc:
        return inv
    kind = sc["rope_type"]
    if kind == "linear":
        return inv / sc["factor"]
    if kind == "yarn":
        return _yarn_inv_freq(inv, d, args.rope_theta, sc)
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
    """cos, sin: [T, rope_dim] for integer positions [T] (half-rotation layout, as in HF Llama), times YaRN's
    attention factor where the scaling has one."""
    inv = rope_inv_freq(args, positions.device)
    freqs = positions.float()[:, None] * inv[None, :]  # [T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    f = rope_attention_factor(args)
    return (emb.cos() * f).to(dtype), (emb.sin() * f).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x: [B, heads, T, d]; cos/sin: [T, r] (or broadcastable), r <= d: the first r dims are rotated and the rest
    pass through (partial rotary, GLM-4.5). interleaved: the pairs are (x0, x1), (x2, x3), ... (DeepSeek); the
    result is then in halves order [rotated evens, rotated odds], as transformers' DeepSeek-V3 writes it: the
    same permutation for q and k, so q·k is that of the pairwise rotation."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin, interleaved), x[..., r:]], dim=-1)
    half = x.shape[-1] // 2
    if interleaved:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA (GQA-aware) with an optional boolean mask, and gpt-oss's sinks: sinks broadcastable to q.shape[:-1]
    (one logit per query row: [H, 1] for q [B, H, T, d], [K, G] for a step's q viewed [b, K, G, d]) in the
    softmax's denominator, as a zero key and value scored by it (the weights of the real keys shrink, nothing is
    added to the output)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=True)
    lead, S = q.shape[:-1], k.shape[-2]
    bias = torch.zeros((*lead, S), dtype=q.dtype, device=q.device)
    if attn_mask is not None:
        bias = bias.masked_fill(~attn_mask, float("-inf"))
    bias = torch.cat([bias, sinks.to(q.dtype).expand(lead)[..., None]], dim=-1)
    zk, zv = k.new_zeros(*k.shape[:-2], 1, k.shape[-1]), v.new_zeros(*v.shape[:-2], 1, v.shape[-1])
    return F.scaled_dot_product_attention(q, torch.cat([k, zk], -2), torch.cat([v, zv], -2), attn_mask=bias,
                                          scale=scale, enable_gqa=True)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_pos: torch.Tensor, window: int = 0,
                       sinks: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of the last T of the keys' positions: q [B, H, T, d] at positions key_pos[-T:], k, v [B, K, S, d]
    at positions key_pos [S] (any order: a ring buffer's). A query at p sees the keys at p' <= p, and with a
    window only those with p - p' < window (transformers' sliding window: the query's own key included).
    sinks [H]: one logit per query head in the softmax's denominator (gpt-oss), as a zero key and value scored
    by that logit: the keys' weights shrink and nothing is added to the output."""
    T = q.shape[2]
    qp = key_pos[-T:][:, None]
    allowed = key_pos[None, :] <= qp
    if window:
        allowed &= key_pos[None, :] > qp - window  # [T, S]
    return sdpa(q, k, v, allowed, scale, None if sinks is None else sinks.view(-1, 1))


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
        if args.attn_sinks:
            self.sinks = nn.Parameter(torch.zeros(H))

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
        window = a.layer_windows[layer]
        sinks = self.sinks if a.attn_sinks else None
        if cache is None and sinks is None and not window:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif cache is None:
            out = windowed_attention(q, k, v, torch.arange(T, device=x.device), window, sinks)
        else:
            out = cache.attend(layer, q, k, v, start_pos, **({} if sinks is None else {"sinks": sinks}))  # [B, H, T, d]
        out = out.transpose(1, 2).reshape(B, T, a.n_heads * a.head_dim)  # [B, T, H·d]
        if observer is not None:
            observer(layer, "attn_out", out)  # the input of wo
        return self.wo(out)


def mla_softmax_scale(args: ModelArgs) -> float:
    """MLA's score scale: 1/√(qk head dim), times mscale(factor, mscale_all_dim)² under a scaling that sets
    mscale_all_dim (DeepSeek's YaRN: the temperature the cos/sin factor divides out of the RoPE part)."""
    scale = args.head_dim**-0.5
    sc = args.rope_scaling or {}
    if sc.get("mscale_all_dim"):
        scale *= yarn_mscale(sc["factor"], sc["mscale_all_dim"]) ** 2
    return scale


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3). Per token: q = wq(x) (or wq_b(q_a_norm(wq_a(x)))) split
    into the no-RoPE part [H, nope] and the RoPE part [H, rope]; wkv_a(x) = [latent c (r), k_rope (rope)],
    c normed (kv_a_norm); wkv_b(c) = per head [k_nope (nope), v (v_head_dim)]. Keys are [k_nope, k_rope]
    with k_rope shared by every head.

    Without a cache (prefill, the reference) the keys and values are decompressed and attended with SDPA.
    With one, the cache holds only [c, k_rope] per token (args.latent_dim) and attention is absorbed:
    q_nope·k_nope = (q_nope·W_UK)·c, so each head's query becomes [q_nope·W_UK (r), q_rope] against the
    one shared latent "head", and the output P·c is projected by W_UV per head afterwards. The cache's
    `attend(layer, q [B, H, T, r + rope], kv [B, 1, T, r + rope], None, start_pos)` returns P·c [B, H, T, r]
    (values = the first r channels of the cached rows): moec/runtime/mla.py."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H, d, D, r = args.n_heads, args.head_dim, args.dim, args.kv_lora_rank
        if args.q_lora_rank:
            self.wq_a = nn.Linear(D, args.q_lora_rank, bias=args.qkv_bias)
            self.q_a_norm = RMSNorm(args.q_lora_rank, 1e-6)
            self.wq_b = nn.Linear(args.q_lora_rank, H * d, bias=False)
        else:
            self.wq = nn.Linear(D, H * d, bias=False)
        self.wkv_a = nn.Linear(D, r + args.qk_rope_dim, bias=args.qkv_bias)
        self.kv_a_norm = RMSNorm(r, 1e-6)
        self.wkv_b = nn.Linear(r, H * (args.qk_nope_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(H * args.v_head_dim, D, bias=args.o_bias)
        self.scale = mla_softmax_scale(args)

    def kv_b_weight(self) -> torch.Tensor:
        """wkv_b's weight [H, nope + v, r]; a quantized wkv_b (runtime/experts.QLinear) dequantized once and kept
        (the absorbed products need the matrix itself, not its product with a vector)."""
        a = self.args
        if isinstance(self.wkv_b, nn.Linear):
            w = self.wkv_b.weight
        else:
            if getattr(self, "_kv_b_dense", None) is None or self._kv_b_dense[0] is not self.wkv_b:
                self._kv_b_dense = (self.wkv_b, self.wkv_b.dense_weight())
            w = self._kv_b_dense[1]
        return w.view(a.n_heads, a.qk_nope_dim + a.v_head_dim, a.kv_lora_rank)

    def absorbed_weight(self, dtype: torch.dtype, rotation: torch.Tensor | None = None) -> torch.Tensor:
        """kv_b_weight() in `dtype`, times the cache's latent rotation Rc [r, r] when it has one: a cache holding
        the latent as c·Rc (runtime/mla_nuq.py) is queried with q_nope·W_UK·Rc and returns P·(c·Rc), which
        W_UV·Rc projects, so the rotation costs nothing per step (the product is made once and kept). The conversion
        is kept too: a quantized wkv_b's fp32 dense weight cast to bf16 every step was a 4 MB copy kernel a
        DeepSeek-V2-Lite layer (0.13 ms a step; results/latency_deepseek_lin4_down_split_h100)."""
        w = self.kv_b_weight()
        if rotation is None and w.dtype == dtype:
            return w
        # _version: an in-place change of the weight (or rotation) makes a new product
        rot = None if rotation is None else (rotation.data_ptr(), rotation._version)
        key = (w.data_ptr(), w._version, w.shape, rot, dtype)
        if getattr(self, "_kv_b_rot", None) is None or self._kv_b_rot[0] != key:
            made = w.to(dtype) if rotation is None else torch.matmul(w.float(), rotation.to(w.device, torch.float32))
            self._kv_b_rot = (key, made.to(dtype))
        return self._kv_b_rot[1]

    def forward(self, x, cos, sin, layer: int, cache=None, start_pos: int = 0, observer=None):
        a = self.args
        B, T, _ = x.shape
        H, nope, rope, r = a.n_heads, a.qk_nope_dim, a.qk_rope_dim, a.kv_lora_rank
        if a.q_lora_rank:
            q_lat = self.q_a_norm(self.wq_a(x))
            if observer is not None:
                observer(layer, "q_lat", q_lat)  # the input of wq_b
            q = self.wq_b(q_lat)
        else:
            q = self.wq(x)
        q = q.view(B, T, H, a.head_dim).transpose(1, 2)  # [B, H, T, nope + rope]
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        c, k_rope = self.wkv_a(x).split([r, rope], dim=-1)  # [B, T, r], [B, T, rope]
        c = self.kv_a_norm(c)
        q_rope = apply_rope(q_rope, cos, sin, a.rope_interleave)
        k_rope = apply_rope(k_rope[:, None], cos, sin, a.rope_interleave)  # [B, 1, T, rope]
        latent = torch.cat([c[:, None], k_rope], dim=-1)  # [B, 1, T, r + rope]: what a cache holds
        if observer is not None:
            observer(layer, "kv_latent", latent)
        if cache is None:
            kv = self.wkv_b(c).view(B, T, H, nope + a.v_head_dim).transpose(1, 2)
            k_nope, v = kv.split([nope, a.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_rope.expand(B, H, T, rope)], dim=-1)
            out = F.scaled_dot_product_attention(torch.cat([q_nope, q_rope], dim=-1), k, v, is_causal=True,
                                                 scale=self.scale)  # [B, H, T, v]
        else:
            rotation = getattr(cache, "latent_rotation", None)  # a cache holding c·Rc (runtime/mla_nuq.py)
            w = self.absorbed_weight(q.dtype, None if rotation is None else rotation(layer))  # [H, nope + v, r]
            # per-head products as bmm over strided slices of w (einsum would copy them every step)
            q_lat = torch.bmm(q_nope.transpose(0, 1).reshape(H, B * T, nope), w[:, :nope])  # [H, B·T, r]
            q_lat = q_lat.view(H, B, T, r).transpose(0, 1)
            o_lat = cache.attend(layer, torch.cat([q_lat, q_rope], dim=-1), latent, None, start_pos)  # [B, H, T, r]
            out = torch.bmm(o_lat.to(q.dtype).transpose(0, 1).reshape(H, B * T, r), w[:, nope:].transpose(1, 2))
            out = out.view(H, B, T, a.v_head_dim).transpose(0, 1)  # [B, H, T, v]
        out = out.transpose(1, 2).reshape(B, T, H * a.v_head_dim)
        if observer is not None:
            observer(layer, "attn_out", out)
        return self.wo(out)

    def decode_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, cache,
                     in_proj=None) -> torch.Tensor:
        """forward()'s absorbed step for one token a row (x [b, D], cos/sin [b, rope]) -> [b, D], with the q_a
        norm, the kv_a norm, both RoPEs, the query's absorption (q_nope·W_UK) and the latent row as two kernels
        (kernels/fused_decode.py) instead of ~27 torch launches: the engine's fused step (runtime/decode.py) on
        models of one dtype. in_proj: wq (or wq_a) and wkv_a as one projection of x (the engine's, runtime/decode.py
        _fuse_linears), one launch."""
        from ..kernels.fused_decode import add_rms_norm, mla_rope_latent, mla_uv

        a = self.args
        b = x.shape[0]
        H, nope = a.n_heads, a.qk_nope_dim
        norms = (self.kv_a_norm, self.q_a_norm) if a.q_lora_rank else (self.kv_a_norm,)
        if any(n.weight.dtype != x.dtype for n in norms):  # the kernels' one dtype: forward's promotions otherwise
            return self(x[:, None], cos[:, None, None], sin[:, None, None], layer, cache, 0).view(b, -1)
        if in_proj is not None:  # [q or q_a | c_kv, k_rope]: row-strided views of one output
            y = in_proj(x)
            n = y.shape[1] - self.kv_a_norm.weight.shape[0] - a.qk_rope_dim
            q_in, ckr = y[:, :n], y[:, n:]
        else:
            q_in, ckr = None, self.wkv_a(x)
        if a.q_lora_rank:
            q_a = self.wq_a(x) if q_in is None else q_in
            q = self.wq_b(add_rms_norm(q_a, None, self.q_a_norm.weight, self.q_a_norm.eps)[1])
        else:
            q = self.wq(x) if q_in is None else q_in  # [b, H·(nope + rope)]
        rotation = getattr(cache, "latent_rotation", None)
        w = self.absorbed_weight(q.dtype, None if rotation is None else rotation(layer))  # [H, nope + v, r]
        # the absorbed query [b, H, r + rope] = [q_nope·W_UK, RoPE(q_rope)] and the latent row, one launch
        q_abs, latent = mla_rope_latent(q, ckr, cos, sin, self.kv_a_norm.weight, self.kv_a_norm.eps, H, nope,
                                        a.rope_interleave, w[:, :nope])
        o_lat = cache.attend(layer, q_abs[:, :, None], latent[:, None, None], None, 0)  # [b, H, 1, r]
        # o_lat·W_UVᵀ per head in one launch (kernels/fused_decode.mla_uv) where MOEC_MLA_UV, else MLA_UV_DEFAULT, says;
        # else the cast and cuBLAS's bmm
        if os.environ.get("MOEC_MLA_UV", "1" if MLA_UV_DEFAULT else "0") == "1":
            return self.wo(mla_uv(o_lat[:, :, 0], w[:, nope:]))
        out = torch.bmm(o_lat[:, :, 0].to(q.dtype).transpose(0, 1), w[:, nope:].transpose(1, 2))  # [H, b, v]
        return self.wo(out.transpose(0, 1).reshape(b, H * a.v_head_dim))


# Whether MLA's fused decode step takes mla_uv by default: benchmarks/studies/fp4h_flip.py sets it from the step's A/B
# on DeepSeek-V2-Lite (benchmarks/studies/gpu_fp4h.sh V2LITE=1; docs/results.md has the numbers).
MLA_UV_DEFAULT = True


class FFN(nn.Module):
    """A plain SwiGLU MLP (the shared expert)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid slope: gate·sigmoid(1.702·gate) approximates GELU


def expert_act(g: torch.Tensor, u: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The expert's gated activation of its gate g and up u projections (ModelArgs.expert_act)."""
    if args.expert_act == "silu":
        return F.silu(g) * u
    lim = args.swiglu_limit
    g, u = g.clamp(max=lim), u.clamp(-lim, lim)
    return g * torch.sigmoid(SWIGLU_ALPHA * g) * (u + 1)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool, args: ModelArgs | None = None,
          score_bias: torch.Tensor | None = None, logit_bias: torch.Tensor | None = None):
    """Top-k routing in fp32. x: [N, D], router: [E, D] -> logits [N, E], weights, ids [N, A].
    Softmax over all experts unless `args` says otherwise (ModelArgs router_score, topk_method, n_group,
    topk_group, routed_scale; score_bias [E]: added to the scores for the choice only; logit_bias [E]: the
    router's own bias, added to the logits)."""
    logits = x @ router.t()
    if logit_bias is not None:
        logits = logits + logit_bias
    if args is not None and args.router_score == "softmax_topk":  # gpt-oss: the softmax over the kept logits
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return logits, torch.softmax(top, dim=-1) * args.routed_scale, ids
    if args is None or (args.router_score, args.topk_method, args.routed_scale, score_bias) == (
            "softmax", "greedy", 1.0, None):
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, ids
    lf = logits.float()
    scores = torch.sigmoid(lf) if args.router_score == "sigmoid" else torch.softmax(lf, dim=-1)
    choice = scores if score_bias is None else scores + score_bias.float()
    if args.topk_method != "greedy":
        N, E = choice.shape
        grouped = choice.view(N, args.n_group, E // args.n_group)
        if args.topk_method == "group_max":
            group_score = grouped.amax(-1)
        else:  # group_top2
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(args.topk_group, dim=-1).indices, True)
        # DeepSeek-V2 zeroes the other groups' (non-negative) scores, V3 sets its biased ones to -inf: either
        # way no expert outside the kept groups is chosen unless fewer than top_k experts remain
        fill = 0.0 if args.topk_method == "group_max" else float("-inf")
        choice = grouped.masked_fill(~keep[..., None], fill).view(N, E)
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return logits, weights * args.routed_scale, ids


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


def expert_forward(x: torch.Tensor, w1, w3, w2, args: ModelArgs, biases=None, e: int = 0) -> torch.Tensor:
    """One expert on x [n, D] from its matrices w1, w3 [I, D], w2 [D, I] (and its row e of the biases)."""
    g, u = x @ w1.t(), x @ w3.t()
    if biases is not None:
        g, u = g + biases[0][e].to(g.dtype), u + biases[1][e].to(u.dtype)
    y = expert_act(g, u, args) @ w2.t()
    return y if biases is None else y + biases[2][e].to(y.dtype)


class MoE(nn.Module):
    """Router + stacked experts (+ optional shared expert). A dense MLP is E = 1 without a router."""

    def __init__(self, args: ModelArgs, kind: str):
        super().__init__()
        self.args, self.kind = args, kind
        E, I = (args.n_experts, args.expert_dim) if kind == "moe" else (1, args.dense_dim)
        D = args.dim
        if kind == "moe":
            self.router = nn.Linear(D, E, bias=args.router_logit_bias)
            if args.router_bias:
                self.score_bias = nn.Parameter(torch.zeros(E))
        self.w1 = nn.Parameter(torch.empty(E, I, D))
        self.w3 = nn.Parameter(torch.empty(E, I, D))
        self.w2 = nn.Parameter(torch.empty(E, D, I))
        if kind == "moe" and args.expert_bias:
            self.b1, self.b3 = nn.Parameter(torch.zeros(E, I)), nn.Parameter(torch.zeros(E, I))
            self.b2 = nn.Parameter(torch.zeros(E, D))
        self.codec = None  # runtime/experts.ExpertWeights once a packed checkpoint quantizes these experts
        if kind == "moe" and args.shared_dim:
            self.shared = FFN(D, args.shared_dim)
            if args.shared_gate:
                self.shared_gate = nn.Linear(D, 1, bias=False)

    def biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(b1, b3, b2) where the experts have biases."""
        return (self.b1, self.b3, self.b2) if hasattr(self, "b1") else None

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.codec is not None:
            return self.codec.expert(e, x, self.args, self.biases())
        return expert_forward(x, self.w1[e], self.w3[e], self.w2[e], self.args, self.biases(), e)

    def forward(self, x: torch.Tensor, layer: int, observer=None, shared: bool = True) -> torch.Tensor:
        """x [..., D] -> [..., D]; shared=False leaves the shared expert out (the fused decode step runs it)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        if self.kind == "dense":
            return self.expert(0, x).view(shape)
        a = self.args
        logits, weights, ids = route(x, self.router.weight, a.top_k, a.norm_topk, a,
                                     getattr(self, "score_bias", None), self.router.bias)  # [N, E], [N, A] ×2
        if observer is not None:  # (on CUDA)
            observer(layer, "router_logits", logits)
            observer(layer, "expert_ids", ids)
        out = self.codec.fused(x, weights, ids, a, self.biases()) if self.codec is not None else None  # Triton
        if out is None:
            out = combine_experts(self.expert, x, weights, ids)
        if shared and hasattr(self, "shared"):
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
        self.attn = MLAttention(args) if args.is_mla else Attention(args)
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
