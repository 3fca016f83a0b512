"""tcq: trellis-coded quantization (QTIP-style, issue 38): each row one path through a bitshift trellis of
12-bit states, k = bits stored per weight, each weight's value computed from its state (no table) times the row's
fp16 scale. Fitted by calibrate/tcq.py (Viterbi with block LDLQ under the Hessian, usually on incoherence-rotated
weights), its runtime half in runtime/tcq.py, stored layout in formats/codecs.py (WeightCodec.TCQ).

group_size is not a storage group here (the stored row has one scale): it is the fit's block-LDLQ step, the inputs
whose path is chosen together before their error moves onto the later columns (0: 8).
"""

from __future__ import annotations

from ..errors import UserError
from ..registry import WeightCodecSpec, register_weight


def check_tcq_rule(rule) -> None:
    if rule.group_size > 256:
        raise UserError(f"weights rule: codec 'tcq' reads group_size as its fit's block-LDLQ step (inputs fitted "
                        f"together, 0 for the default 8); at most 256, got {rule.group_size}")


MODE_TCQ = 6  # kernels/dequant.py MODE_TCQ (codecs may not import the kernels)


def tcq_kernel_rule(bits: int, n_in: int, group_size: int) -> str | None:
    """MODE_TCQ reads a row in chunks of 32 inputs (`bits` whole int32 words)."""
    if n_in % 32 == 0:
        return None
    return f"the fused kernels read tcq rows in chunks of 32 inputs: {n_in} inputs are not whole chunks"


_R = "moec.runtime.tcq"
register_weight(WeightCodecSpec(
    "tcq", bits=(2, 3, 4), quantize="moec.calibrate.tcq:quantize_tcq_rule", dequantize=f"{_R}:dequantize_tcq",
    random_stored=f"{_R}:random_tcq", check_rule=check_tcq_rule, tune="moec.calibrate.tcq:TunedTCQ", allocate=True,
    hold=f"{_R}:hold_tcq", held_dequantize=f"{_R}:held_dequantize_tcq", held_group=f"{_R}:held_group_tcq",
    kernel_mode=MODE_TCQ, kernel_parts=("codes", "scale"), kernel_rule=tcq_kernel_rule, rows_concat=True,
    description="trellis-coded (QTIP-style bitshift trellis, computed codes): k bits per weight, an fp16 row scale"))
