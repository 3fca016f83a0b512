"""kernels/mla_decode_attention.py against its torch reference (the interpreter on the CPU, fp32 dots): rows of
different lengths (one at slot 0, one past several splits), more heads than one head block, a latent width
that is not a power of two, and the new row written into the cache."""

import math

import pytest
import torch

from moec.kernels.mla_decode_attention import mla_decode_attention, mla_decode_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 dots on the CPU (interpreter); fp16 tensor-core dot inputs on the GPU
TOL = dict(atol=2e-5, rtol=1e-4) if DEVICE == "cpu" else dict(atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("H,r,rp,block_h", [(6, 32, 16, None), (20, 48, 8, 16)])
def test_matches_reference(H, r, rp, block_h):
    g = torch.Generator().manual_seed(H)
    B, S, L = 3, 80, r + rp
    q = torch.randn(B, H, L, generator=g).to(DEVICE)
    rows = torch.randn(B + 1, S, L, generator=g).half().to(DEVICE)  # one spare batch row (the cache's capacity)
    new = torch.randn(B, L, generator=g).to(DEVICE)
    pos = torch.tensor([0, 37, 79], device=DEVICE)
    ref_rows = rows.clone()
    scale = 1 / math.sqrt(L)
    want = mla_decode_attention_ref(q, ref_rows, new, pos, r, scale)
    got = mla_decode_attention(q, rows, new, pos, r, scale, n_splits=3, block_h=block_h)
    assert got.shape == (B, H, r)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(rows, ref_rows)  # the new rows written at pos, nothing else touched


def test_half_partials_match_reference():
    """half_partials: each split's acc / l in fp16 (m, l in fp32), combined with l·2^(m - M) weights; a row whose
    only token is slot 0 leaves two of its three splits empty (l = 0: stored as 0, not 0/0)."""
    g = torch.Generator().manual_seed(7)
    B, H, r, rp, S = 3, 6, 32, 16, 80
    q = torch.randn(B, H, r + rp, generator=g).to(DEVICE)
    rows = torch.randn(B, S, r + rp, generator=g).half().to(DEVICE)
    new = torch.randn(B, r + rp, generator=g).to(DEVICE)
    pos = torch.tensor([0, 37, 79], device=DEVICE)
    scale = 1 / math.sqrt(r + rp)
    want = mla_decode_attention_ref(q, rows.clone(), new, pos, r, scale)
    full = mla_decode_attention(q, rows.clone(), new, pos, r, scale, n_splits=3, half_partials=False)
    got = mla_decode_attention(q, rows, new, pos, r, scale, n_splits=3, half_partials=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)  # fp16's 2^-11 on each split's output
    assert (got - want).abs().max() > (full - want).abs().max()  # the fp16 rounding is there: the path ran
