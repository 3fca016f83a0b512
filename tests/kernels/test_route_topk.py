"""route_topk against the torch routing (softmax fp32, topk, optional renormalization)."""

import pytest
import torch

from moec.kernels.route_topk import route_topk, route_topk_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (tokens, experts, top_k, renormalize): Mixtral, Qwen3-MoE, Qwen2-MoE-like, DeepSeek-like (top-6, not a
# power of two), a decode batch, a single expert
CASES = [(1, 8, 2, False), (1, 128, 8, True), (5, 60, 4, False), (3, 64, 6, True), (16, 8, 2, True), (2, 5, 1, False)]


@pytest.mark.parametrize("N,E,A,norm", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_matches_torch(N, E, A, norm, dtype):
    g = torch.Generator().manual_seed(N * 1000 + E)
    logits = (torch.randn(N, E, generator=g) * 3).to(dtype).to(DEV)
    w, ids = route_topk(logits, A, norm)
    w_ref, ids_ref = route_topk_ref(logits, A, norm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (N, A)
    # bf16 logits can tie exactly: compare the chosen probabilities, and the ids where the reference's are unique
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    probs = torch.softmax(logits.float(), -1)
    torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, ids_ref.long()), atol=1e-7, rtol=0)
    if dtype == torch.float32:
        assert torch.equal(ids, ids_ref), (ids, ids_ref)


def test_route_topk_strided_rows_and_ties():
    logits = torch.zeros(3, 16, device=DEV)[:, :8]  # strided rows; all experts equal
    w, ids = route_topk(logits, 4, norm=False)
    assert torch.equal(ids.cpu(), torch.arange(4, dtype=torch.int32).expand(3, 4))  # ties: lowest index first
    torch.testing.assert_close(w.cpu(), torch.full((3, 4), 1 / 8))


@pytest.mark.parametrize("N,E,A,norm", [c for c in CASES if c[0] <= 4] + [(4, 128, 8, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_gemv_topk_matches_torch_route(N, E, A, norm, dtype):
    """The router GEMV fused in (split over programs, the last one routes) against model.route; called
    twice, so the second launch shows the ticket counter was put back to 0."""
    from moec.kernels.route_topk import route_gemv_topk
    from moec.runtime.model import route

    D = 80 if E != 128 else 256  # not a multiple of the GEMV's D tile
    g = torch.Generator().manual_seed(N * 7 + E)
    x = torch.randn(N, D, generator=g).to(dtype).to(DEV)
    router = (torch.randn(E, D, generator=g) / D**0.5 * 3).to(dtype).to(DEV)
    _, w_ref, ids_ref = route(x, router, A, norm)
    for _ in range(2):
        w, ids = route_gemv_topk(x, router, A, norm)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (N, A)
        # fp32 summation order differs from the GEMM's: bf16-rounded logits may move by one ulp
        tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(w, w_ref, **tol)
        if dtype == torch.float32:
            assert torch.equal(ids, ids_ref.to(torch.int32)), (ids, ids_ref)
        else:  # where the reference's choice is clear (a margin of 1% in probability), the same experts
            probs = torch.softmax((x @ router.t()).float(), -1)
            top = probs.topk(min(A + 1, E), -1).values
            clear = (top[:, A - 1] - (top[:, A] if A < E else 0)) > 1e-2
            assert torch.equal(ids[clear].sort(-1).values, ids_ref.to(torch.int32)[clear].sort(-1).values)


# (tokens, experts, groups, groups kept, top_k, bias, renormalize, scale): DeepSeek-V3, GLM-4.5-Air, the
# smoke-mla shape, no correction bias, a decode batch of 16 without renormalization
SIGMOID_CASES = [(1, 256, 8, 4, 8, True, True, 2.5), (1, 128, 1, 1, 8, True, True, 1.0),
                 (3, 8, 4, 2, 2, True, True, 1.0), (2, 64, 4, 2, 6, False, True, 1.0),
                 (16, 32, 4, 3, 4, True, False, 1.5),
                 # groups of 20 (padded to 32): the padding lanes of group 0 hold the ids of group 1's experts
                 (2, 40, 2, 2, 3, True, True, 2.5), (2, 60, 3, 1, 4, True, True, 1.0)]


@pytest.mark.parametrize("N,E,G,KG,A,bias,norm,scale", SIGMOID_CASES)
def test_route_sigmoid_topk_matches_torch_route(N, E, G, KG, A, bias, norm, scale):
    """DeepSeek-V3 / GLM-4.5 routing (model.route: sigmoid scores, the correction bias for the choice only, group
    top-2) in one program per token: the same experts in the same order, their weights to fp32 rounding."""
    from types import SimpleNamespace

    from moec.kernels.route_topk import route_sigmoid_topk
    from moec.runtime.model import route

    g = torch.Generator().manual_seed(N * 1000 + E + G)
    x, router = torch.randn(N, 64, generator=g), torch.randn(E, 64, generator=g) / 4
    sb = torch.randn(E, generator=g) * 0.3 if bias else None
    args = SimpleNamespace(router_score="sigmoid", topk_method="greedy" if G == 1 else "group_top2", n_group=G,
                           topk_group=KG, routed_scale=scale)
    logits, w_ref, ids_ref = route(x, router, A, norm, args, sb)
    w, ids = route_sigmoid_topk(logits.to(DEV), None if sb is None else sb.to(DEV), A, norm, G, KG, scale)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (N, A)
    assert torch.equal(ids.cpu().long(), ids_ref), (ids, ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, atol=1e-6, rtol=1e-5)
    if G > 1:  # every chosen expert is in one of the KG kept groups
        assert all(len(set((ids_ref[n] // (E // G)).tolist())) <= KG for n in range(N))


def test_route_sigmoid_compiles_for_sm90():
    """The engine falls back to torch's route when the kernel fails to compile (a warning, not an error), so CI
    compiles it for sm_90 at DeepSeek-V3's and GLM-4.5-Air's configurations (aot.report_in_subprocess)."""
    from moec.kernels import aot

    types = {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i32", "stride_n": "i32",
             "scale": "fp32"}
    jobs = [{"module": "moec.kernels.route_topk", "kernel": "_route_sigmoid_kernel", "types": types, "num_warps": nw,
             "constexprs": {"G": G, "G_P2": G, "EG": E // G, "EG_P2": E // G, "KG": KG, "A": 8, "A_P2": 8,
                            "HAS_BIAS": True, "NORM": True}} for E, G, KG, nw in ((256, 8, 4, 4), (128, 1, 1, 1))]
    for rep in aot.report_in_subprocess(jobs):
        assert rep["resources"]["stack"] == 0, rep["resources"]
