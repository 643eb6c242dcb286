"""The host ring: slots in POSIX shared memory (a file in /dev/shm), for CPU engines and tests."""

from __future__ import annotations

import logging
import mmap
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hscapture.errors import ProtocolError, short_repr
from hscapture.ring.base import Ring, RingReader

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


class HostRing(Ring):
    """A ring in POSIX shared memory (a file in /dev/shm), for CPU engines and tests.

    The file is created exclusively with mode 0600 and unlinked on close; a consumer that
    still has it mapped keeps reading valid memory until it unmaps.
    """

    def __init__(self, num_slots: int, slot_bytes: int, name: str) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.path = SHM_DIR / f"hscapture-{os.getuid()}-{name}.ring"
        nbytes = num_slots * slot_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        except OSError:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
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
        try:
            self._map.close()
        except BufferError:
            # A caller still holds a view of a slot: the mapping goes when that view does.
            log.debug("ring %s still viewed; unmapping when the last view is freed", self.path)


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
        if offset < 0 or offset + dst.nbytes > self.nbytes:
            raise ProtocolError(f"Chunk: bytes {offset}..{offset + dst.nbytes} fall outside the ring of {self.nbytes}")
        dst[:] = self._view[offset : offset + dst.nbytes]

    def close(self) -> None:
        if self._map is None:
            return
        del self._view
        try:
            self._map.close()
        except BufferError:
            log.debug("host ring still viewed at close; unmapping when the last view is freed")
        self._map = None
