"""The `moec` command: calibrate, pack, eval, inspect, models, recipes, generate, export, report.

Exit codes: 0 success, 2 bad usage or input (one line naming the problem, no traceback), 1 for
anything else (one line; MOEC_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import warnings

import click
import typer
from rich.logging import RichHandler

from .. import __version__
from ..errors import UserError
from ..progress import install as set_reporter
from . import (
    calibrate_cmd,
    eval_cmd,
    export_cmd,
    generate_cmd,
    inspect_cmd,
    models_cmd,
    pack_cmd,
    recipes_cmd,
    report_cmd,
)
from .common import console
from .progress import install as install_progress

# -h beside --help: click inherits help_option_names into every subcommand's context.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _print_version(value: bool) -> None:
    if value:
        print(f"moec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the moec version and exit.")) -> None:
    """Compress Mixture-of-Experts models offline and run them fast (metrics and table columns: docs/metrics.md)."""


app.command("models")(models_cmd.models)
app.command("recipes")(recipes_cmd.recipes)
app.command("calibrate")(calibrate_cmd.calibrate)
app.command("pack")(pack_cmd.pack)
app.command("eval")(eval_cmd.eval_)
app.command("inspect")(inspect_cmd.inspect)
app.command("generate")(generate_cmd.generate)
app.command("export")(export_cmd.export)
app.command("report")(report_cmd.report)


def _click_errors(name: str) -> tuple[type, ...]:
    """click's exception class `name`, and typer's vendored copy of it (typer >= 0.2x ships its own click,
    whose usage errors are not subclasses of the installed click's)."""
    import importlib

    out = [getattr(click.exceptions, name)]
    try:
        out.append(getattr(importlib.import_module("typer._click.exceptions"), name))
    except (ImportError, AttributeError):
        pass
    return tuple(out)


def main() -> None:
    logging.basicConfig(level=os.environ.get("MOEC_LOG", "INFO"), format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False, show_time=False)])
    for noisy in ("httpx", "datasets", "filelock", "urllib3", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    install_progress(console)  # every long step's progress and ETA: bars on a terminal, timestamped lines elsewhere
    try:
        rc = app(prog_name="moec", standalone_mode=False)  # `moec` in usage lines under python -m too
        sys.exit(rc if isinstance(rc, int) else 0)
    except _click_errors("NoArgsIsHelpError"):  # bare `moec`: the help was printed, which is what was asked
        sys.exit(0)
    except _click_errors("UsageError") as e:
        print(f"moec: error: {e.format_message()}", file=sys.stderr)
        sys.exit(2)
    except UserError as e:
        print(f"moec: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (*_click_errors("Abort"), KeyboardInterrupt):
        print("moec: interrupted", file=sys.stderr)
        sys.exit(130)
    except _click_errors("Exit") as e:
        sys.exit(e.exit_code)
    except Exception as e:
        if os.environ.get("MOEC_DEBUG"):
            raise
        msg = str(e).splitlines()[0] if str(e) else ""
        print(f"moec: internal error: {type(e).__name__}: {msg} (MOEC_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        sys.exit(1)
    finally:  # main() called in-process (tests, gpu_smoke) leaves no reporter behind
        set_reporter(None)


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
def _as_a_fresh_process(columns: int | None):
    """The root logger as a fresh process has it (no handler, level WARNING), so main()'s basicConfig installs
    the CLI's handler on the captured stderr, and the CLI's consoles `columns` wide (a console made earlier
    may have fixed its width at 80); both come back afterwards."""
    from rich.console import Console

    from . import common

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    consoles = [c for c in vars(common).values() if isinstance(c, Console)] if columns else []
    sizes = [(c._width, c._height) for c in consoles]
    root.handlers, root.level = [], logging.WARNING
    for c in consoles:
        c.width = columns
    try:
        yield
    finally:
        root.handlers, root.level = handlers, level
        for c, (w, h) in zip(consoles, sizes, strict=True):
            c._width, c._height = w, h


def run(*args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`moec ARGS` in this process, as a `moec` process would run it: main() with sys.argv set, the
    environment updated by `env` for the call (COLUMNS there also sizes the consoles), the exit code, stdout
    and stderr captured (Python warnings printed to the captured stderr). For callers that run many commands
    (tests, benchmarks/behaviour_ref.py, benchmarks/gpu_smoke.py): a process would pay torch's and
    transformers' imports each time."""
    env = env or {}
    argv = ["moec", *map(str, args)]
    out, err = io.StringIO(), io.StringIO()

    def show(message, category, filename, lineno, file=None, line=None):  # as a process prints them
        err.write(warnings.formatwarning(message, category, filename, lineno, line))

    old_argv = sys.argv
    with _environ(env), _as_a_fresh_process(int(env["COLUMNS"]) if "COLUMNS" in env else None), \
            warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
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


if __name__ == "__main__":
    main()
