"""Triton quantize-and-pack of a KV block vs NUQOutlierCodec.encode (TRITON_INTERPRET=1 on the CPU).

Away from ties the kernel must reproduce the codec bit for bit: same codes, value scales, outlier
indices (both ascending) and residuals (both x − level·scale in fp32, rounded to fp16). With tied
magnitudes at the selection threshold the two may keep different (equally large) elements; then
the kernel's selection must still be a valid top-n_out and its residual-corrected decode must
give back x at every kept element to fp16 precision.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.kernels.kv_quantize_pack import kv_quantize_pack  # noqa: E402
from moec.runtime.config import ModelArgs  # noqa: E402
from moec.runtime.kvtiered import TieredKVCache  # noqa: E402
from moec.runtime.nuq import FIXED_LEVELS, NUQCenteredCodec, NUQOutlierCodec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _codec(bits, K, d, block, frac, gen, fitted=True, centered=False):
    lev = torch.tensor(FIXED_LEVELS[bits])
    if fitted:  # non-uniform, asymmetric levels (as k-means would give)
        lev = torch.sign(lev) * lev.abs() ** 1.5 + 0.03
    scale = torch.rand(K, d, generator=gen) + 0.25
    if centered:  # key centers off zero and query-RMS weights (recipe k_center + outlier_select weighted-error)
        return NUQCenteredCodec(bits, d, block, lev, lev.flip(0) * -0.9, scale, frac,
                                torch.randn(K, d, generator=gen), torch.rand(K, d, generator=gen) + 0.1)
    return NUQOutlierCodec(bits, d, block, lev, lev.flip(0) * -0.9, scale, frac)


@pytest.mark.parametrize("B,K,d,block,bits,frac,dtype,centered", [
    (2, 3, 64, 32, 2, 0.01, torch.float16, False),
    (1, 2, 128, 32, 3, 0.01, torch.float16, False),
    (3, 1, 64, 16, 2, 0.05, torch.float32, False),  # fp32 input (pre-RoPE keys are un-rotated in fp32)
    (1, 2, 64, 32, 3, 0.0, torch.float16, False),  # no outliers
    (2, 2, 64, 32, 2, 0.008, torch.float32, True),  # NUQCenteredCodec: centers, query-weighted key outliers
    (1, 2, 64, 16, 3, 0.0, torch.float16, True),
])
def test_matches_codec(B, K, d, block, bits, frac, dtype, centered):
    gen = torch.Generator().manual_seed(bits * 7 + d)
    codec = _codec(bits, K, d, block, frac, gen, centered=centered)
    x = torch.randn(B, K, block, d, generator=gen) * codec.k_scale[None, :, None, :]
    if centered:
        x = x + codec.k_center[None, :, None, :]
    x[..., 5] *= 8  # an outlier channel
    x = x.to(dtype).to(DEVICE)
    for kind in "kv":
        ref = codec.encode(x.float(), kind)  # the reference: the codec's own torch encode, in fp32
        out = kv_quantize_pack(x, kind, codec.kernel_view(x.device))
        assert set(out) == set(ref), (sorted(out), sorted(ref))
        for name in ref:
            assert out[name].dtype == ref[name].dtype and out[name].shape == ref[name].shape, name
            assert torch.equal(out[name], ref[name]), (kind, name, (out[name].float() - ref[name].float()).abs().max())


def test_ties_give_a_valid_top_k():
    """Many equal magnitudes at the threshold: any n_out of them is a correct choice."""
    gen = torch.Generator().manual_seed(3)
    codec = _codec(2, 2, 64, 32, 0.02, gen, fitted=False)  # n_out = 41
    x = torch.sign(torch.randn(1, 2, 32, 64, generator=gen)) * 0.5
    x.view(1, 2, -1)[:, :, ::97] = 3.0  # 22 clear outliers, then ties at 0.5 for the remaining 19
    x = x.half().to(DEVICE)
    out = kv_quantize_pack(x, "v", codec.kernel_view(x.device))
    idx = out["out_idx"].long().view(1, 2, -1)
    mag = x.float().abs().view(1, 2, -1)
    assert (idx[..., 1:] > idx[..., :-1]).all()  # ascending, no repeats
    kept = torch.zeros_like(mag, dtype=torch.bool).scatter(-1, idx, True)
    assert (mag[kept].view(1, 2, -1).amin(-1) >= mag.masked_fill(kept, 0).amax(-1)).all()
    y = codec.decode({n: t.cpu() for n, t in out.items()}, "v").view(1, 2, -1)  # residual-corrected
    xs = x.float().cpu().view(1, 2, -1)
    assert torch.allclose(y.gather(-1, idx.cpu()), xs.gather(-1, idx.cpu()), rtol=1e-3, atol=0)
    ref = codec.encode(x.float(), "v")
    assert torch.equal(out["codes"], ref["codes"]) and torch.equal(out["scale"], ref["scale"])


@pytest.mark.skipif(DEVICE != "cuda", reason="the cache uses the kernel on CUDA only")
def test_cache_encodes_with_the_kernel():
    """TieredKVCache on CUDA stores what the codec would store."""
    args = ModelArgs(arch="llama", vocab_size=8, dim=128, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64,
                     max_seq_len=256)
    gen = torch.Generator().manual_seed(2)
    codecs = [_codec(2, 2, 64, 32, 0.01, gen)]
    cache = TieredKVCache(args, 2, 200, codecs, window=8, sinks=2, device=DEVICE)
    k = torch.randn(2, 2, 60, 64, generator=gen).half().to(DEVICE)
    v = torch.randn(2, 2, 60, 64, generator=gen).half().to(DEVICE)
    q = torch.randn(2, 4, 60, 64, generator=gen).half().to(DEVICE)
    cache.attend(0, q, k, v, 0)
    assert cache.n_blocks[0] == 1
    for kind, x in (("k", k), ("v", v)):
        ref = codecs[0].encode(x[:, :, 2:34].float(), kind)
        got = cache.history_fields(0, kind)
        for name in ref:
            assert torch.equal(got[name], ref[name]), (kind, name)
