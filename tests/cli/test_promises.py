"""What the README promises a user sees: the memory estimate calibrate prints, progress inside every long
step (the KV fit, each eval window), result tables whole when stdout is a file or a pipe, and `eval
--seq-len` (the old `--window`, which read like the cache's window, refused in one line naming it)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml

from moec import progress
from moec.calibrate.recipe import parse_recipe
from moec.cli import app as cli
from moec.cli import latency_cmd
from moec.cli.progress import PlainLines
from moec.registry import kv_codec
from moec.runtime.config import ModelArgs
from tests.cli.test_cli_habits import run

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d"


def _moec(*args) -> subprocess.CompletedProcess:
    """`moec ARGS` as a user runs it with both outputs piped: every progress line (interval 0), and an 80-column
    COLUMNS (rich's width for a pipe) that a result table must not be cut to."""
    env = dict(os.environ, MOEC_PROGRESS="plain", MOEC_PROGRESS_SECONDS="0", COLUMNS="80", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "moec.cli.app", *map(str, args)], capture_output=True, text=True,
                          env=env, stdin=subprocess.DEVNULL, timeout=600)


def _lines(err: str, label: str) -> list[str]:
    return [x for x in err.splitlines() if re.match(STAMP + " " + re.escape(label) + ": ", x)]


def test_calibrate_prints_its_memory_estimate_and_the_kv_fit_progress(tiny_moe_dir, tmp_path):
    recipe = tmp_path / "nuq.yaml"
    recipe.write_text(yaml.safe_dump({"name": "nuq", "kv": {"codec": "nuq-outlier", "bits": 2, "window": 16,
                                                            "sinks": 2, "outlier_frac": 0.02}}))
    r = _moec("calibrate", tiny_moe_dir, "--recipe", recipe, "--data", "ptb", "--split", "valid", "--samples", "2",
              "--seq-len", "64", "-o", tmp_path / "calib")
    assert r.returncode == 0, r.stderr
    err = r.stderr.splitlines()
    mem = [x for x in err if x.startswith("memory estimate: ")]
    assert len(mem) == 1, r.stderr
    assert re.fullmatch(r"memory estimate: host \d+\.\d\d GB \(available \d+\.\d\d GB\)", mem[0]), mem
    fit = _lines(r.stderr, "fitting the nuq-outlier KV cache")
    assert re.search(r": 1/2 layers, \d+ s elapsed, ETA \d+ s$", fit[0]), fit
    assert re.search(r": 2/2 layers done in \d+ s$", fit[-1]), fit
    # the layer loop's final line comes when the loop ends, before the KV fit, not after everything
    (layers_done,) = [i for i, x in enumerate(err) if re.match(STAMP + " calibrate layers: 2/2 done in", x)]
    assert err.index(mem[0]) < layers_done < err.index(fit[0])
    report = json.loads((tmp_path / "calib" / "report.json").read_text())
    for e in report["layers"]:  # the table's rows whole on stdout (a pipe)
        row = [x for x in r.stdout.splitlines() if re.match(rf"│ {e['layer']} +│", x)]
        assert len(row) == 1 and f"{e['k_absmax']:.2f}" in row[0] and f"{e['v_absmax']:.2f}" in row[0], r.stdout


def _samples(sampler, args: ModelArgs, tokens: int = 64) -> None:
    g = torch.Generator().manual_seed(0)
    for i in range(args.n_layers):  # one batch [B, heads, T, d] per layer and name, as capture feeds them
        for name, heads in (("q", args.n_heads), ("k_pre", args.n_kv_heads), ("k", args.n_kv_heads),
                            ("v", args.n_kv_heads)):
            sampler(i, name, torch.randn(1, heads, tokens, args.head_dim, generator=g))


@pytest.mark.parametrize("kv, total, unit", [
    ({"codec": "nuq-outlier", "bits": 2, "levels": "fitted"}, 3, "layers"),
    ({"codec": "latent-layer", "bits": 4, "latent": {"rank_k": 16, "rank_v": 16, "group_layers": 2}}, 2,
     "layer groups"),
    ({"codec": "rvq-tiered", "bits": 2, "rvq": {"mid_sizes": [8], "mid_dim": 4, "iters": 2}}, 3, "layers"),
])
def test_every_kv_fit_shows_progress(kv, total, unit):
    """The KV fit of each codec with a fit step reports each layer (or layer group) as it is fitted."""
    args = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16)
    cfg = parse_recipe({"name": "kv", "kv": kv}).kv_or_default()
    spec = kv_codec(cfg.codec)
    sampler = spec.hook("sampler")(cfg, 0)
    _samples(sampler, args)
    out = io.StringIO()
    prev = progress.install(PlainLines(out, interval=0.0))
    try:
        spec.hook("fit")(args, cfg, sampler, "cpu")
    finally:
        progress.install(prev)
    lines = _lines(out.getvalue(), f"fitting the {cfg.codec} KV cache")
    assert [int(re.search(rf": (\d+)/{total} {unit}", x).group(1)) for x in lines] == list(range(1, total + 1)), lines
    assert f": {total}/{total} {unit} done in " in lines[-1], lines


def test_eval_reports_inside_each_window_and_prints_the_table_whole(tiny_moe_dir, tmp_path):
    """One window of 128 tokens (96 scored positions), both modes, against a baseline: tf reports after each
    of the 2 layers of the window's forward, dec after each position; the table (10 columns, wider than
    80) is printed with every number whole to the pipe."""
    out = tmp_path / "eval.json"
    r = _moec("eval", tiny_moe_dir, "--baseline", tiny_moe_dir, "--mode", "both", "--max-windows", "1",
              "--seq-len", "128", "--json", out)
    assert r.returncode == 0, r.stderr
    tf, dec = _lines(r.stderr, "eval tf (1 window of 128)"), _lines(r.stderr, "eval dec (1 window of 128)")
    assert [x.split(": ", 1)[1].split(",")[0] for x in tf[:-1]] == ["48/96 positions"], tf
    assert [int(re.search(r": (\d+)/96 positions,", x).group(1)) for x in dec[:-1]] == list(range(1, 96)), dec
    assert "96/96 positions done in" in tf[-1] and "96/96 positions done in" in dec[-1], (tf, dec)
    assert "…" not in r.stdout, r.stdout
    for rec in json.loads(out.read_text()):
        (row,) = [x for x in r.stdout.splitlines() if re.match(rf"│ +{rec['mode']} │", x)]
        cells = [c.strip() for c in row.strip("│").split("│")]
        want = [rec["mode"], f"{rec['ppl']:.4f}", f"{rec['ppl_base']:.4f}", f"{rec['delta_pct']:+.3f}",
                f"{rec['kld']:.5f}", f"{rec['top1']:.4f}", f"{rec['w_bits']:.2f}", "-"]
        want += [f"{rec['kv_bits']:.2f}", f"{rec['kv_bits_32k']:.2f}"] if rec["mode"] == "dec" else ["-", "-"]
        assert cells == want, (cells, want)


def test_tables_are_whole_when_stdout_is_not_a_terminal(monkeypatch, capsys):
    """`moec models` and the latency table (12 columns) to a pipe with COLUMNS=80: one line per row, every
    number whole, no `…`."""
    monkeypatch.setattr(sys, "argv", ["moec", "models"])
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as e:
        cli.main()
    out = capsys.readouterr().out
    assert e.value.code == 0 and "…" not in out, out
    (row,) = [x for x in out.splitlines() if "mixtral-8x7b" in x]
    assert "expert ffn 14336" in row, out
    lat = {"bench": "moec-latency", "shape": "mixtral-8x7b", "recipe": "latency-hls2-nuq2-w512", "batch": 16,
           "context": 131072, "ms_median": 12.345678, "ms_p10": 12.2345, "ms_p90": 12.4567,
           "bytes_per_step": 51.234e9, "floor_ms": 10.9876, "pct_of_floor": 89.01234, "speedup_vs_bf16": 1.8312,
           "tokens_per_s": 1296.0123}
    latency_cmd.print_table([lat])
    out = capsys.readouterr().out
    assert "…" not in out, out
    (row,) = [x for x in out.splitlines() if "mixtral-8x7b" in x]
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells == ["mixtral-8x7b", "latency-hls2-nuq2-w512", "16", "131072", "12.346", "12.235", "12.457", "51.23",
                     "10.988", "89", "1.83", "1296"], cells


def test_eval_window_was_renamed_seq_len(monkeypatch, capsys):
    """--window (tokens per evaluation window) read like the cache's kv.window: refused, naming --seq-len."""
    rc, _, err = run(monkeypatch, capsys, "eval", "demo-moe", "--window", "512", "--max-windows", "1")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "--window was renamed --seq-len" in err and "--seq-len 512" in err and "kv.window" in err, err
    rc, out, _ = run(monkeypatch, capsys, "eval", "-h")
    assert rc == 0 and "--seq-len" in out and not re.search(r"--window\b", out), out
