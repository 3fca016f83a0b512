"""Weight dequantization in registers, shared by the MoE decode/prefill kernels and the quantized linear.

Shape legend: BO = rows (output features) of a tile, BK = inputs of a tile, C = codes per chunk.

A weight row is a run of chunks along the input dim; each mode says what a chunk holds:
  MODE_LUT    codes packed per formats/bitpack.py (2-bit U2X4: 4 codes a byte; 3-bit U3X8: 8 codes in
              3 bytes; 4-bit U4X2: 2 codes a byte) + a table lut [.., O, G, 2^bits] (fp16 or fp32):
              w[o, k] = lut[o, k // gs, idx]. Selection is a tree of `tl.where` keyed by bit tests of
              the packed word (bits·3/2 tests and 2^bits − 1 selects a code, no shifts).
  MODE_AFFINE codes as above (or 8-bit, one a byte) + scale, zero [.., O, G]: w = zero + scale · idx (RTN:
              uniform levels; intsym: zero = -2^(b-1)·scale).
  MODE_FP8    float8_e4m3fn weights, one chunk = one weight; the per-row scale is applied by the caller
              on the accumulated row (it commutes with the sum).
  MODE_DENSE  plain bf16/fp16/fp32 weights (the bf16 peer goes through the same kernels).
  MODE_FP4    4-bit codes as MODE_LUT's (U4X2) holding e2m1 bit patterns + scale fp16/fp32 [.., O, G]:
              w = e2m1(idx) · scale (mxfp4 / nvfp4, runtime/fp4.py): the value is built from the code's bits
              (no table), so a block costs its codes and one scale.
  MODE_VQ     vector codebooks (runtime/weightcodecs.dequantize_vq): one code of W = bits·d bits per d
              consecutive inputs (BITSTREAM: code j at bits [W·j, W·j + W) of the row), a codebook fp16
              [E, K = 2^W, d] per matrix and a row scale [E, O], applied by the caller on the accumulated
              row like MODE_FP8's. Codes are extracted with shifts and masks, then each code gathers its d
              codebook entries (the codebook is ≤ 32 KiB and stays in L1/L2).
  MODE_TCQ    trellis codes (runtime/tcq.py): each row a stream of int32 words, word 0 the lead word, the
              k-bit symbols after it; the weight at input t is computed from the 12 stream bits ending with
              its symbol (state s): (byte sum of 34038481·s + 76625530 mod 2^32 − 510) times the row scale
              fp32 [E, O] (the held scale, already over 128), applied by the caller on the accumulated row like
              MODE_FP8's. A chunk is 32 inputs = k words, read with the word before it (the states straddle).

Two access patterns:
  `gemv_chunks` (CUDA cores, few tokens): accumulates Σ w·x into a 2-D register tile acc [BO, BK/C]
      without reducing inside the loop (the caller reduces once); slot s of every chunk meets the
      stride-C slice of x it multiplies, so codes never need reordering.
  `gemv_prmt` (CUDA, 2-bit fp16 tables in the word layout): table lookup by PTX prmt, two fp16 weights
      per instruction, fp16x2 products, fp32 sums per 16 codes (see the section comment below).
  `gemv_vq` (MODE_VQ, reached through gemv_chunks): three variants. Word chunks (VQF = 1, the default
      where a row is whole chunks): a chunk is NW int32 words holding CPC codes (W | 32: one word of 32/W codes;
      W ∈ {3, 6, 12}: three words of 96/W codes, codes may straddle words), fields extracted with constant
      shifts, and each code's d fp16 entries come in one load (the codebook viewed as int32 at d = 2, int64
      at d = 4, two int64 at d = 8) split by bit ops; these gathers go to L1 (a warp's 32 random 8-byte
      reads of a 2 KiB codebook touch ~14 cache lines). Word chunks + tl.gather (VQF = 2, opt-in, d ≤ 4,
      K ≤ 256): the codebook is loaded into registers once per call and looked up by tl.gather, which
      Triton lowers through shared memory (fewer wavefronts than L1 per random gather). Byte codes (VQF = 0, any row
      length): each code from the one or two bytes holding it, shifts per element, d fp16 loads per code.
  `dequant_tile` (tensor cores, tl.dot): returns the tile W[BO, BK] in natural input order (the C
      slots of each chunk are interleaved back with tl.join, which only adds register dimensions; vq:
      each input gathers its code's entry; without the row scale).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats.codecs import VQ_DIMS, VQ_WIDTHS
from . import pdl
from .pdl import begin as pdl_begin

MODE_LUT, MODE_AFFINE, MODE_FP8, MODE_DENSE, MODE_VQ, MODE_FP4, MODE_TCQ = 0, 1, 2, 3, 4, 5, 6
TCQ_L, TCQ_LEAD = 12, 32  # formats/codecs.py TCQ_STATE_BITS, TCQ_LEAD_BITS
_TCQ_L, _TCQ_LEAD = tl.constexpr(TCQ_L), tl.constexpr(TCQ_LEAD)  # the same, as the kernels read globals
_TCQ_MASK = tl.constexpr((1 << TCQ_L) - 1)
# dequant_tile gathers two int32 words per input of a MODE_TCQ tile: the GEMM launches cap their software
# pipeline at this many stages (4 stages of 128 x 64 tiles need 320 KiB of shared memory, the H100/H200 have 227)
TCQ_MAX_STAGES = 2
_GROUPED = (MODE_LUT, MODE_AFFINE, MODE_FP4)  # codes + per-group operands [E, O, G, ...]


class QWeight(NamedTuple):
    """A stacked matrix [E, O, n_in] as the kernels take it.

    data: codes uint8 [E, O, row_bytes] (LUT/AFFINE), float8_e4m3fn [E, O, n_in] (FP8) or the plain
    weights (DENSE). a: lut [E, O, G, 2^bits] (LUT), scale [E, O, G] (AFFINE), row scale fp32 [E, O]
    (FP8), None (DENSE), codebook fp16 [E, 2^(bits·d), d] (VQ). b: zero [E, O, G] (AFFINE), or for 2-bit LUT
    optionally runtime/experts.lut_poly(a) fp32 [E, O, G, 4] (the GEMV decodes through the cubic; the
    tensor-core paths ignore it), row scale fp16/fp32 [E, O] (VQ), else None. VQ data: BITSTREAM codes
    uint8 [E, O, ceil(n_in / d · bits · d / 8)]. FP4: data 4-bit codes (e2m1 patterns), a fp16/fp32 block
    scales [E, O, G], b None.
    """

    mode: int
    bits: int
    n_in: int
    data: torch.Tensor
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None

    @property
    def groups(self) -> int:
        return self.a.shape[2] if self.mode in _GROUPED else 1

    @property
    def tile_group(self) -> int:
        """The inputs a kernel tile may not straddle (pick_block_k's `group`): a LUT/AFFINE group; a whole row
        for FP4, whose kernels load each chunk's block scale, and for the ungrouped modes."""
        return self.n_in // self.groups if self.mode in (MODE_LUT, MODE_AFFINE) else self.n_in

    @property
    def vq_dim(self) -> int:
        """Inputs per code d (MODE_VQ; 1 for the other modes)."""
        return self.a.shape[2] if self.mode == MODE_VQ else 1

    def check(self, E: int, O: int) -> None:
        """Shapes, dtypes and contiguity the kernels rely on (AssertionError names what is off)."""
        from ..formats import bitpack

        d = self.data
        assert d.is_contiguous() and d.shape[:2] == (E, O), (d.shape, d.stride(), E, O)
        if self.mode in _GROUPED:
            assert d.dtype == torch.uint8 and d.shape[2] == bitpack.packed_row_bytes(self.n_in, self.bits), \
                (d.dtype, d.shape, self.n_in, self.bits)
            assert self.a.is_contiguous() and self.a.shape[:2] == (E, O) and self.n_in % self.a.shape[2] == 0, \
                (self.a.shape, self.n_in)
            if self.mode == MODE_LUT:
                assert self.a.dim() == 4 and self.a.shape[3] == 1 << self.bits, self.a.shape
                assert self.b is None or (self.bits == 2 and self.b.shape == self.a.shape and self.b.is_contiguous()
                                          and self.b.dtype == torch.float32), "b: experts.lut_poly(lut) of 2-bit tables"
            elif self.mode == MODE_FP4:
                assert self.bits == 4 and self.a.dim() == 3 and self.b is None \
                    and self.a.dtype in (torch.float16, torch.float32), (self.bits, self.a.shape, self.a.dtype)
            else:
                assert self.b is not None and self.b.shape == self.a.shape and self.b.is_contiguous()
        elif self.mode == MODE_VQ:
            vd = self.vq_dim
            width = self.bits * vd
            assert vd in VQ_DIMS and width in VQ_WIDTHS and self.n_in % vd == 0, (self.bits, vd, self.n_in)
            assert d.dtype == torch.uint8 and d.shape[2] == -(-self.n_in // vd * width // 8), \
                (d.dtype, d.shape, self.n_in, width)
            assert self.a.dtype == torch.float16 and self.a.is_contiguous() and self.a.shape == (E, 1 << width, vd), \
                (self.a.dtype, self.a.shape, E, width)
            assert self.b is not None and self.b.shape == (E, O) and self.b.is_contiguous() \
                and self.b.dtype in (torch.float16, torch.float32), "b: row scales fp16/fp32 [E, O]"
        elif self.mode == MODE_TCQ:
            words = 1 + self.bits * self.n_in // 32  # the lead word and the symbols
            assert d.dtype == torch.uint8 and self.n_in % 32 == 0 and d.shape[2] == 4 * words, \
                (d.dtype, d.shape, self.n_in, self.bits)
            assert self.a.shape == (E, O) and self.a.dtype == torch.float32 and self.a.is_contiguous() \
                and self.b is None, "a: row scales fp32 [E, O]"
        elif self.mode == MODE_FP8:
            assert d.dtype == torch.float8_e4m3fn and d.shape[2] == self.n_in, (d.dtype, d.shape)
            assert self.a.shape == (E, O) and self.a.dtype == torch.float32 and self.a.is_contiguous()
        else:
            assert d.dtype in (torch.bfloat16, torch.float16, torch.float32) and d.shape[2] == self.n_in

    def ptrs(self):
        """(data, a, b) for a launch; unused slots point at `data` (never read). TCQ data as int32 words."""
        d = self.data.view(torch.int32) if self.mode == MODE_TCQ else self.data
        return d, d if self.a is None else self.a, d if self.b is None else self.b

    def row_stride_a(self) -> int:
        return self.a.stride(1) if self.a is not None and self.mode in _GROUPED else 0

    def vq_words(self) -> bool:
        """MODE_VQ rows of whole word chunks (vq_chunk): the word-chunk GEMV applies."""
        cpc, _ = vq_chunk(self.bits * self.vq_dim)
        return self.mode == MODE_VQ and self.n_in % (cpc * self.vq_dim) == 0

    def vq_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes as int32 words, codebook as words of d fp16) for the word-chunk GEMV (vq_words() true):
        one load per code entry (int32 at d = 2, int64 at d = 4 and 8; fp16 itself at d = 1)."""
        vd = self.vq_dim
        cb = self.a if vd == 1 else self.a.view(torch.int32 if vd == 2 else torch.int64)
        return self.data.view(torch.int32), cb


def vq_chunk(width: int) -> tuple[int, int]:
    """(codes per chunk, int32 words per chunk) of a vq row in the word-chunk GEMV."""
    return (32 // width, 1) if 32 % width == 0 else (96 // width, 3)


def vq_static(w: QWeight, block_k: int, words: bool = True, gather: bool = False) -> dict:
    """Launch constexprs of a MODE_VQ matrix for gemv_chunks/dequant_tile: word chunks (VQF 1, or 2 with
    gather: codebook lookups by tl.gather, d ≤ 4 and K ≤ 256: the whole codebook goes through shared
    memory at every lookup, 32 KiB at K = 4096) where rows are whole chunks and `words`, C = inputs per
    chunk, BPC = int32 words per chunk; else byte codes (VQF 0) C = d, BPC = 1. BK: a power of two of
    whole chunks."""
    vd = w.vq_dim
    fast = words and w.vq_words()
    cpc, nw = vq_chunk(w.bits * vd)
    C, BPC = (cpc * vd, nw) if fast else (vd, 1)
    bk = pick_block_k(w.n_in, w.n_in, block_k, C)
    vqf = 0 if not fast else 2 if gather and vd <= 4 and w.bits * vd <= 8 else 1
    return dict(MODE=MODE_VQ, BITS=w.bits, C=C, BPC=BPC, G=1, GS=w.n_in, BK=bk, VD=vd, VQF=vqf)


def gated_act_ref(g: torch.Tensor, u: torch.Tensor, biases, e: int, act: str, limit: float) -> torch.Tensor:
    """The kernels' reference of biases + gated activation (fp32): model.expert_act's arithmetic."""
    if biases is not None:
        g, u = g + biases[0][e].float(), u + biases[1][e].float()
    if act == "silu":
        return torch.nn.functional.silu(g) * u
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g * torch.sigmoid(1.702 * g) * (u + 1)


def check_moe_args(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: QWeight, w3: QWeight,
                   w2: QWeight) -> tuple[int, int, int, int, int]:
    """Shape checks shared by the MoE launchers (decode and prefill) -> (N, D, A, E, I)."""
    N, D = x.shape
    A = ids.shape[1]
    E, I = w1.data.shape[:2]
    assert ids.shape == weights.shape == (N, A), (ids.shape, weights.shape, N, A)
    # one mode for the three; one width for w1 and w3 (one gate/up launch), w2's own (the down launch)
    assert w1.mode == w3.mode == w2.mode and w1.bits == w3.bits, "one mode for the three matrices, w1/w3 one width"
    assert w1.n_in == w3.n_in == D and w2.n_in == I, (w1.n_in, w2.n_in, D, I)
    w1.check(E, I)
    w3.check(E, I)
    w2.check(E, D)
    assert w1.a is None or (w1.a.shape == w3.a.shape and w1.a.stride() == w3.a.stride()), "w1/w3 layouts differ"
    return N, D, A, E, I


def tcq_asm(w: QWeight) -> bool:
    """MODE_TCQ on CUDA (not the interpreter): the GEMV takes the dp4a byte sum."""
    return w.mode == MODE_TCQ and w.data.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"


def codes_per_chunk(mode: int, bits: int) -> tuple[int, int]:
    """(codes per chunk, bytes per chunk) of a packed row (MODE_VQ: vq_static)."""
    assert mode != MODE_VQ, "vq chunks: vq_static"
    if mode in (MODE_FP8, MODE_DENSE):
        return 1, 1
    if mode == MODE_TCQ:  # 32 inputs: `bits` int32 words (the kernels read the codes as int32)
        return 32, bits
    return {2: (4, 1), 3: (8, 3), 4: (2, 1), 8: (1, 1)}[bits]  # 8: MODE_AFFINE int8 (codecs/intsym.py)


def use_words(w: QWeight) -> bool:
    """The word path of the GEMV (gemv_words): table codes with rows and groups of multiples of 32."""
    return w.mode == MODE_LUT and w.n_in % 32 == 0 and (w.n_in // w.groups) % 32 == 0


def pick_block_k(n_in: int, group: int, cap: int, per: int) -> int:
    """Inputs per tile: a power of two ≥ 16 (and ≥ one chunk) that never straddles a group of `group`
    inputs (group == n_in: one group per row)."""
    bk = min(cap, max(16, triton.next_power_of_2(n_in)))
    if group < n_in:
        bk = min(bk, group & -group)  # largest power of two dividing the group size
    assert bk >= max(per, 16) and (group >= n_in or group % bk == 0), \
        f"group size {group} must be a multiple of {max(per, 16)} for the fused kernels"
    return bk


# the experts' gated activation (runtime/model.expert_act): ACT 0 silu(g)·u, ACT 1 gpt-oss's clamped SwiGLU
ACT_SILU, ACT_CLAMPED_SWIGLU = 0, 1
EXPERT_ACT_IDS = {"silu": ACT_SILU, "clamped_swiglu": ACT_CLAMPED_SWIGLU}


@triton.jit
def gated_act(g, u, ACT: tl.constexpr, LIMIT: tl.constexpr):
    if ACT == 1:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        return g / (1.0 + tl.exp(-1.702 * g)) * (u + 1.0)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _bit(v, pos: tl.constexpr):
    if pos == 31:  # int32 sign bit (1 << 31 is no int32 constant)
        r = v < 0
    else:
        r = (v & (1 << pos)) != 0
    return r


@triton.jit
def _sel4(v, sh: tl.constexpr, c0, c1, c2, c3):
    b0 = _bit(v, sh)
    return tl.where(_bit(v, sh + 1), tl.where(b0, c3, c2), tl.where(b0, c1, c0))


@triton.jit
def _sel8(v, sh: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7):
    return tl.where(_bit(v, sh + 2), _sel4(v, sh, c4, c5, c6, c7), _sel4(v, sh, c0, c1, c2, c3))


@triton.jit
def _lut_entry(lrow, i: tl.constexpr, mask_o):
    return tl.load(lrow + i, mask=mask_o, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _table(lrow, mask_o, MODE: tl.constexpr, BITS: tl.constexpr):
    """The 2^BITS table entries [BO, 1] of each row's current group, loaded once per tile (16 values
    always returned; entries past 2^BITS, and all of them outside MODE_LUT, alias the first)."""
    if MODE == 0:
        c0 = _lut_entry(lrow, 0, mask_o)
    else:
        c0 = tl.zeros((lrow.shape[0], 1), tl.float32)
    c1 = c0
    c2 = c0
    c3 = c0
    c4 = c0
    c5 = c0
    c6 = c0
    c7 = c0
    c8 = c0
    c9 = c0
    c10 = c0
    c11 = c0
    c12 = c0
    c13 = c0
    c14 = c0
    c15 = c0
    if MODE == 0:
        c1 = _lut_entry(lrow, 1, mask_o)
        c2 = _lut_entry(lrow, 2, mask_o)
        c3 = _lut_entry(lrow, 3, mask_o)
        if BITS >= 3:
            c4 = _lut_entry(lrow, 4, mask_o)
            c5 = _lut_entry(lrow, 5, mask_o)
            c6 = _lut_entry(lrow, 6, mask_o)
            c7 = _lut_entry(lrow, 7, mask_o)
        if BITS == 4:
            c8 = _lut_entry(lrow, 8, mask_o)
            c9 = _lut_entry(lrow, 9, mask_o)
            c10 = _lut_entry(lrow, 10, mask_o)
            c11 = _lut_entry(lrow, 11, mask_o)
            c12 = _lut_entry(lrow, 12, mask_o)
            c13 = _lut_entry(lrow, 13, mask_o)
            c14 = _lut_entry(lrow, 14, mask_o)
            c15 = _lut_entry(lrow, 15, mask_o)
    return c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15


@triton.jit
def _e2m1(q):
    """fp32 value of the e2m1 pattern in the low 4 bits of q (int32): magnitudes m = 2..7 are the fp32
    1.0·2^0 .. 1.5·2^2 whose exponent and mantissa bits are m's own (bits (m + 252) << 22), m = 0, 1 the
    subnormals 0 and 0.5; bit 3 the sign."""
    m = q & 7
    mag = tl.where(m >= 2, ((m + 252) << 22).to(tl.float32, bitcast=True), m.to(tl.float32) * 0.5)
    return tl.where((q & 8) != 0, -mag, mag)


@triton.jit
def _decode(v, s: tl.constexpr, a_row, b_row, mask_o, MODE: tl.constexpr, BITS: tl.constexpr,
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """Weights [BO, n] of code slot s of the packed words v [BO, n] (int32): table entries c0.. (MODE_LUT,
    from _table) or each row's scale/zero of the current group at a_row/b_row (MODE_AFFINE)."""
    sh: tl.constexpr = s * BITS
    if MODE == 1:  # affine: zero + scale · idx
        q = ((v >> sh) & ((1 << BITS) - 1)).to(tl.float32)
        sc = tl.load(a_row, mask=mask_o, other=0.0).to(tl.float32)[:, None]
        z = tl.load(b_row, mask=mask_o, other=0.0).to(tl.float32)[:, None]
        w = z + sc * q
    elif BITS == 2:
        w = _sel4(v, sh, c0, c1,
                  c2, c3)
    elif BITS == 3:
        w = _sel8(v, sh, c0, c1,
                  c2, c3,
                  c4, c5,
                  c6, c7)
    else:  # 4-bit table: two 8-way trees keyed by the top bit
        lo = _sel8(v, sh, c0, c1,
                   c2, c3,
                   c4, c5,
                   c6, c7)
        hi = _sel8(v, sh, c8, c9,
                   c10, c11,
                   c12, c13,
                   c14, c15)
        w = tl.where(_bit(v, sh + 3), hi, lo)
    return w


@triton.jit
def _load_words(w_ptr, offs_o, mask_o, stride_wo, cidx, n_chunks, BPC: tl.constexpr):
    """Packed chunks [BO, len(cidx)] as int32 (3-bit: the 24-bit little-endian word of 3 bytes)."""
    m = mask_o[:, None] & (cidx < n_chunks)[None, :]
    p = w_ptr + offs_o[:, None] * stride_wo + (cidx * BPC)[None, :]
    v = tl.load(p, mask=m, other=0).to(tl.int32)
    if BPC == 3:
        v = v | (tl.load(p + 1, mask=m, other=0).to(tl.int32) << 8) \
            | (tl.load(p + 2, mask=m, other=0).to(tl.int32) << 16)
    return v


@triton.jit
def _group_ptrs(a_ptr, b_ptr, offs_o, stride_ao, k0, G: tl.constexpr, GS: tl.constexpr, K: tl.constexpr):
    """Per-row pointers to the current group's lut entries (a_ptr = lut, stride_ao per row) or scale/zero."""
    g = 0 if G == 1 else k0 // GS
    return a_ptr + offs_o * stride_ao + g * K, a_ptr + offs_o * stride_ao + g, b_ptr + offs_o * stride_ao + g


@triton.jit
def _tcq_state(v0, v1, v2, v3, v4, s: tl.constexpr, BITS: tl.constexpr):
    """The 12-bit trellis state of input s (0..31) of a chunk: the stream bits [lo, lo + 12) of the words
    v0 (the word before the chunk), v1.. (the chunk's BITS words) as uint32, lo = 32 + BITS·(s + 1) − 12."""
    lo: tl.constexpr = _TCQ_LEAD + BITS * (s + 1) - _TCQ_L
    a: tl.constexpr = lo // 32
    off: tl.constexpr = lo % 32
    if a == 0:
        w = v0
        nxt = v1
    elif a == 1:
        w = v1
        nxt = v2
    elif a == 2:
        w = v2
        nxt = v3
    elif a == 3:
        w = v3
        nxt = v4
    else:  # the chunk's last word (4-bit): no window reaches past it
        w = v4
        nxt = v4
    if off + _TCQ_L <= 32:
        st = (w >> off) & _TCQ_MASK
    else:  # the window straddles two words
        st = ((w >> off) | (nxt << (32 - off))) & _TCQ_MASK
    return st


# The byte sum as one PTX dp4a (four byte products with 1, summed onto 0x4B000000: the fp32 bits of 2^23 + sum,
# so one FADD of −(2^23 + 510) gives the centred code exactly, without an int-to-float conversion).
TCQ_DP4A = tl.constexpr("dp4a.u32.u32 $0, $1, 16843009, 1258291200;")


@triton.jit
def _tcq_code(st, ASM: tl.constexpr = False):
    """(byte sum of 34038481·st + 76625530 mod 2^32) − 510 as fp32 (st uint32): runtime/tcq.code_of times 128.
    ASM (CUDA): the byte sum by dp4a; else shifts and masks (the interpreter's path; the same value)."""
    x = st * 34038481 + 76625530
    if ASM:
        bits = tl.inline_asm_elementwise(asm=TCQ_DP4A, constraints="=r,r", args=[x], dtype=tl.uint32, is_pure=True,
                                         pack=1)
        code = bits.to(tl.float32, bitcast=True) - 8389118.0
    else:
        y = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)
        code = ((y & 0xFFFF) + (y >> 16)).to(tl.float32) - 510.0
    return code


@triton.jit
def load_x(x_ptr, k, n_in, GATED: tl.constexpr = False):
    """x[k] as fp32, 0 at k >= n_in. GATED: x_ptr is a fused gate/up row [g | u] of 2·n_in and the value is
    silu(g)·u rounded as fused_decode.silu_mul rounds it (silu in fp32 rounded to g's dtype, the product rounded
    again): a shared expert's activation read by its down GEMV, one launch a layer fewer, the same numbers."""
    m = k < n_in
    if GATED:
        g = tl.load(x_ptr + k, mask=m, other=0.0)
        u = tl.load(x_ptr + n_in + k, mask=m, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        sg = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        return (sg * u).to(g.dtype).to(tl.float32)
    return tl.load(x_ptr + k, mask=m, other=0.0).to(tl.float32)


@triton.jit
def gemv_chunks(acc, w_ptr, a_ptr, b_ptr, x_ptr, offs_o, mask_o, stride_wo, stride_ao, k0, n_in,
                MODE: tl.constexpr, BITS: tl.constexpr, C: tl.constexpr, BPC: tl.constexpr,
                G: tl.constexpr, GS: tl.constexpr, BKC: tl.constexpr, VD: tl.constexpr = 1,
                VQF: tl.constexpr = 0, ASM: tl.constexpr = False, GATED: tl.constexpr = False):
    """acc [BO, BKC] += w·x over inputs [k0, k0 + BKC·C) of rows offs_o (x: fp32/bf16 vector). MODE_VQ:
    gemv_vq with a_ptr the codebook (VD, VQF: vq_static), row scales left to the caller. ASM: MODE_TCQ's
    byte sums by PTX dp4a (CUDA; tcq_asm). GATED: x is a fused gate/up row [g | u] (load_x; not MODE_VQ)."""
    cidx = k0 // C + tl.arange(0, BKC)
    n_chunks = (n_in + C - 1) // C
    if MODE == 4:
        acc = gemv_vq(acc, w_ptr, a_ptr, x_ptr, offs_o, mask_o, stride_wo, k0, n_in, BITS * VD, VD, C, BPC,
                      BKC, VQF)
    elif MODE == 2 or MODE == 3:  # fp8 / dense: one weight per chunk
        m = mask_o[:, None] & (cidx < n_in)[None, :]
        w = tl.load(w_ptr + offs_o[:, None] * stride_wo + cidx[None, :], mask=m, other=0.0).to(tl.float32)
        acc += w * load_x(x_ptr, cidx, n_in, GATED)[None, :]
    elif MODE == 6:  # tcq: a chunk is BITS words of 32 symbols (w_ptr int32), read with the word before it
        m = mask_o[:, None] & (cidx < n_chunks)[None, :]
        p = w_ptr + offs_o[:, None] * stride_wo + (cidx * BITS)[None, :]
        v0 = tl.load(p, mask=m, other=0).to(tl.uint32, bitcast=True)  # the previous chunk's last word
        v1 = tl.load(p + 1, mask=m, other=0).to(tl.uint32, bitcast=True)
        v2 = tl.load(p + 2, mask=m, other=0).to(tl.uint32, bitcast=True)
        v3 = v2
        v4 = v2
        if BITS >= 3:
            v3 = tl.load(p + 3, mask=m, other=0).to(tl.uint32, bitcast=True)
        if BITS == 4:
            v4 = tl.load(p + 4, mask=m, other=0).to(tl.uint32, bitcast=True)
        for s in tl.static_range(C):
            k = cidx * C + s
            xs = load_x(x_ptr, k, n_in, GATED)
            acc += _tcq_code(_tcq_state(v0, v1, v2, v3, v4, s, BITS), ASM) * xs[None, :]
    elif MODE == 5:  # fp4: a byte of two codes per chunk, each chunk's block scale loaded beside it (a tile
        # may span blocks, so the tile width is not bound to the 16/32-input block)
        v = _load_words(w_ptr, offs_o, mask_o, stride_wo, cidx, n_chunks, 1)
        m = mask_o[:, None] & (cidx < n_chunks)[None, :]
        sc = tl.load(a_ptr + offs_o[:, None] * stride_ao + (cidx * C // GS)[None, :], mask=m, other=0.0)
        sc = sc.to(tl.float32)
        for s in tl.static_range(C):
            k = cidx * C + s
            xs = load_x(x_ptr, k, n_in, GATED)
            acc += _e2m1(v >> (4 * s)) * sc * xs[None, :]
    else:
        v = _load_words(w_ptr, offs_o, mask_o, stride_wo, cidx, n_chunks, BPC)
        lrow, a_row, b_row = _group_ptrs(a_ptr, b_ptr, offs_o, stride_ao, k0, G, GS, 1 << BITS)
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _table(lrow, mask_o, MODE, BITS)
        for s in tl.static_range(C):
            k = cidx * C + s
            xs = load_x(x_ptr, k, n_in, GATED)
            acc += _decode(v, s, a_row, b_row, mask_o, MODE, BITS,
                           c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15) * xs[None, :]
    return acc


# ---- vq: vector codebooks (MODE_VQ) ---------------------------------------------------------------------

@triton.jit
def _vq_codes_bytes(w_ptr, offs_o, mask_o, stride_wo, j, n_codes, W: tl.constexpr):
    """Codes j [BJ] of rows offs_o as int32 [BO, BJ], read from the byte(s) holding bits [W·j, W·j + W)
    (w_ptr: uint8 codes; 0 outside the matrix). Widths dividing 8 never straddle a byte; the others
    (3, 6, 12) span at most two, the second read only where the code reaches into it."""
    m = mask_o[:, None] & (j < n_codes)[None, :]
    pos = j * W
    p = w_ptr + offs_o[:, None] * stride_wo + (pos >> 3)[None, :]
    v = tl.load(p, mask=m, other=0).to(tl.int32)
    if 8 % W != 0:
        two = ((pos + W - 1) >> 3) > (pos >> 3)
        v = v | (tl.load(p + 1, mask=m & two[None, :], other=0).to(tl.int32) << 8)
    return (v >> (pos & 7)[None, :]) & ((1 << W) - 1)


@triton.jit
def _word3(v0, v1, v2, q: tl.constexpr):
    if q == 0:
        r = v0
    elif q == 1:
        r = v1
    else:
        r = v2
    return r


@triton.jit
def _vq_field(v0, v1, v2, s: tl.constexpr, W: tl.constexpr):
    """Code s of a chunk held in int32 words v0..v2 (little-endian bit string; constant shifts and masks;
    the masks drop the sign bits an arithmetic shift brings in)."""
    p: tl.constexpr = s * W
    q: tl.constexpr = p // 32
    sh: tl.constexpr = p % 32
    lo = _word3(v0, v1, v2, q)
    if sh + W <= 32:
        c = (lo >> sh) & ((1 << W) - 1)
    else:  # straddles words q and q + 1
        nlo: tl.constexpr = 32 - sh
        hi = _word3(v0, v1, v2, q + 1)
        c = ((lo >> sh) & ((1 << nlo) - 1)) | ((hi & ((1 << (W - nlo)) - 1)) << nlo)
    return c


@triton.jit
def _half(word, a: tl.constexpr):
    """fp16 number a (0..3) of an int32/int64 word, as fp32."""
    return ((word >> (16 * a)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _vq_fma(acc, cb_ptr, cbv, code, x_ptr, k, n_in, VD: tl.constexpr, WIDE: tl.constexpr, GATHER: tl.constexpr):
    """acc [BO, BJ] += Σ_a cb[code, a] · x[k + a] (k [BJ]: first input of each code). WIDE: cb_ptr is the
    codebook in words of d fp16 (QWeight.vq_views), one load per code (two at d = 8); else fp16, d loads.
    GATHER (d ≤ 4): the entries come from cbv [K], the codebook words in registers, by tl.gather."""
    if GATHER:
        BO: tl.constexpr = code.shape[0]
        BJ: tl.constexpr = code.shape[1]
        ent = tl.reshape(tl.gather(cbv, tl.reshape(code, (BO * BJ,)), 0), (BO, BJ))
        for a in tl.static_range(VD):
            if VD == 1:
                h = ent.to(tl.float32)
            else:
                h = _half(ent, a)
            xs = tl.load(x_ptr + k + a, mask=k + a < n_in, other=0.0).to(tl.float32)
            acc += h * xs[None, :]
    elif WIDE and VD >= 2:
        if VD == 8:
            e0 = tl.load(cb_ptr + code * 2)
            e1 = tl.load(cb_ptr + code * 2 + 1)
        else:
            e0 = tl.load(cb_ptr + code)
            e1 = e0
        for a in tl.static_range(VD):
            if a < 4:
                h = _half(e0, a)
            else:
                h = _half(e1, a - 4)
            xs = tl.load(x_ptr + k + a, mask=k + a < n_in, other=0.0).to(tl.float32)
            acc += h * xs[None, :]
    else:
        for a in tl.static_range(VD):
            h = tl.load(cb_ptr + code * VD + a).to(tl.float32)
            xs = tl.load(x_ptr + k + a, mask=k + a < n_in, other=0.0).to(tl.float32)
            acc += h * xs[None, :]
    return acc


@triton.jit
def gemv_vq(acc, w_ptr, cb_ptr, x_ptr, offs_o, mask_o, stride_wo, k0, n_in, W: tl.constexpr, VD: tl.constexpr,
            C: tl.constexpr, NW: tl.constexpr, BKC: tl.constexpr, VQF: tl.constexpr):
    """acc [BO, BKC] += Σ cb[code]·x over inputs [k0, k0 + BKC·C) of rows offs_o (no row scale). VQF: word
    chunks (w_ptr: codes as int32, stride_wo in words; cb_ptr: QWeight.vq_views' codebook; C = CPC·d
    inputs in NW words per chunk, rows of whole chunks). Else byte codes (w_ptr uint8, cb_ptr fp16, C = d):
    one code per acc column. VQF = 2: word chunks with the codebook looked up by tl.gather. Codes outside
    the matrix read 0, a valid codebook row, against x = 0."""
    cidx = k0 // C + tl.arange(0, BKC)
    if VQF == 2:  # the whole codebook once per call: K words (K = 2^W)
        cbv = tl.load(cb_ptr + tl.arange(0, 1 << W))
    else:
        cbv = tl.zeros((1,), tl.int32)  # unused
    if VQF >= 1:
        CPC: tl.constexpr = C // VD
        m = mask_o[:, None] & (cidx < n_in // C)[None, :]
        p = w_ptr + offs_o[:, None] * stride_wo + (cidx * NW)[None, :]
        v0 = tl.load(p, mask=m, other=0)
        v1 = v0
        v2 = v0
        if NW == 3:
            v1 = tl.load(p + 1, mask=m, other=0)
            v2 = tl.load(p + 2, mask=m, other=0)
        for s in tl.static_range(CPC):
            acc = _vq_fma(acc, cb_ptr, cbv, _vq_field(v0, v1, v2, s, W), x_ptr, cidx * C + s * VD, n_in, VD, True,
                          VQF == 2)
    else:
        code = _vq_codes_bytes(w_ptr, offs_o, mask_o, stride_wo, cidx, n_in // VD, W)
        acc = _vq_fma(acc, cb_ptr, cbv, code, x_ptr, cidx * VD, n_in, VD, False, False)
    return acc


@triton.jit
def _wbit(v0, v1, v2, v3, pos: tl.constexpr):
    """Bit `pos` of the 128-bit little-endian word v0..v3 (int32 tiles), as a predicate."""
    if pos < 32:
        r = _bit(v0, pos)
    elif pos < 64:
        r = _bit(v1, pos - 32)
    elif pos < 96:
        r = _bit(v2, pos - 64)
    else:
        r = _bit(v3, pos - 96)
    return r


@triton.jit
def _wsel(v0, v1, v2, v3, s: tl.constexpr, BITS: tl.constexpr,
          c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """Table entry of code s of a 32-code chunk held in BITS int32 words (bit-test tree)."""
    p: tl.constexpr = s * BITS
    b0 = _wbit(v0, v1, v2, v3, p)
    b1 = _wbit(v0, v1, v2, v3, p + 1)
    if BITS == 2:
        w = tl.where(b1, tl.where(b0, c3, c2),
                     tl.where(b0, c1, c0))
    else:
        b2 = _wbit(v0, v1, v2, v3, p + 2)
        lo = tl.where(b2, tl.where(b1, tl.where(b0, c7, c6),
                                   tl.where(b0, c5, c4)),
                      tl.where(b1, tl.where(b0, c3, c2),
                               tl.where(b0, c1, c0)))
        if BITS == 4:
            b3 = _wbit(v0, v1, v2, v3, p + 3)
            hi = tl.where(b2, tl.where(b1, tl.where(b0, c15, c14),
                                       tl.where(b0, c13, c12)),
                          tl.where(b1, tl.where(b0, c11, c10),
                                   tl.where(b0, c9, c8)))
            w = tl.where(b3, hi, lo)
        else:
            w = lo
    return w


@triton.jit
def gemv_words(acc, w_ptr, a_ptr, b_ptr, x_ptr, offs_o, mask_o, stride_wo, stride_ao, k0, n_in,
               BITS: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, BKC: tl.constexpr, POLY: tl.constexpr):
    """MODE_LUT with n_in % 32 == 0: like gemv_chunks, but a chunk is 32 codes = BITS int32 words
    (w_ptr: the codes viewed as int32, stride_wo in words) and each code is selected by bit tests on
    the words directly (no byte extraction, no shifts; 3-bit codes may straddle words, bits do not)."""
    cidx = k0 // 32 + tl.arange(0, BKC)
    m = mask_o[:, None] & (cidx < n_in // 32)[None, :]
    p = w_ptr + offs_o[:, None] * stride_wo + (cidx * BITS)[None, :]
    v0 = tl.load(p, mask=m, other=0)
    v1 = tl.load(p + 1, mask=m, other=0)
    v2 = v0
    v3 = v0
    if BITS >= 3:
        v2 = tl.load(p + 2, mask=m, other=0)
    if BITS == 4:
        v3 = tl.load(p + 3, mask=m, other=0)
    g = 0 if G == 1 else k0 // GS
    if POLY:  # 2-bit tables as cubics in b_ptr (experts.lut_poly): FMA-pipe decode
        pa, pb, pc, pd = _poly_coefs(b_ptr + offs_o * stride_ao + g * 4, mask_o)
        for s in tl.static_range(32):
            xs = tl.load(x_ptr + cidx * 32 + s, mask=cidx * 32 + s < n_in, other=0.0).to(tl.float32)
            acc += _poly_code(v0, v1, s, pa, pb, pc, pd) * xs[None, :]
    else:
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = \
            _table(a_ptr + offs_o * stride_ao + g * (1 << BITS), mask_o, 0, BITS)
        for s in tl.static_range(32):
            xs = tl.load(x_ptr + cidx * 32 + s, mask=cidx * 32 + s < n_in, other=0.0).to(tl.float32)
            acc += _wsel(v0, v1, v2, v3, s, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15) * xs[None, :]
    return acc


@triton.jit
def _poly_code(v0, v1, s: tl.constexpr, pa, pb, pc, pd):
    """Weight of 2-bit code s (0..31) of a chunk held in v0, v1 through its table's cubic (pa..pd [BO, 1]):
    q as a float with one logic op and one FFMA (2^23 + q·2^pos built in the mantissa, then scaled and
    shifted back exactly), then Horner. Everything but the logic op runs on the FMA pipe, which issues
    twice as fast as the integer/select pipe the bit-test tree needs."""
    j: tl.constexpr = s % 16
    if s < 16:
        word = v0
    else:
        word = v1
    if j < 8:
        src = word
    else:
        src = word >> 16  # (sign bits from the arithmetic shift are masked off below)
    pos: tl.constexpr = 2 * (j % 8)
    f = ((src & (3 << pos)) | 0x4B000000).to(tl.float32, bitcast=True)
    q = f * (1.0 / (1 << pos)) - (8388608.0 / (1 << pos))
    return ((pd * q + pc) * q + pb) * q + pa


@triton.jit
def _poly_coefs(p_row, mask_o):
    return (_lut_entry(p_row, 0, mask_o), _lut_entry(p_row, 1, mask_o), _lut_entry(p_row, 2, mask_o),
            _lut_entry(p_row, 3, mask_o))


@triton.jit
def gemv_words2(acc_g, acc_u, w1_ptr, a1_ptr, b1_ptr, w3_ptr, a3_ptr, b3_ptr, x_ptr, offs_o, mask_o, stride_wo,
                stride_ao, k0, n_in, BITS: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, BKC: tl.constexpr,
                POLY: tl.constexpr):
    """gemv_words for two matrices of one layout against the same x (gate and up): x slices load once."""
    cidx = k0 // 32 + tl.arange(0, BKC)
    m = mask_o[:, None] & (cidx < n_in // 32)[None, :]
    off = offs_o[:, None] * stride_wo + (cidx * BITS)[None, :]
    g0 = tl.load(w1_ptr + off, mask=m, other=0)
    g1 = tl.load(w1_ptr + off + 1, mask=m, other=0)
    u0 = tl.load(w3_ptr + off, mask=m, other=0)
    u1 = tl.load(w3_ptr + off + 1, mask=m, other=0)
    g2 = g0
    u2 = u0
    g3 = g0
    u3 = u0
    if BITS >= 3:
        g2 = tl.load(w1_ptr + off + 2, mask=m, other=0)
        u2 = tl.load(w3_ptr + off + 2, mask=m, other=0)
    if BITS == 4:
        g3 = tl.load(w1_ptr + off + 3, mask=m, other=0)
        u3 = tl.load(w3_ptr + off + 3, mask=m, other=0)
    g = 0 if G == 1 else k0 // GS
    if POLY:
        pa, pb, pc, pd = _poly_coefs(b1_ptr + offs_o * stride_ao + g * 4, mask_o)
        qa, qb, qc, qd = _poly_coefs(b3_ptr + offs_o * stride_ao + g * 4, mask_o)
        for s in tl.static_range(32):
            if n_in % (BKC * 32) == 0:
                xs = tl.load(x_ptr + cidx * 32 + s).to(tl.float32)[None, :]
            else:
                xs = tl.load(x_ptr + cidx * 32 + s, mask=cidx * 32 + s < n_in, other=0.0).to(tl.float32)[None, :]
            acc_g += _poly_code(g0, g1, s, pa, pb, pc, pd) * xs
            acc_u += _poly_code(u0, u1, s, qa, qb, qc, qd) * xs
    else:
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = \
            _table(a1_ptr + offs_o * stride_ao + g * (1 << BITS), mask_o, 0, BITS)
        d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15 = \
            _table(a3_ptr + offs_o * stride_ao + g * (1 << BITS), mask_o, 0, BITS)
        for s in tl.static_range(32):
            if n_in % (BKC * 32) == 0:  # no tail: unmasked x loads (fewer address ops)
                xs = tl.load(x_ptr + cidx * 32 + s).to(tl.float32)[None, :]
            else:
                xs = tl.load(x_ptr + cidx * 32 + s, mask=cidx * 32 + s < n_in, other=0.0).to(tl.float32)[None, :]
            acc_g += _wsel(g0, g1, g2, g3, s, BITS,
                           c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15) * xs
            acc_u += _wsel(u0, u1, u2, u3, s, BITS,
                           d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15) * xs
    return acc_g, acc_u


# ---- fp4 (e2m1) codes read as int32 words ----------------------------------------------------------------
# MODE_FP4's codes are U4X2 bytes in natural order, so int32 word w of a row holds inputs 8w .. 8w + 7, input
# 8w + j in bits 4j .. 4j + 3. A chunk is 4 words, 32 inputs: one mxfp4 block (or two nvfp4 blocks of 16), so a
# chunk loads its block scale once, not once per byte as gemv_chunks's MODE 5 branch does. A code decodes with
# integer shifts and masks and one exact multiply instead of compares and selects (_fp4_word).


def use_fp4_words(w: QWeight) -> bool:
    """The word path of the fp4 GEMV (gemv_fp4_words): rows of whole 32-input chunks whose block scales cover 16
    inputs or a multiple of 32 (nvfp4, mxfp4)."""
    gs = w.n_in // w.groups
    return w.mode == MODE_FP4 and w.n_in % 32 == 0 and (gs == 16 or gs % 32 == 0)


@triton.jit
def _fp4_word(v, j: tl.constexpr):
    """fp32 value of nibble j (0..7) of the int32 words v, an e2m1 pattern: its magnitude bits m at an fp32's
    bits 22..24 read as e2m1(m)·2^-126 (exponent field m >> 1, mantissa bit m & 1; m = 1 the subnormal
    0.5·2^-126), its sign bit at bit 31; the power-of-two product is exact (the GPU's fp32 multiply keeps
    subnormal inputs: Triton emits mul.f32, not its .ftz form)."""
    q = v >> (4 * j)
    bits = ((q & 7) << 22) | ((q & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def _fp4_chunk_dot(v0, v1, v2, v3, x_ptr, base, xmask, sc_lo, sc_hi, HALF: tl.constexpr):
    """Σ over a chunk's 32 inputs of e2m1(code)·x times its block scale(s), [BO, BKC]: sc_lo for all 32 (HALF
    False) or for the first 16 and sc_hi for the last 16 (HALF: nvfp4's 16-input blocks)."""
    lo = tl.zeros(v0.shape, dtype=tl.float32)
    hi = tl.zeros(v0.shape, dtype=tl.float32)
    for s in tl.static_range(32):
        xs = tl.load(x_ptr + base + s, mask=xmask, other=0.0).to(tl.float32)[None, :]
        if s < 8:
            word = v0
        elif s < 16:
            word = v1
        elif s < 24:
            word = v2
        else:
            word = v3
        if HALF and s >= 16:
            hi += _fp4_word(word, s % 8) * xs
        else:
            lo += _fp4_word(word, s % 8) * xs
    if HALF:
        return lo * sc_lo + hi * sc_hi
    return lo * sc_lo


@triton.jit
def _fp4_chunk_loads(w_ptr, a_ptr, offs_o, mask_o, stride_wo, stride_ao, k0, n_in, GS: tl.constexpr,
                     BKC: tl.constexpr):
    """Chunks k0 / 32 .. + BKC of rows offs_o: their 4 words [BO, BKC] each (w_ptr: the codes viewed as int32,
    stride_wo in words), block scales (lo, hi) [BO, BKC] fp32, and the chunks' first input and mask [BKC]."""
    cidx = k0 // 32 + tl.arange(0, BKC)
    live = cidx < n_in // 32
    m = mask_o[:, None] & live[None, :]
    p = w_ptr + offs_o[:, None] * stride_wo + (cidx * 4)[None, :]
    v0 = tl.load(p, mask=m, other=0)
    v1 = tl.load(p + 1, mask=m, other=0)
    v2 = tl.load(p + 2, mask=m, other=0)
    v3 = tl.load(p + 3, mask=m, other=0)
    sp = a_ptr + offs_o[:, None] * stride_ao + (cidx * 32 // GS)[None, :]
    sc_lo = tl.load(sp, mask=m, other=0.0).to(tl.float32)
    sc_hi = sc_lo
    if GS == 16:
        sc_hi = tl.load(sp + 1, mask=m, other=0.0).to(tl.float32)
    return v0, v1, v2, v3, sc_lo, sc_hi, cidx * 32, live


@triton.jit
def gemv_fp4_words(acc, w_ptr, a_ptr, x_ptr, offs_o, mask_o, stride_wo, stride_ao, k0, n_in, GS: tl.constexpr,
                   BKC: tl.constexpr):
    """acc [BO, BKC] += w·x over inputs [k0, k0 + 32·BKC) for MODE_FP4 rows that use_fp4_words accepts."""
    v0, v1, v2, v3, sc_lo, sc_hi, base, live = _fp4_chunk_loads(w_ptr, a_ptr, offs_o, mask_o, stride_wo, stride_ao,
                                                                k0, n_in, GS, BKC)
    return acc + _fp4_chunk_dot(v0, v1, v2, v3, x_ptr, base, live, sc_lo, sc_hi, GS == 16)


@triton.jit
def gemv_fp4_words2(acc_g, acc_u, w1_ptr, a1_ptr, w3_ptr, a3_ptr, x_ptr, offs_o, mask_o, stride_wo, stride_ao, k0,
                    n_in, GS: tl.constexpr, BKC: tl.constexpr):
    """gemv_fp4_words for gate and up (one layout, the same x)."""
    g0, g1, g2, g3, gs_lo, gs_hi, base, live = _fp4_chunk_loads(w1_ptr, a1_ptr, offs_o, mask_o, stride_wo,
                                                                stride_ao, k0, n_in, GS, BKC)
    u0, u1, u2, u3, us_lo, us_hi, base, live = _fp4_chunk_loads(w3_ptr, a3_ptr, offs_o, mask_o, stride_wo,
                                                                stride_ao, k0, n_in, GS, BKC)
    g_lo = tl.zeros(g0.shape, dtype=tl.float32)
    g_hi = tl.zeros(g0.shape, dtype=tl.float32)
    u_lo = tl.zeros(g0.shape, dtype=tl.float32)
    u_hi = tl.zeros(g0.shape, dtype=tl.float32)
    for s in tl.static_range(32):  # one x load for both matrices
        xs = tl.load(x_ptr + base + s, mask=live, other=0.0).to(tl.float32)[None, :]
        if s < 8:
            gw = g0
            uw = u0
        elif s < 16:
            gw = g1
            uw = u1
        elif s < 24:
            gw = g2
            uw = u2
        else:
            gw = g3
            uw = u3
        if GS == 16 and s >= 16:
            g_hi += _fp4_word(gw, s % 8) * xs
            u_hi += _fp4_word(uw, s % 8) * xs
        else:
            g_lo += _fp4_word(gw, s % 8) * xs
            u_lo += _fp4_word(uw, s % 8) * xs
    if GS == 16:
        return acc_g + g_lo * gs_lo + g_hi * gs_hi, acc_u + u_lo * us_lo + u_hi * us_hi
    return acc_g + g_lo * gs_lo, acc_u + u_lo * us_lo


# ---- 2-bit tables through PTX prmt (CUDA): ~2 instructions per code -------------------------------------
# A row's 2-bit codes are read as int32 words of 16 codes (U2X4: byte b of the word holds inputs 4b..4b+3,
# input 4b + j in bits 2j, 2j+1). A prmt selector for two weights is sel(c, c') = 0x22·(c | c' << 8) + 0x1010:
# its nibbles (2c, 2c + 1, 2c', 2c' + 1) pick the two bytes of fp16 table entries c and c' out of the 8-byte
# pool {entry0 | entry1 << 16, entry2 | entry3 << 16} (the row's fp16 table viewed as two int32), so each
# prmt yields two fp16 weights, multiplied by two fp16 activations with one fma.f16x2. Field j of the four
# bytes gives two selectors (bytes 0,1 and bytes 2,3): m = ((w >> 2j) & 0x03030303) | 0x78f0f4 (one LOP3 masks
# the field and ORs in a constant), s0 = m·0x22 + 0xfa8 (one IMAD), s1 = s0 >> 16. The constants make the
# selectors' low halves c·0x22 + 0x1010 (0xf0f4·0x22 + 0xfa8 = 0x201010; the high half gains 0x78·0x22 + the
# carry 0x20 = 0x1010), no carries between bytes (every raw selector <= 0x7676). Per word: 8 prmt, 8 HFMA2,
# 4 IMAD, 4 LOP3, 7 shifts, then the fp16x2 partial (8 products per half) is converted and summed in fp32, so the
# reduction over the row stays fp32. s1 was a multiply-high, hi(m·0x220000), until 2026-12-06: the same bits, but
# Hopper issues IMAD.HI at a quarter of the rate of SHF (benchmarks/studies/int_pipe_throughput.py).
PRMT_ASM = tl.constexpr("""{
.reg .b32 m, t, s0, s1, p, acc;
.reg .b16 ha, hb;
.reg .f32 fa, fb;
lop3.b32 m, $1, 0x03030303, 0x78f0f4, 0xEA;
mad.lo.u32 s0, m, 0x22, 0xfa8;
shr.b32 s1, s0, 16;
prmt.b32 p, $2, $3, s0;
mul.rn.f16x2 acc, p, $4;
prmt.b32 p, $2, $3, s1;
fma.rn.f16x2 acc, p, $5, acc;
shr.b32 t, $1, 2;
lop3.b32 m, t, 0x03030303, 0x78f0f4, 0xEA;
mad.lo.u32 s0, m, 0x22, 0xfa8;
shr.b32 s1, s0, 16;
prmt.b32 p, $2, $3, s0;
fma.rn.f16x2 acc, p, $6, acc;
prmt.b32 p, $2, $3, s1;
fma.rn.f16x2 acc, p, $7, acc;
shr.b32 t, $1, 4;
lop3.b32 m, t, 0x03030303, 0x78f0f4, 0xEA;
mad.lo.u32 s0, m, 0x22, 0xfa8;
shr.b32 s1, s0, 16;
prmt.b32 p, $2, $3, s0;
fma.rn.f16x2 acc, p, $8, acc;
prmt.b32 p, $2, $3, s1;
fma.rn.f16x2 acc, p, $9, acc;
shr.b32 t, $1, 6;
lop3.b32 m, t, 0x03030303, 0x78f0f4, 0xEA;
mad.lo.u32 s0, m, 0x22, 0xfa8;
shr.b32 s1, s0, 16;
prmt.b32 p, $2, $3, s0;
fma.rn.f16x2 acc, p, $10, acc;
prmt.b32 p, $2, $3, s1;
fma.rn.f16x2 acc, p, $11, acc;
mov.b32 {ha, hb}, acc;
cvt.f32.f16 fa, ha;
cvt.f32.f16 fb, hb;
add.f32 $0, fa, fb;
}""")


def use_prmt(w: QWeight) -> bool:
    """The prmt GEMV path: CUDA, 2-bit fp16 tables, word layout (rows and groups multiples of 32)."""
    return use_words(w) and w.bits == 2 and w.a.dtype == torch.float16 and w.data.is_cuda


@triton.jit
def _prmt_pairs_kernel(v_ptr, out_ptr, NW, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One row of v: out[i, cw] = fp16(v[16cw + 8q + j]) | fp16(v[16cw + 8q + 4 + j]) << 16, i = 2j + q."""
    pdl_begin(PDL)  # PDL: nothing read or written before the predecessor's writes are visible
    row = tl.program_id(0)
    i = tl.arange(0, 8)
    cw = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    off = 16 * cw[None, :] + (8 * (i % 2) + i // 2)[:, None]  # [8, BLOCK]
    m = (cw < NW)[None, :]
    src = v_ptr + row * NW * 16 + off
    lo = tl.load(src, mask=m, other=0.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = tl.load(src + 4, mask=m, other=0.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    tl.store(out_ptr + row * 8 * NW + i[:, None] * NW + cw[None, :], lo | (hi << 16), mask=m)


def prmt_pairs(v: torch.Tensor) -> torch.Tensor:
    """v [..., n] (n % 16 == 0) -> int32 [..., 8, n/16]: fp16 pairs in the prmt emission order. Pair i = 2j + q
    of word cw holds inputs 16cw + 8q + j (low half) and 16cw + 8q + 4 + j (high half). On CUDA one kernel (the
    decode step's MoE input: a bf16 x took a conversion and a permuting copy, two launches of a few µs each at
    batch 1); elsewhere torch (prmt_pairs_ref)."""
    return _prmt_pairs_launch(v) if v.is_cuda else prmt_pairs_ref(v)


def _prmt_pairs_launch(v: torch.Tensor) -> torch.Tensor:
    """The kernel's launch (tests run it under TRITON_INTERPRET on the CPU)."""
    *lead, n = v.shape
    v2 = v.reshape(-1, n).contiguous()
    out = torch.empty(*lead, 8, n // 16, dtype=torch.int32, device=v.device)
    nw = n // 16
    block = min(128, triton.next_power_of_2(nw))
    _prmt_pairs_kernel[(v2.shape[0], triton.cdiv(nw, block))](v2, out, nw, BLOCK=block, num_warps=4,
                                                              **pdl.options(v2.device))
    return out


def prmt_pairs_ref(v: torch.Tensor) -> torch.Tensor:
    """Torch version of prmt_pairs (any device)."""
    *lead, n = v.shape
    L = len(lead)
    h = v.to(torch.float16).reshape(*lead, n // 16, 2, 2, 4)  # [.., cw, q, half, j]: input 16cw + 8q + 4half + j
    h = h.permute(*range(L), L + 3, L + 1, L, L + 2)  # [.., j, q, cw, half]
    return h.contiguous().view(torch.int32).reshape(*lead, 8, n // 16)


def prmt_decode_emulate(words: torch.Tensor, lut16: torch.Tensor) -> torch.Tensor:
    """Torch replay of the kernel's selector + prmt arithmetic. words int32 [..., NW] (16 codes each), lut16
    fp16 [..., 4] (one table for the row) -> fp16 weights [..., 8, NW, 2] in `prmt_pairs` order."""
    w = words.long() & 0xFFFFFFFF
    pool = lut16.contiguous().view(torch.int16).long() & 0xFFFF  # [..., 4]
    pool = pool[..., 0] | pool[..., 1] << 16 | pool[..., 2] << 32 | pool[..., 3] << 48  # 8 bytes, entry c at 2c

    def hi(m, k):  # mad.hi.u32 without the addend: bits 32..63 of the 64-bit product (exact in int64 here)
        assert int(m.max()) * k < 2 ** 63
        return (m * k) >> 32

    sels = []
    for j in range(4):  # the kernel's instruction sequence, field by field
        if j in (0, 2):
            m = (w >> (2 * j)) & 0x03030303
            sels += [(m * 0x22) & 0xFFFFFFFF, hi(m, 0x220000)]
        else:
            m = ((w << 4) if j == 1 else w) & 0xC0C0C0C0
            sels += [hi(m, 0x88000000), hi(m, 0x8800)]
    out = []
    for s in sels:
        s = (s + 0x10101010) & 0xFFFFFFFF
        r = torch.zeros_like(w)
        for k in range(4):  # result byte k = pool byte selected by nibble k (bit 3 would sign-replicate)
            nib = (s >> (4 * k)) & 0xF
            assert int((nib & 8).max()) == 0, "selector nibble with the sign-replicate bit"
            r |= ((pool[..., None] >> (8 * nib)) & 0xFF) << (8 * k)
        out.append(r)
    r = torch.stack(out, -2)  # [..., 8, NW]: uint32 values held in int64
    r = (r - ((r >> 31) << 32)).to(torch.int32)  # the same 32 bits as int32
    return r.contiguous().view(torch.float16).reshape(*r.shape, 2)


@triton.jit
def _prmt_dot16(w, tlo, thi, x0, x1, x2, x3, x4, x5, x6, x7):
    """Σ of 16 code·x products of each word w [BO, BKW] (int32) against fp16 pairs x0..x7 [1, BKW], tables
    tlo/thi [BO, 1] (int32 views of the row's fp16 table) -> fp32 [BO, BKW]."""
    return tl.inline_asm_elementwise(
        asm=PRMT_ASM, constraints="=r,r,r,r,r,r,r,r,r,r,r,r",
        args=[w, tl.broadcast_to(tlo, w.shape), tl.broadcast_to(thi, w.shape),
              tl.broadcast_to(x0, w.shape), tl.broadcast_to(x1, w.shape), tl.broadcast_to(x2, w.shape),
              tl.broadcast_to(x3, w.shape), tl.broadcast_to(x4, w.shape), tl.broadcast_to(x5, w.shape),
              tl.broadcast_to(x6, w.shape), tl.broadcast_to(x7, w.shape)],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _prmt_x(xp_ptr, cw, NW: tl.constexpr):
    """The 8 fp16-pair rows of x ([8, NW] int32, `prmt_pairs`) at words cw, each [1, BKW] (0 past NW)."""
    m = cw < NW
    return (tl.load(xp_ptr + cw, mask=m, other=0)[None, :], tl.load(xp_ptr + NW + cw, mask=m, other=0)[None, :],
            tl.load(xp_ptr + 2 * NW + cw, mask=m, other=0)[None, :],
            tl.load(xp_ptr + 3 * NW + cw, mask=m, other=0)[None, :],
            tl.load(xp_ptr + 4 * NW + cw, mask=m, other=0)[None, :],
            tl.load(xp_ptr + 5 * NW + cw, mask=m, other=0)[None, :],
            tl.load(xp_ptr + 6 * NW + cw, mask=m, other=0)[None, :],
            tl.load(xp_ptr + 7 * NW + cw, mask=m, other=0)[None, :])


@triton.jit
def prmt_tab(a_ptr, rows, stride_ao, g):
    """Each row's fp16 table of group g as two int32 [BO, 1] (a_ptr: the tables viewed as int32, 2 per group;
    rows: row indices clamped into the matrix, so the loads need no mask and no select)."""
    p = a_ptr + rows * stride_ao + g * 2
    return tl.load(p)[:, None], tl.load(p + 1)[:, None]


@triton.jit
def gemv_prmt(acc, w_ptr, tlo, thi, xp_ptr, rows, stride_wo, k0, NW: tl.constexpr, BKW: tl.constexpr):
    """acc [BO, BKW] += Σ w·x over inputs [k0, k0 + 16·BKW) (w_ptr: codes as int32 words; NW words a row;
    tlo, thi: prmt_tab of the current group; xp_ptr: x as prmt_pairs [8, NW]; rows: clamped row indices, the
    caller drops the rows past the matrix). Words past NW read code 0 against x pairs 0: they add nothing."""
    cw = k0 // 16 + tl.arange(0, BKW)
    w = tl.load(w_ptr + rows[:, None] * stride_wo + cw[None, :], mask=(cw < NW)[None, :], other=0)
    x0, x1, x2, x3, x4, x5, x6, x7 = _prmt_x(xp_ptr, cw, NW)
    return acc + _prmt_dot16(w, tlo, thi, x0, x1, x2, x3, x4, x5, x6, x7)


@triton.jit
def gemv_prmt2(acc_g, acc_u, w1_ptr, glo, ghi, w3_ptr, ulo, uhi, xp_ptr, rows, stride_wo, k0,
               NW: tl.constexpr, BKW: tl.constexpr):
    """gemv_prmt for gate and up (same layout, same x): the x pairs load once."""
    cw = k0 // 16 + tl.arange(0, BKW)
    off = rows[:, None] * stride_wo + cw[None, :]
    m = (cw < NW)[None, :]
    wg = tl.load(w1_ptr + off, mask=m, other=0)
    wu = tl.load(w3_ptr + off, mask=m, other=0)
    x0, x1, x2, x3, x4, x5, x6, x7 = _prmt_x(xp_ptr, cw, NW)
    acc_g += _prmt_dot16(wg, glo, ghi, x0, x1, x2, x3, x4, x5, x6, x7)
    acc_u += _prmt_dot16(wu, ulo, uhi, x0, x1, x2, x3, x4, x5, x6, x7)
    return acc_g, acc_u


@triton.jit
def dequant_tile(w_ptr, a_ptr, b_ptr, offs_o, mask_o, stride_wo, stride_ao, k0, n_in,
                 MODE: tl.constexpr, BITS: tl.constexpr, C: tl.constexpr, BPC: tl.constexpr,
                 G: tl.constexpr, GS: tl.constexpr, BK: tl.constexpr, OUT: tl.constexpr, VD: tl.constexpr = 1):
    """W[offs_o, k0:k0+BK] as a [BO, BK] tile of dtype OUT in natural input order (zeros past n_in).
    MODE_FP8 and MODE_VQ leave out the row scale (the caller scales the output columns after tl.dot)."""
    if MODE == 4:  # vq: each input reads its code (byte loads, cached across the d inputs of a code) and
        # its entry of the codebook at a_ptr, in natural order (no reshape: a [BO, BK/d, d] gather reshaped
        # to [BO, BK] failed Triton 3.6's TritonGPUOptimizeDotOperands pass at 128 x 128 x 64 tiles)
        k = k0 + tl.arange(0, BK)
        code = _vq_codes_bytes(w_ptr, offs_o, mask_o, stride_wo, k // VD, n_in // VD, BITS * VD)
        m = mask_o[:, None] & (k < n_in)[None, :]
        out = tl.load(a_ptr + code * VD + (k % VD)[None, :], mask=m, other=0.0).to(OUT)
    elif MODE == 2 or MODE == 3:  # (one return at the end: Triton compiles code after an early return)
        k = k0 + tl.arange(0, BK)
        m = mask_o[:, None] & (k < n_in)[None, :]
        out = tl.load(w_ptr + offs_o[:, None] * stride_wo + k[None, :], mask=m, other=0.0).to(OUT)
    elif MODE == 6:  # tcq, in natural order: each input reads the two words holding its state (cached)
        k = k0 + tl.arange(0, BK)
        m = mask_o[:, None] & (k < n_in)[None, :]
        lo = _TCQ_LEAD + BITS * (k + 1) - _TCQ_L  # the state's first stream bit
        p = w_ptr + offs_o[:, None] * stride_wo + (lo // 32)[None, :]
        w0 = tl.load(p, mask=m, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        spans = (lo % 32 + _TCQ_L > 32)[None, :]  # the next word only where the state straddles (never past a row)
        w1 = tl.load(p + 1, mask=m & spans, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        st = (((w1 << 32) | w0) >> (lo % 32).to(tl.uint64)[None, :]) & _TCQ_MASK
        out = _tcq_code(st.to(tl.uint32)).to(OUT)
    elif MODE == 5:  # fp4, in natural order: each input reads its byte (cached for its pair) and block scale
        k = k0 + tl.arange(0, BK)
        m = mask_o[:, None] & (k < n_in)[None, :]
        q = tl.load(w_ptr + offs_o[:, None] * stride_wo + (k // 2)[None, :], mask=m, other=0).to(tl.int32)
        sc = tl.load(a_ptr + offs_o[:, None] * stride_ao + (k // GS)[None, :], mask=m, other=0.0).to(tl.float32)
        out = (_e2m1(q >> (4 * (k % 2))[None, :]) * sc).to(OUT)
    else:
        cidx = k0 // C + tl.arange(0, BK // C)
        v = _load_words(w_ptr, offs_o, mask_o, stride_wo, cidx, (n_in + C - 1) // C, BPC)
        lrow, a_row, b_row = _group_ptrs(a_ptr, b_ptr, offs_o, stride_ao, k0, G, GS, 1 << BITS)
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = \
            _table(lrow, mask_o, MODE, BITS)
        # Interleave slots back: join(x, y) adds a last dim [x, y]; the outermost join splits by the
        # lowest bit of the slot, so the row-major flattening of the trailing dims is the slot index.
        if C == 1:  # 8-bit codes, one a byte (MODE_AFFINE)
            w = _decode(v, 0, a_row, b_row, mask_o, MODE, BITS,
                        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
        elif C == 2:
            d0 = _decode(v, 0, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            d1 = _decode(v, 1, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            w = tl.join(d0, d1)
        elif C == 4:
            d0 = _decode(v, 0, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            d1 = _decode(v, 1, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            d2 = _decode(v, 2, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            d3 = _decode(v, 3, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            w = tl.join(tl.join(d0, d2), tl.join(d1, d3))
        else:
            d0 = _decode(v, 0, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            d1 = _decode(v, 1, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            d2 = _decode(v, 2, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            d3 = _decode(v, 3, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            d4 = _decode(v, 4, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            d5 = _decode(v, 5, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            d6 = _decode(v, 6, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            d7 = _decode(v, 7, a_row, b_row, mask_o, MODE, BITS,
                         c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(OUT)
            w = tl.join(tl.join(tl.join(d0, d4), tl.join(d2, d6)), tl.join(tl.join(d1, d5), tl.join(d3, d7)))
        out = tl.reshape(w, (offs_o.shape[0], BK))
    return out


def dequant_ref(w: QWeight) -> torch.Tensor:
    """W [E, O, n_in] fp32 in plain torch (the reference every kernel is checked against)."""
    from ..formats import bitpack

    if w.mode == MODE_DENSE:
        return w.data.float()
    if w.mode == MODE_VQ:  # w = row_scale · codebook[code] (kernels may not import the runtime's
        # dequantize_vq; tests/kernels/test_vq_kernels.py checks the two are equal)
        E, O, _ = w.data.shape
        K, d = w.a.shape[-2:]
        J = w.n_in // d
        idx = bitpack.unpack_bits(w.data, [K.bit_length() - 1] * J).reshape(E, O * J, 1).expand(-1, -1, d)
        return w.a.float().gather(1, idx).reshape(E, O, w.n_in) * w.b.float()[..., None]
    if w.mode == MODE_FP8:
        return w.data.float() * w.a.float()[..., None]
    if w.mode == MODE_TCQ:  # the window of each state, its 1MAD byte sum (runtime/tcq.held_dequantize_tcq: equal)
        words = w.data.view(torch.int32).long() & 0xFFFFFFFF
        words = torch.cat([words, torch.zeros_like(words[..., :1])], -1)
        lo = TCQ_LEAD + w.bits * (torch.arange(w.n_in, device=w.data.device) + 1) - TCQ_L
        st = ((words[..., lo // 32] | (words[..., lo // 32 + 1] << 32)) >> (lo % 32)) & ((1 << TCQ_L) - 1)
        x = (34038481 * st + 76625530) & 0xFFFFFFFF
        total = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        return (total - 510).float() * w.a[..., None]
    E, O, _ = w.data.shape
    G = w.a.shape[2]
    idx = bitpack.unpack(w.data, w.bits, w.n_in).view(E, O, G, w.n_in // G)
    if w.mode == MODE_LUT:
        return w.a.float().gather(-1, idx).reshape(E, O, w.n_in)
    if w.mode == MODE_FP4:  # e2m1 of the code's bits (the table of runtime/fp4.E2M1) times the block scale
        m = idx & 7
        mag = torch.where(m >= 2, (2.0 + (m & 1)) * torch.exp2((m >> 1).float() - 2), m * 0.5)
        return (torch.where(idx >= 8, -mag, mag) * w.a.float()[..., None]).reshape(E, O, w.n_in)
    return (w.b.float()[..., None] + w.a.float()[..., None] * idx.float()).reshape(E, O, w.n_in)
