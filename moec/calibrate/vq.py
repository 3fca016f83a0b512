"""Vector codebooks for weight matrices (issue 17 item 2), pure fp32 functions.

Shapes: W [E, O, I] (E experts, O output rows, I inputs), H [E, I, I] the second moment of the inputs
(positive definite), d = vector length along I (d divides I), K = 2^(bits·d) codewords, J = I / d vectors
per row.

Each row o of expert e is stored as J codes into one codebook per expert matrix, C [E, K, d] fp16, times
one fp16 scale per row (rows of different norms share the codebook):

    w[e, o, j·d : (j+1)·d] = s[e, o] · C[e, idx[e, o, j]]

so a code costs bits·d bits and the codebook K·d·16 bits per matrix (256 × 4 at 2 bits: 2 KiB, 0.02 bit
per weight on a 576 × 1536 matrix). With `shared` (the rule's `shared_codebook`) the experts of a layer's
matrix share one codebook, C [1, K, d]: small experts pay K·d·16 bits once instead of E times (demo-moe's
[8, 160, 256] at 2 bits and d = 4: 0.4 bit per weight with a codebook per expert, 0.05 shared); its fit pools
every expert's vectors and normal equations (each expert still under its own Hessian).

Fitting (GPTVQ, van Baalen et al. 2024, in the variant below):
  1. scales: the RMS of each row; codebook initialised at the product grid of a 1-D weighted Lloyd
     quantizer with 2^bits levels over the matrix's normalized weights (so step 2 starts from a scalar
     quantizer and can only lower the weighted error), then weighted k-means on the d-vectors with the
     per-coordinate importances diag(H);
  2. GPTQ with vector assignment: columns are visited in groups of d; the group's d-vector is assigned
     to the codeword nearest in the metric of the not-yet-quantized problem, ‖U_BB⁻ᵀ (w − q)‖² with U the
     upper Cholesky factor of H⁻¹ and B the group, and its error is spread onto the columns not yet
     assigned as in scalar GPTQ;
  3. codebook and scales refitted by least squares under the full H for the fixed codes
     (`refit_codebook`, `refit_scales`), and step 2 once more.
The vectors run along the inputs, so with incoherence processing (moec/rotation.py) the rotated W is
what gets fitted, as for the scalar codecs.
"""

from __future__ import annotations

import torch

from ..formats import bitpack
from ..runtime.weightcodecs import vq_code_width, vq_codes
from .hls import gptq_factor, weighted_lloyd


def vq_codewords(bits: int, dim: int) -> int:
    return 1 << (bits * dim)


def _weighted_sq_dist(V: torch.Tensor, h: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """Σ_a h_a (v_a − c_a)² up to a per-vector constant: V, h [n, d], C [K, d] -> [n, K] (one matmul)."""
    return torch.cat([h, -2 * h * V], 1) @ torch.cat([C * C, C], 1).T


def _nearest(V: torch.Tensor, h: torch.Tensor, C: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """Index of the nearest codeword in the h-weighted metric, in row chunks that keep [chunk, K] in cache."""
    return torch.cat([_weighted_sq_dist(V[s : s + chunk], h[s : s + chunk], C).argmin(-1)
                      for s in range(0, V.shape[0], chunk)])


def weighted_kmeans(V: torch.Tensor, h: torch.Tensor, C: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """Lloyd steps from C [K, d] minimizing Σ_n Σ_a h_na (v_na − c_{k(n), a})²; empty cells keep their place."""
    K, d = C.shape
    for _ in range(iters):
        idx = _nearest(V, h, C)
        num = torch.zeros_like(C).index_add_(0, idx, h * V)
        den = torch.zeros_like(C).index_add_(0, idx, h)
        new = torch.where(den > 0, num / den.clamp_min(1e-30), C)
        if torch.allclose(new, C, rtol=0, atol=1e-7):
            break
        C = new
    return C


def init_codebook(Wn: torch.Tensor, hdiag: torch.Tensor, bits: int, dim: int, iters: int = 20) -> torch.Tensor:
    """C [K, d] for one matrix: normalized weights Wn [O, I], importances hdiag [I] (or [O, I]: per row, for rows
    of several experts pooled under one codebook)."""
    O, I = Wn.shape
    hw = hdiag.clamp_min(0).expand(O, I)
    levels = weighted_lloyd(Wn.reshape(1, -1), hw.reshape(1, -1), 1 << bits)[0]  # [L]
    grid = torch.cartesian_prod(*[levels] * dim) if dim > 1 else levels[:, None]  # [K, d], first coord slowest
    V, h = Wn.reshape(-1, dim), hw.reshape(-1, dim)
    return weighted_kmeans(V, h + 1e-12, grid.reshape(-1, dim).clone(), iters)


def gptq_assign_vq(Wn: torch.Tensor, U: torch.Tensor, C: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Codes [E, O, J] for normalized weights Wn [E, O, I] and codebooks C [E, K, d], columns in natural order,
    with GPTQ error feedback through U [E, I, I] (upper Cholesky factor of H⁻¹). The feedback is linear per
    row, so it runs on W / s as well as on W."""
    E, O, I = Wn.shape
    d = C.shape[2]
    block = max(d, block - block % d)
    W = Wn.float().clone()
    idx = torch.empty(E, O, I // d, dtype=torch.long, device=W.device)
    eye = torch.eye(d, device=W.device).expand(E, d, d)
    for i1 in range(0, I, block):
        i2 = min(i1 + block, I)
        W1 = W[:, :, i1:i2].clone()
        Err = torch.zeros_like(W1)
        U1 = U[:, i1:i2, i1:i2]
        for i in range(0, i2 - i1, d):
            Ub = U1[:, i : i + d, i : i + d]  # [E, d, d] upper triangular
            Ui = torch.linalg.solve_triangular(Ub, eye, upper=True)  # Ub⁻¹: row vectors w·Ub⁻¹ = (Ub⁻ᵀ w)ᵀ
            wt, ct = W1[:, :, i : i + d] @ Ui, C @ Ui  # [E, O, d], [E, K, d]
            k = ((ct * ct).sum(-1)[:, None, :] - 2 * wt @ ct.transpose(1, 2)).argmin(-1)  # [E, O]
            idx[:, :, (i1 + i) // d] = k
            # scalar GPTQ's d sequential column steps with q fixed, in one: err·U_BB = w − q
            err = wt - ct.gather(1, k[..., None].expand(E, O, d))  # [E, O, d]
            W1[:, :, i + d :] -= err @ U1[:, i : i + d, i + d :]
            Err[:, :, i : i + d] = err
        W[:, :, i2:] -= Err @ U[:, i1:i2, i2:]
    return idx


def reconstruct(C: torch.Tensor, s: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """W_hat [E, O, I] from codebooks C [E, K, d] (or [1, K, d]: shared), row scales s [E, O], codes idx [E, O, J]."""
    E, O, J = idx.shape
    d = C.shape[2]
    q = C.float().expand(E, -1, -1).gather(1, idx.reshape(E, O * J, 1).expand(E, O * J, d)).reshape(E, O, J * d)
    return q * s.float()[..., None]


def refit_codebook(W: torch.Tensor, H: torch.Tensor, s: torch.Tensor, idx: torch.Tensor, C: torch.Tensor,
                   iters: int = 30) -> torch.Tensor:
    """Codebooks minimizing Σ_e tr((W_e − Ŵ_e) H_e (W_e − Ŵ_e)ᵀ) for fixed codes and scales (a quadratic in C:
    conjugate gradients on its normal equations, at most `iters` steps): per expert for C [E, K, d], pooled over
    the experts for a shared C [1, K, d]."""
    if C.shape[0] == 1:
        return _codebook_cg(W.float(), H.float(), s.float(), idx, C[0].float(), iters)[None]
    return torch.stack([_codebook_cg(W[e : e + 1].float(), H[e : e + 1].float(), s[e : e + 1].float(),
                                     idx[e : e + 1], C[e].float(), iters) for e in range(W.shape[0])])


def _codebook_cg(W: torch.Tensor, H: torch.Tensor, s: torch.Tensor, idx: torch.Tensor, C0: torch.Tensor,
                 iters: int) -> torch.Tensor:
    """One codebook of refit_codebook for the matrices that use it: W [n, O, I], H [n, I, I], s [n, O],
    idx [n, O, J], C0 [K, d] -> C [K, d]."""
    K, d = C0.shape
    flat = idx.reshape(-1)

    def normal(X: torch.Tensor) -> torch.Tensor:  # Aᵀ H A X: the quadratic form's matrix applied to X [K, d]
        R = (reconstruct(X[None], s, idx) @ H) * s[..., None]  # [n, O, I]
        return torch.zeros(K, d, device=X.device).index_add_(0, flat, R.reshape(-1, d))

    rhs = torch.zeros(K, d, device=W.device).index_add_(0, flat, ((W @ H) * s[..., None]).reshape(-1, d))
    x = C0.clone()
    r = rhs - normal(x)
    p, rs = r.clone(), (r * r).sum()
    rs0 = rs
    for _ in range(iters):
        Ap = normal(p)
        alpha = rs / (p * Ap).sum().clamp_min(1e-30)
        x += alpha * p
        r -= alpha * Ap
        new = (r * r).sum()
        if new <= 1e-12 * rs0:
            break
        p, rs = r + (new / rs) * p, new
    return torch.where(torch.isfinite(x), x, C0)


def refit_scales(W: torch.Tensor, H: torch.Tensor, C: torch.Tensor, idx: torch.Tensor,
                 s: torch.Tensor) -> torch.Tensor:
    """Row scales minimizing the output error for fixed codes and codebooks: s_o = W_o H u_o / u_o H u_o."""
    Uq = reconstruct(C, torch.ones_like(s), idx)  # [E, O, I]
    UH = Uq @ H.float()
    num, den = (UH * W.float()).sum(-1), (UH * Uq).sum(-1)
    new = num / den.clamp_min(1e-30)
    return torch.where((den > 0) & (new.abs() > 1e-8), new, s)


def quantize_vq(W: torch.Tensor, H: torch.Tensor | None, bits: int, dim: int, rounds: int = 1,
                kmeans_iters: int = 20, shared: bool = False) -> dict:
    """Stored parts {"codes": int64 [E, O, J], "codebook": fp16 [E, K, d] ([1, K, d] when shared), "row_scale":
    fp16 [E, O]} for W [E, O, I] (see the module docstring). H None: identity (plain least squares, no error
    feedback)."""
    E, O, I = W.shape
    if I % dim:
        raise ValueError(f"vector length {dim} does not divide the input dim {I}")
    W = W.float()
    Hf = torch.eye(I, device=W.device).expand(E, I, I) if H is None else H.float()
    s = W.pow(2).mean(-1).sqrt().clamp_min(1e-8)  # [E, O]
    Wn = W / s[..., None]
    hdiag = Hf.diagonal(dim1=-2, dim2=-1)
    if shared:  # one codebook from every expert's vectors, each weighted by its own expert's importances
        C = init_codebook(Wn.reshape(E * O, I), hdiag[:, None, :].expand(E, O, I).reshape(E * O, I), bits, dim,
                          kmeans_iters)[None]
    else:
        C = torch.stack([init_codebook(Wn[e], hdiag[e], bits, dim, kmeans_iters) for e in range(E)])
    s, C = s.half().float(), C.half().float()
    if H is None:
        V = (W / s[..., None]).reshape(E, -1, dim)
        idx = torch.stack([_nearest(V[e], torch.ones_like(V[e]), C[0 if shared else e]) for e in range(E)])
        return {"codes": idx.view(E, O, I // dim), "codebook": C.half(), "row_scale": s.half()}
    _, U = gptq_factor(Hf, act_order=False)
    idx = gptq_assign_vq(W / s[..., None], U, C.expand(E, -1, -1))
    for _ in range(rounds):
        C = refit_codebook(W, Hf, s, idx, C).half().float()
        s = refit_scales(W, Hf, C, idx, s).half().float()
        idx = gptq_assign_vq(W / s[..., None], U, C.expand(E, -1, -1))
    return {"codes": idx, "codebook": C.half(), "row_scale": s.half()}


def fitted_weight(stored: dict) -> torch.Tensor:
    """W_hat [E, O, I] from quantize_vq's parts (codes unpacked; the stored form: weightcodecs.dequantize_vq)."""
    return reconstruct(stored["codebook"], stored["row_scale"], stored["codes"].long())


def quantize_vq_rule(W: torch.Tensor, H: torch.Tensor | None, rule) -> dict:
    """The registry's `quantize` hook: stored parts {codes uint8 [E, O, bytes] (BITSTREAM), codebook fp16
    [E, K, d], row_scale fp16 [E, O]} (formats/codecs.py). `gptq: false` assigns without error feedback."""
    d = rule.group_size
    st = quantize_vq(W, H if rule.gptq else None, rule.bits, d, shared=rule.shared_codebook)
    E, O, J = st["codes"].shape
    st["codes"] = bitpack.pack_bits(st["codes"], [vq_code_width(rule.bits, d)] * J)
    return st


class TunedVQ:
    """A vq matrix's tunable values (calibrate/tune.py protocol; the registry's `tune` hook): delta [E, K, d] ([1, K,
    d] shared) on the codebook (relative to its largest entry) and delta_s [E, O] on the row scales (relative to
    each), stored back as fp16; the codes stay fixed."""

    def __init__(self, bits: int, shape: tuple, parts: dict, flat: bool, dev: torch.device):
        E, O, I = shape
        self.bits, self.flat = bits, flat
        parts = {p: v.to(dev)[None] if flat else v.to(dev) for p, v in parts.items()}  # [E, ...]
        self.base, self.base_s = parts["codebook"].float(), parts["row_scale"].float()  # [E, K, d], [E, O]
        self.idx = vq_codes(parts, I)  # [E, O, J]
        self.ref = self.base.abs().amax((1, 2), keepdim=True).clamp_min(1e-12)
        self.ref_s = self.base_s.abs().clamp_min(1e-12)
        self.delta = torch.zeros_like(self.base, requires_grad=True)
        self.delta_s = torch.zeros_like(self.base_s, requires_grad=True)
        self.deltas = [self.delta, self.delta_s]

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base + self.ref * self.delta, self.base_s + self.ref_s * self.delta_s

    def weight(self) -> torch.Tensor:
        """W_hat [E, O, I] (the stored basis: W·R under incoherence)."""
        return reconstruct(*self.values(), self.idx)

    @torch.no_grad()
    def round_to_stored(self) -> None:
        """Set the values to what stored() rounds them to (fp16 codebook and row scales)."""
        cb, sc = self.values()
        self.delta.copy_((cb.half().float() - self.base) / self.ref)
        self.delta_s.copy_((sc.half().float() - self.base_s) / self.ref_s)

    @torch.no_grad()
    def stored(self) -> dict[str, torch.Tensor]:
        cb, sc = self.values()
        assert torch.isfinite(cb).all() and torch.isfinite(sc).all(), "non-finite codebook after tuning"
        parts = {"codebook": cb.half(), "row_scale": sc.half()}
        return {p: (t[0] if self.flat else t).cpu().contiguous() for p, t in parts.items()}
