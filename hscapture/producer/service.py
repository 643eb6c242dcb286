"""The producer's service thread: the sockets served off the engine's thread, every few milliseconds while steps run.

It wakes every ``SERVICE_S`` while the producer is busy (a step ran, or chunks are held), every
``IDLE_S`` otherwise, and at once when woken (free slots running low, ``FLUSH_CHUNKS`` held), and
runs one turn of the producer's: encode and send the held chunks, take releases and hellos. The
turn takes the producer's lock, so the engine's thread and this one never use a socket at once;
mostly it runs while the engine's thread waits for the device with the GIL released. It holds the
producer only through a weak reference: a producer dropped without ``close`` ends it too.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

import hscapture.producer.announcer as announcing

log = logging.getLogger(__name__)

#: How often the service thread serves the sockets while no step runs (hellos and heartbeats only).
IDLE_S = 0.05


class ServiceThread:
    """Runs ``turn`` (a bound method, held weakly) when woken or its wait ends; ``turn`` returns the next wait in
    seconds, below 0 to stop.

    Args:
        turn: the producer's turn, e.g. ``Producer._serve_turn``.
    """

    def __init__(self, turn: Callable[[], float]) -> None:
        self._woken = threading.Event()
        #: Wakes the thread for a turn now (cheap: a flag and a notify).
        self.wake = self._woken.set
        self._thread = threading.Thread(
            target=_serve, args=(weakref.WeakMethod(turn), self._woken), name="hscapture-producer", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Wake it to end (its turn sees its producer stopping) and wait for that, briefly: a close from a signal
        handler may interrupt the engine's thread inside a call holding the lock, which the turn then waits for; the
        close goes on under the lock and that turn ends the thread."""
        self._woken.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)


def _serve(turn_ref: weakref.WeakMethod, woken: threading.Event) -> None:
    wait_s, failures = announcing.SERVICE_S, 0
    while True:
        woken.wait(wait_s)
        woken.clear()
        turn = turn_ref()
        if turn is None:  # the producer is gone
            return
        try:
            wait_s = turn()
        except Exception:  # the engine's thread still serves where it must: say so, and go on
            failures += 1
            if failures == 1 or failures % 1000 == 0:
                log.exception("serving the producer's sockets failed (%d times so far)", failures)
            wait_s = announcing.SERVICE_S
        del turn
        if wait_s < 0:
            return


def next_wait(busy: bool) -> float:
    """The wait before the next turn: ``SERVICE_S`` while busy, else ``IDLE_S`` (never less than ``SERVICE_S``)."""
    return announcing.SERVICE_S if busy else max(announcing.SERVICE_S, IDLE_S)
