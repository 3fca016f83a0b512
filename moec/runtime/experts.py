"""Quantized weights at run time: one `QuantMatrix` per stored [E, O, I] matrix, the `ExpertWeights` a
MoE layer routes through once any of its w1/w3/w2 is quantized, and `QLinear` for the other quantized
linear weights (stored as E = 1, without the E axis): attention projections, shared-expert matrices and
the LM head; a quantized router is held dequantized (attach).

Shape legend: E = experts, O = output rows, I = inputs, G = groups per row, K = codebook entries,
N = tokens, A = experts per token, D = model dim.

The stored parts of each codec are listed in formats/codecs.py; each codec is a spec in moec/registry.py
(its hooks in runtime/weightcodecs.py). At load every LUT codec
(hls, rtn, fp3) becomes codes + lut [E, O, G, K] (fp32), so one dequantization serves them all:
w[e, o, i] = lut[e, o, i // g, idx[e, o, i]]. `dequant_ref` is the torch reference (the CPU path).
On CUDA the Triton kernels read what is stored, not the fp32 lut: hls/fp3 an fp16 copy of the table
(`lut16`, 2·K bytes per group), rtn its fp16 scale and zero (affine levels), fp8 the e4m3 weights and
row scales, vq its BITSTREAM codes, fp16 codebook [E, K, d] and row scales (`qweight()` hands them over
as kernels/dequant.QWeight). A MoE step on CUDA takes the fused
decode GEMV (kernels/moe_decode.py) for up to DECODE_MAX_TOKENS tokens and the grouped dequant-GEMM
(kernels/moe_prefill.py) above; a quantized attention projection the kernels/qlinear.py GEMV/GEMM.

Incoherence processing (calibrate/recipe.Incoherence): a matrix stored with a `had_signs` part holds
W' = W·R for a randomized block-Hadamard R of its inputs, so every path computes y = (x·R)·W'ᵀ: the
input is rotated (moec/rotation.rotate, one batched [b, b] matmul per row, no host sync) and the
dequantization and kernels are unchanged. w1 and w3 of a layer share one rotation: x is rotated once
for all experts; the kernels' intermediate h is rotated between the gate/up and the down launch.
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FormatError
from ..formats.codecs import ROTATION_PART
from ..registry import weight_codec, weight_codecs
from ..rotation import hadamard, rotate, signs_error, unpack_signs
from .backend import capturing, gluon_chosen, kernels_enabled
from .model import expert_act
from .weightcodecs import lut_poly  # noqa: F401  (kernel tests and benchmarks import it from here)

log = logging.getLogger(__name__)

DECODE_MAX_TOKENS = 2  # up to this many tokens: the decode GEMV; above: the grouped kernel (H200 sweep)
FUSED_MAX_TOKENS = DECODE_MAX_TOKENS  # old name
ATTN_PARAM = re.compile(r"layers\.(\d+)\.attn\.(w[qkvo]|wq_[ab]|wkv_[ab])\.weight$")  # GQA, MLA projections
SHARED_PARAM = re.compile(r"layers\.(\d+)\.moe\.shared\.(w[123])\.weight$")
ROUTER_PARAM = re.compile(r"layers\.(\d+)\.moe\.router\.weight$")
HEAD_PARAM = re.compile(r"^output\.weight$")
# the quantizable plain linear weights [O, I], stored without the E axis: attention projections, shared
# experts (QLinear), routers (held dequantized: attach) and the LM head (QLinear)
LINEAR_PARAM = re.compile("|".join(p.pattern for p in (ATTN_PARAM, SHARED_PARAM, ROUTER_PARAM, HEAD_PARAM)))


def lut_from_stored(codec: str, bits: int, stored: dict) -> torch.Tensor:
    """lut [E, O, G, K] fp32 from the stored parts of a LUT codec (its registered `lut` hook)."""
    return weight_codec(codec).hook("lut")(bits, stored)


def dequantize(codec: str, bits: int, shape: tuple[int, int, int], stored: dict) -> torch.Tensor:
    """W_hat [E, O, I] fp32 from the stored parts (the reference the kernels are checked against)."""
    return weight_codec(codec).hook("dequantize")(bits, shape, stored)


def is_quantized(codec: str) -> bool:
    """A registered weight codec that stores parts (under `param`), not the tensor as it is (keep)."""
    spec = weight_codecs().get(codec)
    return spec is not None and not spec.identity


class QuantMatrix(nn.Module):
    """A stacked matrix [E, O, I] held as codes + lut (LUT codecs), fp8 + row scales, vq codes + codebook +
    row scales, or any other codec's stored parts (dequantized by its hook, no kernel)."""

    def __init__(self, codec: str, bits: int, shape: tuple[int, ...], stored: dict[str, torch.Tensor]):
        super().__init__()
        stored = dict(stored)
        signs = stored.pop(ROTATION_PART, None)  # W is stored as W·R (incoherence): R's signs, bit-packed
        self.rotated = signs is not None  # uint8 [I / b, ceil(b / 8)] (or int8 ±1 [I / b, b]: older packs)
        if self.rotated:
            err = signs_error(signs, shape[-1])
            if err is not None:
                raise FormatError(f"{ROTATION_PART} is {err}")
            signs = unpack_signs(signs, shape[-1])
            b = signs.shape[1]
            self.register_buffer("had_signs", signs.float())
            self.register_buffer("had_h", hadamard(b))  # fp32; inputs are rotated in fp32
        self.codec, self.bits = codec, bits
        spec = weight_codec(codec)
        if len(shape) == 2:  # a plain linear weight [O, I] (attention): one "expert"
            shape = (1, *shape)
            # parts stored without the E axis (a 3-D one, an hls codebook [O, G, K], broadcasts against E = 1)
            stored = {k: v[None] if v.dim() < 3 else v for k, v in stored.items()}
        self.shape = tuple(shape)
        self.kernel_mode, self.kernel_parts = spec.kernel_mode, spec.kernel_parts
        self.held = spec.hold is not None
        self._kernel_ok = False
        if self.held:  # the codec's run-time buffers (the kernels' operands, the reference's)
            held = spec.hook("hold")(bits, stored)
            self.parts = list(held)
            for k, v in held.items():
                self.register_buffer(k, v)
            if self.kernel_mode is not None:  # decided once: kernel_ok() is asked on every step
                group = spec.hook("held_group")(self.shape, held)
                self._kernel_ok = bits in spec.bits and spec.kernel_error(bits, self.shape[2], group) is None
        else:  # any other registered codec: its stored parts, dequantized by its hook (no kernel)
            self.kernel_mode = None
            self.parts = list(stored)
            for k, v in stored.items():
                self.register_buffer(f"part_{k}", v)

    def rotate_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., I] -> x·R (in fp32, returned in x's dtype): the input this matrix's stored W·R expects;
        x itself when the matrix is not rotated."""
        if not self.rotated:
            return x
        return rotate(x.float(), self.had_signs, self.had_h).to(x.dtype)

    def same_rotation(self, other) -> bool:
        """Whether `other` (a QuantMatrix or a plain tensor) reads its input in the same basis."""
        r = getattr(other, "rotated", False)
        return r == self.rotated and (not r or torch.equal(self.had_signs, other.had_signs))

    def kernel_ok(self) -> bool:
        """Whether the Triton kernels take this matrix: its codec has a kernel mode and its settings keep the
        codec's kernel rule (WeightCodecSpec.kernel_rule: LUT codecs groups of multiples of 16 inputs or one
        per row; vq vectors in formats/codecs.VQ_DIMS dividing I with codes of VQ_WIDTHS bits). A recipe that
        breaks the rule is refused when it is bound to a model (calibrate/fit_experts.check_kernel_rule), so
        this is False only for matrices built outside a recipe."""
        return self._kernel_ok

    def qweight(self):
        """The kernels' view (kernels/dequant.QWeight) of the held buffers the codec names (kernel_parts); no
        copies."""
        from ..kernels.dequant import QWeight  # lazy: importing the runtime does not pull Triton

        return QWeight(self.kernel_mode, self.bits, self.shape[2],
                       *(getattr(self, k, None) for k in self.kernel_parts))

    def dequant_ref(self, e: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W_hat [O, I] of expert e (or [E, O, I] for all) in `dtype`."""
        E, O, I = self.shape
        sl = slice(None) if e is None else slice(e, e + 1)
        if self.held:  # every held buffer leads with E: dequantize only the experts asked for
            held = {k: getattr(self, k)[sl] for k in self.parts}
            n = held[self.parts[0]].shape[0]
            w = weight_codec(self.codec).hook("held_dequantize")(self.bits, (n, O, I), held)
        else:
            parts = {k: getattr(self, f"part_{k}") for k in self.parts}
            w = dequantize(self.codec, self.bits, self.shape, parts)[sl]
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
        q13 = w1 if isinstance(w1, QuantMatrix) else w3 if isinstance(w3, QuantMatrix) else None
        self.shared_x = q13 is None or q13.same_rotation(w3 if q13 is w1 else w1)  # x rotated once for w1 and w3

    def rotate_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        w = getattr(self, name)
        return w.rotate_input(x) if isinstance(w, QuantMatrix) else x

    def weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        w = getattr(self, name)
        return w.dequant_ref(e, dtype) if isinstance(w, QuantMatrix) else w[e].to(dtype)

    def expert(self, e: int, x: torch.Tensor, args=None, biases=None) -> torch.Tensor:
        """x [n, D] -> [n, D] through expert e (reference path); args: the model's (its expert_act; silu
        without), biases: the layer's (b1, b3, b2) or None."""
        w1, w3, w2 = (self.weight(n, e, x.dtype) for n in ("w1", "w3", "w2"))
        x1 = self.rotate_input("w1", x)
        x3 = x1 if self.shared_x else self.rotate_input("w3", x)
        g, u = x1 @ w1.t(), x3 @ w3.t()
        if biases is not None:
            g, u = g + biases[0][e].to(g.dtype), u + biases[1][e].to(u.dtype)
        h = F.silu(g) * u if args is None else expert_act(g, u, args)
        y = self.rotate_input("w2", h) @ w2.t()
        return y if biases is None else y + biases[2][e].to(y.dtype)

    def fused_ok(self, x: torch.Tensor) -> bool:
        ws = (self.w1, self.w3, self.w2)
        return (kernels_enabled(x.device) and all(isinstance(w, QuantMatrix) and w.kernel_ok() for w in ws)
                and len({w.codec for w in ws}) == 1 and self.w1.bits == self.w3.bits and self.shared_x)

    def fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, args=None,
              biases=None, exact_dtype: bool = True) -> torch.Tensor | None:
        """The fused Triton kernels (backend.kernels_enabled: CUDA by default; x [N, D], weights/ids [N, A]),
        or None where they do not apply. args, biases: as `expert`. exact_dtype=False: the decode kernels' output
        may stay in their fp32 accumulator (moe_decode's out_dtype None) for a caller that rounds it to x's dtype
        itself (the fused step's add_rms_norm): one cast launch a layer fewer."""
        if not self.fused_ok(x):
            return None
        qs = [w.qweight() for w in (self.w1, self.w3, self.w2)]
        xr = self.w1.rotate_input(x)  # w1 and w3 read the same basis (fused_ok)
        h_rotate = self.w2.rotate_input if self.w2.rotated else None
        act = {} if args is None else {"act": args.expert_act, "limit": args.swiglu_limit}
        if x.shape[0] <= DECODE_MAX_TOKENS:
            from ..kernels.moe_decode import moe_decode

            if gluon_chosen(x.device, False):  # opt-in: measured no faster than `tl` (gluon_moe_decode.py)
                from ..kernels import gluon_moe_decode as gmd

                if gmd.supports(*qs, h_rotate):
                    out = gmd.gluon_moe_decode(xr.contiguous(), ids.to(torch.int32).contiguous(),
                                               weights.float().contiguous(), *qs, ids.shape[1], biases=biases, **act)
                    return out.to(x.dtype)
            return moe_decode(xr, ids, weights, *qs, out_dtype=x.dtype if exact_dtype else None, h_rotate=h_rotate,
                              biases=biases, **act)
        from ..kernels.moe_prefill import moe_grouped

        return moe_grouped(xr, ids, weights, *qs, h_rotate=h_rotate, biases=biases, **act)


class QLinear(nn.Module):
    """A quantized nn.Linear stand-in (attention projections): Triton kernels on CUDA, dequantized
    weights and F.linear elsewhere (the reference)."""

    def __init__(self, q: QuantMatrix, bias: torch.Tensor | None):
        super().__init__()
        self.q = q
        self.in_features, self.out_features = q.shape[2], q.shape[1]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.q.rotate_input(x)
        if kernels_enabled(x.device) and self.q.kernel_ok():
            y = self._kernel(x, False)
            if y is not None:
                return y
        return F.linear(x, self.q.dequant_ref(0, x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def gated(self, gu: torch.Tensor) -> torch.Tensor | None:
        """This projection of silu(g)·u for a fused gate/up output gu = [g | u] [N, 2·in] in one launch (the `tl`
        decode GEMV reads the activation itself: qlinear gated), or None where that path does not apply (a rotated
        input, no kernels, prefill rows, vq, a configuration that failed) or the Gluon 4-bit GEMV takes the layer
        (silu_mul and it measured faster than the gated `tl` GEMV and than a gated Gluon load: docs/results.md):
        the caller activates first."""
        from ..kernels import gluon_qlinear
        from ..kernels.qlinear import gated_ok, gluon_measured_faster

        M = gu.numel() // gu.shape[-1]
        if self.q.rotated or not kernels_enabled(gu.device) or not self.q.kernel_ok() or \
                not gated_ok(self.q.qweight(), M):
            return None
        if gluon_chosen(gu.device, gluon_measured_faster(gu.device)) and gluon_qlinear.supports(self.q.qweight(), M):
            return None
        return self._kernel(gu, True)

    def _kernel(self, x: torch.Tensor, gated: bool) -> torch.Tensor | None:
        """qlinear on x (gated: a gate/up output), or None once its configuration failed to compile here."""
        from ..kernels.qlinear import gluon_measured_faster, qlinear

        key = (self.q.codec, self.q.bits, tuple(self.q.shape), x.shape[0] > 1, x.dtype, gated)
        if key in _QLINEAR_FAILED:
            return None
        try:
            gluon = gluon_chosen(x.device, gluon_measured_faster(x.device))
            return qlinear(x, self.q.qweight(), self.bias, gluon=gluon, gated=gated)
        except Exception as e:  # a configuration Triton cannot compile here (met outside graph capture)
            if capturing():
                raise
            log.warning("qlinear kernel failed for %s %d-bit %s%s (%s: %s); torch path for it", self.q.codec,
                        self.q.bits, list(self.q.shape), " gated" if gated else "", type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            _QLINEAR_FAILED.add(key)
            return None

    def dense_weight(self) -> torch.Tensor:
        """The [O, I] weight this layer applies (fp32; a fitted rotation undone): MLA's absorbed decode
        multiplies by wkv_b's weight instead of applying the layer."""
        w = self.q.dequant_ref(0)
        if self.q.rotated:  # stored W·R: the layer computes (W·R)·(Rᵀx)
            w = rotate(w, self.q.had_signs, self.q.had_h, inverse=True)
        return w


_QLINEAR_FAILED: set[tuple] = set()  # quantized-projection configurations whose kernel failed to compile here


def is_quant_expert(name: str, entry: dict) -> bool:
    """Manifest entry of a stored part of a quantized expert/MLP matrix (layers.*.moe.w1/w2/w3)."""
    return is_quantized(entry["codec"]) and entry.get("param", "").rsplit(".", 1)[-1] in ("w1", "w2", "w3") \
        and ".moe." in entry.get("param", "") and name.startswith(entry["param"] + ".")


def is_quant_linear(name: str, entry: dict) -> bool:
    """Manifest entry of a stored part of a quantized plain linear weight [O, I] (LINEAR_PARAM: attention
    projections, shared experts, routers, the LM head)."""
    return is_quantized(entry["codec"]) and LINEAR_PARAM.search(entry.get("param", "")) is not None \
        and name.startswith(entry["param"] + ".")


def pop_quant_experts(state: dict[str, torch.Tensor], manifest: dict | None) -> dict[str, QuantMatrix]:
    """Remove the stored parts of quantized matrices (experts, attention, shared experts, routers, the LM
    head) from `state`; {param: QuantMatrix}."""
    if manifest is None:
        return {}
    parts: dict[str, dict] = {}
    for name, e in manifest["tensors"].items():
        if is_quant_expert(name, e) or is_quant_linear(name, e):
            parts.setdefault(e["param"], {"entry": e, "stored": {}})["stored"][name.removeprefix(e["param"] + ".")] = \
                state.pop(name)
    out = {}
    for p, v in parts.items():
        shape = tuple(v["entry"]["param_shape"])
        out[p] = QuantMatrix(v["entry"]["codec"], v["entry"]["bits"], shape, v["stored"])
        out[p].param_shape = shape  # canonical shape ([O, I] for attention), for the build placeholders
    return out


def placeholders(quant: dict[str, QuantMatrix], dtype, device) -> dict[str, torch.Tensor]:
    """Zero-stride stand-ins (no memory) for the quantized params while the model is built; `attach`
    then removes them. dtype/device match the build so build_model's `.to` leaves them as they are."""
    return {p: torch.zeros((), dtype=dtype or torch.float32, device=device).expand(getattr(q, "param_shape", q.shape))
            for p, q in quant.items()}


def attach(model: nn.Module, quant: dict[str, QuantMatrix], device) -> None:
    """Route each MoE layer with a quantized matrix through an ExpertWeights built from it, and swap
    each quantized attention projection, shared-expert matrix and the LM head for a QLinear (its bias,
    if any, kept). A quantized router is held dequantized (its rotation undone): it is E x D, read by
    every routing path (model.route, the decode engine's routing kernel) as a plain weight, and what it
    computes is the quantized weights' exactly."""
    by_layer: dict[int, dict] = {}
    for p, q in quant.items():
        m = ATTN_PARAM.search(p) or SHARED_PARAM.search(p)
        if m:
            parent = model.layers[int(m.group(1))]
            parent = parent.attn if ".attn." in p else parent.moe.shared
            old = getattr(parent, m.group(2))
            setattr(parent, m.group(2), QLinear(q.to(device), None if old.bias is None else old.bias.data))
            continue
        if HEAD_PARAM.search(p):
            model.output = QLinear(q.to(device), None)
            continue
        if m := ROUTER_PARAM.search(p):
            router = model.layers[int(m.group(1))].moe.router
            w = q.dequant_ref(0)
            if q.rotated:  # stored W·R: the router's own weight is W = (W·R)·Rᵀ
                w = rotate(w, q.had_signs, q.had_h, inverse=True)
            router.weight = nn.Parameter(w.to(device, router.weight.dtype), requires_grad=False)
            continue
        i, name = int(p.split(".")[1]), p.rsplit(".", 1)[-1]
        by_layer.setdefault(i, {})[name] = q.to(device)
    for i, qs in by_layer.items():
        moe = model.layers[i].moe
        ws = [qs.get(n, getattr(moe, n).data) for n in ("w1", "w3", "w2")]
        for n in ("w1", "w3", "w2"):
            delattr(moe, n)
        moe.codec = ExpertWeights(*ws)
