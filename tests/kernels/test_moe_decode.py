"""Fused MoE decode GEMV vs its torch reference: every storage mode (2/3/4-bit tables, affine rtn, fp8,
bf16), word and byte paths, top-k 1/2/8, odd token counts, experts with no tokens, grouped tables.
CPU: Triton's interpreter at toy shapes, plus a torch replay of the 2-bit prmt path's integer arithmetic
(the interpreter cannot run inline PTX); CUDA: also the prmt path and the Mixtral layer at full size."""

import os

import torch

if not torch.cuda.is_available():  # the CPU runs the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.calibrate import hls  # noqa: E402
from moec.formats import bitpack  # noqa: E402
from moec.kernels.dequant import prmt_decode_emulate, prmt_pairs, use_prmt, use_words  # noqa: E402
from moec.kernels.moe_decode import least_padding_block, moe_decode, moe_decode_ref  # noqa: E402
from moec.runtime.experts import ExpertWeights, QuantMatrix  # noqa: E402
from tests.kernels.moe_cases import moe_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (kind, N tokens, top-k A, experts E, D, I, groups of w1/w3, groups of w2). With N·A < E most experts
# get zero tokens. D, I multiples of 32 take the word path (table modes), others the byte path.
CASES = [
    ("lut2", 1, 1, 4, 32, 32, 1, 1),  # word path, one table per row
    ("lut2p", 1, 2, 3, 64, 32, 2, 1),  # word path through the tables' cubics, grouped tables
    ("lut2", 3, 2, 5, 40, 24, 1, 1),  # byte path, odd sizes (rows not a multiple of the block)
    ("lut2", 1, 8, 9, 8, 12, 1, 1),  # top-8
    ("lut3", 1, 1, 3, 32, 32, 1, 1),  # 3-bit words (codes straddle words)
    ("lut3", 1, 1, 3, 48, 24, 3, 1),  # 3-bit bytes, grouped tables (group 16)
    ("rtn2", 3, 1, 4, 40, 24, 1, 1),  # affine levels
    ("rtn4", 1, 2, 4, 64, 32, 2, 1),
    ("int8", 1, 2, 3, 48, 16, 3, 1),  # 8-bit affine (intsym), one code a byte, grouped
    ("fp8", 5, 2, 6, 40, 24, 1, 1),
    ("bf16", 3, 2, 4, 40, 24, 1, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_moe_decode_matches_reference(case):
    kind, *shape = case
    x, ids, wts, w1, w3, w2 = moe_case(kind, *shape, DEVICE, seed=len(CASES) + sum(shape))
    # big blocks: fewer programs for the interpreter (the CUDA test below runs the defaults)
    got = moe_decode(x, ids, wts, w1, w3, w2, block_o=32, block_k=64, block_o_down=64, block_k_down=32, prmt=False)
    want = moe_decode_ref(x, ids, wts, w1, w3, w2)
    assert got.shape == want.shape and torch.isfinite(got).all()
    # fp32 everywhere; only the summation order differs, so a few ulps of the output scale
    tol = 1e-4 * want.abs().max().item() + 1e-6
    err = (got - want).abs().max().item()
    assert err <= tol, f"max abs err {err:.3e} > {tol:.3e} for {case}"


@pytest.mark.parametrize("kind", ["lut2", "bf16"])
def test_low_precision_x_equals_its_fp32_copy(kind):
    """x in bf16 (the engine's activations) is read in place and converted on load: the same output as
    passing its exact fp32 copy (no extra conversion kernel, no change in the arithmetic)."""
    x, ids, wts, w1, w3, w2 = moe_case(kind, 3, 2, 4, 32, 32, 1, 1, DEVICE, seed=11)
    xb = x.to(torch.bfloat16)
    kw = dict(block_o=32, block_k=32, block_o_down=32, block_k_down=32, prmt=False)
    a = moe_decode(xb, ids, wts, w1, w3, w2, **kw)
    b = moe_decode(xb.float(), ids, wts, w1, w3, w2, **kw)
    assert torch.equal(a, b), (a - b).abs().max()


def test_split_and_paths_agree():
    """Split-I atomics and the byte path give what the word path gives (same data; prmt off, so both
    take fp32 levels: the CUDA default would use fp16 prmt tables on the word path)."""
    x, ids, wts, w1, w3, w2 = moe_case("lut2", 1, 1, 2, 32, 64, 1, 1, DEVICE, seed=3)
    assert use_words(w1) and use_words(w2)
    kw = dict(block_o=64, block_k=32, block_o_down=32, block_k_down=32)
    a = moe_decode(x, ids, wts, w1, w3, w2, split=1, prmt=False, **kw)
    b = moe_decode(x, ids, wts, w1, w3, w2, split=2, words=False, **kw)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()


@pytest.mark.parametrize("split_experts,split", [(2, 1), (3, 2), (6, 1)])
def test_down_slots_split_over_programs(split_experts, split):
    """The down GEMV's slots of a token in split_experts programs (fp32 atomics, beside split-I's): the
    reference's output, biases included (each slot's weighted down bias added once whatever the split); a count
    that does not divide the slots is refused."""
    x, ids, wts, w1, w3, w2 = moe_case("lut2", 2, 6, 8, 32, 64, 1, 1, DEVICE, seed=21)
    gen = torch.Generator().manual_seed(22)
    biases = tuple(torch.randn(8, n, generator=gen).to(DEVICE) for n in (64, 64, 32))
    kw = dict(block_o=64, block_k=32, block_o_down=32, block_k_down=32, prmt=False, biases=biases)
    got = moe_decode(x, ids, wts, w1, w3, w2, split=split, split_experts=split_experts, **kw)
    want = moe_decode_ref(x, ids, wts, w1, w3, w2, biases=biases)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    with pytest.raises(AssertionError):
        moe_decode(x, ids, wts, w1, w3, w2, split_experts=4, **kw)  # not a divisor of top-6


@pytest.mark.parametrize("n,cap,want", [(1408, 2048, 512), (2880, 2048, 1024), (768, 2048, 1024),
                                         (2048, 2048, 2048), (14336, 2048, 2048), (1408, 1024, 512), (100, 2048, 512)])
def test_least_padding_block(n, cap, want):
    """The prmt down tile: the power of two in [512, cap] padding the expert inputs least, the largest on a tie
    (GLM-4.5-Air's and DeepSeek-V2-Lite's 1408 -> 512; gpt-oss's 2880 -> 1024; Mixtral's 14336 keeps 2048)."""
    bk = least_padding_block(n, cap)
    assert bk == want
    pad = lambda b: -(-n // b) * b  # noqa: E731
    assert all(pad(bk) < pad(b) or (pad(bk) == pad(b) and bk >= b) for b in (512, 1024, 2048) if b <= cap)


@pytest.mark.parametrize("N,block_o", [(1, 64), (3, 16)])
def test_split_output_zeroed_by_gate_up(monkeypatch, N, block_o):
    """Split-I atomics accumulate into a buffer the gate/up launch zeroes (no memset launch): with every fresh
    torch.empty poisoned by NaNs the split output is finite and equals the unsplit one (3 tokens x 2 slots with
    16-row blocks: 24 programs zero 3 x 32 values, ZB 4 each). out_dtype None keeps the split accumulator in fp32
    and the unsplit output in x's dtype."""
    x, ids, wts, w1, w3, w2 = moe_case("lut2", N, 2, 3, 32, 64, 1, 1, DEVICE, seed=5)
    kw = dict(block_o=block_o, block_k=32, block_o_down=32, block_k_down=32, prmt=False)
    want = moe_decode(x, ids, wts, w1, w3, w2, split=1, **kw)
    empty = torch.empty

    def poisoned(*a, **k):
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    got = moe_decode(x.to(torch.bfloat16), ids, wts, w1, w3, w2, split=2, out_dtype=None, **kw)
    one = moe_decode(x.to(torch.bfloat16), ids, wts, w1, w3, w2, split=1, split_experts=1, out_dtype=None, **kw)
    monkeypatch.undo()
    assert got.dtype == torch.float32 and one.dtype == torch.bfloat16
    assert torch.isfinite(got).all(), "the split output was not zeroed"
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()  # bf16 x against fp32 x


def test_runtime_takes_fused_path_on_cuda_only():
    g = torch.Generator().manual_seed(0)
    E, D, I = 4, 64, 32
    qs = [QuantMatrix("hls", 2, (E, o, i), hls.quantize(torch.randn(E, o, i, generator=g), None, "hls", 2, 0, False))
          for o, i in ((I, D), (I, D), (D, I))]
    ew = ExpertWeights(*qs).to(DEVICE)
    x = torch.randn(2, D, generator=g).to(DEVICE)
    ids = torch.tensor([[0, 3], [1, 3]], device=DEVICE)
    wts = torch.full((2, 2), 0.5, device=DEVICE)
    out = ew.fused(x, wts, ids)
    if DEVICE == "cpu":
        assert out is None  # the CPU keeps the torch reference path
        return
    want = torch.zeros_like(x)
    for n in range(2):
        for a in range(2):
            want[n] += 0.5 * ew.expert(int(ids[n, a]), x[n:n + 1])[0]
    assert (out - want).abs().max() <= 2e-3 * want.abs().max()  # fp16 tables vs fp32 reference


def _random_tables(gen, shape):
    """fp16 tables [..., 4] with every kind of bit pattern (prmt moves bytes: signs, subnormals, inf, nan)."""
    lut = (torch.randn(*shape, 4, generator=gen) * 0.05).half()
    special = torch.tensor([0.0, -0.0, 6e-8, -6e-8, 65504.0, float("inf"), float("-inf"), float("nan")]).half()
    pick = torch.randint(0, 8, lut.shape, generator=gen)
    return torch.where(torch.rand(lut.shape, generator=gen) < 0.2, special[pick], lut)


@pytest.mark.parametrize("O,n,G", [(7, 32, 1), (5, 96, 3), (3, 4096, 2)])
def test_prmt_selectors_bit_exact(O, n, G):
    """The prmt path's selector arithmetic (torch replay of the PTX) picks exactly the table entry of each
    code, in the pair order `prmt_pairs` gives the activations."""
    gen = torch.Generator().manual_seed(O * n + G)
    idx = torch.randint(0, 4, (O, n), generator=gen)
    lut = _random_tables(gen, (O, G))  # [O, G, 4]
    words = bitpack.pack(idx, 2).view(torch.int32).view(O, G, n // G // 16)  # [O, G, NW/G]
    got = prmt_decode_emulate(words, lut)  # [O, G, 8, NW/G, 2]
    ref = lut.gather(-1, idx.view(O, G, n // G))  # [O, G, n/G]
    want = prmt_pairs(ref).view(torch.float16).reshape(got.shape)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_prmt_pair_order_matches_gemv():
    """Decoded prmt weights against prmt_pairs(x) sum to W @ x: the two permutations agree."""
    gen = torch.Generator().manual_seed(5)
    O, n = 6, 160
    idx = torch.randint(0, 4, (O, n), generator=gen)
    lut = (torch.randn(O, 4, generator=gen) * 0.1).half()
    x = torch.randn(n, generator=gen).half().float()
    wq = prmt_decode_emulate(bitpack.pack(idx, 2).view(torch.int32), lut).float()  # [O, 8, NW, 2]
    xp = prmt_pairs(x).view(torch.float16).reshape(8, n // 16, 2).float()
    want = lut.float().gather(-1, idx) @ x
    assert torch.allclose((wq * xp).sum((1, 2, 3)), want, rtol=1e-5, atol=1e-5)


# prmt path tolerance: x and h are rounded to fp16 (2^-11 relative) and each fp16x2 lane accumulates 8
# products in fp16 before the fp32 sum; over the gate/up -> silu -> down chain this stays near 1e-3 of the
# output scale (measured on the H200: benchmarks/results/moe_kernel_h200.json, max_rel_err_vs_ref); the
# bf16 tensor-core paths sit at ~5e-3 on the same scale.
PRMT_TOL = 5e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX needs CUDA")
@pytest.mark.parametrize("case", [("lut2", 1, 1, 4, 32, 32, 1, 1), ("lut2p", 1, 2, 3, 64, 32, 2, 1),
                                  ("lut2", 2, 2, 5, 96, 160, 3, 5), ("lut2", 1, 8, 9, 64, 4096, 1, 2)],
                         ids=lambda c: "-".join(map(str, c)))
def test_prmt_matches_reference_cuda(case):
    kind, *shape = case
    x, ids, wts, w1, w3, w2 = moe_case(kind, *shape, "cuda", seed=sum(shape))
    assert use_prmt(w1) and use_prmt(w2)
    want = moe_decode_ref(x, ids, wts, w1, w3, w2)
    for kw in ({}, dict(block_o=32, block_k=64, block_o_down=64, block_k_down=32), dict(split=3)):
        got = moe_decode(x, ids, wts, w1, w3, w2, prmt=True, **kw)
        err = (got - want).abs().max().item()
        assert err <= PRMT_TOL * want.abs().max().item(), (err, kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="full-size check needs CUDA")
@pytest.mark.parametrize("kind,prmt", [("lut2", None), ("lut2", False), ("lut2p", False), ("lut3", None),
                                       ("fp8", None)])
def test_full_size_mixtral_layer_cuda(kind, prmt):
    x, ids, wts, w1, w3, w2 = moe_case(kind, 1, 2, 8, 4096, 14336, 1, 1, "cuda", seed=1)
    got = moe_decode(x, ids, wts, w1, w3, w2, prmt=prmt)
    want = moe_decode_ref(x, ids, wts, w1, w3, w2)
    tol = PRMT_TOL if prmt is None and kind == "lut2" else 1e-4  # the default 2-bit path is prmt (fp16 products)
    assert (got - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("kind,split,bias_dtype", [("lut2", 1, torch.float32), ("bf16", 2, torch.float32),
                                                   ("mxfp4", 1, torch.float32), ("lut2", 2, torch.bfloat16)])
def test_biased_experts_clamped_swiglu(kind, split, bias_dtype):
    """gpt-oss's experts: biases on gate, up and down (down's times the routing weight, once per token even
    when I is split across programs) and the clamped SwiGLU, against the reference; the clamp bites (large
    inputs) and the result differs from silu without biases. bf16 biases (as a bf16 model stores them) go to the
    kernels as they are, converted in the loads."""
    x, ids, wts, w1, w3, w2 = moe_case(kind, 2, 2, 4, 64, 64, 1, 1, DEVICE, seed=21)
    gen = torch.Generator().manual_seed(5)
    E, I, D = 4, 64, 64
    biases = tuple((torch.randn(*s, generator=gen) * 0.5).to(DEVICE, bias_dtype) for s in ((E, I), (E, I), (E, D)))
    x = x * 20  # gate/up past the limit 1.5 on many rows
    kw = dict(block_o=32, block_k=64, block_o_down=64, block_k_down=32, prmt=False, split=split)
    got = moe_decode(x, ids, wts, w1, w3, w2, biases=biases, act="clamped_swiglu", limit=1.5, **kw)
    want = moe_decode_ref(x, ids, wts, w1, w3, w2, biases=biases, act="clamped_swiglu", limit=1.5)
    tol = 1e-4 * want.abs().max().item() + 1e-6
    assert (got - want).abs().max().item() <= tol
    plain = moe_decode_ref(x, ids, wts, w1, w3, w2)
    assert (plain - want).abs().max().item() > 100 * tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prmt_pairs_kernel_equals_torch(dtype):
    """The one-launch prmt_pairs (CUDA's path) gives exactly the torch permutation, any input dtype, a leading
    batch dim, words past one block."""
    from moec.kernels.dequant import _prmt_pairs_launch, prmt_pairs_ref

    v = (torch.randn(3, 2 * 16 * 130, generator=torch.Generator().manual_seed(2)) * 3).to(dtype).to(DEVICE)
    got = _prmt_pairs_launch(v)
    assert got.shape == (3, 8, 260) and got.dtype == torch.int32
    assert torch.equal(got, prmt_pairs_ref(v))



@pytest.mark.parametrize("pad", ["0", "1"])
def test_dense_down_tile_least_padding(pad, monkeypatch):
    """bf16 experts with the dense config's least_padding (MOEC_DENSE_LEAST_PADDING=1): the down GEMV's 1024-input tile
    taken as a ceiling (1056 inputs: three tiles of 512, not two of 1024), the reference's output either way."""
    import moec.kernels.moe_decode as md

    x, ids, wts, w1, w3, w2 = moe_case("bf16", 1, 1, 2, 16, 1056, 1, 1, DEVICE, seed=5)
    monkeypatch.setenv("MOEC_DENSE_LEAST_PADDING", pad)
    tiles = []
    monkeypatch.setattr(md, "least_padding_block",
                        lambda n, cap: tiles.append(least_padding_block(n, cap)) or tiles[-1])
    got = moe_decode(x, ids, wts, w1, w3, w2, block_o=64, block_o_down=16, prmt=False)
    want = moe_decode_ref(x, ids, wts, w1, w3, w2)
    assert tiles == ([512] if pad == "1" else [])
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
