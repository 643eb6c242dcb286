"""The ring of preallocated slots the producer writes into and the consumer copies out of.

Two sides, one interface per side, so the CUDA backend (device memory exported over CUDA
IPC) slots in beside the host backend (POSIX shared memory) without touching the producer
or the consumer:

* :class:`Ring` lives in the engine process. It hands out per-slot byte views to write
  rows into, marks a slot written (``mark_written``: the CUDA ring records the slot's IPC
  event there), and describes itself once for the handshake (``describe``).
* :class:`RingReader` lives in the consumer process. It opens a description once and
  copies pieces of announced slots into host memory (asynchronously on the CUDA ring).

Announcements carry only ``(slot, offset, nbytes)``, never handles or paths.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hscapture.errors import ProtocolError
from hscapture.protocol import short_repr

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


class Ring(ABC):
    """Producer side: ``num_slots`` slots of ``slot_bytes`` each, allocated once."""

    num_slots: int
    slot_bytes: int

    @abstractmethod
    def slot(self, index: int) -> torch.Tensor:
        """uint8 tensor ``[slot_bytes]`` viewing slot ``index``; write rows into it."""

    def mark_written(self, index: int) -> None:  # noqa: B027 - optional hook, no-op for host memory
        """Called after the rows of slot ``index`` are written, before it is announced."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What a consumer needs to open the ring (sent once in the handshake)."""

    @abstractmethod
    def close(self) -> None:
        """Free the ring. Idempotent."""


class RingReader(ABC):
    """Consumer side: opened once per run from :meth:`Ring.describe`; ``nbytes`` is its size.

    Per chunk the consumer calls ``begin(slot)``, then ``copy_into`` for each piece it
    wants (copies may run asynchronously), then ``mark()``; the slot may be released once
    ``done(token)`` says the copies finished. ``complete()`` waits for every copy issued.
    """

    nbytes: int

    def begin(self, slot: int) -> None:  # noqa: B027 - only the CUDA ring has producer writes to wait for
        """Order the copies that follow after the producer's writes to ``slot``."""

    @abstractmethod
    def copy_into(self, offset: int, dst: np.ndarray) -> None:
        """Copy ``dst.nbytes`` bytes at ring ``offset`` into the contiguous uint8 array ``dst``."""

    def mark(self) -> Any:
        """A token for the copies issued so far (see :meth:`done`)."""
        return None

    def done(self, token: Any) -> bool:
        """Whether the copies before ``token`` have finished (their slots may be released)."""
        return True

    def wait(self, token: Any) -> None:  # noqa: B027 - host copies are synchronous
        """Block until the copies before ``token`` have finished."""

    def complete(self) -> None:  # noqa: B027 - host copies are synchronous
        """Block until every copy issued so far has landed in host memory."""

    def allocate(self, nbytes: int) -> np.ndarray:
        """Host memory the ring copies into fastest (pinned for the CUDA ring)."""
        return np.empty(nbytes, dtype=np.uint8)

    @abstractmethod
    def close(self) -> None:
        """Unmap the ring. Idempotent; never raises."""


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


def create_ring(device: torch.device, num_slots: int, slot_bytes: int, name: str) -> Ring:
    """The ring for an engine on ``device``: host shared memory for CPU, CUDA IPC memory for GPU."""
    if device.type == "cpu":
        return HostRing(num_slots, slot_bytes, name)
    if device.type == "cuda":
        from hscapture.cuda_ring import CudaRing

        return CudaRing(num_slots, slot_bytes, device)
    raise ValueError(f"device: {device} has no ring backend; use 'cpu' or 'cuda[:N]'")


def open_ring(description: dict[str, Any]) -> RingReader:
    """Open the ring a :class:`~hscapture.protocol.Layout` describes."""
    backend = description.get("backend")
    if backend == "host":
        return HostRingReader(description)
    if backend == "cuda":
        from hscapture.cuda_ring import CudaRingReader

        return CudaRingReader(description)
    raise ProtocolError(f"Layout.ring.backend: {backend!r} is not supported by this consumer")
