"""The LUT weight codecs hls, rtn, fp3 and fp8, fitted by one module (calibrate/hls.py), their runtime
halves in runtime/weightcodecs.py; stored layouts in formats/codecs.py.

hls: Hessian-weighted least-squares codebooks per group (int8 entries × an fp16 scale); rtn: uniform levels
(fp16 scale and zero per group); fp3: the fixed grid {-1.5 .. 2} times a signed fp16 scale per group. At
load each becomes codes + a table lut [E, O, G, 2^bits] that the fused kernels read (kernels/dequant.py
MODE_LUT / MODE_AFFINE). fp8: e4m3 weights times fp32 row scales (MODE_FP8).
"""

from __future__ import annotations

from ..registry import WeightCodecSpec, register_weight

LUT_TILE = 16  # inputs per kernel tile (kernels/dequant.pick_block_k): a group holds whole tiles


def lut_kernel_rule(bits: int, n_in: int, group_size: int) -> str | None:
    """The fused MoE / qlinear kernels decode LUT codes in tiles of LUT_TILE inputs that never straddle a
    group (kernels/dequant.pick_block_k): a group is a whole row or a multiple of LUT_TILE inputs."""
    if group_size in (0, n_in) or group_size % LUT_TILE == 0:
        return None
    return (f"the fused kernels read LUT codes in tiles of {LUT_TILE} inputs: group_size must be a multiple of "
            f"{LUT_TILE} (or 0: one group per row), got {group_size}")


_W = "moec.runtime.weightcodecs"
_TUNE = {"hls": "moec.calibrate.hls:TunedLUT", "fp3": "moec.calibrate.hls:TunedScale"}
# the held buffers the kernels read (kernels/dequant.QWeight a, b, c): fp16 tables (and the 2-bit cubic), or
# rtn's fp16 scale and zero (MODE_AFFINE)
_KERNEL_PARTS = {"hls": ("codes", "lut16", "poly"), "fp3": ("codes", "lut16", "poly"),
                 "rtn": ("codes", "scale", "zero")}
# rtn 4-bit in groups of 32 is GGUF's Q4_1; rtn with integer zero points compressed-tensors' pack-quantized
_EXPORTS = {"rtn": {"gguf": "moec.export.to_gguf:rtn_reason", "ct": "moec.export.to_ct:rtn_reason"}}
_EXPORT_TENSORS = {"rtn": {"gguf": "moec.export.to_gguf:rtn_tensor", "ct": "moec.export.to_ct:rtn_tensors"}}
for _name, _bits, _mode in (("hls", (2, 3, 4), 0), ("rtn", (2, 3, 4), 1), ("fp3", (3,), 0)):
    register_weight(WeightCodecSpec(
        _name, bits=_bits, family="hls", quantize=f"moec.calibrate.hls:quantize_{_name}",
        dequantize=f"{_W}:dequantize_lut_{_name}", random_stored=f"{_W}:random_{_name}", lut=f"{_W}:lut_{_name}",
        allocate=True, fit_onehot=_name == "hls", tune=_TUNE.get(_name), hold=f"{_W}:hold_lut_{_name}",
        held_dequantize=f"{_W}:held_dequantize_lut", held_group=f"{_W}:held_group_lut", kernel_mode=_mode,
        kernel_parts=_KERNEL_PARTS[_name], kernel_rule=lut_kernel_rule, rows_concat=True,
        exports=_EXPORTS.get(_name, {}), export_tensors=_EXPORT_TENSORS.get(_name, {})))

register_weight(WeightCodecSpec(
    "fp8", bits=(8,), family="hls", quantize="moec.calibrate.hls:quantize_fp8", dequantize=f"{_W}:dequantize_fp8",
    random_stored=f"{_W}:random_fp8", hold=f"{_W}:hold_fp8", held_dequantize=f"{_W}:dequantize_fp8",
    held_group=f"{_W}:held_group_row", kernel_mode=2, kernel_parts=("fp8", "scale"), rows_concat=True,
    exports={"gguf": "moec.export.to_gguf:fp8_reason", "ct": "moec.export.to_ct:fp8_reason"},
    export_tensors={"ct": "moec.export.to_ct:fp8_tensors"}))
