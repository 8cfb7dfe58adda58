"""Atomic writes: the one way the tools write a file or directory that must never be seen
half-written (everything a run directory needs to resume, and every result).

The content goes to a temporary name beside the target (`name.tmp-PID-TID.ext`: the
writer's process and thread, so that two writers of one target never share it, and
writers that read the extension still work), is flushed to disk (fsync), and is renamed
into place; the rename is atomic, so a process killed at any moment leaves the old
version or the new one, never a mix. Several threads and processes may write one target
at once: each write is whole, and the last one renamed stays.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import threading


def temporary_path(path) -> pathlib.Path:
    """The temporary name this thread's write to `path` uses: `checkpoint.tmp-PID-TID.npz`
    for `checkpoint.npz`."""
    path = pathlib.Path(path)
    return path.with_name(f"{path.stem}.tmp-{_writer()}{path.suffix}")


def target_name(name: str) -> str:
    """The name a write's temporary or set-aside name stands for (`checkpoint.npz` for
    `checkpoint.tmp-12-12.npz`, `best` for `best.old-12-12`); any other name is itself."""
    match = _WRITE_NAME.fullmatch(name)
    return _target(match) if match else name


def _target(match: re.Match) -> str:
    return match["stem"] + (match["suffix"] or "")


# What `atomic_write` leaves beside a target if its process is killed: the temporary, or
# (a directory replaced) the old directory set aside; also without the writer's ids, as
# earlier versions named them (`checkpoint.tmp.npz`, `best.old`).
_WRITE_NAME = re.compile(
    r"(?P<stem>.+?)(?:\.tmp(?:-(?P<pid>\d+)-(?P<tid>\d+))?(?P<suffix>\.[^.]*)?"
    r"|\.old(?:-(?P<old_pid>\d+)-(?P<old_tid>\d+))?)",
    re.DOTALL,
)


def _writer() -> str:
    return f"{os.getpid()}-{threading.get_native_id()}"


@contextlib.contextmanager
def atomic_write(path):
    """Yield a temporary path to write `path` through; on success it replaces `path`.

    Works for a file or a directory (write the directory's files into the yielded
    path). A symbolic link stays one: what it leads to is replaced. On an exception
    the temporary is removed and `path` is left as it was. What a killed writer left
    beside `path` is removed first.
    """
    path = pathlib.Path(path)
    if path.is_symlink():  # write where the link leads, and keep the link
        path = pathlib.Path(os.path.realpath(path))
    tmp = temporary_path(path)
    for leftover in _leftovers(path):
        with contextlib.suppress(FileNotFoundError):  # another writer of `path` removed it first
            _remove(leftover)
    old = None
    try:
        yield tmp
        _fsync_tree(tmp)
        with _replacing(path.parent):
            if path.exists() and path.is_dir() != tmp.is_dir():  # a file never replaces a folder, nor a folder a file
                kinds = ("directory", "file") if path.is_dir() else ("file", "directory")
                raise ValueError(f"{path} is a {kinds[0]}; writing a {kinds[1]} there would replace it")
            if path.is_dir():  # `path` is no link here: a link was followed above
                # A directory cannot be replaced by rename while it holds files: move the
                # old one aside first (a kill here leaves it under `name.old-PID-TID`).
                old = path.with_name(f"{path.name}.old-{_writer()}")
                os.replace(path, old)
            os.replace(tmp, path)
            _fsync_directory(path.parent)
    except BaseException:
        _remove(tmp)
        raise
    if old is not None:
        shutil.rmtree(old)


# Replacing a directory is two renames, which no other writer of the same target may come
# between: the threads of this process take this lock, processes the parent directory's `flock`.
_REPLACING = threading.Lock()


@contextlib.contextmanager
def _replacing(directory: pathlib.Path):
    import fcntl

    with _REPLACING:
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:  # not every platform opens directories
            yield
            return
        try:
            with contextlib.suppress(OSError):  # a file system without locks: threads are still in turn
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and the lock with it


def _leftovers(path: pathlib.Path) -> list[pathlib.Path]:
    """The temporaries and set-aside directories of writes to `path` whose writer is gone
    (its process ended; in this process, its thread)."""
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    threads = {t.native_id for t in threading.enumerate()}
    found = []
    for name in names:
        match = _WRITE_NAME.fullmatch(name)
        if not match or path.parent / _target(match) != path:
            continue
        pid, tid = match["pid"] or match["old_pid"], match["tid"] or match["old_tid"]
        if pid is None:  # an earlier version's name
            gone = True
        elif int(pid) == os.getpid():
            gone = int(tid) not in threads or int(tid) == threading.get_native_id()
        else:
            gone = not _running(int(pid))
        if gone:
            found.append(path.parent / name)
    return found


def _running(pid: int) -> bool:
    """Whether process `pid` runs (signal 0 asks, sending nothing; on Windows `os.kill`
    would end the process, so there every writer counts as running)."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def write_text(path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_write(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path, data) -> None:
    """Write `data` as indented JSON to `path` atomically."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_tree(path: pathlib.Path) -> None:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for f in files:
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    if path.is_dir():
        _fsync_directory(path)


def _fsync_directory(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform opens directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
