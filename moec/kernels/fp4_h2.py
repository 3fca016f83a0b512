"""fp4 (e2m1) weight GEMV with fp16x2 products: the codes turned into e4m3 bytes by shifts and masks, each byte
pair converted to an fp16 pair by one `cvt.rn.f16x2.e4m3x2` (sm_89+), two products per fma.rn.f16x2.

Why: the fp32 word path (dequant.gemv_fp4_words) builds each weight from its code with integer shifts and masks
and one fp32 multiply, then one FFMA: about 8.6 SASS instructions per code in the gate/up loop (sm_90,
benchmarks/studies/sass_fp4_decode.py), which makes the MoE GEMV issue-bound well below copy bandwidth. Here a
word (8 codes) costs 7 integer instructions, 4 conversions and 4 HFMA2.

The e4m3 byte of an e2m1 code s·e1·e0·m is s << 7 | (e1 e0 m) << 2: exponent field e1 e0 (0..3), mantissa m00,
so its value is e2m1 · 2^-6 exactly (normal: 2^(e-7)·(1 + m/2); e = 0: the subnormal 2^-6·m/2), every one an
fp16 normal; the 2^6 goes into the block scale's multiply. Codes are MODE_FP4's natural U4X2 order: int32 word
q of a 32-input chunk holds inputs 8q..8q+7, input 8q + r in bits 4r..4r+3. The even nibbles (r = 0, 2, 4, 6)
become the word's four bytes by ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080), the odd ones (1, 3, 5, 7)
by ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080); the low half of each converts to the fp16 pair of inputs
(r, r + 2), the high half to (r + 4, r + 6). So x comes as fp16 pairs in that order (`fp4_pairs`): pair
p = 4q + 2a + b of a chunk holds inputs 8q + 4b + a (low half) and 8q + 4b + a + 2 (high half).

Products are summed in fp16 over 16 codes (8 per half; the weights are at most 6/64, so a partial stays within
fp16 unless |x| reaches ~40000), each partial converted and added in fp32, like dequant.gemv_prmt's.
`fp4h_decode_emulate` replays the arithmetic in torch (the CPU has no PTX); the GPU smoke runs the kernels.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl
from .dequant import QWeight, _fp4_chunk_loads, use_fp4_words
from .pdl import begin as pdl_begin

FP4H_SCALE = tl.constexpr(64.0)  # the e4m3 bytes hold e2m1 · 2^-6

# one word's 8 codes against its four pairs of x, into the fp16x2 accumulator `acc` (an asm fragment, {W}: the word's
# operand, {X0}..{X3}: its x pairs, {FIRST}: mul instead of fma for the first product of a partial)
_WORD = """shl.b32 t, {W}, 2;
shl.b32 u, {W}, 4;
and.b32 u, u, 0x80808080;
lop3.b32 e, t, 0x1C1C1C1C, u, 0xEA;
shr.b32 t, {W}, 2;
and.b32 u, {W}, 0x80808080;
lop3.b32 o, t, 0x1C1C1C1C, u, 0xEA;
mov.b32 {{lo, hi}}, e;
cvt.rn.f16x2.e4m3x2 p, lo;
{FIRST}
cvt.rn.f16x2.e4m3x2 p, hi;
fma.rn.f16x2 acc, p, {X1}, acc;
mov.b32 {{lo, hi}}, o;
cvt.rn.f16x2.e4m3x2 p, lo;
fma.rn.f16x2 acc, p, {X2}, acc;
cvt.rn.f16x2.e4m3x2 p, hi;
fma.rn.f16x2 acc, p, {X3}, acc;
"""


def _asm16() -> str:
    """Two words (16 codes, operands $1 $2) against their eight pairs of x ($3..$10) -> fp32 $0."""
    body = "".join(_WORD.format(W=f"${1 + q}", X1=f"${4 + 4 * q}", X2=f"${5 + 4 * q}", X3=f"${6 + 4 * q}",
                                FIRST=(f"mul.rn.f16x2 acc, p, ${3 + 4 * q};" if q == 0 else
                                       f"fma.rn.f16x2 acc, p, ${3 + 4 * q}, acc;")) for q in range(2))
    return ("{\n.reg .b32 t, u, e, o, p, acc;\n.reg .b16 lo, hi;\n.reg .f32 fa, fb;\n" + body +
            "mov.b32 {lo, hi}, acc;\ncvt.f32.f16 fa, lo;\ncvt.f32.f16 fb, hi;\nadd.f32 $0, fa, fb;\n}")


FP4H_ASM = tl.constexpr(_asm16())


# Whether the MoE decode takes this path by default: benchmarks/studies/fp4h_flip.py sets it from the GPU check
# against the reference and the step's A/B (benchmarks/studies/gpu_fp4h.sh; docs/results.md has the numbers).
# MOEC_FP4H=1 / 0 turns it on / off.
ON_BY_DEFAULT = True


def use_fp4h(w: QWeight) -> bool:
    """The fp16x2 path: fp4 rows the word path takes, on a CUDA device with e4m3 conversions (sm_89+), where it is
    on (MOEC_FP4H, else ON_BY_DEFAULT)."""
    on = os.environ.get("MOEC_FP4H", "1" if ON_BY_DEFAULT else "0") == "1"
    return on and use_fp4_words(w) and w.data.is_cuda and torch.cuda.get_device_capability(w.data.device) >= (8, 9)


@triton.jit
def _dot16(w0, w1, x0, x1, x2, x3, x4, x5, x6, x7):
    """Σ of the 16 code·x products of words w0, w1 [BO, BKC] against their x pairs [1, BKC] -> fp32 (· 2^-6)."""
    return tl.inline_asm_elementwise(
        asm=FP4H_ASM, constraints="=r,r,r,r,r,r,r,r,r,r,r",
        args=[w0, w1, tl.broadcast_to(x0, w0.shape), tl.broadcast_to(x1, w0.shape), tl.broadcast_to(x2, w0.shape),
              tl.broadcast_to(x3, w0.shape), tl.broadcast_to(x4, w0.shape), tl.broadcast_to(x5, w0.shape),
              tl.broadcast_to(x6, w0.shape), tl.broadcast_to(x7, w0.shape)],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _x8(xp_ptr, cidx, n_chunks, h: tl.constexpr):
    """x pairs 8h .. 8h + 7 of chunks cidx, each [1, BKC] (xp_ptr: fp4_pairs [16, n_chunks] int32; 0 past)."""
    m = cidx < n_chunks
    p = xp_ptr + 8 * h * n_chunks + cidx
    return (tl.load(p, mask=m, other=0)[None, :], tl.load(p + n_chunks, mask=m, other=0)[None, :],
            tl.load(p + 2 * n_chunks, mask=m, other=0)[None, :], tl.load(p + 3 * n_chunks, mask=m, other=0)[None, :],
            tl.load(p + 4 * n_chunks, mask=m, other=0)[None, :], tl.load(p + 5 * n_chunks, mask=m, other=0)[None, :],
            tl.load(p + 6 * n_chunks, mask=m, other=0)[None, :], tl.load(p + 7 * n_chunks, mask=m, other=0)[None, :])


@triton.jit
def _chunk(v0, v1, v2, v3, sc_lo, sc_hi, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
           GS: tl.constexpr):
    """One chunk's scaled sum [BO, BKC] (the 2^6 left to the caller)."""
    lo = _dot16(v0, v1, x0, x1, x2, x3, x4, x5, x6, x7)
    hi = _dot16(v2, v3, y0, y1, y2, y3, y4, y5, y6, y7)
    if GS == 16:
        return lo * sc_lo + hi * sc_hi
    return (lo + hi) * sc_lo


@triton.jit
def gemv_fp4h(acc, w_ptr, a_ptr, xp_ptr, offs_o, mask_o, stride_wo, stride_ao, k0, n_in, GS: tl.constexpr,
              BKC: tl.constexpr):
    """acc [BO, BKC] += 2^-6 · Σ w·x over inputs [k0, k0 + 32·BKC) (w_ptr: codes as int32; xp_ptr: x as
    fp4_pairs). The caller multiplies the row sums by FP4H_SCALE."""
    n_chunks = n_in // 32
    cidx = k0 // 32 + tl.arange(0, BKC)
    v0, v1, v2, v3, sc_lo, sc_hi, _, _ = _fp4_chunk_loads(w_ptr, a_ptr, offs_o, mask_o, stride_wo, stride_ao, k0, n_in,
                                                          GS, BKC)
    x0, x1, x2, x3, x4, x5, x6, x7 = _x8(xp_ptr, cidx, n_chunks, 0)
    y0, y1, y2, y3, y4, y5, y6, y7 = _x8(xp_ptr, cidx, n_chunks, 1)
    return acc + _chunk(v0, v1, v2, v3, sc_lo, sc_hi, x0, x1, x2, x3, x4, x5, x6, x7,
                        y0, y1, y2, y3, y4, y5, y6, y7, GS)


@triton.jit
def gemv_fp4h2(acc_g, acc_u, w1_ptr, a1_ptr, w3_ptr, a3_ptr, xp_ptr, offs_o, mask_o, stride_wo, stride_ao, k0, n_in,
               GS: tl.constexpr, BKC: tl.constexpr):
    """gemv_fp4h for gate and up (one layout, the same x pairs, loaded once)."""
    n_chunks = n_in // 32
    cidx = k0 // 32 + tl.arange(0, BKC)
    g0, g1, g2, g3, gs_lo, gs_hi, _, _ = _fp4_chunk_loads(w1_ptr, a1_ptr, offs_o, mask_o, stride_wo, stride_ao, k0,
                                                          n_in, GS, BKC)
    u0, u1, u2, u3, us_lo, us_hi, _, _ = _fp4_chunk_loads(w3_ptr, a3_ptr, offs_o, mask_o, stride_wo, stride_ao, k0,
                                                          n_in, GS, BKC)
    x0, x1, x2, x3, x4, x5, x6, x7 = _x8(xp_ptr, cidx, n_chunks, 0)
    y0, y1, y2, y3, y4, y5, y6, y7 = _x8(xp_ptr, cidx, n_chunks, 1)
    acc_g += _chunk(g0, g1, g2, g3, gs_lo, gs_hi, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7, GS)
    acc_u += _chunk(u0, u1, u2, u3, us_lo, us_hi, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7, GS)
    return acc_g, acc_u


# ---- x as fp16 pairs in the conversion's order ------------------------------------------------------------------

@triton.jit
def fp4_pair_slot(i):
    """Where input i lands in fp4_pairs' output viewed as int16 per row: pair p = 4q + 2a + b of chunk c, half h
    (i = 32c + 8q + 4b + 2h + a) at (p · n_chunks + c) · 2 + h, with n_chunks passed by the caller: returns (p, c,
    h)."""
    c = i // 32
    r = i % 32
    q = r // 8
    b = (r // 4) % 2
    h = (r // 2) % 2
    a = r % 2
    return 4 * q + 2 * a + b, c, h


@triton.jit
def _fp4_pairs_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One row of v (n inputs): out (int16 view) at fp4_pair_slot(i) = fp16(v[i])."""
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    p, c, h = fp4_pair_slot(i)
    v = tl.load(v_ptr + row * n + i, mask=m, other=0.0).to(tl.float16)
    tl.store(out_ptr + row * n + (p * (n // 32) + c) * 2 + h, v, mask=m)


def fp4_pairs(v: torch.Tensor) -> torch.Tensor:
    """v [..., n] (n % 32 == 0) -> int32 [..., 16, n/32]: fp16 pairs in the conversion's order (pair p = 4q + 2a + b
    of chunk c holds inputs 32c + 8q + 4b + a and that + 2). On CUDA one kernel; elsewhere fp4_pairs_ref."""
    return _fp4_pairs_launch(v) if v.is_cuda else fp4_pairs_ref(v)


def _fp4_pairs_launch(v: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The kernel's launch (tests run it under TRITON_INTERPRET on the CPU)."""
    *lead, n = v.shape
    v2 = v.reshape(-1, n).contiguous()
    out = torch.empty(*lead, 16, n // 32, dtype=torch.int32, device=v.device)
    block = min(block, triton.next_power_of_2(n))
    _fp4_pairs_kernel[(v2.shape[0], triton.cdiv(n, block))](v2, out.view(torch.float16), n, BLOCK=block,
                                                              num_warps=4, **pdl.options(v2.device))
    return out


def fp4_pairs_ref(v: torch.Tensor) -> torch.Tensor:
    """Torch version of fp4_pairs (any device)."""
    *lead, n = v.shape
    L = len(lead)
    h = v.to(torch.float16).reshape(*lead, n // 32, 4, 2, 2, 2)  # [.., c, q, b, h, a]
    h = h.permute(*range(L), L + 1, L + 4, L + 2, L, L + 3)  # [.., q, a, b, c, h]
    return h.contiguous().view(torch.int32).reshape(*lead, 16, n // 32)


def fp4h_decode_emulate(words: torch.Tensor) -> torch.Tensor:
    """Torch replay of the kernel's byte arithmetic and conversions: int32 words [..., 4] (a chunk) -> fp16
    weights · 2^-6 [..., 16, 2] in fp4_pairs order (pair 4q + 2a + b: a = 0 the even bytes, low byte first)."""
    w = words.long() & 0xFFFFFFFF
    even = ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)
    odd = ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)
    by = torch.stack([even, odd], -1)  # [..., q, a]
    by = torch.stack([(by >> (8 * k)) & 0xFF for k in range(4)], -1)  # [..., q, a, byte]: byte 2b + h
    f = by.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
    return f.reshape(*words.shape[:-1], 16, 2)
