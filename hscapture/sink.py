"""A consumer sink that keeps nothing: the drain path alone, for drain-rate benchmarks.

It copies every chunk out of the ring exactly as the store does (into host memory the ring
prefers: pinned for the CUDA ring), so slots are released at the rate the copy path allows,
without a disk in the way. It has the store writer's methods, so the consumer needs no `if`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hscapture import protocol
from hscapture.ring import RingReader


class NullSink:
    """Drains chunks into one reused host buffer per slot size and counts them."""

    def __init__(self) -> None:
        self.allocate: Callable[[int], np.ndarray] = lambda n: np.empty(n, dtype=np.uint8)
        self.barrier: Callable[[], None] = lambda: None
        self.rows_written = 0
        self.bytes_copied = 0
        #: As the store's: rows done with (here, once copied) and bytes written (none).
        self.rows_durable = 0
        self.bytes_durable = 0
        self._buffer: np.ndarray | None = None

    def begin_run(self, layout: protocol.Layout) -> None:
        self._buffer = self.allocate(layout.slot_bytes)

    def add_chunk(self, chunk: protocol.Chunk, source: RingReader | Any) -> None:
        assert self._buffer is not None, "begin_run first"
        source.copy_into(chunk.offset, self._buffer[: chunk.nbytes])
        self.rows_written += chunk.rows
        self.rows_durable += chunk.rows
        self.bytes_copied += chunk.nbytes

    def finish_request(self, message: protocol.RequestFinished) -> None:
        return None

    def end_run(self, reason: str, counters: dict[str, int]) -> None:
        self.barrier()

    def tick(self) -> None:
        return None

    def close(self, reason: str = "consumer stopped") -> None:
        self.barrier()
