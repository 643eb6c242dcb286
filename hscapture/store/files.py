"""Durable files: exclusive creation, atomic replacement, directory fsync, the one-writer lock.

New files are created with ``O_EXCL | O_NOFOLLOW`` and mode 0600, so a link planted where a file
is about to be written is never followed and a store stays private to its owner.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import IO

from hscapture.errors import StoreError
from hscapture.store.format import LOCK_FILE

#: Flags of every file the store creates.
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def create_file(path: Path) -> int:
    """A new file at ``path`` (a leftover there is removed first), opened for writing; returns its fd."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return os.open(path, CREATE, 0o600)


def write_all(fd: int, data: memoryview | bytes) -> None:
    """``os.write`` until every byte of ``data`` is written."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    fd = create_file(tmp)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_store(root: Path, timeout_s: float) -> IO[str]:
    """Take the store's writer lock (one writer per store), waiting up to ``timeout_s``."""
    handle = (root / LOCK_FILE).open("a+")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.seek(0)
                owner = handle.read().strip() or "another process"
                handle.close()
                raise StoreError(f"{root}: being written by {owner}; stop it or write to another directory") from None
            time.sleep(0.1)
            continue
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        return handle
