"""Fused MoE decode with 2-bit codebook experts (seed 000: dequantize in registers inside the GEMV).

Shape legend: N = tokens (few: a decode step), A = experts per token, E = experts, D = model dim,
I = expert intermediate dim, G = codebook groups per row, K = 4 entries.

    out[n] = Σ_a weights[n, a] · W2[e] (silu(W1[e] x_n) ⊙ (W3[e] x_n)),  e = ids[n, a]

with every W given as packed codes (formats/bitpack.py U2X4: four 2-bit indices per byte, index k of
a row at bits 2·(k % 4) of byte k // 4) and a codebook lut [E, O, G, 4] (fp32): W[o, k] =
lut[o, k // gs, idx[o, k]] (runtime/experts.py turns hls, rtn and fp3 storage into this form).

Two launches:
  1. gate/up: one program per (token-slot, block of I rows). It reads x_n straight from the input
     (no gathered copy of the activations), loads each code byte once and unpacks all four indices
     in registers (the seed's sketch unpacks only the first), selects from the row's four codebook
     entries with `tl.where`, and accumulates both projections in fp32; SiLU·mul on the way out.
     (Slot s of each byte meets the stride-4 slice of x it multiplies, so no reshape is needed.)
     The [N·A, I] result is the only intermediate written (vLLM's fused_moe keeps the same one).
  2. down + combine: one program per (token-slot, block of D rows, slice of I), dequantizing W2 the
     same way; the routing weight is applied in registers and slices are summed into out[n] with
     fp32 atomics, so the weighted combine needs no gather/scatter pass.
No dequantized weight ever reaches memory. `moe_decode_ref` below is the plain-torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import bitpack


@triton.jit
def _gemv_2bit_block(codes_ptr, lut_ptr, v_ptr, e, offs_o, mask_o, k0, n_in, n_groups,
                     stride_ce, stride_co, stride_le, stride_lo,
                     BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """Σ_k W[offs_o, k] · v[k] over k in [k0, k0 + BLOCK_K), W dequantized from 2-bit codes in registers.

    Each code byte is loaded once and all four of its indices are used: slot s of byte j holds input
    k = 4j + s, so slot s multiplies the stride-4 slice v[k0 + s :: 4]. BLOCK_K never straddles a
    codebook group (GROUP is a multiple of BLOCK_K, or the whole row), so each row selects among its
    four entries of one group with `tl.where`.
    """
    offs_b = k0 // 4 + tl.arange(0, BLOCK_K // 4)
    b = tl.load(codes_ptr + e * stride_ce + offs_o[:, None] * stride_co + offs_b[None, :],
                mask=mask_o[:, None] & (offs_b[None, :] * 4 < n_in), other=0).to(tl.int32)  # [BLOCK_O, BLOCK_K/4]
    g = tl.minimum(k0 // GROUP, n_groups - 1)
    lrow = lut_ptr + e * stride_le + offs_o * stride_lo + g * 4
    c0 = tl.load(lrow + 0, mask=mask_o, other=0.0)[:, None]
    c1 = tl.load(lrow + 1, mask=mask_o, other=0.0)[:, None]
    c2 = tl.load(lrow + 2, mask=mask_o, other=0.0)[:, None]
    c3 = tl.load(lrow + 3, mask=mask_o, other=0.0)[:, None]
    acc = tl.zeros((BLOCK_O,), dtype=tl.float32)
    for s in tl.static_range(4):
        idx = (b >> (2 * s)) & 3
        w = tl.where(idx == 0, c0, tl.where(idx == 1, c1, tl.where(idx == 2, c2, c3)))
        offs_v = offs_b * 4 + s
        v = tl.load(v_ptr + offs_v, mask=offs_v < n_in, other=0.0).to(tl.float32)
        acc += tl.sum(w * v[None, :], axis=1)
    return acc


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, ids_ptr, c1_ptr, l1_ptr, c3_ptr, l3_ptr, h_ptr,  # pointers
    I, A, row_bytes, n_groups,  # sizes
    stride_xn, stride_ce, stride_co, stride_le, stride_lo,  # strides (w1 and w3 share them)
    D: tl.constexpr,  # loop bound: constexpr (Triton 3.6's interpreter cannot loop to a runtime scalar)
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    pid_t = tl.program_id(0)  # token-slot n·A + a
    pid_i = tl.program_id(1)
    n = pid_t // A
    e = tl.load(ids_ptr + pid_t).to(tl.int64)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    acc_g = tl.zeros((BLOCK_I,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I,), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        acc_g += _gemv_2bit_block(c1_ptr, l1_ptr, x_ptr + n * stride_xn, e, offs_i, mask_i, k0, D, n_groups,
                                  stride_ce, stride_co, stride_le, stride_lo, BLOCK_I, BLOCK_K, GROUP)
        acc_u += _gemv_2bit_block(c3_ptr, l3_ptr, x_ptr + n * stride_xn, e, offs_i, mask_i, k0, D, n_groups,
                                  stride_ce, stride_co, stride_le, stride_lo, BLOCK_I, BLOCK_K, GROUP)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) · up
    tl.store(h_ptr + pid_t * I + offs_i, h, mask=mask_i)


@triton.jit
def _moe_down_kernel(
    h_ptr, ids_ptr, wts_ptr, c2_ptr, l2_ptr, out_ptr,  # pointers
    D, I, A, row_bytes, n_groups,  # sizes
    stride_ce, stride_co, stride_le, stride_lo,  # strides of w2
    I_PER_SPLIT: tl.constexpr,  # slice of I per program (a multiple of BLOCK_K)
    BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_t // A
    e = tl.load(ids_ptr + pid_t).to(tl.int64)
    wt = tl.load(wts_ptr + pid_t).to(tl.float32)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for kk in range(0, I_PER_SPLIT, BLOCK_K):
        k0 = pid_s * I_PER_SPLIT + kk
        acc += _gemv_2bit_block(c2_ptr, l2_ptr, h_ptr + pid_t * I, e, offs_d, mask_d, k0, I, n_groups,
                                stride_ce, stride_co, stride_le, stride_lo, BLOCK_D, BLOCK_K, GROUP)
    tl.atomic_add(out_ptr + n * D + offs_d, acc * wt, mask=mask_d)


def _block_k(n_in: int, groups: int, cap: int = 128) -> tuple[int, int]:
    """(BLOCK_K, GROUP): BLOCK_K a power of two ≥ 4 that never straddles a codebook group."""
    if groups == 1:
        return max(4, min(cap, triton.next_power_of_2(n_in))), 1 << 30
    gs = n_in // groups
    bk = gs & -gs  # largest power of two dividing the group size
    assert bk >= 4, f"group size {gs} must be a multiple of 4 for the fused kernel"
    return min(cap, bk), gs


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               c1: torch.Tensor, l1: torch.Tensor, c3: torch.Tensor, l3: torch.Tensor,
               c2: torch.Tensor, l2: torch.Tensor, block_i: int = 16, block_d: int = 32,
               block_k: int = 512, split_i: int | None = None) -> torch.Tensor:
    """Fused 2-bit MoE for few tokens. Returns out [N, D] fp32.

    Default blocks: the best of a hand sweep on the H200 at batch 1 for both benchmark shapes
    (benchmarks/results/moe_kernel_h200.json).

    x [N, D]; ids [N, A] int; weights [N, A]; c1, c3 [E, I, ceil(D/4)] uint8, l1, l3 [E, I, G1, 4] fp32;
    c2 [E, D, ceil(I/4)] uint8, l2 [E, D, G2, 4] fp32.
    """
    N, D = x.shape
    A = ids.shape[1]
    E, I, rb1 = c1.shape
    assert ids.shape == weights.shape == (N, A), (ids.shape, weights.shape, N, A)
    assert c3.shape == c1.shape and c2.shape == (E, D, bitpack.packed_row_bytes(I, 2)), (c1.shape, c2.shape)
    assert rb1 == bitpack.packed_row_bytes(D, 2), (rb1, D)
    assert l1.shape == l3.shape and l1.shape[:2] == (E, I) and l1.shape[3] == 4 and l2.shape[:2] == (E, D), \
        (l1.shape, l2.shape)
    for t in (c1, c3, c2):
        assert t.dtype == torch.uint8 and t.is_contiguous(), (t.dtype, t.stride())
    for t in (l1, l3, l2):
        assert t.dtype == torch.float32 and t.is_contiguous(), (t.dtype, t.stride())
    x = x.contiguous()
    ids = ids.to(torch.int32).contiguous()
    weights = weights.float().contiguous()
    G1, G2 = l1.shape[2], l2.shape[2]
    bk1, gs1 = _block_k(D, G1, block_k)
    bk2, gs2 = _block_k(I, G2, block_k)
    h = torch.empty(N * A, I, dtype=torch.float32, device=x.device)
    _moe_gate_up_kernel[(N * A, triton.cdiv(I, block_i))](
        x, ids, c1, l1, c3, l3, h, I, A, rb1, G1,
        x.stride(0), c1.stride(0), c1.stride(1), l1.stride(0), l1.stride(1), D=D,
        BLOCK_I=block_i, BLOCK_K=bk1, GROUP=gs1)
    out = torch.zeros(N, D, dtype=torch.float32, device=x.device)
    if split_i is None:  # enough programs to fill the GPU at batch 1, a single slice for small I
        split_i = max(1, min(triton.cdiv(I, 4 * bk2), 132 * 4 // max(1, N * A * triton.cdiv(D, block_d))))
    per = triton.cdiv(triton.cdiv(I, split_i), bk2) * bk2
    split_i = triton.cdiv(I, per)
    _moe_down_kernel[(N * A, triton.cdiv(D, block_d), split_i)](
        h, ids, weights, c2, l2, out, D, I, A, c2.shape[2], G2,
        c2.stride(0), c2.stride(1), l2.stride(0), l2.stride(1), I_PER_SPLIT=per,
        BLOCK_D=block_d, BLOCK_K=bk2, GROUP=gs2)
    return out


def _dequant_ref(codes: torch.Tensor, lut: torch.Tensor, n_in: int) -> torch.Tensor:
    """[E, O, row_bytes] codes + [E, O, G, 4] lut -> W [E, O, n_in] fp32."""
    E, O, G, _ = lut.shape
    idx = bitpack.unpack(codes, 2, n_in).view(E, O, G, n_in // G)
    return lut.float().gather(-1, idx).reshape(E, O, n_in)


def moe_decode_ref(x, ids, weights, c1, l1, c3, l3, c2, l2) -> torch.Tensor:
    """Plain-torch reference of `moe_decode` (same arguments), out [N, D] fp32."""
    N, D = x.shape
    I = c1.shape[1]
    w1, w3, w2 = _dequant_ref(c1, l1, D), _dequant_ref(c3, l3, D), _dequant_ref(c2, l2, I)
    xf = x.float()
    out = torch.zeros(N, D, dtype=torch.float32, device=x.device)
    for n in range(N):
        for a in range(ids.shape[1]):
            e = int(ids[n, a])
            h = torch.nn.functional.silu(w1[e] @ xf[n]) * (w3[e] @ xf[n])
            out[n] += weights[n, a].float() * (w2[e] @ h)
    return out
