"""KV codecs (packing, KIVI, NUQ-outlier) and the tiered cache, on the CPU in fp32."""

import math

import pytest
import torch

from moec.formats.bitpack import pack_planar, unpack_planar
from moec.runtime.config import ModelArgs
from moec.runtime.kivi import KIVICodec
from moec.runtime.kvcache import FP16Cache, causal_attention
from moec.runtime.kvtiered import TieredKVCache
from moec.runtime.nuq import FIXED_LEVELS, NUQOutlierCodec

ARGS = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                 max_seq_len=512)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 7, 64))
    packed = pack_planar(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack_planar(packed, bits, 64), codes)


def test_pack_layout():
    # planar: byte i holds channels i, i + n/4, i + n/2, i + 3n/4 (2-bit) / i, i + n/2 (4-bit)
    assert pack_planar(torch.tensor([1, 2, 3, 0]), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    two = pack_planar(torch.tensor([1, 0, 2, 3, 3, 1, 0, 2]), 2).tolist()
    assert two == [1 | 2 << 2 | 3 << 4, 3 << 2 | 1 << 4 | 2 << 6]
    assert pack_planar(torch.tensor([5, 9, 15, 2]), 4).tolist() == [5 | 15 << 4, 9 | 2 << 4]
    # 3-bit: 2-bit layout of code & 3, then a bit plane of the high bit, byte n/4 + i <- channels i + m·n/8
    codes = torch.arange(16) % 8  # high bit set on channels 4..7 and 12..15
    low = pack_planar(codes & 3, 2).tolist()
    assert pack_planar(codes, 3).tolist() == low + [0b11001100, 0b11001100]  # byte i: channels i + 2m


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kivi_error_bound(bits):
    x = torch.randn(2, 3, 32, 64) * torch.linspace(0.1, 5, 64)
    codec = KIVICodec(bits, 64, 32)
    for kind in "kv":
        f = codec.encode(x, kind)
        y = codec.decode(f, kind)
        scale = f["scale"].float()
        scale = scale.expand(2, 3, 32, 64) if kind == "k" else scale.repeat_interleave(32, -1)
        # round to nearest: half a step, plus fp16 rounding of zero point and scale (~1e-3 relative)
        assert ((y - x).abs() <= 0.5 * scale + 2e-3 * x.abs().amax()).all(), kind


@pytest.mark.parametrize("bits", [2, 3])
def test_nuq_outliers_exact_and_core_bounded(bits):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 64)
    x[..., 5] *= 20  # an outlier channel
    k_scale = x.abs().amax(dim=(0, 2)) / 4  # most of channel 5 lies beyond its scale
    lev = torch.tensor(FIXED_LEVELS[bits])
    codec = NUQOutlierCodec(bits, 64, 32, lev, lev, k_scale, 0.01)
    assert codec.n_out == math.ceil(0.01 * 32 * 64)
    gap = (lev[1:] - lev[:-1]).max().item() / 2
    for kind in "kv":
        f = codec.encode(x, kind)
        y = codec.decode(f, kind)
        flat_x, flat_y = x.reshape(2, 3, -1), y.reshape(2, 3, -1)
        idx = f["out_idx"][:, :, 0].long()
        xo, yo = flat_x.gather(-1, idx), flat_y.gather(-1, idx)
        assert torch.allclose(yo, xo, rtol=1e-3, atol=1e-3), kind  # outliers kept to fp16 precision
        scale = k_scale[None, :, None, :] if kind == "k" else f["scale"].float()[..., None]
        xn = x / scale
        inside = (xn.abs() <= 1).reshape(2, 3, -1).scatter(-1, idx, False).view_as(x)
        err = ((y - x).abs() / scale)[inside]
        assert err.max() <= gap + 1e-3, (kind, err.max().item())


def _codecs(kind, bits=2):
    lev = torch.tensor(FIXED_LEVELS[bits])
    if kind == "kivi":
        return [KIVICodec(bits, 32, 32) for _ in range(2)]
    return [NUQOutlierCodec(bits, 32, 32, lev, lev, torch.full((2, 32), 2.0), 0.01) for _ in range(2)]


def _run(cache, steps, gen, prefill=20, dense=None):
    outs = []
    for t in [0, *range(prefill, steps)]:
        T = prefill if t == 0 else 1
        q, k, v = (torch.randn(2, n, T, 32, generator=gen) for n in (4, 2, 2))
        for layer in range(2):
            o = cache.attend(layer, q, k, v, t)
            outs.append((o, dense.attend(layer, q, k, v, t) if dense is not None else None))
    return outs


def test_window_only_equals_dense():
    """While every token fits in sinks + window, the tiered cache is the fp16 cache."""
    gen = torch.Generator().manual_seed(0)
    cache = TieredKVCache(ARGS, 2, 100, _codecs("nuq"), window=64, sinks=4)
    outs = _run(cache, 90, gen, dense=FP16Cache(ARGS, 2, 100))
    assert cache.n_blocks == [0, 0]
    assert all(torch.equal(a, b) for a, b in outs)
    static = 2 * (2 * 32 * 4 + 2 * 4 * 4)  # per layer: fp32 key channel scales and K/V levels
    assert cache.bits_per_element() == pytest.approx(16 + 8 * static / (90 * 2 * 2 * 2 * 2 * 32), rel=1e-12)


@pytest.mark.parametrize("codec,rope_pre", [("kivi", False), ("nuq", False), ("nuq", True)])
def test_tiered_attend_equals_dequantize_then_attend(codec, rope_pre):
    gen = torch.Generator().manual_seed(1)
    cache = TieredKVCache(ARGS, 2, 200, _codecs(codec), window=16, sinks=3, rope_pre=rope_pre)
    dense = FP16Cache(ARGS, 2, 200)
    _run(cache, 130, gen, dense=dense)
    n = cache.length
    assert cache.n_blocks == [cache.blocks_at(n)] * 2 == [3, 3]  # 130 = 3 sinks + 96 + 31 in the window
    q = torch.randn(2, 4, 1, 32, generator=gen)
    k, v = (torch.randn(2, 2, 1, 32, generator=gen) for _ in range(2))
    out = cache.attend(0, q, k, v, n)
    # the oracle: history decoded from the stored fields, window and sinks from the stored fp16
    hk, hv = cache.decode_history(0, "k"), cache.decode_history(0, "v")
    wk, wv = cache.win["k"][0].float(), cache.win["v"][0].float()
    keys = torch.cat([wk[:, :, :3], hk, wk[:, :, 3:]], 2)
    vals = torch.cat([wv[:, :, :3], hv, wv[:, :, 3:]], 2)
    assert torch.allclose(out, causal_attention(q, keys, vals, n), atol=1e-5)
    # the history approximates the keys it replaced (2-bit: SQNR above 5 dB on Gaussian data)
    ref = dense.k[0][:, :, 3 : 3 + hk.shape[2]].float()
    sqnr = 10 * math.log10(ref.pow(2).mean() / (hk - ref).pow(2).mean())
    assert sqnr > 5, sqnr


def test_stored_bytes_and_projection():
    gen = torch.Generator().manual_seed(2)
    cache = TieredKVCache(ARGS, 2, 300, _codecs("nuq"), window=16, sinks=4)
    _run(cache, 200, gen)
    B, L, K, d = 2, 2, 2, 32
    nb = cache.n_blocks[0]
    win = 200 - nb * 32
    n_out = math.ceil(0.01 * 32 * d)
    per_block = B * L * K * (2 * 32 * d * 2 // 8 + 32 * 2 + 2 * n_out * (2 + 2))  # codes K+V, v scales, outliers
    static = L * (K * d * 4 + 2 * 4 * 4)  # key channel scales and levels, fp32
    want = nb * per_block + win * B * L * 2 * K * d * 2 + static
    assert cache.stored_bytes() == want
    assert cache.bits_at(200) == pytest.approx(cache.bits_per_element(), rel=1e-12)
    assert 2.0 < cache.bits_at(32768) < cache.bits_at(200)
