"""FP4 weight quantizers (mxfp4, nvfp4; moec/codecs/fp4.py), pure fp32 functions.

Shapes: W [E, O, I] (E experts, O output rows, I inputs), H [E, I, I] each expert's damped input Hessian,
g = inputs per block (mxfp4 32, nvfp4 16), G = I / g. A weight is e2m1(code) · s with s the block's scale
(runtime/fp4.py): mxfp4 s = 2^(e − 127) (e8m0 byte e), nvfp4 s = e4m3 / gs (gs one fp32 global scale per
expert matrix).

`gptq: false` is plain round-to-nearest as the consuming libraries quantize: mxfp4 e = ⌊log2 amax⌋ − 2
(the OCP MX reference and gguf-py's MXFP4 quantize_blocks: amax lands in [4, 8)·2^(e−127), above 6 clips);
nvfp4 e4m3 = nearest(amax / 6 · gs) (llm-compressor's NVFP4 observer), and each weight to its nearest level.

`gptq: true` is the Hessian-aware fit the other codecs use (calibrate/hls.py):
  1. scale search: per block, the candidate scale of least Σ_j h_jj (w_j − q_j)² with q the nearest levels
     (h_jj the Hessian diagonal: the importance of input j): mxfp4 the exponents e − 1, e, e + 1 (one below
     clips, one above never clips); nvfp4 the e4m3 values 3 steps below to 1 step above the rounded amax / 6
     (a step is 1/8 to 1/16 of the scale: clipping by up to ~30 %, or none);
  2. GPTQ (Frantar et al. 2022) on the full H with those scales fixed: columns by decreasing h_jj
     (act-order), each rounded to its block's nearest level and the error spread over the columns not yet
     visited (calibrate/hls.gptq_assign; the table of a block is its 16 e2m1 values × s).
nvfp4's global scale is a power of two, 2^⌊log2(448 · 6 / amax)⌋ (the largest block scale lands in
(224, 448] of e4m3's range): e4m3 has the same relative precision in every binade, so this costs nothing
against gs = 448 · 6 / amax, and it keeps every weight e2m1 · e4m3 · 2^k exact in bf16, which is how
compressed-tensors decodes it (the export is then bit for bit; moec/export/to_ct.py).
"""

from __future__ import annotations

import torch

from ..formats import bitpack
from ..runtime.fp4 import E2M1, E8M0_BIAS, MX_BLOCK, NV_BLOCK, e8m0_to_float
from .hls import gptq_assign

E4M3_MAX = 448.0
E4M3_MAX_BYTE = 0x7E  # 448; 0x7F is NaN
FP4_MAX = 6.0
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # between the e2m1 magnitudes


def nearest_codes(Wg: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (int64, 0..15) of the level nearest each weight: Wg [..., G, g], s [..., G] > 0 (a block of
    scale 0 gets code 0). Ties go to the smaller magnitude; -0 is never chosen."""
    s = s[..., None]
    x = torch.where(s > 0, Wg / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(Wg))
    mag = torch.bucketize(x.abs(), _MIDPOINTS.to(x.device))  # 0..7
    return torch.where((x < 0) & (mag > 0), mag + 8, mag)


def block_error(Wg: torch.Tensor, hg: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Σ_j h_j (w_j − q_j)² per block [..., G] with q the nearest levels of scale s [..., G]."""
    q = E2M1.to(Wg.device)[nearest_codes(Wg, s)] * s[..., None]
    return (hg * (Wg - q) ** 2).sum(-1)


def _pick(Wg, hg, cands: list[torch.Tensor], scale_of) -> torch.Tensor:
    """The candidate (a stored scale value [E, O, G], mapped to fp32 by scale_of) of least block_error."""
    best, best_err = cands[0], block_error(Wg, hg, scale_of(cands[0]))
    for c in cands[1:]:
        err = block_error(Wg, hg, scale_of(c))
        better = err < best_err
        best, best_err = torch.where(better, c, best), torch.where(better, err, best_err)
    return best


def _blocks(W: torch.Tensor, H: torch.Tensor | None, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    E, O, I = W.shape
    assert I % g == 0, f"{I} inputs are not blocks of {g}"
    hdiag = H.diagonal(dim1=-2, dim2=-1).float() if H is not None else torch.ones(E, I, device=W.device)
    return W.float().reshape(E, O, I // g, g), hdiag.reshape(E, 1, I // g, g)


def _codes(W: torch.Tensor, H: torch.Tensor | None, s: torch.Tensor, gptq: bool) -> torch.Tensor:
    """Packed codes uint8 [E, O, I/2] for block scales s [E, O, G] fp32: nearest levels, or GPTQ's."""
    E, O, I = W.shape
    if gptq and H is not None:
        lut = E2M1.to(W.device) * s[..., None]  # [E, O, G, 16]: code k is entry k
        idx = gptq_assign(W.float(), H, lut)
    else:
        idx = nearest_codes(W.float().reshape(E, O, s.shape[-1], -1), s).reshape(E, O, I)
    return bitpack.pack(idx, 4)


def quantize_mx(W: torch.Tensor, H: torch.Tensor | None, gptq: bool) -> dict:
    """mxfp4 parts {codes uint8 [E, O, I/2], scale uint8 e8m0 [E, O, I/32]} of W [E, O, I]."""
    Wg, hg = _blocks(W, H, MX_BLOCK)
    amax = Wg.abs().amax(-1)
    _, ex = torch.frexp(amax)  # amax = m · 2^ex, m in [0.5, 1): ⌊log2 amax⌋ = ex − 1
    e = torch.where(amax > 0, ex - 1 - 2 + E8M0_BIAS, torch.zeros_like(ex)).clamp(0, 254)
    if gptq:
        e = _pick(Wg, hg, [(e + d).clamp(0, 254) for d in (0, -1, 1)], lambda c: e8m0_to_float(c.to(torch.uint8)))
    e = e.to(torch.uint8)
    return {"codes": _codes(W, H, e8m0_to_float(e), gptq), "scale": e}


def nv_global_scale(W: torch.Tensor) -> torch.Tensor:
    """fp32 [E]: 2^⌊log2(448 · 6 / amax)⌋ per expert matrix (1 for an all-zero one)."""
    amax = W.float().abs().flatten(1).amax(-1)
    _, ex = torch.frexp(E4M3_MAX * FP4_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)))
    return torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), ex - 1), torch.ones_like(amax))


def quantize_nv(W: torch.Tensor, H: torch.Tensor | None, gptq: bool) -> dict:
    """nvfp4 parts {codes uint8 [E, O, I/2], scale float8_e4m3fn [E, O, I/16], global_scale fp32 [E]}."""
    Wg, hg = _blocks(W, H, NV_BLOCK)
    gs = nv_global_scale(W)  # [E]
    t = (Wg.abs().amax(-1) / FP4_MAX * gs[:, None, None]).clamp_max(E4M3_MAX)
    c = t.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)  # round to nearest (even)

    def scale_of(b: torch.Tensor) -> torch.Tensor:
        return b.to(torch.uint8).view(torch.float8_e4m3fn).float() / gs[:, None, None]

    if gptq:
        c = _pick(Wg, hg, [(c + d).clamp(1, E4M3_MAX_BYTE) for d in (0, -1, -2, -3, 1)], scale_of)
    return {"codes": _codes(W, H, scale_of(c), gptq), "scale": c.to(torch.uint8).view(torch.float8_e4m3fn),
            "global_scale": gs}


def quantize_mxfp4(W: torch.Tensor, H: torch.Tensor | None, rule) -> dict:
    """The registry's `quantize` hook of mxfp4 (moec/registry.py)."""
    return quantize_mx(W, H, rule.gptq)


def quantize_nvfp4(W: torch.Tensor, H: torch.Tensor | None, rule) -> dict:
    """The registry's `quantize` hook of nvfp4 (moec/registry.py)."""
    return quantize_nv(W, H, rule.gptq)
