"""Announcements held back and sent together: the fixed cost of a socket call paid every few steps, not every step.

Each written slot's chunk is held as its fields (it takes the next seq at once) and encoded as a
:class:`~hscapture.protocol.Chunk` only when it is taken: the producer's service thread takes the
held chunks every ``SERVICE_S`` while steps run, so the engine's thread neither encodes nor sends
them. They go out oldest first in one :class:`~hscapture.protocol.Announcements` message. Only the
delay changes: seq order, a request's end after its rows and drop counting are as for one message
per chunk. No sockets here: the producer sends what :meth:`Announcer.take` gives.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec

from hscapture import protocol
from hscapture.producer.base import joined_owners
from hscapture.producer.checks import StepChecks

#: Longest the producer's service thread waits, while steps run, before it sends the chunks held and takes releases
#: and hellos. A time gate cannot miss a message, it only delays it (a gate on the socket's ZMQ_FD did).
SERVICE_S = 0.004
#: Chunks held back at most before the service thread is woken to send them (together, in one message).
FLUSH_CHUNKS = 16


class Held:
    """A written slot's chunk, held back to be sent with others; its bytes are made when it is taken."""

    __slots__ = ("_chunk", "_joined", "_owners", "payload", "rows", "seq", "slot")

    def __init__(
        self,
        slot: int,
        seq: int,
        rows: int,
        owners: tuple[Sequence[str], Sequence[int]],
        joined: Sequence[tuple[Sequence[str], Sequence[int]]],
        chunk: tuple,
    ) -> None:
        self.slot, self.seq, self.rows = slot, seq, rows
        self._owners, self._joined = owners, joined
        #: The encoded :class:`~hscapture.protocol.Chunk` ('' until taken): a consumer that takes over gets it again.
        self.payload = b""
        self._chunk = chunk

    def owners(self) -> tuple[Sequence[str], Sequence[int]]:
        """The requests owning its rows and how many each, in row order (counted dropped if ``drop`` cannot send
        it): those of its first step, then of each step that joined it."""
        return joined_owners(*self._owners, self._joined)

    def encode(self, slot_bytes: int, row_bytes: int) -> bytes:
        """The chunk's bytes (made once)."""
        if not self.payload:
            row_stride, ids, counts, positions, token_ids, step, dropped_rows, slots_used = self._chunk
            if self._joined:
                ids, counts = self.owners()
            chunk = protocol.Chunk(
                v=protocol.PROTOCOL_VERSION,
                seq=self.seq,
                step=step,
                slot=self.slot,
                offset=self.slot * slot_bytes,
                nbytes=(row_stride or self.rows) * row_bytes,
                rows=self.rows,
                request_ids=ids,  # a list, or its encoded form (the same bytes on the wire)
                request_rows=counts,
                positions=_joined(positions),
                token_ids=_joined(token_ids),
                dropped_rows=dropped_rows,
                row_stride=row_stride,
                ring_slots_used=slots_used,
            )
            self.payload, self._chunk = protocol.encode(chunk), ()
        return self.payload


class Announcer:
    """Holds chunks in seq order until the producer sends them (:meth:`take`).

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

    def hold(
        self,
        slot: int,
        rows: int,
        row_stride: int,
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        positions: bytes | list[bytes],
        token_ids: bytes | list[bytes],
        step: int,
        dropped_rows: int,
        slots_in_flight: int,
        joined: Sequence[tuple[Sequence[str], Sequence[int]]] = (),
    ) -> None:
        """Hold the chunk of a written slot whose event is recorded (encoded when taken).

        Args:
            slot, rows, row_stride: where the rows are (``row_stride`` rows per plane; 0: ``rows``).
            request_ids, request_rows: owners of the rows, in row order (of the first step's, with ``joined``).
            positions, token_ids: ``[rows]`` int64 per row as bytes (``ndarray.tobytes()``, as a
                :class:`~hscapture.protocol.Chunk` holds them), or the pieces of it in row order (joined when taken).
            step: the producer's step that wrote the first of them.
            dropped_rows: rows the producer dropped so far (the consumer's gauge).
            slots_in_flight: slots announced and not released (the consumer's gauge).
            joined: the owners of each later step whose rows follow in the slot, in order (a run's): the owners of
                all of them are listed when the chunk is encoded, not here. Nothing may change them after.
        """
        checks = self._checks
        if joined:
            ids: Sequence[str] | msgspec.Raw = ()
            counts: Sequence[int] | msgspec.Raw = ()
        elif checks.same_owners(request_ids, request_rows):  # read now: the owners change with the engine's steps
            ids, counts = checks.owners.encoded()  # type: ignore[union-attr]
        else:
            ids, counts = list(request_ids), list(request_rows)
        slots_used = slots_in_flight + len(self.held) + 1
        chunk = (row_stride, ids, counts, positions, token_ids, step, dropped_rows, slots_used)
        self.held.append(Held(slot, next(self._seq), rows, (request_ids, request_rows), joined, chunk))

    @property
    def full(self) -> bool:
        """Enough chunks are held to send them now."""
        return len(self.held) >= FLUSH_CHUNKS

    def take(self) -> tuple[bytes, list[Held]] | None:
        """The held chunks as one message (a lone chunk as itself), oldest first, and no longer held; None if
        none is held. Each chunk's own bytes stay its slot's payload: a consumer that takes over gets it again
        alone, byte for byte what it would have found in the batch."""
        held = self.held
        if not held:
            return None
        self.held = []
        payloads = [h.encode(self._slot_bytes, self._row_bytes) for h in held]
        if len(held) == 1:
            return payloads[0], held
        batch = protocol.Announcements(v=protocol.PROTOCOL_VERSION, chunks=[msgspec.Raw(p) for p in payloads])
        return protocol.encode(batch), held

    def put_back(self, held: list[Held]) -> None:
        """Hold again, before any held since, chunks :meth:`take` gave that could not be sent now."""
        self.held[:0] = held


def _joined(pieces: bytes | list[bytes]) -> bytes:
    return pieces if type(pieces) is bytes else b"".join(pieces)
