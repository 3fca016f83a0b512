"""Atomic outputs: everything moec writes appears whole under its name, or not at all.

Every output (calibration and packed directories, result JSON, plots, benchmark caches) is built in a
temporary sibling, `.NAME.moec-tmp-<pid>-<random>`, then given the umask's modes (files 0666 & ~umask, dirs
0777 & ~umask: safetensors writes its files 0600, which a server running as another user cannot read),
fsynced, and renamed over NAME. A directory replaces an existing one by an atomic exchange (Linux
renameat2), so readers see the old output or the new one and never a missing name; where the filesystem
cannot exchange, the old one is renamed away first.

Writers of one target take turns: each holds an exclusive flock on `.NAME.lock` beside it for the whole
write, and a second writer waits for the first (the write phase is seconds; failing it instead would
throw away an hour of calibration). The last writer's output stays. Because the lock is held, every
`.NAME.moec-tmp-*` found by the next writer was left by a killed run: it is removed, with a one-line
warning. SIGINT and SIGTERM during a write remove the temporary (SIGTERM exits 143), and are held back
for the moment of the rename so that it completes. A full disk or quota (ENOSPC, EDQUOT) is a UserError
naming the output and the space it needed, with the temporary removed; so is an output location that
cannot be written (EACCES, EPERM, EROFS).

Test hook: with MOEC_TEST_PAUSE_BEFORE_RENAME=FILE set, a writer that has written everything writes its
temporary's path to FILE and waits (at most 120 s) until FILE is deleted, so a test can signal it at a
known point (tests/cli/test_atomic_outputs.py). Unset, it costs one environment lookup.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError

log = logging.getLogger(__name__)

TMP_TAG = ".moec-tmp-"
MARKER = ".moec-writer"  # inside a temporary directory until the rename: who is writing it
PAUSE_ENV = "MOEC_TEST_PAUSE_BEFORE_RENAME"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


# ---- modes ------------------------------------------------------------------------------------------


def current_umask() -> int:
    """The process umask, read without changing it (Linux reports it in /proc; elsewhere it is set and
    restored at once, under a lock so two threads cannot interleave)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


_umask_lock = threading.Lock()


def apply_modes(path: Path) -> None:
    """Files 0666 & ~umask and directories 0777 & ~umask, for `path` and everything under it (symlinks
    are left alone: chmod would follow them out of the output)."""
    mask = current_umask()
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    if path.is_file():
        os.chmod(path, file_mode)
        return
    os.chmod(path, dir_mode)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, dir_mode if name in dirs else file_mode)


# ---- durability -------------------------------------------------------------------------------------


def _fsync(path: str | Path, is_dir: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if is_dir else 0))
    try:
        if is_dir:  # some filesystems refuse to sync a directory; its entries are then as safe as they get
            with contextlib.suppress(OSError):
                os.fsync(fd)
        else:
            os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    if path.is_file():
        _fsync(path)
        return
    for root, _dirs, files in os.walk(path):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                _fsync(os.path.join(root, name))
        _fsync(root, is_dir=True)


# ---- temporaries and the lock -----------------------------------------------------------------------


def temp_path(target: Path, suffix: str = "") -> Path:
    """A fresh temporary sibling of `target`. `suffix` keeps an extension for writers that read it
    (matplotlib picks the image format from it)."""
    return target.with_name(f".{target.name[:180]}{TMP_TAG}{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def temporaries(target: Path) -> list[Path]:
    """Every moec temporary of `target` (live or left by a killed run)."""
    prefix = f".{target.name[:180]}{TMP_TAG}"
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix))


def lock_path(target: Path) -> Path:
    return target.with_name(f".{target.name[:200]}.lock")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _remove_stale(target: Path) -> None:
    """Called with the target's lock held: no live moec writer of `target` exists, so every temporary of
    it was left by a run that was killed (SIGKILL, power loss) before it could clean up."""
    for p in temporaries(target):
        pid = p.name[len(f".{target.name[:180]}{TMP_TAG}"):].split("-", 1)[0]
        log.warning("removing %s, left by an interrupted moec run (pid %s)", p, pid)
        _remove(p)


@contextmanager
def _target_lock(target: Path) -> Iterator[None]:
    """Hold `.NAME.lock` exclusively; wait while another moec run holds it. The holder deletes the file
    before releasing it, so a waiter that then wins the lock of the deleted file tries again."""
    path = lock_path(target)
    while True:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:  # the first write to the output's location: is it writable at all?
            if _is_disk_full(e):
                raise UserError(f"no space left on device writing {target} (not even for {path.name})") from None
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise UserError(f"cannot write {target}: {e.strerror}") from None
            raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                log.warning("waiting for another moec run (pid %s) that is writing %s", holder, target)
                fcntl.flock(fd, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        with contextlib.suppress(OSError):  # the pid only tells a waiter whom it waits for (a full disk refuses it)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


# ---- signals ----------------------------------------------------------------------------------------


@contextmanager
def _signals_to(handler: Callable, signums: tuple[int, ...]) -> Iterator[None]:
    """Route `signums` to `handler` for the block. Only the main thread can set handlers (elsewhere this
    does nothing), and a signal the process ignores (nohup) stays ignored."""
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for s in signums:
            prev = signal.getsignal(s)
            if prev not in (signal.SIG_IGN, None):
                saved[s] = prev
                signal.signal(s, handler)
    try:
        yield
    finally:
        for s, prev in saved.items():
            signal.signal(s, prev)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the cleanup below; the shell sees 143 as for a plain kill


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block (the rename) is done, then take their usual course."""
    pending: list[int] = []
    with _signals_to(lambda signum, frame: pending.append(signum), (signal.SIGINT, signal.SIGTERM)):
        yield
    if pending:
        signal.raise_signal(pending[0])


def _pause_for_test(tmp: Path) -> None:
    flag = os.environ.get(PAUSE_ENV)
    if flag:
        Path(flag).write_text(str(tmp))
        deadline = time.monotonic() + 120
        while os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)


# ---- a full disk ------------------------------------------------------------------------------------


def _bytes_under(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in _DISK_FULL:
        return True
    # safetensors reports I/O errors as SafetensorError("... No space left on device (os error 28)")
    return any(f"(os error {code})" in str(e) for code in _DISK_FULL)


def _disk_full_error(target: Path, tmp: Path, size_hint: int | None) -> UserError:
    written = _bytes_under(tmp) if tmp.exists() else 0
    _remove(tmp)
    free = shutil.disk_usage(target.parent).free
    need = f"needs ~{_size(size_hint)}" if size_hint else f"{_size(written)} written when it filled"
    return UserError(f"no space left on device writing {target} ({need}, {_size(free)} free there)")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


# ---- the writers ------------------------------------------------------------------------------------


@contextmanager
def _writing(target: Path, tmp: Path, size_hint: int | None) -> Iterator[None]:
    """The write phase of `tmp`: SIGTERM unwinds like SIGINT, and any failure removes `tmp`."""
    try:
        with _signals_to(_terminate, (signal.SIGTERM,)):
            yield
    except BaseException as e:
        if _is_disk_full(e):
            raise _disk_full_error(target, tmp, size_hint) from None
        _remove(tmp)
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where that is not available."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _replace_dir(tmp: Path, target: Path) -> None:
    if os.path.lexists(target):
        if not _exchange(tmp, target):  # a moment without `target`; the lock still keeps moec writers apart
            old = temp_path(target)
            os.rename(target, old)
            os.rename(tmp, target)
            tmp = old
        _remove(tmp)  # the previous output (or a symlink to it), now under the temporary name
    else:
        os.rename(tmp, target)


@contextmanager
def atomic_dir(target: str | Path, *, is_output: Callable[[Path], bool] | None = None, what: str = "an output",
               size_hint: int | None = None) -> Iterator[Path]:
    """Yields an empty temporary directory to write `target`'s files into; on success it replaces `target`.

    is_output(path): whether an existing non-empty `target` is a previous output of this kind, which may
    be replaced (anything else is refused, named as not being `what`). size_hint: the bytes the output
    will take, for the message when the disk is full.
    """
    target = Path(target)
    with _target_lock(target):
        if os.path.lexists(target) and (not target.is_dir() or (
                is_output is not None and any(target.iterdir()) and not is_output(target))):
            raise UserError(f"{target}: exists and is not {what}; refusing to overwrite it")
        _remove_stale(target)
        tmp = temp_path(target)
        with _writing(target, tmp, size_hint):
            tmp.mkdir()
            (tmp / MARKER).write_text(json.dumps({"pid": os.getpid(), "target": str(target)}) + "\n")
            yield tmp
            _pause_for_test(tmp)
            (tmp / MARKER).unlink()
            apply_modes(tmp)
            _fsync_tree(tmp)
            with _signals_held():
                _replace_dir(tmp, target)
            _fsync(target.parent, is_dir=True)


@contextmanager
def atomic_file(path: str | Path, *, size_hint: int | None = None) -> Iterator[Path]:
    """Yields a temporary path to write `path`'s content to with any writer (open, savefig, save_file,
    torch.save); on success it replaces `path`."""
    path = Path(path)
    with _target_lock(path):
        _remove_stale(path)
        tmp = temp_path(path, path.suffix)
        with _writing(path, tmp, size_hint):
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            yield tmp
            _pause_for_test(tmp)
            apply_modes(tmp)
            _fsync(tmp)
            with _signals_held():
                os.replace(tmp, path)
            _fsync(path.parent, is_dir=True)


def write_text(path: str | Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj) -> None:
    """`obj` as indented JSON (one space) with a final newline, written atomically."""
    write_text(path, json.dumps(obj, indent=1) + "\n")
