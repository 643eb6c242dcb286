"""The engine-neutral producer API that every engine integration calls.

Who calls what, and how often (habit of vLLM's KV connector base class):

* Engine thread, once per forward step: :meth:`Producer.capture_step` with the rows of every
  captured tensor and, per row, its request, position and token id. Copies the rows into
  ring slots (a device-to-device copy on the CUDA ring), announces each slot, returns.
  Under ``drop`` it never waits: rows without a free slot are dropped and counted exactly.
  Under ``block`` it waits for credit and loses nothing.
* Engine thread, once per request that ends: :meth:`Producer.finish_request`.
* Engine thread, when idle (optional): :meth:`Producer.poll` answers a consumer that
  attaches while no step runs.
* Once at shutdown: :meth:`Producer.close` announces the end of stream and waits (bounded)
  for the consumer to copy out what is in flight before the ring is freed.

All socket work happens inline on the caller's thread: no thread, no lock, nothing that
contends with the engine for the GIL between steps. :class:`NullProducer` has the same
methods and does nothing, so call sites need no ``if capture_enabled``.
"""

from __future__ import annotations

import bisect
import hmac
import itertools
import logging
import os
import secrets
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import zmq

from hscapture import protocol
from hscapture.config import CaptureConfig, dtype_name
from hscapture.errors import CreditTimeout, HSCaptureError, ProtocolError, short_repr
from hscapture.ring import Ring, create_ring
from hscapture.transport import (
    announce_endpoint,
    make_socket,
    prepare_ipc_dir,
    publish_token,
    release_endpoint,
    withdraw_token,
)

log = logging.getLogger(__name__)

#: How long one wait for credit or a consumer polls before checking its deadline again.
_POLL_MS = 20


@dataclass
class ProducerCounters:
    """Running totals kept by the producer itself (the store records the final ones)."""

    steps: int = 0
    rows_captured: int = 0
    rows_dropped: int = 0
    chunks_announced: int = 0
    chunks_dropped: int = 0
    #: Times ``block`` had to wait for credit or a consumer, and the microseconds spent waiting.
    credit_waits: int = 0
    credit_wait_us: int = 0
    events_dropped: int = 0
    messages_rejected: int = 0
    attaches: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _InFlight:
    seq: int
    rows: int
    payload: bytes


class Producer:
    """Writes captured rows into the ring and announces them to one consumer.

    Args:
        config: the run's validated configuration.
        tensor_descriptions: one sentence per captured tensor (``config.tensor_names``
            order) saying exactly what was captured; stored in the store's metadata.
        meta: msgpack-safe facts for the store (engine, model path, ...).
        ring: a ring to write into; by default a host shared-memory ring is allocated.
        watchdog: called on every turn of a ``block`` wait; raise from it to stop waiting (an
            extraction raises when its consumer process has exited).

    Raises:
        ValueError: descriptions do not match the captured tensors.
        zmq.ZMQError: the endpoint is in use by another producer.
    """

    def __init__(
        self,
        config: CaptureConfig,
        *,
        tensor_descriptions: Sequence[str],
        meta: dict[str, Any] | None = None,
        ring: Ring | None = None,
        watchdog: Callable[[], None] | None = None,
    ) -> None:
        if len(tensor_descriptions) != config.num_tensors:
            raise ValueError(
                f"tensor_descriptions: got {len(tensor_descriptions)} for {config.num_tensors} tensors "
                f"{config.tensor_names}; describe each one"
            )
        self.config = config
        self.run_id = uuid.uuid4().hex[:16]
        self.token = config.token or secrets.token_hex(16)
        self.counters = ProducerCounters()
        self._descriptions = list(tensor_descriptions)
        self._meta = {"config": config.to_dict(), **(meta or {})}
        self.ring = ring or create_ring(torch.device(config.device), config.num_slots, config.slot_bytes, self.run_id)
        # Typed flat views of every slot, made once: slicing the ring per step costs more than the copy.
        self._slots = [self.ring.slot(i).view(config.torch_dtype) for i in range(config.num_slots)]
        self._free: deque[int] = deque(range(config.num_slots))
        self._in_flight: dict[int, _InFlight] = {}
        self._seq = itertools.count(1)
        self._request_drops: dict[str, int] = {}
        self._consumer_id: str | None = None  # attached: it confirmed our layout
        self._offered: str | None = None  # sent our layout, not confirmed yet
        self._trusted: set[str] = set()  # consumer ids that presented the token: their releases count
        self._closed = False
        self._watchdog = watchdog

        prepare_ipc_dir(config.endpoint)
        self._context = zmq.Context.instance()
        self._announce = make_socket(self._context, zmq.PUSH, immediate=True)
        self._announce.setsockopt(zmq.SNDHWM, 100_000)
        self._release = make_socket(self._context, zmq.PULL)
        try:
            self._announce.bind(announce_endpoint(config.endpoint))
            self._release.bind(release_endpoint(config.endpoint))
        except zmq.ZMQError as exc:
            self._close_sockets()
            self.ring.close()
            raise zmq.ZMQError(
                exc.errno, f"endpoint {config.endpoint!r}: {exc.strerror}; is another producer running there?"
            ) from None
        publish_token(config.endpoint, self.token)
        self._poller = zmq.Poller()
        self._poller.register(self._release, zmq.POLLIN)

    # ------------------------------------------------------------------ engine-facing API

    def capture_step(
        self,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        positions: np.ndarray | torch.Tensor | Sequence[int],
        token_ids: np.ndarray | torch.Tensor | Sequence[int],
        row_index: torch.Tensor | None = None,
    ) -> int:
        """Capture one forward step's rows; returns how many rows were announced.

        Args:
            states: one tensor per captured tensor (``config.tensor_names`` order), each
                ``[N, hidden]`` in ``config.dtype``; all on one device.
            request_ids: the requests owning the kept rows, in row order.
            request_rows: how many consecutive kept rows each request owns.
            positions: ``[R]`` int position of each kept row in its request.
            token_ids: ``[R]`` int token id of each kept row.
            row_index: ``[R]`` int64 indices into the ``N`` rows of ``states`` to keep (drops
                padding); ``None`` keeps all ``N`` rows in order.

        Raises:
            ValueError: shapes, dtypes or counts do not match what was planned.
            CreditTimeout: ``block`` waited longer than ``block_timeout_s``.
        """
        self._check_open()
        config = self.config
        rows = self._check_step(states, request_ids, request_rows, row_index)
        positions = _as_int64(positions, rows, "positions")
        token_ids = _as_int64(token_ids, rows, "token_ids")
        self.counters.steps += 1
        self._drain_control()
        starts = list(itertools.accumulate(request_rows, initial=0))
        begin = 0
        while begin < rows:
            count = min(config.rows_per_slot, rows - begin)
            slot = self._acquire_slot()
            if slot is None:
                self._count_drop(request_ids, starts, begin, rows)
                break
            self._write(slot, states, row_index, begin, count)
            ids, counts = _spans(request_ids, starts, begin, begin + count)
            if not self.announce_written(
                slot, count, 0, ids, counts, positions[begin : begin + count], token_ids[begin : begin + count]
            ):
                self._count_drop(request_ids, starts, begin, rows)
                break
            begin += count
        return begin

    def announce_written(
        self,
        slot: int,
        rows: int,
        row_stride: int,
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        positions: np.ndarray,
        token_ids: np.ndarray,
    ) -> bool:
        """Announce a slot already written (by :meth:`capture_step` or a graph replay).

        The slot's event is recorded here, on the current stream, after the writes queued
        there. Returns False when ``drop`` could not send (the slot is free again).
        """
        self.ring.mark_written(slot)
        config = self.config
        seq = next(self._seq)
        chunk = protocol.Chunk(
            v=protocol.PROTOCOL_VERSION,
            seq=seq,
            step=self.counters.steps,
            slot=slot,
            offset=slot * config.slot_bytes,
            nbytes=(row_stride or rows) * config.row_bytes,
            rows=rows,
            request_ids=list(request_ids),
            request_rows=list(request_rows),
            positions=protocol.pack_rows(positions),
            token_ids=protocol.pack_rows(token_ids),
            dropped_rows=self.counters.rows_dropped,
            row_stride=row_stride,
            ring_slots_used=len(self._in_flight) + 1,
        )
        payload = protocol.encode(chunk)
        if not self._send(payload):
            self._free.appendleft(slot)
            return False
        self._in_flight[slot] = _InFlight(seq, rows, payload)
        self.counters.rows_captured += rows
        self.counters.chunks_announced += 1
        return True

    def acquire_slot(self) -> int | None:
        """A free slot to write (waits under ``block``; None under ``drop`` when none is free)."""
        self._check_open()
        self._drain_control()
        return self._acquire_slot()

    def reserve_slot(self) -> int:
        """Take a slot out of circulation for good: a graph writes there when ``drop`` has no credit."""
        if not self._free:
            raise ValueError("reserve_slot: no free slot; reserve before serving starts")
        return self._free.pop()

    def count_dropped(self, request_ids: Sequence[str], request_rows: Sequence[int]) -> None:
        """Count rows that were computed but not captured (no credit under ``drop``)."""
        starts = list(itertools.accumulate(request_rows, initial=0))
        self._count_drop(request_ids, starts, 0, starts[-1])

    def finish_request(
        self,
        request_id: str,
        reason: str = "finished",
        *,
        num_tokens: int = 0,
        loss_mask: Sequence[tuple[int, int]] = (),
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Say that no more rows come for ``request_id``, and why.

        Args:
            request_id: as given to :meth:`capture_step`.
            reason: ``finished``, ``aborted``, ``retracted`` or another engine word.
            num_tokens: rows the request should have in total (0 if unknown).
            loss_mask: half-open position ranges ``[start, end)`` trained on.
            meta: msgpack-safe facts stored with the request.
        """
        self._check_open()
        self._drain_control()
        message = protocol.RequestFinished(
            v=protocol.PROTOCOL_VERSION,
            request_id=request_id,
            reason=reason,
            num_tokens=num_tokens,
            dropped_rows=self._request_drops.pop(request_id, 0),
            loss_mask=[(int(a), int(b)) for a, b in loss_mask],
            meta=meta or {},
        )
        if not self._send(protocol.encode(message)):
            self.counters.events_dropped += 1

    def poll(self) -> None:
        """Answer attaching consumers and take releases; call when the engine is idle."""
        if not self._closed:
            self._drain_control()

    def close(self, timeout_s: float = 30.0) -> ProducerCounters:
        """Announce the end of stream, wait up to ``timeout_s`` for in-flight slots, free the ring.

        Idempotent. Returns the final counters.
        """
        if self._closed:
            return self.counters
        try:
            eos = protocol.EndOfStream(
                v=protocol.PROTOCOL_VERSION, run_id=self.run_id, counters=self.counters.to_dict()
            )
            self._drain_control()
            if (self._consumer_id or self._offered) and self._send(protocol.encode(eos)):
                deadline = time.monotonic() + timeout_s
                while self._in_flight and time.monotonic() < deadline:
                    self._wait_control()
                if self._in_flight:
                    log.warning("closing with %d slots not released by the consumer", len(self._in_flight))
        except HSCaptureError as exc:  # no consumer to deliver to (timeout, or the watchdog said so)
            log.warning("end of stream not delivered: %s", exc)
        finally:
            self._closed = True
            self._slots = []
            withdraw_token(self.config.endpoint, self.token)
            self._close_sockets()
            self.ring.close()
        return self.counters

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def attached(self) -> bool:
        """Whether a consumer has completed the handshake with this run."""
        return self._consumer_id is not None

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("producer is closed")

    def _check_step(
        self,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        row_index: torch.Tensor | None,
    ) -> int:
        config = self.config
        if len(states) != config.num_tensors:
            raise ValueError(f"states: planned {config.num_tensors} tensors {config.tensor_names}, got {len(states)}")
        first = states[0]
        for name, state in zip(config.tensor_names, states):
            if state.dim() != 2 or state.shape[1] != config.hidden_size or state.shape[0] != first.shape[0]:
                raise ValueError(
                    f"states[{name}]: planned [{first.shape[0]}, {config.hidden_size}], got {list(state.shape)}"
                )
            if state.dtype != config.torch_dtype:
                raise ValueError(f"states[{name}]: planned dtype {config.dtype}, got {dtype_name(state.dtype)}")
        rows = first.shape[0] if row_index is None else row_index.numel()
        if any(n <= 0 for n in request_rows):
            raise ValueError(f"request_rows: every request owns at least one row, got {list(request_rows)[:16]}")
        if len(request_ids) != len(request_rows) or sum(request_rows) != rows:
            raise ValueError(
                f"request_rows: {len(request_ids)} request ids with rows summing to {sum(request_rows)}, "
                f"but the step keeps {rows} rows"
            )
        if rows > config.max_step_rows:
            raise ValueError(
                f"step rows: planned at most max_step_rows={config.max_step_rows}, got {rows}; "
                "raise max_step_rows (and ring_bytes)"
            )
        return rows

    def _write(
        self,
        slot: int,
        states: Sequence[torch.Tensor],
        row_index: torch.Tensor | None,
        begin: int,
        count: int,
    ) -> None:
        config = self.config
        dst = self._slots[slot][: count * config.num_tensors * config.hidden_size]
        dst = dst.view(config.num_tensors, count, config.hidden_size)
        if row_index is None:  # one launch for all tensors, not one copy each
            torch.stack([state[begin : begin + count] for state in states], out=dst)
        else:
            index = row_index[begin : begin + count]
            for i, state in enumerate(states):
                torch.index_select(state, 0, index, out=dst[i])

    def _acquire_slot(self) -> int | None:
        if self._free and self._consumer_id is not None:
            return self._free.popleft()
        if self.config.policy == "drop":
            return None
        self._wait_until(lambda: bool(self._free) and self._consumer_id is not None, "a free ring slot")
        return self._free.popleft()

    def _send(self, payload: bytes) -> bool:
        """Send on ``announce``; under ``drop`` give up at once, under ``block`` wait for a peer."""
        try:
            self._announce.send(payload, zmq.NOBLOCK)
            return True
        except zmq.Again:
            if self.config.policy == "drop":
                return False
        sent = False

        def try_send() -> bool:
            nonlocal sent
            try:
                self._announce.send(payload, zmq.NOBLOCK)
                sent = True
            except zmq.Again:
                pass
            return sent

        self._wait_until(try_send, "a consumer to send to")
        return True

    def _wait_until(self, ready: Any, what: str) -> None:
        """Block (``block`` policy) serving the control socket until ``ready()`` holds."""
        self.counters.credit_waits += 1
        start = time.monotonic()
        timeout = self.config.block_timeout_s
        next_warning = start + 10.0
        try:
            while not ready():
                now = time.monotonic()
                if timeout and now - start > timeout:
                    raise CreditTimeout(
                        f"waited {now - start:.0f} s for {what} (block_timeout_s={timeout}); "
                        f"is `hscapture consume --endpoint {self.config.endpoint}` running?"
                    )
                if now > next_warning:
                    log.warning("waiting %.0f s for %s; is a consumer running?", now - start, what)
                    next_warning = now + 10.0
                if self._watchdog is not None:
                    self._watchdog()
                self._wait_control()
        finally:
            self.counters.credit_wait_us += round((time.monotonic() - start) * 1e6)

    def _wait_control(self) -> None:
        if self._poller.poll(_POLL_MS):
            self._drain_control()

    def _drain_control(self) -> None:
        # Asking for EVENTS is far cheaper than a recv that raises zmq.Again on every step.
        while self._release.get(zmq.EVENTS) & zmq.POLLIN:
            try:
                data = self._release.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = protocol.decode_to_producer(data)
                if isinstance(message, protocol.Release):
                    self._on_release(message)
                else:
                    self._on_hello(message)
            except ProtocolError as exc:
                self.counters.messages_rejected += 1
                log.warning("rejected message on release socket: %s", exc)

    def _on_release(self, message: protocol.Release) -> None:
        flight = self._in_flight.get(message.slot)
        if message.consumer_id not in self._trusted or flight is None or flight.seq != message.seq:
            raise ProtocolError(
                f"Release: slot {short_repr(message.slot)} seq {short_repr(message.seq)} from consumer "
                f"{short_repr(message.consumer_id)} does not match a slot in flight (stale or forged)"
            )
        del self._in_flight[message.slot]
        self._free.append(message.slot)

    def _on_hello(self, message: protocol.Hello) -> None:
        """Attach in two steps: offer the layout, then hand out credit once the consumer confirms.

        A consumer confirms by saying hello with our run id, which it does as soon as it has
        opened the ring; until then no slot is announced, so a slow first open (CUDA context,
        pinned buffers) costs no rows that could have waited in the ring.
        """
        if not hmac.compare_digest(message.token.encode(), self.token.encode()):
            raise ProtocolError(
                f"Hello: consumer {short_repr(message.consumer_id)} gave a wrong token; a stray process, or a "
                "consumer of another run (tcp:// consumers need --token)"
            )
        self._trusted.add(message.consumer_id)
        if message.consumer_id == self._consumer_id:
            return  # heartbeat of the attached consumer
        if message.run_id == self.run_id:  # it holds our layout: it confirms (again, after an interloper)
            self._confirm(message.consumer_id)
            return
        config = self.config
        layout = protocol.Layout(
            v=protocol.PROTOCOL_VERSION,
            run_id=self.run_id,
            consumer_id=message.consumer_id,
            ring=self.ring.describe(),
            num_slots=config.num_slots,
            slot_bytes=config.slot_bytes,
            dtype=config.dtype,
            hidden_size=config.hidden_size,
            tensor_names=config.tensor_names,
            tensor_descriptions=self._descriptions,
            policy=config.policy,
            meta=self._meta,
            pid=os.getpid(),
        )
        try:
            self._announce.send(protocol.encode(layout), zmq.NOBLOCK)
        except zmq.Again:
            return  # its announce connection is not up yet; it says hello again
        # A new consumer replaces the old one, which is gone: no credit until it confirms.
        self._offered, self._consumer_id = message.consumer_id, None

    def _confirm(self, consumer_id: str) -> None:
        self._consumer_id, self._offered = consumer_id, None
        self.counters.attaches += 1
        log.info("consumer %s attached", consumer_id)
        # Slots announced to a consumer that is gone still hold their rows: announce them again.
        try:
            for flight in sorted(self._in_flight.values(), key=lambda f: f.seq):
                self._announce.send(flight.payload, zmq.NOBLOCK)
        except zmq.Again:
            self._consumer_id = None  # gone again mid-way; its successor's hello starts over

    def _count_drop(self, request_ids: Sequence[str], starts: list[int], begin: int, end: int) -> None:
        self.counters.rows_dropped += end - begin
        self.counters.chunks_dropped += -(-(end - begin) // self.config.rows_per_slot)
        ids, counts = _spans(request_ids, starts, begin, end)
        for request_id, count in zip(ids, counts):
            self._request_drops[request_id] = self._request_drops.get(request_id, 0) + count

    def _close_sockets(self) -> None:
        self._announce.close(linger=0)
        self._release.close(linger=0)


class NullProducer:
    """Capture switched off: the same methods as :class:`Producer`, doing nothing."""

    counters = ProducerCounters()
    attached = False

    def capture_step(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def finish_request(self, *args: Any, **kwargs: Any) -> None:
        return None

    def poll(self) -> None:
        return None

    def close(self, timeout_s: float = 0.0) -> ProducerCounters:
        return self.counters

    def __enter__(self) -> NullProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _spans(request_ids: Sequence[str], starts: list[int], begin: int, end: int) -> tuple[list[str], list[int]]:
    """Request ids and row counts covering kept rows ``[begin, end)``; ``starts`` are cumulative."""
    if begin == 0 and end == starts[-1]:  # the whole step in one chunk: the usual decode case
        return list(request_ids), [b - a for a, b in itertools.pairwise(starts)]
    first = bisect.bisect_right(starts, begin) - 1
    ids: list[str] = []
    counts: list[int] = []
    for i in range(first, len(request_ids)):
        lo, hi = max(starts[i], begin), min(starts[i + 1], end)
        if lo >= end:
            break
        if hi > lo:
            ids.append(request_ids[i])
            counts.append(hi - lo)
    return ids, counts


def _as_int64(values: np.ndarray | torch.Tensor | Sequence[int], rows: int, name: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values, dtype=np.int64).reshape(-1)
    if array.shape[0] != rows:
        raise ValueError(f"{name}: planned {rows} values (one per kept row), got {array.shape[0]}")
    return array
