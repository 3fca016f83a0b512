"""End-to-end tuning of fitted hls codebooks (`calibration.tune_steps` in a recipe).

After the layer-wise HLS/GPTQ fit every code index is fixed; what is left free is the value of each
codebook entry (lut [E, O, G, K], int8 × fp16 scale once stored). The layer-wise objective sees one
matrix at a time with the source model's inputs; this step tunes all codebooks at once against the
model's output, minimizing KL(p_source || p_quantized) over the calibration tokens with Adam (the
codebook fine-tuning of AQLM / PV-tuning, restricted to the codebooks so the stored layout and the
bit count do not change). Steps are parameterized relative to each codebook's largest magnitude, so
one learning rate serves matrices of any scale. Runs on the calibration device.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch.func import functional_call

from ..formats import bitpack
from ..progress import tracked
from ..rotation import rotate, unpack_signs
from ..runtime.config import ModelArgs
from ..runtime.model import build_model
from . import hls

log = logging.getLogger(__name__)


def tune_codebooks(args: ModelArgs, state: dict[str, torch.Tensor], fitted: dict[str, torch.Tensor],
                   shapes: dict[str, tuple], bits: dict[str, int], tokens: torch.Tensor, steps: int, lr: float,
                   batch: int, seed: int, device: str = "cpu") -> dict:
    """Tune the hls codebooks in `fitted` (`fit.<param>.codebook` / `.cb_scale`, replaced in place).

    state: source model tensors (canonical names); shapes/bits: [E, O, I] and bits of each hls param
    (E = 1 for a 2-D param, an attention projection, whose fitted parts carry no E axis);
    tokens [N, L] calibration sequences. Returns a report {steps, kl_first, kl_last}."""
    dev = torch.device(device)
    st = {k: v.to(dev, torch.float32) for k, v in state.items()}
    teacher = build_model(args, st)
    student = build_model(args, dict(st))
    for p in list(teacher.parameters()) + list(student.parameters()):
        p.requires_grad_(False)
    lut0, idx, scale, delta = {}, {}, {}, {}
    for name, (E, O, I) in shapes.items():
        parts = {p: fitted[f"fit.{name}.{p}"].to(dev) for p in ("codebook", "cb_scale")}
        if state[name].dim() == 2:  # attention: parts stored without the E axis
            parts = {p: v[None] for p, v in parts.items()}
        lut0[name] = hls.lut_from_stored("hls", bits[name], parts)  # [E, O, G, K]
        G = lut0[name].shape[2]
        codes = bitpack.unpack(fitted[f"fit.{name}.codes"].to(dev), bits[name], I)
        idx[name] = codes.view(E, O, G, I // G).long()  # [E, O, G, g]
        scale[name] = lut0[name].abs().amax(-1, keepdim=True)  # [E, O, G, 1]
        delta[name] = torch.zeros_like(lut0[name], requires_grad=True)
    # incoherence: the codebooks reconstruct W·R (fit_experts.rotation_signs); the model needs W = (W·R)·Rᵀ
    signs = {n: unpack_signs(fitted[f"fit.{n}.had_signs"], shapes[n][-1]).to(dev) for n in lut0
             if f"fit.{n}.had_signs" in fitted}  # stored bit-packed (rotation.pack_signs)
    opt = torch.optim.Adam(delta.values(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    tokens = tokens.to(dev)
    kls = []
    for step in tracked(range(steps), "tuning codebooks", steps, "steps"):
        b = tokens[torch.randint(0, tokens.shape[0], (batch,), generator=g).to(dev)]  # [batch, L]
        with torch.no_grad():
            logp_src = torch.log_softmax(teacher(b).float(), -1)  # [batch, L, V]
        weights = {n: (lut0[n] + scale[n] * delta[n]).gather(-1, idx[n]).reshape(state[n].shape) for n in lut0}
        weights = {n: w if n not in signs else rotate(w, signs[n], inverse=True) for n, w in weights.items()}
        logp_q = torch.log_softmax(functional_call(student, weights, (b,)).float(), -1)
        loss = F.kl_div(logp_q, logp_src, log_target=True, reduction="none").sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        kls.append(loss.item())
        if step % 10 == 0:
            log.info("codebook tuning step %d: KL %.4f", step, kls[-1])
    with torch.no_grad():
        for n in lut0:
            lut = lut0[n] + scale[n] * delta[n]
            assert torch.isfinite(lut).all(), f"{n}: non-finite codebook after tuning"
            for part, t in hls.int8_codebook(lut).items():
                fitted[f"fit.{n}.{part}"] = (t if state[n].dim() == 3 else t[0]).cpu().contiguous()
    k = max(1, min(10, steps // 5))  # KL averaged over the first and the last k steps
    return {"steps": steps, "lr": lr, "batch": batch, "kl_first": _mean(kls[:k]),
            "kl_last": _mean(kls[-k:])}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan
