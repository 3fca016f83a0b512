"""Helpers shared by the benchmark scripts (importable because each script's folder is on sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args) -> None:
    """Run `moec ARGS...` as a user would (a separate process, no progress bars); raise with its stderr."""
    env = dict(os.environ, MOEC_PROGRESS="0")
    r = subprocess.run([sys.executable, "-m", "moec.cli.app", *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"moec {' '.join(map(str, args))} failed:\n{r.stderr[-3000:]}")
