"""The producer's link to its consumer: what it sends goes to the attached consumer, what comes back on the control
socket (releases, hellos) goes to the session, and under ``block`` a wait for a consumer or a free slot serves that
socket until it ends, its deadline passes or the watchdog stops it.

The session (:mod:`~hscapture.producer.session`) decides who is attached and is tested without a socket; this is the
part that holds the sockets and waits on them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from hscapture import protocol
from hscapture.config import CaptureConfig
from hscapture.errors import CreditTimeout, ProtocolError
from hscapture.producer.base import ProducerCounters
from hscapture.producer.session import ConsumerSession

log = logging.getLogger(__name__)

#: How long one wait for credit or a consumer polls before checking its deadline again.
POLL_MS = 20
_POLLIN = int(zmq.POLLIN)


class ConsumerLink:
    """Sends to the attached consumer and takes what it sends back.

    Args:
        release: the control socket a consumer's releases and hellos arrive on.
        session: the consumer session they go to (it sends through the producer's sockets).
        config: the run's policy, ``block_timeout_s`` and endpoint (named in a timeout's message).
        counters: the producer's counters (credit waits, messages rejected).
        watchdog: called on every turn of a ``block`` wait; raise from it to stop waiting.
    """

    def __init__(
        self,
        release: zmq.Socket,
        session: ConsumerSession,
        config: CaptureConfig,
        counters: ProducerCounters,
        watchdog: Callable[[], None] | None = None,
    ) -> None:
        self._release, self._session, self._config, self._counters = release, session, config, counters
        self._watchdog = watchdog
        self._poller = zmq.Poller()
        self._poller.register(release, zmq.POLLIN)

    def send(self, payload: bytes) -> bool:
        """Send to the attached consumer; under ``drop`` give up at once, under ``block`` wait for one."""
        session = self._session
        if session.send(payload):
            return True
        if self._config.policy == "drop":
            return False
        self.wait_until(lambda: session.send(payload), "a consumer to send to")
        return True

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Block (``block`` policy) serving the control socket until ``ready()`` holds.

        Raises:
            CreditTimeout: ``block_timeout_s`` passed first.
        """
        counters, config = self._counters, self._config
        counters.credit_waits += 1
        start = time.monotonic()
        timeout = config.block_timeout_s
        next_warning = start + 10.0
        try:
            while not ready():
                now = time.monotonic()
                if timeout and now - start > timeout:
                    raise CreditTimeout(
                        f"waited {now - start:.0f} s for {what} (block_timeout_s={timeout}); "
                        f"is `hscapture consume --endpoint {config.endpoint}` running?"
                    )
                if now > next_warning:
                    log.warning("waiting %.0f s for %s; is a consumer running?", now - start, what)
                    next_warning = now + 10.0
                if self._watchdog is not None:
                    self._watchdog()
                self.wait()
        finally:
            counters.credit_wait_us += round((time.monotonic() - start) * 1e6)

    def wait(self, timeout_ms: int = POLL_MS) -> bool:
        """Wait up to ``timeout_ms`` for the control socket, and take what came; returns whether anything did."""
        if self._poller.poll(timeout_ms):
            self.drain()
            return True
        return False

    def drain(self) -> None:
        """Take every release and hello waiting on the control socket (a message that does not decode is counted
        and logged)."""
        # Asking for EVENTS is far cheaper than a recv that raises zmq.Again on every step; the
        # flag is a plain int here (zmq.POLLIN is an IntFlag, whose `&` runs in Python).
        release, session = self._release, self._session
        while release.get(zmq.EVENTS) & _POLLIN:
            try:
                data = release.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = protocol.decode_to_producer(data)
                if isinstance(message, protocol.Release):
                    session.on_release(message)
                else:
                    session.on_hello(message)
            except ProtocolError as exc:
                self._counters.messages_rejected += 1
                log.warning("rejected message on release socket: %s", exc)
