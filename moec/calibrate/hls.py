"""Weight quantizers for stacked expert matrices, pure fp32 functions.

Shapes: W [E, O, I] (E experts, O output rows, I inputs; a dense MLP has E = 1), H [E, I, I] the
second moment of each expert's inputs, g = group size along I (0: one group per row), G = I // g
groups per row, K = 2^bits codebook entries.

Every LUT codec below reconstructs w[e, o, i] = lut[e, o, i // g, idx[e, o, i]] with lut [E, O, G, K]:
  hls   fitted codebooks: weighted Lloyd (SqueezeLLM, sensitivity-weighted k-means) minimizing
        Σ_j h_jj (w_j − c[idx_j])² per group, stored as int8 entries × one fp16 scale per group
        (int8 entries cost 8 bits instead of 16: a 4-entry book per 160-input row is 0.3 bit/weight,
        against 0.4 in fp16, and the rounding of a centroid is ≤ 1/254 of the group range);
  fp3   the fixed asymmetric FP3 grid of seed 000 × a signed fp16 scale per group;
  rtn   uniform min-max levels per group (fp16 step and minimum), the round-to-nearest baseline.
hls and fp3 can be followed by GPTQ error feedback (Frantar et al. 2022) with the full H: columns
are assigned to their nearest entry one at a time, by decreasing h_jj (act-order), and the rounding
error is spread onto the columns not yet assigned through the Cholesky factor of H⁻¹, in blocks of
128. The lut is fitted on the original weights first; for hls the codebook values are then refitted
by least squares under the full H for the GPTQ assignment (`refit_lut`) and GPTQ runs once more
(on demo-moe at 2 bits this takes the mean output error of w2 from 0.092 (Lloyd alone) through
0.075 (GPTQ) to 0.068; RTN is at 0.24).
  fp8   e4m3 with one fp32 scale per output row (seed 003); no codebook.

Nothing here reads files or the model: inputs in, stored tensors out.
"""

from __future__ import annotations

import torch

from ..formats import bitpack
from ..runtime.experts import dequantize, lut_from_stored
from ..runtime.weightcodecs import FP3_GRID

# FP3_GRID (runtime/weightcodecs.py), seed 000's "asymmetric FP3": a 1-sign/1-exponent/1-mantissa float
# with subnormals has magnitudes {0, 0.5, 1, 1.5}; its redundant −0 code is spent on one more positive level, 2. The
# per-group scale is signed, so the extra level falls on whichever side holds the group's extreme.
__all__ = ["FP3_GRID", "dequantize", "lut_from_stored", "quantize", "gptq_assign", "weighted_lloyd"]
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def groups(W: torch.Tensor, group_size: int) -> torch.Tensor:
    """[E, O, I] -> [E, O, G, g] (a view)."""
    E, O, I = W.shape
    g = group_size or I
    assert I % g == 0, f"group_size {g} does not divide the input dim {I}"
    return W.reshape(E, O, I // g, g)


def weighted_lloyd(w: torch.Tensor, h: torch.Tensor, K: int, iters: int = 25) -> torch.Tensor:
    """Centroids c [R, K] minimizing Σ_j h_j (w_j − c[idx_j])² per row of w [R, n], h [R, n] ≥ 0.

    Deterministic init at the weighted quantiles (k + ½)/K, then Lloyd steps; a centroid that loses
    all its points keeps its position.
    """
    w, h = w.float(), h.float().clamp_min(0) + 1e-12
    ws, order = w.sort(-1)
    hs = h.gather(-1, order)
    cum = hs.cumsum(-1)
    q = (torch.arange(K, dtype=torch.float32, device=w.device) + 0.5) / K * cum[:, -1:]  # [R, K]
    pos = torch.searchsorted(cum, q).clamp_max(w.shape[-1] - 1)
    c = ws.gather(-1, pos)
    for _ in range(iters):
        idx = nearest(w, c)
        num = torch.zeros_like(c).scatter_add_(-1, idx, h * w)
        den = torch.zeros_like(c).scatter_add_(-1, idx, h)
        new = torch.where(den > 0, num / den.clamp_min(1e-30), c)
        if torch.equal(new, c):
            break
        c = new
    return c.sort(-1).values


def nearest(w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry: w [..., n], c [..., K] -> [..., n] int64."""
    return (w[..., :, None] - c[..., None, :]).abs().argmin(-1)


def fit_lut(W: torch.Tensor, hdiag: torch.Tensor, codec: str, bits: int, group_size: int) -> dict:
    """Stored tensors defining lut [E, O, G, K] for W [E, O, I] with importances hdiag [E, I]."""
    E, O, I = W.shape
    Wg = groups(W.float(), group_size)  # [E, O, G, g]
    G, g = Wg.shape[2], Wg.shape[3]
    hg = hdiag.float().reshape(E, 1, G, g).expand(E, O, G, g)
    K = 1 << bits
    if codec == "hls":
        return int8_codebook(weighted_lloyd(Wg.reshape(-1, g), hg.reshape(-1, g), K).view(E, O, G, K))
    if codec == "rtn":
        lo, hi = Wg.amin(-1), Wg.amax(-1)
        step = ((hi - lo) / (K - 1)).clamp_min(1e-8)
        return {"scale": step.half(), "zero": lo.half()}
    if codec == "fp3":
        assert bits == 3, bits
        # signed scale: the extreme of largest magnitude maps onto the grid's +2 level
        mx, mn = Wg.amax(-1), Wg.amin(-1)
        ext = torch.where(mx.abs() >= mn.abs(), mx, mn)
        base = ext / 2.0
        best_s, best_err = base, None
        for shrink in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6):  # weighted clip search
            s = (base * shrink).half().float()
            s = torch.where(s.abs() < 1e-8, torch.full_like(s, 1e-8), s)
            lut = s[..., None] * FP3_GRID.to(W.device)
            q = lut.gather(-1, nearest(Wg, lut))
            err = (hg * (Wg - q) ** 2).sum(-1)
            if best_err is None:
                best_s, best_err = s, err
            else:
                better = err < best_err
                best_s, best_err = torch.where(better, s, best_s), torch.minimum(err, best_err)
        return {"scale": best_s.half()}
    raise AssertionError(codec)


def gptq_factor(H: torch.Tensor, act_order: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm [E, I], U [E, I, I]): the column order and the upper Cholesky factor of (H[perm][:, perm])⁻¹
    that gptq_assign feeds the rounding errors through; computed once per H (the O(I³) part of GPTQ)."""
    E, I, _ = H.shape
    if act_order:
        perm = torch.argsort(H.diagonal(dim1=-2, dim2=-1), dim=-1, descending=True)  # [E, I]
    else:
        perm = torch.arange(I, device=H.device).expand(E, I)
    H = H.float().gather(1, perm[:, :, None].expand(E, I, I)).gather(2, perm[:, None, :].expand(E, I, I))
    Hinv = torch.cholesky_inverse(torch.linalg.cholesky(H))
    return perm, torch.linalg.cholesky(Hinv, upper=True)  # [E, I, I]


def gptq_assign(W: torch.Tensor, H: torch.Tensor, lut: torch.Tensor, block: int = 128,
                act_order: bool = True, factor: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Indices [E, O, I] assigning W [E, O, I] to lut [E, O, G, K] with GPTQ error feedback.

    H [E, I, I] must be positive definite (hessian.regularize). Batched over experts. With
    `act_order` columns are visited by decreasing h_jj (GPTQ's act-order); each column still uses
    the codebook of its own group (static groups), so the stored layout does not change.
    factor: gptq_factor(H, act_order), when the caller assigns several times against one H.
    """
    E, O, I = W.shape
    G = lut.shape[2]
    g = I // G
    perm, U = factor if factor is not None else gptq_factor(H, act_order)
    W = W.float().gather(-1, perm[:, None, :].expand(E, O, I)).clone()
    idx = torch.empty(E, O, I, dtype=torch.long, device=W.device)
    ar = torch.arange(E, device=W.device)
    for i1 in range(0, I, block):
        i2 = min(i1 + block, I)
        W1 = W[:, :, i1:i2].clone()  # [E, O, b]
        Err = torch.zeros_like(W1)
        U1 = U[:, i1:i2, i1:i2]  # [E, b, b]
        for i in range(i2 - i1):
            w = W1[:, :, i]  # [E, O]
            lg = lut[ar, :, perm[:, i1 + i] // g, :]  # [E, O, K]: the group of the original column
            k = (w[..., None] - lg).abs().argmin(-1)  # [E, O]
            q = lg.gather(-1, k[..., None])[..., 0]
            idx[:, :, i1 + i] = k
            err = (w - q) / U1[:, i, i][:, None]
            W1[:, :, i:] -= err[..., None] * U1[:, None, i, i:]
            Err[:, :, i] = err
        W[:, :, i2:] -= Err @ U[:, i1:i2, i2:]
    out = torch.empty_like(idx)
    out.scatter_(-1, perm[:, None, :].expand(E, O, I), idx)  # back to the original column order
    return out


def refit_lut(W: torch.Tensor, H: torch.Tensor, idx: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Codebook values minimizing the full output error tr((W − Ŵ) H (W − Ŵ)ᵀ) for fixed indices.

    Per row, Ŵ = A c with A [I, G·K] the one-hot of (group, index): c = (AᵀHA)⁻¹ AᵀHw (a G·K system;
    entries no weight uses keep their value through a small ridge toward the current lut).
    W, idx [E, O, I]; H [E, I, I]; lut [E, O, G, K] -> lut [E, O, G, K].
    """
    E, O, I = W.shape
    G, K = lut.shape[2], lut.shape[3]
    gs = I // G
    out = torch.empty_like(lut)
    for e in range(E):
        # A is block-diagonal over groups, so HA = H A costs O·I·I·K (not O·I·I·G·K) flops.
        HA = torch.empty(O, I, G * K, device=W.device)
        M = torch.empty(O, G * K, G * K, device=W.device)
        As = []
        for g in range(G):
            cols = slice(g * gs, (g + 1) * gs)
            Ag = torch.nn.functional.one_hot(idx[e][:, cols], K).float()  # [O, gs, K]
            HA[:, :, g * K : (g + 1) * K] = torch.matmul(H[e][:, cols].float(), Ag)  # [O, I, K]
            As.append((cols, Ag))
        for g, (cols, Ag) in enumerate(As):
            M[:, g * K : (g + 1) * K, :] = Ag.transpose(1, 2) @ HA[:, cols, :]  # [O, K, GK]
        b = torch.einsum("ojk,oj->ok", HA, W[e].float())
        c0 = lut[e].reshape(O, G * K)
        ridge = 1e-6 * M.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True).clamp_min(1e-12)  # [O, 1]
        M = M + torch.diag_embed(ridge.expand(O, G * K))
        c = torch.linalg.solve(M, (b + ridge * c0)[..., None])[..., 0]
        out[e] = torch.where(torch.isfinite(c), c, c0).view(O, G, K)
    return out


def int8_codebook(c: torch.Tensor) -> dict:
    """lut [..., K] fp32 -> stored hls parts: int8 entries × one fp16 scale per group."""
    scale = (c.abs().amax(-1) / 127.0).clamp_min(1e-8).half()
    cb = (c / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
    return {"codebook": cb, "cb_scale": scale}


def quantize(W: torch.Tensor, H: torch.Tensor | None, codec: str, bits: int, group_size: int,
             gptq: bool = True, refit_rounds: int = 1, act_order: bool = True) -> dict:
    """Stored tensors for W [E, O, I] under `codec` (see the module docstring).

    H [E, I, I] (positive definite) supplies the importances diag(H) and, with `gptq`, the error
    feedback; None means identity (plain least squares). Returns {"codes" | "fp8": ..., scales...}.
    """
    E, O, I = W.shape
    W = W.float()
    if codec == "fp8":
        scale = (W.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)  # [E, O] fp32
        return {"fp8": (W / scale[..., None]).to(torch.float8_e4m3fn), "scale": scale}
    hdiag = H.diagonal(dim1=-2, dim2=-1) if H is not None else torch.ones(E, I, device=W.device)
    stored = fit_lut(W, hdiag, codec, bits, group_size)
    lut = lut_from_stored(codec, bits, stored)  # [E, O, G, K]
    if gptq and H is not None and codec != "rtn":
        factor = gptq_factor(H, act_order)  # one factorization for every assignment below
        idx = gptq_assign(W, H, lut, act_order=act_order, factor=factor)
        for _ in range(refit_rounds if codec == "hls" else 0):  # codebook values for the GPTQ assignment
            stored = int8_codebook(refit_lut(W, H, idx, lut))
            lut = lut_from_stored(codec, bits, stored)
            idx = gptq_assign(W, H, lut, act_order=act_order, factor=factor)
    else:
        Wg = groups(W, group_size)
        idx = nearest(Wg, lut).reshape(E, O, I)
    stored["codes"] = bitpack.pack(idx, bits)
    return stored


def _quantizer(codec: str):
    def quantize_codec(W: torch.Tensor, H: torch.Tensor | None, rule) -> dict:
        """The registry's `quantize` hook (moec/registry.py) for this codec under a recipe rule."""
        return quantize(W, H, codec, rule.bits, rule.group_size, gptq=rule.gptq, act_order=rule.actorder)

    quantize_codec.__name__ = f"quantize_{codec}"
    return quantize_codec


quantize_hls, quantize_rtn, quantize_fp3, quantize_fp8 = (_quantizer(c) for c in ("hls", "rtn", "fp3", "fp8"))


def output_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Relative output error per expert: tr(ΔW H ΔWᵀ) / tr(W H Wᵀ), [E]."""
    d = (W_hat.float() - W.float())
    num = torch.einsum("eoi,eij,eoj->e", d, H.float(), d)
    den = torch.einsum("eoi,eij,eoj->e", W.float(), H.float(), W.float())
    return num / den.clamp_min(1e-30)


# -- end-to-end tuning of fitted tables (calibrate/tune.py; the registry's `tune` hook) ------------------------

class _TunedTable:
    """A LUT matrix's tunable values (tune.py protocol): delta relative to each group's magnitude (`ref`), so a
    step of lr moves every group by the same fraction of its range; the code indices stay fixed."""

    def __init__(self, base: torch.Tensor, bits: int, shape: tuple, parts: dict, flat: bool):
        E, O, I = shape
        self.bits, self.flat, self.base = bits, flat, base
        G = base.shape[2]
        self.idx = bitpack.unpack(parts["codes"], bits, I).view(E, O, G, I // G).long()  # [E, O, G, g]
        self.ref = base.abs().amax(-1, keepdim=True).clamp_min(1e-12)  # [E, O, G, 1]
        self.delta = torch.zeros_like(base, requires_grad=True)
        self.deltas = [self.delta]

    def values(self) -> torch.Tensor:
        return self.base + self.ref * self.delta

    def weight(self) -> torch.Tensor:
        """W_hat [E, O, I] (the stored basis: W·R under incoherence)."""
        lut = self.lut()
        return lut.gather(-1, self.idx).reshape(*lut.shape[:2], -1)

    @torch.no_grad()
    def stored(self) -> dict[str, torch.Tensor]:
        """The stored parts of the current values (the same layout as the fit's)."""
        v = self.values()
        assert torch.isfinite(v).all(), "non-finite codebook after tuning"
        return {p: (t[0] if self.flat else t).cpu().contiguous() for p, t in self.stored_parts(v).items()}


class TunedLUT(_TunedTable):
    """hls: delta [E, O, G, K] on the lut (int8 entries × one fp16 scale per group once stored: the entries and
    the group's scale move together, the stored pair is recomputed from the tuned lut)."""

    def __init__(self, bits: int, shape: tuple, parts: dict, flat: bool, dev: torch.device):
        parts = {p: v.to(dev)[None] if flat else v.to(dev) for p, v in parts.items()}  # [E, ...]
        super().__init__(lut_from_stored("hls", bits, parts), bits, shape, parts, flat)

    def lut(self) -> torch.Tensor:
        return self.values()

    def stored_parts(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        return int8_codebook(v)

    @torch.no_grad()
    def round_to_stored(self) -> None:
        """Set the values to what stored() rounds them to (int8 entries × fp16 scale)."""
        r = lut_from_stored("hls", self.bits, int8_codebook(self.values()))
        self.delta.copy_((r - self.base) / self.ref)


class TunedScale(_TunedTable):
    """fp3: delta [E, O, G, 1] on the signed fp16 scale of each group (the grid is fixed)."""

    def __init__(self, bits: int, shape: tuple, parts: dict, flat: bool, dev: torch.device):
        parts = {p: v.to(dev)[None] if flat else v.to(dev) for p, v in parts.items()}  # [E, ...]
        super().__init__(parts["scale"].float()[..., None], bits, shape, parts, flat)  # [E, O, G, 1], signed
        self.grid = FP3_GRID.to(dev)

    def lut(self) -> torch.Tensor:
        return self.values() * self.grid

    def stored_parts(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scale": v[..., 0].half()}

    @torch.no_grad()
    def round_to_stored(self) -> None:
        """Set the values to what stored() rounds them to (fp16 scales)."""
        self.delta.copy_((self.values().half().float() - self.base) / self.ref)
