"""rotate_write_window against its torch reference: the rotated q, and the window slots it writes."""

import pytest
import torch

from moec.kernels.kv_window_write import rotate_write_window, rotate_write_window_ref
from moec.rotation import block_hadamard

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("B,H,K,d,rotate,dtype", [
    (1, 4, 2, 64, True, torch.bfloat16), (3, 6, 3, 128, True, torch.bfloat16), (2, 8, 8, 64, False, torch.bfloat16),
    (3, 6, 3, 128, True, torch.float32), (1, 4, 2, 64, False, torch.float32)])
def test_rotate_write_window_matches_reference(B, H, K, d, rotate, dtype):
    g = torch.Generator().manual_seed(B * 100 + d)
    qkv = torch.randn(B, H + 2 * K, d, generator=g).to(dtype).to(DEV)  # strided q, k, v views, as the engine's
    q, k, v = qkv[:, :H], qkv[:, H : H + K], qkv[:, H + K :]
    R = block_hadamard(d, seed=1).float().to(DEV) if rotate else None
    W = 9
    wins = [torch.randn(B + 1, K, W, d, generator=g).half().to(DEV) for _ in range(2)]
    wins += [w.clone() for w in wins]  # the reference's copies
    slot = torch.tensor([(3 * b + 1) % W for b in range(B)], device=DEV)
    got = rotate_write_window(q, k, v, R, wins[0], wins[1], slot)
    want = rotate_write_window_ref(q, k, v, R, wins[2], wins[3], slot)
    assert got.dtype == dtype and got.shape == (B, H, d)
    # fp32 products on both sides; one rounding to q's dtype / fp16
    torch.testing.assert_close(got, want, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    torch.testing.assert_close(wins[0], wins[2], atol=2e-3, rtol=2e-3)  # untouched slots equal exactly
    torch.testing.assert_close(wins[1], wins[3], atol=2e-3, rtol=2e-3)
    untouched = torch.ones(B + 1, W, dtype=torch.bool)
    untouched[torch.arange(B), slot.cpu()] = False
    assert torch.equal(wins[0].cpu().transpose(1, 2)[untouched], wins[2].cpu().transpose(1, 2)[untouched])
