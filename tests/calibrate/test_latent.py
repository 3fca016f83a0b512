"""Latent KV fitting (moec/calibrate/latent.py) and recipe validation for the latent codecs."""

import pytest
import torch

from moec.calibrate.latent import (
    LatentSampler,
    check_latent_recipe,
    concat_group,
    fit_group,
    fit_latent_tensors,
    fit_scale,
    layer_groups,
    pca,
    rank_for_energy,
)
from moec.calibrate.recipe import load_recipe, parse_recipe
from moec.codecs.latent import LatentConfig, LatentKVConfig
from moec.errors import UserError
from moec.runtime.config import ModelArgs
from moec.runtime.latent import dequantize_latent, quantize_latent

ARGS = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16)


def test_pca_reconstruction_bound_on_low_rank_data():
    """Rank-8 signal + noise of std 0.01 in 64 dims: rank 8 keeps all but the noise energy."""
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(64, 64, generator=g))[0][:, :8]
    x = torch.randn(4000, 8, generator=g) * torch.linspace(3, 1, 8) @ basis.T + 5.0
    x = x + 0.01 * torch.randn(4000, 64, generator=g)
    fit, rep = fit_group(x, 8, 0.99, 16)
    rel = (x - ((x - fit["mean"]) @ fit["basis"] @ fit["basis"].T + fit["mean"])).pow(2).sum() / (x - 5).pow(2).sum()
    noise_share = 0.01**2 * 64 / (torch.linspace(3, 1, 8).pow(2).sum() + 0.01**2 * 64)
    assert rel < 1.2 * noise_share and rep["rel_mse"] < 1.2 * noise_share, (rel, noise_share)
    assert rep["rank"] == 8 and rep["energy"] > 0.99
    mean, evals, _ = pca(x)
    assert (mean - 5).abs().max() < 0.2 and rank_for_energy(evals, 0.999) == 8  # multiple of 8 above 8 signal dims


def test_rank_for_energy_rounds_up_to_8():
    evals = torch.tensor([10.0] * 3 + [0.001] * 29)
    assert rank_for_energy(evals, 0.99) == 8 and rank_for_energy(evals, 1.0) == 32


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_fitted_scale_beats_absmax(bits):
    z = torch.randn(5000, 8) * torch.linspace(4, 0.5, 8)
    z[0] = 50  # one extreme token: absmax would waste the grid on it
    s = fit_scale(z, bits)

    def mse(scale, x=z):  # per channel
        return (dequantize_latent(quantize_latent(x, scale, bits), scale, bits) - x).pow(2).mean(0)

    assert mse(s).sum() < 0.7 * mse(z.abs().amax(0)).sum()
    # Gaussian data: near the optimal uniform quantizer of a Gaussian (0.1175 / 0.0374 / 0.0115 σ²)
    g = z[1:]
    rel = mse(fit_scale(g, bits), g) / g.var(0)
    assert rel.max() < (0.13 if bits == 2 else 0.042 if bits == 3 else 0.014), rel


def test_sampler_groups_and_tensors():
    sampler = LatentSampler(("k", "v"), max_tokens=300)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # two batches of [B=2, K, T=100, d] per layer, as run_layers feeds them
        for i in range(3):
            for name in ("k", "v", "q"):
                sampler(i, name, torch.randn(2, 2, 100, 16, generator=g))
    assert sampler.get(0, "k").shape == (300, 2, 16) and (2, "q") not in sampler.samples
    kv = LatentKVConfig(codec="latent-layer", bits=4, rope="post",
                        latent=LatentConfig(rank_k=16, rank_v=64, group_layers=2))
    tensors, rep = fit_latent_tensors(ARGS, kv, sampler)
    assert layer_groups(3, 2) == [[0, 1], [2]]
    assert tensors["kv.groups.0.k_basis"].shape == (64, 16) and tensors["kv.groups.1.v_basis"].shape == (32, 32)
    assert tensors["kv.groups.1.k_scale"].shape == (16,) and len(rep["groups"]) == 2


def test_model_shape_errors():
    def kv(**lat):
        return LatentKVConfig(codec="latent-layer", bits=4, latent=LatentConfig(**lat))

    with pytest.raises(UserError, match="kv.latent.group_layers 4 is larger than the model's 3 layers"):
        check_latent_recipe(ARGS, kv(group_layers=4))
    with pytest.raises(UserError, match="kv.latent.rank_k 72 exceeds the 64 dims"):
        check_latent_recipe(ARGS, kv(group_layers=2, rank_k=72))
    with pytest.raises(UserError, match="kv.latent.rank_v 40 exceeds the 32 dims"):
        check_latent_recipe(ARGS, LatentKVConfig(codec="latent-head", bits=4, latent=LatentConfig(rank_v=40)))
    with pytest.raises(UserError, match="kv.latent.group_layers: cross-layer sharing needs one KV shape"):
        concat_group([torch.zeros(5, 2, 16), torch.zeros(5, 4, 16)], "k")


@pytest.mark.parametrize("kv,match", [
    ({"codec": "latent-head", "bits": 4, "latent": {"rank_k": -8}}, "kv.latent.rank_k must be a positive multiple"),
    ({"codec": "latent-head", "bits": 4, "latent": {"rank_v": 12}}, "kv.latent.rank_v must be a positive multiple"),
    ({"codec": "latent-head", "bits": 4, "latent": {"group_layers": 2}}, "kv.latent.group_layers: codec 'latent-head'"),
    ({"codec": "latent-layer", "bits": 4, "latent": {"group_layers": 0}}, "kv.latent.group_layers must be >= 1"),
    ({"codec": "latent-layer", "bits": 5}, "kv.bits: codec 'latent-layer' supports bits"),
    ({"codec": "latent-head", "bits": 4, "latent": {"outlier_frac": 0.5}}, "kv.latent.outlier_frac"),
    ({"codec": "latent-head", "bits": 4, "latent": {"energy": 0}}, "kv.latent.energy"),
    ({"codec": "kivi", "bits": 2, "latent": {"rank_k": 8}}, "unknown key 'latent' for codec 'kivi'"),
    ({"codec": "latent-head", "bits": 4, "latent": {"rank": 8}}, "unknown key 'rank'"),
])
def test_recipe_errors_name_the_field(kv, match):
    with pytest.raises(UserError, match=match):
        parse_recipe({"kv": kv})


def test_shipped_recipes_parse():
    head = load_recipe("moec/recipes/ablations/kv-latent-head.yaml").kv
    layer = load_recipe("moec/recipes/ablations/kv-latent-layer.yaml").kv
    assert head.codec == "latent-head" and head.latent.group_layers == 1 and head.latent.outlier_frac <= 0.005
    assert layer.codec == "latent-layer" and layer.latent.group_layers == 4 and layer.latent.rank_k == 48
    assert parse_recipe({"kv": {"codec": "latent-layer", "bits": 16}}).kv.latent.group_layers == 4  # default G
    from pathlib import Path

    variants = sorted(Path("moec/recipes").glob("**/kv-latent-*.yaml"))  # shipped and moec/recipes/ablations/
    assert len(variants) >= 6
    for p in variants:  # every variant, shipped or ablation, parses, and its name is its file name
        assert load_recipe(str(p)).name == p.stem
