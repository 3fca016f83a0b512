"""Fused nuq-outlier decode attention vs its torch reference (TRITON_INTERPRET=1 on the CPU).

Inputs come from the real codec (moec.runtime.kvquant.NUQOutlierCodec), so codes, scales and
outlier residuals have the layout the cache stores. Kernel and reference both compute in fp32 from
the same stored values and differ only in summation order and split-K: tolerance 2e-5 absolute
plus 2e-5 relative on outputs of magnitude ~1 (CPU, exact fp32 dots); 3e-3 on the GPU, where the
dots take tf32 inputs.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.kernels.kv_decode_attention import kv_decode_attention, kv_decode_attention_ref  # noqa: E402
from moec.runtime.config import ModelArgs  # noqa: E402
from moec.runtime.kvquant import FIXED_LEVELS, NUQOutlierCodec  # noqa: E402
from moec.runtime.kvtiered import TieredKVCache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL, RTOL = 2e-5, 2e-5  # exact fp32 dots on the CPU
if DEVICE == "cuda":  # tf32 tensor-core dots (10-bit mantissa) on the GPU
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


CASES = [  # (B, H, K, d, bits, hist lengths, window lengths, outlier frac, n_splits)
    (1, 4, 2, 32, 2, [0], [7], 0.01, None),  # context shorter than the window: no history at all
    (3, 6, 2, 32, 2, [64, 0, 96], [5, 33, 17], 0.01, None),  # batch rows of different lengths, G = 3
    (2, 2, 1, 64, 3, [96, 32], [1, 40], 0.01, 2),  # 3-bit, G = 2, split-K with a ragged last split
    (2, 8, 2, 32, 3, [96, 64], [40, 9], 0.0, 2),  # no outliers
    (1, 3, 1, 32, 2, [128], [13], 0.05, 2),  # many outliers per block
]


@pytest.mark.parametrize("B,H,K,d,bits,hist,win,frac,splits", CASES)
def test_kernel_matches_reference(B, H, K, d, bits, hist, win, frac, splits):
    args = _case(B, H, K, d, bits, hist, win, frac)
    ref = kv_decode_attention_ref(*args, bits=bits, block=32)
    out = kv_decode_attention(*args, bits=bits, block=32, n_splits=splits)
    err = (out - ref).abs()
    assert torch.allclose(out, ref, atol=ATOL, rtol=RTOL), f"max err {err.max().item():.3g} at {err.argmax()}"


def test_reference_sees_outliers():
    """Guard on the oracle itself: dropping the residuals changes the reference output."""
    args = _case(1, 4, 2, 32, 2, [96], [3], 0.02)
    ref = kv_decode_attention_ref(*args, bits=2, block=32)
    args[8] = torch.zeros_like(args[8])  # v residuals
    assert not torch.allclose(kv_decode_attention_ref(*args, bits=2, block=32), ref, atol=1e-3)


def test_bad_input_is_refused():
    args = _case(1, 4, 2, 32, 2, [32], [3])
    args[0] = args[0].half().transpose(0, 1)  # not contiguous
    with pytest.raises(AssertionError):
        kv_decode_attention(*args, bits=2, block=32)


def test_cache_kernel_path_matches_reference_path():
    """TieredKVCache decode steps through the kernel equal the dequantize-then-attend path."""
    args = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32,
                     max_seq_len=256)
    gen = torch.Generator().manual_seed(1)
    lev = torch.tensor(FIXED_LEVELS[2])
    codecs = [NUQOutlierCodec(2, 32, 32, lev, lev, torch.rand(2, 32, generator=gen) + 0.5, 0.01)]
    caches = [TieredKVCache(args, 2, 200, codecs, window=4, sinks=2, device=DEVICE, use_kernel=False)
              for _ in range(2)]
    for t in range(44):
        T = 5 if t == 0 else 1
        if 0 < t < 5:
            continue
        caches[1].use_kernel = t >= 40  # the kernel for the last steps only (the interpreter is slow)
        q, k, v = (torch.randn(2, n, T, 32, generator=gen).to(DEVICE) for n in (4, 2, 2))
        a, b = (c.attend(0, q, k, v, t) for c in caches)
        assert torch.allclose(a, b, atol=max(ATOL, 1e-4), rtol=max(RTOL, 1e-4)), (t, (a - b).abs().max().item())
    assert caches[1].n_blocks[0] == 1  # 44 tokens = 2 sinks + 1 block + 10 in the window
