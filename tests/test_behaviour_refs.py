"""Behaviour references (benchmarks/behaviour_ref.py): one recipe per registered codec, re-run through the
CLI on demo-moe by the benchmark's own `check`, must pack the same bytes (sha256 per tensor) and reach the
same perplexities (1e-6 relative) as recorded before the codec-registry restructure (on another CPU platform
than the recording one: perplexities to 1e-3, with a warning). `python3 -m benchmarks.behaviour_ref check`
runs every kv-*/experts-* recipe; this runs one per codec."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFS = ROOT / "benchmarks" / "results" / "behaviour_refs_cpu.json"
ONE_PER_CODEC = ["kv-kivi2", "kv-nuq2-outlier", "kv-latent-head", "kv-latent-layer-g2", "kv-rvq-tiered",
                 "experts-hls2", "experts-rtn3", "experts-fp3", "experts-fp8"]


@pytest.mark.parametrize("name", ONE_PER_CODEC)
def test_recipe_behaviour_unchanged(name):
    ref = json.loads(REFS.read_text())["recipes"][name]
    assert ref["applies"], ref  # the reference ran the codec (a recipe that stops applying is a difference)
    r = subprocess.run([sys.executable, "-m", "benchmarks.behaviour_ref", "check", "--only", name], cwd=ROOT,
                       capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))  # the references were recorded single-threaded
    for line in r.stdout.splitlines():
        if line.startswith("note: "):  # another CPU platform: the last bits of fp32 math may move
            warnings.warn(line, stacklevel=1)
    assert r.returncode == 0 and "1 recipes checked, 0 differences" in r.stdout, r.stdout + r.stderr[-3000:]
