"""Strict, typed construction of config dataclasses from parsed YAML or JSON: a key the class does not
declare, or a value of the wrong type, is a UserError naming it. Recipes (calibrate/recipe.py) and the
`kv` section of a packed manifest (runtime/loader.py) are both built through here, so one schema (the
codec's config class) is checked the same way on the way in and on the way back.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Literal

from .errors import UserError


def type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def convert(value, tp, where: str):
    """`value` as type `tp` (int, float, bool, str, Literal, list, Optional, a dataclass), or UserError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else convert(value, args[0], where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise UserError(f"{where}: {value!r} is not {type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{where}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")
        return [convert(v, typing.get_args(tp)[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise UserError(f"{where}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def build(cls, data, where: str, codec: str | None = None, parsers: dict[str, Callable] | None = None):
    """`cls(**data)` with every key declared and typed; `parsers[key](value, where)` replaces `convert` for
    a key whose type depends on the data (a recipe's `kv`, by codec). The class's own __post_init__ then
    checks ranges (UserError)."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            whose = f" for codec {codec!r}" if codec else ""
            raise UserError(f"{where}: unknown key {key!r}{whose} (known keys: {', '.join(sorted(known))})")
    parsers = parsers or {}
    kwargs = {k: parsers[k](v, f"{where}.{k}") if k in parsers else convert(v, hints[k], f"{where}.{k}")
              for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise UserError(f"{where}: {e}") from None
