"""Run the `moec` CLI as a user would (exit code, stdout, stderr), in this process.

`moec(*args)` calls the entry point a user's `moec` runs (`moec.cli.app.main`: argument parsing, the
one-line errors and exit codes) with sys.argv set, stdout and stderr captured, the environment a subprocess
got here before (MOEC_PROGRESS=0, COLUMNS=200), the CLI's own log handler in place of pytest's and Python
warnings printed to the captured stderr. A subprocess costs seconds of torch/transformers imports per call on
two busy cores (70+ calls in the suite); in-process each call pays only for its work.

Where a separate process is the point, it still runs one (`isolate=True`, and automatically): a kill
(MOEC_TEST_KILL_AFTER, the process dies) and codec plugins (MOEC_PLUGINS, imported once per process by the
registry). `moec_subprocess` is the subprocess runner.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import warnings

ENV = {"MOEC_PROGRESS": "0", "COLUMNS": "200"}
NEEDS_A_PROCESS = ("MOEC_TEST_KILL_AFTER", "MOEC_PLUGINS")  # env vars whose effect is per process


def moec_subprocess(*args, timeout=600) -> subprocess.CompletedProcess:
    env = dict(os.environ, **ENV)
    return subprocess.run([sys.executable, "-m", "moec.cli.app", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout)


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _own_logging():
    """The root logger as a fresh process has it (no handler, level WARNING), so main()'s basicConfig installs
    the CLI's handler on the captured stderr; pytest's handlers and level come back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers, root.level = [], logging.WARNING
    try:
        yield
    finally:
        root.handlers, root.level = handlers, level


@contextlib.contextmanager
def _console_width(columns: int):
    """The CLI's rich consoles (moec.cli.common) at COLUMNS wide, as a fresh process with COLUMNS set starts
    them: a console this process made earlier may have fixed its width (80 where nothing said otherwise)."""
    from rich.console import Console

    from moec.cli import common

    consoles = [c for c in vars(common).values() if isinstance(c, Console)]
    saved = [(c._width, c._height) for c in consoles]
    for c in consoles:
        c.width = columns
    try:
        yield
    finally:
        for c, (w, h) in zip(consoles, saved, strict=True):
            c._width, c._height = w, h


def moec(*args, timeout=600, isolate: bool = False) -> subprocess.CompletedProcess:
    if isolate or any(os.environ.get(k) for k in NEEDS_A_PROCESS):
        return moec_subprocess(*args, timeout=timeout)
    from moec.cli.app import main

    argv = ["moec", *map(str, args)]
    out, err = io.StringIO(), io.StringIO()

    def show(message, category, filename, lineno, file=None, line=None):  # as a process prints them
        err.write(warnings.formatwarning(message, category, filename, lineno, line))

    old_argv = sys.argv
    with _environ(ENV), _console_width(int(ENV["COLUMNS"])), _own_logging(), warnings.catch_warnings(), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        warnings.simplefilter("default")
        warnings.showwarning = show
        sys.argv = argv
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = old_argv
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
