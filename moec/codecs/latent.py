"""latent-head / latent-layer (seeds 000/001): cross-head / cross-layer PCA latents with their own cache;
calibration in calibrate/latent.py, the cache in runtime/latent.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import UserError
from ..registry import KVCodecSpec, register_kv
from .base import TieredConfig


@dataclass
class LatentConfig:
    """Low-rank latent KV (seeds 000/001; Palu, xKV): keys and values of a group of `group_layers`
    adjacent layers (1 for latent-head) projected by a PCA basis fitted on calibration activations
    to `rank_k` / `rank_v` dims (0: the smallest multiple of 8 reaching `energy` of the variance,
    per group), the latent stored at kv.bits with an offline per-channel scale, plus the largest
    `outlier_frac` of each block's reconstruction residual in fp16 (moec/calibrate/latent.py)."""

    rank_k: int = 0
    rank_v: int = 0
    energy: float = 0.99
    group_layers: int = 1
    outlier_frac: float = 0.005

    def __post_init__(self):
        for name in ("rank_k", "rank_v"):
            r = getattr(self, name)
            if r < 0 or r % 8:
                raise UserError(f"kv.latent.{name} must be a positive multiple of 8 (0: by energy), got {r}")
        if not 0.0 < self.energy <= 1.0:
            raise UserError(f"kv.latent.energy must be in (0, 1], got {self.energy}")
        if self.group_layers < 1:
            raise UserError(f"kv.latent.group_layers must be >= 1, got {self.group_layers}")
        if not 0.0 <= self.outlier_frac <= 0.1:
            raise UserError(f"kv.latent.outlier_frac must be in [0, 0.1], got {self.outlier_frac}")


@dataclass
class LatentKVConfig(TieredConfig):
    """latent-head / latent-layer (bits 1 = ternary latent codes: 1.6 bits per latent element)."""

    rope: Literal["pre", "post"] = "pre"
    latent: LatentConfig | None = None  # defaults when omitted (group_layers 4 for latent-layer)

    def __post_init__(self):
        super().__post_init__()
        if self.latent is None:
            self.latent = LatentConfig(group_layers=4 if self.codec == "latent-layer" else 1)
        if self.codec == "latent-head" and self.latent.group_layers != 1:
            raise UserError(f"kv.latent.group_layers: codec 'latent-head' shares nothing across layers "
                            f"(1), got {self.latent.group_layers}; use codec 'latent-layer'")


for _name in ("latent-head", "latent-layer"):
    register_kv(KVCodecSpec(
        _name, config=LatentKVConfig, bits=(1, 2, 3, 4, 16), family="latent",
        check="moec.calibrate.latent:check_latent_recipe", sampler="moec.calibrate.latent:latent_sampler",
        fit="moec.calibrate.latent:fit_latent_tensors", section="moec.runtime.latent:latent_section",
        tensor_names="moec.runtime.latent:latent_tensor_names",
        cache_factory="moec.runtime.latent:latent_cache_factory",
        random_tensors="moec.runtime.latent:random_latent_tensors",
        description="seeds 000/001: cross-head / cross-layer PCA latents"))
