"""Decode GEMV of 4-bit affine (rtn) projections in Gluon: codes loaded straight into the tensor cores' operand
registers, turned into fp16 weights there, multiplied by mma.sync with the step's tokens as the mma's N.

Why (issue 32): the `tl` GEMV (qlinear._gemv_kernel) decodes each code on the integer pipe and multiplies on the
FMA pipe, and at batch 1 the 4-bit attention projections of `latency-hls2-nuq2-attn4` ran no faster than cuBLAS's
bf16 GEMVs over four times the bytes. 4-bit codes are cheap to decode where the instructions suit them: two codes
of a word at nibbles q and q + 4 (inputs 8w + q and 8w + q + 4, formats/bitpack.py U4X2) become an fp16 pair
(1024 + c) by one shift and one LOP3 that ORs in the exponent of 1024, then w = (v - 1024)·scale + zero is one
sub.f16x2 and one fma.f16x2 (the fp32-rate pipe): per 8 codes 3 shifts, 4 LOP3, 8 fp16x2 instructions, and the
products and sums are mma.sync work (gluon_moe_decode.py does the same for 2-bit tables, where the lookup's
integer work bounds it; at 4 bits a code is twice the bytes for half the integer work).

Layout: a chunk is 16 int32 words (128 inputs) of a row; lane (c = lane % 4, n = lane / 4) holds words
4c .. 4c + 3 (one 16-byte load) of rows n + 8i. Field q (0..3) of those words is the A operand [rows, 32]: column
k = 16·ws1 + 8·ws0 + 2c + r0 is input 8·(4c + ws) + q + 4·r0 of the chunk (ws = 2·ws1 + ws0: which of the lane's
four words, r0: low or high half of the pair), so lane 4n + c's share of x is the chunk's inputs 32c .. 32c + 31
(four 16-byte loads, split into the four fields in registers). x's tokens are the B operand's columns (M ≤ 8; the
rest zero). The KW warps of a program split the inputs (warp w takes chunks w, w + KW, ...) and are summed at
the end; a chunk lies in one quantization group (groups of a multiple of 128 inputs), so a lane reads each of its
rows' scale and zero once per chunk, for 32 codes.

Measured (benchmarks/bench_gluon_qlinear.py -> results/gluon_qlinear_h100.json, benchmarks/gpu_attn4.sh ->
results/latency_attn4_h100/; figures in docs/results.md, "Issue 32"): faster than the `tl` GEMV and than cuBLAS's bf16
GEMV on every projection shape measured (Mixtral, Qwen3, GLM-4.5-Air) at batch 1 and 4, where the `tl` GEMV re-reads
the weights per token; shipped: 16 rows a program, 8 warps (configs/nvidia_h200.json qlinear.gemv: the best or near
it on every shape). Variants that loaded the next chunk's words (and x) during this chunk's math were no faster and
spilled with a bias at 8 warps: measured (results/gluon_qlinear_variants_h100.json), then removed.

Gluon has no CPU interpreter: tests/kernels/test_gluon_qlinear.py compiles it for sm_90 (layouts, registers, the
loop's instructions) and the GPU smoke checks it against qlinear_ref (benchmarks/gpu_smoke.py `(kernels)`, and
every attn4 recipe's logits through the default path).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from . import launch_config, pdl
from .dequant import MODE_AFFINE, QWeight
from .pdl import gluon_begin

CHUNK = 128  # inputs per row and chunk: 16 int32 words of 8 codes (a chunk never straddles a group)
MAX_M = 8  # tokens: the mma's N


@gluon.jit
def _pair(w2, s2, z2, q: gl.constexpr):
    """Field q of each word (nibbles q, q + 4) -> the fp16 pair (c·scale + zero) for its two inputs, packed in one
    32-bit register (pack=2: every input comes twice, so one asm instance makes the two fp16 of one word)."""
    return gl.inline_asm_elementwise(
        asm=f"""{{
        .reg .b32 r, m;
        shr.u32 r, $1, {4 * q};
        lop3.b32 r, r, 0x000F000F, 0x64006400, 0xEA;
        mov.b32 m, 0x64006400;
        sub.rn.f16x2 r, r, m;
        fma.rn.f16x2 $0, r, $3, $5;
        }}""",
        constraints="=r,r,r,r,r,r,r", args=[w2, s2, z2], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _two(v):
    return gl.join(v, v)


@gluon.jit
def _a_field(w, s, z, q: gl.constexpr, A_L: gl.constexpr, KW: gl.constexpr, BM: gl.constexpr):
    """Field q of the words [KW, BM, 16] as the A operand [KW, BM, 32] fp16 (column k = 16·ws1 + 8·ws0 + 2c + r0)."""
    a = _pair(_two(w), _two(s), _two(z), q)  # [w, m, word, r0]
    a = gl.reshape(a, [KW, BM, 4, 2, 2, 2])  # [w, m, c, ws1, ws0, r0]
    a = gl.reshape(gl.permute(a, [0, 1, 3, 4, 2, 5]), [KW, BM, 32])  # [w, m, ws1, ws0, c, r0]
    return gl.convert_layout(a, A_L, assert_trivial=True)


@gluon.jit
def _b_field(v, B_L: gl.constexpr, KW: gl.constexpr):
    """One field's inputs [KW, 8 (n), 4 (c), 2 (ws1), 2 (ws0), 2 (r0)] -> the B operand [KW, 32, 8]."""
    v = gl.reshape(gl.permute(v, [0, 3, 4, 2, 5, 1]), [KW, 32, 8])  # [w, ws1, ws0, c, r0, n]
    return gl.convert_layout(v, B_L, assert_trivial=True)


@gluon.jit
def _x_load(x_ptr, M, chunk, K: gl.constexpr, KW: gl.constexpr):
    """x's tokens over the warps' chunks, [KW, 8 (n), 4 (c), 32] in x's dtype: lane 4n + c reads token n's inputs
    32c .. 32c + 31 of its warp's chunk (four 16-byte loads; zeros past the row and for n >= M)."""
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 1, 32], [1, 8, 4, 1], [KW, 1, 1, 1], [3, 2, 1, 0])
    w = gl.arange(0, KW, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, XL))))
    i = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, XL))))
    ck = gl.convert_layout(chunk, w.type.layout)
    off = ((ck * 128)[:, None, None, None] + (n * K)[None, :, None, None] + (32 * c)[None, None, :, None]
           + i[None, None, None, :])
    m = (ck < K // 128)[:, None, None, None] & (n < M)[None, :, None, None]
    return gl.load(x_ptr + off, mask=m, other=0.0)


@gluon.jit
def _x_fields(v, B_L: gl.constexpr, KW: gl.constexpr):
    """_x_load's tile as four B operands [KW, 32, 8] fp16 (fields q = 0..3), split in registers."""
    v = gl.reshape(v.to(gl.float16), [KW, 8, 4, 2, 2, 2, 2, 2])  # [w, n, c, ws1, ws0, r0, qh, ql]: 8ws + 4r0 + q
    even, odd = gl.split(v)
    v0, v2 = gl.split(even)
    v1, v3 = gl.split(odd)
    return _b_field(v0, B_L, KW), _b_field(v1, B_L, KW), _b_field(v2, B_L, KW), _b_field(v3, B_L, KW)


@gluon.jit
def _half_pair(p, rows, G: gl.constexpr, g):
    """Each row's fp16 value of group g, as the int32 pair (v | v << 16), [KW, BM]."""
    v = gl.load(p + rows * G + g).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return v | (v << 16)


@gluon.jit
def _chunk_loads(base, s_ptr, z_ptr, rows, wk, zero, i, NC: gl.constexpr, G: gl.constexpr, GC: gl.constexpr,
                 KW: gl.constexpr):
    """Iteration i's code words [KW, BM, 16] and the rows' scale and zero pairs of its groups (chunks past the row:
    words 0, the last group's scales; their x is 0)."""
    chunk = i * KW + wk
    w = gl.load(base + i * KW * 16, mask=(chunk < NC)[:, None, None], other=0)  # masked per warp: wide loads stay
    g = gl.minimum(chunk, NC - 1) // GC
    s = zero + _half_pair(s_ptr, rows[None, :], G, g[:, None])[:, :, None]
    z = zero + _half_pair(z_ptr, rows[None, :], G, g[:, None])[:, :, None]
    return w, s, z


@gluon.jit
def _chunk_mma(acc, w, s, z, b0, b1, b2, b3, A_L: gl.constexpr, KW: gl.constexpr, BM: gl.constexpr):
    acc = mma_v2(_a_field(w, s, z, 0, A_L, KW, BM), b0, acc)
    acc = mma_v2(_a_field(w, s, z, 1, A_L, KW, BM), b1, acc)
    acc = mma_v2(_a_field(w, s, z, 2, A_L, KW, BM), b2, acc)
    return mma_v2(_a_field(w, s, z, 3, A_L, KW, BM), b3, acc)


@gluon.jit
def _gemv4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, M, O,
                  K: gl.constexpr, G: gl.constexpr, BM: gl.constexpr, KW: gl.constexpr, HAS_BIAS: gl.constexpr,
                  PDL: gl.constexpr = False):
    """Grid (cdiv(O, BM),): y[:M, rows] = x[:M] Wᵀ (+ bias) for W's 4-bit codes [O, K/8] int32 words, scale and zero
    [O, G]; y in y_ptr's dtype."""
    gluon_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[KW, 1, 1], instr_shape=[1, 16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    WL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [KW, 1, 1], [2, 1, 0])
    NW: gl.constexpr = K // 8  # words a row
    NC: gl.constexpr = K // 128  # chunks a row
    GC: gl.constexpr = NC // G  # chunks a group
    NIT: gl.constexpr = (NC + KW - 1) // KW

    r0 = gl.program_id(0) * BM
    wk = gl.arange(0, KW, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
    wr = gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
    ww = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
    rows = gl.minimum(r0 + wr, O - 1)  # rows past O read the last row; the store drops them
    zero = gl.full([KW, BM, 16], 0, gl.int32, WL)
    base = w_ptr + (rows * NW)[None, :, None] + (wk * 16)[:, None, None] + ww[None, None, :]
    acc = gl.zeros([KW, BM, 8], gl.float32, MMA)
    for i in range(NIT):
        w, s, z = _chunk_loads(base, s_ptr, z_ptr, rows, wk, zero, i, NC, G, GC, KW)
        b0, b1, b2, b3 = _x_fields(_x_load(x_ptr, M, i * KW + wk, K, KW), B_L, KW)
        acc = _chunk_mma(acc, w, s, z, b0, b1, b2, b3, A_L, KW, BM)
    y = gl.sum(acc, axis=0)  # [BM, 8]: the warps' partial sums
    orow = r0 + gl.arange(0, BM, layout=gl.SliceLayout(1, y.type.layout))
    ocol = gl.arange(0, 8, layout=gl.SliceLayout(0, y.type.layout))
    if HAS_BIAS:
        y += gl.load(bias_ptr + orow, mask=orow < O, other=0.0).to(gl.float32)[:, None]
    gl.store(y_ptr + ocol[None, :] * O + orow[:, None], y.to(y_ptr.dtype.element_ty),
             mask=(orow < O)[:, None] & (ocol < M)[None, :])


def supports(w: QWeight, M: int) -> bool:
    """4-bit affine codes (rtn) with groups of a multiple of 128 inputs, contiguous scales and zeros, CUDA, M <= 8
    tokens."""
    if not (w.mode == MODE_AFFINE and w.bits == 4 and w.data.is_cuda and M <= MAX_M and w.b is not None
            and w.a.is_contiguous() and w.b.is_contiguous()):
        return False
    K, G = w.n_in, w.groups
    return K % CHUNK == 0 and K % G == 0 and (K // G) % CHUNK == 0


def pick_warps(K: int, O: int, sms: int, block_m: int = 16) -> int:
    """Warps a program (they split the row's chunks) for K inputs and O outputs: 8, unless the grid would leave
    the SMs idle or queue a partial second wave. A program of w warps at this kernel's ~64 registers a thread
    shares an SM with 32 / w - 1 others, so a wave is sms · 32 / w programs. 16 warps where that still fits one wave
    and each warp keeps 3 or more chunks (long rows on few programs, e.g. GLM-4.5-Air's o projection: 256 programs
    of 96 chunks); 4 where 8 would spill past one wave and 4 does not (GLM's q/k/v: 896 programs). The sweep behind
    it: benchmarks/bench_gluon_qlinear.py (configs/nvidia_h200.json names the record)."""
    programs = triton.cdiv(O, block_m)

    def waves(w: int) -> float:
        return programs / (sms * (32 // w))

    if (K // CHUNK) // 16 >= 3 and waves(16) <= 1:
        return 16
    if waves(8) > 1 and waves(4) <= 1:
        return 4
    return 8


LAUNCHES = 0  # host-side count of launches (the GPU smoke records which path ran)


def gluon_qlinear(x2: torch.Tensor, w: QWeight, bias: torch.Tensor | None, y: torch.Tensor, block_m: int = 16,
                  warps: int | None = 8) -> torch.Tensor:
    """qlinear's decode path for the weights `supports` accepts: x2 [M, K] contiguous rows, y [M, O] (written).
    warps None: `pick_warps` for this shape and device."""
    global LAUNCHES
    LAUNCHES += 1
    M, K = x2.shape
    O = y.shape[1]
    if warps is None:
        warps = pick_warps(K, O, launch_config.num_sms(x2.device), block_m)
    d = w.data.view(torch.int32)  # [1, O, K/8]
    _gemv4_kernel[(triton.cdiv(O, block_m),)](
        x2, d, w.a, w.b, bias if bias is not None else d, y, M, O,
        K=K, G=w.groups, BM=block_m, KW=warps, HAS_BIAS=bias is not None, num_warps=warps,
        **pdl.options(x2.device))
    return y
