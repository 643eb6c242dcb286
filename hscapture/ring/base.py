"""The two sides of a ring of preallocated slots, as the producer and the consumer see it.

* :class:`Ring` lives in the engine process. It hands out per-slot byte views to write
  rows into, marks a slot written (``mark_written``: the CUDA ring records the slot's IPC
  event there), and describes itself once for the handshake (``describe``).
* :class:`RingReader` lives in the consumer process. It opens a description once and
  copies pieces of announced slots into host memory (asynchronously on the CUDA ring).

Announcements carry only ``(slot, offset, nbytes)``, never handles or paths.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


class Ring(ABC):
    """Producer side: ``num_slots`` slots of ``slot_bytes`` each, allocated once."""

    num_slots: int
    slot_bytes: int

    @abstractmethod
    def slot(self, index: int) -> torch.Tensor:
        """uint8 tensor ``[slot_bytes]`` viewing slot ``index``; write rows into it."""

    def mark_written(self, index: int, stream: int | None = None) -> None:  # noqa: B027 - no-op for host memory
        """Called after the rows of slot ``index`` are written, before it is announced: the writes were queued on
        ``stream`` (a :meth:`current_stream` handle), by default the current one."""

    def current_stream(self) -> int:
        """The stream writes are queued on now (a raw handle; 0 where there is none): ``mark_written`` may
        come later, from another stream, for writes queued on this one."""
        return 0

    def stream_reader(self) -> Callable[[], int]:
        """:meth:`current_stream` as the cheapest callable there is: an engine's hook reads it every step."""
        return self.current_stream

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

    def copy_planes_into(self, offset: int, pitch: int, planes: Sequence[np.ndarray]) -> None:
        """Copy a slot's planes: ``planes[t].nbytes`` bytes at ring ``offset + t * pitch`` into each contiguous
        uint8 array ``planes[t]``."""
        for t, plane in enumerate(planes):
            self.copy_into(offset + t * pitch, plane)

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
