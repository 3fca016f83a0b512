"""LUT attention over residual-VQ codes (moec/kernels/rvq_lut_attention.py) vs its torch reference.

On the CPU under TRITON_INTERPRET=1 (small shapes), on CUDA at full size. The kernel sums fp32 table
entries in another order than the reference's dequantize-then-dot, so outputs agree to ~1e-5."""

import os

import pytest
import torch

from moec.formats.bitpack import pack_bits
from moec.kernels.rvq_lut_attention import CodeSegment, rvq_lut_attention, rvq_lut_attention_ref
from moec.runtime.rvq import RVQTier

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEV = "cuda" if CUDA else "cpu"
TOL = 2e-4 if CUDA else 1e-5


def _segment(B, K, S, d, dim, sizes, lengths, starts, shared, gen):
    Gc = 1 if shared else K
    cbk = [torch.randn(Gc, d // dim, c, dim, generator=gen).half() for c in sizes]
    cbv = [torch.randn(Gc, d // dim, c, dim, generator=gen).half() for c in sizes]
    tier = RVQTier(cbk)
    codes = [torch.stack([torch.randint(0, c, (B, K, S, d // dim), generator=gen) for _ in range(1)])[0]
             for c in sizes]
    ck = pack_bits(torch.cat(codes, -1), tier.widths)
    codes = [torch.randint(0, c, (B, K, S, d // dim), generator=gen) for c in sizes]
    cv = pack_bits(torch.cat(codes, -1), tier.widths)
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    return CodeSegment(ck.to(DEV), cv.to(DEV), as_t(starts), as_t(lengths), [c.to(DEV) for c in cbk],
                       [c.to(DEV) for c in cbv])


# (B, H, K, d, dim, sizes, segment lengths per row, window lengths per row, shared codebooks)
CASES = [
    (1, 4, 2, 16, 4, [64, 32], [37], [5], False),  # odd length, 2 stages of different widths
    (2, 3, 1, 32, 4, [128], [50, 13], [9, 3], True),  # G = 3, rows of different lengths, 7-bit codes
    (2, 4, 4, 16, 8, [16, 16], [0, 41], [1, 16], False),  # an empty segment in one row, 1 bit/element
    (1, 2, 2, 16, 4, [256, 512], [3], [40], False),  # context shorter than the window, 8/9-bit codes
]
if CUDA:
    CASES += [(4, 32, 8, 128, 4, [64, 32], [4096, 3001, 17, 0], [131, 160, 3, 1], False),
              (1, 32, 8, 128, 4, [128], [32768], [150], True)]


@pytest.mark.parametrize("case", CASES, ids=[str(c[:5]) for c in CASES])
def test_kernel_matches_reference(case):
    B, H, K, d, dim, sizes, lengths, wins, shared = case
    gen = torch.Generator().manual_seed(sum(lengths) + d)
    S = max(lengths) + 7  # the segment starts at an offset inside a larger buffer
    starts = [S - n - (i % 3) if n < S - 2 else 0 for i, n in enumerate(lengths)]
    seg = _segment(B, K, S, d, dim, sizes, lengths, starts, shared, gen)
    Wc = max(wins) + 2
    wk = torch.randn(B, K, Wc, d, generator=gen).half().to(DEV)
    wv = torch.randn(B, K, Wc, d, generator=gen).half().to(DEV)
    wl = torch.tensor(wins, dtype=torch.int32, device=DEV)
    q = (torch.randn(B, H, d, generator=gen) * 2).to(DEV)
    ref = rvq_lut_attention_ref(q, [seg], wk, wv, wl)
    out = rvq_lut_attention(q, [seg], wk, wv, wl, n_splits=3)
    err = (out - ref).abs().max().item()
    assert err < TOL * max(1.0, ref.abs().max().item()), err


def test_two_segments_and_splits_agree():
    """Archive + middle segments together, and the result independent of the split count."""
    gen = torch.Generator().manual_seed(7)
    B, H, K, d = 2, 4, 2, 16
    a = _segment(B, K, 40, d, 4, [128], [23, 40], [0, 0], True, gen)
    m = _segment(B, K, 60, d, 4, [64, 32], [19, 11], [23, 40], False, gen)
    wk, wv = (torch.randn(B, K, 10, d, generator=gen).half().to(DEV) for _ in range(2))
    wl = torch.tensor([10, 6], dtype=torch.int32, device=DEV)
    q = torch.randn(B, H, d, generator=gen).to(DEV)
    ref = rvq_lut_attention_ref(q, [a, m], wk, wv, wl)
    for splits in (1, 2):
        out = rvq_lut_attention(q, [a, m], wk, wv, wl, n_splits=splits, block_n=16)
        assert (out - ref).abs().max().item() < TOL, splits


def test_cache_decode_step_through_kernel():
    """RVQTieredCache with the kernel (archive + middle + window, GQA) equals the torch path of the same cache."""
    from moec.runtime.config import ModelArgs
    from moec.runtime.rvq import RVQLayerCodec, RVQTieredCache

    gen = torch.Generator().manual_seed(3)
    K, d = 2, 16
    tier = lambda sizes: RVQTier([torch.randn(K, d // 4, c, 4, generator=gen) for c in sizes])  # noqa: E731
    codec = RVQLayerCodec({"k": tier([32, 16]), "v": tier([32, 16])}, {"k": tier([64]), "v": tier([64])})
    args = ModelArgs(arch="llama", vocab_size=10, dim=32, n_layers=1, n_heads=6, n_kv_heads=K, head_dim=d,
                     max_seq_len=128)
    caches = [RVQTieredCache(args, 2, 128, [codec], window=8, sinks=2, block=8, archive_after=24, device=DEV,
                             use_kernel=kern) for kern in (False, True)]
    k, v = (torch.randn(2, K, 60, d, generator=gen).to(DEV) for _ in range(2))
    q = torch.randn(2, 6, 60, d, generator=gen).to(DEV)
    outs = []
    for c in caches:
        c.attend(0, q[:, :, :59], k[:, :, :59], v[:, :, :59], 0)  # prefill: blocks leave the window, some age out
        outs.append(c.attend(0, q[:, :, 59:], k[:, :, 59:], v[:, :, 59:], 59))
    assert caches[1].n_arch[0] == 4 and caches[1].n_blocks[0] == 6, (caches[1].n_arch, caches[1].n_blocks)
    assert (outs[0] - outs[1]).abs().max().item() < TOL
