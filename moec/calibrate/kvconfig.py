"""One recipe config class per KV codec (the `kv:` mapping of a recipe), selected by its `codec` key.

The recipe parser (recipe.py) looks the codec up in moec/registry.py and builds that codec's class
strictly: a key the chosen codec does not declare is an error naming the key and the codec. The
packed manifest's `kv` section is `dataclasses.asdict(config)` plus the model's shapes (and derived
keys a codec adds), see moec/formats/kvsection.py.

    kv:
      codec: nuq-outlier      # fp16 | kivi | nuq-outlier | latent-head | latent-layer | rvq-tiered
      bits: 2
      window: 128             # recent tokens kept in fp16 (every tiered codec)
      sinks: 4                # first tokens kept in fp16
      block: 32               # tokens leave the window in blocks, each encoded once
      ...                     # the codec's own keys (below)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import UserError


def check_bits(codec: str, bits: int) -> None:
    from ..registry import kv_codec

    allowed = kv_codec(codec).bits
    if bits not in allowed:
        raise UserError(f"kv.bits: codec {codec!r} supports bits {' or '.join(map(str, allowed))}, got {bits}")


@dataclass
class FP16Config:
    """No compression: the fp16 cache every codec is compared against."""

    codec: str = "fp16"
    bits: int = 16

    def __post_init__(self):
        check_bits(self.codec, self.bits)


@dataclass
class TieredConfig:
    """What every tiered cache shares: fp16 sinks + compressed history + fp16 window
    (moec/runtime/kvtiered.py TierPolicy)."""

    codec: str = ""
    bits: int = 16
    window: int = 128
    sinks: int = 4
    block: int = 32

    def __post_init__(self):
        if self.window < 0:
            raise UserError(f"kv.window must be >= 0, got {self.window}")
        if self.sinks < 0:
            raise UserError(f"kv.sinks must be >= 0, got {self.sinks}")
        if self.block < 8 or self.block % 8:
            raise UserError(f"kv.block must be a positive multiple of 8, got {self.block}")
        check_bits(self.codec, self.bits)


@dataclass
class KIVIConfig(TieredConfig):
    """KIVI: keys quantized per channel over a block, values per token in groups of `group_size`."""

    group_size: int = 32

    def __post_init__(self):
        super().__post_init__()
        if self.group_size < 1:
            raise UserError(f"kv.group_size must be >= 1, got {self.group_size}")


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
