"""Latent KV codec and cache (moec/runtime/latent.py), on the CPU in fp32."""

import pytest
import torch

from moec.errors import FormatError
from moec.formats.bitpack import pack_planar, pack_trits, unpack_planar, unpack_trits
from moec.runtime.config import ModelArgs
from moec.runtime.kvcache import FP16Cache
from moec.runtime.latent import LatentCodec, LatentKVCache, build_latent_codecs

ARGS = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                 max_seq_len=512)


def _orth(D, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(D, D, generator=g))[0][:, :r].contiguous()


def _codecs(groups, rank, bits, frac, block=8, seed=0):
    K, d = ARGS.n_kv_heads, ARGS.head_dim
    out = []
    for g, layers in enumerate(groups):
        D = len(layers) * K * d
        r = min(rank, D)
        out.append({kind: LatentCodec(_orth(D, r, seed + g), torch.randn(D) * 0.1, torch.full((r,), 3.0), bits,
                                      block, frac) for kind in "kv"})
    return out


@pytest.mark.parametrize("bits", [2, 4])
def test_planar_round_trip(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 24))
    packed = pack_planar(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 24 * bits // 8
    assert torch.equal(unpack_planar(packed, bits, 24), codes)
    assert pack_planar(torch.tensor([1, 2, 3, 0]), 2).tolist() == [1 | 2 << 2 | 3 << 4]  # channel c: bit 2c


@pytest.mark.parametrize("r", [5, 24, 27])
def test_trit_round_trip(r):
    codes = torch.randint(0, 3, (3, 4, r))
    packed = pack_trits(codes)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == -(-r // 5)  # 1.6 bits per element
    assert torch.equal(unpack_trits(packed, r), codes)


def test_ternary_latent_codec():
    """Ternary latent (bits 1): stored at ceil(r/5) bytes per token; the reconstruction equals the basis
    times the nearest of {-s, 0, s} per latent channel; the rounding error is at most s/2 per channel."""
    D, r = 32, 16
    basis = _orth(D, r, 3)
    scale = torch.full((r,), 0.7)
    c = LatentCodec(basis, torch.zeros(D), scale, 1, 8, 0.0)
    assert c.fields()["codes"][1] == (4,)
    z = torch.randn(2, 8, r)
    x = z @ basis.T
    y = c.decode(c.encode(x))
    zq = (y @ basis)  # the dequantized latent (basis orthonormal)
    lev = torch.round(torch.clamp(z / 0.7, -1, 1)) * 0.7
    assert torch.allclose(zq, lev, atol=2e-3)  # basis, mean and scale are held in fp16
    inside = z.abs() <= 0.7
    assert ((zq - z).abs()[inside] <= 0.35 + 2e-3).all()


def test_codec_low_rank_exact_and_outliers():
    D, r, N = 32, 8, 8
    basis, mean = _orth(D, r), torch.randn(D)
    x = (torch.randn(2, N, r) @ basis.T + mean)[:, :, :]  # exactly rank r around the mean
    c16 = LatentCodec(basis, mean, torch.ones(r), 16, N, 0.0)
    err = (c16.decode(c16.encode(x)) - x).abs().max().item()
    assert err < 1e-2, err  # fp16 latent and fp16-held basis: ~1e-3
    # 4-bit latent with outliers: the largest residuals come back to fp16 precision, the rest shrink
    x = x + 0.5 * torch.randn_like(x)
    c4 = LatentCodec(basis, mean, torch.full((r,), 3.0), 4, N, 0.05)
    plain = LatentCodec(basis, mean, torch.full((r,), 3.0), 4, N, 0.0)
    e_out = (c4.decode(c4.encode(x)) - x).reshape(2, -1)
    e_plain = (plain.decode(plain.encode(x)) - x).reshape(2, -1)
    n = c4.n_out
    assert n == 13 and e_out.abs().amax(-1).lt(e_plain.abs().sort(-1).values[:, -n - 1] + 1e-6).all()
    assert e_out.pow(2).sum() < e_plain.pow(2).sum()


def _run(cache, q, k, v, chunk):
    """Feed positions 0..S-1: a prefill of 5 tokens, then chunks of `chunk` tokens -> outputs per layer."""
    S, outs = k[0].shape[2], [[] for _ in range(ARGS.n_layers)]
    t = 0
    while t < S:
        n = 5 if t == 0 else min(chunk, S - t)
        for i in range(ARGS.n_layers):
            outs[i].append(cache.attend(i, q[i][:, :, t : t + n], k[i][:, :, t : t + n], v[i][:, :, t : t + n], t))
        t += n
    return [torch.cat(o, 2) for o in outs]


def _qkv(B=2, S=77, seed=1):
    g = torch.Generator().manual_seed(seed)
    H, K, d = ARGS.n_heads, ARGS.n_kv_heads, ARGS.head_dim
    return ([torch.randn(B, H, S, d, generator=g) for _ in range(3)],
            [torch.randn(B, K, S, d, generator=g) * 2 for _ in range(3)],
            [torch.randn(B, K, S, d, generator=g) for _ in range(3)])


@pytest.mark.parametrize("groups,rope_pre", [([[0], [1], [2]], False), ([[0, 1], [2]], True)])
def test_chunked_equals_token_by_token(groups, rope_pre):
    """Multi-token calls give every query its decode-mode view (the exact chunked evaluation)."""
    q, k, v = _qkv()
    codecs = _codecs(groups, 16, 4, 0.02)

    def make():
        return LatentKVCache(ARGS, 2, 77, groups, codecs, window=12, sinks=2, block=8, rope_pre=rope_pre)

    c1, c2 = make(), make()
    one, chunked = _run(c1, q, k, v, 1), _run(c2, q, k, v, 13)
    for a, b in zip(one, chunked, strict=True):
        assert (a - b).abs().max().item() < 1e-4
    assert c1.n_blocks == c2.n_blocks == [7] * 3 and c1.stored_bytes() == c2.stored_bytes()
    assert c1.win["k"][0].shape[2] == 2 + 75 - 7 * 8  # sinks + window between 12 and 12 + 8 - 1
    assert abs(c1.bits_per_element() - c1.bits_at(77)) < 1e-9  # the projection formula meets the bytes held


def test_full_rank_fp16_latent_matches_dense_cache():
    """Full rank, 16-bit latent, no outliers: the cache is the fp16 cache up to fp16 rounding of z."""
    q, k, v = _qkv(S=50)
    groups = [[0, 1], [2]]
    codecs = _codecs(groups, 64, 16, 0.0)
    lat = LatentKVCache(ARGS, 2, 50, groups, codecs, window=8, sinks=2, block=8, rope_pre=True)
    dense = FP16Cache(ARGS, 2, 50, dtype=torch.float16)
    for a, b in zip(_run(lat, q, k, v, 1), _run(dense, q, k, v, 1), strict=True):
        assert (a - b).abs().max().item() < 2e-2
    assert lat.n_blocks[0] > 3


def test_bits_accounting():
    groups = [[0], [1], [2]]
    c = LatentKVCache(ARGS, 1, 4096, groups, _codecs(groups, 8, 4, 0.0), window=16, sinks=0, block=8)
    # per block and group: 8 tokens × (8 + 8 latent dims × 4 bits) = 64 bytes for 8 · 2 · 32 elements
    assert c._block_bytes() == 3 * 64
    static = 3 * 2 * (32 * 8 + 32 + 8) * 2  # basis + mean + scale per group and kind, fp16
    assert c._static_bytes() == static
    n = 4096 - 16  # blocks_at(4096) blocks hold all but the window
    want = 8 * (n // 8 * 3 * 64 + 16 * 3 * 2 * 32 * 2 + static) / (4096 * 3 * 2 * 32)
    assert abs(c.bits_at(4096) - want) < 1e-12


def test_checkpoint_shape_errors():
    section = {"codec": "latent-layer", "bits": 4, "n_layers": 3, "n_kv_heads": 2, "head_dim": 16,
               "latent": {"group_layers": 2, "outlier_frac": 0.0}, "n_groups": 2, "block": 8, "window": 8, "sinks": 0,
               "rope": "post"}
    tensors = {}
    for g, D in ((0, 64), (1, 32)):
        for kind in "kv":
            tensors |= {f"kv.groups.{g}.{kind}_basis": _orth(D, 8), f"kv.groups.{g}.{kind}_mean": torch.zeros(D),
                        f"kv.groups.{g}.{kind}_scale": torch.ones(8)}
    groups, codecs = build_latent_codecs(section, tensors, ARGS)
    assert groups == [[0, 1], [2]] and codecs[1]["k"].D == 32
    with pytest.raises(FormatError, match="kv.groups.1.v_basis has shape"):
        build_latent_codecs(section, tensors | {"kv.groups.1.v_basis": _orth(64, 8)}, ARGS)
    with pytest.raises(FormatError, match="kv.groups.0.k_scale is missing|_mean/_scale"):
        build_latent_codecs(section, {n: t for n, t in tensors.items() if n != "kv.groups.0.k_scale"}, ARGS)
    with pytest.raises(FormatError, match="KV calibration is for"):
        build_latent_codecs(dict(section, head_dim=32), tensors, ARGS)
    with pytest.raises(FormatError, match="group_layers"):
        build_latent_codecs(dict(section, latent={"group_layers": 1, "outlier_frac": 0.0}), tensors, ARGS)
