"""Expert-parallel calibration (moec/calibrate/distributed.py) on 2 gloo processes on the CPU.

The tiny random MoE (5 experts: rank 0 fits 0, 2, 4 and rank 1 fits 1, 3) with 2-bit hls + GPTQ experts
(some experts routed, some starved onto all-token statistics) and rtn attention (rank 0 alone): the
output must be the bytes of the one-process run. Then a rank killed after layer 0: the run stops with
one line, and a one-process --resume finishes it with the same bytes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch
import yaml

from moec.calibrate import distributed, resume
from moec.calibrate.recipe import load_recipe
from moec.calibrate.run import calibrate
from moec.errors import UserError

RECIPE = {
    "name": "dist-test",
    "weights": [{"targets": ["experts"], "codec": "hls", "bits": 2, "group_size": 0, "gptq": True},
                {"targets": ["attention"], "codec": "rtn", "bits": 4}],
    # 4 × 24 tokens, top-2 of 5: ~38 tokens per expert, so both Hessian sources occur
    "calibration": {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 38, "seed": 0},
}
RUN = ("--data", "ptb", "--split", "valid", "--samples", "4", "--seq-len", "24")
VOLATILE = ("created", "capture_seconds", "fit_seconds", "processes")  # report.json fields allowed to differ


def _stable(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in VOLATILE}


@pytest.fixture(scope="module")
def setup(tiny_moe_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    recipe = tmp / "dist-test.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    ref = tmp / "ref"
    calibrate(tiny_moe_dir, str(tiny_moe_dir), load_recipe(recipe), "ptb", "valid", 4, 24, 0, ref)
    return tmp, recipe, ref


def _env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", MOEC_PROGRESS="0", MOEC_DIST_TIMEOUT="60", **extra)


def _rank(rank: int, port: int, model, recipe, out, kill: str | None, resume_: bool) -> None:
    """One rank of a forked 2-process run (the imports are the parent's: no start-up cost). A UserError
    is written to out.rank-<r>.err and exits 2, as the CLI would print it (moec/cli/app.py)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), **{distributed.TIMEOUT_ENV: "60"})
    if kill is not None:
        os.environ[resume.KILL_ENV] = kill
    try:
        dist = distributed.from_env("cpu")
        calibrate(model, str(model), load_recipe(recipe), "ptb", "valid", 4, 24, 0, out, dist=dist, resume=resume_)
        dist.close()
    except UserError as e:
        out.with_name(f"{out.name}.rank-{rank}.err").write_text(str(e))
        os._exit(2)


def _run2(model, recipe, out, kill: str | None = None, resume_: bool = False) -> list[int]:
    """Both ranks, forked; their exit codes."""
    ctx = mp.get_context("fork")
    port = distributed.free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, model, recipe, out, kill, resume_)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    return [p.exitcode for p in procs]


def test_two_gloo_processes_match_one_process(tiny_moe_dir, setup):
    """2 gloo ranks: calib.safetensors byte-identical to the one-process run, report.json equal but for
    durations and the process count; rank 1 writes nothing."""
    tmp, recipe, ref = setup
    out = tmp / "two"
    assert _run2(tiny_moe_dir, recipe, out) == [0, 0]
    assert (out / "calib.safetensors").read_bytes() == (ref / "calib.safetensors").read_bytes()
    got, want = (json.loads((d / "report.json").read_text()) for d in (out, ref))
    assert got["processes"] == 2 and want["processes"] == 1
    assert _stable(got) == _stable(want)
    sources = {e["hessian_w13"] for layer in got["layers"] for e in layer["weights"]["experts"]}
    assert sources == {"routed", "all-tokens"}, sources
    assert sorted(p.name for p in tmp.iterdir()) == ["dist-test.yaml", "ref", "two"]  # no stray files


def test_rank_killed_fails_cleanly_and_resumes(tiny_moe_dir, setup):
    """Rank 1 SIGKILLed after layer 0: rank 0 stops at its next collective with one line (exit 2) and
    keeps its layer-0 checkpoint; a 2-process --resume (rank 0 reads the checkpoint and broadcasts where
    to start and the hidden states) finishes with the one-process bytes. A one-process resume of a
    multi-process checkpoint is the same code path as resuming a one-process run (test_resume.py)."""
    tmp, recipe, ref = setup
    out = tmp / "killed"
    assert _run2(tiny_moe_dir, recipe, out, kill="rank-1-layer-0") == [2, -9]
    err = (tmp / "killed.rank-0.err").read_text()
    assert err.startswith("rank 0: lost contact") and err.endswith("rerun with --resume to continue from the "
                                                                    "last checkpoint") and "\n" not in err, err
    assert not out.exists()
    assert json.loads((resume.partial_dir(out) / "state.json").read_text())["layer"] == 0
    with pytest.raises(UserError, match="pass --resume"):
        calibrate(tiny_moe_dir, "tiny", load_recipe(recipe), "ptb", "valid", 4, 24, 0, out)
    assert _run2(tiny_moe_dir, recipe, out, resume_=True) == [0, 0]
    assert not resume.partial_dir(out).exists()
    assert (out / "calib.safetensors").read_bytes() == (ref / "calib.safetensors").read_bytes()


def test_gpus_refused(tiny_moe_dir, tmp_path):
    """--gpus on the CPU points at torchrun; more GPUs than present names how many there are."""
    from moec.cli.calibrate_cmd import calibrate as cli

    kw = dict(model=str(tiny_moe_dir), recipe=Path("moec/recipes/experts-hls2.yaml"), data="ptb", split="valid",
              samples=2, seq_len=24, out=tmp_path / "c", seed=None, resume=False)
    with pytest.raises(UserError, match=r"--gpus 2 needs --device cuda; on the CPU .*torchrun --nproc-per-node 2"):
        cli(**kw, device="cpu", gpus=2)
    with pytest.raises(UserError, match=rf"--gpus 9: this machine has {torch.cuda.device_count()} GPU"):
        cli(**kw, device="cuda", gpus=9)
    assert not (tmp_path / "c").exists()
