"""benchmarks/choose_gluon_config.py: a candidate is adopted only when it is faster in geometric mean by the
margin, slower nowhere beyond the tolerance, and every check passed; the device file then carries its knobs."""

import json

from benchmarks import choose_gluon_config as cg
from moec.kernels import launch_config


def _bench(w4: list[float], ok=True):
    rows = []
    for (shape, ctx, b), ms in zip([("mixtral", 32768, 1), ("mixtral", 32768, 16), ("qwen3", 32768, 1)], w4,
                                   strict=True):
        base = {"shape": shape, "context": ctx, "batch": b}
        rows += [base | {"path": "gluon", "ms_median": 1.0},
                 base | {"path": "gluon-sweep", "ms_median": ms, "warps": 4},
                 base | {"path": "gluon-sweep", "ms_median": 0.5, "n_splits": 16}]  # not a candidate
    return {"device": "NVIDIA H100 80GB HBM3", "all_checks_ok": ok, "timings": rows}


def test_adopts_only_a_clear_win(tmp_path):
    assert cg.choose(_bench([0.8, 0.9, 0.85]), 0.03, 0.03)[0] == "warps 4"
    assert cg.choose(_bench([0.8, 1.05, 0.85]), 0.03, 0.03)[0] is None  # one case 5% slower
    assert cg.choose(_bench([0.99, 0.99, 0.99]), 0.03, 0.03)[0] is None  # within the margin
    assert cg.choose(_bench([0.8, 0.9, 0.85], ok=False), 0.03, 0.03)[0] is None  # a failed check


def test_writes_the_device_file(tmp_path, monkeypatch):
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(_bench([0.8, 0.9, 0.85])))
    monkeypatch.setattr("sys.argv", ["choose", str(f), str(tmp_path)])
    assert cg.main() == 0
    written = json.loads((tmp_path / "nvidia_h100_80gb_hbm3.json").read_text())
    assert written["kv_decode_attention"]["gluon"] == {"warps": 4}
    merged = launch_config._merge(launch_config.defaults(), written, "test")  # a valid device file
    assert merged["kv_decode_attention"]["gluon"]["warps"] == 4
