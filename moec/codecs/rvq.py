"""rvq-tiered (seed 002): tiered residual VQ with its own cache; calibration in calibrate/rvq.py, the
cache in runtime/rvq.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import UserError
from ..registry import KVCodecSpec, register_kv
from .base import TieredConfig


@dataclass
class RVQConfig:
    """Tiered residual VQ KV (seed 002; moec/runtime/rvq.py): the middle tier (blocks leaving the fp16
    window) is a residual VQ with `mid_sizes` centroids per stage over sub-vectors of `mid_dim` channels
    (Σ log2(size) / dim bits per element); blocks whose tokens are all `archive_after` or more tokens
    back are re-encoded into the archive tier (`arch_sizes`, `arch_dim`); archive_after 0: one tier.
    Codebooks per layer, per sub-vector position, per KV head (or `shared_heads`), fitted by k-means on
    post- or pre-RoPE keys (`rope`) and values (moec/calibrate/rvq.py)."""

    mid_sizes: list[int] = field(default_factory=lambda: [64, 64])
    mid_dim: int = 4
    archive_after: int = 4096
    arch_sizes: list[int] = field(default_factory=lambda: [128])
    arch_dim: int = 4
    rope: Literal["pre", "post"] = "post"
    shared_heads: bool = False
    iters: int = 10  # Lloyd iterations per stage (at most; stops when the error stops falling)
    max_samples: int = 4096  # calibration tokens per layer the codebooks are fitted on

    def __post_init__(self):
        for name in ("mid_sizes", "arch_sizes"):
            sizes = getattr(self, name)
            if not sizes and (name == "mid_sizes" or self.archive_after):
                raise UserError(f"kv.rvq.{name} must list at least one codebook size")
            for c in sizes:
                if c < 2 or c > 2**16 or c & (c - 1):
                    raise UserError(f"kv.rvq.{name}: codebook size {c} is not a power of two in 2..65536")
        for name in ("mid_dim", "arch_dim"):
            if getattr(self, name) < 1:
                raise UserError(f"kv.rvq.{name} must be >= 1, got {getattr(self, name)}")
        if self.archive_after < 0:
            raise UserError(f"kv.rvq.archive_after must be >= 0 (0: no archive tier), got {self.archive_after}")
        if self.iters < 1 or self.max_samples < 16:
            raise UserError(f"kv.rvq.iters must be >= 1 and kv.rvq.max_samples >= 16, got {self.iters}, "
                            f"{self.max_samples}")


@dataclass
class RVQKVConfig(TieredConfig):
    """rvq-tiered (bits: a nominal label; the stored bits follow from the codebook sizes)."""

    rvq: RVQConfig | None = None  # defaults when omitted

    def __post_init__(self):
        super().__post_init__()
        self.rvq = self.rvq or RVQConfig()
        if self.rvq.archive_after and self.rvq.archive_after <= self.window + self.block:
            raise UserError(f"kv.rvq.archive_after {self.rvq.archive_after} must exceed kv.window + kv.block "
                            f"({self.window} + {self.block}): tier boundaries out of order")


register_kv(KVCodecSpec(
    "rvq-tiered", config=RVQKVConfig, bits=(1, 2, 3, 4), family="rvq",
    check="moec.calibrate.rvq:check_rvq_recipe", sampler="moec.calibrate.rvq:rvq_sampler",
    fit="moec.calibrate.rvq:fit_rvq_tensors", tensor_names="moec.runtime.rvq:rvq_tensor_names",
    cache_factory="moec.runtime.rvq:rvq_cache_factory",
    random_tensors="moec.runtime.rvq:random_rvq_tensors",
    description="seed 002: tiered residual VQ"))
