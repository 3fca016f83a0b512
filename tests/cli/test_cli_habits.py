"""CLI habits: -h, --version, bare `moec`, eval's help panels, random-shape names, docs/metrics.md, inspect.

In-process through `moec.cli.app.main` (the exit-code wrapper a user's `moec` runs), not in subprocesses:
each of these is a fraction of a second once the package is imported.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from rich.table import Table

import moec
from moec.cli import app as cli
from moec.cli import common, eval_cmd, inspect_cmd, latency_cmd

METRICS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def run(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `moec ARGS`, run in this process."""
    monkeypatch.setattr(sys, "argv", ["moec", *map(str, args)])
    monkeypatch.setenv("COLUMNS", "200")  # typer's help formatter reads it per call: no wrapped option names
    with pytest.raises(SystemExit) as e:
        cli.main()
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_bare_moec_shows_help_and_exits_0(monkeypatch, capsys):
    rc, out, err = run(monkeypatch, capsys)
    assert rc == 0, err
    assert "Usage: moec" in out and "calibrate" in out and "docs/metrics.md" in out
    assert "error" not in err


@pytest.mark.parametrize("args", [("-h",), ("--help",), ("eval", "-h"), ("inspect", "-h")])
def test_short_and_long_help(monkeypatch, capsys, args):
    rc, out, _ = run(monkeypatch, capsys, *args)
    assert rc == 0 and "Usage: moec" in out


def test_version(monkeypatch, capsys):
    rc, out, _ = run(monkeypatch, capsys, "--version")
    assert rc == 0 and out.strip() == f"moec {moec.__version__}"


def test_eval_help_puts_latency_options_in_their_own_panel(monkeypatch, capsys):
    rc, out, _ = run(monkeypatch, capsys, "eval", "-h")
    assert rc == 0
    quality = out.index("Perplexity and KL")
    latency = out.index("Decode latency (--latency; GPU only)")
    assert quality < latency
    for opt in ("--seq-len", "--baseline", "--mode", "--max-windows"):  # quality options above the latency panel
        assert quality < out.index(opt) < latency, opt
    for opt in ("--contexts", "--batches", "--steps", "--prefill-contexts", "--breakdown", "--plot", "--random"):
        assert out.index(opt) > latency, opt
    assert "docs/metrics.md" in out and "BENCHMARKS" not in out


@pytest.mark.parametrize("command", [("calibrate", "mixtral-8x7b", "-r", "moec/recipes/fp16.yaml", "-o", "{tmp}/c"),
                                     ("eval", "qwen3-30b-a3b")])
def test_random_shape_name_is_explained(monkeypatch, capsys, tmp_path, command):
    """`moec models` lists the performance shapes beside the models; using one as MODEL says what it is for."""
    args = [a.format(tmp=tmp_path) for a in command]
    rc, _, err = run(monkeypatch, capsys, *args)
    shape = args[1]
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "performance shape" in err and f"--random {shape}" in err and "demo-moe" in err, err
    assert not (tmp_path / "c").exists()


def test_random_without_latency_is_explained(monkeypatch, capsys):
    rc, _, err = run(monkeypatch, capsys, "eval", "--random", "smoke-moe")
    assert rc == 2 and "add --latency" in err and len(err.strip().splitlines()) == 1, err


def _headers(monkeypatch, fn, *a) -> list[str]:
    """Column headers of every table `fn` prints through the CLI's out_console (moec/cli/common.py)."""
    tables = []
    monkeypatch.setattr(common.out_console, "print", lambda obj=None, *_, **__: tables.append(obj))
    fn(*a)
    return [str(c.header) for t in tables if isinstance(t, Table) for c in t.columns]


def test_metrics_doc_defines_every_column(monkeypatch):
    """docs/metrics.md (which every help text cites) names each column the eval, latency and inspect tables
    print, and each metric the issue lists."""
    doc = METRICS.read_text()
    rec = {"model": "m", "data": "ptb", "split": "test", "windows": "1 window", "dtype": "fp32", "context": 1024,
           "mode": "dec", "ppl": 10.0, "ppl_base": 9.0, "delta_pct": 11.1, "kld": 0.1, "top1": 0.9, "w_bits": 16.0,
           "q_bits": None, "kv_bits": 4.1, "kv_bits_32k": 2.2}
    cols = _headers(monkeypatch, eval_cmd._print_table, [rec])
    assert "kv bits @1024" in cols and "kv bits @32k" in cols, cols
    lat = {"bench": "moec-latency", "shape": "s", "recipe": "r", "batch": 1, "context": 4096, "ms_median": 1.0,
           "ms_p10": 0.9, "ms_p90": 1.1, "bytes_per_step": 1e9, "floor_ms": 0.5, "pct_of_floor": 50.0,
           "tokens_per_s": 1000.0}
    pre = {"bench": "moec-latency-prefill", "shape": "s", "recipe": "r", "context": 4096, "prefill_s": 1.0,
           "prefill_tokens_per_s": 4096.0}
    cols += _headers(monkeypatch, latency_cmd.print_table, [lat, pre])
    assert "floor ms" in cols and "seconds" in cols, cols
    cols += ["group", "layers", "codec", "bits", "dtype", "tensors", "size", "tensor", "shape"]  # inspect
    missing = [c for c in cols if f"`{re.sub(r'@[0-9]+$', '@W', c)}`" not in doc]
    assert not missing, f"docs/metrics.md does not define {missing}"
    for metric in ("ppl_tf", "ppl_dec", "Δppl", "KL", "w_bits", "q_bits", "kv_bits", "kv_bits_32k", "ms/token",
                   "floor", "% of floor", "tokens/s", "top1"):
        assert metric in doc, metric


def test_inspect_groups_layers_and_names_dense_mlps(monkeypatch, capsys, tmp_path):
    """12 layers, two dense then ten MoE: one row per kind with its layer range, `mlp.*` for the dense ones,
    natural order with --per-tensor."""
    from moec.calibrate.pack import pack_random
    from moec.calibrate.recipe import load_recipe
    from moec.runtime.config import ModelArgs

    args = ModelArgs(arch="qwen3_moe", vocab_size=64, dim=16, n_layers=12, n_heads=2, n_kv_heads=1, head_dim=8,
                     qk_norm="head", ffn_kinds=["dense"] * 2 + ["moe"] * 10, dense_dim=16, n_experts=2, top_k=1,
                     expert_dim=8)
    pack_random(args, "tiny-mixed", load_recipe(Path("moec/recipes/fp16.yaml")), tmp_path / "p")

    rc, _, err = run(monkeypatch, capsys, "inspect", tmp_path / "p", "--json", tmp_path / "g.json")
    assert rc == 0, err
    groups = {g["group"]: g for g in json.loads((tmp_path / "g.json").read_text())["groups"]}
    assert groups["layers.*.mlp.w1"]["layers"] == [0, 1] and groups["layers.*.mlp.w1"]["tensors"] == 2
    assert groups["layers.*.moe.w1"]["layers"] == list(range(2, 12))
    assert groups["layers.*.attn.wq.weight"]["tensors"] == 12
    assert not any(re.search(r"layers\.\d", g) for g in groups), sorted(groups)  # every per-layer tensor grouped

    rc, _, err = run(monkeypatch, capsys, "inspect", tmp_path / "p", "--per-tensor", "--json", tmp_path / "t.json")
    assert rc == 0, err
    names = [g["group"] for g in json.loads((tmp_path / "t.json").read_text())["groups"]]
    wq = [n for n in names if n.endswith("attn.wq.weight")]
    assert wq == [f"layers.{i}.attn.wq.weight" for i in range(12)], wq  # layers.2 before layers.10
    assert "layers.0.moe.w1" in names  # --per-tensor keeps the stored names


def test_inspect_helpers():
    assert inspect_cmd.layer_ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert inspect_cmd.layer_ranges([]) == "-"
    assert sorted(["l.10", "l.2", "l.1"], key=inspect_cmd.natural_key) == ["l.1", "l.2", "l.10"]
    assert [inspect_cmd.human_bytes(n) for n in (512, 3 << 10, 5 << 20)] == ["512 B", "3.00 KiB", "5.00 MiB"]
