"""The host ring: slots in POSIX shared memory (a file in /dev/shm), for CPU engines and tests."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

from hscapture.errors import ProtocolError, short_repr
from hscapture.ownership import create_private, pid_alive, unlink_ours
from hscapture.ring.base import Ring, RingReader

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


#: ``hscapture-UID-PID-NAME.ring``: the owner's pid in the name lets a later run reclaim a dead owner's ring.
_RING_NAME = re.compile(r"^hscapture-(\d+)-(\d+)-.+\.ring$")


class HostRing(Ring):
    """A ring in POSIX shared memory (a file in /dev/shm), for CPU engines and tests.

    The file ``hscapture-UID-PID-NAME.ring`` is created exclusively with mode 0600, stays locked
    (``flock``) while its producer lives, and is unlinked on close; a consumer that still has it
    mapped keeps reading valid memory until it unmaps. A producer killed before its close leaves
    the file behind: the next host ring of the same user removes it (:func:`reclaim_host_rings`).
    """

    def __init__(self, num_slots: int, slot_bytes: int, name: str) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        reclaim_host_rings()
        self.path = SHM_DIR / f"hscapture-{os.getuid()}-{os.getpid()}-{name}.ring"
        nbytes = num_slots * slot_bytes
        self._fd: int | None = create_private(self.path)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held for our life: the file is in use
            os.ftruncate(self._fd, nbytes)
            self._map = mmap.mmap(self._fd, nbytes)
        except OSError:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            raise
        import torch  # the engine's side: its rows are tensors

        self._bytes: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)

    def slot(self, index: int) -> torch.Tensor:
        if self._bytes is None:
            raise ValueError("ring is closed")
        start = index * self.slot_bytes
        return self._bytes[start : start + self.slot_bytes]

    def describe(self) -> dict[str, Any]:
        return {"backend": "host", "path": str(self.path), "nbytes": self.num_slots * self.slot_bytes}

    def close(self) -> None:
        if self._bytes is None:
            return
        self._bytes = None
        self.path.unlink(missing_ok=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            self._map.close()
        except BufferError:
            # A caller still holds a view of a slot: the mapping goes when that view does.
            log.debug("ring %s still viewed; unmapping when the last view is freed", self.path)


def reclaim_host_rings() -> list[Path]:
    """Remove the host rings of this user whose producers died; the paths removed.

    A ring is reclaimed only when it is a regular file of ours, the pid in its name is not alive
    here, and nobody holds its lock (its producer may live in another pid namespace). Another
    user's files are never touched.
    """
    removed: list[Path] = []
    uid = os.getuid()
    with os.scandir(SHM_DIR) as entries:
        candidates = [(e.name, _RING_NAME.match(e.name)) for e in entries if e.name.startswith(f"hscapture-{uid}-")]
    for name, match in candidates:
        if match is None or int(match.group(1)) != uid or pid_alive(int(match.group(2))):
            continue
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its producer lives (elsewhere)
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(path).st_ino == info.st_ino and unlink_ours(path):
                    removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d host rings of dead producers from %s", len(removed), SHM_DIR)
    return removed


class HostRingReader(RingReader):
    """Maps a :class:`HostRing` read-only."""

    def __init__(self, description: dict[str, Any]) -> None:
        path = Path(str(description.get("path", "")))
        nbytes = description.get("nbytes")
        if path.parent != SHM_DIR or not path.name.startswith("hscapture-") or not isinstance(nbytes, int):
            raise ProtocolError(f"Layout.ring: not a host ring description: {short_repr(description)}")
        if nbytes <= 0:
            raise ProtocolError(f"Layout.ring.nbytes: {nbytes} is not a ring size")
        try:  # never follow a link out of /dev/shm, never block on a FIFO
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise ProtocolError(f"Layout.ring: cannot open {path} ({exc.strerror}); is the producer alive?") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise ProtocolError(f"Layout.ring: {path} is not a ring file of this user")
            if info.st_size != nbytes:
                raise ProtocolError(f"Layout.ring: {path} has {info.st_size} bytes, the layout says {nbytes}")
            self._map: mmap.mmap | None = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._map, dtype=np.uint8)
        self.nbytes = nbytes

    def copy_into(self, offset: int, dst: np.ndarray) -> None:
        np.copyto(dst, self.view(offset, dst.nbytes).reshape(dst.shape))

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The ``nbytes`` ring bytes at ``offset``, read-only, uncopied (for reading a slot in place
        between ``begin`` and its release; valid until :meth:`close`)."""
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ProtocolError(f"Chunk: bytes {offset}..{offset + nbytes} fall outside the ring of {self.nbytes}")
        return self._view[offset : offset + nbytes]

    def close(self) -> None:
        if self._map is None:
            return
        del self._view
        try:
            self._map.close()
        except BufferError:
            log.debug("host ring still viewed at close; unmapping when the last view is freed")
        self._map = None
