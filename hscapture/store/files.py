"""A store's files on disk: who may read them, how they are created, replaced and locked.

A store holds users' token ids and hidden states, so it is private to its owner unless the owner
shares it with a group (``share_group``): the directory is then setgid 2750 in that group and every
file 0640, otherwise the directory is 0700 and every file 0600. A directory another user owns, or
that others may write into, is refused (whoever can write there can plant links), and so is one
under a directory others may write into (unless sticky) or reached through another user's link
(:func:`~hscapture.ownership.check_path_to`: they could put a directory of theirs in its place). The
directory is opened once (:class:`~hscapture.store.directory.StoreDir`) and every file is made,
renamed and fsync'd relative to that handle, so the store cannot be moved from under its writer.
Every file is created afresh under an unpredictable temp name of ours with ``O_EXCL | O_NOFOLLOW``
and renamed into place, or (the lock, the index) opened with ``O_NOFOLLOW`` and checked to be a
regular file of ours, so a link planted where the store writes is never followed.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import re
import stat
import time
from pathlib import Path

from hscapture.errors import AccessError, StoreError
from hscapture.ownership import TEMP_PREFIX, check_owner, check_path_to, open_own, unlink_ours, write_private
from hscapture.store.directory import PRIVATE_FILE_MODE, SHARED_FILE_MODE, StoreDir
from hscapture.store.format import LOCK_FILE

#: Mode of a shared store's directory (setgid: files take its group).
SHARED_DIR_MODE = 0o2750
#: Temp files a store writer names (``.hscapture-NAME.PID.RANDOM.tmp``), and those its earlier versions named.
_TEMP = re.compile(rf"\.{TEMP_PREFIX}.+\.\d+\.[0-9a-f]{{12}}\.tmp")
_OLD_TEMP = re.compile(r"(shard-\d{6,}\.safetensors|meta\.json)\.tmp")


def group_id(name: str) -> int:
    """The id of a group this user may share a store with.

    Raises:
        ValueError: no such group, or the user is not in it (only root may give files to any group).
    """
    try:
        gid = int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(f"share_group: no group {name!r} on this host; give a group you belong to") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ValueError(f"share_group: you are not a member of group {name!r}; give a group you belong to")
    return gid


def open_store_dir(
    root: Path, share_group: str | None = None, what: str = "store directory", option: str = "--out"
) -> StoreDir:
    """Create the store directory (0700), or check an existing one, and open it: the handle every file of
    the store is made through.

    ``root`` may be a link of the user's own to a directory elsewhere; a link of another user on the way to it,
    or a directory on the way that others may write into (unless sticky), is refused. With ``share_group`` the
    directory is given to that group, setgid and 2750, and the store's files already there become 0640 in it.
    ``what`` names the directory in messages (an export's output directory follows the same rules), ``option`` the
    argument that gives it.

    Raises:
        AccessError: a link or directory of another user, a directory others may write into, or one on the
            way to it that others may write into.
        ValueError: ``share_group`` names no group of the user's.
    """
    gid = None if share_group is None else group_id(share_group)
    check_path_to(root, what)
    root.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    follow = stat.S_ISLNK(os.lstat(root).st_mode)  # a link of ours or root's (checked on the way)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except NotADirectoryError:
        raise AccessError(f"{what} {root} is not a directory; choose another {option}") from None
    directory = StoreDir(root, fd)
    try:
        fix = (
            f"if you made it, run `chmod go-w {root}`, else choose another {option} (whoever can write there can "
            "plant links)"
        )
        check_owner(os.fstat(fd), root, what, 0o022, fix)
        if gid is not None:
            os.fchown(fd, -1, gid)
            os.fchmod(fd, SHARED_DIR_MODE)
            for name in directory.names():
                info = directory.lstat(name)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
                    _share(directory, name, gid)
    except BaseException:
        directory.close()
        raise
    return directory


def prepare_store_dir(
    root: Path, share_group: str | None = None, what: str = "store directory", option: str = "--out"
) -> int:
    """:func:`open_store_dir` for a caller that keeps no handle; returns the mode of files to create."""
    with open_store_dir(root, share_group, what, option) as directory:
        return directory.file_mode


def _share(directory: StoreDir, name: str, gid: int) -> None:
    fd = directory.open_file(name, os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.fchown(fd, -1, gid)
        os.fchmod(fd, SHARED_FILE_MODE)
    finally:
        os.close(fd)


def remove_stale_temps(directory: StoreDir) -> list[str]:
    """Remove the temp files store writers name (never another file, never another user's); their names.

    Call it holding the store's lock: no writer is then alive to own one.
    """
    removed = []
    for name in directory.names():
        if (_TEMP.fullmatch(name) or _OLD_TEMP.fullmatch(name)) and unlink_ours(directory.file(name), directory.fd):
            removed.append(name)
    return removed


def write_all(fd: int, data: memoryview | bytes) -> None:
    """``os.write`` until every byte of ``data`` is written."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: Path, data: bytes, mode: int = PRIVATE_FILE_MODE) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new, never a torn one."""
    write_private(path, data, mode)
    fsync_dir(path.parent)


def replace_file(directory: StoreDir, name: str, data: bytes, mode: int = PRIVATE_FILE_MODE) -> None:
    """:func:`write_atomic` of the file ``name`` in the store ``directory``, through its handle."""
    write_private(directory.file(name), data, mode, directory.fd)
    directory.fsync()


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StoreLock:
    """The store's writer lock: an ``flock`` on ``.lock``, which says the holder's pid."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock_store(
    root: Path | StoreDir, timeout_s: float, mode: int = PRIVATE_FILE_MODE, inherited_fd: int | None = None
) -> StoreLock:
    """Take the store's writer lock (one writer per store), waiting up to ``timeout_s`` (0: refuse at once).

    Args:
        root: the store directory (its handle, or its path).
        timeout_s: how long to wait for another writer to finish.
        mode: of the lock file, if it is created.
        inherited_fd: a descriptor of this store's ``.lock`` that the process which started this one
            locked already (``hscapture extract`` for its consumer): the lock is shared with it, never
            released in between, so no other writer gets in.

    Raises:
        StoreError: another process holds the lock (the message gives its pid), or ``inherited_fd``
            is not this store's lock file.
        AccessError: ``.lock`` is a link, not a regular file, or another user's.
    """
    directory = StoreDir.of(root)
    root, path = directory.path, directory.file(LOCK_FILE)
    if inherited_fd is not None:
        held, here = os.fstat(inherited_fd), directory.lstat(LOCK_FILE)
        if (held.st_dev, held.st_ino) != (here.st_dev, here.st_ino):
            raise StoreError(f"{path}: descriptor {inherited_fd} is not this store's lock file")
        fd = inherited_fd
    else:
        fd = open_own(path, os.O_RDWR | os.O_CREAT, "store lock file", mode, directory.fd)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise StoreError(
                    f"{root}: the store is in use, being written by {owner}; stop it or write to another directory"
                ) from None
            time.sleep(0.1)
    if inherited_fd is None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
    return StoreLock(fd)
