"""KV-cache codecs: KIVI (uniform asymmetric) and NUQ-outlier (non-uniform levels + sparse fp16 outliers).

A codec encodes one block of tokens leaving the fp16 window, for one layer, keys or values:

    encode(x [B, K, N, d] fp32, kind "k"|"v") -> {field: tensor}     N = block tokens
    decode(fields, kind) -> [B, K, N', d] fp32                        fields sliced over whole blocks

Every field is stored with its token or block axis at dim 2 (`fields()` says which), so the cache
(moec/runtime/kvtiered.py) can keep preallocated buffers and count stored bytes from them.

Packed code layout (`pack_codes`, along the channel axis of each token, n channels; "planar": a
contiguous run of bytes unpacks with one shift into a contiguous run of channels, so the fused
kernel (moec/kernels/kv_decode_attention.py) loads whole [tokens, bytes] tiles and never gathers):
    2-bit: n/4 bytes; byte i holds channel i + m·n/4 in bits 2m..2m+1 (m = 0..3)
    4-bit: n/2 bytes; byte i holds channel i in bits 0..3 and channel i + n/2 in bits 4..7
    3-bit: n/4 + n/8 bytes: first the 2-bit layout of the low two bits (code & 3), then a bit
           plane of the high bit: byte n/4 + i holds bit 2 of channel i + m·n/8 in bit m (m = 0..7)
q·k is invariant to a permutation of the channels, so a kernel may work in this order.

KIVI (Liu et al. 2024, "KIVI: a tuning-free asymmetric 2bit quantization for KV cache"): keys
per channel over a group of tokens (here the cache block, so group = block tokens), values per
token over groups of `group_size` channels; min/zero and scale in fp16.

NUQ-outlier (seed 003, after KVQuant, Hooper et al. 2024): keys divided by an offline per-channel
scale [K, d] (pre- or post-RoPE), values by a per-token absmax scale (fp16) computed after removing
outliers; both rounded to the nearest of 2^bits levels in [-1, 1] (the seed's fixed
{-1, -1/3, 1/3, 1} grid or levels fitted by weighted k-means, moec/calibrate/fit_kv.py). Outliers:
a fixed count per block, ceil(outlier_frac · N · d) elements of each (batch row, KV head) block with
the largest |x / scale| (keys: channel-normalized; values: raw magnitude), kept as int16 index
(t·d + c inside the block) plus an fp16 *residual* x − dequant(code). The residual makes dequant
additive (dense dequant + scatter-add), which the fused kernel needs; x is recovered to fp16
precision, as if x itself were stored in fp16.
"""

from __future__ import annotations

import math

import torch

FIXED_LEVELS = {
    2: (-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0),  # seed 003's grid
    3: tuple(-1.0 + 2.0 * i / 7.0 for i in range(8)),  # its 3-bit analogue: 8 evenly spaced levels
}


# -- bit packing ---------------------------------------------------------------------------------------

def packed_width(n: int, bits: int) -> int:
    assert n * bits % 8 == 0 and (bits != 3 or n % 8 == 0), (n, bits)
    return n * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., n] integer in [0, 2^bits) -> uint8 [..., n·bits/8] (planar layout, module docstring)."""
    n = codes.shape[-1]
    packed_width(n, bits)
    c = codes.to(torch.int32)
    if bits == 3:
        return torch.cat([pack_codes(c & 3, 2), _pack_planes(c >> 2, 1)], dim=-1)
    assert bits in (2, 4), bits
    return _pack_planes(c, bits)


def _pack_planes(c: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] -> [..., n·bits/8]: byte i holds channel i + m·(n·bits/8) in bits m·bits (m < 8/bits)."""
    per = 8 // bits
    c = c.reshape(*c.shape[:-1], per, c.shape[-1] // per)  # [..., m, i]
    shifts = (torch.arange(per, device=c.device, dtype=torch.int32) * bits)[:, None]
    return (c << shifts).sum(-2).to(torch.uint8)


def _unpack_planes(p: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = (torch.arange(per, device=p.device, dtype=torch.int32) * bits)[:, None]
    return ((p[..., None, :] >> shifts) & (2**bits - 1)).flatten(-2)  # [..., m·w + i]


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_codes: uint8 [..., n·bits/8] -> int64 codes [..., n]."""
    p = packed.to(torch.int32)
    if bits == 3:
        return (_unpack_planes(p[..., : n // 4], 2) | (_unpack_planes(p[..., n // 4 :], 1) << 2)).long()
    assert bits in (2, 4), bits
    return _unpack_planes(p, bits).long()


# -- codecs ------------------------------------------------------------------------------------------

class KIVICodec:
    """Uniform asymmetric; keys per channel over the block's tokens, values per token per channel group."""

    name = "kivi"

    def __init__(self, bits: int, head_dim: int, group_size: int = 32):
        assert bits in (2, 4), bits
        assert head_dim % group_size == 0, (head_dim, group_size)
        self.bits, self.d, self.g = bits, head_dim, group_size

    def fields(self, kind: str) -> dict[str, tuple[str, tuple, torch.dtype]]:
        """name -> (axis kind "token"|"block", trailing shape, dtype)."""
        w = packed_width(self.d, self.bits)
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
        return {"codes": pack_codes(codes, self.bits), "scale": scale, "zero": zero}

    def decode(self, f: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
        codes = unpack_codes(f["codes"], self.bits, self.d).float()  # [B, K, S, d]
        B, K, S, d = codes.shape
        if kind == "k":
            nb = f["scale"].shape[2]
            c = codes.view(B, K, nb, S // nb, d)
            return (c * f["scale"].float()[:, :, :, None] + f["zero"].float()[:, :, :, None]).view(B, K, S, d)
        c = codes.view(B, K, S, d // self.g, self.g)
        return (c * f["scale"].float()[..., None] + f["zero"].float()[..., None]).view(B, K, S, d)

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return {}


class NUQOutlierCodec:
    """Non-uniform levels, per-channel (keys, offline) / per-token (values) scales, sparse fp16 outliers."""

    name = "nuq-outlier"

    def __init__(self, bits: int, head_dim: int, block: int, k_levels: torch.Tensor, v_levels: torch.Tensor,
                 k_scale: torch.Tensor, outlier_frac: float):
        assert bits in (2, 3), bits
        assert k_levels.shape == v_levels.shape == (2**bits,), (k_levels.shape, v_levels.shape)
        self.bits, self.d, self.block = bits, head_dim, block
        self.levels = {"k": k_levels.float().sort().values, "v": v_levels.float().sort().values}
        self.k_scale = k_scale.float().clamp_min(1e-6)  # [K, d]
        self.n_out = math.ceil(outlier_frac * block * head_dim - 1e-9) if outlier_frac > 0 else 0

    def fields(self, kind: str) -> dict[str, tuple[str, tuple, torch.dtype]]:
        f = {"codes": ("token", (packed_width(self.d, self.bits),), torch.uint8)}
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
        out["codes"] = pack_codes(codes, self.bits)
        if self.n_out:
            deq = (self.levels[kind].to(x.device)[codes] * scale).reshape(B, K, N * d)
            resid = flat.gather(-1, idx) - deq.gather(-1, idx)
            out["out_idx"] = idx.to(torch.int16)[:, :, None]
            out["out_val"] = resid.half()[:, :, None]
        return out

    def decode(self, f: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
        codes = unpack_codes(f["codes"], self.bits, self.d)
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
                 k_weight: torch.Tensor | None = None):
        super().__init__(bits, head_dim, block, k_levels, v_levels, k_scale, outlier_frac)
        self.k_center = None if k_center is None else k_center.float()  # [K, d]
        self.k_weight = None if k_weight is None else k_weight.float()  # [K, d]
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
        out = {"codes": pack_codes(codes, self.bits)}
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
        return out
