"""`moec models`: the built-in models and data sets."""

from __future__ import annotations

from rich.table import Table

from ..calibrate.data import BUILTIN_DATA
from ..calibrate.sources import BUILTIN_MODELS
from ..runtime.config import PRESETS
from .common import out_console, show_table


def models() -> None:
    """List built-in models, performance shapes and data sets."""
    t = Table(title="built-in models")
    t.add_column("name")
    t.add_column("what")
    for name, about in BUILTIN_MODELS.items():
        t.add_row(name, about)
    for name, a in PRESETS.items():
        t.add_row(name, f"performance shape (random weights, for `--random` of `moec pack` and "
                        f"`moec eval --latency`): {a.n_layers} layers, "
                        f"dim {a.dim}, {a.n_experts} experts top-{a.top_k}, expert ffn {a.expert_dim}")
    show_table(t)
    d = Table(title="built-in data sets")
    d.add_column("name")
    d.add_column("splits")
    d.add_column("what")
    for name, info in BUILTIN_DATA.items():
        d.add_row(name, ", ".join(info["splits"]) + f" (eval: {info['eval_split']})", info["about"])
    show_table(d)
    out_console.print("--data also takes a local .txt/.json/.jsonl file or a hub data set name.")
