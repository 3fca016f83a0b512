"""mla-nuq: the MLA latent cache (DeepSeek-V2/V3) at 2 bits: rows rotated by randomized Hadamards, per-token
fp16 scales per part (c, k_rope), 4 fitted non-uniform levels per layer and part, fp16 sinks and window.
The cache and its format: moec/runtime/mla_nuq.py; calibration: moec/calibrate/mla_nuq.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import UserError
from ..registry import KVCodecSpec, register_kv
from .base import TieredConfig


@dataclass
class MLANUQConfig(TieredConfig):
    """The latent row [c, k_rope] of MLA models, both parts quantized (2 bits)."""

    bits: int = 2
    # fitted: Lloyd k-means of the rms-normalized rotated latents per layer and part; gaussian: a unit
    # Gaussian's Lloyd-Max levels (no fit)
    levels: Literal["fitted", "gaussian"] = "fitted"

    def __post_init__(self):
        super().__post_init__()
        if self.levels not in ("fitted", "gaussian"):
            raise UserError(f"kv.levels must be fitted or gaussian, got {self.levels!r}")


register_kv(KVCodecSpec(
    "mla-nuq", config=MLANUQConfig, bits=(2,), family="mla_nuq", mla=True,
    check="moec.calibrate.mla_nuq:check_recipe", sampler="moec.calibrate.mla_nuq:sampler",
    fit="moec.calibrate.mla_nuq:fit", tensor_names="moec.runtime.mla_nuq:tensor_names",
    cache_factory="moec.runtime.mla_nuq:cache_factory", random_tensors="moec.runtime.mla_nuq:random_tensors",
    description="MLA latent (DeepSeek) at 2 bits: rotated rows, per-token scales, fitted levels, fp16 window"))
