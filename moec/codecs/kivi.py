"""kivi: KIVI (Liu et al. 2024), keys quantized per channel over a block, values per token in groups,
uniform levels; a block codec of the tiered cache (runtime/kivi.py), no calibration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import UserError
from ..registry import KVCodecSpec, register_kv
from .base import TieredConfig


@dataclass
class KIVIConfig(TieredConfig):
    """KIVI: keys quantized per channel over a block, values per token in groups of `group_size`."""

    group_size: int = 32
    # keys and values rotated along head_dim by the per-layer randomized Hadamard of nuq-outlier's
    # `rotate: hadamard` (moec/rotation.py block_hadamard, seed = layer) before quantization; the cache
    # attends in the rotated basis (runtime/kvtiered.LayerRotations)
    rotate: Literal["none", "hadamard"] = "none"

    def __post_init__(self):
        super().__post_init__()
        if self.group_size < 1:
            raise UserError(f"kv.group_size must be >= 1, got {self.group_size}")
        if self.rotate not in ("none", "hadamard"):
            raise UserError(f"kv.rotate must be none or hadamard, got {self.rotate!r}")


register_kv(KVCodecSpec(
    "kivi", config=KIVIConfig, bits=(2, 3, 4), check="moec.calibrate.kivi:check_kivi",
    layer_codecs="moec.runtime.kivi:kivi_layer_codecs",
    description="KIVI: per-channel keys over a block, per-token values, uniform levels"))
