"""Fused MoE decode for 2-bit hls experts in Gluon: packed codes loaded straight into the tensor cores' operand
registers, looked up there by `prmt`, multiplied by mma.sync — the `tl` kernels' (moe_decode.py) contract and
launch structure (gate/up with the activation fused, then down with the slots' sum), for the codecs it supports.

Why (issue 32): the `tl` prmt GEMV (dequant.gemv_prmt) multiplies on the FMA pipe: per 16 codes 8 prmt, 8 IMAD,
8 HFMA2 and the fp32 partial sums, ~2.5 SASS instructions per code with its addressing, which bounds it at about
half of copy bandwidth (issue-bound). Here the weights are the mma's A operand (rows of W as M, x as the B
operand's one live column): a code's lookup is the KV kernel's `_unpack4` (a mask, a selector IMAD, a prmt per
two codes, 23 instructions per 16 codes) and the products and the row sums are tensor-core work (two HMMA per
16 codes and thread), so nothing but the lookup is left on the issue slots.

Codes (formats/bitpack.py U2X4: byte b of a row holds inputs 4b..4b+3, input 4b + j in bits 2j) are read as int32
words, 8 words (128 inputs) per row and chunk, in gluon_kv_attention's KEY_WORDS placement: lane (c = lane % 4,
n = lane / 4) holds words 2c, 2c + 1 of rows n + 8i. Bit field j of those words is, after a join/reshape/permute
that moves no value between threads (assert_trivial), the A operand [rows, 32] whose column k is byte
_key_channel(k) of the chunk, i.e. input 4·_key_channel(k) + j: x is loaded as the B operand in that order.
Each row's 4-entry fp16 table (hls with group_size 0: one table a row) stays in two registers for the whole row.

Work split: a program takes BM rows of one token-slot (gate/up) or one token (down: the token's A slots summed in
the same accumulator, so the combine is free) and its KW warps split the input dim (warp w reads chunks
w, w + KW, ...: adjacent warps read adjacent 32-byte pieces of a row), each with its own accumulator, summed
across warps at the end (gl.sum over the warp axis, through shared memory once per program). The next chunk's
words are loaded before the current chunk's math.

Measured (benchmarks/bench_gluon_moe.py -> results/gluon_moe_h100.json; the figures are in docs/results.md,
"Issue 32"): correct, and on the Mixtral shape at batch 1 faster than the `tl` kernels only with the TILED code
layout (tile_codes: a warp reads its m-tile's chunk as 512 contiguous bytes), still well short of copy bandwidth;
Qwen3 about equal, batch 4 slower. What was tried: a cp.async pipeline of 3-6 stages (no gain, so load latency
is not the bound; measured, then removed: results/gluon_moe_variants_h100.json), 16-64 rows a program, 2-8
warps, the tiled layout, and removing the multiply-highs from the lookup (Hopper issues IMAD.HI at a quarter of
the full integer rate, benchmarks/studies/int_pipe_throughput.py). Nsight Compute (benchmarks/studies/
ncu_kernels.py, figures in docs/results.md) says what bounds it: with four warps a scheduler (registers) about
half the cycles find no eligible warp, most memory waits sit at the loop top on the code words loaded one chunk
ahead, and the grid runs in under two waves; the loop is about two full-rate instructions a code, the lookup
most of them and x's bf16 -> fp16 conversion (redone per chunk and warp) the rest. Neither two chunks in flight
nor a register cap for more programs an SM made it faster (benchmarks/studies/gluon_moe_pf2.patch,
results/gluon_moe_pf_h100.json), and a bf16 x costs little against an fp16 one (benchmarks/studies/
moe_x_dtype.py). So
MOEC_KERNELS=gluon sends 2-bit hls layers here (runtime/experts.ExpertWeights.fused, row-major codes: the runtime
holds no tiled copy); the default stays on the `tl` kernels.

Not here (the `tl` kernels serve them): 3/4-bit codes, per-group tables, fp32 tables, vq/fp8/tcq, an h rotation,
inputs not a multiple of 128. Gluon has no CPU interpreter: tests/kernels/test_gluon_moe_decode.py compiles these
kernels for sm_90 on the CPU (registers, spills, SASS per code) and the GPU smoke checks them against
moe_decode_ref (benchmarks/gpu_smoke.py).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .dequant import EXPERT_ACT_IDS, MODE_LUT, QWeight, gated_act

CHUNK = 128  # inputs per row and chunk: 8 int32 words of 16 codes
N_COLS = 8  # the mma's N: column 0 is the token, the other seven are zero


@gluon.jit
def _lookup4(w4, lo4, hi4, j: gl.constexpr):
    """Bit field j of each word -> its four bytes' fp16 levels as two fp16 pairs (gluon_kv_attention._unpack4's
    arithmetic: the field's shift, a mask, the selector code·0x22 + 0x10 of two codes by one multiply-add (nibbles
    2c, 2c + 1 pick level c's bytes out of the table's eight), its high half by a shift, one prmt per two codes:
    23 instructions per word, every one issued at the full integer rate: a multiply-high, which the shifts once
    were, issues at a quarter of it on Hopper (benchmarks/studies/int_pipe_throughput.py). The inputs come four
    times over (_four) so that one asm instance yields four fp16 packed in two 32-bit registers, the form the mma
    operand takes: with four 16-bit outputs ptxas re-packed them, a move per pair (measured: 571 -> 489
    instructions per loop step). A variant with dequant.PRMT_ASM's shift-free selectors for fields 1 and 3 (mad.hi
    with an addend) compiled to more instructions (573)."""
    return gl.inline_asm_elementwise(
        asm=f"""{{
        .reg .b32 r, s;
        shr.b32 r, $2, {2 * j};
        and.b32 r, r, 0x03030303;
        mad.lo.u32 s, r, 34, 0x10101010;
        prmt.b32 $0, $6, $10, s;
        shr.b32 s, s, 16;
        prmt.b32 $1, $6, $10, s;
        }}""",
        constraints="=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
        args=[w4, lo4, hi4], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _four(v):
    """v [..] -> [.., 2, 2]: every element four times (the same registers, no instruction). A join's new axis is
    the fastest in a thread's registers, so element [.., mh, ml] is the (2·mh + ml)-th of the four."""
    return gl.join(gl.join(v, v), gl.join(v, v))


@gluon.jit
def _a_tile(w, j: gl.constexpr, tlo, thi, A_L: gl.constexpr, KW: gl.constexpr, BM: gl.constexpr):
    """Bit field j of the words [KW, BM, 8] as the A operand [KW, BM, 32] fp16 (column k: byte _key_channel(k))."""
    a = _lookup4(_four(w), _four(tlo), _four(thi), j)  # [w, m, r, mh, ml]: byte 2·mh + ml of word r
    a = gl.reshape(a, [KW, BM, 4, 2, 2, 2])  # [w, m, c, ks, mh, ml]
    a = gl.reshape(gl.permute(a, [0, 1, 3, 4, 2, 5]), [KW, BM, 32])  # [w, m, ks, mh, c, ml]
    return gl.convert_layout(a, A_L, assert_trivial=True)


@gluon.jit
def _b_field(v, B_L: gl.constexpr, KW: gl.constexpr):
    """One bit field's inputs [KW, 8 (n), 4 (t), 8 (i)] -> the B operand [KW, 32, 8]: row k = 16·r2 + 8·r1 + 2t + r0
    for i = 4·r2 + 2·r1 + r0 (mma.sync's B fragment: lane 4n + t holds rows 2t, 2t + 1, 2t + 8, 2t + 9 (+16) of
    column n), which is byte _key_channel(k) = 8t + i of the chunk."""
    v = gl.reshape(v, [KW, 8, 4, 2, 2, 2])  # [w, n, t, r2, r1, r0]
    v = gl.reshape(gl.permute(v, [0, 3, 4, 2, 5, 1]), [KW, 32, 8])  # [w, r2, r1, t, r0, n]
    return gl.convert_layout(v, B_L, assert_trivial=True)


@gluon.jit
def _b_tiles(v_ptr, chunk, live, B_L: gl.constexpr, KW: gl.constexpr, EVEN: gl.constexpr):
    """x (or h) of the warps' chunks as four B operands [KW, 32, 8] fp16 (fields j = 0..3). Lane 4n + t needs the
    bytes 8t..8t+7 of the chunk, i.e. inputs 32t..32t+31: four 16-byte loads, split into the fields in registers.
    Every column n holds the same vector (only column 0 is read back; no mask, so every lane's load is plain)."""
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8, 4], [1, 8, 4, 1, 1], [KW, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    w = gl.arange(0, KW, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, XL)))))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, XL)))))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, XL)))))
    i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, XL)))))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL)))))
    ck = gl.convert_layout(chunk, w.type.layout)
    off = ((ck * 128)[:, None, None, None, None] + (0 * n)[None, :, None, None, None]
           + (32 * t)[None, None, :, None, None] + (4 * i)[None, None, None, :, None] + j[None, None, None, None, :])
    if EVEN:
        v = gl.load(v_ptr + off)
    else:
        lk = gl.convert_layout(live, w.type.layout)
        v = gl.load(v_ptr + off, mask=lk[:, None, None, None, None], other=0.0)
    v = gl.reshape(v.to(gl.float16), [KW, 8, 4, 8, 2, 2])
    even, odd = gl.split(v)  # j = 2·jh + jl: the last axis is jl
    v0, v2 = gl.split(even)
    v1, v3 = gl.split(odd)
    return _b_field(v0, B_L, KW), _b_field(v1, B_L, KW), _b_field(v2, B_L, KW), _b_field(v3, B_L, KW)


@gluon.jit
def _b_tiles_perm(v_ptr, chunk, live, B_L: gl.constexpr, KW: gl.constexpr, EVEN: gl.constexpr):
    """_b_tiles for a vector stored in the B order (`b_order`): field j of a chunk is its 32 values 32j..32j+31,
    lane 4n + t's eight at 8t..8t+7, so each field is one 16-byte load and no repacking."""
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [1, 8, 4, 1], [KW, 1, 1, 1], [3, 2, 1, 0])
    w = gl.arange(0, KW, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, XL))))
    i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, XL))))
    ck = gl.convert_layout(chunk, w.type.layout)
    p = v_ptr + ((ck * 128)[:, None, None, None] + (0 * n)[None, :, None, None] + (8 * t)[None, None, :, None]
                 + i[None, None, None, :])
    if EVEN:
        v0 = gl.load(p)
        v1 = gl.load(p + 32)
        v2 = gl.load(p + 64)
        v3 = gl.load(p + 96)
    else:
        m = gl.convert_layout(live, w.type.layout)[:, None, None, None]
        v0 = gl.load(p, mask=m, other=0.0)
        v1 = gl.load(p + 32, mask=m, other=0.0)
        v2 = gl.load(p + 64, mask=m, other=0.0)
        v3 = gl.load(p + 96, mask=m, other=0.0)
    return (_b_field(v0.to(gl.float16), B_L, KW), _b_field(v1.to(gl.float16), B_L, KW),
            _b_field(v2.to(gl.float16), B_L, KW), _b_field(v3.to(gl.float16), B_L, KW))


@gluon.jit
def _b_order(o):
    """Position of input o in the B order: within each 128-input chunk, input 32t + 4i + j sits at 32j + 8t + i."""
    q = o % 128
    return o - q + 32 * (q % 4) + 8 * (q // 32) + (q % 32) // 4


@gluon.jit
def _chunk_mma(acc, w, tlo, thi, b0, b1, b2, b3, A_L: gl.constexpr, KW: gl.constexpr, BM: gl.constexpr):
    acc = mma_v2(_a_tile(w, 0, tlo, thi, A_L, KW, BM), b0, acc)
    acc = mma_v2(_a_tile(w, 1, tlo, thi, A_L, KW, BM), b1, acc)
    acc = mma_v2(_a_tile(w, 2, tlo, thi, A_L, KW, BM), b2, acc)
    acc = mma_v2(_a_tile(w, 3, tlo, thi, A_L, KW, BM), b3, acc)
    return acc


@gluon.jit
def _words(p, live, EVEN: gl.constexpr, TILED: gl.constexpr = False, WL: gl.constexpr = None, BM: gl.constexpr = 16):
    """A chunk's code words [KW, BM, 8] in WL (live [KW]: the warp's chunk exists; past the row end: 0, against
    x = 0). TILED: p points into tile_codes' layout ([KW, BM/16, 8, 4, 4]: 16 contiguous bytes a lane, 512 a warp
    and m-tile), and the tile is renamed into WL's placement (no value moves: assert_trivial)."""
    if EVEN:
        v = gl.load(p)
    else:
        if TILED:
            lk = gl.convert_layout(live, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(
                4, p.type.layout)))))
            v = gl.load(p, mask=lk[:, None, None, None, None], other=0)
        else:
            lk = gl.convert_layout(live, gl.SliceLayout(1, gl.SliceLayout(2, p.type.layout)))
            v = gl.load(p, mask=lk[:, None, None], other=0)
    if TILED:
        KW: gl.constexpr = v.shape[0]
        v = gl.reshape(v, [KW, BM // 16, 8, 4, 2, 2])  # [w, t16, n, c, rowhi, ws]
        v = gl.reshape(gl.permute(v, [0, 1, 4, 2, 3, 5]), [KW, BM, 8])  # [w, t16, rowhi, n, c, ws]
        v = gl.convert_layout(v, WL, assert_trivial=True)
    return v


@gluon.jit
def _tile_offsets(RB, NC: gl.constexpr, rb0, c0, KW: gl.constexpr, BM: gl.constexpr):
    """Word offsets [KW, BM/16, 8, 4, 4] (the last axis: 2·rowhi + ws, one 16-byte load) of the warps' first chunks
    (c0 + w) of row blocks rb0 .. rb0 + BM/16 - 1 in tile_codes' layout [RB, NC, 32 lanes, 4 words] (one
    matrix); row blocks past RB read the last one."""
    TL: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4], [1, 1, 8, 4, 1], [KW, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    L4: gl.constexpr = gl.SliceLayout(4, TL)
    L34: gl.constexpr = gl.SliceLayout(3, L4)
    w = gl.arange(0, KW, layout=gl.SliceLayout(1, gl.SliceLayout(2, L34)))
    t = gl.arange(0, BM // 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L34)))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L34)))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, TL)))))
    rb = gl.minimum(rb0 + t, RB - 1)
    return ((c0 + w)[:, None, None, None, None] * 128 + (rb * NC * 128)[None, :, None, None, None]
            + (n * 16)[None, None, :, None, None] + (c * 4)[None, None, None, :, None] + q[None, None, None, None, :])


@gluon.jit
def _row_tables(t_ptr, rows, zero):
    """A row's fp16 table as two int32 words, broadcast over the words tile `zero` [KW, BM, 8]."""
    p = t_ptr + rows * 2
    return zero + gl.load(p)[None, :, None], zero + gl.load(p + 1)[None, :, None]


@gluon.jit
def _col0(acc, OUT_L: gl.constexpr):
    """The warps' accumulators [KW, BM, 8] -> column 0 summed over the warps, [BM] fp32 in OUT_L."""
    s = gl.sum(acc, axis=0)  # [BM, 8]
    col = gl.arange(0, 8, layout=gl.SliceLayout(0, s.type.layout))
    r = gl.sum(gl.where((col == 0)[None, :], s, 0.0), axis=1)
    return gl.convert_layout(r, OUT_L)


@gluon.jit
def _gate_up_kernel(x_ptr, ids_ptr, wts_ptr, w1_ptr, t1_ptr, w3_ptr, t3_ptr, h_ptr, bg_ptr, bu_ptr,
                    I,
                    D: gl.constexpr, A: gl.constexpr, BM: gl.constexpr, KW: gl.constexpr,
                    HAS_BIAS: gl.constexpr, ACT: gl.constexpr, LIMIT: gl.constexpr, TILED: gl.constexpr = False):
    """Grid (T token-slots, cdiv(I, BM)): h[t, rows] = weight · act(W1[e] x_n, W3[e] x_n) as fp16, stored in the
    B order (_b_order; I % 128 == 0).
    w*_ptr: codes as int32 [E, I, D/16]; t*_ptr: fp16 tables as int32 [E, I, 2]; x fp16/bf16/fp32 [N, D]."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[KW, 1, 1], instr_shape=[1, 16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    WL: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 8, 4], [KW, 1, 1], [2, 1, 0])
    OUT_L: gl.constexpr = gl.BlockedLayout([1], [32], [KW], [0])
    NW: gl.constexpr = D // 16  # words a row
    NC: gl.constexpr = D // 128  # chunks a row
    NIT: gl.constexpr = (NC + KW - 1) // KW
    EVEN: gl.constexpr = NC % KW == 0  # every warp has NIT whole chunks: no masks

    t = gl.program_id(0)
    n = t // A
    e = gl.load(ids_ptr + t).to(gl.int64)
    r0 = gl.program_id(1) * BM
    wk = gl.arange(0, KW, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
    wr = gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
    ww = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
    rows = gl.minimum(r0 + wr, I - 1)  # rows past I read the last row; the store drops them
    zero = gl.full([KW, BM, 8], 0, gl.int32, WL)
    glo, ghi = _row_tables(t1_ptr + e * I * 2, rows, zero)
    ulo, uhi = _row_tables(t3_ptr + e * I * 2, rows, zero)
    STEP: gl.constexpr = KW * 128 if TILED else KW * 8  # words from one of a warp's chunks to its next
    if TILED:  # tile_codes' layout [E, I/16, NC, 32, 4]
        base = _tile_offsets(I // 16, NC, r0 // 16, 0, KW, BM)
    else:
        base = (rows * NW)[None, :, None] + (wk * 8)[:, None, None] + ww[None, None, :]
    p1 = w1_ptr + e * I * NW + base  # contiguous [E, I, NW]: the expert's offset is a multiple of NW (wide loads)
    p3 = w3_ptr + e * I * NW + base
    xr = x_ptr + n * D
    acc_g = gl.zeros([KW, BM, 8], gl.float32, MMA)
    acc_u = gl.zeros([KW, BM, 8], gl.float32, MMA)
    # the next chunk's words are in flight during this chunk's math
    wg = _words(p1, wk < NC, EVEN, TILED, WL, BM)
    wu = _words(p3, wk < NC, EVEN, TILED, WL, BM)
    for i in range(NIT):
        chunk = i * KW + wk
        # the last iteration re-reads its own chunk (EVEN loads have no mask: one past the row's end would read
        # past the expert, and past the allocation for the last rows of the last expert)
        nxt = gl.minimum(i + 1, NIT - 1) * STEP
        wg_n = _words(p1 + nxt, chunk + KW < NC, EVEN, TILED, WL, BM)
        wu_n = _words(p3 + nxt, chunk + KW < NC, EVEN, TILED, WL, BM)
        b0, b1, b2, b3 = _b_tiles(xr, chunk, chunk < NC, B_L, KW, EVEN)
        acc_g = _chunk_mma(acc_g, wg, glo, ghi, b0, b1, b2, b3, A_L, KW, BM)
        acc_u = _chunk_mma(acc_u, wu, ulo, uhi, b0, b1, b2, b3, A_L, KW, BM)
        wg = wg_n
        wu = wu_n
    g = _col0(acc_g, OUT_L)
    u = _col0(acc_u, OUT_L)
    orow = r0 + gl.arange(0, BM, layout=OUT_L)
    om = orow < I
    if HAS_BIAS:  # the experts' biases [E, I] as stored (the model dtype), added in fp32
        g += gl.load(bg_ptr + e * I + orow, mask=om, other=0.0).to(gl.float32)
        u += gl.load(bu_ptr + e * I + orow, mask=om, other=0.0).to(gl.float32)
    wt = gl.load(wts_ptr + t).to(gl.float32)
    h = gated_act(g, u, ACT, LIMIT) * wt
    gl.store(h_ptr + t * I + _b_order(orow), h.to(gl.float16), mask=om)  # in the B order: the down kernel's loads


@gluon.jit
def _down_kernel(h_ptr, ids_ptr, wts_ptr, w2_ptr, t2_ptr, out_ptr, bd_ptr,
                 Dout,
                 I: gl.constexpr, A: gl.constexpr, BM: gl.constexpr, KW: gl.constexpr, SPLIT: gl.constexpr,
                 HAS_BIAS: gl.constexpr, TILED: gl.constexpr = False):
    """Grid (N tokens, cdiv(D, BM), SPLIT): out[n, rows] (+)= Σ_a W2[e_a] h[n·A + a] (+ weight · b2[e_a]), fp32;
    SPLIT > 1: each program a 1/SPLIT of the inputs, added with fp32 atomics into a zeroed out. h fp16 [T, I] in the
    B order (the routing weight folded in by the gate/up kernel); w2 codes int32 [E, D, I/16]."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[KW, 1, 1], instr_shape=[1, 16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    WL: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 8, 4], [KW, 1, 1], [2, 1, 0])
    OUT_L: gl.constexpr = gl.BlockedLayout([1], [32], [KW], [0])
    NW: gl.constexpr = I // 16
    NC: gl.constexpr = I // 128
    CPS: gl.constexpr = (NC + SPLIT - 1) // SPLIT  # chunks per split
    NIT: gl.constexpr = (CPS + KW - 1) // KW
    EVEN: gl.constexpr = (NC % SPLIT == 0) and (CPS % KW == 0)

    n = gl.program_id(0)
    r0 = gl.program_id(1) * BM
    split = gl.program_id(2)
    wk = gl.arange(0, KW, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
    wr = gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
    ww = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
    rows = gl.minimum(r0 + wr, Dout - 1)
    zero = gl.full([KW, BM, 8], 0, gl.int32, WL)
    c0 = split * CPS
    STEP: gl.constexpr = KW * 128 if TILED else KW * 8
    if TILED:
        base = _tile_offsets(Dout // 16, NC, r0 // 16, c0, KW, BM)
    else:
        base = (rows * NW)[None, :, None] + ((c0 + wk) * 8)[:, None, None] + ww[None, None, :]
    orow = r0 + gl.arange(0, BM, layout=OUT_L)
    om = orow < Dout
    acc = gl.zeros([KW, BM, 8], gl.float32, MMA)
    y = gl.zeros([BM], gl.float32, OUT_L)
    for a in gl.static_range(A):  # the slots share the accumulator: Σ_a W2[e_a] h_a
        t = n * A + a
        e = gl.load(ids_ptr + t).to(gl.int64)
        tlo, thi = _row_tables(t2_ptr + e * Dout * 2, rows, zero)
        p2 = w2_ptr + e * Dout * NW + base
        hr = h_ptr + t * I
        w = _words(p2, (wk < CPS) & (c0 + wk < NC), EVEN, TILED, WL, BM)  # one chunk ahead, as gate/up
        for i in range(NIT):
            k = i * KW + wk
            w_n = _words(p2 + gl.minimum(i + 1, NIT - 1) * STEP, (k + KW < CPS) & (c0 + k + KW < NC), EVEN, TILED,
                         WL, BM)  # clamped as in gate/up
            b0, b1, b2, b3 = _b_tiles_perm(hr, c0 + k, (k < CPS) & (c0 + k < NC), B_L, KW, EVEN)
            acc = _chunk_mma(acc, w, tlo, thi, b0, b1, b2, b3, A_L, KW, BM)
            w = w_n
        if HAS_BIAS:  # h carries the routing weight, the bias [E, D] does not: added once (split 0)
            wt = gl.where(split == 0, gl.load(wts_ptr + t).to(gl.float32), 0.0)
            y += wt * gl.load(bd_ptr + e * Dout + orow, mask=om, other=0.0).to(gl.float32)
    y += _col0(acc, OUT_L)
    if SPLIT == 1:
        gl.store(out_ptr + n * Dout + orow, y, mask=om)
    else:
        gl.atomic_add(out_ptr + n * Dout + orow, y, mask=om)


def supports(w1: QWeight, w3: QWeight, w2: QWeight, h_rotate=None) -> bool:
    """Whether these kernels serve a layer: CUDA, 2-bit codes with one fp16 table per row (hls, group_size 0),
    both dims multiples of 128, no rotation of h."""
    def ok(w: QWeight) -> bool:
        return (w.mode == MODE_LUT and w.bits == 2 and w.a is not None and w.a.dtype == torch.float16
                and w.a.shape[2] == 1 and w.n_in % CHUNK == 0 and w.data.is_cuda)
    return h_rotate is None and all(ok(w) for w in (w1, w3, w2))


def tile_codes(data: torch.Tensor) -> torch.Tensor:
    """2-bit codes uint8 [E, O, n/4] (O % 16 == 0, n % 128 == 0) -> int32 [E, O/16, n/128, 32, 4], the TILED layout:
    for each 16-row block and 128-input chunk, lane 4n + c's four words (rows n and n + 8, words 2c and 2c + 1 of
    the chunk) side by side, so a warp reads its m-tile's chunk as 512 contiguous bytes, 16 a lane (row-major codes
    give it 32-byte pieces of 16 rows)."""
    E, O, nb = data.shape
    NC = nb // 32
    w = data.contiguous().view(torch.int32).view(E, O // 16, 2, 8, NC, 4, 2)  # [e, rb, rowhi, n, ch, c, ws]
    return w.permute(0, 1, 4, 3, 5, 2, 6).contiguous().view(E, O // 16, NC, 32, 4)


LAUNCHES = 0  # host-side count of launches (captures under CUDA graphs): the GPU smoke records which path ran


def launch_gate_up(x, ids, weights, w1: QWeight, w3: QWeight, h, A: int, biases=None, act: str = "silu",
                   limit: float = 7.0, block_m: int = 32, warps: int = 4, tiled: tuple | None = None) -> None:
    """The gate/up launch: h [T, I] fp16 (B order) from x [N, D]. tiled: (w1, w3) codes in tile_codes' layout."""
    T, I = h.shape
    d1, d3 = (w1.data.view(torch.int32), w3.data.view(torch.int32)) if tiled is None else tiled
    t1, t3 = (w.a.contiguous().view(torch.int32) for w in (w1, w3))  # [E, O, 1, 4] fp16 -> 2 int32 a row
    bg, bu = (weights, weights) if biases is None else (biases[0].contiguous(), biases[1].contiguous())  # as stored
    _gate_up_kernel[(T, triton.cdiv(I, block_m))](
        x, ids, weights, d1, t1, d3, t3, h, bg, bu, I,
        D=x.shape[1], A=A, BM=block_m, KW=warps, HAS_BIAS=biases is not None, ACT=EXPERT_ACT_IDS[act],
        LIMIT=float(limit), TILED=tiled is not None, num_warps=warps)


def launch_down(h, ids, weights, w2: QWeight, out, A: int, biases=None, block_m: int = 16, warps: int = 8,
                split: int = 1, tiled: torch.Tensor | None = None) -> None:
    """The down launch: out [N, D] fp32 (zeroed by the caller when split > 1) from h [T, I] (B order). tiled: w2's
    codes in tile_codes' layout."""
    N, D = out.shape
    d2 = w2.data.view(torch.int32) if tiled is None else tiled
    t2 = w2.a.contiguous().view(torch.int32)
    bd = weights if biases is None else biases[2].contiguous()
    _down_kernel[(N, triton.cdiv(D, block_m), split)](
        h, ids, weights, d2, t2, out, bd, D,
        I=h.shape[1], A=A, BM=block_m, KW=warps, SPLIT=split, HAS_BIAS=biases is not None,
        TILED=tiled is not None, num_warps=warps)


def gluon_moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: QWeight, w3: QWeight,
                     w2: QWeight, A: int, biases=None, act: str = "silu", limit: float = 7.0,
                     block_m: int = 32, warps: int = 4, block_m_down: int = 16, warps_down: int | None = None,
                     split: int | None = None,
                     tiled: tuple | None = None) -> torch.Tensor:
    """moe_decode's contract for the layers `supports` accepts (x [N, D]; ids int32 and weights fp32 [N, A],
    contiguous; shapes checked by the caller): out [N, D] fp32. tiled: (w1, w3, w2) codes in tile_codes' layout.
    Down launch, unless given (bench_gluon_moe.py's sweep): 8 warps and the inputs split over 2 programs where a
    row has 32 chunks or more (Mixtral's 112: the split was the faster there), else 4 warps unsplit (Qwen3's 6)."""
    global LAUNCHES
    LAUNCHES += 1
    N, D = x.shape
    I = w1.data.shape[1]
    long_rows = I // CHUNK >= 32
    warps_down = warps_down or (8 if long_rows else 4)
    split = split or (2 if long_rows else 1)
    h = torch.empty(N * A, I, dtype=torch.float16, device=x.device)
    launch_gate_up(x, ids, weights, w1, w3, h, A, biases, act, limit, block_m, warps,
                   None if tiled is None else tiled[:2])
    out = (torch.empty if split == 1 else torch.zeros)(N, D, dtype=torch.float32, device=x.device)
    launch_down(h, ids, weights, w2, out, A, biases, block_m_down, warps_down, split,
                None if tiled is None else tiled[2])
    return out
