"""Incoherence processing at calibrate time (calibrate/recipe.Incoherence, fit_experts): the fit of a
rotated rule is the plain fit of W·R under RᵀHR, rotations are shared by the matrices that read one
input, and a block that does not divide a matrix's input dim is refused naming the matrix."""

import re

import pytest
import torch

from moec.calibrate import hls
from moec.calibrate.fit_experts import ExpertFitter, plan, rotation_signs
from moec.calibrate.recipe import Incoherence, WeightRule, parse_recipe
from moec.errors import UserError
from moec.rotation import block_hadamard, hadamard, unpack_signs
from moec.runtime.experts import dequantize
from moec.runtime.hf_layout import HFCheckpoint


def _layer(E=3, D=32, I=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {"layers.1.moe.w1": torch.randn(E, I, D, generator=g), "layers.1.moe.w3": torch.randn(E, I, D, generator=g),
          "layers.1.moe.w2": torch.randn(E, D, I, generator=g)}
    x = torch.randn(256, D, generator=g) * torch.linspace(0.1, 3, D)  # uneven channels, as real inputs have
    a = torch.randn(256, I, generator=g)
    stats = {"H1": (x.T @ x).expand(E, D, D).clone(), "H2": (a.T @ a).expand(E, I, I).clone(),
             "count": torch.full((E,), 256)}
    return sd, stats


@pytest.mark.parametrize("codec,bits,group", [("hls", 2, 0), ("hls", 3, 16), ("rtn", 3, 16)])
def test_fit_in_rotated_basis_is_the_plain_fit_of_w_r(codec, bits, group):
    sd, stats = _layer()
    rule = WeightRule(targets=["experts"], codec=codec, bits=bits, group_size=group, incoherence=Incoherence())
    fitter = ExpertFitter({f"layers.1.moe.{p}": rule for p in ("w1", "w2", "w3")}, lambda i: sd,
                          "all-experts-for-stats", 0, seed=5)
    fitter.on_layer(1, {k: v.clone() for k, v in stats.items()})
    t = fitter.tensors
    s13, s2 = t["fit.layers.1.moe.w1.had_signs"], t["fit.layers.1.moe.w2.had_signs"]
    assert torch.equal(s13, t["fit.layers.1.moe.w3.had_signs"])  # gate and up read one x: one rotation
    # stored bit-packed (uint8 [I / b, ceil(b / 8)]); auto blocks: the largest powers of two dividing 32, 48
    assert s13.dtype == s2.dtype == torch.uint8 and s13.shape == (1, 4) and s2.shape == (3, 2)
    s13, s2 = unpack_signs(s13, 32), unpack_signs(s2, 48)
    assert s13.shape == (1, 32) and s2.shape == (3, 16)
    assert fitter.report[1]["w2"]["incoherence_block"] == 16
    for p, key, s in (("w1", "H1", s13), ("w2", "H2", s2)):
        R = block_hadamard(s.numel(), s.shape[1], seed=(5 * 100_003 + 1) * 4 + (p == "w2"))
        nb, b = s.shape  # the stored signs define R (the seeding is the fitter's, recomputed here)
        torch.testing.assert_close(torch.block_diag(*[hadamard(b)] * nb) * s.flatten().float() / b**0.5, R)
        # the same damped H the fitter used (regularize is deterministic), rotated densely here
        H, _ = fitter._hessians({**stats, key: stats[key]}, key, [0, 1, 2])
        W = sd[f"layers.1.moe.{p}"]
        want = hls.quantize(W @ R, R.T @ H @ R, codec, bits, group, gptq=True)
        got = {k.rsplit(".", 1)[-1]: v for k, v in t.items() if k.startswith(f"fit.layers.1.moe.{p}.")}
        assert got.keys() == want.keys() | {"had_signs"}
        W_got = dequantize(codec, bits, tuple(W.shape), got)
        W_want = dequantize(codec, bits, tuple(W.shape), want)
        # the dense and the block rotation of W and H differ by rounding only, which can move a few
        # weights across a codebook boundary: compare reconstructions, not bits
        assert (W_got - W_want).norm() <= 0.05 * W_want.norm(), (W_got - W_want).norm() / W_want.norm()
        # and the fit is a fit of W·R: far better than of W itself, reconstructed back as W_hat·Rᵀ ≈ W
        assert (W_got @ R.T - W).norm() < 0.5 * W.norm()
        assert (W_got - W).norm() > W.norm()


def test_rotation_seeds_differ_by_layer_and_input():
    rule = WeightRule(targets=["experts"], codec="hls", bits=2, incoherence=Incoherence(block=16))
    a, b = rotation_signs("layers.0.moe.w1", 64, rule, 0), rotation_signs("layers.1.moe.w1", 64, rule, 0)
    assert not torch.equal(a, b) and torch.equal(a, rotation_signs("layers.0.moe.w3", 64, rule, 0))
    assert not torch.equal(a, rotation_signs("layers.0.moe.w2", 64, rule, 0))
    assert not torch.equal(a, rotation_signs("layers.0.moe.w1", 64, rule, 1))
    assert rotation_signs("layers.0.moe.w1", 64, WeightRule(targets=["experts"], codec="hls", bits=2), 0) is None


def test_auto_block():
    inc = Incoherence()
    assert [inc.block_for(n) for n in (576, 1536, 14336, 4096, 40)] == [64, 512, 512, 512, 8]
    assert Incoherence(max_block=128).block_for(1536) == 128 and Incoherence(block=64).block_for(1536) == 64
    assert Incoherence(block=512).block_for(576) == 0


@pytest.mark.parametrize("inc,message", [({"block": 48}, "incoherence.block must be a power of two or 0"),
                                         ({"max_block": 0}, "incoherence.max_block must be a power of two"),
                                         ({"blok": 4}, "unknown key 'blok'")])
def test_bad_incoherence_config(inc, message):
    with pytest.raises(UserError, match=re.escape(message)):
        parse_recipe({"weights": [{"targets": ["experts"], "codec": "hls", "bits": 2, "incoherence": inc}]})


def test_block_that_does_not_divide_names_the_matrix(tiny_moe_dir):
    """tiny: D = 48 (w1/w3 inputs), I = 40 (w2 inputs): block 16 divides 48, not 40."""
    args = HFCheckpoint(tiny_moe_dir).args
    recipe = parse_recipe({"weights": [{"targets": ["experts"], "codec": "hls", "bits": 2,
                                        "incoherence": {"block": 16}}]})
    with pytest.raises(UserError, match=re.escape("incoherence block 16 does not divide the input dim 40 of "
                                                  "layers.0.moe.w2")):
        plan(args, recipe)


def test_expert_parallel_merge_keeps_the_shared_rotation():
    """Two ranks' shares of one layer (experts 0, 2 and 1): per-expert parts interleave, the layer's
    rotation (no E axis, the same on every rank) is kept once."""
    from moec.calibrate.fit_experts import _merge

    signs = torch.ones(2, 8, dtype=torch.int8)
    codes = torch.arange(3 * 4).view(3, 4)
    entry = {"experts": [{"tokens": 1}], "w2": {"codec": "hls", "rel_output_error": [0.1]}}
    shares = [({"fit.layers.0.moe.w2.codes": codes[[0, 2]], "fit.layers.0.moe.w2.had_signs": signs},
               {"entry": {"experts": [{"tokens": 0}, {"tokens": 2}], "w2": {"rel_output_error": [0.0, 0.2]}},
                "experts": [0, 2]}),
              ({"fit.layers.0.moe.w2.codes": codes[[1]], "fit.layers.0.moe.w2.had_signs": signs},
               {"entry": {**entry, "experts": [{"tokens": 1}]}, "experts": [1]})]
    tensors, merged = _merge(shares, 3)
    assert torch.equal(tensors["fit.layers.0.moe.w2.codes"], codes)
    assert torch.equal(tensors["fit.layers.0.moe.w2.had_signs"], signs)
    assert merged["w2"]["rel_output_error"] == [0.0, 0.1, 0.2]
