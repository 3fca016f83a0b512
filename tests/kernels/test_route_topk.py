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
