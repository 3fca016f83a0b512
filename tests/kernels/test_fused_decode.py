"""Fused decode-step kernels (moec/kernels/fused_decode.py) against the torch ops they replace, and the
engine's fused step against its plain step (TRITON_INTERPRET=1 on the CPU).

fp32: equal to 1e-5 (summation order only). bf16: the kernels round where torch rounds (after the
normalization, after each RoPE product, after the residual add), so outputs agree to one bf16 ulp
(the fp32 sum of squares may differ in its last bits and flip a rounding). The CPU interpreter casts
fp32 to bf16 by truncation, not round-to-nearest as the GPU does, so there a rounded value may be one
ulp off too."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.kernels.fused_decode import add_rms_norm, mla_rope_latent, mla_uv, qk_norm_rope, silu_mul  # noqa: E402
from moec.runtime.config import ModelArgs  # noqa: E402
from moec.runtime.decode import DecodeEngine  # noqa: E402
from moec.runtime.kvcache import FP16Cache  # noqa: E402
from moec.runtime.latency import random_model  # noqa: E402
from moec.runtime.model import apply_rope, rms_norm, rope_cos_sin  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16: one ulp (2^-7 relative) on the GPU; two on the CPU, where the interpreter truncates twice
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7 if DEVICE == "cuda" else 2 ** -6}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 96])
def test_add_rms_norm(dtype, D):
    g = torch.Generator().manual_seed(D)
    x, delta = (torch.randn(3, D, generator=g).to(DEVICE, dtype) * 3 for _ in range(2))
    w = (torch.rand(D, generator=g) + 0.5).to(DEVICE, dtype)
    xo, h = add_rms_norm(x, delta, w, 1e-5)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(xo, x + delta)
    assert torch.allclose(xo.float(), (x + delta).float(), rtol=TOL[dtype], atol=0)
    ref = rms_norm(xo, w, 1e-5)
    assert torch.allclose(h.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    _, h0 = add_rms_norm(x[:, :D], None, w, 1e-5)
    assert torch.allclose(h0.float(), rms_norm(x, w, 1e-5).float(), rtol=TOL[dtype], atol=TOL[dtype])
    d2 = torch.randn(3, D, generator=g).to(DEVICE, dtype)
    xo2, h2 = add_rms_norm(x, delta, w, 1e-5, delta2=d2)  # x + (delta + d2): the sum rounded first, as torch's
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(xo2, x + (delta + d2))
    ref2 = (x + (delta + d2)).float()  # two roundings: each off by up to TOL of what it rounds
    assert ((xo2.float() - ref2).abs() <= TOL[dtype] * ((delta + d2).float().abs() + ref2.abs()) + 1e-6).all()
    assert torch.allclose(h2.float(), rms_norm(xo2, w, 1e-5).float(), rtol=TOL[dtype], atol=TOL[dtype])
    # an fp32 delta (the MoE kernels' split accumulator) is rounded to x's dtype first: torch's x + delta.to(x.dtype)
    df = torch.randn(3, D, generator=g).to(DEVICE) * 3
    xo3, _ = add_rms_norm(x, df, w, 1e-5, delta2=d2)
    ref3 = (x + (df.to(dtype) + d2)).float()
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(xo3.float(), ref3)
    assert ((xo3.float() - ref3).abs() <= TOL[dtype] * (2 * df.abs() + d2.float().abs() + ref3.abs()) + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("I", [48, 1500])
def test_silu_mul(dtype, I):
    """silu(g)·u of a fused [g | u] row against torch's F.silu(g) * u (1500: two column blocks, a masked tail)."""
    g = torch.Generator().manual_seed(I)
    gu = (torch.randn(2, 2 * I, generator=g) * 4).to(DEVICE, dtype)
    out = silu_mul(gu)
    ref = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    assert out.shape == (2, I) and out.dtype == dtype
    assert torch.allclose(out.float(), ref.float(), rtol=2 * TOL[dtype], atol=TOL[dtype]), (out - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("rotary", [0, 16, 8])
def test_qk_norm_rope(dtype, norm, rotary):
    """The kernel against the model's norm and RoPE: whole heads, and partial rotary (GLM-4.5: half of each head
    rotated; a quarter, where the passed-through part is not a power of two)."""
    N, H, K, d = 2, 4, 2, 32
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(N, (H + 2 * K) * d, generator=g).to(DEVICE, dtype)
    q, k = qkv[:, : H * d], qkv[:, H * d : (H + K) * d]  # strided views, as the engine passes them
    args = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=1, n_heads=H, n_kv_heads=K, head_dim=d,
                     rotary_dim=rotary)
    cos, sin = rope_cos_sin(args, torch.tensor([5, 1000], device=DEVICE), dtype)
    assert cos.shape == (N, rotary or d)
    qw = kw = None
    qr, kr = q.reshape(N, H, 1, d), k.reshape(N, K, 1, d)
    if norm:
        qw, kw = ((torch.rand(d, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(2))
        qr, kr = rms_norm(qr, qw, 1e-6), rms_norm(kr, kw, 1e-6)
    ref_q = apply_rope(qr, cos[:, None, None], sin[:, None, None])[:, :, 0]
    ref_k = apply_rope(kr, cos[:, None, None], sin[:, None, None])[:, :, 0]
    oq, ok = qk_norm_rope(q, k, cos, sin, H, K, qw, kw, 1e-6)
    for o, r in ((oq, ref_q), (ok, ref_k)):
        assert o.shape == r.shape and o.dtype == r.dtype
        err = (o.float() - r.float()).abs().max()
        assert torch.allclose(o.float(), r.float(), rtol=TOL[dtype], atol=TOL[dtype]), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
def test_mla_rope_latent(dtype, interleave):
    """MLA's step prologue against model.MLAttention.forward's torch ops: the query heads' RoPE parts turned (pairs
    interleaved as DeepSeek stores them, or halves), and the latent row [kv_a_norm(c), RoPE(k_rope)], from a q
    whose rows are strided views (as a fused projection gives them); r = 48 is not a power of two."""
    N, H, nope, rope, r = 2, 3, 32, 16, 48
    g = torch.Generator().manual_seed(4)
    qbig = torch.randn(N, H * (nope + rope) + 8, generator=g).to(DEVICE, dtype)
    q = qbig[:, : H * (nope + rope)]
    ckr = torch.randn(N, r + rope, generator=g).to(DEVICE, dtype)
    w = (torch.rand(r, generator=g) + 0.5).to(DEVICE, dtype)
    args = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=1, n_heads=H, n_kv_heads=H, head_dim=rope)
    cos, sin = rope_cos_sin(args, torch.tensor([7, 3000], device=DEVICE), dtype)
    q_rope, latent = mla_rope_latent(q, ckr, cos, sin, w, 1e-6, H, nope, interleave)
    cs = cos[:, None, None], sin[:, None, None]
    want_q = apply_rope(q.view(N, H, 1, nope + rope)[..., nope:], *cs, interleaved=interleave)[:, :, 0]
    want_k = apply_rope(ckr[:, None, None, r:], *cs, interleaved=interleave)[:, 0, 0]
    want_lat = torch.cat([rms_norm(ckr[:, :r], w, 1e-6), want_k], -1)
    for got, want in ((q_rope, want_q), (latent, want_lat)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.allclose(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype]), (got - want).abs().max()
    # with W_UK [H, nope, r] (a strided slice of the absorbed weight, as the engine passes it): the absorbed query
    # [q_nope·W_UK, RoPE(q_rope)] as the step's bmm and cat give it (r = 48: two column tiles, the second masked)
    wkv = torch.randn(H, nope + 40, r, generator=g).to(DEVICE, dtype) / 8
    q_abs, latent2 = mla_rope_latent(q, ckr, cos, sin, w, 1e-6, H, nope, interleave, wkv[:, :nope])
    q_lat = torch.bmm(q.view(N, H, -1)[:, :, :nope].transpose(0, 1), wkv[:, :nope]).transpose(0, 1)
    want_abs = torch.cat([q_lat, want_q], -1)
    assert q_abs.shape == (N, H, r + rope) and torch.equal(latent2, latent)
    # the sums' order differs from the GEMM's: fp32 to 1e-5, bf16 to one rounding of the product's size
    tol = 1e-5 if dtype == torch.float32 else 2 * TOL[dtype]
    assert torch.allclose(q_abs.float(), want_abs.float(), rtol=tol, atol=tol), (q_abs - want_abs).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 3])
def test_mla_uv(dtype, N):
    """MLA's absorbed output product against the step's cast and bmm: o_lat in fp32 as the latent attention returns
    it, as a strided view [N, H, r] of its [N, H, 1, r] output; W_UV a strided slice [H, v, r] of the absorbed
    weight, v = 24 (two row tiles, the second masked) and r = 48 (not a power of two)."""
    H, nope, v, r = 3, 16, 24, 48
    g = torch.Generator().manual_seed(5)
    o_lat = torch.randn(N, H, 1, r, generator=g).to(DEVICE)[:, :, 0]
    w = (torch.randn(H, nope + v, r, generator=g) / 8).to(DEVICE, dtype)
    got = mla_uv(o_lat, w[:, nope:])
    want = torch.bmm(o_lat.to(dtype).transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1).reshape(N, H * v)
    assert got.shape == want.shape == (N, H * v) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 * TOL[dtype]
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (got.float() - want.float()).abs().max()


def test_engine_mla_uv_matches_bmm(monkeypatch):
    """The fused MLA step with mla_uv (MOEC_MLA_UV=1) gives the logits of the cast and bmm it replaces (0), in bf16
    as the GPU runs it (MOEC_KERNELS=1: the interpreter runs the kernel paths)."""
    from moec.runtime.kvcache import dense_cache

    args = ModelArgs(arch="deepseek_v3", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=48,
                     max_seq_len=64, n_experts=4, top_k=2, expert_dim=32, ffn_kinds=["dense", "moe"], dense_dim=64,
                     shared_dim=32, router_score="sigmoid", topk_method="group_top2", n_group=2, topk_group=1,
                     router_bias=True, routed_scale=2.5, attn_kind="mla", q_lora_rank=32, kv_lora_rank=32,
                     qk_rope_dim=16, v_head_dim=32, rope_interleave=True)
    tokens = torch.tensor([3, 9, 27, 17, 51, 8, 40])
    monkeypatch.setenv("MOEC_KERNELS", "1")
    out = []
    for uv in ("0", "1"):
        monkeypatch.setenv("MOEC_MLA_UV", uv)
        model = random_model(args, lambda name: None, DEVICE, torch.bfloat16, seed=4)
        eng = DecodeEngine(model, dense_cache(args, 1, 32, dtype=torch.bfloat16, device=DEVICE, mode="static"),
                           graphs=False, fuse=True)
        assert eng.mla_kernel
        logits = [eng.prefill(0, tokens[:4])]
        for t in tokens[4:]:
            eng.tokens[:1] = t
            logits.append(eng.step(1)[0].clone())
        out.append(torch.stack(logits).float())
    # one bf16 rounding of the product either way; the sums' order differs. Triton's interpreter rounds fp32 to bf16
    # by truncation (biased, unlike the GPU's cvt.rn), so the drift between the two paths through this tiny random
    # model is larger here: 0.0094, then 0.0101 once the routed experts' fp32 sum was rounded in add_rms_norm (a
    # wrong product gives ~1)
    err = ((out[1] - out[0]).norm() / out[0].norm()).item()
    assert err < 2e-2, err


def test_mla_uv_compiles_for_sm90_without_spills():
    """mla_uv at DeepSeek's shapes (r = 512, a [16, 512] fp32 W_UV tile a program, batch 1 and 16), compiled for sm_90
    on the CPU with PDL: no stack, registers under 128 (four programs an SM at 4 warps), and no global access before
    the PDL wait."""
    from moec.kernels import aot

    types = {"o_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16"} | {
        n: "i32" for n in ("H", "V", "so0", "so1", "sw0", "sw1")}
    jobs = [{"module": "moec.kernels.fused_decode", "kernel": "_mla_uv_kernel", "types": types,
             "constexprs": dict(N=n, R=512, RB=512, BV=16, PDL=True), "num_warps": 4} for n in (1, 16)]
    for job, rep in zip(jobs, aot.report_in_subprocess(jobs), strict=True):
        res, order = rep["resources"], rep["ptx_order"]
        assert res["stack"] == 0 and res["local"] == 0 and res["registers"] <= 128, (job["constexprs"], res)
        assert order["wait"] is not None and order["wait"] < order["global"], order


@pytest.mark.parametrize("qk_norm", ["none", "head"])
def test_engine_fused_step_matches_plain_step(qk_norm):
    """Greedy tokens and logits of the fused step equal the plain step's (fp32 model, fp32 cache)."""
    args = ModelArgs(arch="qwen3" if qk_norm == "head" else "mixtral", vocab_size=64, dim=64, n_layers=2,
                     n_heads=4, n_kv_heads=2, head_dim=32, max_seq_len=64, n_experts=4, top_k=2, expert_dim=48,
                     qk_norm=qk_norm)
    model = random_model(args, lambda name: None, DEVICE, torch.float32, seed=2)
    prompt = torch.tensor([3, 9, 27, 17, 51])
    out = []
    for fuse in (False, True):
        cache = FP16Cache(args, 1, 32, device=DEVICE, dtype=torch.float32, mode="static")
        eng = DecodeEngine(model, cache, graphs=False, fuse=fuse)
        assert eng.fused == fuse
        logits = [eng.prefill(0, prompt)]
        for _ in range(4):
            logits.append(eng.step(1, feed_next=True)[0].clone())
        out.append(torch.stack(logits))
    assert torch.allclose(out[0], out[1], rtol=1e-4, atol=1e-4), (out[0] - out[1]).abs().max()


@pytest.mark.parametrize("q_lora_rank,quantized", [(32, False), (0, False), (0, True)])
def test_engine_fused_step_mla(q_lora_rank, quantized):
    """The fused step of an MLA model (DeepSeek-V3 style, or V2-Lite's without the query's low rank: the residual
    adds and block norms fused around model.MLAttention's absorbed step over the latent cache, its norms, RoPEs and
    latent row in one kernel, the query's and the latent's projections as one) gives the plain step's logits.
    quantized: every attention and shared-expert projection 4-bit (latency-hls2-lin4's layout), wq and wkv_a then
    one qlinear launch (_QuantQKV) and wkv_b dequantized once for the absorbed products."""
    from moec.calibrate import hls
    from moec.runtime.decode import _QuantQKV
    from moec.runtime.experts import QuantMatrix, attach
    from moec.runtime.kvcache import dense_cache

    args = ModelArgs(arch="deepseek_v3", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=48,
                     max_seq_len=64, ffn_kinds=["dense", "moe"], dense_dim=64, n_experts=4, top_k=2, expert_dim=32,
                     shared_dim=32, router_score="sigmoid", topk_method="group_top2", n_group=2, topk_group=1,
                     router_bias=True, routed_scale=2.5, attn_kind="mla", q_lora_rank=q_lora_rank, kv_lora_rank=32,
                     qk_rope_dim=16, v_head_dim=32, rope_interleave=True)
    model = random_model(args, lambda name: None, DEVICE, torch.float32, seed=2)
    if quantized:
        quant = {}
        names = [f"layers.{i}.attn.{n}" for i in range(2) for n in ("wq", "wkv_a", "wkv_b", "wo")]
        for name in names + [f"layers.1.moe.shared.{n}" for n in ("w1", "w3", "w2")]:
            W = model.get_submodule(name).weight.data.float().cpu()
            stored = {k: v[0] for k, v in hls.quantize(W[None], None, "rtn", 4, 16, False).items()}
            quant[name + ".weight"] = QuantMatrix("rtn", 4, tuple(W.shape), stored)
        attach(model, quant, DEVICE)
    prompt = torch.tensor([3, 9, 27, 17, 51])
    out = []
    for fuse in (False, True):
        eng = DecodeEngine(model, dense_cache(args, 1, 32, dtype=torch.float32, device=DEVICE, mode="static"),
                           graphs=False, fuse=fuse)
        assert eng.mla_kernel == fuse  # the fused step takes MLAttention.decode_fused (fused_decode.mla_rope_latent)
        assert [f is not None for f in eng.shared_gate_up] == ([False, True] if fuse else [])  # the moe layer's
        assert [f is not None for f in eng.mla_in] == ([True, True] if fuse else [])
        if fuse and quantized:
            assert all(isinstance(f, _QuantQKV) for f in eng.mla_in + eng.shared_gate_up[1:])
        attn = model.layers[0].attn  # the absorbed weight in another dtype: converted once, again after a change
        w16 = attn.absorbed_weight(torch.bfloat16)
        assert attn.absorbed_weight(torch.bfloat16) is w16 and torch.equal(w16, attn.kv_b_weight().to(torch.bfloat16))
        if not quantized:
            with torch.no_grad():
                attn.wkv_b.weight.mul_(2)
            assert torch.equal(attn.absorbed_weight(torch.bfloat16), 2 * w16)
            with torch.no_grad():
                attn.wkv_b.weight.div_(2)
        logits = [eng.prefill(0, prompt)]
        for _ in range(2 if quantized else 4):  # the interpreter's 4-bit GEMVs cost ~1 s a step
            logits.append(eng.step(1, feed_next=True)[0].clone())
        out.append(torch.stack(logits))
    assert torch.allclose(out[0], out[1], rtol=1e-4, atol=1e-4), (out[0] - out[1]).abs().max()


def _teacher_forced(model, cache, tokens, n_prompt: int, fuse: bool, shared_fused: list[bool] | None = None
                    ) -> torch.Tensor:
    """Logits [len(tokens) - n_prompt + 1, V] of the static engine: a prefill of n_prompt tokens, then one step
    per token (the plain or the fused step); shared_fused: which layers' shared experts the fused step must fuse."""
    eng = DecodeEngine(model, cache, graphs=False, fuse=fuse)
    assert eng.fused == fuse
    if fuse and shared_fused is not None:
        assert [f is not None for f in eng.shared_gate_up] == shared_fused
    logits = [eng.prefill(0, tokens[:n_prompt])]
    for t in tokens[n_prompt:]:
        eng.tokens[:1] = t
        logits.append(eng.step(1)[0].clone())
    return torch.stack(logits)


def test_engine_fused_step_partial_rotary():
    """GLM-4.5 style (q/k/v biases, per-head q/k norm, RoPE on half of each head, sigmoid group routing, a dense
    layer, a shared expert): the fused step (its q/k norm and partial RoPE in torch, the fused residual norms)
    gives the plain step's logits, and the plain step the full forward's."""
    args = ModelArgs(arch="glm4_moe", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                     max_seq_len=64, ffn_kinds=["dense", "moe"], dense_dim=64, n_experts=4, top_k=2, expert_dim=32,
                     shared_dim=32, qkv_bias=True, qk_norm="head", rotary_dim=16, router_score="sigmoid",
                     topk_method="group_top2", n_group=2, topk_group=1, router_bias=True, routed_scale=2.5)
    model = random_model(args, lambda name: None, DEVICE, torch.float32, seed=3)
    tokens = torch.tensor([3, 9, 27, 17, 51, 8, 40, 2, 33])
    out = [_teacher_forced(model, FP16Cache(args, 1, 32, device=DEVICE, dtype=torch.float32, mode="static"),
                           tokens, 5, fuse, [False, True]) for fuse in (False, True)]
    assert torch.allclose(out[0], out[1], rtol=1e-4, atol=1e-4), (out[0] - out[1]).abs().max()
    with torch.no_grad():
        full = model(tokens[None].to(DEVICE))[0, 4:]
    assert torch.allclose(out[0], full, rtol=1e-4, atol=1e-4), (out[0] - full).abs().max()


@pytest.mark.parametrize("rotated,bias", [(False, False), (True, False), (False, True)])
def test_engine_fuses_quantized_qkv(rotated, bias):
    """4-bit q/k/v projections (QLinear) run as one qlinear launch in the fused step: the same logits as
    the plain step (per-projection QLinear), and wq/wk/wv still hold their own weights (views). Rotated
    (incoherence) projections stay separate QLinears, which rotate their inputs, with the same logits.
    Biased ones (GLM, gpt-oss) fuse their biases too, and each QLinear keeps its own bias (a view)."""
    from moec.calibrate import hls
    from moec.rotation import hadamard_signs
    from moec.runtime.decode import _QuantQKV
    from moec.runtime.experts import QLinear, QuantMatrix, attach

    args = ModelArgs(arch="mixtral", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                     max_seq_len=64, n_experts=4, top_k=2, expert_dim=48, qkv_bias=bias)
    prompt = torch.tensor([3, 9, 27, 17, 51])
    out = []
    for fuse in (False, True):
        model = random_model(args, lambda name: None, DEVICE, torch.float32, seed=4)
        bk = model.layers[0].attn.wk.bias.detach().clone() if bias else None
        quant = {}
        for i, blk in enumerate(model.layers):
            for n in ("wq", "wk", "wv"):
                W = getattr(blk.attn, n).weight.data.float().cpu()
                stored = {k: v[0] for k, v in hls.quantize(W[None], None, "rtn", 4, 32, False).items()}
                if rotated:
                    stored["had_signs"] = hadamard_signs(W.shape[1], 16, i)
                quant[f"layers.{i}.attn.{n}.weight"] = QuantMatrix("rtn", 4, tuple(W.shape), stored)
        attach(model, quant, DEVICE)
        ref = [model.layers[0].attn.wk.q.dequant_ref(0)]
        cache = FP16Cache(args, 1, 32, device=DEVICE, dtype=torch.float32, mode="static")
        eng = DecodeEngine(model, cache, graphs=False, fuse=fuse)
        if fuse:
            assert all((f is None) if rotated else isinstance(f, _QuantQKV) for f in eng.qkv)
            assert isinstance(model.layers[0].attn.wk, QLinear)
            assert torch.equal(model.layers[0].attn.wk.q.dequant_ref(0), ref[0])  # the views hold wk's parts
            if bias:
                assert all(f.bias is not None for f in eng.qkv)
                assert torch.equal(model.layers[0].attn.wk.bias, bk)
        logits = [eng.prefill(0, prompt)]
        for _ in range(3):
            logits.append(eng.step(1, feed_next=True)[0].clone())
        out.append(torch.stack(logits))
    assert torch.allclose(out[0], out[1], rtol=1e-4, atol=1e-4), (out[0] - out[1]).abs().max()


@pytest.mark.parametrize("quantized,gated", [(True, False), (False, True)])
def test_engine_fuses_shared_expert(quantized, gated):
    """The shared expert in the fused step: its gate and up projections as one (4-bit QLinears: one qlinear
    launch, each keeping its own parts as views), fused_decode.silu_mul, the down projection, its output added in
    the next add_rms_norm: the plain step's logits. A gated shared expert (Qwen2-MoE's sigmoid gate) stays in
    the MoE call, with the same logits."""
    from moec.calibrate import hls
    from moec.runtime.decode import _QuantQKV
    from moec.runtime.experts import QuantMatrix, attach

    args = ModelArgs(arch="glm4_moe", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                     max_seq_len=64, ffn_kinds=["dense", "moe"], dense_dim=64, n_experts=4, top_k=2, expert_dim=32,
                     shared_dim=48, shared_gate=gated, router_score="sigmoid", topk_method="group_top2", n_group=2,
                     topk_group=1, router_bias=True, routed_scale=2.5)
    tokens = torch.tensor([3, 9, 27, 17, 51, 8, 40, 2, 33])
    out = []
    for fuse in (False, True):
        model = random_model(args, lambda name: None, DEVICE, torch.float32, seed=6)
        if quantized:
            quant = {}
            for n in ("w1", "w3", "w2"):
                W = getattr(model.layers[1].moe.shared, n).weight.data.float().cpu()
                stored = {k: v[0] for k, v in hls.quantize(W[None], None, "rtn", 4, 16, False).items()}
                quant[f"layers.1.moe.shared.{n}.weight"] = QuantMatrix("rtn", 4, tuple(W.shape), stored)
            attach(model, quant, DEVICE)
            ref = model.layers[1].moe.shared.w3.q.dequant_ref(0)
        cache = FP16Cache(args, 1, 32, device=DEVICE, dtype=torch.float32, mode="static")
        out.append(_teacher_forced(model, cache, tokens, 5, fuse, [False, not gated]))
        if fuse and quantized:
            eng_fused = DecodeEngine(model, FP16Cache(args, 1, 32, device=DEVICE, dtype=torch.float32,
                                                      mode="static"), graphs=False, fuse=True)
            assert isinstance(eng_fused.shared_gate_up[1], _QuantQKV)
            assert torch.equal(model.layers[1].moe.shared.w3.q.dequant_ref(0), ref)  # w3's parts: views
    assert torch.allclose(out[0], out[1], rtol=1e-4, atol=1e-4), (out[0] - out[1]).abs().max()


def test_engine_gpt_oss_sinks_windows_biased_experts():
    """gpt-oss style (sinks, a 4-token sliding window on layer 0, biases on every projection, the biased router
    with the softmax after top-k, biased experts with the clamped SwiGLU): the plain and the fused static steps
    give the full forward's logits past the window, and the window layer's cache holds 4 slots whatever the
    context (its ring), the full layer's the whole context."""
    args = ModelArgs(arch="gpt_oss", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                     max_seq_len=64, n_experts=4, top_k=2, expert_dim=32, qkv_bias=True, o_bias=True,
                     attn_sinks=True, layer_windows=[4, 0], router_score="softmax_topk", router_logit_bias=True,
                     expert_bias=True, expert_act="clamped_swiglu", swiglu_limit=1.0, norm_topk=False)
    model = random_model(args, lambda name: None, DEVICE, torch.float32, seed=5)
    tokens = torch.tensor([3, 9, 27, 17, 51, 8, 40, 2, 33, 12, 60, 5])
    out = []
    for fuse in (False, True):
        cache = FP16Cache(args, 1, 32, device=DEVICE, dtype=torch.float32, mode="static")
        assert [c.shape[2] for c in cache.k] == [4, 32]
        out.append(_teacher_forced(model, cache, tokens, 6, fuse))
        assert cache.bytes_read(range(1)) == (4 + 13) * 2 * 2 * 32 * 4  # K and V, 2 heads of 32, fp32
    assert torch.allclose(out[0], out[1], rtol=1e-4, atol=1e-4), (out[0] - out[1]).abs().max()
    with torch.no_grad():
        full = model(tokens[None].to(DEVICE))[0, 5:]
    assert torch.allclose(out[0], full, rtol=1e-4, atol=1e-4), (out[0] - full).abs().max()


def test_feed_next_after_prefill_feeds_the_prefill_choice():
    """step(feed_next=True) right after a prefill feeds the prefill's greedy token (it fed a stale one)."""
    args = ModelArgs(arch="mixtral", vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32,
                     max_seq_len=64, n_experts=4, top_k=2, expert_dim=32)
    model = random_model(args, lambda name: None, DEVICE, torch.float32, seed=6)
    prompt = torch.tensor([3, 9, 27, 17])
    out = []
    for feed in (True, False):
        eng = DecodeEngine(model, FP16Cache(args, 1, 16, device=DEVICE, dtype=torch.float32, mode="static"),
                           graphs=False)
        first = eng.prefill(0, prompt)
        if not feed:
            eng.tokens[:1] = first.argmax()
        out.append(eng.step(1, feed_next=feed)[0].clone())
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3", "gpt_oss"])
def test_engine_dense_gemv_route(arch, monkeypatch):
    """MOEC_DENSE_GEMV=1: the fused step's plain projections (fused q/k/v with their biases, o with gpt-oss's bias,
    the MLA query/latent inputs and wq_b, the shared expert's gate/up and down, the router with gpt-oss's logit
    bias) run qlinear's GEMV on the weights
    as stored (decode._DenseGEMV, the same Parameters) and give the cuBLAS route's logits; the LM head stays a
    Linear. MOEC_KERNELS=1: the interpreter runs every kernel path, as the GPU would."""
    from moec.runtime.decode import _DenseGEMV
    from moec.runtime.kvcache import dense_cache

    common = dict(vocab_size=64, dim=64, n_layers=2, n_heads=4, max_seq_len=64, n_experts=4, top_k=2, expert_dim=32)
    args = {"glm4_moe": ModelArgs(arch="glm4_moe", n_kv_heads=2, head_dim=32, ffn_kinds=["dense", "moe"],
                                  dense_dim=64, shared_dim=32, qkv_bias=True, router_score="sigmoid",
                                  topk_method="group_top2", n_group=2, topk_group=1, router_bias=True,
                                  routed_scale=2.5, **common),
            "deepseek_v3": ModelArgs(arch="deepseek_v3", n_kv_heads=4, head_dim=48, ffn_kinds=["dense", "moe"],
                                     dense_dim=64, shared_dim=32, router_score="sigmoid", topk_method="group_top2",
                                     n_group=2, topk_group=1, router_bias=True, routed_scale=2.5, attn_kind="mla",
                                     q_lora_rank=32, kv_lora_rank=32, qk_rope_dim=16, v_head_dim=32,
                                     rope_interleave=True, **common),
            "gpt_oss": ModelArgs(arch="gpt_oss", n_kv_heads=2, head_dim=32, qkv_bias=True, o_bias=True,
                                 attn_sinks=True, layer_windows=[4, 0], router_score="softmax_topk",
                                 router_logit_bias=True, expert_bias=True, expert_act="clamped_swiglu",
                                 swiglu_limit=1.0, norm_topk=False, **common)}[arch]
    tokens = torch.tensor([3, 9, 27, 17, 51, 8, 40])
    monkeypatch.setenv("MOEC_KERNELS", "1")
    monkeypatch.setenv("MOEC_DENSE_GEMV_ROUTER", "1")  # the router too, whatever the shipped config says
    monkeypatch.setenv("MOEC_ROUTER_BLOCK_O", "1")  # in one-row programs
    out = []
    for route in ("0", "1"):
        monkeypatch.setenv("MOEC_DENSE_GEMV", route)
        model = random_model(args, lambda name: None, DEVICE, torch.float32, seed=4)
        cache = dense_cache(args, 1, 32, dtype=torch.float32, device=DEVICE, mode="static")
        eng = DecodeEngine(model, cache, graphs=False, fuse=True)
        routed = [m for m in model.modules() if isinstance(m, _DenseGEMV)] + [
            p for p in eng.qkv + eng.mla_in + eng.shared_gate_up if isinstance(p, _DenseGEMV)]
        assert bool(routed) == (route == "1") and type(model.output) is torch.nn.Linear
        if route == "1":
            assert isinstance(model.layers[1].attn.wo, _DenseGEMV)
            if arch == "gpt_oss":
                assert model.layers[1].attn.wo.bias is not None
            else:
                assert isinstance(model.layers[1].moe.shared.w2, _DenseGEMV)
            assert all(isinstance(p, _DenseGEMV) for p in (eng.mla_in if arch == "deepseek_v3" else eng.qkv))
            assert isinstance(model.layers[1].moe.router, _DenseGEMV)  # the router GEMV before its routing kernel
            assert model.layers[1].moe.router.tiles["block_o"] == 1 and model.layers[1].attn.wo.tiles["block_o"] != 1
            assert (model.layers[1].moe.router.bias is not None) == (arch == "gpt_oss")
        logits = [eng.prefill(0, tokens[:4])]
        linear, seen = torch.nn.functional.linear, []

        def spy(x, w, b=None, seen=seen, linear=linear):  # every weight the steps send to torch's linear (cuBLAS)
            seen.append(w)
            return linear(x, w, b)

        monkeypatch.setattr(torch.nn.functional, "linear", spy)
        import moec.kernels.fused_decode as fd

        silu_mul, activations = fd.silu_mul, []
        monkeypatch.setattr(fd, "silu_mul", lambda gu, a=activations, f=silu_mul: a.append(gu) or f(gu))
        for t in tokens[4:]:
            eng.tokens[:1] = t
            logits.append(eng.step(1)[0].clone())
        monkeypatch.setattr(torch.nn.functional, "linear", linear)
        monkeypatch.setattr(fd, "silu_mul", silu_mul)
        # the shared expert's activation: its own launch on the cuBLAS route, read by the down GEMV on this one
        assert bool(activations) == (route == "0" and arch != "gpt_oss"), len(activations)
        if route == "1":  # the fused projections too (a fused Linear once kept the meta Linear's in_features = 1,
            # so _DenseGEMV sent every token to torch's linear): only the LM head is left to it
            assert seen and all(w is model.output.weight for w in seen), [tuple(w.shape) for w in seen]
        out.append(torch.stack(logits))
    assert torch.allclose(out[0], out[1], rtol=1e-4, atol=1e-4), (out[0] - out[1]).abs().max()


def test_router_rows_override_must_be_a_power_of_two():
    """MOEC_ROUTER_BLOCK_O (and the config's router_block_o): a power of two, else a one-line ValueError naming it
    (a 3 once reached Triton as a non-power-of-two arange, a "x" as int()'s traceback)."""
    from moec.runtime.decode import _power_of_two

    assert _power_of_two("MOEC_ROUTER_BLOCK_O", "1") == 1 and _power_of_two("MOEC_ROUTER_BLOCK_O", 4) == 4
    for bad in ("3", "x", "0", "-2", None):
        with pytest.raises(ValueError, match="MOEC_ROUTER_BLOCK_O=.*power of two"):
            _power_of_two("MOEC_ROUTER_BLOCK_O", bad)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_engine_router_rows_in_the_shared_gate_up(score, monkeypatch):
    """MOEC_ROUTER_IN_SHARED=1 (more experts than route_gemv_topk takes, a shared expert): the router's rows lead the
    shared expert's fused gate/up GEMV, the routing kernels read those logits and the router module is not called
    in the step; the logits equal the step's with the router's own launch (=0), softmax (DeepSeek-V2) and sigmoid
    group (V3) routing, bf16 as the GPU runs it."""
    from moec.runtime.kvcache import dense_cache

    routing = dict(router_score="sigmoid", topk_method="group_top2", n_group=2, topk_group=1, router_bias=True,
                   routed_scale=2.5) if score == "sigmoid" else dict(router_score="softmax", topk_method="greedy")
    args = ModelArgs(arch="deepseek_v3", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=48,
                     max_seq_len=64, n_experts=40, top_k=3, expert_dim=32, ffn_kinds=["dense", "moe"], dense_dim=64,
                     shared_dim=32, attn_kind="mla", q_lora_rank=32, kv_lora_rank=32, qk_rope_dim=16, v_head_dim=32,
                     rope_interleave=True, **routing)
    monkeypatch.setenv("MOEC_KERNELS", "1")
    monkeypatch.setenv("MOEC_DENSE_GEMV", "1")
    tokens = torch.tensor([3, 9, 27, 17, 51, 8, 40])
    out, calls = [], []
    for fold in ("0", "1"):
        monkeypatch.setenv("MOEC_ROUTER_IN_SHARED", fold)
        model = random_model(args, lambda name: None, DEVICE, torch.bfloat16, seed=4)
        eng = DecodeEngine(model, dense_cache(args, 1, 32, dtype=torch.bfloat16, device=DEVICE, mode="static"),
                           graphs=False, fuse=True)
        assert eng.router_folded == ([0, 40] if fold == "1" else [0, 0])
        calls.clear()
        model.layers[1].moe.router.register_forward_hook(lambda *a: calls.append(1))
        logits = [eng.prefill(0, tokens[:4])]
        n_prefill = len(calls)
        for t in tokens[4:]:
            eng.tokens[:1] = t
            logits.append(eng.step(1)[0].clone())
        assert len(calls) - n_prefill == (0 if fold == "1" else 3)
        out.append(torch.stack(logits).float())
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["v3_shared", "softmax_plain", "gpt_oss"])
def test_engine_routes_in_the_router_gemv(case, monkeypatch):
    """MOEC_ROUTE_IN_GEMV=1: the router's decode GEMV routes in its epilogue (qlinear `route`), so no routing kernel
    runs in the step: a sigmoid router of one group folded into the shared expert's gate/up GEMV (GLM-4.5-style
    routing on DeepSeek's layers, MOEC_ROUTER_IN_SHARED=1), a plain softmax router of 40 experts, gpt-oss's biased
    router (softmax over its top-k); the logits equal the step's with the routing kernels (=0)."""
    import moec.kernels.route_topk as rt
    from moec.runtime.kvcache import dense_cache

    common = dict(vocab_size=64, dim=64, n_layers=2, n_heads=4, max_seq_len=64, n_experts=40, top_k=3,
                  expert_dim=32)
    args = {"v3_shared": ModelArgs(arch="deepseek_v3", n_kv_heads=4, head_dim=48, ffn_kinds=["dense", "moe"],
                                   dense_dim=64, shared_dim=32, router_score="sigmoid", topk_method="group_top2",
                                   n_group=2, topk_group=2, router_bias=True, routed_scale=2.5, attn_kind="mla",
                                   q_lora_rank=32, kv_lora_rank=32, qk_rope_dim=16, v_head_dim=32,
                                   rope_interleave=True, **common),
            "softmax_plain": ModelArgs(arch="mixtral", n_kv_heads=2, head_dim=16, **common),
            "gpt_oss": ModelArgs(arch="gpt_oss", n_kv_heads=2, head_dim=32, qkv_bias=True, o_bias=True,
                                 attn_sinks=True, layer_windows=[4, 0], router_score="softmax_topk",
                                 router_logit_bias=True, expert_bias=True, expert_act="clamped_swiglu",
                                 swiglu_limit=1.0, norm_topk=False, **common)}[case]
    monkeypatch.setenv("MOEC_KERNELS", "1")
    monkeypatch.setenv("MOEC_DENSE_GEMV", "1")
    monkeypatch.setenv("MOEC_DENSE_GEMV_ROUTER", "1")
    monkeypatch.setenv("MOEC_ROUTER_IN_SHARED", "1")
    calls = []
    for name in ("route_topk", "route_sigmoid_topk"):
        real = getattr(rt, name)
        monkeypatch.setattr(rt, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    tokens = torch.tensor([3, 9, 27, 17, 51, 8, 40])
    dtype = torch.bfloat16 if case == "v3_shared" else torch.float32
    out = []
    for on in ("0", "1"):
        monkeypatch.setenv("MOEC_ROUTE_IN_GEMV", on)
        model = random_model(args, lambda name: None, DEVICE, dtype, seed=4)
        eng = DecodeEngine(model, dense_cache(args, 1, 32, dtype=dtype, device=DEVICE, mode="static"),
                           graphs=False, fuse=True)
        assert (eng.route_in_shared[1] is not None) == (case == "v3_shared" and on == "1")
        logits = [eng.prefill(0, tokens[:4])]
        calls.clear()
        for t in tokens[4:]:
            eng.tokens[:1] = t
            logits.append(eng.step(1)[0].clone())
        moe_layers = sum(getattr(blk.moe, "kind", None) == "moe" for blk in model.layers)
        assert len(calls) == (0 if on == "1" else 3 * moe_layers), (on, len(calls))
        out.append(torch.stack(logits).float())
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-4)
