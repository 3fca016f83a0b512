"""A real `moec pack` process killed, interrupted, or racing another pack to the same -o; a full disk.

The child is paused at a known point, everything written and nothing renamed yet, by the test hook
MOEC_TEST_PAUSE_BEFORE_RENAME (moec/atomic.py): it writes its temporary's path to the flag file and
waits until the test deletes it.
"""

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moec import atomic
from moec.calibrate.pack import pack
from moec.calibrate.recipe import load_recipe
from moec.calibrate.run import calibrate
from moec.cli.app import main
from moec.formats import checkpoint
from tests.cli.test_bad_input import assert_clean_failure

# As `python -m moec.cli.app`, with SIGINT raising KeyboardInterrupt even where the test runner was started
# with SIGINT ignored (a background job inherits that, and Python then leaves it ignored).
MOEC = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['moec', *sys.argv[1:]]; from moec.cli.app import main; main()")


def spawn(*args, pause: Path | None = None, stderr=subprocess.PIPE) -> subprocess.Popen:
    env = dict(os.environ, MOEC_PROGRESS="0", COLUMNS="1000")  # wide: one log record, one line
    env.pop(atomic.PAUSE_ENV, None)
    if pause is not None:
        env[atomic.PAUSE_ENV] = str(pause)
    return subprocess.Popen([sys.executable, "-c", MOEC, *map(str, args)], env=env, stdout=subprocess.DEVNULL,
                            stderr=stderr, text=True)


def wait_for(ready, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"moec exited {proc.returncode} before {what}: {proc.stderr.read() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _flag_written(flag: Path) -> bool:
    """The paused run's flag holds the temporary's path: its file exists a moment before the path is written (a
    read in between gave Path(""), a flaky failure under load)."""
    return flag.exists() and bool(flag.read_text())


def assert_nothing_beside(out: Path) -> None:
    assert not atomic.temporaries(out), atomic.temporaries(out)
    assert not atomic.lock_path(out).exists()


@pytest.fixture(scope="module")
def work(tiny_moe_dir, tmp_path_factory):
    """Two calibrations of the tiny model whose packs differ in every shard, and a pack of the first."""
    d = tmp_path_factory.mktemp("atomic")
    for recipe in ("fp16.yaml", "ablations/experts-rtn2.yaml"):
        name = Path(recipe).stem
        calibrate(tiny_moe_dir, str(tiny_moe_dir), load_recipe(Path("moec/recipes") / recipe), "ptb", "valid",
                  2, 16, 0, d / name)
    pack(tiny_moe_dir, str(tiny_moe_dir), d / "fp16", d / "previous")
    return d


def test_sigkill_keeps_the_previous_output_and_the_rerun_removes_the_temporary(tiny_moe_dir, work, tmp_path,
                                                                              caplog):
    out, flag = tmp_path / "packed", tmp_path / "paused"
    shutil.copytree(work / "previous", out)
    before = tree(out)
    p = spawn("pack", tiny_moe_dir, work / "experts-rtn2", "-o", out, pause=flag)
    wait_for(lambda: _flag_written(flag), p, "the pause before the rename")
    tmp = Path(flag.read_text())
    assert tmp.parent == tmp_path and (tmp / checkpoint.MANIFEST).is_file()  # written in full, not renamed
    p.kill()
    p.communicate(timeout=60)
    assert tree(out) == before and tmp.is_dir()  # SIGKILL leaves no chance to clean up

    with caplog.at_level(logging.WARNING, logger="moec.atomic"):  # the rerun, in this process (cheaper)
        pack(tiny_moe_dir, str(tiny_moe_dir), work / "experts-rtn2", out)
    assert caplog.messages == [f"removing {tmp}, left by an interrupted moec run (pid {p.pid})"]
    assert checkpoint.verify(out)["recipe"]["name"] == "experts-rtn2"
    assert_nothing_beside(out)


@pytest.mark.parametrize("signum,exit_code,previous", [(signal.SIGINT, 130, True), (signal.SIGTERM, 143, False)],
                         ids=["SIGINT-over-previous", "SIGTERM-first-write"])
def test_signal_removes_the_temporary(tiny_moe_dir, work, tmp_path, signum, exit_code, previous):
    out, flag = tmp_path / "packed", tmp_path / "paused"
    if previous:
        shutil.copytree(work / "previous", out)
    before = tree(out) if previous else None
    p = spawn("pack", tiny_moe_dir, work / "experts-rtn2", "-o", out, pause=flag)
    wait_for(lambda: _flag_written(flag), p, "the pause before the rename")
    tmp = Path(flag.read_text())
    assert tmp.is_dir()
    p.send_signal(signum)
    _, err = p.communicate(timeout=60)
    assert p.returncode == exit_code, err
    assert "Traceback" not in err and "error" not in err, err
    assert not tmp.exists()
    assert (tree(out) == before) if previous else not out.exists()
    assert_nothing_beside(out)


def test_two_packs_to_one_output_take_turns(tiny_moe_dir, work, tmp_path):
    out, flag, b_log = tmp_path / "packed", tmp_path / "paused", tmp_path / "b.stderr"
    a = spawn("pack", tiny_moe_dir, work / "fp16", "-o", out, pause=flag)
    wait_for(lambda: _flag_written(flag), a, "the first pack's pause")  # it holds the lock, its output not yet renamed
    with open(b_log, "w") as log:
        b = spawn("pack", tiny_moe_dir, work / "experts-rtn2", "-o", out, stderr=log)
    wait_for(lambda: "waiting for another moec run" in b_log.read_text(), b, "the second pack to wait")
    assert f"waiting for another moec run (pid {a.pid}) that is writing {out}" in b_log.read_text()
    assert not out.exists()  # neither has renamed anything
    flag.unlink()
    assert a.wait(60) == 0, a.stderr.read()
    assert b.wait(300) == 0, b_log.read_text()
    # The later writer's output, whole: every shard matches the manifest that came with it (the two packs
    # differ in every shard, so a mix of the two would not verify).
    assert checkpoint.verify(out)["recipe"]["name"] == "experts-rtn2"
    assert_nothing_beside(out)


def test_full_disk_is_one_line_and_keeps_the_previous_output(tiny_moe_dir, work, tmp_path, monkeypatch, capsys):
    """`moec pack` run in this process (its exit path is the CLI's) on a disk that fills mid-shard."""
    out = tmp_path / "packed"
    shutil.copytree(work / "previous", out)
    before = tree(out)

    def fill_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(bytes(4096))
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(checkpoint, "save_file", fill_disk)
    monkeypatch.setattr(sys, "argv", ["moec", "pack", str(tiny_moe_dir), str(work / "experts-rtn2"), "-o", str(out)])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert_clean_failure(subprocess.CompletedProcess(sys.argv, e.value.code, "", err),
                         f"no space left on device writing {out} (needs ~", "free there)")
    assert tree(out) == before
    assert_nothing_beside(out)
