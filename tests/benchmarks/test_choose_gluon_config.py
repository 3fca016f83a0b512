"""benchmarks/choose_gluon_config.py, run as the GPU call runs it: a candidate is adopted only when it is faster
in geometric mean by the margin, slower nowhere beyond the tolerance, and every check passed; the device file it
writes is one the launch-config loader accepts."""

import json
import subprocess
import sys
from pathlib import Path

from moec.kernels import launch_config

REPO = Path(__file__).resolve().parents[2]


def _choose(tmp_path, w4: list[float], ok=True):
    rows = []
    for (shape, ctx, b), ms in zip([("mixtral", 32768, 1), ("mixtral", 32768, 16), ("qwen3", 32768, 1)], w4,
                                   strict=True):
        base = {"shape": shape, "context": ctx, "batch": b}
        rows += [base | {"path": "gluon", "ms_median": 1.0},
                 base | {"path": "gluon-sweep", "ms_median": ms, "warps": 4},
                 base | {"path": "gluon-sweep", "ms_median": 0.5, "n_splits": 16}]  # not a candidate
    tmp_path.mkdir(parents=True, exist_ok=True)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "all_checks_ok": ok, "timings": rows}))
    cfg = tmp_path / "cfg"
    p = subprocess.run([sys.executable, "-m", "benchmarks.choose_gluon_config", str(bench), str(cfg)], cwd=REPO,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    f = cfg / "nvidia_h100_80gb_hbm3.json"
    return json.loads(f.read_text()) if f.is_file() else None


def test_adopts_a_clear_win_as_a_valid_device_file(tmp_path):
    written = _choose(tmp_path, [0.8, 0.9, 0.85])
    assert written["kv_decode_attention"]["gluon"] == {"warps": 4}
    merged = launch_config._merge(launch_config.defaults(), written, "test")
    assert merged["kv_decode_attention"]["gluon"]["warps"] == 4


def test_keeps_the_shipped_config_otherwise(tmp_path):
    assert _choose(tmp_path / "a", [0.8, 1.05, 0.85]) is None  # one case 5% slower
    assert _choose(tmp_path / "b", [0.99, 0.99, 0.99]) is None  # within the margin
    assert _choose(tmp_path / "c", [0.8, 0.9, 0.85], ok=False) is None  # a failed check
