"""benchmarks/peers/speedup_vs_llamacpp.py: llama-bench's tokens/s becomes ms per token on the matching batch-1
rows only, and a row timed on another GPU model is never paired."""

import json

import pytest

from benchmarks.peers import speedup_vs_llamacpp as sv


def _bench(tmp_path, gpu="NVIDIA H100 80GB HBM3"):
    rows = [{"n_prompt": 0, "n_gen": 64, "n_depth": d, "avg_ts": ts, "gpu_info": gpu, "test_time": "t"}
            for d, ts in ((4096, 200.0), (32768, 125.0))]
    (tmp_path / "llama_bench_mixtral.json").write_text(json.dumps(rows))
    return sv.llamacpp_ms(tmp_path)


def _row(ctx, batch=1, device="NVIDIA H100 80GB HBM3"):
    return {"bench": "moec-latency", "shape": "mixtral-8x7b", "recipe": "r", "batch": batch, "context": ctx,
            "ms_median": 4.0, "device": device, "peer": {}}


def test_pairs_batch1_rows_at_timed_depths(tmp_path):
    recs = [_row(4096), _row(32768), _row(32768, batch=16), _row(131072)]
    sv.attach(recs, _bench(tmp_path), same_device=True)
    assert recs[0]["speedup_vs_llamacpp"] == pytest.approx(5.0 / 4.0)  # 1000 / 200 tokens/s = 5 ms
    assert recs[1]["speedup_vs_llamacpp"] == pytest.approx(8.0 / 4.0)
    assert recs[1]["peer"]["llamacpp"]["ms"] == pytest.approx(8.0)
    assert "speedup_vs_llamacpp" not in recs[2] and "speedup_vs_llamacpp" not in recs[3]


def test_other_gpu_is_skipped_or_refused(tmp_path):
    peer = _bench(tmp_path, gpu="NVIDIA H200")
    recs = [_row(4096)]
    lines = sv.attach(recs, peer, same_device=False)
    assert "speedup_vs_llamacpp" not in recs[0] and lines[0].startswith("skipped")
    with pytest.raises(SystemExit):
        sv.attach(recs, peer, same_device=True)
