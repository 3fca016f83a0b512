"""Latent decode attention kernel vs its torch reference (reconstruct K/V, then softmax), on the CPU under
TRITON_INTERPRET=1 over small odd shapes, and at the Mixtral shape when CUDA is available."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.kernels.latent_decode_attention import latent_decode_attention, latent_decode_attention_ref  # noqa: E402
from moec.runtime.kvlatent import pack_planar  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(B, H, K, d, RK, RV, S, Wc, bits, hist, win, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=g)

    u_k, u_v = rnd(K, d, RK) / RK**0.5, rnd(K, d, RV) / RV**0.5
    mean_k, mean_v = rnd(K, d), rnd(K, d) * 0.1
    if bits == 16:
        ck, cv = (rnd(B, S, RK) * 2).half(), rnd(B, S, RV).half()
        sk, sv = torch.ones(RK), torch.ones(RV)
    else:
        n = 2**bits
        ck = pack_planar(torch.randint(0, n, (B, S, RK), generator=g), bits)
        cv = pack_planar(torch.randint(0, n, (B, S, RV), generator=g), bits)
        sk, sv = torch.rand(RK, generator=g) + 0.2, torch.rand(RV, generator=g) + 0.2
    wk, wv = rnd(B, K, Wc, d).half(), rnd(B, K, Wc, d).half()
    q = rnd(B, H, d)
    args = [q, ck, cv, u_k, mean_k, sk, u_v, mean_v, sv, bits, torch.tensor(hist, dtype=torch.int32), wk, wv,
            torch.tensor(win, dtype=torch.int32)]
    return [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]


# (B, H, K, d, RK, RV, S capacity, window capacity, bits, hist lengths, window lengths)
CASES = [
    (1, 4, 2, 16, 16, 24, 40, 7, 4, [37], [5]),  # odd lengths, RV not a power of 2
    (2, 6, 3, 16, 24, 16, 64, 40, 2, [64, 3], [33, 1]),  # batch rows of different lengths, window > tile
    (3, 8, 2, 32, 16, 32, 96, 16, 16, [0, 95, 50], [9, 16, 2]),  # no history at all in one row, fp16 latent
    (1, 4, 1, 16, 8, 8, 70, 3, 4, [70], [3]),  # one KV head (MQA), 3 splits forced below
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case):
    args = _case(*case)
    splits = 3 if case[0] == 1 else None
    out = latent_decode_attention(*args, splits=splits)
    ref = latent_decode_attention_ref(*args)
    # fp32 in the interpreter ("ieee" dots): only summation order differs; tf32 on the GPU
    tol = 1e-4 if DEV == "cpu" else 3e-3
    err = (out - ref).abs().max().item()
    assert torch.isfinite(out).all() and err < tol * max(1.0, ref.abs().max().item()), err


@pytest.mark.skipif(DEV != "cuda", reason="full size on the GPU only")
@pytest.mark.parametrize("bits", [4, 16])
def test_kernel_full_size(bits):
    B, S = 4, 4096
    args = _case(B, 32, 8, 128, 256, 256, S, 160, bits, [S, 1000, 33, 0], [160, 130, 7, 1])
    out = latent_decode_attention(*args)
    ref = latent_decode_attention_ref(*args)
    assert (out - ref).abs().max().item() < 3e-3 * max(1.0, ref.abs().max().item())


def test_cache_decode_through_kernel():
    """A post-RoPE LatentKVCache whose decode steps go through the kernel equals the torch path."""
    from moec.runtime.kvlatent import LatentCodec, LatentKVCache
    from tests.runtime.test_kvlatent import ARGS, _orth, _qkv, _run

    bits, groups = 4, [[0, 1], [2]]  # the interpreter is slow: one small case, ~20 decode steps × 3 layers
    K, d = ARGS.n_kv_heads, ARGS.head_dim
    codecs = [{kind: LatentCodec(_orth(len(ls) * K * d, 16, g), torch.randn(len(ls) * K * d) * 0.1,
                                 torch.full((16,), 3.0), bits, 8, 0.0, DEV) for kind in "kv"}
              for g, ls in enumerate(groups)]
    q, k, v = ([t.to(DEV) for t in ts] for ts in _qkv(S=25))
    outs = []
    for use_kernel in (False, True):
        c = LatentKVCache(ARGS, 2, 25, groups, codecs, window=4, sinks=2, block=8, device=DEV, use_kernel=use_kernel)
        outs.append(_run(c, q, k, v, 1))
        assert c.n_blocks[0] == 2
    for a, b in zip(*outs, strict=True):
        assert (a - b).abs().max().item() < (1e-4 if DEV == "cpu" else 3e-3)
