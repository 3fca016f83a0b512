"""k-means (vs scikit-learn), residual-VQ fitting, the rvq codec's round trip and tiers, recipe validation."""

import numpy as np
import pytest
import torch

from moec.calibrate.kmeans import assign, kmeans
from moec.calibrate.recipe import parse_recipe
from moec.calibrate.rvq import fit_rvq, tier_errors
from moec.errors import UserError
from moec.formats.bitpack import pack_bits, unpack_bits
from moec.runtime.config import ModelArgs
from moec.runtime.rvq import RVQLayerCodec, RVQTier, RVQTieredCache


def _blobs(G=3, N=600, v=4, k=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(G, k, v, generator=g) * 4
    lab = torch.randint(0, k, (G, N), generator=g)
    return centers.gather(1, lab[..., None].expand(-1, -1, v)) + 0.3 * torch.randn(G, N, v, generator=g)


def test_kmeans_matches_sklearn():
    """Same data: our inertia within 2% of scikit-learn's best of 4 restarts (both are local optima)."""
    from sklearn.cluster import KMeans

    x = _blobs()
    c, idx, inertia = kmeans(x, 8, iters=50, seed=0)
    for g in range(x.shape[0]):
        sk = KMeans(8, n_init=4, random_state=0).fit(x[g].numpy().astype(np.float64))
        ref = sk.inertia_ / x.shape[1]
        assert inertia[g].item() <= 1.02 * ref, (g, inertia[g].item(), ref)
        # the assignment is the nearest centroid, and the reported inertia is its mean squared distance
        d = torch.cdist(x[g], c[g]).pow(2)
        assert torch.equal(idx[g], d.argmin(1))
        assert abs(d.min(1).values.mean().item() - inertia[g].item()) < 1e-4 * ref


def test_kmeans_deterministic_and_blocked():
    x = _blobs(G=2, N=300, k=16)
    a = kmeans(x, 16, iters=10, seed=3)
    b = kmeans(x, 16, iters=10, seed=3, max_elems=64)  # distances computed 2 points at a time
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.equal(a[1], b[1])
    i1, d1 = assign(x, a[0])
    i2, d2 = assign(x, a[0], max_elems=16)
    assert torch.equal(i1, i2) and torch.allclose(d1, d2, atol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_rvq_error_falls_per_stage(shared):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 2, 16, generator=g) * torch.linspace(0.2, 3, 16)  # [N, K, d], anisotropic
    books, errs = fit_rvq(x, 4, [16, 16, 16], iters=8, shared_heads=shared)
    assert [tuple(b.shape) for b in books] == [(1 if shared else 2, 4, 16, 4)] * 3
    assert errs[0] < 0.5 and errs[1] < 0.8 * errs[0] and errs[2] < 0.8 * errs[1], errs
    # the runtime codec (greedy encode, fp16 codebooks) reaches the fitted error up to fp16 rounding
    e = tier_errors(x, books, None)["mid"]
    assert e < 1.1 * errs[-1] + 1e-3, (e, errs)


@pytest.mark.parametrize("widths", [[7] * 8, [6] * 16 + [5] * 16, [4] * 3, [16, 1, 9]])
def test_pack_bits_round_trip(widths):
    g = torch.Generator().manual_seed(len(widths))
    codes = torch.stack([torch.randint(0, 2**w, (5, 3), generator=g) for w in widths], -1)
    packed = pack_bits(codes, widths)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == -(-sum(widths) // 8)
    assert torch.equal(unpack_bits(packed, widths), codes)


def _codec(K=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(400, K, d, generator=g)
    mid, _ = fit_rvq(x, 4, [64, 32], iters=6)
    arch, _ = fit_rvq(x, 4, [16], iters=6)
    tiers = {kind: RVQTier(mid) for kind in "kv"}, {kind: RVQTier(arch) for kind in "kv"}
    return RVQLayerCodec(*tiers), x


def test_codec_round_trip_bound():
    """Fresh samples of the calibration distribution through the 2-stage (64 + 32 centroids over 4 dims =
    2.75 bits) codec: relative error well under the 0.35 bound (Gaussian noise at 2.75 bits: ~0.15)."""
    codec, x = _codec()
    g = torch.Generator().manual_seed(9)
    fresh = torch.randn(1, 2, 32, 16, generator=g)
    enc = codec.encode(fresh, "k")
    assert enc["codes"].shape == (1, 2, 32, (4 * 6 + 4 * 5 + 7) // 8)  # 4 sub-vectors × (6 + 5) bits
    y = codec.decode(enc, "k")
    rel = ((y - fresh).pow(2).sum() / fresh.pow(2).sum()).item()
    assert rel < 0.35, rel


@pytest.mark.parametrize("rope_pre", [False, True])
def test_tier_reencoding_and_bits(rope_pre):
    """Blocks move to the archive once ≥ archive_after tokens back, re-encoded from the middle tier's
    reconstruction; the archive costs more error than the middle tier and less than no cache at all.
    Pre-RoPE keys: blocks are un-rotated before encoding and rotated back (a rotation keeps the error)."""
    codec, _ = _codec()
    args = ModelArgs(arch="llama", vocab_size=10, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                     max_seq_len=512)
    cache = RVQTieredCache(args, 1, 512, [codec], window=16, sinks=2, block=16, archive_after=64, rope_pre=rope_pre)
    g = torch.Generator().manual_seed(2)
    ks = torch.randn(1, 2, 200, 16, generator=g)
    vs = torch.randn(1, 2, 200, 16, generator=g)
    q = torch.randn(1, 4, 1, 16, generator=g)
    for t in range(200):
        cache.attend(0, q, ks[:, :, t : t + 1], vs[:, :, t : t + 1], t)
    assert cache.n_blocks[0] == cache.blocks_at(200) == (200 - 2 - 16) // 16
    assert cache.n_arch[0] == cache.arch_at(200) == (200 - 64 - 2) // 16
    hist = cache.decode_history(0, "k")
    assert torch.allclose(hist, cache.mirror["k"][0][:, :, : hist.shape[2]], atol=1e-6)
    orig = ks.half().float()[:, :, 2 : 2 + hist.shape[2]]
    na = cache.n_arch[0] * 16
    err = lambda a, b: ((a - b).pow(2).sum() / b.pow(2).sum()).item()  # noqa: E731
    e_arch, e_mid = err(hist[:, :, :na], orig[:, :, :na]), err(hist[:, :, na:], orig[:, :, na:])
    assert e_mid < e_arch < 1.0, (e_mid, e_arch)
    if not rope_pre:
        direct = codec.arch["k"].decode(codec.arch["k"].encode(orig[:, :, :na]))
        assert err(direct, orig[:, :, :na]) <= e_arch + 1e-6  # re-encoding the reconstruction costs extra error
    # stored bytes: fp16 sinks + window, middle and archive code rows, fp16 codebooks
    stored = cache.stored_bytes()
    win = cache.win["k"][0].numel() * 2 * 2
    rows = (cache.n_blocks[0] - cache.n_arch[0]) * 16 * 2 * codec.mid["k"].row_bytes * 2
    arch = na * 2 * codec.arch["k"].row_bytes * 2
    books = sum(t.numel() * 2 for t in codec.static_tensors().values())
    assert stored == win + rows + arch + books
    assert abs(cache.bits_at(200) - cache.bits_per_element()) < 1e-9


@pytest.mark.parametrize("rvq, match", [
    ({"mid_sizes": [48]}, "kv.rvq.mid_sizes: codebook size 48 is not a power of two"),
    ({"arch_sizes": [131072]}, "kv.rvq.arch_sizes: codebook size 131072"),
    ({"archive_after": 100}, "kv.rvq.archive_after 100 must exceed kv.window"),
    ({"mid_sizes": []}, "kv.rvq.mid_sizes must list"),
    ({"rope": "mid"}, "kv.rvq.rope"),
    ({"bogus": 1}, "unknown key 'bogus'"),
])
def test_recipe_errors_name_the_field(rvq, match):
    with pytest.raises(UserError, match=match):
        parse_recipe({"kv": {"codec": "rvq-tiered", "bits": 2, "rvq": rvq}})


def test_recipe_dims_must_divide_head_dim():
    from moec.calibrate.rvq import check_rvq_recipe

    kv = parse_recipe({"kv": {"codec": "rvq-tiered", "bits": 2, "rvq": {"arch_dim": 3}}}).kv
    with pytest.raises(UserError, match="kv.rvq.arch_dim 3 does not divide the model's head_dim 64"):
        check_rvq_recipe(type("A", (), {"head_dim": 64})(), kv)
    with pytest.raises(UserError, match="unknown key .rvq. for codec .kivi."):
        parse_recipe({"kv": {"codec": "kivi", "bits": 2, "rvq": {}}})
