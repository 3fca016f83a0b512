"""Progress of long steps: the plain lines (content, rate bound, ETA arithmetic), the rich bars, the CLI's choice."""

import io
import os
import re
import subprocess
import sys
import time

from rich.console import Console

from moec import progress
from moec.cli.progress import PlainLines, RichBars, amount, duration, eta, reporter_for

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d"
ANSI = re.compile(r"\x1b|\r")


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_duration_amount_eta():
    assert [duration(s) for s in (0, 41.4, 59.6, 250, 3599, 3720)] == ["0 s", "41 s", "1m00s", "4m10s", "59m59s",
                                                                       "1h02m"]
    assert amount(3, 24, "") == "3/24" and amount(3, 24, "layers") == "3/24 layers"
    assert amount(1.5 * 2**30, 4 * 2**30, "B") == "1.5/4.0 GiB" and amount(10, 700, "B") == "10/700 B"
    assert eta(10, 0, 5) is None
    assert eta(41, 3, 24) == 41 * 21 / 3  # mean rate over everything so far
    assert eta(41, 3, 24, since=(20, 1)) == (41 - 20) * 21 / 2  # the rate since the first unit


def test_plain_lines_content_rate_and_eta():
    out, clock = io.StringIO(), Clock(1_000_000.0)
    rep = PlainLines(out, clock=clock, interval=5.0)
    prev = progress.install(rep)
    try:
        with progress.track("calibrate layers", 24, "layers") as advance:
            clock.t += 20  # loading data and weights before the first layer: not part of the rate
            advance()
            for _ in range(23):  # then 10 s a layer, 4 units reported per line at most (5 s interval)
                clock.t += 10
                advance()
    finally:
        progress.install(prev)
    lines = out.getvalue().splitlines()
    assert not ANSI.search(out.getvalue())
    assert all(re.match(STAMP + " calibrate layers: ", x) for x in lines), lines
    body = [x.split(" ", 1)[1] for x in lines]
    assert body[0] == "calibrate layers: 1/24 layers, 20 s elapsed, ETA 7m40s"  # 20 s × 23 (one unit seen)
    assert body[1] == "calibrate layers: 2/24 layers, 30 s elapsed, ETA 3m40s"  # 10 s/layer since the first × 22
    assert body[-1] == "calibrate layers: 24/24 layers done in 4m10s"
    assert len(lines) == 24  # 23 progress lines (every advance is >= 5 s after the last line) + the final one
    assert lines[-1].split(" ")[0] == time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(clock.t))


def test_plain_lines_bounded_rate_and_interrupted_step():
    out, clock = io.StringIO(), Clock(1_000_000.0)
    rep = PlainLines(out, clock=clock, interval=5.0)
    task = rep.start("hashing w.safetensors", 1000 * 2**20, "B")
    for _ in range(480):  # 1 MiB every 1/8 s for 60 s: a line every 5 s (12), not 480, and the final one
        clock.t += 0.125
        task.advance(2**20)
    task.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 13, lines
    assert lines[0].endswith("hashing w.safetensors: 40.0/1000.0 MiB, 5 s elapsed, ETA 2m00s"), lines[0]
    assert lines[-1].endswith("hashing w.safetensors: 480.0/1000.0 MiB stopped after 1m00s"), lines[-1]
    t = rep.start("hashing \x1b[31mred\rx", 1, "")  # a file name's control characters are not passed on
    clock.t += 6
    t.close()
    assert out.getvalue().splitlines()[-1].endswith("hashing ?[31mred?x: 0/1 stopped after 6 s")
    n = len(out.getvalue().splitlines())
    rep.start("hashing quick", 1, "").close()  # quicker than the interval, no line before: silent
    assert len(out.getvalue().splitlines()) == n


def test_resumed_units_do_not_count_in_the_rate():
    out, clock = io.StringIO(), Clock(0.0)
    task = PlainLines(out, clock=clock, interval=0.0).start("calibrate layers", 10, "")
    clock.t = 20  # set-up: data, weights, the checkpoint read
    for _ in range(5):  # layers done before an interruption, reported at once on --resume
        task.advance()
    clock.t = 30
    task.advance()  # one layer: 10 s, 4 left
    assert out.getvalue().splitlines()[-1].endswith("calibrate layers: 6/10, 30 s elapsed, ETA 40 s")
    clock.t = 40
    task.advance()  # 10 s a layer, 3 left
    assert out.getvalue().splitlines()[-1].endswith("calibrate layers: 7/10, 40 s elapsed, ETA 30 s")


def test_no_reporter_is_silent_and_tracked_counts_after_the_body():
    progress.install(None)
    seen = []
    with progress.track("x", 3) as advance:
        advance()  # nothing installed: a no-op
    out, clock = io.StringIO(), Clock(0.0)
    progress.install(PlainLines(out, clock=clock, interval=0.0))
    try:
        for i in progress.tracked(range(3), "items", 3):
            seen.append(i)
            clock.t += 1
    finally:
        progress.install(None)
    assert seen == [0, 1, 2]
    assert out.getvalue().splitlines()[-1].endswith("items: 3/3 done in 3 s")
    assert "items: 1/3, 1 s elapsed, ETA 2 s" in out.getvalue()


def test_rich_bars_nest_and_leave_one_line_per_step():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    prev = progress.install(RichBars(console))
    try:
        with progress.track("calibrate layers", 2) as outer:
            with progress.track("hashing w", 4096, "B") as inner:
                inner(4096)
            outer(2)
    finally:
        progress.install(prev)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    assert "hashing w: 4.0/4.0 KiB in 0 s" in text and "calibrate layers: 2/2 in 0 s" in text, text


def test_reporter_choice():
    plain = Console(file=io.StringIO())  # not a terminal
    tty = Console(file=io.StringIO(), force_terminal=True)
    assert reporter_for(plain, {"MOEC_PROGRESS": "0"}) is None
    assert isinstance(reporter_for(plain, {}), PlainLines)
    assert isinstance(reporter_for(tty, {}), RichBars)
    assert isinstance(reporter_for(tty, {"MOEC_PROGRESS": "plain"}), PlainLines)
    assert isinstance(reporter_for(plain, {"MOEC_PROGRESS": "1"}), RichBars)
    assert reporter_for(plain, {"MOEC_PROGRESS_SECONDS": "2"}).interval == 2.0


def test_cli_not_on_a_terminal_prints_timestamped_eta_lines(tiny_moe_dir, tmp_path):
    """A calibration and a pack with stderr captured (not a terminal): ETA lines, no control characters."""
    env = {k: v for k, v in os.environ.items() if k != "MOEC_PROGRESS"}
    env.update(MOEC_PROGRESS_SECONDS="0", COLUMNS="200", OMP_NUM_THREADS="1")
    calib, packed = tmp_path / "calib", tmp_path / "packed"
    runs = [["calibrate", tiny_moe_dir, "--recipe", "moec/recipes/ablations/experts-rtn3.yaml", "--data", "ptb",
             "--split", "valid", "--samples", "2", "--seq-len", "32", "-o", calib],
            ["pack", tiny_moe_dir, calib, "-o", packed]]
    err = ""
    for args in runs:
        r = subprocess.run([sys.executable, "-m", "moec.cli.app", *map(str, args)], capture_output=True, text=True,
                           env=env, timeout=600)
        assert r.returncode == 0, r.stderr
        err += r.stderr
    assert not ANSI.search(err), repr(err)
    lines = err.splitlines()
    eta_lines = [x for x in lines if re.fullmatch(STAMP + r" calibrate layers: 1/2, \d+ s elapsed, ETA \d+ s", x)]
    assert len(eta_lines) == 1, err
    for step in ("calibrate layers: 2/2 done in", "layer 1: fitting 5 experts: 3/3 matrices done in",
                 "hashing tiny-moe", "packing tensors: ", "writing packed: 1/1 shards done in"):
        assert any(re.match(STAMP + " " + re.escape(step), x) for x in lines), (step, err)
