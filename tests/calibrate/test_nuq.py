"""KV calibration fits (pure functions) and the recipe's KV validation."""

import pytest
import torch

from moec.calibrate.nuq import channel_scale, fit_layer, kmeans_1d, quant_error
from moec.calibrate.recipe import parse_recipe
from moec.errors import UserError


def test_kmeans_recovers_clusters():
    gen = torch.Generator().manual_seed(0)
    centers = torch.tensor([-0.7, -0.2, 0.1, 0.6])
    x = (centers[torch.randint(0, 4, (20000,), generator=gen)] + 0.02 * torch.randn(20000, generator=gen))
    assert torch.allclose(kmeans_1d(x, 4), centers, atol=0.01)


def test_fitted_levels_beat_fixed_grid_on_gaussian_keys():
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(4000, 2, 32, generator=gen), torch.randn(4000, 2, 32, generator=gen)
    fitted, fixed = fit_layer(k, v, 2, 0.01, "fitted"), fit_layer(k, v, 2, 0.01, "fixed")
    xn = (k / fitted["k_scale"]).clamp(-1, 1).flatten()
    assert quant_error(xn, fitted["k_levels"]) < 0.8 * quant_error(xn, fixed["k_levels"])


def test_channel_scale_is_the_quantile():
    x = torch.arange(1, 1001, dtype=torch.float32).view(1000, 1, 1).expand(1000, 2, 3)
    assert torch.equal(channel_scale(x, 0.01), torch.full((2, 3), 990.0))
    assert torch.equal(channel_scale(x, 0.0), torch.full((2, 3), 1000.0))


@pytest.mark.parametrize("kv,field", [
    ({"codec": "kivi", "bits": 5}, "kv.bits"),
    ({"codec": "nuq-outlier", "bits": 4}, "kv.bits"),
    ({"codec": "nuq-outlier", "bits": 2, "outlier_frac": 0.2}, "kv.outlier_frac"),
    ({"codec": "kivi", "bits": 2, "window": -1}, "kv.window"),
    ({"codec": "kivi", "bits": 2, "block": 12}, "kv.block"),
    ({"codec": "kivi", "bits": 2, "windw": 3}, "windw"),
    ({"codec": "nuq-outlier", "bits": 2, "rope": "mid"}, "kv.rope"),
])
def test_bad_kv_recipe_names_the_field(kv, field):
    with pytest.raises(UserError, match=field):
        parse_recipe({"kv": kv})
