"""The KIVI KV codec (Liu et al. 2024, "KIVI: a tuning-free asymmetric 2bit quantization for KV cache"):
keys per channel over a group of tokens (here the cache block, so group = block tokens), values per
token over groups of `group_size` channels; min/zero and scale in fp16. A block codec of the tiered
cache (moec/runtime/kvtiered.py; the codec protocol is in moec/runtime/nuq.py's docstring), registered
in moec/codecs/kivi.py; codes in moec/formats/bitpack.py Layout.PLANAR. No calibration tensors.

Options (issue 37): `rotate: hadamard` quantizes k·R and v·R, R the per-layer randomized Hadamard
block_hadamard(head_dim, seed=layer) (rebuilt at load, not stored); the cache attends in that basis
(kvtiered.LayerRotations). The torch paths serve it; no fused kernel reads kivi. A per-block score bias from
the stored key scales (nuq-outlier's `score_bias` with the error power s²/12 known per block) was tried and
removed: on SmolLM2-135M 2 x 8192 it took rotated KIVI-2 from +7.4% to +19.4% (docs/recipes.md, "Rotated KIVI").
"""

from __future__ import annotations

import torch

from ..errors import FormatError
from ..formats.bitpack import pack_planar, planar_width, unpack_planar
from ..rotation import block_hadamard


class KIVICodec:
    """Uniform asymmetric; keys per channel over the block's tokens, values per token per channel group."""

    name = "kivi"

    def __init__(self, bits: int, head_dim: int, group_size: int = 32, rotation: torch.Tensor | None = None):
        assert bits in (2, 3, 4), bits
        assert head_dim % group_size == 0, (head_dim, group_size)
        self.bits, self.d, self.g = bits, head_dim, group_size
        # [d, d] (`rotate: hadamard`): the codec sees k·R and v·R; the cache rotates (kvtiered.LayerRotations)
        self.rotation = None if rotation is None else rotation.float()

    def fields(self, kind: str) -> dict[str, tuple[str, tuple, torch.dtype]]:
        """name -> (axis kind "token"|"block", trailing shape, dtype)."""
        w = planar_width(self.d, self.bits)
        if kind == "k":
            return {"codes": ("token", (w,), torch.uint8), "scale": ("block", (self.d,), torch.float16),
                    "zero": ("block", (self.d,), torch.float16)}
        ng = self.d // self.g
        return {"codes": ("token", (w,), torch.uint8), "scale": ("token", (ng,), torch.float16),
                "zero": ("token", (ng,), torch.float16)}

    def encode(self, x: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        B, K, N, d = x.shape
        qmax = 2**self.bits - 1
        if kind == "k":
            mn, mx = x.amin(2, keepdim=True), x.amax(2, keepdim=True)  # [B, K, 1, d]
            xs = x
        else:
            xs = x.view(B, K, N, d // self.g, self.g)
            mn, mx = xs.amin(-1, keepdim=True), xs.amax(-1, keepdim=True)  # [B, K, N, d/g, 1]
        scale = ((mx - mn) / qmax).clamp_min(1e-6).half()
        zero = mn.half()
        codes = torch.round((xs - zero.float()) / scale.float()).clamp(0, qmax).view(B, K, N, d)
        if kind == "v":
            scale, zero = scale.squeeze(-1), zero.squeeze(-1)
        return {"codes": pack_planar(codes, self.bits), "scale": scale, "zero": zero}

    def decode(self, f: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
        codes = unpack_planar(f["codes"], self.bits, self.d).float()  # [B, K, S, d]
        B, K, S, d = codes.shape
        if kind == "k":
            nb = f["scale"].shape[2]
            c = codes.view(B, K, nb, S // nb, d)
            return (c * f["scale"].float()[:, :, :, None] + f["zero"].float()[:, :, :, None]).view(B, K, S, d)
        c = codes.view(B, K, S, d // self.g, self.g)
        return (c * f["scale"].float()[..., None] + f["zero"].float()[..., None]).view(B, K, S, d)

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.rotation is None else {"rotation": self.rotation}


# -- registry hook (moec/registry.py) ---------------------------------------------------------------

def kivi_layer_codecs(section: dict, tensors: dict[str, torch.Tensor], args) -> list[KIVICodec]:
    if tensors:
        raise FormatError(f"KV calibration tensor {sorted(tensors)[0]} does not belong to a kivi cache (none do)")
    # the rotation is a function of (head_dim, layer) alone (moec/rotation.py block_hadamard, seed = layer),
    # so it is rebuilt here rather than stored: nothing is calibrated
    rotate = section.get("rotate", "none") == "hadamard"
    return [KIVICodec(section["bits"], args.head_dim, section["group_size"],
                      block_hadamard(args.head_dim, seed=i) if rotate else None) for i in range(args.n_layers)]
