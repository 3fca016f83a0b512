"""The FP4 weight codecs mxfp4 and nvfp4: e2m1 values (4-bit codes) times one scale per block of inputs.

mxfp4: blocks of 32 inputs, an e8m0 (power-of-two) scale each: the OCP MX format gpt-oss ships
    (`*_blocks` / `*_scales`, loaded exactly by runtime/fp4.mxfp4_from_blocks) and llama.cpp's MXFP4 type
    stores (`moec export --format gguf`).
nvfp4: blocks of 16 inputs, an fp8 e4m3 scale each and one fp32 global scale per matrix (per expert):
    compressed-tensors' `nvfp4-pack-quantized` (`moec export --format ct`).
Both are fitted by calibrate/fp4.py (per-block scale search under the Hessian diagonal, then GPTQ error
feedback; `gptq: false` the plain round-to-nearest of the consuming libraries), run by runtime/fp4.py and
the fused kernels' MODE_FP4 (kernels/dequant.py: codes + an fp16/fp32 scale per block, decoded in registers);
stored parts in formats/codecs.py.
"""

from __future__ import annotations

from ..errors import UserError
from ..registry import WeightCodecSpec, register_weight

BLOCK = {"mxfp4": 32, "nvfp4": 16}  # inputs per block scale (the formats fix them)
MODE_FP4 = 5  # kernels/dequant.py MODE_FP4 (codecs may not import the kernels)


def _check(name: str):
    def check_rule(rule) -> None:
        """UserError unless group_size is the format's block (the rule's group_size names it explicitly)."""
        if rule.group_size != BLOCK[name]:
            raise UserError(f"weights rule: codec {name} scales blocks of {BLOCK[name]} inputs: group_size must be "
                            f"{BLOCK[name]}, got {rule.group_size}")

    check_rule.__name__ = f"check_rule_{name}"
    return check_rule


def kernel_rule(bits: int, n_in: int, group_size: int) -> str | None:
    """MODE_FP4 reads each chunk's own block scale, so a kernel tile may span blocks: the kernels need only
    rows of whole blocks."""
    if group_size and n_in % group_size == 0:
        return None
    return f"the fused kernels read fp4 codes in whole blocks: {n_in} inputs are not blocks of {group_size}"


_R = "moec.runtime.fp4"
_EXPORTS = {"mxfp4": ({"gguf": "moec.export.to_gguf:mxfp4_reason"}, {"gguf": "moec.export.to_gguf:mxfp4_tensor"}),
            "nvfp4": ({"ct": "moec.export.to_ct:nvfp4_reason"}, {"ct": "moec.export.to_ct:nvfp4_tensors"})}
_DESCRIPTION = {"mxfp4": "e2m1 codes, an e8m0 scale per 32 inputs (OCP MX, gpt-oss, GGUF MXFP4)",
                "nvfp4": "e2m1 codes, an e4m3 scale per 16 inputs, an fp32 global scale (compressed-tensors NVFP4)"}
for _name in ("mxfp4", "nvfp4"):
    register_weight(WeightCodecSpec(
        _name, bits=(4,), family="fp4", quantize=f"moec.calibrate.fp4:quantize_{_name}",
        dequantize=f"{_R}:dequantize_{_name}", random_stored=f"{_R}:random_{_name}", check_rule=_check(_name),
        hold=f"{_R}:hold_{_name}", held_dequantize=f"{_R}:held_dequantize", held_group=f"{_R}:held_group",
        kernel_mode=MODE_FP4, kernel_parts=("codes", "scale"), kernel_rule=kernel_rule, rows_concat=True,
        exports=_EXPORTS[_name][0], export_tensors=_EXPORTS[_name][1],
        description=_DESCRIPTION[_name]))
