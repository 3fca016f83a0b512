"""`moec recipes`: the shipped recipes (one line each: name and purpose) and the `--scheme` shorthands."""

from __future__ import annotations

import typer
from rich.table import Table
from rich.text import Text

from ..calibrate.catalog import SCHEMES, is_ablation, purpose, shipped
from .common import out_console


def recipes(ablations: bool = typer.Option(False, "--ablations", help="also the variants kept to reproduce "
                                           "measurements (moec/recipes/ablations/)")) -> None:
    """List the shipped recipes (`--recipe NAME`) and the `--scheme` shorthands."""
    files = shipped()
    t = Table(title="shipped recipes (--recipe NAME; a path to your own YAML works too)", title_justify="left")
    t.add_column("name", no_wrap=True)
    t.add_column("purpose", no_wrap=True, overflow="ellipsis")  # one line each, cut on a narrow terminal
    n_abl = 0
    for name, path in files.items():
        if is_ablation(path):
            n_abl += 1
            if not ablations:
                continue
        t.add_row(Text(name), Text(purpose(path)))  # as written: no markup or emoji codes in a description
    out_console.print(t)
    s = Table(title="--scheme NAME (case-insensitive): the recipe it stands for", title_justify="left")
    for c in ("scheme", "recipe", "what"):
        s.add_column(c, no_wrap=True, overflow="ellipsis")
    for name, sch in SCHEMES.items():
        s.add_row(name, sch.recipe if sch.recipe in files else f"{sch.recipe} (not shipped in this version)",
                  Text(sch.about))
    out_console.print(s)
    if not ablations and n_abl:
        out_console.print(f"{n_abl} ablations (variants kept to reproduce measurements): moec recipes --ablations",
                          markup=False, highlight=False)
