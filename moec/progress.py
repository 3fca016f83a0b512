"""Progress of long steps (capture, per-layer fitting, hashing, packing, eval windows).

Library code says what it is doing and how far it got:

    with track("hashing model.safetensors", total=n_bytes, unit="B") as advance:
        ...
        advance(len(chunk))

and the CLI decides how that is shown, by installing a reporter (moec/cli/progress.py: a rich bar with
elapsed time and ETA on a terminal, plain timestamped lines otherwise). Without one (the library used
from Python, most tests) a tracked step costs one function call per advance. Standard library only, so
every layer of the package (formats, runtime, calibrate) may use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

Advance = Callable[..., None]  # advance(n=1): n more units done


class Task(Protocol):
    def advance(self, n: float = 1) -> None: ...

    def close(self) -> None: ...


class Reporter(Protocol):
    def start(self, label: str, total: float, unit: str) -> Task: ...


_reporter: Reporter | None = None
T = TypeVar("T")


def install(reporter: Reporter | None) -> Reporter | None:
    """Make `reporter` show every tracked step from now on (None: show nothing); returns the previous one."""
    global _reporter
    prev, _reporter = _reporter, reporter
    return prev


def _ignore(n: float = 1) -> None:
    pass


@contextmanager
def track(label: str, total: float, unit: str = "") -> Iterator[Advance]:
    """Yields advance(n=1) for a step of `total` units ("B" for bytes, "" for counted items)."""
    rep = _reporter
    if rep is None or total <= 0:
        yield _ignore
        return
    task = rep.start(label, total, unit)
    try:
        yield task.advance
    finally:
        task.close()


def tracked(items: Iterable[T], label: str, total: float, unit: str = "") -> Iterator[T]:
    """`items`, one unit of progress each, counted when the loop body that received it is done."""
    with track(label, total, unit) as advance:
        for x in items:
            yield x
            advance()
