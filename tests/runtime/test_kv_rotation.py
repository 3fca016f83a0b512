"""Hadamard-rotated KV caches (nuq-outlier `rotate: hadamard`): the rotation itself (moec/rotation.py), the
calibration statistics in the rotated basis, the recipe rule, and every attention path attending in the
rotated basis: the dynamic cache against explicit attention, simulated decode against decode. Also the
history score bias (`score_bias`, kvtiered.history_bias) on the same paths."""

import pytest
import torch

from moec.calibrate.nuq import KVSampler, key_error_power, query_rms
from moec.calibrate.recipe import parse_recipe
from moec.errors import UserError
from moec.rotation import block_hadamard, pow2_block
from moec.runtime.config import ModelArgs
from moec.runtime.kivi import KIVICodec, kivi_layer_codecs
from moec.runtime.kvcache import causal_attention
from moec.runtime.kvtiered import TieredKVCache
from moec.runtime.loader import load_model
from moec.runtime.nuq import FIXED_LEVELS, NUQCenteredCodec
from moec.runtime.perplexity import CONTEXT

ARGS = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                 max_seq_len=512)


@pytest.mark.parametrize("n,block", [(64, 0), (576, 0), (96, 16), (128, 32)])
def test_block_hadamard_is_orthogonal_and_spreads(n, block):
    R = block_hadamard(n, block, seed=3)
    b = block or pow2_block(n)
    assert torch.allclose(R @ R.T, torch.eye(n), atol=1e-6)
    assert torch.allclose(R.abs(), (R != 0).float() / b**0.5)  # ±1/√b inside the diagonal blocks, 0 elsewhere
    assert int((R != 0).sum()) == n * b
    x = torch.zeros(n)
    x[5] = 10.0  # one outlier channel spreads over its block
    assert (x @ R).abs().max() == pytest.approx(10.0 / b**0.5)
    assert not torch.equal(R, block_hadamard(n, block, seed=4))  # the signs follow the seed


def test_block_hadamard_rejects_bad_blocks():
    for n, block in ((96, 64), (64, 12)):
        with pytest.raises(UserError, match="power of two dividing"):
            block_hadamard(n, block)


def test_query_rms_in_the_rotated_basis():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 10, 8, generator=gen) * torch.arange(1, 9)  # [B, H, T, d]
    smp = KVSampler()
    smp(0, "q", q)
    R = block_hadamard(8, seed=1)
    want = (q @ R).pow(2).mean((0, 2)).view(2, 2, 8).mean(1).sqrt()  # per KV head over its 2 query heads
    assert torch.allclose(query_rms(smp, 0, 2, R), want, rtol=1e-5)


@pytest.mark.parametrize("kv,msg", [
    ({"codec": "nuq-outlier", "bits": 2, "rotate": "hadamard", "rope": "pre"}, "kv.rotate: a head_dim rotation"),
    ({"codec": "nuq-outlier", "bits": 2, "rotate": "walsh", "rope": "post"}, "kv.rotate"),
    ({"codec": "kivi", "bits": 2, "rotate": "walsh"}, "kv.rotate"),
])
def test_recipe_rule(kv, msg):
    with pytest.raises(UserError, match=msg.replace(".", r"\.")):
        parse_recipe({"kv": kv})
    ok = parse_recipe({"kv": {"codec": "nuq-outlier", "bits": 2, "rope": "post", "rotate": "hadamard"}})
    assert ok.kv.rotate == "hadamard"
    assert parse_recipe({"kv": {"codec": "kivi", "bits": 2, "rotate": "hadamard"}}).kv.rotate == "hadamard"


def test_kivi_rotation_is_rebuilt_from_the_layer():
    """kivi `rotate: hadamard` stores no tensor: each layer's codec gets block_hadamard(head_dim, seed=layer),
    the rotation nuq-outlier's calibration writes for the same layer, and counts it as a static tensor."""
    section = {"bits": 2, "group_size": 16, "rotate": "hadamard"}
    codecs = kivi_layer_codecs(section, {}, ARGS)
    for i, c in enumerate(codecs):
        assert torch.equal(c.rotation, block_hadamard(ARGS.head_dim, seed=i))
        assert set(c.static_tensors()) == {"rotation"}
    assert all(c.rotation is None for c in kivi_layer_codecs(section | {"rotate": "none"}, {}, ARGS))


def _rotated_codecs(n_layers, K, d, block, seed=0, bias=False, codec="nuq"):
    if codec == "kivi":
        return [KIVICodec(2, d, d // 2, rotation=block_hadamard(d, seed=i)) for i in range(n_layers)]
    gen = torch.Generator().manual_seed(seed)
    lev = torch.tensor(FIXED_LEVELS[2])
    return [NUQCenteredCodec(2, d, block, lev, lev, torch.rand(K, d, generator=gen) + 1, 0.0,
                             k_center=0.1 * torch.randn(K, d, generator=gen), rotation=block_hadamard(d, seed=i),
                             k_err2=torch.rand(K, d, generator=gen) * 0.3 if bias else None)
            for i in range(n_layers)]


def test_key_error_power():
    """k_err2 is the per-channel mean squared rounding error; outliers (kept exactly) count as 0."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(500, 2, 8, generator=gen) * torch.arange(1, 9)
    lev = torch.tensor(FIXED_LEVELS[2])
    fit = {"k_scale": torch.full((2, 8), 4.0), "k_levels": lev}
    err = (lev[torch.bucketize(k / 4.0, (lev[1:] + lev[:-1]) / 2)] * 4.0 - k).pow(2)
    assert torch.allclose(key_error_power(k, fit, 0.0, False), err.mean(0))
    with_out = key_error_power(k, fit, 0.05, False)
    kept = err.flatten().sort().values[: round(0.95 * err.numel())]  # the 5% largest errors are the outliers'
    assert (with_out <= err.mean(0)).all() and with_out.sum() * 500 == pytest.approx(kept.sum(), rel=1e-5)
    pre = key_error_power(k, fit, 0.0, True)
    assert torch.allclose(pre[:, :4], pre[:, 4:])  # pair-averaged (c, c + d/2)


@pytest.mark.parametrize("codec", ["nuq", "kivi"])
def test_dynamic_cache_attends_in_the_rotated_basis(codec):
    """The cache stores k·R, v·R (window and history), and its output is explicit attention with q·R over those,
    rotated back; without the final rotation the output would be off by the rotation itself."""
    gen = torch.Generator().manual_seed(4)
    codecs = _rotated_codecs(2, 2, 32, 32, codec=codec)
    cache = TieredKVCache(ARGS, 2, 200, codecs, window=16, sinks=3, use_kernel=False)
    for t in [0, *range(20, 120)]:
        T = 20 if t == 0 else 1
        q, k, v = (torch.randn(2, n, T, 32, generator=gen) for n in (4, 2, 2))
        for layer in range(2):
            out = cache.attend(layer, q, k, v, t)
    R = codecs[1].rotation
    assert torch.equal(cache.rot.get(1, torch.float32), R)
    assert torch.equal(cache.win["k"][1][:, :, -1:], (k @ R).half())  # the newest token, stored rotated
    n = cache.length
    hk, hv = cache.decode_history(1, "k"), cache.decode_history(1, "v")
    wk, wv = cache.win["k"][1].float(), cache.win["v"][1].float()
    keys, vals = torch.cat([wk[:, :, :3], hk, wk[:, :, 3:]], 2), torch.cat([wv[:, :, :3], hv, wv[:, :, 3:]], 2)
    want = causal_attention(q @ R, keys[:, :, :n], vals[:, :, :n], n - 1) @ R.T
    assert torch.allclose(out, want, atol=1e-5)
    assert not torch.allclose(out, want @ R, atol=1e-2)
    calib = 2 * 2 * 32 * 4 + 2 * 4 * 4 if codec == "nuq" else 0  # nuq: k_scale, k_center, the two level tables
    assert cache._static_bytes() == 2 * (calib + 32 * 32 * 4)  # + the rotation per layer


@pytest.mark.parametrize("bias,codec", [(False, "nuq"), (True, "nuq"), (False, "kivi")])
def test_simulated_decode_equals_decode_with_rotation(tiny_moe_dir, bias, codec):
    model, _ = load_model(tiny_moe_dir)
    args = model.args
    codecs = _rotated_codecs(args.n_layers, args.n_kv_heads, args.head_dim, 16, seed=5, bias=bias, codec=codec)
    W = 120
    x = torch.randint(0, args.vocab_size, (2, W), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        sim = TieredKVCache(args, 2, W, codecs, window=24, sinks=2, block=16, mode="simulated")
        lg_sim = model(x, sim, 0)[:, CONTEXT - 1 : W - 1]
        dec = TieredKVCache(args, 2, W, codecs, window=24, sinks=2, block=16)
        out = [model(x[:, :CONTEXT], dec, 0)[:, -1]]
        for t in range(CONTEXT, W - 1):
            out.append(model(x[:, t : t + 1], dec, t)[:, -1])
    lg_dec = torch.stack(out, 1)
    assert dec.n_blocks[0] == dec.blocks_at(W - 1) > 3
    assert torch.allclose(lg_sim, lg_dec, atol=1e-4), (lg_sim - lg_dec).abs().max()


def test_score_bias_is_added_to_history_scores_only():
    """The dynamic cache's torch path with `score_bias` equals explicit attention whose history scores get
    Σ q²·k_err2/(2d) per query head (q in the rotated basis), and differs from the unbiased cache; so does
    attend_history given q and keys in the model's basis (q_rotated False)."""
    gen = torch.Generator().manual_seed(6)
    codecs = _rotated_codecs(2, 2, 32, 32, seed=1, bias=True)
    cache = TieredKVCache(ARGS, 1, 200, codecs, window=16, sinks=3, use_kernel=False)
    plain = TieredKVCache(ARGS, 1, 200, _rotated_codecs(2, 2, 32, 32, seed=1), window=16, sinks=3, use_kernel=False)
    for t in [0, *range(20, 90)]:
        T = 20 if t == 0 else 1
        q, k, v = (torch.randn(1, n, T, 32, generator=gen) for n in (4, 2, 2))
        out, out_plain = cache.attend(1, q, k, v, t), plain.attend(1, q, k, v, t)
    R, h = codecs[1].rotation, cache.n_blocks[1] * 32
    hk, hv = cache.decode_history(1, "k"), cache.decode_history(1, "v")
    wk, wv = cache.win["k"][1].float(), cache.win["v"][1].float()
    keys, vals = torch.cat([wk[:, :, :3], hk, wk[:, :, 3:]], 2), torch.cat([wv[:, :, :3], hv, wv[:, :, 3:]], 2)
    qr = (q @ R).view(1, 2, 2, 32)  # [B, K, G, d]
    scores = qr @ keys.transpose(-1, -2) / 32**0.5  # [1, K, G, n]
    bias = (qr.pow(2) * codecs[1].k_err2[None, :, None, :]).sum(-1, keepdim=True) / (2 * 32)
    scores[..., 3 : 3 + h] += bias
    want = (torch.softmax(scores, -1) @ vals).reshape(1, 4, 1, 32) @ R.T
    assert torch.allclose(out, want, atol=1e-5)
    assert not torch.allclose(out, out_plain, atol=1e-3)
    # read_append's view (moec/hf): q, keys and values in the model's basis; the bias still comes from q·R
    got = cache.attend_history(1, q, keys @ R.T, vals @ R.T, 3, h, keys.shape[2] - 1, q_rotated=False)
    assert torch.allclose(got, want, atol=1e-5)
