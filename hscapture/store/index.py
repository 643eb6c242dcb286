"""Appending to ``index.jsonl`` on a thread of its own, one fsync per group of lines.

Every line carries its own CRC-32 (``line_crc32``, FORMAT.md), so a changed byte anywhere in the
index is caught by the readers. The writer hands over groups of lines in the order they must
appear. A group of ``shard`` lines is fsync'd before anything after it is written, so a line
naming a shard never reaches the disk before that shard's own line; other groups that are
waiting are written together and fsync'd once. The consumer's loop therefore never waits for an
fsync, and a burst of finished requests costs one fsync, not one each.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

from hscapture.errors import StoreError
from hscapture.ownership import open_own
from hscapture.store.directory import PRIVATE_FILE_MODE, StoreDir
from hscapture.store.files import replace_file
from hscapture.store.format import INDEX_FILE, encode_line

log = logging.getLogger(__name__)

#: What a failed write leaves, said in every such error.
KEPT = (
    "what the index lists is intact; free space (or fix the disk) and run the same command again: it first records "
    "the requests this run could not (hscapture verify reports them as unrecorded until then), then continues"
)

_Group = tuple[bytes, bool, Callable[[], None] | None]


class IndexLog:
    """Appends groups of index lines to a store's ``index.jsonl`` in order, on the ``hscapture-index`` thread.

    Args:
        directory: the store (its index is created with ``mode`` if absent; a torn last line must be cut before).
        mode: of the file, if it is created.

    Raises:
        AccessError: the index is a link, not a regular file, or another user's.
    """

    def __init__(self, directory: StoreDir, mode: int = PRIVATE_FILE_MODE) -> None:
        self.path = directory.file(INDEX_FILE)
        self._fd = open_own(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "store index", mode, directory.fd)
        self._queue: queue.SimpleQueue[_Group | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._queued = 0
        self._written = 0
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="hscapture-index", daemon=True)
        self._thread.start()

    def append(
        self, records: list[dict[str, Any]], barrier: bool = False, on_durable: Callable[[], None] | None = None
    ) -> None:
        """Queue ``records`` as one group.

        Args:
            records: index lines, in order.
            barrier: fsync this group before writing any later one (``shard`` lines).
            on_durable: called on the index thread once the group is fsync'd.

        Raises:
            StoreError: an earlier write failed.
        """
        self.check()
        if not records:
            return
        data = b"".join(encode_line(r) for r in records)
        with self._done:
            self._queued += 1
        self._queue.put((data, barrier, on_durable))

    def flush(self) -> None:
        """Wait until every group queued so far is durable.

        Raises:
            StoreError: a write failed.
        """
        with self._done:
            self._done.wait_for(lambda: self._written == self._queued or self._error is not None)
        self.check()

    def check(self) -> None:
        if self._error is not None:
            raise StoreError(self._error)

    def close(self) -> None:
        """Write what is queued, stop the thread, close the file. Idempotent; raises a write failure once."""
        if self._fd < 0:
            return
        self._queue.put(None)
        self._thread.join()
        os.close(self._fd)
        self._fd = -1
        self.check()

    def _run(self) -> None:
        while True:
            groups = [self._queue.get()]
            while groups[-1] is not None and not groups[-1][1]:  # gather what waits, up to a barrier
                try:
                    groups.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            ready = [g for g in groups if g is not None]
            if ready:
                self._write(ready)
            if groups[-1] is None:
                return

    def _write(self, groups: list[_Group]) -> None:
        if self._error is None:
            try:
                data = memoryview(b"".join(g[0] for g in groups))
                while data:
                    data = data[os.write(self._fd, data) :]
                os.fsync(self._fd)
            except OSError as exc:  # a torn line is cut by the next writer; everything before it stands
                self._error = f"{self.path}: append failed ({exc.strerror}); {KEPT}"
                log.error("%s", self._error)
            else:
                for _, _, on_durable in groups:
                    if on_durable is not None:
                        on_durable()
        with self._done:
            self._written += len(groups)
            self._done.notify_all()


def rewrite_index(directory: StoreDir, records: Iterable[dict[str, Any]], mode: int) -> None:
    """Replace the index of the store ``directory`` with ``records``, each line with its checksum, atomically.

    Only for a store whose lock is held: upgrading a version-1 store, or ``hscapture verify --repair``.
    """
    replace_file(directory, INDEX_FILE, b"".join(encode_line(r) for r in records), mode)
