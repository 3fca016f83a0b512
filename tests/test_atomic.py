"""moec.atomic: outputs appear whole or not at all, with the umask's modes, one writer of a target at a time.

The CLI side (a real `moec pack` killed, interrupted, or racing another) is tests/cli/test_atomic_outputs.py.
"""

import errno
import logging
import os
import signal
import stat
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from moec import atomic
from moec.calibrate.pack import pack
from moec.calibrate.recipe import load_recipe
from moec.calibrate.run import calibrate
from moec.errors import UserError
from moec.formats import checkpoint


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _write(out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    info = {n: {"codec": "keep", "bits": 32} for n in tensors}
    return checkpoint.write_packed(out, tensors, info, {}, {"model_type": "x"})


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "rename-away"])
def test_directory_replaced_only_when_complete(tmp_path, monkeypatch, exchange):
    if not exchange:  # filesystems without RENAME_EXCHANGE take the other path
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    with atomic.atomic_dir(out) as d:
        (d / "a").write_text("old")
    before = tree(out)
    with pytest.raises(RuntimeError, match="midway"):
        with atomic.atomic_dir(out) as d:
            (d / "a").write_text("new, half written")
            assert tree(out) == before  # the new output is built beside the old one
            raise RuntimeError("midway")
    assert tree(out) == before and os.listdir(tmp_path) == ["out"]  # no temporary, no lock file
    with atomic.atomic_dir(out) as d:
        (d / "b").write_text("new")
    assert tree(out) == {"b": b"new"} and os.listdir(tmp_path) == ["out"]  # whole replacement


def test_exchange_swaps_or_declines(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    swapped = atomic._exchange(a, b)
    assert ((a / "x").read_text(), (b / "x").read_text()) == (("b", "a") if swapped else ("a", "b"))


def test_refuses_what_is_not_an_output(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UserError, match=f"{f}: exists and is not a thing; refusing to overwrite it"):
        with atomic.atomic_dir(f, what="a thing"):
            pytest.fail("entered")
    d = tmp_path / "dir"
    d.mkdir()
    (d / "keep").write_text("x")
    with pytest.raises(UserError, match="exists and is not a thing"):
        with atomic.atomic_dir(d, is_output=lambda p: (p / "manifest").is_file(), what="a thing"):
            pytest.fail("entered")
    assert tree(d) == {"keep": b"x"} and sorted(os.listdir(tmp_path)) == ["dir", "file"]


def test_stale_temporary_removed_with_one_warning(tmp_path, caplog):
    out = tmp_path / "out"
    stale = tmp_path / ".out.moec-tmp-4194304-0badf00d"  # what a SIGKILLed writer leaves: its temporary
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 100)
    atomic.lock_path(out).write_text("4194304\n")  # ... and its lock file, no longer locked
    other = tmp_path / ".outer.moec-tmp-1-00000000"  # another output's temporary is not this writer's to judge
    other.mkdir()
    with caplog.at_level(logging.WARNING, logger="moec.atomic"):
        with atomic.atomic_dir(out) as d:
            (d / "a").write_text("x")
    assert [r.getMessage() for r in caplog.records] == [
        f"removing {stale}, left by an interrupted moec run (pid 4194304)"]
    assert sorted(os.listdir(tmp_path)) == [other.name, "out"]


def test_second_writer_waits_for_the_first(tmp_path, caplog):
    out, order = tmp_path / "out", []
    inside, release = threading.Event(), threading.Event()

    def first():
        with atomic.atomic_dir(out) as d:
            (d / "who").write_text("first")
            inside.set()
            release.wait(30)
            order.append("first done")

    def second():
        with atomic.atomic_dir(out) as d:
            order.append("second writing")
            (d / "who").write_text("second")

    t1 = threading.Thread(target=first)
    t1.start()
    assert inside.wait(30)
    with caplog.at_level(logging.WARNING, logger="moec.atomic"):
        t2 = threading.Thread(target=second)
        t2.start()
        try:
            deadline = time.monotonic() + 30
            while not any("waiting for another moec run" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the second writer never waited"
                time.sleep(0.01)
        finally:
            release.set()
            t1.join(30), t2.join(30)
    assert order == ["first done", "second writing"]
    assert f"waiting for another moec run (pid {os.getpid()}) that is writing {out}" in caplog.text
    assert (out / "who").read_text() == "second" and os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),  # its words
], ids=["ENOSPC", "EDQUOT", "safetensors"])
def test_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, error):
    out = _write(tmp_path / "ck", {"a": torch.zeros(3)})
    before = tree(out)

    def fill_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # part of the shard reached the disk
        raise error

    monkeypatch.setattr(checkpoint, "save_file", fill_disk)
    with pytest.raises(UserError) as e:
        _write(out, {"a": torch.zeros(1000)})
    msg = str(e.value)
    assert msg.startswith(f"no space left on device writing {out} (needs ~4.0 kB, ") and msg.endswith(" free there)")
    assert "\n" not in msg and e.value.__cause__ is None and e.value.__suppress_context__
    assert tree(out) == before and os.listdir(tmp_path) == ["ck"]


def test_full_disk_without_a_size_hint_says_what_was_written(tmp_path):
    path = tmp_path / "r.json"
    with pytest.raises(UserError, match=r"writing .*r\.json \(1\.5 kB written when it filled, .* free there\)$"):
        with atomic.atomic_file(path) as tmp:
            tmp.write_bytes(b"x" * 1500)
            raise OSError(errno.ENOSPC, "No space left on device")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_unwritable_location_is_one_line(tmp_path, monkeypatch, code):
    real_open = os.open

    def refuse(path, *args, **kw):  # what a read-only mount or a directory of another user answers
        if str(path).startswith(str(tmp_path)):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(UserError, match=f"^cannot write {tmp_path / 'out'}: {os.strerror(code)}$"):
        with atomic.atomic_dir(tmp_path / "out"):
            pytest.fail("entered")


def test_file_replaced_whole_and_keeps_its_suffix(tmp_path):
    path = tmp_path / "plot.png"
    atomic.write_text(path, "old")
    with pytest.raises(KeyError):
        with atomic.atomic_file(path) as tmp:
            assert tmp.suffix == ".png" and tmp.parent == tmp_path  # savefig takes the format from it
            tmp.write_text("new, half")
            raise KeyError("midway")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["plot.png"]
    atomic.write_json(path, {"a": 1})
    assert path.read_text() == '{\n "a": 1\n}\n' and os.listdir(tmp_path) == ["plot.png"]


def test_signals_wait_for_the_rename():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be set in the main thread")
    done = []
    # a shell starts background jobs with SIGINT ignored, and Python then installs no KeyboardInterrupt handler:
    # give this process the handler an interactive run has, so the test checks the same thing however it runs
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with atomic._signals_held():
                signal.raise_signal(signal.SIGINT)
                done.append("renamed")  # not cut short by the SIGINT above
    finally:
        signal.signal(signal.SIGINT, prev)
    assert done == ["renamed"]


@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)],
                         ids=["umask022", "umask077"])
def test_modes_follow_the_umask(tiny_moe_dir, tmp_path, umask, file_mode, dir_mode):
    """safetensors writes 0600 and copy2 keeps the source's mode: both are set from the umask afterwards."""
    out = tmp_path / "out"
    old = os.umask(umask)
    try:
        assert atomic.current_umask() == umask
        calibrate(tiny_moe_dir, str(tiny_moe_dir), load_recipe("fp16"), "ptb", "valid", 2, 16, 0,
                  out / "calib")
        pack(tiny_moe_dir, str(tiny_moe_dir), out / "calib", out / "packed")
        atomic.write_json(out / "eval.json", [])
        with atomic.atomic_file(out / "samples.safetensors") as tmp:
            save_file({"a": torch.zeros(2)}, str(tmp))
    finally:
        os.umask(old)
    paths = [out, *out.rglob("*")]
    assert {p.name for p in paths} >= {"calib.safetensors", "report.json", "model-00001-of-00001.safetensors",
                                       "moec.json", "tokenizer.json", "eval.json", "samples.safetensors"}
    for p in paths:
        assert stat.S_IMODE(p.stat().st_mode) == (dir_mode if p.is_dir() else file_mode), p
