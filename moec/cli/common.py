"""Shared CLI helpers: console, progress bars, result records, atomic JSON output (moec.atomic)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from rich.console import Console

from ..atomic import write_json
from ..progress import track

console = Console(stderr=True)
out_console = Console()


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
