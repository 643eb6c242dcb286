"""The producer: the engine-facing API (:class:`~hscapture.producer.base.EngineProducer`) over a ring and a socket pair.

It joins its parts, each in its own module: the step checks (:mod:`~hscapture.producer.checks`),
the row copier (:mod:`~hscapture.producer.copier`), the slot ledger (:mod:`~hscapture.producer.ledger`),
the announcer that holds chunks back and sends them together (:mod:`~hscapture.producer.announcer`),
the consumer session (:mod:`~hscapture.producer.session`) and the link that sends to the consumer and
waits on its sockets (:mod:`~hscapture.producer.link`). What is left here is the order of things and
when to wait: under ``block`` for credit or a consumer, under ``drop`` never.

The sockets are served by a thread of the producer's own (:mod:`~hscapture.producer.service`) every
``SERVICE_S`` while steps run: it encodes and sends the held chunks and takes releases and hellos,
mostly while the engine's thread waits for the device with the GIL released, so an engine's step pays
for neither. The engine's thread serves them itself only where it must: no free slot, a wait under
``block``, a request's end, ``poll`` and ``close``. One lock keeps the two apart; the engine's thread
takes it once per call, except for a decode step that joins an open slot in a replay of a graph holding
the copy: that touches nothing the service thread changes (see ``Producer._extend``), and takes no lock
(its roll into the next slot every ``RUN_STEPS`` steps takes it once).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hscapture import protocol
from hscapture.config import CaptureConfig
from hscapture.errors import HSCaptureError
from hscapture.ownership import pid_alive
from hscapture.producer.announcer import Announcer, Held
from hscapture.producer.base import EngineProducer, ProducerCounters, WrittenStep
from hscapture.producer.checks import INT64, StepChecks, as_int64
from hscapture.producer.copier import RowCopier
from hscapture.producer.ledger import SlotLedger
from hscapture.producer.link import POLL_MS, ConsumerLink
from hscapture.producer.row_kernel import PLAN_WAIT_S, GraphRows
from hscapture.producer.service import ServiceThread, next_wait
from hscapture.producer.session import ConsumerSession
from hscapture.ring import Ring, create_ring
from hscapture.transport import ProducerSockets, publish_token, withdraw_token

log = logging.getLogger(__name__)

#: Steps of the same requests that :meth:`Producer.capture_step` puts into one slot at most, announced as one chunk
#: (fewer when the slot fills first). It bounds how long the first step's rows wait to be announced.
RUN_STEPS = 16


@dataclass(slots=True)
class _Run:
    """Steps of the same requests that :meth:`Producer.capture_step` put into one slot, announced together."""

    step: WrittenStep
    #: Each step's ``[rows]`` int64 values as bytes (``tobytes``: cheaper than an array's copy, and what is sent).
    positions: list[bytes]
    token_ids: list[bytes]
    #: The kept rows of each of its steps (its requests' rows, the same tuples step after step).
    rows: int
    #: The copy inside the engine's graphs when the run's first rows were a replay's (its later steps' rows are
    #: planned there, by a join that takes no lock), else None.
    graph: GraphRows | None


class Producer(EngineProducer):
    """Writes captured rows into the ring and announces them to one consumer.

    Args:
        config: the run's validated configuration.
        tensor_descriptions: one sentence per captured tensor (``config.tensor_names`` order) saying exactly what
            was captured; stored in the store's metadata.
        meta: msgpack-safe facts for the store (engine, model path, ...).
        ring: a ring to write into; by default a host shared-memory ring, or a CUDA ring for ``device="cuda"``.
        watchdog: called on every turn of a ``block`` wait; raise from it to stop waiting (an extraction raises
            when its consumer process has exited).

    Raises:
        ValueError: descriptions do not match the captured tensors.
        AccessError: the socket directory or the key directory cannot be trusted.
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
        # tcp:// peers prove themselves with their CURVE key; a token is checked there only when one was given.
        self.token = config.token or (secrets.token_hex(16) if config.endpoint.startswith("ipc://") else "")
        self.counters = ProducerCounters()
        self._descriptions = list(tensor_descriptions)
        self._rows_per_slot = config.rows_per_slot  # read every step (the config's properties cost more)
        self._meta = {"config": config.to_dict(), **(meta or {})}
        self._sockets = ProducerSockets(config.endpoint, config.keys)  # refuses an untrusted directory before the ring
        try:
            self.ring = ring or create_ring(
                torch.device(config.device), config.num_slots, config.slot_bytes, self.run_id
            )
        except BaseException:
            self._sockets.close()
            raise
        # Typed flat views of every slot, made once: slicing the ring per step costs more than the copy.
        slots = [self.ring.slot(i).view(config.torch_dtype) for i in range(config.num_slots)]
        wait_s = PLAN_WAIT_S + (config.block_timeout_s if config.policy == "block" else 0.0)  # a copy waits too
        self._copier = RowCopier(
            slots, config.slot_bytes, config.hidden_size, config.num_tensors, self.ring.stream_reader(), wait_s
        )
        #: Where each ring slot is (free, written, in flight); read it, never change it.
        self.ledger = SlotLedger(config.num_slots)
        self._checks = StepChecks(config)
        self._announcer = Announcer(config.slot_bytes, config.row_bytes, self._checks)
        self._session = ConsumerSession(
            run_id=self.run_id,
            token=self.token,
            endpoint=config.endpoint,
            layout=self._layout,
            send=self._sockets.send,
            ledger=self.ledger,
            counters=self.counters,
        )
        self._run: _Run | None = None
        self._request_drops: dict[str, int] = {}
        self._closed = False
        self._current_stream = self.ring.stream_reader()
        try:
            publish_token(config.endpoint, self.token)
        except BaseException:
            self._sockets.close()
            self.ring.close()
            raise
        self._link = ConsumerLink(self._sockets.release, self._session, config, self.counters, watchdog)
        self._lock = threading.RLock()  # the sockets and the ledger: the engine's thread or the service thread
        self._stopping = False
        self._served_steps = -1
        self._service = ServiceThread(self._serve_turn)
        self._wake = self._service.wake

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
        """See :meth:`EngineProducer.capture_step`. Steps whose owners are the very tuples of the step before go
        into its slot (up to :data:`RUN_STEPS`), announced together when the owners change, the slot or the
        run is full, a request ends, the engine polls or the producer closes."""
        run, tried = self._run, False
        # A decode step of the run's very request tuples in a replay of a graph holding the copy (a decode loop, step
        # after step) joins the run's slot with no lock and no call but the join's (see _extend): the run's first step
        # checked the rows, the copy's capture its sources. Each call costs µs on a host the device wait left cold.
        if (
            run is not None
            and run.graph is not None
            and run.graph.pending
            and request_ids is run.step.request_ids
            and request_rows is run.step.request_rows
            and row_index is None
            and type(positions) is np.ndarray
            and type(token_ids) is np.ndarray
            and positions.dtype is INT64 is token_ids.dtype  # what as_int64 takes as it is (flattened)
        ):
            position_bytes, token_bytes = positions.tobytes(), token_ids.tobytes()  # their length is the rows' check
            tried = len(position_bytes) == len(token_bytes) == run.rows * 8
            if tried:
                if len(run.positions) < RUN_STEPS and self._extend(
                    run.step, states, (), request_ids, request_rows, run.rows, True
                ):
                    run.positions.append(position_bytes)
                    run.token_ids.append(token_bytes)
                    return run.rows
                with self._lock:  # the held chunks and the free slots are the service thread's too
                    if self._roll(run, position_bytes, token_bytes):
                        return run.rows
        with self._lock:
            self._check_open()
            run, graph = self._run, self._copier.graph
            replayed = run is not None and run.step.replayed and graph is not None and graph.pending
            rows, spans = self._checks.step(states, request_ids, request_rows, row_index, replayed)
            positions = as_int64(positions, rows, "positions")
            token_ids = as_int64(token_ids, rows, "token_ids")
            self._wake_when_low()
            if (
                not tried  # (a join tried above found its slot full or the stream changed: so would this one)
                and run is not None
                and row_index is None
                and request_ids is run.step.request_ids
                and request_rows is run.step.request_rows
                and len(run.positions) < RUN_STEPS
                and self._extend(run.step, states, spans, request_ids, request_rows, rows, replayed)
            ):
                run.positions.append(positions.tobytes())
                run.token_ids.append(token_ids.tobytes())
                return rows
            # This step's rows are planned before the run before it is announced: that run's event goes on the engine's
            # stream, behind a replay whose copy waits for its plan. Announced first, a block producer could wait for
            # credit or a send while the consumer waits for that event: neither would move again.
            one_slot = row_index is None and rows <= self._rows_per_slot
            if one_slot and self._checks.same_owners(request_ids, request_rows):
                step = self._write_step(states, spans, request_ids, request_rows, None, rows, self._rows_per_slot)
                self._settle()
                self._close_run()
                if step.written:
                    graph = self._copier.graph if step.replayed else None
                    self._run = _Run(step, [positions.tobytes()], [token_ids.tobytes()], rows, graph)
                return step.written
            step = self._write_step(states, spans, request_ids, request_rows, row_index, rows)
            self._settle()
            self._close_run()
            return self._announce_step(step, positions, token_ids)

    def write_step(
        self,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        row_index: torch.Tensor | None = None,
        *,
        extendable: bool = False,
    ) -> WrittenStep:
        """See :meth:`EngineProducer.write_step`. Each slot's event, which the consumer waits for, is recorded after
        the copy (for a step written ``extendable``, when it is announced: after the rows of every step it took)."""
        with self._lock:
            self._check_open()
            self._close_run()  # steps are announced in the order they were written
            rows, spans = self._checks.step(states, request_ids, request_rows, row_index)
            self._wake_when_low()
            stride = self._rows_per_slot if extendable and row_index is None and rows <= self._rows_per_slot else 0
            step = self._write_step(states, spans, request_ids, request_rows, row_index, rows, stride)
            self._settle()
            return step

    def extend_step(
        self,
        step: WrittenStep,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
    ) -> bool:
        """See :meth:`EngineProducer.extend_step`."""
        graph, checked = self._copier.graph, self._checks.checked
        # A replay after one that wrote the step's first rows: its copy takes the graph's own outputs, which were
        # checked when the copy was captured, so the owners of the step checked last need no look at the states, and
        # the join takes no lock (see _extend).
        if (
            step.replayed
            and graph is not None
            and graph.pending
            and checked is not None
            and request_ids is checked.request_ids
            and request_rows is checked.request_rows
        ):
            return self._extend(step, states, (), request_ids, request_rows, checked.rows, True)
        with self._lock:
            self._check_open()
            if len(step.slots) != 1 or not step.row_stride or self._current_stream() != step.stream:
                return False  # before the checks: a step that takes no more rows is no error
            replayed = step.replayed and graph is not None and graph.pending
            rows, spans = self._checks.step(states, request_ids, request_rows, None, replayed)
            self._wake_when_low()
            return self._extend(step, states, spans, request_ids, request_rows, rows, replayed)

    def announce_step(
        self,
        step: WrittenStep,
        positions: np.ndarray | torch.Tensor | Sequence[int],
        token_ids: np.ndarray | torch.Tensor | Sequence[int],
    ) -> int:
        """See :meth:`EngineProducer.announce_step`."""
        with self._lock:
            self._check_open()
            if step.written and not step.slots:
                raise ValueError(f"announce_step: step {step.step} was announced already")
            try:
                positions = as_int64(positions, step.rows, "positions")
                token_ids = as_int64(token_ids, step.rows, "token_ids")
            except ValueError:
                self._unwrite(step)
                raise
            return self._announce_step(step, positions, token_ids)

    def finish_request(
        self,
        request_id: str,
        reason: str = "finished",
        *,
        num_tokens: int = 0,
        loss_mask: Sequence[tuple[int, int]] = (),
        meta: dict[str, Any] | None = None,
        prefix_token_ids: Sequence[int] | np.ndarray = (),
        positions: str = "",
    ) -> None:
        """See :meth:`EngineProducer.finish_request`."""
        with self._lock:
            self._check_open()
            self._close_run()
            self._flush()  # its rows first
            message = protocol.RequestFinished(
                v=protocol.PROTOCOL_VERSION,
                request_id=request_id,
                reason=reason,
                num_tokens=num_tokens,
                dropped_rows=self._request_drops.pop(request_id, 0),
                loss_mask=[(int(a), int(b)) for a, b in loss_mask],
                meta=meta or {},
                prefix_token_ids=protocol.pack_rows(np.asarray(prefix_token_ids)) if len(prefix_token_ids) else b"",
                positions=positions,
            )
            if not self._link.send(protocol.encode(message)):
                self.counters.events_dropped += 1

    def graph_rows(self) -> GraphRows | None:
        """See :meth:`EngineProducer.graph_rows`: a replay of a graph holding the copy is told
        :meth:`~GraphRows.launched`, then the step's ``capture_step`` / ``write_step`` / ``extend_step`` plans its
        rows there (no launch); a replay whose rows are not captured, :meth:`~GraphRows.settle`. A copy left
        without a plan waits ``PLAN_WAIT_S`` (plus ``block_timeout_s`` under ``block``), then turns every copy off
        and raises :attr:`GraphRows.failed`."""
        return None if self._closed else self._copier.graph_rows()

    def poll(self) -> None:
        """See :meth:`EngineProducer.poll`; it announces the steps :meth:`capture_step` holds in a slot too."""
        with self._lock:
            if not self._closed:
                self._close_run()
                self._serve()

    def wait_attached(self, timeout_s: float) -> bool:
        """See :meth:`EngineProducer.wait_attached`."""
        self._check_open()
        deadline = time.monotonic() + timeout_s
        while self._session.attached is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._lock:  # held for one poll at a time: the service thread may attach it meanwhile
                self._check_open()
                if self._link.wait(min(POLL_MS, max(1, round(remaining * 1000)))):
                    self._flush()
        return True

    def close(self, timeout_s: float = 30.0, error: str = "") -> ProducerCounters:
        """See :meth:`EngineProducer.close`."""
        if self._closed:
            return self.counters
        self._stop_service()
        with self._lock:
            return self._close(timeout_s, error)

    def _close(self, timeout_s: float, error: str) -> ProducerCounters:
        if self._closed:
            return self.counters
        session = self._session
        try:
            self._close_run()
            rows, slots = self.ledger.drop_written()  # written by write_step, never announced: the consumer lacks them
            self.counters.rows_dropped += rows
            self.counters.chunks_dropped += slots
            self._link.drain()
            deadline = time.monotonic() + timeout_s
            while session.offered is not None and time.monotonic() < deadline:  # it opens the ring: let it confirm
                if session.peer_pid and not pid_alive(session.peer_pid):
                    break  # it died opening it: nobody to end the stream to
                self._link.wait()
            if session.attached is not None:
                self._flush()
            else:  # nobody to send them to, and no reason to wait for one
                taken = self._announcer.take()
                if taken is not None:
                    self._drop_held(taken[1])
            eos = protocol.EndOfStream(
                v=protocol.PROTOCOL_VERSION, run_id=self.run_id, counters=self.counters.to_dict(), error=error
            )
            if session.attached is not None and self._link.send(protocol.encode(eos)):
                while self.ledger.in_flight and time.monotonic() < deadline:
                    self._link.wait()
                if self.ledger.in_flight:
                    log.warning("closing with %d slots not released by the consumer", len(self.ledger.in_flight))
        except HSCaptureError as exc:  # no consumer to deliver to (timeout, or the watchdog said so)
            log.warning("end of stream not delivered: %s", exc)
        finally:
            self._closed = True
            self._copier.close()  # the engine's graphs replay on: their copies must not write
            withdraw_token(self.config.endpoint, self.token)
            self._sockets.close()
            self.ring.close()
        return self.counters

    @property
    def attached(self) -> bool:
        return self._session.attached is not None

    @property
    def consumer_id(self) -> str | None:
        """The attached consumer's id (None while none is)."""
        return self._session.attached

    # ------------------------------------------------------------------ writing and announcing

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("producer is closed")

    def _write_step(
        self,
        states: Sequence[torch.Tensor],
        spans: tuple[int, ...],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        row_index: torch.Tensor | None,
        rows: int,
        row_stride: int = 0,
    ) -> WrittenStep:
        self.counters.steps += 1
        slots: list[tuple[int, int, int]] = []
        begin = 0
        replayed = False
        while begin < rows:
            count = min(self._rows_per_slot, rows - begin)
            slot = self._acquire_slot()
            if slot is None:
                self._count_drop(request_ids, request_rows, begin, rows)
                break
            replayed = self._copier.write(slot, states, spans, row_index, begin, count, 0, row_stride)
            if not row_stride:  # else when announced, after the rows of the steps it takes (extend_step)
                self.ring.mark_written(slot)
            self.ledger.write(slot, count)
            slots.append((slot, begin, count))
            begin += count
        stream = self._current_stream() if row_stride else 0
        return WrittenStep(
            self.counters.steps, rows, begin, request_ids, request_rows, slots, row_stride, stream, replayed
        )

    def _extend(
        self,
        step: WrittenStep,
        states: Sequence[torch.Tensor],
        spans: tuple[int, ...],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        rows: int,
        replayed: bool,
    ) -> bool:
        """Rows of a checked step into the slot of ``step`` after its rows (False when they do not fit it).

        A replay's join runs without the lock: only the engine's thread touches a step and the copy's plan, and of
        what the service thread shares, it stores one entry of the ledger's ``written`` (a dict store, which the GIL
        keeps whole) and adds to ``counters.steps``, which that thread only reads."""
        if len(step.slots) != 1 or not step.row_stride or self._current_stream() != step.stream:
            return False
        slot, _, count = step.slots[0]
        if count + rows > step.row_stride:
            return False
        self.counters.steps += 1
        if replayed:
            self._copier.graph.plan(slot, 0, rows, count, step.row_stride)  # type: ignore[union-attr]
        else:
            self._copier.write(slot, states, spans, None, 0, rows, count, step.row_stride)
        step.slots[0] = (slot, 0, count + rows)
        self.ledger.written[slot] = count + rows  # SlotLedger.write, one call less on a decode step
        step.rows += rows
        step.written += rows
        step.joined.append((request_ids, request_rows))
        return True

    def _roll(self, run: _Run, position_bytes: bytes, token_bytes: bytes) -> bool:
        """The next step of ``run``'s requests, planned in a replay, into a fresh slot as a new run, and ``run``
        announced: what a decode loop does every :data:`RUN_STEPS` steps, in as few calls as a join (False, with
        nothing done, when no slot is free to take at once: the step takes the general path, which waits or drops).
        The caller holds the lock and made the join's checks."""
        ledger, free = self.ledger, self.ledger.free
        if self._closed or not free or self._session.attached is None:
            return False
        if len(free) <= ledger.low:
            self._wake()  # the service thread takes the releases now
        slot, rows, stride = free.popleft(), run.rows, self._rows_per_slot
        run.graph.plan(slot, 0, rows, 0, stride)  # type: ignore[union-attr]  # before the announcement: see capture_step
        ledger.written[slot] = rows
        counters, step = self.counters, run.step
        counters.steps += 1
        self._run = _Run(
            WrittenStep(
                counters.steps, rows, rows, step.request_ids, step.request_rows, [(slot, 0, rows)], stride,
                self._current_stream(), True,
            ),
            [position_bytes], [token_bytes], rows, run.graph,
        )  # fmt: skip
        self._announce_step(step, run.positions, run.token_ids)
        return True

    def _settle(self) -> None:
        """A replay of a graph holding the copy whose rows were not planned (dropped) copies none."""
        graph = self._copier.graph
        if graph is not None and graph.pending:
            graph.settle()

    def _close_run(self) -> None:
        """Announce the steps :meth:`capture_step` put into one slot."""
        run, self._run = self._run, None
        if run is not None:
            self._announce_step(run.step, run.positions, run.token_ids)

    def _announce_step(
        self,
        step: WrittenStep,
        positions: np.ndarray | list[bytes],
        token_ids: np.ndarray | list[bytes],
    ) -> int:
        """Hold the chunks of ``step``'s slots; ``positions`` and ``token_ids`` are the step's (the caller's arrays),
        or a run's bytes of each of its steps' (its one slot holds them all)."""
        ledger, held = self.ledger, self._announcer
        joined = step.joined  # a run, in one slot: the owners of its steps are listed when its chunk is encoded
        request_ids, request_rows = step.request_ids, step.request_rows
        for slot, begin, count in step.slots:
            if step.row_stride:
                self.ring.mark_written(slot, step.stream)
            end = begin + count
            if joined:
                ids, counts = request_ids, request_rows
            else:
                ids, counts = _spans(request_ids, request_rows, begin, end, step.rows)  # a whole step: as is
            if isinstance(positions, np.ndarray):  # encoded later: bytes the caller cannot change
                slot_positions, slot_tokens = positions[begin:end].tobytes(), token_ids[begin:end].tobytes()  # type: ignore[index]
            else:
                slot_positions, slot_tokens = positions, token_ids
            ledger.hold(slot)
            held.hold(
                slot, count, step.row_stride, ids, counts, slot_positions, slot_tokens, step.step,
                self.counters.rows_dropped, len(ledger.in_flight), joined,
            )  # fmt: skip
        step.slots = []
        if held.full:
            self._wake()
        return step.written

    def _unwrite(self, step: WrittenStep) -> None:
        """Free the slots of ``step`` and count their rows dropped."""
        slots, step.slots = step.slots, []
        for slot, _, _ in slots:
            self.ledger.give_back(slot)
        if slots:
            self._count_drop(*step.owners(), 0, step.written)

    def _flush(self, wait: bool = True) -> None:
        """Send the held chunks, oldest first, in one message; under ``drop`` a send that fails drops them all. Under
        ``block`` it waits for a consumer to take them, or with ``wait`` False holds them again (the service thread
        never waits: the engine's thread does, where it must)."""
        taken = self._announcer.take()
        if taken is None:
            return
        payload, held = taken
        if not wait and self.config.policy == "block":
            sent = self._session.send(payload)
            if not sent:
                self._announcer.put_back(held)
                return
        else:
            try:
                sent = self._link.send(payload)
            except BaseException:  # block gave up waiting (or was stopped): the rows are lost, count them
                self._drop_held(held)
                raise
        if not sent:
            self._drop_held(held)
            return
        consumer, ledger = self._session.attached or "", self.ledger
        for h in held:
            ledger.announced(h.slot, h.seq, h.rows, h.payload, consumer)
            self.counters.rows_captured += h.rows
        self.counters.chunks_announced += len(held)

    def _drop_held(self, held: list[Held]) -> None:
        """Free the slots of chunks that were never sent and count their rows dropped."""
        for h in held:
            self.ledger.give_back(h.slot)
            self._count_drop(*h.owners(), 0, h.rows)

    def _count_drop(self, request_ids: Sequence[str], request_rows: Sequence[int], begin: int, end: int) -> None:
        self.counters.rows_dropped += end - begin
        self.counters.chunks_dropped += -(-(end - begin) // self._rows_per_slot)
        ids, counts = _spans(request_ids, request_rows, begin, end, sum(request_rows))
        for request_id, count in zip(ids, counts):
            self._request_drops[request_id] = self._request_drops.get(request_id, 0) + count

    # ------------------------------------------------------------------ sockets and waiting

    def _wake_when_low(self) -> None:
        if self.ledger.running_low:  # free slots are few: the service thread takes the releases now
            self._wake()

    def _serve(self, wait: bool = True) -> None:
        """Send the held chunks, then take releases and hellos."""
        self._flush(wait)
        self._link.drain()

    def _serve_turn(self) -> float:
        """One turn of the service thread; returns how long to wait for the next (-1: stop)."""
        with self._lock:
            if self._stopping or self._closed:
                return -1.0
            busy = self.counters.steps != self._served_steps or bool(self._announcer.held)
            self._served_steps = self.counters.steps
            self._serve(wait=False)
        return next_wait(busy)

    def _stop_service(self) -> None:
        """Stop the service thread: from now on the caller's thread serves the sockets."""
        self._stopping = True
        self._service.stop()

    def _acquire_slot(self) -> int | None:
        ledger, session = self.ledger, self._session
        if ledger.free and session.attached is not None:
            return ledger.take()
        self._serve()  # releases not taken yet, held chunks the consumer could release, a hello that attaches
        if ledger.free and session.attached is not None:
            return ledger.take()
        if self.config.policy == "drop":
            return None
        if not ledger.free and not ledger.in_flight:  # no release can come: waiting would never end
            raise ValueError(
                f"ring: all {self.config.num_slots} slots hold rows written and not announced yet; announce "
                "written steps before writing more, or raise ring_bytes"
            )
        self._link.wait_until(lambda: bool(ledger.free) and session.attached is not None, "a free ring slot")
        return ledger.take()

    def _layout(self, consumer_id: str) -> bytes:
        """The encoded layout offered to ``consumer_id``: everything it needs to open the ring and read the rows."""
        config = self.config
        return protocol.encode(
            protocol.Layout(
                v=protocol.PROTOCOL_VERSION,
                run_id=self.run_id,
                consumer_id=consumer_id,
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
        )


def _spans(
    request_ids: Sequence[str], request_rows: Sequence[int], begin: int, end: int, total: int
) -> tuple[Sequence[str], Sequence[int]]:
    """Request ids and row counts covering kept rows ``[begin, end)`` of a step of ``total`` kept rows."""
    if begin == 0 and end == total:  # the whole step in one chunk: the usual decode case
        return request_ids, request_rows
    starts = list(itertools.accumulate(request_rows, initial=0))
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
