"""Fused nuq-outlier decode attention vs its torch reference (TRITON_INTERPRET=1 on the CPU).

Inputs come from the real codec (moec.runtime.nuq.NUQOutlierCodec), so codes, scales and
outlier residuals have the layout the cache stores. On the CPU the kernel's dots take exact fp32
inputs, so kernel and reference differ only in summation order and split-K: tolerance 2e-5
absolute plus 2e-5 relative on outputs of magnitude ~1-10. On the GPU the dots take fp16 inputs
(q·k_scale, levels, p; fp32 accumulation): ~5e-4 relative per product, so outputs are checked to
3e-3 of the output scale, and a full-size Mixtral-shaped grid runs too.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.kernels.kv_decode_attention import kv_decode_attention, kv_decode_attention_ref  # noqa: E402
from moec.runtime.config import ModelArgs  # noqa: E402
from moec.runtime.kvtiered import TieredKVCache  # noqa: E402
from moec.runtime.nuq import FIXED_LEVELS, NUQCenteredCodec, NUQOutlierCodec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL, RTOL = 2e-5, 2e-5  # exact fp32 dots on the CPU
if DEVICE == "cuda":  # fp16 tensor-core dot inputs (10-bit mantissa) on the GPU
    ATOL, RTOL = 3e-3, 3e-3


def _case(B, H, K, d, bits, hist, win, frac=0.01, block=32, seed=0):
    """Random packed history (capacity max(hist) rounded up, at least one block) + fp16 windows."""
    gen = torch.Generator().manual_seed(seed)
    S = max(block, -(-max(hist) // block) * block)
    k_scale = torch.rand(K, d, generator=gen) + 0.5
    lev = torch.tensor(FIXED_LEVELS[bits]) * 0.9
    codec = NUQOutlierCodec(bits, d, block, lev, lev.flip(0) * -1.1 + 0.01, k_scale, frac)
    fields = {"k": [], "v": []}
    for _ in range(S // block):
        x = torch.randn(B, K, block, d, generator=gen) * k_scale[None, :, None, :]
        x[..., 3] *= 6  # an outlier channel
        for kind in "kv":
            fields[kind].append(codec.encode(x if kind == "k" else x.flip(-1), kind))
    cat = {kind: {n: torch.cat([f[n] for f in fields[kind]], 2) for n in fields[kind][0]} for kind in "kv"}
    Wc = max(max(win), 1)
    win_k = torch.randn(B, K, Wc, d, generator=gen).half()
    win_v = torch.randn(B, K, Wc, d, generator=gen).half()
    q = torch.randn(B, H, d, generator=gen)
    nb = S // block
    if codec.n_out:
        oi = (cat["k"]["out_idx"], cat["k"]["out_val"], cat["v"]["out_idx"], cat["v"]["out_val"])
    else:
        oi = (torch.zeros(B, K, nb, 0, dtype=torch.int16), torch.zeros(B, K, nb, 0).half()) * 2
    args = (q, cat["k"]["codes"], cat["v"]["codes"], k_scale, cat["v"]["scale"], codec.levels["k"],
            codec.levels["v"], *oi, torch.tensor(hist, dtype=torch.int32), win_k, win_v,
            torch.tensor(win, dtype=torch.int32))
    return [a.to(DEVICE).contiguous() for a in args]


CASES = [  # (B, H, K, d, bits, hist lengths, window lengths, outlier frac, n_splits, block_t, out_mode)
    (1, 4, 2, 64, 2, [0], [7], 0.01, None, None, None),  # context shorter than the window: no history at all
    (3, 6, 2, 64, 2, [64, 0, 96], [5, 33, 17], 0.01, None, 64, 2),  # ragged rows, G = 3, 2-block tiles
    (2, 2, 1, 64, 3, [96, 32], [1, 40], 0.01, 2, None, 0),  # 3-bit, G = 2, split-K with a ragged last split
    (2, 8, 2, 64, 3, [160, 64], [40, 9], 0.0, 2, 64, None),  # no outliers, tiles straddling the history end
    (1, 3, 1, 64, 2, [128], [13], 0.05, 2, None, 1),  # many outliers per block
    (2, 8, 2, 64, 2, [64, 32], [150, 70], 0.0, None, None, None),  # window in 3 chunks, the last one empty in row 2
]


@pytest.mark.parametrize("B,H,K,d,bits,hist,win,frac,splits,block_t,out_mode", CASES)
def test_kernel_matches_reference(B, H, K, d, bits, hist, win, frac, splits, block_t, out_mode):
    args = _case(B, H, K, d, bits, hist, win, frac)
    ref = kv_decode_attention_ref(*args, bits=bits, block=32)
    out = kv_decode_attention(*args, bits=bits, block=32, n_splits=splits, block_t=block_t, out_mode=out_mode)
    _close(out, ref)


def _close(out, ref):
    scale = 1.0 if DEVICE == "cpu" else ref.abs().max().item()
    err = (out - ref).abs()
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, atol=ATOL * scale, rtol=RTOL), f"max err {err.max().item():.3g} at {err.argmax()}"


@pytest.mark.skipif(DEVICE != "cuda", reason="full-size grid on the GPU only")
@pytest.mark.parametrize("bits,block_t,lazy,deq,frac,out_mode", [
    (2, 64, True, 1, 0.01, 1), (2, 128, False, 1, 0.01, 0), (2, 32, True, 0, 0.01, 2), (2, 64, True, 1, 0.0, 0),
    (2, 128, True, 1, 0.03, 2), (3, 64, True, 0, 0.01, 1)])
def test_full_size_cuda(bits, block_t, lazy, deq, frac, out_mode):
    """Mixtral attention shape (32 q heads, 8 KV heads, d 128), ragged 2k-8k histories, every launch knob."""
    args = _case(3, 32, 8, 128, bits, [8192, 2080, 4096], [148, 1, 37], frac, seed=bits)
    ref = kv_decode_attention_ref(*args, bits=bits, block=32)
    out = kv_decode_attention(*args, bits=bits, block=32, block_t=block_t, lazy=lazy, deq=deq, out_mode=out_mode)
    _close(out, ref)


def _inv_freq(d, theta=10000.0):
    return (1.0 / theta ** (torch.arange(0, d, 2).float() / d)).to(DEVICE)


@pytest.mark.parametrize("out_mode", [1, 0])
def test_pre_rope_keys(out_mode):
    """Pre-RoPE history keys rotated in the kernel at positions pos0 + t (large positions, outliers)."""
    args = _case(2, 8, 2, 64, 2, [96, 64], [40, 9], 0.03)
    rope = (_inv_freq(64), 20011)
    ref = kv_decode_attention_ref(*args, bits=2, block=32, rope=rope)
    assert not torch.allclose(ref, kv_decode_attention_ref(*args, bits=2, block=32), atol=1e-2)  # it rotates
    _close(kv_decode_attention(*args, bits=2, block=32, n_splits=2, out_mode=out_mode, rope=rope), ref)


@pytest.mark.parametrize("pre_rope", [False, True])
def test_key_center(pre_rope):
    """Asymmetric keys (nuq.NUQCenteredCodec): k = center + level·scale, before the rotation when
    pre-RoPE; post-RoPE the kernel adds q·center to every history score."""
    args = _case(2, 8, 2, 64, 2, [96, 64], [40, 9], 0.01, seed=4)
    center = (torch.randn(2, 64) * 2).to(DEVICE)
    rope = (_inv_freq(64), 4) if pre_rope else None
    ref = kv_decode_attention_ref(*args, bits=2, block=32, rope=rope, k_center=center)
    assert not torch.allclose(ref, kv_decode_attention_ref(*args, bits=2, block=32, rope=rope), atol=1e-2)
    _close(kv_decode_attention(*args, bits=2, block=32, n_splits=2, rope=rope, k_center=center), ref)


@pytest.mark.parametrize("pre_rope,center", [(False, True), (True, True), (False, False)])
def test_score_bias(pre_rope, center):
    """nuq `score_bias`: every history score (not the window's) gets Σ q²·k_err2·sm_scale²/2 per query head."""
    args = _case(2, 8, 2, 64, 2, [96, 64], [40, 9], 0.01, seed=5)
    err2 = (torch.rand(2, 64) * 0.5).to(DEVICE)
    kw = {"rope": (_inv_freq(64), 4) if pre_rope else None,
          "k_center": (torch.randn(2, 64) * 0.5).to(DEVICE) if center else None}
    ref = kv_decode_attention_ref(*args, bits=2, block=32, k_err2=err2, **kw)
    assert not torch.allclose(ref, kv_decode_attention_ref(*args, bits=2, block=32, **kw), atol=1e-2)
    _close(kv_decode_attention(*args, bits=2, block=32, n_splits=2, k_err2=err2, **kw), ref)


@pytest.mark.skipif(DEVICE != "cuda", reason="full-size grid on the GPU only")
@pytest.mark.parametrize("center", [False, True])
def test_full_size_cuda_pre_rope(center):
    args = _case(2, 32, 8, 128, 2, [8192, 2080], [148, 37], 0.01, seed=5)
    rope = (_inv_freq(128, 1e6), 4)
    kc = torch.randn(8, 128, device=DEVICE) if center else None
    ref = kv_decode_attention_ref(*args, bits=2, block=32, rope=rope, k_center=kc)
    _close(kv_decode_attention(*args, bits=2, block=32, rope=rope, k_center=kc), ref)
    if center:  # post-RoPE centered keys too
        ref = kv_decode_attention_ref(*args, bits=2, block=32, k_center=kc)
        _close(kv_decode_attention(*args, bits=2, block=32, k_center=kc), ref)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_output_rotation_in_the_combine(out_dtype):
    """out_rotation R: the split combine returns out·Rᵀ in out_dtype (the rotated cache's way back)."""
    from moec.rotation import block_hadamard

    args = _case(2, 8, 2, 64, 2, [96, 64], [40, 9], 0.0, seed=7)
    R = block_hadamard(64, seed=3).float().to(DEVICE)
    ref = kv_decode_attention_ref(*args, bits=2, block=32) @ R.T
    got = kv_decode_attention(*args, bits=2, block=32, n_splits=3, out_rotation=R, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    if out_dtype == torch.float32:
        _close(got, ref)
    else:  # one bf16 rounding of the output
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("center,bias,rot", [(True, True, False), (True, False, True), (False, True, False)])
def test_combine_adds_the_history_score_terms(center, bias, rot):
    """combine_splits' hist_terms (the Gluon kernels' partials): the first n_hist splits' m gain
    qscale·(q·center) + bscale·(q²·err2) of their KV head; the result equals combining partials whose m already
    carry those terms (what every program added for itself before). Empty splits (m = -inf) stay empty."""
    from moec.kernels.kv_decode_attention import combine_splits

    g = torch.Generator().manual_seed(5)
    B, HQ, K, d, P, n_hist = 2, 8, 2, 64, 7, 5
    G = HQ // K
    part = torch.randn(B * HQ, P, d + 2, generator=g)
    part[..., d + 1] = torch.rand(B * HQ, P, generator=g) + 0.5  # l > 0
    part[3, 2, d] = float("-inf")  # an empty history split
    part[3, 2, : d] = 0
    part[3, 2, d + 1] = 0
    q = torch.randn(B, HQ, d, generator=g)
    kc = torch.randn(K, d, generator=g) if center else None
    ke = torch.rand(K, d, generator=g) * 0.1 if bias else None
    qscale, bscale = 0.18, 0.011
    qc = torch.zeros(B * HQ)
    kh = (torch.arange(B * HQ) % HQ) // G
    qf = q.reshape(B * HQ, d)
    if center:
        qc += qscale * (qf * kc[kh]).sum(-1)
    if bias:
        qc += bscale * (qf * qf * ke[kh]).sum(-1)
    shifted = part.clone()
    shifted[:, :n_hist, d] += qc[:, None]
    R = torch.linalg.qr(torch.randn(d, d, generator=g))[0].contiguous() if rot else None
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    want = combine_splits(dev(shifted), B * HQ, P, d, dev(R))
    got = combine_splits(dev(part), B * HQ, P, d, dev(R), hist_terms=dict(
        q=dev(q), k_center=dev(kc), k_err2=dev(ke), n_hist=n_hist, HQ=HQ, G=G, qscale=qscale, bscale=bscale))
    assert not torch.allclose(want, combine_splits(dev(part), B * HQ, P, d, dev(R)), atol=1e-3)  # the terms matter
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_sees_outliers():
    """Guard on the oracle itself: dropping the residuals changes the reference output."""
    args = _case(1, 4, 2, 64, 2, [96], [3], 0.02)
    ref = kv_decode_attention_ref(*args, bits=2, block=32)
    args[8] = torch.zeros_like(args[8])  # v residuals
    assert not torch.allclose(kv_decode_attention_ref(*args, bits=2, block=32), ref, atol=1e-3)


def test_bad_input_is_refused():
    args = _case(1, 4, 2, 64, 2, [32], [3])
    args[0] = args[0].half().transpose(0, 1)  # not contiguous
    with pytest.raises(AssertionError):
        kv_decode_attention(*args, bits=2, block=32)


@pytest.mark.parametrize("rope_pre,centered", [(False, False), (True, False), (True, True)])
def test_cache_kernel_path_matches_reference_path(rope_pre, centered):
    """TieredKVCache decode steps through the kernel equal the dequantize-then-attend path (pre-RoPE
    keys: rotated in the kernel at their positions; centered: the recipe's NUQCenteredCodec)."""
    args = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64,
                     max_seq_len=256)
    gen = torch.Generator().manual_seed(1)
    lev = torch.tensor(FIXED_LEVELS[2])
    scale = torch.rand(2, 64, generator=gen) + 0.5
    codecs = [NUQCenteredCodec(2, 64, 32, lev, lev, scale, 0.01, torch.randn(2, 64, generator=gen),
                               torch.rand(2, 64, generator=gen)) if centered
              else NUQOutlierCodec(2, 64, 32, lev, lev, scale, 0.01)]
    caches = [TieredKVCache(args, 2, 200, codecs, window=4, sinks=2, device=DEVICE, use_kernel=False,
                            rope_pre=rope_pre) for _ in range(2)]
    for t in range(44):
        T = 5 if t == 0 else 1
        if 0 < t < 5:
            continue
        caches[1].use_kernel = t >= 42  # the kernel for the last steps only (the interpreter is slow)
        q, k, v = (torch.randn(2, n, T, 64, generator=gen).to(DEVICE) for n in (4, 2, 2))
        a, b = (c.attend(0, q, k, v, t) for c in caches)
        assert torch.allclose(a, b, atol=max(ATOL, 1e-4), rtol=max(RTOL, 1e-4)), (t, (a - b).abs().max().item())
    assert caches[1].n_blocks[0] == 1  # 44 tokens = 2 sinks + 1 block + 10 in the window


def test_static_engine_kernel_path_matches_mirror_path():
    """The CUDA-graph engine's TieredKVCache (static mode) through the fused kernel (pre-RoPE, centered keys: the
    recipe's codec) gives the ppl_dec of its dequantized-mirror torch path."""
    from moec.runtime.decode import evaluate_dec
    from moec.runtime.latency import random_model

    args = ModelArgs(arch="llama", vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64,
                     max_seq_len=128, dense_dim=96)
    model = random_model(args, lambda name: None, DEVICE, torch.float32, seed=1)
    gen = torch.Generator().manual_seed(3)
    lev = torch.tensor(FIXED_LEVELS[2])
    codecs = [NUQCenteredCodec(2, 64, 16, lev, lev * 0.8, torch.rand(2, 64, generator=gen) + 0.5, 0.01,
                               torch.randn(2, 64, generator=gen), torch.rand(2, 64, generator=gen))]
    windows = torch.randint(0, 64, (1, 56), generator=gen)  # 2 history blocks by the end
    res = [evaluate_dec(model, windows, lambda B, n, k=kern: TieredKVCache(
        args, B, n, codecs, window=4, sinks=2, block=16, rope_pre=True, device=DEVICE, use_kernel=k, mode="static"),
        batch_size=1)
        for kern in (False, True)]
    assert abs(res[1]["ppl"] / res[0]["ppl"] - 1) < (1e-5 if DEVICE == "cpu" else 1e-3), res
