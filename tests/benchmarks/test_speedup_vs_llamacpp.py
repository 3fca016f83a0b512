"""benchmarks/peers/speedup_vs_llamacpp.py, run as the GPU call runs it: llama-bench's tokens/s becomes ms per
token on the matching batch-1 rows only, and a row timed on another GPU model is never paired."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, gpu: str, *flags):
    rows = [{"n_prompt": 0, "n_gen": 64, "n_depth": d, "avg_ts": ts, "gpu_info": gpu, "test_time": "t"}
            for d, ts in ((4096, 200.0), (32768, 125.0))]
    (tmp_path / "llama_bench_mixtral.json").write_text(json.dumps(rows))
    recs = [{"bench": "moec-latency", "shape": "mixtral-8x7b", "recipe": "r", "batch": b, "context": c,
             "ms_median": 4.0, "device": "NVIDIA H100 80GB HBM3", "peer": {}}
            for b, c in ((1, 4096), (1, 32768), (16, 32768), (1, 131072))]
    (tmp_path / "lat.json").write_text(json.dumps(recs))
    p = subprocess.run([sys.executable, "-m", "benchmarks.peers.speedup_vs_llamacpp", str(tmp_path / "lat.json"),
                        str(tmp_path), str(tmp_path / "out.json"), *flags], cwd=REPO, capture_output=True, text=True)
    out = json.loads((tmp_path / "out.json").read_text()) if (tmp_path / "out.json").is_file() else None
    return p, out


def test_pairs_batch1_rows_at_timed_depths(tmp_path):
    p, out = _run(tmp_path, "NVIDIA H100 80GB HBM3", "--same-device")
    assert p.returncode == 0, p.stderr
    assert abs(out[0]["speedup_vs_llamacpp"] - 5.0 / 4.0) < 1e-9  # 1000 / 200 tokens/s = 5 ms against 4 ms
    assert abs(out[1]["speedup_vs_llamacpp"] - 8.0 / 4.0) < 1e-9 and abs(out[1]["peer"]["llamacpp"]["ms"] - 8) < 1e-9
    assert "speedup_vs_llamacpp" not in out[2] and "speedup_vs_llamacpp" not in out[3]  # batch 16; no 128k depth


def test_other_gpu_is_skipped_or_refused(tmp_path):
    p, out = _run(tmp_path, "NVIDIA H200")
    assert p.returncode == 0 and "skipped" in p.stdout
    assert not any("speedup_vs_llamacpp" in r for r in out)
    (tmp_path / "out.json").unlink()
    p, out = _run(tmp_path, "NVIDIA H200", "--same-device")
    assert p.returncode != 0 and out is None  # refused, nothing written


def test_type_and_layer_count_pair_by_name(tmp_path):
    """gpt-oss at its first 18 layers: experts-mxfp4 pairs with the MXFP4 file of 18 layers, experts-hls2 with the
    Q2_K one of 18 layers; the whole model (no @N) and other layer counts with neither."""
    def bench(ts):
        return json.dumps([{"n_prompt": 0, "n_gen": 64, "n_depth": 4096, "avg_ts": ts, "gpu_info": "H100",
                            "test_time": "t"}])
    (tmp_path / "llama_bench_gpt-oss-120b_MXFP4_L18.json").write_text(bench(100.0))
    (tmp_path / "llama_bench_gpt-oss-120b_L18.json").write_text(bench(50.0))
    recs = [{"bench": "moec-latency", "shape": s, "recipe": r, "batch": 1, "context": 4096, "ms_median": 5.0,
             "device": "NVIDIA H100", "peer": {}}
            for s, r in (("gpt-oss-120b@18", "experts-mxfp4"), ("gpt-oss-120b@18", "experts-hls2"),
                         ("gpt-oss-120b", "experts-mxfp4"), ("gpt-oss-120b@12", "experts-hls2"))]
    (tmp_path / "lat.json").write_text(json.dumps(recs))
    p = subprocess.run([sys.executable, "-m", "benchmarks.peers.speedup_vs_llamacpp", str(tmp_path / "lat.json"),
                        str(tmp_path), str(tmp_path / "out.json")], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert abs(out[0]["speedup_vs_llamacpp"] - 10.0 / 5.0) < 1e-9 and out[0]["peer"]["llamacpp"]["type"][:5] == "MXFP4"
    assert abs(out[1]["speedup_vs_llamacpp"] - 20.0 / 5.0) < 1e-9 and out[1]["peer"]["llamacpp"]["type"][:4] == "Q2_K"
    assert "speedup_vs_llamacpp" not in out[2] and "speedup_vs_llamacpp" not in out[3]
