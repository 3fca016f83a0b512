"""The fp16-cache decode attention kernel against its torch reference (interpreter on the CPU)."""

import pytest
import torch

from moec.kernels.fp16_decode_attention import fp16_decode_attention, fp16_decode_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 dots on the CPU (interpreter); fp16 tensor-core dot inputs on the GPU
TOL = dict(atol=2e-5, rtol=1e-4) if DEVICE == "cpu" else dict(atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("B,H,K,d,S,pos,n_splits", [
    (2, 8, 2, 32, 96, [40, 7], 3),      # G = 4, splits with no tokens for the short row
    (1, 6, 6, 16, 64, [63], 4),         # G = 1, the new token in the last slot
    (3, 4, 1, 16, 48, [0, 17, 32], 2),  # an empty history (pos 0)
])
def test_fp16_decode_attention_matches_reference(B, H, K, d, S, pos, n_splits):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, d, generator=g).to(DEVICE)
    kc = torch.randn(B + 1, K, S, d, generator=g).half().to(DEVICE)  # one spare row: Bc > B
    vc = torch.randn(B + 1, K, S, d, generator=g).half().to(DEVICE)
    kn, vn = torch.randn(B, K, d, generator=g).to(DEVICE), torch.randn(B, K, d, generator=g).to(DEVICE)
    p = torch.tensor(pos, dtype=torch.int64, device=DEVICE)
    kr, vr = kc.clone(), vc.clone()
    ref = fp16_decode_attention_ref(q, kr, vr, kn, vn, p)
    out = fp16_decode_attention(q, kc, vc, kn, vn, p, n_splits=n_splits, out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)  # the new token written at pos, nothing else


def test_fp16_decode_attention_strided_query_bf16_out():
    """q as a view of a fused projection (row stride != H·d) and a bf16 output."""
    g = torch.Generator().manual_seed(1)
    B, H, K, d, S = 2, 4, 2, 16, 32
    qkv = torch.randn(B, (H + 2 * K) * d, generator=g).to(DEVICE)
    q = qkv[:, : H * d].view(B, H, d)
    kn = qkv[:, H * d: (H + K) * d].view(B, K, d)
    vn = qkv[:, (H + K) * d:].view(B, K, d)
    kc = torch.randn(B, K, S, d, generator=g).half().to(DEVICE)
    vc = torch.randn(B, K, S, d, generator=g).half().to(DEVICE)
    p = torch.tensor([5, 31], device=DEVICE)
    ref = fp16_decode_attention_ref(q, kc.clone(), vc.clone(), kn, vn, p)
    out = fp16_decode_attention(q, kc, vc, kn, vn, p, n_splits=2, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("pos,ring,sinks", [
    ([3, 9], 8, False),    # one row before its ring fills, one past it (slot pos % 8 replaces the oldest)
    ([40, 8], 8, True),    # wrapped rows with gpt-oss's sinks
    ([5, 20], 0, True),    # a full-attention layer with sinks
])
def test_fp16_decode_attention_ring_and_sinks(pos, ring, sinks):
    """A sliding-window layer's ring (slot = pos % ring, every held slot attended once full) and per-head sink
    logits in the denominator, against the reference; the new token lands in its ring slot only."""
    g = torch.Generator().manual_seed(2)
    B, H, K, d = 2, 4, 2, 16
    S = ring or 48
    q = torch.randn(B, H, d, generator=g).to(DEVICE)
    kc = torch.randn(B, K, S, d, generator=g).half().to(DEVICE)
    vc = torch.randn(B, K, S, d, generator=g).half().to(DEVICE)
    kn, vn = torch.randn(B, K, d, generator=g).to(DEVICE), torch.randn(B, K, d, generator=g).to(DEVICE)
    sk = (torch.randn(H, generator=g) * 2).to(DEVICE) if sinks else None
    p = torch.tensor(pos, dtype=torch.int64, device=DEVICE)
    kr, vr = kc.clone(), vc.clone()
    ref = fp16_decode_attention_ref(q, kr, vr, kn, vn, p, ring=ring, sinks=sk)
    out = fp16_decode_attention(q, kc, vc, kn, vn, p, n_splits=3, out_dtype=torch.float32, ring=ring, sinks=sk)
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    if sinks:  # the sinks took weight: the output is smaller than without them
        plain = fp16_decode_attention_ref(q, kc.clone(), vc.clone(), kn, vn, p, ring=ring)
        assert out.norm() < plain.norm()
