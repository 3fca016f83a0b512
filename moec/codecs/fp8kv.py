"""fp8 (KV): keys and values as fp8 e4m3 with a static per-layer scale each, as vLLM's fp8 KV cache and
compressed-tensors' kv_cache_scheme store them (runtime/fp8kv.py); a block codec of the tiered cache."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from ..registry import KVCodecSpec, register_kv
from .base import TieredConfig


@dataclass
class FP8KVConfig(TieredConfig):
    """fp8 e4m3 keys (post-RoPE) and values, one calibrated scale per layer and kind."""

    bits: int = 8
    rope: str = "post"

    def __post_init__(self):
        super().__post_init__()
        if self.rope != "post":
            raise UserError(f"kv.rope must be post for the fp8 KV codec (vLLM caches post-RoPE keys), "
                            f"got {self.rope!r}")


register_kv(KVCodecSpec(
    "fp8", config=FP8KVConfig, bits=(8,), family="fp8kv",
    sampler="moec.calibrate.fp8kv:fp8_sampler", fit="moec.calibrate.fp8kv:fit_fp8",
    tensor_names="moec.runtime.fp8kv:fp8_tensor_names", layer_codecs="moec.runtime.fp8kv:fp8_layer_codecs",
    random_tensors="moec.runtime.fp8kv:random_fp8_tensors", ct_kv_cache="moec.runtime.fp8kv:ct_kv_cache",
    description="fp8 e4m3 keys and values, one static scale per layer each (vLLM fp8 KV, ct kv_cache_scheme)"))
