"""Quantized expert weights at run time: one `QuantMatrix` per stored [E, O, I] matrix, and the
`ExpertWeights` a MoE layer routes through once any of its w1/w3/w2 is quantized.

Shape legend: E = experts, O = output rows, I = inputs, G = groups per row, K = codebook entries,
N = tokens, A = experts per token, D = model dim.

The stored parts of each codec are listed in formats/codecs.py (WeightCodec). At load every LUT codec
(hls, rtn, fp3) becomes codes + lut [E, O, G, K] (fp32), so one dequantization serves them all:
w[e, o, i] = lut[e, o, i // g, idx[e, o, i]]. `dequant_ref` is the torch reference; on CUDA a
decode step with all three matrices at 2 bits goes through the fused Triton kernel
(kernels/moe_decode.py), elsewhere through `dequant_ref` and torch matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import bitpack

FP3_GRID = torch.tensor([-1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0])
LUT_CODECS = ("hls", "rtn", "fp3")
FUSED_MAX_TOKENS = 16  # decode steps (few tokens) take the fused kernel; prefill the per-expert path


def lut_from_stored(codec: str, bits: int, stored: dict) -> torch.Tensor:
    """lut [E, O, G, K] fp32 from the stored parts of a LUT codec."""
    if codec == "hls":
        return stored["codebook"].float() * stored["cb_scale"].float()[..., None]
    if codec == "rtn":
        k = torch.arange(1 << bits, dtype=torch.float32, device=stored["scale"].device)
        return stored["zero"].float()[..., None] + stored["scale"].float()[..., None] * k
    if codec == "fp3":
        return stored["scale"].float()[..., None] * FP3_GRID.to(stored["scale"].device)
    raise AssertionError(codec)


def dequantize(codec: str, bits: int, shape: tuple[int, int, int], stored: dict) -> torch.Tensor:
    """W_hat [E, O, I] fp32 from the stored parts (the reference the kernels are checked against)."""
    if codec == "fp8":
        return stored["fp8"].float() * stored["scale"].float()[..., None]
    E, O, I = shape
    lut = lut_from_stored(codec, bits, stored)
    G = lut.shape[2]
    idx = bitpack.unpack(stored["codes"], bits, I).view(E, O, G, I // G)
    return lut.gather(-1, idx).reshape(E, O, I)


class QuantMatrix(nn.Module):
    """A stacked matrix [E, O, I] held as codes + lut (LUT codecs) or fp8 + row scales."""

    def __init__(self, codec: str, bits: int, shape: tuple[int, int, int], stored: dict[str, torch.Tensor]):
        super().__init__()
        self.codec, self.bits, self.shape = codec, bits, tuple(shape)
        if codec == "fp8":
            self.register_buffer("fp8", stored["fp8"])
            self.register_buffer("scale", stored["scale"].float())
        else:
            assert codec in LUT_CODECS, codec
            self.register_buffer("codes", stored["codes"])  # [E, O, row_bytes] uint8
            self.register_buffer("lut", lut_from_stored(codec, bits, stored))  # [E, O, G, K] fp32

    def dequant_ref(self, e: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W_hat [O, I] of expert e (or [E, O, I] for all) in `dtype`."""
        E, O, I = self.shape
        sl = slice(None) if e is None else slice(e, e + 1)
        if self.codec == "fp8":
            w = self.fp8[sl].float() * self.scale[sl][..., None]
        else:
            lut = self.lut[sl]
            G = lut.shape[2]
            idx = bitpack.unpack(self.codes[sl], self.bits, I).view(-1, O, G, I // G)
            w = lut.gather(-1, idx).reshape(-1, O, I)
        w = w.to(dtype)
        return w if e is None else w[0]


class ExpertWeights(nn.Module):
    """w1, w3 [E, I, D] and w2 [E, D, I] of one MoE/MLP layer, each a QuantMatrix or a plain tensor."""

    def __init__(self, w1, w3, w2):
        super().__init__()
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            if isinstance(w, QuantMatrix):
                self.add_module(name, w)
            else:
                self.register_buffer(name, w)

    def weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        w = getattr(self, name)
        return w.dequant_ref(e, dtype) if isinstance(w, QuantMatrix) else w[e].to(dtype)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, D] -> [n, D] through expert e (reference path)."""
        w1, w3, w2 = (self.weight(n, e, x.dtype) for n in ("w1", "w3", "w2"))
        return F.silu(x @ w1.t()) * (x @ w3.t()) @ w2.t()

    def fused_ok(self, x: torch.Tensor) -> bool:
        ws = (self.w1, self.w3, self.w2)
        return (x.is_cuda and x.shape[0] <= FUSED_MAX_TOKENS
                and all(isinstance(w, QuantMatrix) and w.codec in LUT_CODECS and w.bits == 2 for w in ws))

    def fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """The fused decode kernel on CUDA (x [N, D], weights/ids [N, A]), or None where it does not apply."""
        if not self.fused_ok(x):
            return None
        from ..kernels.moe_decode import moe_decode  # lazy: importing the runtime does not pull Triton

        return moe_decode(x, ids, weights, self.w1.codes, self.w1.lut, self.w3.codes, self.w3.lut,
                          self.w2.codes, self.w2.lut).to(x.dtype)


def is_quant_expert(name: str, entry: dict) -> bool:
    """Manifest entry of a stored part of a quantized expert/MLP matrix (layers.*.moe.w1/w2/w3)."""
    return entry["codec"] in (*LUT_CODECS, "fp8") and entry.get("param", "").rsplit(".", 1)[-1] in ("w1", "w2", "w3") \
        and ".moe." in entry.get("param", "") and name.startswith(entry["param"] + ".")


def pop_quant_experts(state: dict[str, torch.Tensor], manifest: dict | None) -> dict[str, QuantMatrix]:
    """Remove the stored parts of quantized matrices from `state`; {param: QuantMatrix}."""
    if manifest is None:
        return {}
    parts: dict[str, dict] = {}
    for name, e in manifest["tensors"].items():
        if is_quant_expert(name, e):
            parts.setdefault(e["param"], {"entry": e, "stored": {}})["stored"][name.removeprefix(e["param"] + ".")] = \
                state.pop(name)
    return {p: QuantMatrix(v["entry"]["codec"], v["entry"]["bits"], tuple(v["entry"]["param_shape"]), v["stored"])
            for p, v in parts.items()}


def placeholders(quant: dict[str, QuantMatrix], dtype, device) -> dict[str, torch.Tensor]:
    """Zero-stride stand-ins (no memory) for the quantized params while the model is built; `attach`
    then removes them. dtype/device match the build so build_model's `.to` leaves them as they are."""
    return {p: torch.zeros((), dtype=dtype or torch.float32, device=device).expand(q.shape) for p, q in quant.items()}


def attach(model: nn.Module, quant: dict[str, QuantMatrix], device) -> None:
    """Route each MoE layer with a quantized matrix through an ExpertWeights built from it."""
    by_layer: dict[int, dict] = {}
    for p, q in quant.items():
        i, name = int(p.split(".")[1]), p.rsplit(".", 1)[-1]
        by_layer.setdefault(i, {})[name] = q.to(device)
    for i, qs in by_layer.items():
        moe = model.layers[i].moe
        ws = [qs.get(n, getattr(moe, n).data) for n in ("w1", "w3", "w2")]
        for n in ("w1", "w3", "w2"):
            delattr(moe, n)
        moe.codec = ExpertWeights(*ws)
