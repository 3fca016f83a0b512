"""keep: a tensor stored as the source has it (dtype and canonical shape), the default of every tensor no
recipe rule selects; a packed copy reproduces the source bit for bit."""

from __future__ import annotations

from ..registry import WeightCodecSpec, register_weight

register_weight(WeightCodecSpec("keep", bits=tuple(range(1, 17)), identity=True,
                                description="stored as the source has it"))
