"""Rotated quantized matrices at run time (runtime/experts.py): the torch path, the fused decode and
grouped kernels (Triton's interpreter on the CPU) and QLinear compute x·W_effᵀ with W_eff = W'_hat·Rᵀ,
the dense reference built here from the stored parts and the dense rotation matrix."""

import os

import torch

if not torch.cuda.is_available():  # the CPU runs the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moec.calibrate import hls  # noqa: E402
from moec.errors import FormatError  # noqa: E402
from moec.rotation import block_hadamard, hadamard_signs, pack_signs  # noqa: E402
from moec.runtime.backend import kernels_forced  # noqa: E402
from moec.runtime.experts import ExpertWeights, QLinear, QuantMatrix  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _matrix(E, O, I, block, seed, codec="hls", bits=2, packed=True):
    """(QuantMatrix, dense W_eff [E, O, I]): a random fit stored with rotation signs (block 0: none),
    bit-packed as checkpoints store them (packed=False: int8, as packs before bit packing did)."""
    g = torch.Generator().manual_seed(seed)
    stored = hls.quantize(torch.randn(E, O, I, generator=g) * 0.1, None, codec, bits, 0, False)
    signs = hadamard_signs(I, block, seed) if block else None
    if block:
        stored["had_signs"] = pack_signs(signs) if packed else signs
    q = QuantMatrix(codec, bits, (E, O, I), stored)
    W = q.dequant_ref()  # W' = the stored (rotated-basis) weights
    return q, (W @ block_hadamard(I, block, seed).T if block else W)


def _experts(E, D, I, b13, b2, bits=2):
    (q1, W1), (q3, W3), (q2, W2) = _matrix(E, I, D, b13, 1, bits=bits), _matrix(E, I, D, b13, 1, bits=bits), \
        _matrix(E, D, I, b2, 2, bits=bits)
    return ExpertWeights(q1, q3, q2), (W1, W3, W2)


def _dense(Ws, x, ids, wts):
    W1, W3, W2 = Ws
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for a in range(ids.shape[1]):
            e = int(ids[n, a])
            out[n] += wts[n, a] * ((F.silu(W1[e] @ x[n]) * (W3[e] @ x[n])) @ W2[e].T)
    return out


def test_int8_and_bit_packed_signs_compute_the_same():
    """Packs written before bit packing store int8 signs: the same rotation, bit for bit."""
    for block in (1, 4, 8, 32):
        (a, Wa), (b, Wb) = _matrix(2, 8, 64, block, 3), _matrix(2, 8, 64, block, 3, packed=False)
        assert torch.equal(a.had_signs, b.had_signs) and torch.equal(Wa, Wb)
        x = torch.randn(5, 64)
        assert torch.equal(a.rotate_input(x), b.rotate_input(x))


@pytest.mark.parametrize("b13,b2", [(16, 32), (64, 8), (0, 32), (16, 0)])
def test_reference_path_matches_dense(b13, b2):
    ew, Ws = _experts(3, 64, 32, b13, b2)
    x = torch.randn(5, 64)
    for e in range(3):
        want = (F.silu(x @ Ws[0][e].T) * (x @ Ws[1][e].T)) @ Ws[2][e].T
        torch.testing.assert_close(ew.expert(e, x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# N = 1, 2: the decode GEMV (moe_decode); 5: the grouped kernel (moe_prefill)
@pytest.mark.parametrize("N,bits", [(1, 2), (2, 3), (5, 2), (5, 3)])
def test_fused_kernels_with_rotation_match_dense(N, bits):
    E, D, I, A = 4, 64, 32, 2
    ew, Ws = _experts(E, D, I, 32, 16, bits=bits)
    ew = ew.to(DEVICE)
    g = torch.Generator().manual_seed(N)
    x = torch.randn(N, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(N)])
    wts = torch.softmax(torch.randn(N, A, generator=g), -1)
    with kernels_forced("1"):
        assert ew.fused_ok(x.to(DEVICE))
        got = ew.fused(x.to(DEVICE), wts.to(DEVICE), ids.to(DEVICE)).float().cpu()
    want = _dense(Ws, x, ids, wts)
    # the kernels read fp16 tables (the reference: fp32 luts), the grouped one multiplies in bf16
    tol = (1e-2 if N > 2 else 2e-3) * want.abs().max().item()
    assert (got - want).abs().max().item() <= tol, (got - want).abs().max().item()
    unrotated = _dense(tuple(w.dequant_ref().cpu() for w in (ew.w1, ew.w3, ew.w2)), x, ids, wts)
    assert (got - unrotated).abs().max().item() > 10 * tol  # the rotation is not a no-op here


def test_gate_and_up_with_different_rotations_take_the_torch_path():
    (q1, _), (q3, _), (q2, _) = _matrix(2, 32, 64, 16, 1), _matrix(2, 32, 64, 16, 9), _matrix(2, 64, 32, 16, 2)
    ew = ExpertWeights(q1, q3, q2)
    with kernels_forced("1"):
        assert not ew.shared_x and not ew.fused_ok(torch.zeros(1, 64))


def test_qlinear_with_rotation_matches_dense():
    q, W = _matrix(1, 24, 64, 32, 4, codec="rtn", bits=4)
    lin = QLinear(q, torch.randn(24))
    x = torch.randn(3, 7, 64)
    torch.testing.assert_close(lin(x), F.linear(x, W[0], lin.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("signs", [torch.ones(3, 20, dtype=torch.int8), torch.full((2, 32), 2, dtype=torch.int8),
                                   torch.ones(1, 32, dtype=torch.int8), torch.zeros(2, 3, dtype=torch.uint8),
                                   torch.zeros(3, 3, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.int16),
                                   torch.full((16, 1), 0xF0, dtype=torch.uint8)])
def test_bad_signs_are_a_format_error(signs):
    stored = hls.quantize(torch.randn(1, 8, 64), None, "hls", 2, 0, False)
    with pytest.raises(FormatError, match="had_signs"):
        QuantMatrix("hls", 2, (1, 8, 64), {**stored, "had_signs": signs})


def test_random_pack_stores_bit_packed_signs_and_loads(tmp_path):
    """pack --random with an incoherence recipe: signs stored one bit each (uint8 [I / b, ceil(b / 8)]), the
    loader's part check takes them, and a manifest whose signs do not cover the inputs is a FormatError."""
    import json

    from moec.calibrate.pack import pack_random
    from moec.calibrate.recipe import load_recipe
    from moec.formats import checkpoint
    from moec.runtime.config import ModelArgs
    from moec.runtime.loader import check_quant_parts, load_model

    args = ModelArgs(arch="mixtral", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                     max_seq_len=128, n_experts=4, top_k=2, expert_dim=16)
    ck = tmp_path / "ck"
    pack_random(args, "tiny", load_recipe("moec/recipes/experts-hls2-had.yaml"), ck)
    man = json.loads((ck / checkpoint.MANIFEST).read_text())
    e = man["tensors"]["layers.0.moe.w1.had_signs"]  # 32 inputs, auto block 32: one row of 4 bytes
    assert (e["dtype"], e["shape"]) == ("uint8", [1, 4])
    model, _ = load_model(ck)
    assert model.layers[0].moe.codec.w1.had_signs.shape == (1, 32)
    e["shape"] = [1, 3]
    with pytest.raises(FormatError, match="had_signs.*expected uint8"):
        check_quant_parts(ck, man)
