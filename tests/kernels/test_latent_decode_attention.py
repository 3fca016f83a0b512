"""Latent decode attention kernel vs its torch reference (reconstruct K/V, then softmax), on the CPU under
TRITON_INTERPRET=1 over small odd shapes, and at the Mixtral shape when CUDA is available."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.formats.bitpack import pack_planar  # noqa: E402
from moec.kernels.latent_decode_attention import latent_decode_attention, latent_decode_attention_ref  # noqa: E402

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


def _extras(B, K, d, S, block, layers, layer, n_out, rope, seed=1):
    """Sparse residual entries over a group of `layers` layers (this one at index `layer`), and the RoPE
    table of a pre-RoPE history starting at position 4."""
    g = torch.Generator().manual_seed(seed)
    DG = layers * K * d
    nb = S // block
    kw = {"block": block, "group_dim": DG, "layer_off": layer * K * d}
    for kind in "kv":  # distinct indices per block, large values (the residual is what the latent misses)
        idx = torch.stack([torch.randperm(block * DG, generator=g)[:n_out] for _ in range(B * nb)]).view(B, nb, n_out)
        val = (torch.randn(B, nb, n_out, generator=g) * 3).half()
        kw[f"{kind}_out"] = (idx.to(torch.int16 if block * DG <= 32767 else torch.int32).to(DEV), val.to(DEV))
    if rope:
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        kw["rope"] = (inv.to(DEV), 4)
    return kw


# (B, H, K, d, RK, RV, S, Wc, bits, hist, win, block, layers in group, layer, n_out, rope)
EXTRA_CASES = [
    (2, 4, 2, 32, 16, 24, 64, 5, 4, [61, 9], [5, 2], 8, 2, 1, 12, False),  # 4 blocks per tile, second layer
    (1, 6, 3, 32, 16, 16, 96, 3, 2, [96], [3], 32, 1, 0, 40, False),  # block == tile, 2-bit
    (2, 4, 1, 32, 24, 16, 128, 4, 4, [128, 70], [4, 1], 64, 3, 2, 30, False),  # block = 2 tiles, MQA
    (2, 4, 2, 32, 16, 24, 64, 5, 4, [61, 9], [5, 2], 8, 2, 0, 12, True),  # pre-RoPE, residual
    (1, 8, 2, 64, 32, 16, 96, 7, 16, [90], [7], 32, 1, 0, 25, True),  # pre-RoPE, fp16 latent, G = 4
    (3, 4, 2, 32, 16, 16, 64, 4, 2, [0, 64, 33], [4, 1, 2], 16, 1, 0, 0, True),  # pre-RoPE, no residual
    (1, 9, 3, 64, 64, 128, 64, 5, 4, [64], [5], 32, 2, 1, 62, True),  # SmolLM2 shape (G = 3), kv-latent-layer-g2
]


@pytest.mark.parametrize("tile", [32, 64])
@pytest.mark.parametrize("case", EXTRA_CASES)
def test_kernel_residual_and_rope(case, tile):
    """Sparse fp16 residual (only this layer's rows of the group, only the blocks of the history) and
    pre-RoPE keys rebuilt and rotated in the kernel, against the reconstruct-rotate-softmax reference."""
    *base, block, layers, layer, n_out, rope = case
    args = _case(*base)
    B, K, d, S = base[0], base[2], base[3], base[6]
    kw = _extras(B, K, d, S, block, layers, layer, n_out, rope)
    if not n_out:
        kw.pop("k_out"), kw.pop("v_out")
    out = latent_decode_attention(*args, splits=2 if B == 1 else None, config={"block": tile, "rank_chunk": 16},
                                  **kw)  # rank_chunk 16: the pre-RoPE rebuild runs over 1-2 chunks
    ref = latent_decode_attention_ref(*args, **kw)
    plain = latent_decode_attention_ref(*args, rope=kw.get("rope"))
    tol = 1e-4 if DEV == "cpu" else 3e-3
    err = (out - ref).abs().max().item()
    assert torch.isfinite(out).all() and err < tol * max(1.0, ref.abs().max().item()), err
    if n_out:  # the residual changes the result, so the check above is not vacuous
        assert (plain - ref).abs().max().item() > 20 * tol


@pytest.mark.skipif(DEV != "cuda", reason="full size on the GPU only")
@pytest.mark.parametrize("rope", [False, True])
def test_kernel_full_size_residual(rope):
    B, S, K, d = 4, 4096, 8, 128
    args = _case(B, 32, 8, 128, 256, 256, S, 160, 4, [S, 1000, 33, 0], [160, 130, 7, 1])
    kw = _extras(B, K, d, S, 32, 1, 0, 164, rope)
    out = latent_decode_attention(*args, **kw)
    ref = latent_decode_attention_ref(*args, **kw)
    assert (out - ref).abs().max().item() < 5e-3 * max(1.0, ref.abs().max().item())


@pytest.mark.skipif(DEV != "cuda", reason="full size on the GPU only")
@pytest.mark.parametrize("bits", [4, 16])
def test_kernel_full_size(bits):
    B, S = 4, 4096
    args = _case(B, 32, 8, 128, 256, 256, S, 160, bits, [S, 1000, 33, 0], [160, 130, 7, 1])
    out = latent_decode_attention(*args)
    ref = latent_decode_attention_ref(*args)
    assert (out - ref).abs().max().item() < 3e-3 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("rope_pre,frac", [(False, 0.0), (False, 0.05), (True, 0.05)])
def test_cache_decode_through_kernel(rope_pre, frac):
    """A LatentKVCache whose decode steps go through the kernel equals its torch path: post- and pre-RoPE
    keys, with and without the sparse residual, on a cross-layer group and a single layer."""
    from moec.runtime.config import ModelArgs
    from moec.runtime.latent import LatentCodec, LatentKVCache
    from tests.runtime.test_latent import _orth

    args = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32,
                     max_seq_len=64)
    bits, groups, S = 4, [[0, 1], [2]], 25  # the interpreter is slow: ~20 decode steps × 3 layers
    K, d = args.n_kv_heads, args.head_dim
    codecs = [{kind: LatentCodec(_orth(len(ls) * K * d, 16, g), torch.randn(len(ls) * K * d) * 0.1,
                                 torch.full((16,), 3.0), bits, 8, frac, DEV) for kind in "kv"}
              for g, ls in enumerate(groups)]
    gen = torch.Generator().manual_seed(1)
    q, k, v = ([torch.randn(2, n, S, d, generator=gen).to(DEV) * sc for _ in range(3)]
               for n, sc in ((4, 1), (K, 2), (K, 1)))
    outs = []
    for use_kernel in (False, True):
        c = LatentKVCache(args, 2, S, groups, codecs, window=4, sinks=2, block=8, rope_pre=rope_pre, device=DEV,
                          use_kernel=use_kernel)
        per_layer = [[] for _ in range(3)]
        for t in range(S):  # a prefill of 5 tokens, then one token per call
            if 0 < t < 5:
                continue
            n = 5 if t == 0 else 1
            for i in range(3):
                per_layer[i].append(c.attend(i, q[i][:, :, t : t + n], k[i][:, :, t : t + n], v[i][:, :, t : t + n], t))
        outs.append([torch.cat(o, 2) for o in per_layer])
        assert c.n_blocks[0] == 2
    for a, b in zip(*outs, strict=True):
        assert (a - b).abs().max().item() < (1e-4 if DEV == "cpu" else 3e-3)



@pytest.mark.parametrize("case", ["post", "post-kv", "post-k", "pre-kv"])
def test_kernels_compile_for_h200(case):
    """The history kernels at the Mixtral shape with the launch config, compiled for the H200's sm_90
    (tests/kernels/compile_sm90.py, in a process without TRITON_INTERPRET). A residual-mask pattern once
    crashed Triton's layout pass there while the interpreter ran it fine."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tests.kernels.compile_sm90", case], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, (r.stdout[-500:], r.stderr[-2000:])
