"""Behaviour references (benchmarks/behaviour_ref.py): one recipe per registered codec, re-run through the
CLI on demo-moe, must pack the same bytes (sha256 per tensor) and reach the same perplexities (1e-6
relative) as recorded before the codec-registry restructure (on another CPU platform than the recording
one: perplexities to 1e-3, with a warning). `python3 benchmarks/behaviour_ref.py check`
runs every kv-*/experts-* recipe; this runs one per codec."""

import json
import warnings

import pytest

from benchmarks.behaviour_ref import REFS, compare, platform, recipe_file, run_one

ONE_PER_CODEC = ["kv-kivi2", "kv-nuq2-outlier", "kv-latent-head", "kv-latent-layer-g2", "kv-rvq-tiered",
                 "experts-hls2", "experts-rtn3", "experts-fp3", "experts-fp8"]


@pytest.mark.parametrize("name", ONE_PER_CODEC)
def test_recipe_behaviour_unchanged(name, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the references were recorded single-threaded
    refs = json.loads(REFS.read_text())
    ref = refs["recipes"][name]
    got = run_one(recipe_file(name), tmp_path)
    assert got["applies"] and ref["applies"], got
    same = refs["protocol"]["platform"] == platform()
    if not same:  # other CPU kernels: the last bits of fp32 math may move, so bytes are not comparable
        warnings.warn(f"behaviour references were recorded on {refs['protocol']['platform']}, this is {platform()}: "
                      f"perplexities compared to 1e-3, bytes not compared", stacklevel=1)
    diffs = compare(name, ref, got, same)
    assert not diffs, "\n".join(diffs)
