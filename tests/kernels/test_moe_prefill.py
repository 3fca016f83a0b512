"""Grouped MoE dequant-GEMM (tokens sorted by expert, block-aligned) vs the torch reference, and the
alignment it runs on. CPU: Triton's interpreter at toy shapes (tl.dot in fp32 there: the interpreter's
bf16 dot is broken); CUDA: bf16 tensor cores, also at a real prefill size."""

import os

import torch

if not torch.cuda.is_available():  # the CPU runs the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moec.kernels.moe_prefill import align, moe_grouped, moe_grouped_ref  # noqa: E402
from tests.kernels.moe_cases import moe_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("N,A,E,BM", [(7, 2, 5, 4), (1, 1, 3, 16), (33, 8, 16, 8), (5, 2, 40, 4)])
def test_align_partitions_slots_by_expert(N, A, E, BM):
    g = torch.Generator().manual_seed(N)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(N)]).to(DEVICE)
    sid, bexp = align(ids, E, BM)
    T = N * A
    assert sid.numel() == bexp.numel() * BM
    real = sid[sid < T]
    assert sorted(real.tolist()) == list(range(T)), "every slot exactly once"
    flat = ids.reshape(-1)
    for b in range(bexp.numel()):
        blk = sid[b * BM:(b + 1) * BM]
        blk = blk[blk < T]
        if int(bexp[b]) == E:  # past the end: padding only
            assert blk.numel() == 0
        else:
            assert (flat[blk.long()] == bexp[b]).all(), "a block holds one expert's slots"
    used = bexp[bexp < E]
    assert (used[1:] >= used[:-1]).all() and set(used.tolist()) == set(flat.tolist())


# (kind, N, A, E, D, I, G1, G2): top-1/2/8, odd token counts, experts without tokens (E > N·A),
# byte-path sizes (not multiples of the tile), grouped tables.
CASES = [
    ("lut2", 5, 2, 4, 40, 24, 1, 1),
    ("lut3", 3, 1, 6, 32, 16, 2, 1),
    ("rtn4", 7, 2, 3, 32, 16, 1, 1),
    ("int8", 3, 2, 3, 32, 16, 2, 1),
    ("fp8", 9, 8, 12, 16, 16, 1, 1),
    ("bf16", 3, 2, 4, 24, 40, 1, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_grouped_matches_reference(case):
    kind, *shape = case
    x, ids, wts, w1, w3, w2 = moe_case(kind, *shape, DEVICE, seed=sum(shape))
    got = moe_grouped(x, ids, wts, w1, w3, w2, block_m=16, block_n=32, block_k=32, num_warps=4)
    want = moe_grouped_ref(x, ids, wts, w1, w3, w2)
    assert got.shape == want.shape and torch.isfinite(got).all()
    # h is stored bf16 (and the CUDA dot runs on bf16 operands): ~1e-2 of the output scale
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), f"max abs err {err:.3e} for {case}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="full-size check needs CUDA")
@pytest.mark.parametrize("kind", ["lut2", "lut3", "fp8", "bf16"])
def test_prefill_qwen3_layer_cuda(kind):
    x, ids, wts, w1, w3, w2 = moe_case(kind, 512, 8, 128, 2048, 768, 1, 1, "cuda", seed=2, dtype=torch.bfloat16)
    got = moe_grouped(x, ids, wts, w1, w3, w2)
    want = moe_grouped_ref(x, ids, wts, w1, w3, w2)
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
    small = moe_grouped(x[:16], ids[:16], wts[:16], w1, w3, w2)  # decode-size batch: the small config
    assert (small.float() - want[:16]).abs().max() <= 2e-2 * want[:16].abs().max()


def test_compile_failure_falls_back_to_small_config(monkeypatch):
    """A config Triton cannot compile (PassManager failure) is retried, and remembered, as SMALL_CONFIG."""
    from moec.kernels import moe_prefill as mp

    calls = []
    real = mp._launch

    def flaky(x, ids, weights, w1, w3, w2, cfg, *rest):
        calls.append(cfg["block_m"])
        if cfg != mp.SMALL_CONFIG:
            raise RuntimeError("PassManager::run failed")
        return real(x, ids, weights, w1, w3, w2, dict(cfg, block_n=16, block_k=32), *rest)

    monkeypatch.setattr(mp, "_launch", flaky)
    monkeypatch.setattr(mp, "_BROKEN", set())
    x, ids, wts, w1, w3, w2 = moe_case("bf16", 3, 1, 2, 16, 16, 1, 1, DEVICE, seed=5)
    want = moe_grouped_ref(x, ids, wts, w1, w3, w2)
    for _ in range(2):
        got = moe_grouped(x, ids, wts, w1, w3, w2, small=False)
        assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
    assert calls == [128, 16, 16], calls  # the broken config is tried once only


def test_grouped_biased_experts_clamped_swiglu():
    """The grouped kernel with gpt-oss's expert biases and clamped SwiGLU against its reference."""
    x, ids, wts, w1, w3, w2 = moe_case("lut2", 6, 2, 4, 64, 32, 1, 1, "cpu", seed=9)
    gen = torch.Generator().manual_seed(4)
    biases = tuple(torch.randn(*s, generator=gen) * 0.5 for s in ((4, 32), (4, 32), (4, 64)))
    kw = dict(biases=biases, act="clamped_swiglu", limit=1.0)
    got = moe_grouped(x * 10, ids, wts, w1, w3, w2, block_m=16, block_n=32, block_k=32, num_warps=4, **kw)
    want = moe_grouped_ref(x * 10, ids, wts, w1, w3, w2, **kw)
    tol = 2e-3 * want.abs().max().item()  # h is stored in bf16 between the launches
    assert (got.float() - want).abs().max().item() <= tol
    assert (moe_grouped_ref(x * 10, ids, wts, w1, w3, w2) - want).abs().max().item() > 20 * tol
