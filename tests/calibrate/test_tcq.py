"""The tcq weight codec (moec/codecs/tcq.py; fit calibrate/tcq.py, runtime runtime/tcq.py): the Viterbi search
returns the least-error path of the bitshift trellis (checked against every path of a small one), a continued path
starts where the previous one ended, the stored stream gives back every state and the fit's weights exactly (2, 3
and 4 bits: 3-bit symbols straddle words), the held buffers dequantize to the same values, and on Gaussian rows
the 2-bit trellis beats the 2-bit Lloyd-Max quantizer's error (0.1175 of the variance)."""

import itertools

import pytest
import torch

from moec.calibrate import tcq
from moec.calibrate.recipe import WeightRule
from moec.errors import UserError
from moec.runtime import tcq as rt


def _decode(bits: list[int], L: int, k: int, s0: int) -> list[int]:
    states, s = [], s0
    for b in bits:
        s = (s >> k) | (b << (L - k))
        states.append(s)
    return states


def test_viterbi_is_the_best_path():
    L, k, T = 4, 2, 4
    table = rt.code_table(L)
    x = torch.randn(3, T, generator=torch.Generator().manual_seed(0)) * rt.CODE_STD
    got = tcq.viterbi(x, L, k, None, table)
    for n in range(3):
        best = min(((sum((x[n, t] - table[s]) ** 2 for t, s in enumerate(_decode(list(bits), L, k, s0))), s0, bits)
                    for s0 in range(1 << L) for bits in itertools.product(range(1 << k), repeat=T)),
                   key=lambda c: float(c[0]))
        err = sum((x[n, t] - table[s]) ** 2 for t, s in enumerate(got[n].tolist()))
        assert abs(float(err) - float(best[0])) < 1e-5
        path = got[n].tolist()  # a trellis path: each state is the previous one shifted down by k bits
        assert all((b & ((1 << (L - k)) - 1)) == (a >> k) for a, b in zip(path[:-1], path[1:], strict=True))
    start = got[:, -1]
    nxt = tcq.viterbi(x.flip(1), L, k, start, table)
    assert torch.equal(nxt[:, 0] & ((1 << (L - k)) - 1), start >> k)


def test_viterbi_in_row_chunks_matches_one_search(monkeypatch):
    """Rows searched in chunks (the cost history's memory cap) give the same paths as one search."""
    L, k = 6, 2
    table = rt.code_table(L)
    x = torch.randn(7, 10, generator=torch.Generator().manual_seed(1)) * rt.CODE_STD
    start = torch.arange(7) * 5 % (1 << L)
    whole = tcq.viterbi(x, L, k, start, table)
    monkeypatch.setattr(tcq, "HISTORY_BYTES", {"cpu": 3 * 10 * (4 << L)})  # 3 rows per chunk
    assert torch.equal(tcq.viterbi(x, L, k, start, table), whole)


@pytest.mark.parametrize("k, n_in", [(2, 48), (3, 40), (4, 24)])
def test_stream_gives_back_the_states_and_weights(k, n_in):
    W = torch.randn(2, 5, n_in, generator=torch.Generator().manual_seed(k))
    states, scale = tcq.fit(W, None, k, block=8)
    codes = rt.pack_states(states, k, scale.half())
    assert codes.shape == (2, 5, 4 * (1 + -(-k * n_in // 32))) and codes.dtype == torch.uint8
    assert torch.equal(rt.unpack_states(codes, k, n_in), states)  # the scale's bits never enter a state
    assert torch.equal(rt.lead_scale(codes), scale.half())
    stored = {"codes": codes}
    W_hat = rt.dequantize_tcq(k, tuple(W.shape), stored)
    assert torch.equal(W_hat, rt.code_table()[states] * scale[..., None])
    held = rt.hold_tcq(k, stored)
    assert torch.equal(rt.held_dequantize_tcq(k, tuple(W.shape), held), W_hat)
    # a stop-50 pack: the scale as its own part, the lead word's low bits zero
    old = {"codes": rt.pack_states(states, k), "row_scale": scale.half()}
    assert torch.equal(rt.dequantize_tcq(k, tuple(W.shape), old), W_hat)
    assert torch.equal(rt.hold_tcq(k, old)["scale"], held["scale"])
    assert torch.equal(rt.with_lead_scale(old["codes"], scale.half()), codes)
    rand = rt.random_tcq(k, (2, 5, n_in), 0, "cpu", torch.Generator().manual_seed(0))
    assert torch.equal(rt.pack_states(rt.unpack_states(rand["codes"], k, n_in), k, rt.lead_scale(rand["codes"])),
                       rand["codes"])


def test_two_bit_trellis_beats_scalar_levels_on_gaussian_rows():
    W = torch.randn(1, 64, 128, generator=torch.Generator().manual_seed(1))
    states, scale = tcq.fit(W, None, 2, L=10, block=64)
    Wh = rt.code_table(10)[states] * scale[..., None]
    assert ((W - Wh) ** 2).mean() / W.pow(2).mean() < 0.1


def test_hessian_fit_lowers_the_output_error():
    g = torch.Generator().manual_seed(2)
    X = torch.randn(512, 64, generator=g) * torch.linspace(0.2, 3, 64)  # uneven input scales
    X = X + 2 * torch.randn(512, 1, generator=g)  # and a component they share: the feedback has work to do
    H = (X.T @ X)[None]
    W = torch.randn(1, 16, 64, generator=g)
    rule = WeightRule(targets=["experts"], codec="tcq", bits=2)
    out = {}
    for gptq in (False, True):
        rule.gptq = gptq
        st = tcq.quantize_tcq_rule(W, H, rule)
        d = W - rt.dequantize_tcq(2, tuple(W.shape), st)
        out[gptq] = float(torch.einsum("eoi,eij,eoj->", d, H, d) / torch.einsum("eoi,eij,eoj->", W, H, W))
    assert out[True] < 0.8 * out[False]


def test_rule_checks():
    with pytest.raises(UserError, match="block-LDLQ"):
        WeightRule(targets=["experts"], codec="tcq", bits=2, group_size=512)
    with pytest.raises(UserError, match="takes bits"):
        WeightRule(targets=["experts"], codec="tcq", bits=8)


@pytest.mark.parametrize("flat", [False, True])
def test_tuned_scales_go_back_into_the_lead_words(flat):
    W = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3))
    parts = tcq.quantize_tcq_rule(W, None, WeightRule(targets=["experts"], codec="tcq", bits=2))
    if flat:
        parts, W = {"codes": parts["codes"][0]}, W[:1]
    tuned = tcq.TunedTCQ(2, (1 if flat else 2, 4, 64), parts, flat, torch.device("cpu"))
    with torch.no_grad():
        tuned.delta_s.fill_(0.25)
    tuned.round_to_stored()
    out = tuned.stored()
    assert set(out) == {"codes"} and out["codes"].shape == parts["codes"].shape
    codes = out["codes"] if not flat else out["codes"][None]
    orig = parts["codes"] if not flat else parts["codes"][None]
    assert torch.equal(rt.unpack_states(codes, 2, 64), rt.unpack_states(orig, 2, 64))  # paths fixed
    assert torch.equal(rt.lead_scale(codes).float(), tuned.scale().detach())
    torch.testing.assert_close(rt.lead_scale(codes).float(), rt.lead_scale(orig).float() * 1.25, rtol=1e-3, atol=0)
