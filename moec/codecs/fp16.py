"""fp16: the uncompressed KV cache every KV codec is compared against (the default of a recipe
without `kv:`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import KVCodecSpec, register_kv
from .base import check_bits


@dataclass
class FP16Config:
    """No compression: the fp16 cache every codec is compared against."""

    codec: str = "fp16"
    bits: int = 16

    def __post_init__(self):
        check_bits(self.codec, self.bits)


register_kv(KVCodecSpec("fp16", config=FP16Config, bits=(16,), identity=True, description="uncompressed cache"))
