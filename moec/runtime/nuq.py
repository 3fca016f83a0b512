"""The NUQ-outlier KV codec (non-uniform levels + sparse fp16 outliers; KIVI is in kivi.py).

A codec encodes one block of tokens leaving the fp16 window, for one layer, keys or values:

    encode(x [B, K, N, d] fp32, kind "k"|"v") -> {field: tensor}     N = block tokens
    decode(fields, kind) -> [B, K, N', d] fp32                        fields sliced over whole blocks

Every field is stored with its token or block axis at dim 2 (`fields()` says which), so the cache
(moec/runtime/kvtiered.py) can keep preallocated buffers and count stored bytes from them.

Packed code layout (moec/formats/bitpack.py Layout.PLANAR, along the channel axis of each token, n
channels; a contiguous run of bytes unpacks with one shift into a contiguous run of channels, so the fused
kernel (moec/kernels/kv_decode_attention.py) loads whole [tokens, bytes] tiles and never gathers):
    2-bit: n/4 bytes; byte i holds channel i + m·n/4 in bits 2m..2m+1 (m = 0..3)
    4-bit: n/2 bytes; byte i holds channel i in bits 0..3 and channel i + n/2 in bits 4..7
    3-bit: n/4 + n/8 bytes: first the 2-bit layout of the low two bits (code & 3), then a bit
           plane of the high bit: byte n/4 + i holds bit 2 of channel i + m·n/8 in bit m (m = 0..7)
q·k is invariant to a permutation of the channels, so a kernel may work in this order.

NUQ-outlier (seed 003, after KVQuant, Hooper et al. 2024): keys divided by an offline per-channel
scale [K, d] (pre- or post-RoPE), values by a per-token absmax scale (fp16) computed after removing
outliers; both rounded to the nearest of 2^bits levels in [-1, 1] (the seed's fixed
{-1, -1/3, 1/3, 1} grid or levels fitted by weighted k-means, moec/calibrate/nuq.py). Outliers:
a fixed count per block, ceil(outlier_frac · N · d) elements of each (batch row, KV head) block with
the largest |x / scale| (keys: channel-normalized; values: raw magnitude), kept as int16 index
(t·d + c inside the block) plus an fp16 *residual* x − dequant(code). The residual makes dequant
additive (dense dequant + scatter-add), which the fused kernel needs; x is recovered to fp16
precision, as if x itself were stored in fp16.

`rotate: hadamard` (NUQCenteredCodec.rotation, a per-layer [d, d] randomized Hadamard, moec/rotation.py):
the codec is calibrated on k·R and v·R and the cache stores and attends in that basis
(kvtiered.LayerRotations), so heavy channels are spread before quantization and the recipe can drop the
outliers, which are most of the fused kernel's time (moec/recipes/kv-nuq2-rot.yaml).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..errors import FormatError
from ..formats.bitpack import pack_planar, planar_width, unpack_planar
from ..formats.kvsection import layer_tensor
from ..rotation import block_hadamard

if TYPE_CHECKING:
    from ..kernels.kv_quantize_pack import NUQView

FIXED_LEVELS = {
    2: (-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0),  # seed 003's grid
    3: tuple(-1.0 + 2.0 * i / 7.0 for i in range(8)),  # its 3-bit analogue: 8 evenly spaced levels
}


# -- codecs ------------------------------------------------------------------------------------------

class NUQOutlierCodec:
    """Non-uniform levels, per-channel (keys, offline) / per-token (values) scales, sparse fp16 outliers."""

    name = "nuq-outlier"
    # the fused decode-attention kernel (moec/kernels/kv_decode_attention.py) reads this codec's fields: the
    # tiered cache's kernel path (kvtiered.kernel_path) asks for this capability, not for the codec's name
    fused_decode_attention = True

    def __init__(self, bits: int, head_dim: int, block: int, k_levels: torch.Tensor, v_levels: torch.Tensor,
                 k_scale: torch.Tensor, outlier_frac: float):
        assert bits in (2, 3), bits
        assert k_levels.shape == v_levels.shape == (2**bits,), (k_levels.shape, v_levels.shape)
        self.bits, self.d, self.block = bits, head_dim, block
        self.levels = {"k": k_levels.float().sort().values, "v": v_levels.float().sort().values}
        self.k_scale = k_scale.float().clamp_min(1e-6)  # [K, d]
        self.n_out = math.ceil(outlier_frac * block * head_dim - 1e-9) if outlier_frac > 0 else 0
        self._kernel_views: dict[str, NUQView] = {}  # device -> kernel_view(device)

    def fields(self, kind: str) -> dict[str, tuple[str, tuple, torch.dtype]]:
        f = {"codes": ("token", (planar_width(self.d, self.bits),), torch.uint8)}
        if kind == "v":
            f["scale"] = ("token", (), torch.float16)
        if self.n_out:
            f["out_idx"] = ("block", (self.n_out,), torch.int16)
            f["out_val"] = ("block", (self.n_out,), torch.float16)
        return f

    def _nearest(self, xn: torch.Tensor, kind: str) -> torch.Tensor:
        lev = self.levels[kind].to(xn.device)
        return torch.bucketize(xn.contiguous(), (lev[1:] + lev[:-1]) / 2)

    def encode(self, x: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        B, K, N, d = x.shape
        assert N == self.block, (N, self.block)
        flat = x.reshape(B, K, N * d)
        out: dict[str, torch.Tensor] = {}
        if kind == "k":
            scale = self.k_scale.to(x.device)[None, :, None, :]  # [1, K, 1, d]
            mag = (x / scale).abs().reshape(B, K, N * d)
        else:
            mag = flat.abs()
        if self.n_out:
            # [B, K, n_out], ascending (a canonical order: the GPU quantize-pack kernel writes the same)
            idx = mag.topk(self.n_out, dim=-1).indices.sort(dim=-1).values
        if kind == "v":
            core = flat.abs()
            if self.n_out:
                core = core.scatter(-1, idx, 0.0)
            scale = core.view(B, K, N, d).amax(-1, keepdim=True).clamp_min(1e-6).half()  # [B, K, N, 1]
            out["scale"] = scale.squeeze(-1)
            scale = scale.float()
        codes = self._nearest(x / scale, kind)  # [B, K, N, d]
        out["codes"] = pack_planar(codes, self.bits)
        if self.n_out:
            deq = (self.levels[kind].to(x.device)[codes] * scale).reshape(B, K, N * d)
            resid = flat.gather(-1, idx) - deq.gather(-1, idx)
            out["out_idx"] = idx.to(torch.int16)[:, :, None]
            out["out_val"] = resid.half()[:, :, None]
        return out

    def decode(self, f: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
        codes = unpack_planar(f["codes"], self.bits, self.d)
        B, K, S, d = codes.shape
        x = self.levels[kind].to(codes.device)[codes]
        if kind == "k":
            x = x * self.k_scale.to(codes.device)[None, :, None, :]
        else:
            x = x * f["scale"].float()[..., None]
        if self.n_out:
            nb = S // self.block
            x = x.reshape(B, K, nb, self.block * d)
            x = x.scatter_add(-1, f["out_idx"].long(), f["out_val"].float())
        return x.reshape(B, K, S, d)

    def static_tensors(self) -> dict[str, torch.Tensor]:
        """Per-layer tensors shared by every token (counted once per layer in stored bytes)."""
        return {"k_scale": self.k_scale, "k_levels": self.levels["k"], "v_levels": self.levels["v"]}

    def kernel_view(self, device) -> NUQView:
        """This codec's tensors on `device` in the forms the kernels take (kv_quantize_pack, and the
        cache's kv_decode_attention calls), made once per device and kept on the codec."""
        key = str(device)
        if key not in self._kernel_views:
            from ..kernels.kv_quantize_pack import NUQView

            k_lev, v_lev = (self.levels[kind].to(device).contiguous() for kind in "kv")
            extra = (getattr(self, "k_center", None), getattr(self, "k_weight", None),  # NUQCenteredCodec
                     getattr(self, "k_err2", None))
            self._kernel_views[key] = NUQView(
                self.bits, self.block, self.n_out, self.k_scale.to(device).contiguous(), k_lev, v_lev,
                ((k_lev[1:] + k_lev[:-1]) / 2).contiguous(), ((v_lev[1:] + v_lev[:-1]) / 2).contiguous(),
                *(None if t is None else t.to(device).float().contiguous() for t in extra))
        return self._kernel_views[key]


class NUQCenteredCodec(NUQOutlierCodec):
    """nuq-outlier with asymmetric keys and, optionally, outliers chosen by query-weighted error.

    Keys: k ≈ k_center + k_lev[code]·k_scale, with an offline per-channel center [K, d] (the midpoint
    of the calibrated quantile range, so a channel whose values sit off zero uses all its levels;
    recipe `k_center: true`). Outliers of keys (`outlier_select: weighted-error`): the elements whose
    rounding error, weighted by the channel's calibrated query RMS k_weight [K, d] (pair-averaged over
    the RoPE rotation pairs, so equal pre- and post-RoPE), is largest: the greedy choice that most
    reduces the expected q·k score error, instead of the largest |k / k_scale|. Values as in the
    parent. Same stored fields as NUQOutlierCodec; k_center and k_weight are per-layer statics. The
    fused kernels take both: kv_decode_attention adds the center (to the key tile before the RoPE
    rotation, or as q·center on every history score post-RoPE); kv_quantize_pack subtracts it and
    selects outliers by the weighted error, bit-identical to this encode.
    """

    def __init__(self, bits: int, head_dim: int, block: int, k_levels: torch.Tensor, v_levels: torch.Tensor,
                 k_scale: torch.Tensor, outlier_frac: float, k_center: torch.Tensor | None = None,
                 k_weight: torch.Tensor | None = None, rotation: torch.Tensor | None = None,
                 k_err2: torch.Tensor | None = None):
        super().__init__(bits, head_dim, block, k_levels, v_levels, k_scale, outlier_frac)
        self.k_center = None if k_center is None else k_center.float()  # [K, d]
        self.k_weight = None if k_weight is None else k_weight.float()  # [K, d]
        # [d, d] (`rotate: hadamard`): the codec sees k·R and v·R; the cache rotates (kvtiered.Rotation)
        self.rotation = None if rotation is None else rotation.float()
        # [K, d] (`score_bias`): mean squared key rounding error per channel (calibration); history scores get
        # + Σ_c q_c²·k_err2_c·sm_scale²/2 (kvtiered.history_bias)
        self.k_err2 = None if k_err2 is None else k_err2.float()
        assert self.k_center is None or self.k_center.shape == self.k_scale.shape, (k_center.shape, k_scale.shape)
        assert self.k_weight is None or self.k_weight.shape == self.k_scale.shape, (k_weight.shape, k_scale.shape)

    def encode(self, x: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        if kind == "v":
            return super().encode(x, kind)
        B, K, N, d = x.shape
        assert N == self.block, (N, self.block)
        if self.k_center is not None:
            x = x - self.k_center.to(x.device)[None, :, None, :]
        scale = self.k_scale.to(x.device)[None, :, None, :]  # [1, K, 1, d]
        codes = self._nearest(x / scale, "k")  # [B, K, N, d]
        out = {"codes": pack_planar(codes, self.bits)}
        if self.n_out:
            deq = self.levels["k"].to(x.device)[codes] * scale
            if self.k_weight is None:
                mag = (x / scale).abs()
            else:
                mag = (x - deq).abs() * self.k_weight.to(x.device)[None, :, None, :]
            idx = mag.reshape(B, K, N * d).topk(self.n_out, dim=-1).indices.sort(dim=-1).values
            resid = x.reshape(B, K, N * d).gather(-1, idx) - deq.reshape(B, K, N * d).gather(-1, idx)
            out["out_idx"] = idx.to(torch.int16)[:, :, None]
            out["out_val"] = resid.half()[:, :, None]
        return out

    def decode(self, f: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
        x = super().decode(f, kind)
        if kind == "k" and self.k_center is not None:
            x = x + self.k_center.to(x.device)[None, :, None, :]
        return x

    def static_tensors(self) -> dict[str, torch.Tensor]:
        out = super().static_tensors()
        if self.k_center is not None:
            out["k_center"] = self.k_center
        if self.k_weight is not None:
            out["k_weight"] = self.k_weight
        if self.rotation is not None:
            out["rotation"] = self.rotation
        if self.k_err2 is not None:
            out["k_err2"] = self.k_err2
        return out


def quantize_pack_supports(codec) -> bool:
    """Whether moec/kernels/kv_quantize_pack.py reproduces codec.encode: a 2/3-bit NUQOutlierCodec or
    NUQCenteredCodec with the fields it writes, within the kernel's shape limits (a codec with other options
    or fields keeps its torch encode)."""
    if type(codec) not in (NUQOutlierCodec, NUQCenteredCodec) or codec.bits not in (2, 3):
        return False
    N, d = codec.block, codec.d
    want = {"k": {"codes"}, "v": {"codes", "scale"}}
    if codec.n_out:
        want = {kind: f | {"out_idx", "out_val"} for kind, f in want.items()}
    return (N & (N - 1) == 0 and d & (d - 1) == 0 and d >= 16 and N * d < 2**15
            and all(set(codec.fields(kind)) == want[kind] for kind in "kv"))


# -- registry hooks (moec/registry.py): building the per-layer codecs of a packed checkpoint --------------

def nuq_parts(section: dict) -> tuple[str, ...]:
    """The per-layer calibration tensors of a nuq-outlier section (k_center / k_weight by its options)."""
    return ("k_scale", "k_levels", "v_levels") + (("k_center",) if section.get("k_center") else ()) + (
        ("k_weight",) if section.get("outlier_select") == "weighted-error" else ()) + (
        ("rotation",) if section.get("rotate", "none") != "none" else ()) + (
        ("k_err2",) if section.get("score_bias") else ())


def nuq_tensor_names(section: dict, args) -> list[str]:
    return [layer_tensor(i, p) for i in range(args.n_layers) for p in nuq_parts(section)]


def nuq_rope_pre(section: dict) -> bool:
    return section["rope"] == "pre"


def nuq_layer_codecs(section: dict, tensors: dict[str, torch.Tensor], args) -> list[NUQOutlierCodec]:
    """Per-layer NUQOutlierCodec / NUQCenteredCodec; FormatError when a tensor is missing or misshapen."""
    L, K, d, bits = args.n_layers, args.n_kv_heads, args.head_dim, section["bits"]
    shapes = {"k_scale": (K, d), "k_levels": (2**bits,), "v_levels": (2**bits,), "k_center": (K, d),
              "k_weight": (K, d), "rotation": (d, d), "k_err2": (K, d)}
    parts_of = nuq_parts(section)
    codecs = []
    for i in range(L):
        parts = {}
        for part in parts_of:
            t = tensors.get(layer_tensor(i, part))
            if t is None:
                raise FormatError(f"KV calibration tensor {layer_tensor(i, part)} is missing")
            if tuple(t.shape) != shapes[part]:
                raise FormatError(f"KV calibration tensor {layer_tensor(i, part)} has shape {list(t.shape)}, "
                                  f"the model needs {list(shapes[part])} ({L} layers, {K} KV heads, head_dim {d})")
            parts[part] = t
        if len(parts_of) > 3:
            codecs.append(NUQCenteredCodec(bits, d, section["block"], parts["k_levels"], parts["v_levels"],
                                           parts["k_scale"], section["outlier_frac"], parts.get("k_center"),
                                           parts.get("k_weight"), parts.get("rotation"), parts.get("k_err2")))
        else:
            codecs.append(NUQOutlierCodec(bits, d, section["block"], parts["k_levels"], parts["v_levels"],
                                          parts["k_scale"], section["outlier_frac"]))
    extra = sorted(set(tensors) - set(nuq_tensor_names(section, args)))
    if extra:
        raise FormatError(f"KV calibration tensor {extra[0]} does not belong to a {L}-layer model")
    return codecs


def random_nuq_tensors(args, section: dict, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    """Stand-in calibration: the seed's fixed levels; key scales, centers (`k_center`) and query weights
    (`outlier_select: weighted-error`) drawn around 1, 0 and 1 (not constant: with constant weights
    the errors of equal fp16 inputs tie, and the kernel's and torch's outlier choices part on ties)."""
    lev = torch.tensor(FIXED_LEVELS[section["bits"]])
    shape = (args.n_kv_heads, args.head_dim)
    out = {}
    for i in range(args.n_layers):
        out[layer_tensor(i, "k_scale")] = torch.rand(shape, generator=gen) + 0.5
        out[layer_tensor(i, "k_levels")] = lev.clone()
        out[layer_tensor(i, "v_levels")] = lev.clone()
        if section.get("k_center", False):
            out[layer_tensor(i, "k_center")] = torch.randn(shape, generator=gen) * 0.1
        if section.get("outlier_select", "magnitude") == "weighted-error":
            out[layer_tensor(i, "k_weight")] = torch.rand(shape, generator=gen) + 0.5
        if section.get("rotate", "none") != "none":
            out[layer_tensor(i, "rotation")] = block_hadamard(args.head_dim, seed=i)
        if section.get("score_bias"):
            out[layer_tensor(i, "k_err2")] = torch.rand(shape, generator=gen) * 0.05
    return {n: t.to(device) for n, t in out.items()}
