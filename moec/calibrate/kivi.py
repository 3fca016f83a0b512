"""Calibration side of the kivi KV codec (moec/runtime/kivi.py): nothing to fit (min/max scales are
computed per block at run time), only the settings checked against the model's shapes."""

from __future__ import annotations

from ..errors import UserError


def check_packs(args, kv) -> None:
    d = args.head_dim
    if (d * kv.bits) % 8 or (kv.bits == 3 and d % 8):
        raise UserError(f"kv.bits {kv.bits}: head_dim {d} does not pack into whole bytes")


def check_kivi(args, kv) -> None:
    """Refuse kivi settings the model's shapes cannot take (UserError naming the field)."""
    if args.head_dim % kv.group_size:
        raise UserError(f"kv.group_size {kv.group_size} does not divide the model's head_dim {args.head_dim}")
    check_packs(args, kv)
