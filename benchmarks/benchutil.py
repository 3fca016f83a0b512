"""Helpers shared by the benchmark scripts: the CLI as a user runs it, and CUDA step timing.

Imported as `benchmarks.benchutil`: the scripts run from the repository root as `python3 -m benchmarks.NAME`
(benchmarks/README.md). Library code a test needs belongs in moec/, not here.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def cli(*args) -> None:
    """Run `moec ARGS...` as a user would (a separate process, no progress bars); raise with its stderr."""
    env = dict(os.environ, MOEC_PROGRESS="0")
    r = subprocess.run([sys.executable, "-m", "moec.cli.app", *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"moec {' '.join(map(str, args))} failed:\n{r.stderr[-3000:]}")


def time_step(fn, reps: int) -> list[float]:
    """ms of each of `reps` calls of fn (CUDA events, synchronized), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out


def graph_times(fn, reps: int) -> list[float]:
    """ms of each of `reps` replays of fn captured in a CUDA graph (after a warm-up call), as the decode
    engine runs a step: no Python launch overhead."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    out = time_step(g.replay, reps)
    del g
    return out


def copy_bandwidth() -> float:
    """GB/s of a 4 GiB device-to-device copy, read + write counted (median of 10)."""
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ts = time_step(lambda x=x, y=y: y.copy_(x), 10)
    return 2 * (4 << 30) / (statistics.median(ts) / 1e3) / 1e9


def stats(ts: list[float]) -> dict:
    """Median, p10 and p90 of step times in ms."""
    ts = sorted(ts)
    return {"ms_median": statistics.median(ts), "ms_p10": ts[len(ts) // 10], "ms_p90": ts[(9 * len(ts)) // 10]}


def recorder(res: dict, out: Path):
    """record(**fields): appends a record to res["records"], prints it as a JSON line and rewrites `out` (atomically),
    so a run cut short keeps what it measured."""
    from moec.atomic import write_json

    def record(**kw) -> None:
        res["records"].append(kw)
        print(json.dumps(kw), flush=True)
        write_json(out, res)

    return record

