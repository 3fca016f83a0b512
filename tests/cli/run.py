"""Run the `moec` CLI as a user would (exit code, stdout, stderr), in this process.

`moec(*args)` calls the entry point a user's `moec` runs through `moec.cli.app.run` (main(): argument
parsing, the one-line errors and exit codes, with sys.argv set, stdout and stderr captured, the CLI's own log
handler in place of pytest's and Python warnings printed to the captured stderr), in the environment a
subprocess got here before (MOEC_PROGRESS=0, COLUMNS=200). A subprocess costs seconds of torch/transformers
imports per call on two busy cores (70+ calls in the suite); in-process each call pays only for its work.

Where a separate process is the point, it still runs one (`isolate=True`, and automatically): a kill
(MOEC_TEST_KILL_AFTER, the process dies) and codec plugins (MOEC_PLUGINS, imported once per process by the
registry). `moec_subprocess` is the subprocess runner.
"""

from __future__ import annotations

import os
import subprocess
import sys

ENV = {"MOEC_PROGRESS": "0", "COLUMNS": "200"}
NEEDS_A_PROCESS = ("MOEC_TEST_KILL_AFTER", "MOEC_PLUGINS")  # env vars whose effect is per process


def moec_subprocess(*args, timeout=600) -> subprocess.CompletedProcess:
    env = dict(os.environ, **ENV)
    return subprocess.run([sys.executable, "-m", "moec.cli.app", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout)


def moec(*args, timeout=600, isolate: bool = False) -> subprocess.CompletedProcess:
    if isolate or any(os.environ.get(k) for k in NEEDS_A_PROCESS):
        return moec_subprocess(*args, timeout=timeout)
    from moec.cli.app import run

    return run(*args, env=ENV)
