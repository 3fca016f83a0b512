"""vq: vector codebooks (GPTVQ-style), one code per group_size consecutive inputs and a codebook per
expert matrix, or one per layer's matrix shared by its experts (`shared_codebook: true`); fitted by
calibrate/vq.py, its runtime half in runtime/weightcodecs.py, stored layout in formats/codecs.py."""

from __future__ import annotations

from ..errors import UserError
from ..formats.codecs import VQ_DIMS, VQ_MAX_WIDTH, VQ_WIDTHS
from ..registry import WeightCodecSpec, register_weight


def check_vq_rule(rule) -> None:
    """The registry's `check_rule` hook: group_size is the vector length d."""
    d = rule.group_size
    if d not in VQ_DIMS:
        raise UserError(f"weights rule: codec 'vq' codes group_size consecutive inputs jointly; group_size must "
                        f"be one of {', '.join(map(str, VQ_DIMS))}, got {d}")
    width = rule.bits * d
    if width > VQ_MAX_WIDTH:
        raise UserError(f"weights rule: codec 'vq' with bits {rule.bits} and group_size {d} needs "
                        f"{width}-bit codes, a codebook of 2^{width} "
                        f"vectors; at most {VQ_MAX_WIDTH} bits per code (bits x group_size <= {VQ_MAX_WIDTH})")


def vq_kernel_rule(bits: int, n_in: int, group_size: int) -> str | None:
    """The vq kernels (kernels/dequant.py MODE_VQ) take codes of VQ_WIDTHS bits (a code spans at most two
    bytes of its row) over vectors of VQ_DIMS inputs dividing the row."""
    d = group_size
    if d in VQ_DIMS and n_in % d == 0 and bits * d in VQ_WIDTHS:
        return None
    return (f"the vq kernels take vectors of {'/'.join(map(str, VQ_DIMS))} inputs dividing the row and codes of "
            f"bits x group_size in {'/'.join(map(str, VQ_WIDTHS))} bits, got bits {bits}, group_size {d}, "
            f"{n_in} inputs")


_W = "moec.runtime.weightcodecs"
register_weight(WeightCodecSpec(
    "vq", bits=(2, 3, 4), quantize="moec.calibrate.vq:quantize_vq_rule", dequantize=f"{_W}:dequantize_vq",
    random_stored=f"{_W}:random_vq", check_rule=check_vq_rule, tune="moec.calibrate.vq:TunedVQ", allocate=True,
    hold=f"{_W}:hold_vq", held_dequantize=f"{_W}:dequantize_vq", held_group=f"{_W}:held_group_vq", kernel_mode=4,
    kernel_parts=("codes", "codebook", "row_scale"), kernel_rule=vq_kernel_rule, shared_parts=("codebook",),
    description="vector codebooks: one code per group_size inputs, a codebook per matrix (GPTVQ-style)"))
