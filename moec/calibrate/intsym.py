"""Symmetric integer weights (moec/codecs/intsym.py), pure fp32 functions: the GPTQ of llm-compressor's
W4A16 / W8A16 schemes (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers") on moec's per-expert Hessians.

Shapes: W [E, O, I] (E experts, a dense or attention matrix has E = 1), H [E, I, I] the damped second moment of
each expert's inputs (calibrate/hessian.py), g = group size along I (0: one group per row), G = I // g,
q in [qmin, qmax] = [-2^(b-1), 2^(b-1) - 1], w = s · q.

1. Scales, static per group (as llm-compressor fixes them before its GPTQ loop): s = r · a / (qmax + ½) with a
   the group's largest magnitude, r searched over a few shrink ratios minimizing Σ_j h_jj (w_j - s·q_j)²
   (diag(H): the inputs' energy), each candidate rounded to fp16 before it is scored (the stored value).
2. Levels: with `gptq` and a Hessian, GPTQ's column loop: each column rounded to the nearest level of its own
   group's scale, the rounding error spread onto the columns not yet rounded through the upper Cholesky
   factor of H⁻¹, in blocks of 128; with `actorder`, columns visited by decreasing h_jj (compressed-tensors'
   `actorder: weight`/static: the order changes the fit only, the groups and the stored layout do not).
   Without, round to nearest.

Nothing here reads files or the model: inputs in, stored tensors out.
"""

from __future__ import annotations

import torch

from ..formats import bitpack
from ..runtime.intsym import offset
from .hls import gptq_factor, groups

SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)  # clip ratios of the scale search


def qrange(bits: int) -> tuple[int, int]:
    return -offset(bits), offset(bits) - 1


def fit_scale(W: torch.Tensor, hdiag: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """fp16 scales [E, O, G] for W [E, O, I] with importances hdiag [E, I] (step 1 of the module docstring)."""
    E, O, I = W.shape
    Wg = groups(W.float(), group_size)  # [E, O, G, g]
    G, g = Wg.shape[2:]
    hg = hdiag.float().reshape(E, 1, G, g)
    qmin, qmax = qrange(bits)
    base = Wg.abs().amax(-1) / (qmax + 0.5)  # [E, O, G]
    best_s, best_err = None, None
    for r in SHRINK:
        s = (base * r).half().float().clamp_min(2.0 ** -24)  # the smallest fp16 subnormal: a zero group stays 0
        q = (Wg / s[..., None]).round().clamp(qmin, qmax)
        err = (hg * (Wg - s[..., None] * q) ** 2).sum(-1)
        if best_s is None:
            best_s, best_err = s, err
        else:
            better = err < best_err
            best_s, best_err = torch.where(better, s, best_s), torch.minimum(err, best_err)
    assert torch.isfinite(best_s.half()).all(), "intsym scale overflows fp16"
    return best_s.half()


def gptq_levels(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, bits: int, actorder: bool = True,
                block: int = 128) -> torch.Tensor:
    """Signed levels q [E, O, I] (int64) of W [E, O, I] on the fixed scales [E, O, G] with GPTQ error feedback
    through H [E, I, I] (positive definite: hessian.regularize)."""
    E, O, I = W.shape
    G = scale.shape[2]
    g = I // G
    qmin, qmax = qrange(bits)
    perm, U = gptq_factor(H, actorder)  # [E, I], [E, I, I]
    W = W.float().gather(-1, perm[:, None, :].expand(E, O, I)).clone()
    S = scale.float().gather(-1, (perm // g)[:, None, :].expand(E, O, I))  # [E, O, I]: each column's group scale
    Q = torch.empty(E, O, I, dtype=torch.float32, device=W.device)
    for i1 in range(0, I, block):
        i2 = min(i1 + block, I)
        W1 = W[:, :, i1:i2].clone()  # [E, O, b]
        Err = torch.zeros_like(W1)
        U1 = U[:, i1:i2, i1:i2]  # [E, b, b]
        for i in range(i2 - i1):
            w, s = W1[:, :, i], S[:, :, i1 + i]  # [E, O]
            q = (w / s).round().clamp(qmin, qmax)
            Q[:, :, i1 + i] = q
            err = (w - s * q) / U1[:, i, i][:, None]
            W1[:, :, i:] -= err[..., None] * U1[:, None, i, i:]
            Err[:, :, i] = err
        W[:, :, i2:] -= Err @ U[:, i1:i2, i2:]
    out = torch.empty_like(Q)
    out.scatter_(-1, perm[:, None, :].expand(E, O, I), Q)  # back to the original column order
    return out.long()


def quantize(W: torch.Tensor, H: torch.Tensor | None, bits: int, group_size: int, gptq: bool = True,
             actorder: bool = True) -> dict:
    """Stored parts {codes, scale} of W [E, O, I] (formats/codecs.py WeightCodec.INTSYM)."""
    E, O, I = W.shape
    W = W.float()
    hdiag = H.diagonal(dim1=-2, dim2=-1) if H is not None else torch.ones(E, I, device=W.device)
    scale = fit_scale(W, hdiag, bits, group_size)
    if gptq and H is not None:
        q = gptq_levels(W, H, scale, bits, actorder)
    else:
        qmin, qmax = qrange(bits)
        q = (groups(W, group_size) / scale.float()[..., None]).round().clamp(qmin, qmax).long().reshape(E, O, I)
    return {"codes": bitpack.pack(q + offset(bits), bits), "scale": scale}


def quantize_intsym(W: torch.Tensor, H: torch.Tensor | None, rule) -> dict:
    """The registry's `quantize` hook (moec/registry.py) under a recipe rule (bits, group_size, gptq, actorder)."""
    return quantize(W, H, rule.bits, rule.group_size, gptq=rule.gptq, actorder=rule.actorder)
