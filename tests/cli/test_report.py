"""`moec report`: one SVG point per plottable record of the committed results, axes and scales, bad input."""

import importlib.util
import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from moec.cli import report_cmd
from moec.cli.svgplot import Panel, Point, pick_scale, scatter_svg
from moec.errors import UserError
from tests.cli.run import moec

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))


def _finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _expected_rows(files):
    """Records a user would expect as points: Δppl with bits, or a decode step's ms with its floor."""
    n = 0
    for f in files:
        data = json.loads(f.read_text())
        for r in data if isinstance(data, list) else data.get("records", [data]):
            if not isinstance(r, dict):
                continue
            quality = _finite(r.get("delta_pct")) and (_finite(r.get("q_bits")) or _finite(r.get("kv_bits")))
            speed = r.get("bench") == "moec-latency" and _finite(r.get("ms_median")) and _finite(r.get("floor_ms"))
            n += quality or speed
    return n


def _svgs(html: str) -> list[ET.Element]:
    return [ET.fromstring(s) for s in re.findall(r"<svg.*?</svg>", html, re.S)]  # each parses as XML


def test_report_on_the_committed_results(tmp_path):
    files = [f for f in RESULTS if f.name.startswith(("expert_quality_", "kv_quality_", "hls_study_", "latency_"))]
    assert len(files) >= 10
    out = tmp_path / "report.html"
    r = moec("report", *files, "-o", out)
    assert r.returncode == 0, r.stderr
    html = out.read_text()
    ns = "{http://www.w3.org/2000/svg}"
    points = [g for svg in _svgs(html) for g in svg.iter(ns + "g") if g.get("class") == "point"]
    rows = [g for g in points if g.get("data-row") == "1"]
    assert len(rows) == _expected_rows(files) > 100
    assert all(g.find(ns + "title").text for g in points)  # every point has a hover title
    assert any(g.get("data-peer") == "1" for g in rows)  # kivi / hqq rows are drawn as peers
    assert any(g.get("data-row") == "0" for g in points)  # the latency rows' bf16 peers
    assert "mixtral-8x7b: decode ms per token against the floor" in html
    assert "smollm2-135m: Δppl against KV bits per element, context 1024" in html


def test_panels_from_hand_records(tmp_path):
    recs = [
        {"model": "m", "recipe": "experts-hls2", "delta_pct": 7.0, "q_bits": 2.3, "context": 1024},
        {"model": "m", "recipe": "experts-rtn2", "delta_pct": 190.0, "q_bits": 2.15, "context": 1024},
        {"model": "m", "method": "hqq3:g192", "recipe": None, "delta_pct": 0.2, "q_bits": 3.2, "context": 1024},
        {"model": "m", "recipe": "fp16", "delta_pct": None, "kv_bits": 16.0},  # no Δppl: not a point
        {"bench": "moec-latency", "shape": "mixtral-8x7b", "recipe": "latency-hls2-nuq2", "batch": 1,
         "context": 32768, "ms_median": 5.0, "floor_ms": 1.5, "device": "H200",
         "peer": {"bf16": {"ms_median": 12.0, "pct_of_floor": 50.0}, "hf": {"ms_median": 34.4}}},
        {"bench": "kv_attention", "ms_median": 0.1, "floor_ms": 0.05},  # a kernel, not a decode step
    ]
    f = tmp_path / "r.json"
    f.write_text(json.dumps(recs))
    quality, speed = report_cmd.panels([f])
    assert [p.label for p in quality.points] == ["experts-hls2", "experts-rtn2", "hqq3:g192"]
    assert [p.peer for p in quality.points] == [False, False, True]
    assert quality.yscale == "symlog"  # 0.2% .. 190%: three decades
    assert [(p.x, p.y, p.row, p.peer) for p in speed.points] == [(1.5, 5.0, True, False), (6.0, 12.0, False, True)]
    svg = ET.fromstring(scatter_svg(quality))
    labels = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert {"0", "1", "10", "100"} <= set(labels), labels  # symlog ticks: 0 and powers of ten


def test_scale_choice_and_positions():
    assert pick_scale([1.0, 2.0, 50.0], True) == "linear"
    assert pick_scale([0.5, 80.0], True) == "log" and pick_scale([0.0, 0.5, 80.0], False) == "symlog"
    p = Panel("t", "x", "y", [Point(1.0, 1.0, "a", "a"), Point(2.0, 3.0, "b", "b")])
    svg = ET.fromstring(scatter_svg(p, width=400, height=300))
    c = [e for e in svg.iter("{http://www.w3.org/2000/svg}circle")]
    (x0, y0), (x1, y1) = [(float(e.get("cx")), float(e.get("cy"))) for e in c]
    assert x1 > x0 and y1 < y0  # larger x to the right, larger y up
    assert (y0 - y1) / (x1 - x0) == pytest.approx(2.0 * ((300 - 16 - 52) / 2.24) / ((400 - 72 - 150) / 1.12), rel=1e-3)


def test_bad_input(tmp_path):
    empty = tmp_path / "train.json"
    empty.write_text(json.dumps({"bench": "train", "loss": 1.0}))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for files, msg in (([tmp_path / "missing.json"], "no such file"), ([empty], "no plottable records"),
                       ([broken], "not JSON")):
        with pytest.raises(UserError, match=msg):
            report_cmd.panels(files)
    r = moec("report", empty, "-o", tmp_path / "r.html")
    assert r.returncode == 2 and r.stderr.startswith("moec: error:") and "no plottable records" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    if importlib.util.find_spec("matplotlib") is None:  # PNG needs it; without it, a one-line error naming HTML
        with pytest.raises(UserError, match=r"needs matplotlib.*r\.html"):
            report_cmd.write_png([], tmp_path / "r.png")
        assert not (tmp_path / "r.png").exists()
    r = moec("report", empty, "-o", tmp_path / "r.pdf")
    assert r.returncode == 2 and "expected a .html or .png" in r.stderr
    assert not (tmp_path / "r.html").exists()
