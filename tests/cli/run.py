"""Run the `moec` CLI in a subprocess, as a user would (exit code, stdout, stderr)."""

import os
import subprocess
import sys


def moec(*args, timeout=600):
    env = dict(os.environ, MOEC_PROGRESS="0", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "moec.cli.app", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout)
