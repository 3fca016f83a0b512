"""Shared CLI helpers: console, progress bars, result records, atomic JSON output (moec.atomic)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from rich.console import Console, ConsoleDimensions
from rich.table import Table

from ..atomic import write_json
from ..progress import track

PIPE_WIDTH = 10_000  # stdout's columns when it is a file or a pipe: wider than any table moec prints


class _Results(Console):
    """stdout, where results go. To a file or a pipe it is as wide as what is printed needs (rich's
    default there is 80 columns, or the width of a terminal on stderr, and a wider table had its numbers
    cut to `38.5…`); on a terminal, the terminal's width."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        return size if self.is_terminal else ConsoleDimensions(PIPE_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


console = Console(stderr=True)
out_console = _Results()


def show_table(t: Table) -> None:
    """A result table on stdout, every number whole: a terminal too narrow for it folds a cell onto the
    next line instead of cutting it to `…` (to a file or a pipe it is never narrowed: _Results)."""
    for c in t.columns:
        c.overflow = "fold"
    out_console.print(t)


def progress_bar(description: str, total: int):
    """Yields advance(n=1) for a long step, shown with elapsed time and ETA (moec/cli/progress.py)."""
    return track(description, total)


@lru_cache(maxsize=1)  # one sha per run, even if commits land while a long eval runs
def git_sha() -> str | None:
    repo = Path(__file__).resolve().parents[2]
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def base_record(bench: str, device: str) -> dict:
    return {"bench": bench, "git_sha": git_sha(), "date": time.strftime("%Y-%m-%d"), "device": device_name(device)}


def write_json_atomic(path: Path, obj) -> None:
    """Result JSON, written atomically (moec.atomic.write_json; kept under this name for the benchmarks)."""
    write_json(path, obj)
