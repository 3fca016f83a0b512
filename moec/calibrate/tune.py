"""End-to-end tuning of fitted codebooks and scales (`calibration.tune_steps` in a recipe).

After the layer-wise HLS/GPTQ fit every code index is fixed; what is left free is the value of each
codebook entry: hls lut [E, O, G, K] (int8 entries × one fp16 scale per group once stored: the entries
and the group's scale move together, the stored pair is recomputed from the tuned lut), fp3 the signed
fp16 scale of each group (its grid is fixed). The layer-wise objective sees one matrix at a time with
the source model's inputs; this step tunes them all at once against the model's output, minimizing
KL(p_source || p_quantized) over the calibration tokens with Adam (the codebook fine-tuning of AQLM /
PV-tuning, restricted to codebooks and scales so the stored layout and the bit count do not change).
Steps are parameterized relative to each codebook's largest magnitude (each scale's magnitude), so
one learning rate serves matrices of any scale. Runs on the calibration device.

With `tune_norms` the model's norm gains (`*norm.weight`, kept unquantized) are tuned too, additive steps
relative to each gain vector's rms: in front of a quantized matmul a norm gain is a per-input-channel scale of
it, the one such degree of freedom that costs no stored bit (the tuned gains replace the source's in the pack,
`tuned.<name>` in calib.safetensors, fp32). QuIP# and AQLM fine-tune the unquantized parameters likewise.

Held-back windows (`tune_holdout`): a seeded share of the calibration sequences is not trained on; the
KL on them is measured before the first step and every `tune_eval_every` steps, the state with the
lowest held-back KL is kept, and tuning stops after `tune_patience` evaluations without improvement
(after `tune_lr_drops` restarts from the best state at a third of the learning rate). The tuned
parameters fit a few thousand calibration tokens: without this, more steps overfit them (demo-moe,
hls2: past ~120 steps the PTB-test ppl rises while the calibration KL still falls).
"""

from __future__ import annotations

import logging
import math
import re

import torch
import torch.nn.functional as F
from torch.func import functional_call

from ..errors import UserError
from ..formats.codecs import ROTATION_PART
from ..progress import tracked
from ..registry import weight_codec
from ..rotation import rotate, unpack_signs
from ..runtime.config import ModelArgs
from ..runtime.model import build_model

log = logging.getLogger(__name__)

LR_DROP = 1 / 3  # the learning rate after each plateau restart (tune_lr_drops)
NORM_GAIN = re.compile(r"(^|\.)[a-z_]*norm\.weight$")  # attn_norm, ffn_norm, the final norm, q/k norms, MLA's
TUNED = "tuned."  # calib.safetensors prefix of a kept tensor's tuned value (calibrate/pack.py stores it instead)


def holdout_split(n: int, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit, held-back) sequence indices of n calibration sequences, disjoint, each sorted: round(holdout·n)
    held back (at least 1 when holdout > 0), drawn by a generator seeded with `seed` (the same split on
    every run and every process)."""
    k = 0 if holdout <= 0 else max(1, round(holdout * n))
    if k >= n:
        raise UserError(f"calibration.tune_holdout {holdout} holds back {k} of the {n} calibration sequences and "
                        f"leaves none to tune on: use more --samples or a smaller tune_holdout")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + 17))
    return perm[k:].sort().values, perm[:k].sort().values


def tune_codebooks(args: ModelArgs, state: dict[str, torch.Tensor], fitted: dict[str, torch.Tensor],
                   codecs: dict[str, tuple[str, int]], tokens: torch.Tensor, steps: int, lr: float, batch: int,
                   seed: int, device: str = "cpu", holdout: float = 0.0, eval_every: int = 10, patience: int = 0,
                   lr_drops: int = 0, norms: bool = False) -> dict:
    """Tune the fitted parameters in `fitted` (`fit.<param>.<part>`, replaced in place).

    state: source model tensors (canonical names); codecs: (codec, bits) of each tuned param (a 2-D
    param, an attention projection, stores its parts without the E axis); tokens [N, L] calibration
    sequences. Without `holdout` every sequence is tuned on for `steps` steps and the last state is
    kept; with it, see the module docstring. norms: the norm gains tuned too, written to `fitted` as
    `tuned.<name>` fp32. Returns the report (provenance of the calibration)."""
    dev = torch.device(device)
    st = {k: v.to(dev, torch.float32) for k, v in state.items()}
    teacher = build_model(args, st)
    student = build_model(args, dict(st))
    for p in list(teacher.parameters()) + list(student.parameters()):
        p.requires_grad_(False)
    params = {}
    for name, (codec, bits) in codecs.items():
        spec = weight_codec(codec)
        assert spec.tunable, codec
        parts = {k.removeprefix(f"fit.{name}."): v for k, v in fitted.items()
                 if k.startswith(f"fit.{name}.") and k != f"fit.{name}.{ROTATION_PART}"}
        flat = state[name].dim() == 2
        shape = state[name].shape if not flat else (1, *state[name].shape)
        params[name] = spec.hook("tune")(bits, shape, parts, flat, dev)  # the codec's tunable values
    # incoherence: the codebooks reconstruct W·R (fit_experts.rotation_signs); the model needs W = (W·R)·Rᵀ
    signs = {n: _signs(fitted, n, state[n].shape[-1]).to(dev) for n in params
             if f"fit.{n}.{ROTATION_PART}" in fitted}
    gains = {n: _Gain(st[n]) for n in st if norms and NORM_GAIN.search(n) and st[n].dim() == 1}

    def weights() -> dict[str, torch.Tensor]:
        w = {n: p.weight().reshape(state[n].shape) for n, p in params.items()}
        return {n: x if n not in signs else rotate(x, signs[n], inverse=True) for n, x in w.items()} | \
            {n: g.value() for n, g in gains.items()}

    def kl(b: torch.Tensor, w: dict) -> torch.Tensor:
        """Mean per-token KL(p_source || p_quantized) over the sequences b [n, L]."""
        with torch.no_grad():
            logp_src = torch.log_softmax(teacher(b).float(), -1)  # [n, L, V]
        logp_q = torch.log_softmax(functional_call(student, w, (b,)).float(), -1)
        return F.kl_div(logp_q, logp_src, log_target=True, reduction="none").sum(-1).mean()

    fit_ix, hold_ix = holdout_split(tokens.shape[0], holdout, seed)
    tokens = tokens.to(dev)
    fit_tokens, hold_tokens = tokens[fit_ix.to(dev)], tokens[hold_ix.to(dev)]

    @torch.no_grad()
    def held_back_kl() -> float:
        w = weights()
        return sum(kl(hold_tokens[i : i + batch], w).item() * len(hold_tokens[i : i + batch])
                   for i in range(0, len(hold_tokens), batch)) / len(hold_tokens)

    deltas = [d for p in params.values() for d in p.deltas] + [g.delta for g in gains.values()]
    opt = torch.optim.Adam(deltas, lr=lr)
    g = torch.Generator().manual_seed(seed)
    kls: list[float] = []
    history: list[tuple[int, float]] = []  # (steps done, held-back KL)
    best, best_step, best_state = math.inf, 0, None
    since_best, drops, cur_lr, stopped = 0, 0, lr, False
    if len(hold_tokens):
        best = held_back_kl()
        history.append((0, best))
        best_state = [d.detach().clone() for d in deltas]
    step = 0
    for step in tracked(range(1, steps + 1), "tuning codebooks", steps, "steps"):
        b = fit_tokens[torch.randint(0, fit_tokens.shape[0], (batch,), generator=g).to(dev)]  # [batch, L]
        loss = kl(b, weights())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        kls.append(loss.item())
        if not len(hold_tokens) or (step % eval_every and step != steps):
            continue
        h = held_back_kl()
        history.append((step, h))
        log.info("codebook tuning step %d: KL fit batch %.4f, held back %.4f", step, kls[-1], h)
        if h < best:
            best, best_step, since_best = h, step, 0
            best_state = [d.detach().clone() for d in deltas]
            continue
        since_best += 1
        if patience and since_best >= patience:
            if drops >= lr_drops:
                stopped = True
                break
            # plateau: restart from the best state at a lower learning rate (fresh Adam moments)
            drops, since_best, cur_lr = drops + 1, 0, cur_lr * LR_DROP
            with torch.no_grad():
                for d, s in zip(deltas, best_state, strict=True):
                    d.copy_(s)
            opt = torch.optim.Adam(deltas, lr=cur_lr)
    if best_state is not None:  # the held-back best (the untuned fit when no step improved it)
        with torch.no_grad():
            for d, s in zip(deltas, best_state, strict=True):
                d.copy_(s)
    for n, p in params.items():
        fitted.update({f"fit.{n}.{part}": t for part, t in p.stored().items()})
        p.round_to_stored()
    fitted.update({f"{TUNED}{n}": g.value().detach().cpu().contiguous() for n, g in gains.items()})
    # the held-back KL of what is stored: hls entries round to int8 steps of 1/127 of the group's largest,
    # which can undo moves smaller than that
    kl_stored = held_back_kl() if len(hold_tokens) else None
    k = max(1, min(10, len(kls) // 5))  # batch KL averaged over the first and the last k steps
    report = {"steps": steps, "steps_run": step, "lr": lr, "batch": batch,
              "codecs": sorted({c for c, _ in codecs.values()}), "norms": sorted(gains),
              "kl_fit_first": _mean(kls[:k]), "kl_fit_last": _mean(kls[-k:])}
    if len(hold_tokens):
        report |= {"holdout": holdout, "holdout_sequences": hold_ix.tolist(), "fit_sequences": len(fit_ix),
                   "eval_every": eval_every, "patience": patience, "lr_drops": lr_drops, "lr_drops_used": drops,
                   "stopped_early": stopped, "best_step": best_step, "kl_holdout_first": history[0][1],
                   "kl_holdout_best": best, "kl_holdout_stored": kl_stored,
                   "kl_holdout_history": [[s, float(f"{v:.6g}")] for s, v in history]}
    return report


class _Gain:
    """A norm gain g0 [D] tuned as g0 + rms(g0)·delta (fp32 throughout)."""

    def __init__(self, g0: torch.Tensor):
        self.g0 = g0.detach().float()
        self.ref = self.g0.pow(2).mean().sqrt().clamp_min(1e-6)
        self.delta = torch.zeros_like(self.g0, requires_grad=True)

    def value(self) -> torch.Tensor:
        return self.g0 + self.ref * self.delta


def _signs(fitted: dict[str, torch.Tensor], name: str, n_in: int) -> torch.Tensor:
    """The ±1 rotation signs of `name` [I / b, b] (stored bit-packed: rotation.pack_signs)."""
    return unpack_signs(fitted[f"fit.{name}.{ROTATION_PART}"], n_in)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan
