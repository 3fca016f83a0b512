"""nuq-outlier (seed 003): non-uniform fitted levels with sparse fp16 outliers (KVQuant-style), a block
codec of the tiered cache; calibration in calibrate/nuq.py, the codec in runtime/nuq.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import UserError
from ..registry import KVCodecSpec, register_kv
from .base import TieredConfig


@dataclass
class NUQConfig(TieredConfig):
    """Seed 003 (runtime/nuq.NUQOutlierCodec / NUQCenteredCodec): non-uniform levels, fp16 outliers."""

    outlier_frac: float = 0.01  # fraction of each block's elements kept as fp16 residuals
    levels: Literal["fixed", "fitted"] = "fitted"  # the seed grid, or weighted k-means on calibration
    rope: Literal["pre", "post"] = "pre"  # quantize keys before or after RoPE
    k_center: bool = False  # per-channel key center calibrated offline (asymmetric keys)
    # key outliers: largest |k/scale|, or largest rounding error weighted by the channel's query RMS
    outlier_select: Literal["magnitude", "weighted-error"] = "magnitude"
    k_scale_fit: Literal["quantile", "mse"] = "quantile"  # key scale: quantile of |k|, or MSE-searched
    # keys and values rotated along head_dim by a per-layer randomized Hadamard before quantization
    # (QuaRot); the cache attends in the rotated basis (q rotated, the output rotated back)
    rotate: Literal["none", "hadamard"] = "none"
    # add E[(q·e)²]/2 to every history score, e the key quantization error (calibrated per channel): the
    # softmax mass of a quantized key is E[exp(q·k) | k̂] = exp(q·k̂ + σ²/2), not exp(q·k̂)
    score_bias: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.outlier_frac <= 0.1:
            raise UserError(f"kv.outlier_frac must be in [0, 0.1], got {self.outlier_frac}")
        if self.rotate != "none" and self.rope == "pre":
            raise UserError("kv.rotate: a head_dim rotation needs rope: post (pre-RoPE keys are rotated by RoPE "
                            "after decoding, which does not commute with it)")


register_kv(KVCodecSpec(
    "nuq-outlier", config=NUQConfig, bits=(2, 3), family="nuq",
    check="moec.calibrate.nuq:check_kv_recipe", sampler="moec.calibrate.nuq:nuq_sampler",
    fit="moec.calibrate.nuq:fit_kv_tensors", tensor_names="moec.runtime.nuq:nuq_tensor_names",
    layer_codecs="moec.runtime.nuq:nuq_layer_codecs", random_tensors="moec.runtime.nuq:random_nuq_tensors",
    rope_pre="moec.runtime.nuq:nuq_rope_pre",
    description="seed 003: non-uniform fitted levels, sparse fp16 outliers (KVQuant-style)"))
