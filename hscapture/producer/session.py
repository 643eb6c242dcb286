"""The producer's side of the consumer session: who may attach, when a consumer is gone, who takes over.

One consumer at a time, in two steps: a hello gets the layout (an offer), and the consumer confirms
by saying hello with our run id once it has opened the ring; only then is it sent chunks, request
ends and the end of stream. While the consumer we talk to is alive, any other is refused
(:class:`~hscapture.protocol.Refused`); once it is gone (its process ended on this host, or silent for
``TAKEOVER_BEATS`` heartbeats) the next one takes over and is handed every slot still in flight,
oldest first. Sending goes through a callable, so the session is tested without a socket.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable

from hscapture import protocol
from hscapture.errors import ProtocolError, short_repr
from hscapture.ownership import pid_alive, process_place
from hscapture.producer.base import ProducerCounters
from hscapture.producer.ledger import SlotLedger

log = logging.getLogger(__name__)

#: The attached consumer counts as gone after this many of its heartbeats of silence (and at least
#: ``TAKEOVER_MIN_S``), or at once when its process has ended on this host; only then may another take over.
TAKEOVER_BEATS = 10
TAKEOVER_MIN_S = 2.0


class ConsumerSession:
    """Which consumer a producer run talks to.

    Args:
        run_id: the producer's run id (a consumer confirms with it).
        token: the per-run secret every hello must carry ('' where none is checked: tcp:// without one).
        endpoint: the producer's endpoint (for messages).
        layout: the encoded :class:`~hscapture.protocol.Layout` for a consumer id.
        send: sends bytes to a consumer id; False when it cannot now (its connection is not up).
        ledger: the run's slots (released here; handed over to a consumer that takes over).
        counters: the producer's counters (attaches, consumers refused).
    """

    def __init__(
        self,
        *,
        run_id: str,
        token: str,
        endpoint: str,
        layout: Callable[[str], bytes],
        send: Callable[[str, bytes], bool],
        ledger: SlotLedger,
        counters: ProducerCounters,
    ) -> None:
        self.run_id, self.token, self.endpoint = run_id, token, endpoint
        self._layout, self._send, self._ledger, self._counters = layout, send, ledger, counters
        #: The consumer attached (it confirmed our layout); None while none is.
        self.attached: str | None = None
        #: A consumer sent our layout that has not confirmed yet.
        self.offered: str | None = None
        # The one consumer we talk to (attached or offered): when it was last heard from, its pid when it runs
        # in our pid namespace (0: watched by its silence only), and the silence after which it counts as gone.
        self._heard = 0.0
        self.peer_pid = 0
        self._takeover_s = TAKEOVER_MIN_S
        self._refused: set[str] = set()  # consumers told so (logged once each)

    def send(self, payload: bytes) -> bool:
        """Send to the attached consumer; False when none is attached or it cannot take it now. Never to a
        consumer only offered our layout: it gets the slots still in flight first, when it confirms."""
        peer = self.attached
        return peer is not None and self._send(peer, payload)

    def on_release(self, message: protocol.Release) -> None:
        """Free each slot released by the consumer it was last announced to, with the seq it was announced with.

        Raises:
            ProtocolError: some pair matches no slot in flight (the others are freed).
        """
        consumer = message.consumer_id
        freed, bad = self._ledger.release(consumer, ((message.slot, message.seq), *message.more))
        if consumer == self.attached and freed:
            self._heard = time.monotonic()
        if bad:
            (slot, seq), others = bad[0], f" (and {len(bad) - 1} more pairs)" if len(bad) > 1 else ""
            raise ProtocolError(
                f"Release: slot {short_repr(slot)} seq {short_repr(seq)} from consumer {short_repr(consumer)} "
                f"does not match a slot in flight (stale or forged){others}"
            )

    def on_hello(self, message: protocol.Hello) -> None:
        """Offer the layout, take a confirmation, count a heartbeat, or refuse a second consumer.

        Raises:
            ProtocolError: a wrong token.
        """
        if self.token and not hmac.compare_digest(message.token.encode(), self.token.encode()):
            raise ProtocolError(
                f"Hello: consumer {short_repr(message.consumer_id)} gave a wrong token; a stray process, or a "
                "consumer of another run"
            )
        now = time.monotonic()
        peer = self.attached or self.offered
        if message.consumer_id == peer:
            self._heard = now
            if peer == self.attached:
                return  # heartbeat of the attached consumer
            if message.run_id == self.run_id:  # it opened the ring of our layout: it confirms
                self._confirm(peer)
                return
        elif peer is not None and self.peer_alive(now):
            self._refuse(message.consumer_id, peer, now)
            return
        elif message.run_id == self.run_id:  # attached to us before (then silent): it holds our layout already
            self._watch(message, now)
            self._confirm(message.consumer_id)
            return
        if not self._send(message.consumer_id, self._layout(message.consumer_id)):
            return  # its announce connection is not up yet; it says hello again
        # The consumer we talked to (if any) is gone: no credit until this one confirms.
        self.offered, self.attached = message.consumer_id, None
        self._watch(message, now)

    def peer_alive(self, now: float) -> bool:
        """The consumer we talk to has not ended on this host and was heard from lately."""
        if self.peer_pid and not pid_alive(self.peer_pid):
            return False
        return now - self._heard < self._takeover_s

    def _watch(self, message: protocol.Hello, now: float) -> None:
        """Take the consumer of ``message`` as the one we talk to; note how to tell when it is gone."""
        self._heard = now
        same_namespace = message.place == process_place() and pid_alive(message.pid)
        self.peer_pid = message.pid if same_namespace else 0
        heartbeat_s = (message.heartbeat_ms or 200) / 1000
        self._takeover_s = max(TAKEOVER_MIN_S, TAKEOVER_BEATS * heartbeat_s)

    def _refuse(self, consumer_id: str, peer: str, now: float) -> None:
        """Tell a second consumer that another one is attached (it prints why and exits)."""
        reason = (
            f"consumer {short_repr(peer)} is attached to {self.endpoint} (heard from "
            f"{now - self._heard:.1f} s ago) and a producer serves one consumer at a time; stop that one "
            "first, or point this one at another producer"
        )
        refusal = protocol.Refused(
            v=protocol.PROTOCOL_VERSION,
            consumer_id=consumer_id,
            reason=reason,
            takeover_ms=round(self._takeover_s * 1000),
        )
        self._send(consumer_id, protocol.encode(refusal))
        self._counters.consumers_refused += 1
        if consumer_id not in self._refused and len(self._refused) < 1000:
            self._refused.add(consumer_id)
            log.warning("refused consumer %s: %s", short_repr(consumer_id), reason)

    def _confirm(self, consumer_id: str) -> None:
        """Attach ``consumer_id`` and hand it every slot still in flight that was announced to another, oldest first.

        Those slots hold rows a consumer that is gone never released: each is announced again,
        with its seq, and from then on only this consumer's release frees it. Nothing but the
        layout goes to a consumer before it confirms, so every chunk announced after these has a
        higher seq: the consumer sees one increasing sequence and takes each slot once. A
        consumer taken back after another had its place still holds what was announced to it;
        what went to the other reaches it again, with seqs it may have seen: a consumer takes an
        announcement it has seen byte for byte as a repeat (released, never copied twice).
        """
        self.attached, self.offered = consumer_id, None
        self._counters.attaches += 1
        log.info("consumer %s attached", consumer_id)
        for flight in self._ledger.hand_over(consumer_id):
            if not self._send(consumer_id, flight.payload):
                self.attached = None  # gone again mid-way; its successor's hello starts over
                break
            flight.consumer = consumer_id
