"""A refused or failed command leaves nothing it created: no empty store, no lock file, no empty folder.

``hscapture extract`` creates ``--out`` and takes the store's lock before its model loads (so that a
second extraction into the same store is refused at once), and its consumer creates ``index.jsonl``
when it starts. When the run then fails before anything is recorded (a layer the model lacks, an
architecture it cannot capture, an engine that does not start), what it created is removed: an
``--out`` that did not exist does not exist after, and one that existed holds nothing new. A store
where a run began (``meta.json`` written, or ``index.jsonl`` grown) is kept as it is: it may hold
captured rows, and a rerun resumes it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from hscapture.store.format import INDEX_FILE, META_FILE


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, innermost first."""
    missing = []
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            break
        missing.append(candidate)
    return missing


def remove_empty(dirs: list[Path]) -> None:
    """Remove each of ``dirs`` (innermost first) that is an empty directory; anything with content stays."""
    for path in dirs:
        with contextlib.suppress(OSError):
            os.rmdir(path)


@contextlib.contextmanager
def dirs_removed_on_failure(path: Path) -> Iterator[None]:
    """On an exception, remove ``path`` and the ancestors that did not exist on entry, where they are empty."""
    made = missing_dirs(path)
    try:
        yield
    except BaseException:
        remove_empty(made)
        raise


def files_of(root: Path) -> dict[str, int] | None:
    """The sizes of the regular files directly in ``root`` (None: ``root`` does not exist)."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return None
    return {e.name: e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False)}


def undo_unrecorded(root: Path, before: dict[str, int] | None) -> bool:
    """Remove the files created in the store ``root`` since ``before`` (:func:`files_of`), and ``root`` itself if it
    did not exist then, unless a run was recorded meanwhile. Call it holding the store's lock.

    Returns:
        Whether anything was undone (False: a run was recorded, the store is kept).
    """
    now = files_of(root)
    if now is None:
        return False
    was = before or {}
    if META_FILE in now and META_FILE not in was:
        return False  # a run began: its rows may be there
    if now.get(INDEX_FILE, 0) > was.get(INDEX_FILE, 0):
        return False  # lines recorded (a run, or the recovery of an earlier one)
    for name in now.keys() - was.keys():
        path = root / name
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(path).st_mode):
                path.unlink()
    if before is None:
        remove_empty([root])
    return True
