"""A store directory as one handle: its files are reached through it, never through a link.

A writer opens its store directory once (:meth:`StoreDir.open`, or
:func:`hscapture.store.files.open_store_dir` with its checks) and makes, opens, renames and fsyncs
every file relative to that descriptor (``openat``, ``renameat``): if the directory is renamed mid-run
and another put in its place, every file still lands in the one that was opened. Readers may name a
store by path alone (:meth:`StoreDir.of`); either way a file of the store that is a symbolic link is
refused (``O_NOFOLLOW``) with one :class:`~hscapture.errors.StoreError` naming it, never followed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hscapture.errors import StoreError
from hscapture.ownership import open_regular

#: Modes of a shared store's files, and of a private store's.
SHARED_FILE_MODE = 0o640
PRIVATE_FILE_MODE = 0o600


class StoreDir:
    """The store directory at ``path``: opened (``fd``), or named by path only (``fd`` None, for readers).

    ``path`` names it in messages; with ``fd`` every call below works in the directory that was opened,
    wherever it is now. Close it (or use it as a context manager) when done; closing is idempotent.
    """

    def __init__(self, path: Path, fd: int | None = None) -> None:
        self.path = Path(path)
        self.fd = fd

    @classmethod
    def open(cls, path: str | Path) -> StoreDir:
        """Open the directory at ``path`` (a link there is followed: the caller named it).

        Raises:
            StoreError: it does not exist or is no directory.
        """
        try:
            return cls(Path(path), os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        except OSError as exc:
            raise StoreError(f"{path}: {exc.strerror}; not a store directory") from None

    @classmethod
    def of(cls, root: str | Path | StoreDir) -> StoreDir:
        """``root`` itself if it is one, else the store at that path, named by path only."""
        return root if isinstance(root, StoreDir) else cls(Path(root))

    def file(self, name: str) -> Path:
        """The path of the file ``name`` in the store, for messages."""
        return self.path / name

    def _at(self, name: str) -> str:
        return name if self.fd is not None else str(self.path / name)

    def open_file(self, name: str, flags: int, mode: int = PRIVATE_FILE_MODE) -> int:
        """``os.open`` of ``name`` in the store, never through a link (``ELOOP`` if it is one)."""
        return os.open(self._at(name), flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)

    def open_regular(self, name: str) -> int | None:
        """A read-only descriptor of the regular file ``name`` in the store; None when there is none.

        Raises:
            StoreError: it is a link, not a regular file, or cannot be opened; the message names it.
        """
        try:
            return open_regular(self.file(name), os.O_RDONLY | os.O_NONBLOCK, "store file", 0, self.fd, StoreError)
        except FileNotFoundError:
            return None

    def read(self, name: str) -> bytes | None:
        """The bytes of the regular file ``name`` in the store (None when there is none); see :meth:`open_regular`."""
        fd = self.open_regular(name)
        if fd is None:
            return None
        try:
            with os.fdopen(fd, "rb") as handle:
                return handle.read()
        except OSError as exc:
            raise StoreError(f"{self.file(name)}: unreadable ({exc.strerror})") from None

    def names(self) -> list[str]:
        """The names of every entry in the store directory."""
        return os.listdir(self.fd if self.fd is not None else self.path)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(self._at(name), dir_fd=self.fd, follow_symlinks=False)

    def replace(self, source: str, target: str) -> None:
        """Rename ``source`` over ``target``, both in the store."""
        os.replace(self._at(source), self._at(target), src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def link(self, source: str, target: str) -> None:
        """A hard link ``target`` to ``source`` (never following a link there), both in the store."""
        os.link(self._at(source), self._at(target), src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, name: str) -> None:
        os.unlink(self._at(name), dir_fd=self.fd)

    def fsync(self) -> None:
        """Make the store's entries (names made, renamed, removed) durable."""
        if self.fd is not None:
            os.fsync(self.fd)
            return
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @property
    def file_mode(self) -> int:
        """Files of the store are group-readable exactly when its directory is shared (setgid, group r-x)."""
        mode = os.fstat(self.fd).st_mode if self.fd is not None else os.stat(self.path).st_mode
        return SHARED_FILE_MODE if mode & stat.S_ISGID and mode & stat.S_IRGRP else PRIVATE_FILE_MODE

    def close(self) -> None:
        if self.fd is not None and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1  # opened and closed: every call fails, none falls back to the path

    def __enter__(self) -> StoreDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
