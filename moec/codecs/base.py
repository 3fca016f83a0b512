"""What the KV codec configs share: the bits check against the registry, and the tiered cache's keys.

A recipe's `kv:` mapping is parsed into its codec's config class (calibrate/recipe.py, strict: a key the
codec does not declare is an error); a packed manifest stores it once, in its resolved `recipe`, and the
runtime's view of the KV codec (runtime/loader.kv_section) is `dataclasses.asdict` of it plus the `kv`
section's shapes and derived keys (formats/kvsection.py).

    kv:
      codec: nuq-outlier      # fp16 | fp8 | kivi | nuq-outlier | latent-head | latent-layer | rvq-tiered
      bits: 2
      window: 128             # recent tokens kept in fp16 (every tiered codec)
      sinks: 4                # first tokens kept in fp16
      block: 32               # tokens leave the window in blocks, each encoded once
      ...                     # the codec's own keys (its module in this package)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError


def check_bits(codec: str, bits: int) -> None:
    from ..registry import kv_codec

    allowed = kv_codec(codec).bits
    if bits not in allowed:
        raise UserError(f"kv.bits: codec {codec!r} supports bits {' or '.join(map(str, allowed))}, got {bits}")


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
