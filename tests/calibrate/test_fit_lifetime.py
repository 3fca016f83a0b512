"""Memory lifetime of the expert fit (issue 20): ExpertFitter.on_layer damps the Hessians in place and
fits one expert at a time; the stored parts must be the bytes of the batched fit over a damped copy of
the whole stack (the code before that change, written out here as the reference), and the report's
output errors the same figures up to the last rounding digit."""

from __future__ import annotations

import pytest
import torch

from moec.calibrate.fit_experts import ExpertFitter
from moec.calibrate.hessian import regularize
from moec.calibrate.hls import output_error
from moec.calibrate.recipe import WeightRule
from moec.registry import weight_codec

E, D, I, MIN_TOKENS = 4, 32, 48, 40


def _stats(g: torch.Generator) -> dict:
    """Routed sums for E experts (experts 1 and 3 starved below MIN_TOKENS) and all-token sums."""
    count = torch.tensor([64, 20, 50, 8])
    H1 = torch.stack([(x := torch.randn(int(n), D, generator=g)).T @ x for n in count])
    H2 = torch.stack([(a := torch.randn(int(n), I, generator=g)).T @ a for n in count])
    xa, aa = torch.randn(200, D, generator=g), torch.randn(E, 200, I, generator=g)
    return {"H1": H1, "H2": H2, "count": count, "experts": list(range(E)), "H1_all": xa.T @ xa,
            "H2_all": aa.transpose(1, 2) @ aa, "n_all": 200}


def _reference(stats: dict, sd: dict, rule: WeightRule) -> tuple[dict, dict]:
    """The batched fit: a damped copy of each stack, all experts in one quantize call."""
    tensors, errors = {}, {}
    for key, params in (("H1", ("w1", "w3")), ("H2", ("w2",))):
        H = stats[key].clone()
        for e in range(E):
            if stats["count"][e] < MIN_TOKENS:
                H[e] = stats[f"{key}_all"] if stats[f"{key}_all"].dim() == 2 else stats[f"{key}_all"][e]
            H[e] = regularize(H[e])[0]
        for p in params:
            W = sd[f"layers.0.moe.{p}"].float()
            spec = weight_codec(rule.codec)
            stored = spec.hook("quantize")(W, H, rule)
            W_hat = spec.hook("dequantize")(rule.bits, tuple(W.shape), stored)
            errors[p] = [round(x, 6) for x in output_error(W, W_hat, H).tolist()]
            tensors.update({f"fit.layers.0.moe.{p}.{k}": t for k, t in stored.items()})
    return tensors, errors


@pytest.mark.parametrize("codec,bits,gptq", [("hls", 2, True), ("fp3", 3, True), ("rtn", 3, False), ("fp8", 8, False)])
def test_per_expert_in_place_fit_matches_batched_fit(codec, bits, gptq):
    g = torch.Generator().manual_seed(0)
    sd = {"layers.0.moe.w1": torch.randn(E, I, D, generator=g).bfloat16(),
          "layers.0.moe.w3": torch.randn(E, I, D, generator=g).bfloat16(),
          "layers.0.moe.w2": torch.randn(E, D, I, generator=g).bfloat16()}
    stats = _stats(g)
    rule = WeightRule(targets=["experts"], codec=codec, bits=bits, group_size=16 if codec != "fp8" else 0, gptq=gptq)
    ref_tensors, ref_errors = _reference({k: v.clone() if torch.is_tensor(v) else v for k, v in stats.items()},
                                         sd, rule)
    fitter = ExpertFitter({f"layers.0.moe.{p}": rule for p in ("w1", "w2", "w3")}, lambda i: sd,
                          "all-experts-for-stats", MIN_TOKENS)
    fitter.on_layer(0, stats)
    assert sorted(fitter.tensors) == sorted(ref_tensors)
    for name, t in fitter.tensors.items():
        ref = ref_tensors[name]
        assert t.dtype == ref.dtype and t.shape == ref.shape, name
        assert torch.equal(t.view(torch.uint8), ref.contiguous().view(torch.uint8)), name  # the same bytes
    for p, errs in ref_errors.items():  # a report figure: einsum's sums may round differently per batch size
        assert fitter.report[0][p]["rel_output_error"] == pytest.approx(errs, rel=1e-4, abs=2e-6), p
    hs = [e["hessian_w2"] for e in fitter.report[0]["experts"]]
    assert hs == ["routed", "all-tokens", "routed", "all-tokens"], hs  # both sources were exercised
    assert "H2_all" not in stats and "H1_all" not in stats  # dropped once used
