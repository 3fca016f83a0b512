"""intsym: symmetric integer weights, as llm-compressor's W4A16 / W8A16 schemes store them: w = scale · q with
q a signed b-bit integer in [-2^(b-1), 2^(b-1) - 1] and one fp16 scale per group of inputs (or per row), the
zero point fixed at 0. Fitted by calibrate/intsym.py (scale search on diag(H), then GPTQ error feedback with
the full Hessian, columns by decreasing h_jj with `actorder`); runtime half in runtime/intsym.py; stored layout
in formats/codecs.py (WeightCodec.INTSYM).

The fused kernels read it as MODE_AFFINE (kernels/dequant.py: w = zero + scale · code with code = q + 2^(b-1)
and zero = -2^(b-1) · scale, exact in fp16 and in the fp32 sum), so they need the same group rule as rtn.

Exports (moec/export): compressed-tensors `pack-quantized`, symmetric (any group, 4 or 8 bits), and GGUF Q4_0
/ Q8_0 (groups of 32: GGML's block, with the fp16 scale as the block's d).
"""

from __future__ import annotations

from ..registry import WeightCodecSpec, register_weight

KERNEL_TILE = 16  # inputs per kernel tile (kernels/dequant.pick_block_k): a group holds whole tiles


def intsym_kernel_rule(bits: int, n_in: int, group_size: int) -> str | None:
    """MODE_AFFINE tiles of KERNEL_TILE inputs never straddle a group (kernels/dequant.pick_block_k)."""
    if group_size in (0, n_in) or group_size % KERNEL_TILE == 0:
        return None
    return (f"the fused kernels read intsym codes in tiles of {KERNEL_TILE} inputs: group_size must be a multiple "
            f"of {KERNEL_TILE} (or 0: one group per row), got {group_size}")


_R = "moec.runtime.intsym"
register_weight(WeightCodecSpec(
    "intsym", bits=(4, 8), quantize="moec.calibrate.intsym:quantize_intsym", dequantize=f"{_R}:dequantize_intsym",
    random_stored=f"{_R}:random_intsym", hold=f"{_R}:hold_intsym",
    held_dequantize=f"{_R}:held_dequantize_intsym", held_group=f"{_R}:held_group_intsym", kernel_mode=1,
    kernel_parts=("codes", "scale", "zero"), kernel_rule=intsym_kernel_rule, rows_concat=True,
    exports={"gguf": "moec.export.to_gguf:intsym_reason", "ct": "moec.export.to_ct:intsym_reason"},
    export_tensors={"gguf": "moec.export.to_gguf:intsym_tensor", "ct": "moec.export.to_ct:intsym_tensors"},
    description="symmetric int4/int8 (w = scale · q, integer zero 0), GPTQ; W4A16 / W8A16"))
