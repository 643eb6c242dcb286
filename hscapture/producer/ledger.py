"""The producer's slot ledger: which ring slot may be written, which holds rows, and whose release frees it.

A slot is in one place at a time (zguide's credit habit: the producer writes only slots it owns):

* **free**: the producer may write it;
* **written**: rows are in it (or on their way) and the engine has not announced it yet (:meth:`SlotLedger.write`);
* **held**: announced by the engine, its chunk held to be sent with others (:meth:`SlotLedger.hold`);
* **in flight**: announced to a consumer, whose :class:`~hscapture.protocol.Release` with the same seq frees it.

No sockets and no tensors here: the ledger only counts, so it is tested alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class InFlight:
    """A slot announced to a consumer and not released yet."""

    seq: int
    rows: int
    #: The chunk's encoded announcement: a consumer that takes over gets it again, byte for byte.
    payload: bytes
    #: The consumer it was last announced to: the one whose release frees the slot.
    consumer: str


class SlotLedger:
    """Where each of ``num_slots`` ring slots is.

    Args:
        num_slots: slots in the ring, all free at first.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free: deque[int] = deque(range(num_slots))
        #: Slot -> what was announced in it, for slots a release has not freed yet.
        self.in_flight: dict[int, InFlight] = {}
        #: Slot -> rows written in it and not announced yet.
        self.written: dict[int, int] = {}
        #: Slots whose chunks are held to be sent.
        self.held: set[int] = set()
        #: At this many free slots or fewer the producer serves its control socket at once.
        self.low = max(1, num_slots // 4)

    def take(self) -> int | None:
        """A free slot, now owned by the caller (None when none is free)."""
        return self.free.popleft() if self.free else None

    @property
    def running_low(self) -> bool:
        return len(self.free) <= self.low

    def write(self, slot: int, rows: int) -> None:
        """``slot`` (taken) holds ``rows`` rows, not announced yet."""
        self.written[slot] = rows

    def hold(self, slot: int) -> None:
        """The engine announced ``slot``'s rows: its chunk is held to be sent (then :meth:`announced`, or
        :meth:`give_back` when it cannot be)."""
        del self.written[slot]
        self.held.add(slot)

    def give_back(self, slot: int) -> None:
        """A taken, written or held slot whose rows will never be sent is free again (first in line)."""
        self.written.pop(slot, None)
        self.held.discard(slot)
        self.free.appendleft(slot)

    def announced(self, slot: int, seq: int, rows: int, payload: bytes, consumer: str) -> None:
        """``slot`` was sent to ``consumer`` as chunk ``seq``: only that consumer's release frees it now."""
        self.held.discard(slot)
        self.in_flight[slot] = InFlight(seq, rows, payload, consumer)

    def release(self, consumer: str, pairs: Iterable[tuple[int, int]]) -> tuple[int, list[tuple[int, int]]]:
        """Free each ``(slot, seq)`` in flight that was announced to ``consumer`` with that seq.

        Returns:
            How many slots were freed, and the pairs that matched no slot in flight (stale or forged).
        """
        in_flight, freed, bad = self.in_flight, 0, []
        for slot, seq in pairs:
            flight = in_flight.get(slot)
            if flight is None or flight.seq != seq or flight.consumer != consumer:
                bad.append((slot, seq))
                continue
            del in_flight[slot]
            self.free.append(slot)
            freed += 1
        return freed, bad

    def hand_over(self, consumer: str) -> list[InFlight]:
        """Slots in flight announced to another consumer, oldest first: ``consumer`` takes them over once each is
        announced to it again (the caller sets each one's ``consumer`` as it does)."""
        return sorted((f for f in self.in_flight.values() if f.consumer != consumer), key=lambda f: f.seq)

    def drop_written(self) -> tuple[int, int]:
        """Forget every written slot never announced (the producer closes); returns its rows and slots."""
        rows, slots = sum(self.written.values()), len(self.written)
        self.written.clear()
        return rows, slots
