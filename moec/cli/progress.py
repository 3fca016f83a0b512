"""How the CLI shows tracked steps (moec/progress.py): elapsed time and ETA for every long step.

On a terminal: rich bars on stderr (one live display shared by nested steps, e.g. hashing inside a
calibration). Elsewhere (a log file, CI, a pipe): plain timestamped lines, at most one per step every
MOEC_PROGRESS_SECONDS (default 5) plus a final line (steps quicker than that print nothing), with no control
characters, e.g.

    2026-12-01T23:59:01 calibrate layers: 3/24, 41 s elapsed, ETA 4m47s

MOEC_PROGRESS=0 shows nothing, =plain forces the lines, =1 forces the bars.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from rich.console import Console
from rich.errors import LiveError
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from .. import progress as _progress


def duration(seconds: float) -> str:
    """41 s, 4m10s, 1h02m: short enough for a line, exact enough for an ETA."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def amount(done: float, total: float, unit: str) -> str:
    """3/24, 3/24 layers, or 1.2/4.0 GiB for bytes (the total's binary unit for both)."""
    if unit == "B":
        scale, name = next(((2.0**p, n) for p, n in ((30, "GiB"), (20, "MiB"), (10, "KiB")) if total >= 2**p),
                           (1.0, "B"))
        digits = 0 if name == "B" else 1
        return f"{done / scale:.{digits}f}/{total / scale:.{digits}f} {name}"
    return f"{done:g}/{total:g}" + (f" {unit}" if unit else "")


def eta(elapsed: float, done: float, total: float, since: tuple[float, float] | None = None) -> float | None:
    """Seconds left at the mean rate so far (None before the first unit is done). since = (elapsed, done)
    at the first unit: the rate from there on, once there is more, leaves set-up time (loading data and
    weights before the first layer, units skipped by a resume) out of the rate."""
    if done <= 0:
        return None
    if since is not None and done > since[1] and elapsed > since[0]:
        return (elapsed - since[0]) * max(total - done, 0) / (done - since[1])
    return elapsed * max(total - done, 0) / done


class PlainLines:
    """Timestamped lines on `stream`: one per step every `interval` seconds at most, and a final one for a
    step that took at least `interval` seconds or printed a line before."""

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.time, interval: float = 5.0):
        self.stream, self.clock, self.interval = stream, clock, interval  # None: sys.stderr when a line is written

    def start(self, label: str, total: float, unit: str) -> _PlainTask:
        return _PlainTask(self, label, total, unit)

    def line(self, now: float, text: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now))
        text = "".join(c if c.isprintable() else "?" for c in text)  # a file name may hold control characters
        out = self.stream or sys.stderr
        out.write(f"{stamp} {text}\n")
        out.flush()


class _PlainTask:
    def __init__(self, out: PlainLines, label: str, total: float, unit: str):
        self.out, self.label, self.total, self.unit = out, label, total, unit
        self.done = 0.0
        self.t0 = self.last = out.clock()
        self.since: tuple[float, float] | None = None  # (elapsed, done) at the first unit (see eta)

    def advance(self, n: float = 1) -> None:
        self.done += n
        now = self.out.clock()
        if self.since is None or now - self.t0 - self.since[0] < 0.5:  # a burst of units at once: set-up
            self.since = (now - self.t0, self.done)
        if now - self.last >= self.out.interval and self.done < self.total:
            self.last = now
            elapsed = now - self.t0
            left = eta(elapsed, self.done, self.total, self.since)
            self.out.line(now, f"{self.label}: {amount(self.done, self.total, self.unit)}, {duration(elapsed)} "
                               f"elapsed, ETA {'?' if left is None else duration(left)}")

    def close(self) -> None:
        now = self.out.clock()
        if now - self.t0 < self.out.interval and self.last == self.t0:
            return  # a step quicker than one interval, with no line yet, stays silent (a one-line error stays one)
        what = "done in" if self.done >= self.total else "stopped after"
        self.out.line(now, f"{self.label}: {amount(self.done, self.total, self.unit)} {what} "
                           f"{duration(now - self.t0)}")


class _Amount(ProgressColumn):
    def render(self, task) -> Text:
        return Text(amount(task.completed, task.total or 0, task.fields.get("unit", "")), style="progress.download")


class RichBars:
    """rich bars on `console`; one Progress for all open steps, stopped when the last one closes."""

    def __init__(self, console: Console):
        self.console = console
        self.progress: Progress | None = None
        self.open = 0

    def start(self, label: str, total: float, unit: str):
        if self.progress is None:
            p = Progress(TextColumn("{task.description}"), BarColumn(), _Amount(), TimeElapsedColumn(),
                         TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=True)
            try:
                p.start()
            except LiveError:  # another live display (a status spinner) under rich < 14: show nothing
                return _NoTask()
            self.progress = p
        self.open += 1
        return _RichTask(self, self.progress.add_task(label, total=total, unit=unit), label)

    def closed(self, task_id, label: str) -> None:
        p = self.progress
        t = p.tasks[[x.id for x in p.tasks].index(task_id)]
        # the bars are transient: a finished step leaves one line saying how long it took
        self.console.print(f"{label}: {amount(t.completed, t.total or 0, t.fields['unit'])} in "
                           f"{duration(t.elapsed or 0.0)}", markup=False, highlight=False, style="dim")
        p.remove_task(task_id)
        self.open -= 1
        if self.open == 0:
            p.stop()
            self.progress = None


class _RichTask:
    def __init__(self, bars: RichBars, task_id, label: str):
        self.bars, self.id, self.label = bars, task_id, label

    def advance(self, n: float = 1) -> None:
        self.bars.progress.advance(self.id, n)

    def close(self) -> None:
        self.bars.closed(self.id, self.label)


class _NoTask:
    def advance(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass


def reporter_for(console: Console, env: Mapping[str, str] = os.environ, stream: TextIO | None = None):
    """The reporter the environment asks for (module docstring); None: show nothing."""
    mode = env.get("MOEC_PROGRESS", "")
    if mode == "0":
        return None
    if mode == "plain" or (mode != "1" and not console.is_terminal):
        try:
            interval = float(env.get("MOEC_PROGRESS_SECONDS", "5"))
        except ValueError:
            interval = 5.0
        return PlainLines(stream, interval=interval)
    return RichBars(console)


def install(console: Console) -> None:
    _progress.install(reporter_for(console))
