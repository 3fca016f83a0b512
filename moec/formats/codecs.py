"""Per-tensor storage codecs of the packed checkpoint (the `codec` field of each manifest entry)."""

from __future__ import annotations

import re
from enum import StrEnum

KEEP = "keep"  # the `codec` of a tensor stored as the source has it
ROTATION_PART = "had_signs"  # the stored part of a matrix fitted in a rotated basis (WeightCodec below)
VQ_DIMS = (1, 2, 4, 8)  # vq vector lengths (WeightCodec.VQ): powers of two, so a code's inputs stay in one word
VQ_MAX_WIDTH = 12  # bits per vq code: a codebook of at most 4096 vectors, a code spans at most two bytes
VQ_WIDTHS = (2, 3, 4, 6, 8, 12)  # code widths bits·d the vq kernels take (kernels/dequant.py MODE_VQ)
TCQ_STATE_BITS = 12  # bits of a tcq trellis state (WeightCodec.TCQ): a row's window of its bit stream
TCQ_LEAD_BITS = 32  # the lead word of a tcq row (the first state's other bits, at its top)


class WeightCodec(StrEnum):
    """The stored layouts of the built-in weight codecs (each registered in its module of moec/codecs/; code looks
    codecs up in moec/registry.py; a registered codec outside this list documents its own parts).

    KEEP: the tensor as-is, in its source dtype and canonical shape (the identity recipe), so a
    packed copy reproduces the source bit for bit.

    The others store a stacked matrix P [E, O, I] (experts, output rows, inputs) as several tensors
    named `P.<part>`, each carrying `param` = P in the manifest; g = group size along I (the whole
    row when the recipe says 0), G = I // g, K = 2^bits, codes packed per row (formats/bitpack.py).
    HLS: codes uint8 [E, O, row_bytes], codebook int8 [E, O, G, K], cb_scale fp16 [E, O, G];
        w = cb_scale · codebook[idx] (Hessian-weighted least-squares codebooks, calibrate/hls.py).
    RTN: codes, scale fp16 [E, O, G], zero fp16 [E, O, G]; w = zero + scale · idx (uniform).
    FP3: codes (3-bit), scale fp16 [E, O, G] (signed); w = scale · FP3_GRID[idx], the fixed grid
        {-1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2}.
    FP8: fp8 float8_e4m3fn [E, O, I], scale fp32 [E, O]; w = scale · fp8.
    VQ: group_size is the vector length d (1, 2, 4 or 8): one code per d consecutive inputs, w = bits·d
        bits wide (≤ 12), K = 2^w; codes uint8 [E, O, ceil(I/d · w / 8)] (formats/bitpack.py BITSTREAM: code
        j of a row at bits w·j .. w·j + w − 1, LSB first), codebook fp16 [E, K, d] (one per expert matrix),
        row_scale fp16 [E, O]; w[e, o, j·d + a] = row_scale[e, o] · codebook[e, code_j, a] (calibrate/vq.py).
        Added within format version 2: a reader that predates it refuses the codec by name. A codebook
        [1, K, d] is shared by every expert of the matrix (a rule's `shared_codebook`: codebook[0] for each e);
        a reader that predates sharing refuses its shape.
    INTSYM: symmetric integers (moec/codecs/intsym.py), bits b = 4 or 8: codes uint8 [E, O, row_bytes] (ROW
        layout; code = q + 2^(b-1) for the signed level q in [-2^(b-1), 2^(b-1) - 1]), scale fp16 [E, O, G];
        w = scale · (code - 2^(b-1)) (calibrate/intsym.py). Added within format version 2: a reader that
        predates it refuses the codec by name.
    MXFP4: codes uint8 [E, O, I / 2], scale uint8 [E, O, I / 32] (e8m0, g = 32 fixed); w = E2M1[code] ·
        2^(scale − 127) with E2M1 the e2m1 values by bit pattern {0, 0.5, 1, 1.5, 2, 3, 4, 6, −0, −0.5, .., −6}
        (bit 3 the sign); codes in bitpack's 4-bit ROW layout: input 2j in the low nibble of byte j, 2j + 1 in
        the high one: byte for byte gpt-oss's `*_blocks` [E, O, I / 32, 16] viewed as [E, O, I / 2] and its
        `*_scales` (runtime/fp4.mxfp4_from_blocks). Scale 255 (the MX NaN) is never written.
    NVFP4: codes as MXFP4's, scale float8_e4m3fn [E, O, I / 16] (g = 16 fixed), global_scale fp32 [E] (a
        plain [O, I] weight: a 0-dim tensor); w = E2M1[code] · (fp32(scale) / global_scale[e]), the quotient in
        fp32 first (compressed-tensors' `nvfp4-pack-quantized` convention: its weight_global_scale is the
        divisor). moec's fit writes power-of-two global scales, so every weight is exact in bf16.
        Both added within format version 2: a reader that predates them refuses the codec by name.
    TCQ: trellis-coded (moec/codecs/tcq.py, runtime/tcq.py), k = bits, L = TCQ_STATE_BITS: codes uint8 [E, O,
        4 · (1 + ceil(k·I / 32))], each row little-endian 32-bit words: word 0 holds the first state's other L − k
        bits in its top bits and the row's fp16 scale in its low 16 bits (the bits between zero), symbol b_t (k bits)
        at stream bit 32 + k·t, zero padding after the last. The state of input t is the L stream bits ending with
        b_t, [32 + k·(t + 1) − L, 32 + k·(t + 1)), and w = scale · code(state), code computed from the state
        (runtime/tcq.code_of: 1MAD, (byte sum of 34038481·s + 76625530 mod 2^32 − 510) / 128). Added within format
        version 3: a reader that predates it refuses the codec by name. The first tcq packs (stop 50) stored the
        scale as a part, row_scale fp16 [E, O], with those low bits zero; readers take both.

    Any of them may carry one more part, `P.had_signs`, for a matrix fitted with incoherence processing
    (calibrate/recipe.Incoherence): the parts above then store W' = W·R with R = blockdiag(H_b)·diag(s)/√b
    (moec/rotation.py, H_b the Sylvester Hadamard matrix, b a power of two: the block, s the ±1 signs
    [I / b, b]), and y = (x·R)·W'ᵀ. A layer's matrices that read one input (w1 and w3) hold the same signs.
    Stored bit-packed: uint8 [I / b, ceil(b / 8)], sign k of block j in bit k % 8 of byte [j, k // 8], 1 for
    −1 (rotation.pack_signs; formats/bitpack.Layout.BITSTREAM of 1-bit codes), so b = I / rows and the signs
    cost I/8 bytes. Packs written before bit packing store int8 ±1 [I / b, b] (1 byte per input); readers
    take both, told apart by the dtype. Added within format version 2: a reader that predates the part
    refuses such a checkpoint, naming it, and one that predates bit packing refuses the uint8 form likewise.
    """

    KEEP = "keep"
    HLS = "hls"
    RTN = "rtn"
    FP3 = "fp3"
    FP8 = "fp8"
    VQ = "vq"
    INTSYM = "intsym"
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"
    TCQ = "tcq"


# Which canonical tensors count as "weights" for effective bits: every matrix inside the decoder
# layers (attention projections, router, experts, shared experts, dense MLPs). Norms, biases,
# embeddings and the LM head are reported apart (a quantized LM head counts in q_bits, calibrate/pack.py).
WEIGHT_PATTERN = re.compile(r"layers\.\d+\.(attn\.w[qkvo]\.weight|moe\.(router\.weight|w[123]|shared\..*weight|"
                            r"shared_gate\.weight))$")

# Named groups a recipe rule targets (docs/architecture.md; experts, shared_experts, mlp, attention, router, lm_head).
# `experts` and `mlp` name the same stacked tensors: a MoE layer's experts, or a dense MLP stored as one
# always-taken expert; Recipe.rule_for tells them apart by the layer's kind when the model is known, so on
# a model with MoE and dense layers (Qwen2-MoE `mlp_only_layers`, DeepSeek's first dense layers) each
# names only its own. `router` is the gate Linear [E, D] (the shared expert's [1, D] gate is kept);
# `lm_head` the output projection [V, D] (on a tied model a copy of the embedding: the input embedding
# is never quantized, calibrate/pack.py unties it).
TARGET_PATTERNS = {
    "experts": r"layers\.\d+\.moe\.w[123]$",  # stacked experts of MoE layers
    "mlp": r"layers\.\d+\.moe\.w[123]$",  # dense MLPs are stored as one always-taken expert
    "shared_experts": r"layers\.\d+\.moe\.shared\.w[123]\.weight$",
    "attention": r"layers\.\d+\.attn\.(w[qkvo]|wq_[ab]|wkv_[ab])\.weight$",  # GQA; MLA (wq_a/b, wkv_a/b)
    "router": r"layers\.\d+\.moe\.router\.weight$",
    "lm_head": r"^output\.weight$",
}
# the ffn kind (ModelArgs.ffn_kinds) each kind-bound target selects
TARGET_KIND = {"experts": "moe", "mlp": "dense"}
