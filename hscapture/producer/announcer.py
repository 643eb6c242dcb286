"""Announcements held back and sent together: the fixed cost of a socket call paid every few steps, not every step.

Each written slot's :class:`~hscapture.protocol.Chunk` is encoded at once (it takes the next seq)
and held; the held chunks go out oldest first in one :class:`~hscapture.protocol.Announcements`
message when the producer serves its sockets. :meth:`Announcer.due` says when that is: free slots
running low, ``SERVICE_S`` passed with chunks held (holding none, every ``SERVE_STEPS`` steps: an
engine whose steps outlast ``SERVICE_S`` would otherwise pay for the control socket every step), or
``FLUSH_CHUNKS`` held. Only the delay changes: seq order, a request's end after its rows and drop
counting are as for one message per chunk. No sockets here: the producer sends what :meth:`take` gives.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import numpy as np

from hscapture import protocol
from hscapture.producer.checks import StepChecks

#: Longest the producer goes, while steps run, without sending the chunks it holds and taking releases and hellos.
#: A time gate cannot miss a message, it only delays it (a gate on the socket's ZMQ_FD did).
SERVICE_S = 0.004
#: Chunks held back at most before they are sent (together, in one message).
FLUSH_CHUNKS = 16
#: Steps the producer goes at most, holding no chunk, without taking releases and hellos (once ``SERVICE_S`` has
#: passed too); free slots running low, a wait, a request's end and ``poll`` take them at once.
SERVE_STEPS = 8


class Held(NamedTuple):
    """A chunk encoded and its slot written, held back to be sent with others."""

    slot: int
    seq: int
    rows: int
    payload: bytes
    #: The requests owning its rows (counted dropped if ``drop`` cannot send it).
    request_ids: Sequence[str]
    request_rows: Sequence[int]


class Announcer:
    """Encodes chunks in seq order and holds them until the producer sends them (:meth:`take`).

    Args:
        slot_bytes: bytes of one ring slot (a chunk's offset is ``slot * slot_bytes``).
        row_bytes: bytes of one row of every captured tensor.
        checks: the run's step checks, whose owners (the same tuples step after step) are encoded once.
    """

    def __init__(self, slot_bytes: int, row_bytes: int, checks: StepChecks) -> None:
        self._slot_bytes, self._row_bytes, self._checks = slot_bytes, row_bytes, checks
        self._seq = itertools.count(1)
        #: Chunks announced by the engine and not sent yet, oldest first.
        self.held: list[Held] = []
        self._service_at = 0.0  # when the held chunks and the control socket are next served at the latest
        self._steps_unserved = 0  # steps since the control socket was last served

    def hold(
        self,
        slot: int,
        rows: int,
        row_stride: int,
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        positions: np.ndarray,
        token_ids: np.ndarray,
        step: int,
        dropped_rows: int,
        slots_in_flight: int,
    ) -> None:
        """Encode the chunk of a written slot whose event is recorded, and hold it.

        Args:
            slot, rows, row_stride: where the rows are (``row_stride`` rows per plane; 0: ``rows``).
            request_ids, request_rows: owners of the rows, in row order.
            positions, token_ids: ``[rows]`` int64 per row.
            step: the producer's step that wrote the first of them.
            dropped_rows: rows the producer dropped so far (the consumer's gauge).
            slots_in_flight: slots announced and not released (the consumer's gauge).
        """
        checks = self._checks
        if checks.same_owners(request_ids, request_rows):
            ids: list[str] | msgspec.Raw = checks.owners.encoded_ids  # type: ignore[union-attr]
            counts: list[int] | msgspec.Raw = checks.owners.encoded_rows  # type: ignore[union-attr]
        else:
            ids, counts = list(request_ids), list(request_rows)
        seq = next(self._seq)
        chunk = protocol.Chunk(
            v=protocol.PROTOCOL_VERSION,
            seq=seq,
            step=step,
            slot=slot,
            offset=slot * self._slot_bytes,
            nbytes=(row_stride or rows) * self._row_bytes,
            rows=rows,
            request_ids=ids,  # a list, or its encoded form (the same bytes on the wire)
            request_rows=counts,
            positions=protocol.pack_rows(positions),
            token_ids=protocol.pack_rows(token_ids),
            dropped_rows=dropped_rows,
            row_stride=row_stride,
            ring_slots_used=slots_in_flight + len(self.held) + 1,
        )
        self.held.append(Held(slot, seq, rows, protocol.encode(chunk), request_ids, request_rows))

    @property
    def full(self) -> bool:
        """Enough chunks are held to send them now."""
        return len(self.held) >= FLUSH_CHUNKS

    def due(self, running_low: bool) -> bool:
        """Counts a step; whether the sockets are to be served before it (see the module docstring)."""
        self._steps_unserved += 1
        return running_low or (
            (bool(self.held) or self._steps_unserved >= SERVE_STEPS) and time.monotonic() >= self._service_at
        )

    def served(self) -> None:
        """The producer just served its sockets: the next time is ``SERVICE_S`` away."""
        self._service_at = time.monotonic() + SERVICE_S
        self._steps_unserved = 0

    def take(self) -> tuple[bytes, list[Held]] | None:
        """The held chunks as one message (a lone chunk as itself), oldest first, and no longer held; None if
        none is held. Each chunk's own bytes stay its slot's payload: a consumer that takes over gets it again
        alone, byte for byte what it would have found in the batch."""
        held = self.held
        if not held:
            return None
        self.held = []
        if len(held) == 1:
            return held[0].payload, held
        batch = protocol.Announcements(v=protocol.PROTOCOL_VERSION, chunks=[msgspec.Raw(h.payload) for h in held])
        return protocol.encode(batch), held
