"""The nuq-outlier options (nuq.NUQCenteredCodec: key centers, query-weighted key outliers; calibrate/nuq.py's
centered / MSE scales), their recipe validation, and the simulated mode of TieredKVCache against real decode."""

import pytest
import torch

from moec.calibrate.nuq import KVSampler, center_scale, channel_scale, fit_layer, mse_scale, query_rms
from moec.calibrate.recipe import parse_recipe
from moec.errors import UserError
from moec.runtime.config import ModelArgs
from moec.runtime.kvcache import causal_attention
from moec.runtime.kvtiered import TieredKVCache
from moec.runtime.loader import load_model
from moec.runtime.nuq import FIXED_LEVELS, NUQCenteredCodec, NUQOutlierCodec
from moec.runtime.perplexity import CONTEXT

ARGS = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                 max_seq_len=512)


def _offset_keys(gen, B=2, K=2, N=32, d=32):
    """Gaussian keys whose channels sit off zero (offsets up to 4× their spread)."""
    center = torch.linspace(-4, 4, d).repeat(K, 1)
    return center[None, :, None, :] + torch.randn(B, K, N, d, generator=gen), center


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_centered_codec_error_bound(bits, weighted):
    gen = torch.Generator().manual_seed(0)
    x, center = _offset_keys(gen)
    scale = torch.full((2, 32), 2.0)
    lev = torch.tensor(FIXED_LEVELS[bits])
    w = torch.rand(2, 32, generator=gen) + 0.5 if weighted else None
    codec = NUQCenteredCodec(bits, 32, 32, lev, lev, scale, 0.02, k_center=center, k_weight=w)
    f = codec.encode(x, "k")
    assert set(f) == set(NUQOutlierCodec(bits, 32, 32, lev, lev, scale, 0.02).fields("k"))  # same fields
    y = codec.decode(f, "k")
    idx = f["out_idx"][:, :, 0].long()
    flat_x, flat_y = x.reshape(2, 2, -1), y.reshape(2, 2, -1)
    assert torch.allclose(flat_y.gather(-1, idx), flat_x.gather(-1, idx), rtol=1e-3, atol=1e-3)  # outliers exact
    # the rest: within half the largest level gap (× scale) when inside the scale, else the edge error
    xn = (x - center[None, :, None, :]) / scale[None, :, None, :]
    gap = (lev[1:] - lev[:-1]).max().item() / 2
    bound = scale[None, :, None, :] * (gap + (xn.abs() - 1).clamp_min(0)) + 1e-5
    assert ((y - x).abs() <= bound).all()
    # values are the parent codec's
    assert torch.equal(codec.decode(codec.encode(x, "v"), "v"),
                       NUQOutlierCodec(bits, 32, 32, lev, lev, scale, 0.02).decode(
                           NUQOutlierCodec(bits, 32, 32, lev, lev, scale, 0.02).encode(x, "v"), "v"))


def test_weighted_outliers_are_the_largest_weighted_errors():
    gen = torch.Generator().manual_seed(1)
    x, center = _offset_keys(gen, B=1, K=1)
    lev = torch.tensor(FIXED_LEVELS[2])
    scale, w = torch.full((1, 32), 1.5), torch.rand(1, 32, generator=gen) * 3
    codec = NUQCenteredCodec(2, 32, 32, lev, lev, scale, 0.03, k_center=center[:1], k_weight=w)
    plain = NUQCenteredCodec(2, 32, 32, lev, lev, scale, 0.0, k_center=center[:1])
    err = ((plain.decode(plain.encode(x, "k"), "k") - x).abs() * w[None, :, None, :]).flatten()
    chosen = codec.encode(x, "k")["out_idx"].flatten().long()
    rest = torch.ones_like(err, dtype=torch.bool)
    rest[chosen] = False
    assert err[chosen].min() >= err[rest].max()
    # and they reduce the weighted squared error more than picking by |k / scale| does
    mag = NUQCenteredCodec(2, 32, 32, lev, lev, scale, 0.03, k_center=center[:1])
    e_w = (((codec.decode(codec.encode(x, "k"), "k") - x) * w[None, :, None, :]) ** 2).sum()
    e_m = (((mag.decode(mag.encode(x, "k"), "k") - x) * w[None, :, None, :]) ** 2).sum()
    assert e_w < e_m


def test_center_beats_symmetric_on_offset_channels():
    gen = torch.Generator().manual_seed(2)
    x, _ = _offset_keys(gen, N=512)
    samples = x.permute(0, 2, 1, 3).reshape(-1, 2, 32)  # [N, K, d]
    errs = {}
    for centered in (False, True):
        fit = fit_layer(samples, samples, 2, 0.01, "fitted", k_center=centered)
        codec = NUQCenteredCodec(2, 32, 512, fit["k_levels"], fit["v_levels"], fit["k_scale"], 0.0,
                                 k_center=fit.get("k_center"))
        errs[centered] = (codec.decode(codec.encode(x, "k"), "k") - x).pow(2).mean().item()
    assert errs[True] < 0.5 * errs[False], errs


def test_fit_helpers():
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(4000, 2, 8, generator=gen) * 2 + 3
    c, s = center_scale(k, 0.0)
    assert torch.allclose(c, (k.amax(0) + k.amin(0)) / 2) and torch.allclose(s, (k.amax(0) - k.amin(0)) / 2)
    c, s = center_scale(k, 0.02)
    assert ((k - c).abs() > s).float().mean().item() == pytest.approx(0.02, abs=0.005)
    lev = torch.tensor(FIXED_LEVELS[2])
    base = channel_scale(k - c, 0.01)
    tuned = mse_scale(k, c, base, lev, 0.01)

    def err(s):
        idx = torch.bucketize(((k - c) / s).contiguous(), (lev[1:] + lev[:-1]) / 2)
        return (lev[idx] * s - (k - c)).pow(2).sort(0).values[: int(0.99 * 4000)].sum().item()

    assert err(tuned) <= err(base)
    # query RMS: per KV head over its group, equal on the two channels of a RoPE pair (c, c + d/2)
    smp = KVSampler()
    q = torch.randn(3, 4, 10, 8, generator=gen) * torch.arange(1, 9)  # [B, H, T, d]
    smp(0, "q", q)
    w = query_rms(smp, 0, 2)
    assert w.shape == (2, 8) and torch.allclose(w[:, :4], w[:, 4:])
    ms = q.pow(2).mean((0, 2)).view(2, 2, 8).mean(1)
    assert torch.allclose(w[:, 0], ((ms[:, 0] + ms[:, 4]) / 2).sqrt(), rtol=1e-5)


@pytest.mark.parametrize("kv,field", [
    ({"codec": "kivi", "bits": 2, "k_center": True}, "kv: unknown key 'k_center' for codec 'kivi'"),
    ({"codec": "fp16", "outlier_select": "weighted-error"}, "kv: unknown key 'outlier_select' for codec 'fp16'"),
    ({"codec": "nuq-outlier", "bits": 2, "outlier_select": "largest"}, "kv.outlier_select"),
    ({"codec": "nuq-outlier", "bits": 2, "k_scale_fit": "max"}, "kv.k_scale_fit"),
    ({"codec": "nuq-outlier", "bits": 2, "k_center": "yes"}, "kv.k_center"),
])
def test_recipe_options_validated(kv, field):
    with pytest.raises(UserError, match=field.replace(".", r"\.")):
        parse_recipe({"kv": kv})


def test_recipe_options_parse():
    r = parse_recipe({"kv": {"codec": "nuq-outlier", "bits": 2, "k_center": True, "outlier_select": "weighted-error",
                             "k_scale_fit": "mse"}})
    assert (r.kv.k_center, r.kv.outlier_select, r.kv.k_scale_fit) == (True, "weighted-error", "mse")


def _centered_codecs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lev = torch.tensor(FIXED_LEVELS[2])
    return [NUQCenteredCodec(2, 32, 32, lev, lev, torch.rand(2, 32, generator=gen) + 1, 0.02,
                             k_center=torch.randn(2, 32, generator=gen), k_weight=torch.rand(2, 32, generator=gen))
            for _ in range(2)]


def test_tiered_cache_with_centered_codec_is_the_torch_path():
    gen = torch.Generator().manual_seed(4)
    cache = TieredKVCache(ARGS, 2, 200, _centered_codecs(), window=16, sinks=3, rope_pre=True, use_kernel=None)
    assert cache.use_kernel is False  # on the CPU: the torch path (the kernel path is tested in tests/kernels)
    for t in [0, *range(20, 120)]:
        T = 20 if t == 0 else 1
        q, k, v = (torch.randn(2, n, T, 32, generator=gen) for n in (4, 2, 2))
        for layer in range(2):
            out = cache.attend(layer, q, k, v, t)
    n = cache.length
    assert cache.n_blocks == [3, 3]
    hk, hv = cache.decode_history(1, "k"), cache.decode_history(1, "v")
    wk, wv = cache.win["k"][1].float(), cache.win["v"][1].float()
    keys, vals = torch.cat([wk[:, :, :3], hk, wk[:, :, 3:]], 2), torch.cat([wv[:, :, :3], hv, wv[:, :, 3:]], 2)
    q = q[:, :, -1:]
    assert torch.allclose(out[:, :, -1:], causal_attention(q, keys[:, :, :n], vals[:, :, :n], n - 1), atol=1e-5)
    static = 2 * (3 * 2 * 32 * 4 + 2 * 4 * 4)  # per layer: k_scale, k_center, k_weight (fp32) and levels
    assert cache._static_bytes() == static


def test_simulated_decode_equals_decode(tiny_moe_dir):
    """The simulated mode's one forward per window gives the logits of token-by-token decode through the cache."""
    model, _ = load_model(tiny_moe_dir)
    args = model.args
    gen = torch.Generator().manual_seed(5)
    lev = torch.tensor(FIXED_LEVELS[2])
    codecs = [NUQCenteredCodec(2, args.head_dim, 16, lev, lev, torch.rand(args.n_kv_heads, args.head_dim,
                                                                           generator=gen) + 0.5, 0.02,
                               k_center=0.1 * torch.randn(args.n_kv_heads, args.head_dim, generator=gen),
                               k_weight=torch.rand(args.n_kv_heads, args.head_dim, generator=gen))
              for _ in range(args.n_layers)]
    W = 120
    x = torch.randint(0, args.vocab_size, (2, W), generator=gen)
    with torch.no_grad():
        sim = TieredKVCache(args, 2, W, codecs, window=24, sinks=2, block=16, rope_pre=True, mode="simulated")
        lg_sim = model(x, sim, 0)[:, CONTEXT - 1 : W - 1]
        dec = TieredKVCache(args, 2, W, codecs, window=24, sinks=2, block=16, rope_pre=True)
        out = [model(x[:, :CONTEXT], dec, 0)[:, -1]]
        for t in range(CONTEXT, W - 1):
            out.append(model(x[:, t : t + 1], dec, t)[:, -1])
    lg_dec = torch.stack(out, 1)
    assert dec.n_blocks[0] == dec.blocks_at(W - 1) > 3  # history blocks were evicted and used
    assert torch.allclose(lg_sim, lg_dec, atol=1e-4), (lg_sim - lg_dec).abs().max()
    assert sim.bits_at(W - 1) == pytest.approx(dec.bits_per_element(), rel=1e-12)
