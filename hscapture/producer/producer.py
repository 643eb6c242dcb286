"""The engine-neutral producer API that every engine integration calls.

Who calls what, and how often (habit of vLLM's KV connector base class):

* Engine thread, once per forward step: :meth:`Producer.capture_step` with the rows of every
  captured tensor and, per row, its request, position and token id. Copies the rows into
  ring slots (a device-to-device copy on the CUDA ring), announces each slot, returns.
  Under ``drop`` it never waits: rows without a free slot are dropped and counted exactly.
  Under ``block`` it waits for credit and loses nothing.
* Or the same step in two calls, for an engine whose host learns the step's token ids only
  after the forward was launched (SGLang's overlap scheduler): :meth:`Producer.write_step`
  right after the forward (queues the copy of the rows on the current stream, so it runs
  before the engine's next work there overwrites its outputs), then
  :meth:`Producer.announce_step` once with that step's positions and token ids, before any
  of its requests is finished. Written slots stay the producer's until announced. A step
  written ``extendable`` may take the rows of later steps into its slot
  (:meth:`Producer.extend_step`, a decode engine's next steps): one chunk for them all.
* Engine thread, once per request that ends: :meth:`Producer.finish_request`.
* Engine thread, when idle (optional): :meth:`Producer.poll` answers a consumer that
  attaches while no step runs.
* Once at shutdown: :meth:`Producer.close` announces the end of stream and waits (bounded)
  for the consumer to copy out what is in flight before the ring is freed.

All socket work happens inline on the caller's thread: no thread, no lock, nothing that
contends with the engine for the GIL between steps. Its fixed cost per call (a ZeroMQ send is two
socket calls, asking the control socket for messages a system call) would dominate a decode step,
so it is not paid per step: announced chunks are held back and sent together in one
:class:`~hscapture.protocol.Announcements` message, and the control socket (releases, hellos) is
served with that send. Both happen when ``_SERVICE_S`` has passed since the last time and
chunks are held (or, holding none, every ``_SERVE_STEPS`` steps: a decode run announces one chunk
per several steps, and an engine whose steps outlast ``_SERVICE_S`` would otherwise pay for the
control socket every step), when ``_FLUSH_CHUNKS`` chunks are held, when free slots run low,
before a request's end or the end of stream is sent, before the producer waits, and on
:meth:`Producer.poll`. Only the delay
changes: seq order, a request's end after its rows, and drop counting are as for one message
per chunk. :class:`NullProducer` has the same methods and does nothing, so call sites need no
``if capture_enabled``.
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
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import msgspec
import numpy as np
import torch
import zmq

from hscapture import protocol
from hscapture.config import CaptureConfig, dtype_name
from hscapture.errors import CreditTimeout, HSCaptureError, ProtocolError, short_repr
from hscapture.ownership import pid_alive, process_place
from hscapture.producer.row_kernel import PLAN_WAIT_S, GraphRows, RowKernel
from hscapture.ring import Ring, create_ring
from hscapture.transport import ProducerSockets, publish_token, withdraw_token

log = logging.getLogger(__name__)

#: How long one wait for credit or a consumer polls before checking its deadline again.
_POLL_MS = 20
_POLLIN = int(zmq.POLLIN)
#: The attached consumer counts as gone after this many of its heartbeats of silence (and at least
#: _TAKEOVER_MIN_S), or at once when its process has ended on this host; only then may another take over.
_TAKEOVER_BEATS = 10
_TAKEOVER_MIN_S = 2.0
#: Slot views kept for reuse (per slot, row count and grouping of the states); cleared when full.
_MAX_TARGETS = 1024
#: Longest the producer goes, while steps run, without sending the chunks it holds and taking releases
#: and hellos. A time gate cannot miss a message, it only delays it (a gate on the socket's ZMQ_FD did).
_SERVICE_S = 0.004
#: Chunks held back at most before they are sent (together, in one message).
_FLUSH_CHUNKS = 16
#: Steps the producer goes at most, holding no chunk, without taking releases and hellos (once ``_SERVICE_S``
#: has passed too); free slots running low, a wait, a request's end and ``poll`` take them at once.
_SERVE_STEPS = 8


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
    #: Hellos of a second consumer refused while another was attached.
    consumers_refused: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class WrittenStep:
    """One step's rows copied into ring slots (the copies queued), not announced yet.

    Made by :meth:`Producer.write_step`; handed back once to :meth:`Producer.announce_step`.
    """

    #: The producer's step number when the rows were written.
    step: int
    #: Kept rows of the step (what ``positions`` and ``token_ids`` cover at announce time).
    rows: int
    #: Kept rows copied into the ring: the first ``written``; the rest were dropped and counted.
    written: int
    #: The first step's owners: its requests, and the consecutive kept rows each owns.
    request_ids: Sequence[str]
    request_rows: Sequence[int]
    #: ``(slot, first kept row, rows)`` of each slot written, in row order; emptied when announced.
    slots: list[tuple[int, int, int]]
    #: Rows per plane of its one slot when later steps may add rows there (:meth:`Producer.extend_step`);
    #: 0 when the planes hold just its rows.
    row_stride: int = 0
    #: The stream its copies were queued on, when its slot's event waits for its announcement (``row_stride``).
    stream: int = 0
    #: Its rows were written by the copy inside a graph replay (:class:`GraphRows`): that graph's own outputs.
    replayed: bool = False
    #: The owners of each later step's rows (:meth:`Producer.extend_step`), joined to the first's when announced:
    #: a decode step adds two references here, not one per request.
    joined: list[tuple[Sequence[str], Sequence[int]]] = field(default_factory=list)

    def owners(self) -> tuple[Sequence[str], Sequence[int]]:
        """Request ids and rows of every step it holds, in row order."""
        if not self.joined:
            return self.request_ids, self.request_rows
        ids, rows = list(self.request_ids), list(self.request_rows)
        for step_ids, step_rows in self.joined:
            ids += step_ids
            rows += step_rows
        return ids, rows


class _Held(NamedTuple):
    """A chunk encoded and its slot written, held back to be sent with others (see the module docstring)."""

    slot: int
    seq: int
    rows: int
    payload: bytes
    #: The requests owning its rows (counted dropped if ``drop`` cannot send it).
    request_ids: Sequence[str]
    request_rows: Sequence[int]


@dataclass
class _InFlight:
    seq: int
    rows: int
    payload: bytes
    #: The consumer it was last announced to: the one whose release frees the slot.
    consumer: str


class _Owners(NamedTuple):
    """Request ids and rows that an engine passes step after step as the same tuples (a decode batch
    that did not change): checked and encoded once, not every step."""

    request_ids: tuple[str, ...]
    request_rows: tuple[int, ...]
    rows: int
    encoded_ids: msgspec.Raw
    encoded_rows: msgspec.Raw


#: Where a step of side-by-side states goes in one launch: the slot's planes seen row by row
#: (``[count, num_tensors, hidden]``, strided), and the ``[count, k, hidden]`` shape of each state's rows.
_Targets = tuple[torch.Tensor, "tuple[tuple[int, int, int], ...]"]


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
        # Read every step (the config's properties cost more than the work they stand for).
        self._num_tensors, self._dtype = config.num_tensors, config.torch_dtype
        self._row_bytes, self._rows_per_slot = config.row_bytes, config.rows_per_slot
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
        self._slots = [self.ring.slot(i).view(config.torch_dtype) for i in range(config.num_slots)]
        # On a GPU ring a step's rows go in by one driver launch (its host time is the write's cost); else torch.
        self._row_kernel = RowKernel.load(
            self._slots, config.slot_bytes, config.hidden_size, self._num_tensors, self.ring.stream_reader()
        )
        self._graph_rows: GraphRows | None = None
        self._views: dict[tuple[int, int, tuple[int, ...]], tuple[torch.Tensor, _Targets | None]] = {}
        #: ``[count, k, hidden]`` of each state's rows, per row count and grouping (writes into a slot's rows).
        self._shapes: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, int, int], ...]] = {}
        self._free: deque[int] = deque(range(config.num_slots))
        self._in_flight: dict[int, _InFlight] = {}
        self._written: dict[int, int] = {}  # slot -> rows written by write_step, not announced yet
        self._held: list[_Held] = []  # announced by the engine, not sent yet, oldest first
        self._service_at = 0.0  # when the held chunks and the control socket are next served at the latest
        self._steps_unserved = 0  # steps since the control socket was last served
        self._low_slots = max(1, config.num_slots // 4)  # at this many free slots or fewer: serve at once
        self._owners: _Owners | None = None
        # The last step checked with owners of ``_owners``: (request_ids, request_rows, each state's (shape, dtype),
        # kept rows, spans). A step with the same owners and states of the same shapes passes without the checks.
        self._checked: tuple[Any, ...] | None = None
        self._seq = itertools.count(1)
        self._request_drops: dict[str, int] = {}
        self._consumer_id: str | None = None  # attached: it confirmed our layout
        self._offered: str | None = None  # sent our layout, not confirmed yet
        # The one consumer we talk to (attached or offered): when it was last heard from, its pid when it runs
        # in our pid namespace (0: watched by its silence only), and the silence after which it counts as gone.
        self._peer_heard = 0.0
        self._peer_pid = 0
        self._peer_takeover_s = _TAKEOVER_MIN_S
        self._refused: set[str] = set()  # consumers told so (logged once each)
        self._closed = False
        self._watchdog = watchdog
        self._release = self._sockets.release
        self._current_stream = self.ring.stream_reader()
        try:
            publish_token(config.endpoint, self.token)
        except BaseException:
            self._close_sockets()
            self.ring.close()
            raise
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
        """Capture one forward step's rows; returns how many rows were announced (sent, or held to be
        sent with the next ones: a send that ``drop`` cannot make later counts them dropped).

        Args:
            states: the captured tensors in ``config.tensor_names`` order, in ``config.dtype``,
                all on one device: each ``[N, hidden]``, or ``[N, k * hidden]`` holding ``k``
                consecutive captured tensors side by side (SGLang's concatenated aux layers).
                A slot's rows are written by one launch: on a GPU ring the row kernel's
                (:mod:`~hscapture.producer.row_kernel`, up to 4 states, rows 16-byte aligned), else
                ``torch.stack`` of separate tensors, ``torch.cat`` when some state holds several side
                by side (with ``row_index``: one ``index_select`` per tensor). Give each tensor
                alone, or as few states as the engine has.
            request_ids: the requests owning the kept rows, in row order.
            request_rows: how many consecutive kept rows each request owns.
            positions: ``[R]`` int position of each kept row in its request (host values: a
                list, numpy array or CPU tensor; reading a device tensor would synchronize).
            token_ids: ``[R]`` int token id of each kept row (host values).
            row_index: ``[R]`` int64 indices into the ``N`` rows of ``states`` to keep (drops
                padding), on the states' device; ``None`` keeps all ``N`` rows in order.

        Raises:
            ValueError: shapes, dtypes or counts do not match what was planned, or positions or
                token ids are on a device.
            CreditTimeout: ``block`` waited longer than ``block_timeout_s``.
        """
        self._check_open()
        rows, spans = self._check_step(states, request_ids, request_rows, row_index)
        positions = _as_int64(positions, rows, "positions")
        token_ids = _as_int64(token_ids, rows, "token_ids")
        step = self._write_step(states, spans, request_ids, request_rows, row_index, rows)
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
        """Copy one forward step's rows into ring slots now; announce them later.

        The copy is queued on the current stream, so it runs before whatever the engine queues
        there next (a graph replay that overwrites its outputs); each slot's event, which the
        consumer waits for, is recorded after it (for a step written ``extendable``, when it is
        announced: after the rows of every step it took). Nothing is sent: the slots stay this
        producer's until :meth:`announce_step`. Under ``drop`` rows without a free slot are dropped and counted
        here; under ``block`` it waits for credit.

        Args:
            states, request_ids, request_rows, row_index: as for :meth:`capture_step`.
            extendable: lay the rows out so that later steps may add theirs to the same slot
                (:meth:`extend_step`), when they fit one slot and keep every row.

        Returns:
            The written step, for :meth:`announce_step`.

        Raises:
            ValueError: shapes, dtypes or counts do not match what was planned; or every slot
                holds rows written and not announced (announce them, or raise ``ring_bytes``).
            CreditTimeout: ``block`` waited longer than ``block_timeout_s``.
        """
        self._check_open()
        rows, spans = self._check_step(states, request_ids, request_rows, row_index)
        if extendable and row_index is None and rows <= self._rows_per_slot:
            return self._write_step(states, spans, request_ids, request_rows, None, rows, self._rows_per_slot)
        return self._write_step(states, spans, request_ids, request_rows, row_index, rows)

    def extend_step(
        self,
        step: WrittenStep,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
    ) -> bool:
        """Copy one more forward step's rows into the slot of ``step``, after its rows, and make them part of it.

        For an engine that decodes the same requests step after step: one slot, one announcement and
        one chunk for several steps instead of one per step. ``step`` must come from
        :meth:`write_step` with ``extendable=True`` and not be announced yet; the rows extend its
        ``request_ids``, ``request_rows`` and the ``positions`` and ``token_ids`` it is announced
        with, in order. The copy is queued on the current stream, which must be the one ``step`` was
        written on (else False); the slot's event is recorded when ``step`` is announced.

        Returns:
            False, writing nothing, when the rows do not fit the slot (or ``step`` was dropped, not
            written extendable, or written on another stream): write them as a step of their own.

        Raises:
            ValueError: as for :meth:`write_step`.
        """
        self._check_open()
        if len(step.slots) != 1 or not step.row_stride or self._current_stream() != step.stream:
            return False
        graph = self._graph_rows
        # A replay after one that wrote the step's first rows: its copy takes the graph's own outputs, which were
        # checked when the copy was captured, so the same owners as the last step need no look at the states.
        replayed = step.replayed and graph.pending  # type: ignore[union-attr]
        rows, spans = self._check_step(states, request_ids, request_rows, None, replayed)
        slot, _, count = step.slots[0]
        if count + rows > step.row_stride:
            return False
        self.counters.steps += 1
        self._serve_when_due()
        if replayed:
            graph.plan(slot, 0, rows, count, step.row_stride)  # type: ignore[union-attr]
        else:
            self._write(slot, states, spans, None, 0, rows, count, step.row_stride)
        step.slots[0] = (slot, 0, count + rows)
        self._written[slot] = count + rows
        step.rows += rows
        step.written += rows
        step.joined.append((request_ids, request_rows))
        return True

    def announce_step(
        self,
        step: WrittenStep,
        positions: np.ndarray | torch.Tensor | Sequence[int],
        token_ids: np.ndarray | torch.Tensor | Sequence[int],
    ) -> int:
        """Announce a step made by :meth:`write_step`; returns how many rows were announced (as for
        :meth:`capture_step`: sent, or held to be sent with the next ones).

        Call it once per written step, in the order the steps were written, and before
        :meth:`finish_request` of any request that owns rows in it.

        Args:
            step: what :meth:`write_step` returned.
            positions: ``[step.rows]`` int position of each kept row (host values).
            token_ids: ``[step.rows]`` int token id of each kept row (host values).

        Raises:
            ValueError: the step was announced already; or the lengths do not match it, or the
                values are on a device (then its slots are freed and its rows counted dropped).
        """
        self._check_open()
        if step.written and not step.slots:
            raise ValueError(f"announce_step: step {step.step} was announced already")
        try:
            positions = _as_int64(positions, step.rows, "positions")
            token_ids = _as_int64(token_ids, step.rows, "token_ids")
        except ValueError:
            self._unwrite(step)
            raise
        return self._announce_step(step, positions, token_ids)

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
        self._serve_when_due()
        slots: list[tuple[int, int, int]] = []
        begin = 0
        replayed = False
        while begin < rows:
            count = min(self._rows_per_slot, rows - begin)
            slot = self._acquire_slot()
            if slot is None:
                self._count_drop(request_ids, request_rows, begin, rows)
                break
            replayed = self._write(slot, states, spans, row_index, begin, count, 0, row_stride)
            if not row_stride:  # else when announced, after the rows of the steps it takes (extend_step)
                self.ring.mark_written(slot)
            self._written[slot] = count
            slots.append((slot, begin, count))
            begin += count
        stream = self._current_stream() if row_stride else 0
        return WrittenStep(
            self.counters.steps, rows, begin, request_ids, request_rows, slots, row_stride, stream, replayed
        )

    def _announce_step(self, step: WrittenStep, positions: np.ndarray, token_ids: np.ndarray) -> int:
        request_ids, request_rows = step.owners()
        for slot, begin, count in step.slots:
            if step.row_stride:
                self.ring.mark_written(slot, step.stream)
            end = begin + count
            ids, counts = _spans(request_ids, request_rows, begin, end, step.rows)  # a whole step: as is
            self._hold_chunk(
                slot, count, step.row_stride, ids, counts, positions[begin:end], token_ids[begin:end], step.step
            )
            del self._written[slot]
        step.slots = []
        if len(self._held) >= _FLUSH_CHUNKS:
            self._flush()
        return step.written

    def _unwrite(self, step: WrittenStep) -> None:
        """Free the slots of ``step`` and count their rows dropped."""
        slots, step.slots = step.slots, []
        for slot, _, _ in slots:
            del self._written[slot]
            self._free.appendleft(slot)
        if slots:
            self._count_drop(*step.owners(), 0, step.written)

    def announce_written(
        self,
        slot: int,
        rows: int,
        row_stride: int,
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        positions: np.ndarray,
        token_ids: np.ndarray,
    ) -> None:
        """Announce a slot a graph replay wrote (see :class:`~hscapture.graph.GraphRingWriter`).

        The slot's event is recorded here, on the current stream, after the writes queued
        there. The chunk may be sent with later ones; a send ``drop`` cannot make counts its rows
        dropped and frees the slot.
        """
        self.ring.mark_written(slot)
        self._hold_chunk(slot, rows, row_stride, request_ids, request_rows, positions, token_ids, self.counters.steps)
        if len(self._held) >= _FLUSH_CHUNKS:
            self._flush()

    def _hold_chunk(
        self,
        slot: int,
        rows: int,
        row_stride: int,
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        positions: np.ndarray,
        token_ids: np.ndarray,
        step: int,
    ) -> None:
        """Encode the chunk of a written slot whose event is recorded, and hold it to be sent (:meth:`_flush`)."""
        config = self.config
        seq = next(self._seq)
        owners = self._owners
        if owners is not None and request_ids is owners.request_ids and request_rows is owners.request_rows:
            ids, counts = owners.encoded_ids, owners.encoded_rows
        else:
            ids, counts = list(request_ids), list(request_rows)
        chunk = protocol.Chunk(
            v=protocol.PROTOCOL_VERSION,
            seq=seq,
            step=step,
            slot=slot,
            offset=slot * config.slot_bytes,
            nbytes=(row_stride or rows) * self._row_bytes,
            rows=rows,
            request_ids=ids,  # a list, or its encoded form (the same bytes on the wire)
            request_rows=counts,
            positions=protocol.pack_rows(positions),
            token_ids=protocol.pack_rows(token_ids),
            dropped_rows=self.counters.rows_dropped,
            row_stride=row_stride,
            ring_slots_used=len(self._in_flight) + len(self._held) + 1,
        )
        self._held.append(_Held(slot, seq, rows, protocol.encode(chunk), request_ids, request_rows))

    def _flush(self) -> None:
        """Send the held chunks, oldest first, in one message; under ``drop`` a send that fails drops them all.

        Each chunk's own bytes are kept as its slot's in-flight payload: a consumer that takes over
        gets it again alone (:meth:`_confirm`), byte for byte what it would have found in the batch.
        """
        held = self._held
        if not held:
            return
        self._held = []
        if len(held) == 1:
            payload = held[0].payload
        else:
            batch = protocol.Announcements(v=protocol.PROTOCOL_VERSION, chunks=[msgspec.Raw(h.payload) for h in held])
            payload = protocol.encode(batch)
        try:
            sent = self._send(payload)
        except BaseException:  # block gave up waiting (or was stopped): the rows are lost, count them
            self._drop_held(held)
            raise
        if not sent:
            self._drop_held(held)
            return
        consumer = self._consumer_id or ""
        in_flight = self._in_flight
        for h in held:
            in_flight[h.slot] = _InFlight(h.seq, h.rows, h.payload, consumer)
            self.counters.rows_captured += h.rows
        self.counters.chunks_announced += len(held)

    def _drop_held(self, held: list[_Held]) -> None:
        """Free the slots of chunks that were never sent and count their rows dropped."""
        for h in held:
            self._free.appendleft(h.slot)
            self._count_drop(h.request_ids, h.request_rows, 0, h.rows)

    def _serve_when_due(self) -> None:
        """Serve the sockets when free slots run low, or ``_SERVICE_S`` has passed and chunks are held (holding
        none, every ``_SERVE_STEPS`` steps); a clock read otherwise."""
        self._steps_unserved += 1
        if len(self._free) <= self._low_slots or (
            (self._held or self._steps_unserved >= _SERVE_STEPS) and time.monotonic() >= self._service_at
        ):
            self._serve()

    def _serve(self) -> None:
        """Send the held chunks, then take releases and hellos."""
        self._flush()
        self._drain_control()
        self._service_at = time.monotonic() + _SERVICE_S
        self._steps_unserved = 0

    def acquire_slot(self) -> int | None:
        """A free slot to write (waits under ``block``; None under ``drop`` when none is free)."""
        self._check_open()
        self._serve_when_due()
        return self._acquire_slot()

    def graph_rows(self) -> GraphRows | None:
        """The ring's writer from inside the engine's CUDA graphs (made on first call); None on a host ring or
        where its kernels do not compile. Its copies write a step's rows once :meth:`GraphRows.launched` said a
        replay holding them was launched; :meth:`write_step` and :meth:`extend_step` then plan them, no launch."""
        if self._graph_rows is None and self._slots:
            config = self.config
            wait_s = PLAN_WAIT_S + (config.block_timeout_s if config.policy == "block" else 0.0)  # a copy waits too
            self._graph_rows = GraphRows.load(
                self._slots, config.slot_bytes, config.hidden_size, self._num_tensors, wait_s
            )
        return self._graph_rows

    def reserve_slot(self) -> int:
        """Take a slot out of circulation for good: a graph writes there when ``drop`` has no credit."""
        if not self._free:
            raise ValueError("reserve_slot: no free slot; reserve before serving starts")
        return self._free.pop()

    def count_dropped(self, request_ids: Sequence[str], request_rows: Sequence[int]) -> None:
        """Count rows that were computed but not captured (no credit under ``drop``)."""
        self._count_drop(request_ids, request_rows, 0, sum(request_rows))

    def finish_request(
        self,
        request_id: str,
        reason: str = "finished",
        *,
        num_tokens: int = 0,
        loss_mask: Sequence[tuple[int, int]] = (),
        meta: dict[str, Any] | None = None,
        prefix_token_ids: Sequence[int] | np.ndarray = (),
    ) -> None:
        """Say that no more rows come for ``request_id``, and why.

        Args:
            request_id: as given to :meth:`capture_step`.
            reason: ``finished``, ``aborted``, ``retracted`` or another engine word.
            num_tokens: rows the request should have in total (0 if unknown).
            loss_mask: half-open position ranges ``[start, end)`` trained on.
            meta: msgpack-safe facts stored with the request.
            prefix_token_ids: host token ids of the request's first positions that the engine never
                forwarded (a prefix-cache hit); the store takes their rows from the request that computed them.
        """
        self._check_open()
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
        )
        if not self._send(protocol.encode(message)):
            self.counters.events_dropped += 1

    def poll(self) -> None:
        """Send held chunks, answer attaching consumers and take releases; call when the engine is idle."""
        if not self._closed:
            self._serve()

    def close(self, timeout_s: float = 30.0, error: str = "") -> ProducerCounters:
        """Announce the end of stream, wait up to ``timeout_s`` for in-flight slots, free the ring.

        ``error``: why capture failed, if it did; the consumer records it with the run and shows it.
        Idempotent. Returns the final counters.
        """
        if self._closed:
            return self.counters
        if self._written:  # written by write_step, never announced: the consumer cannot have them
            self.counters.rows_dropped += sum(self._written.values())
            self.counters.chunks_dropped += len(self._written)
            self._written.clear()
        try:
            self._drain_control()
            deadline = time.monotonic() + timeout_s
            while self._offered is not None and time.monotonic() < deadline:  # it opens the ring: let it confirm
                if self._peer_pid and not pid_alive(self._peer_pid):
                    break  # it died opening it: nobody to end the stream to
                self._wait_control()
            if self._consumer_id is not None:
                self._flush()
            else:  # nobody to send them to, and no reason to wait for one
                self._drop_held(self._held)
                self._held = []
            eos = protocol.EndOfStream(
                v=protocol.PROTOCOL_VERSION, run_id=self.run_id, counters=self.counters.to_dict(), error=error
            )
            if self._consumer_id is not None and self._send(protocol.encode(eos)):
                while self._in_flight and time.monotonic() < deadline:
                    self._wait_control()
                if self._in_flight:
                    log.warning("closing with %d slots not released by the consumer", len(self._in_flight))
        except HSCaptureError as exc:  # no consumer to deliver to (timeout, or the watchdog said so)
            log.warning("end of stream not delivered: %s", exc)
        finally:
            self._closed = True
            self._slots, self._row_kernel = [], None
            if self._graph_rows is not None:  # the engine's graphs replay on: their copies must not write
                self._graph_rows.off()
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
        replayed: bool = False,
    ) -> tuple[int, tuple[int, ...]]:
        """Check a step against the plan; returns its kept rows and how many tensors each state holds.

        A decode batch that did not change passes the same owners' tuples and states of the same shapes step
        after step: that is checked once (``_checked``), then only compared; ``replayed`` rows (a graph replay's
        copy of its own outputs) need only the same owners.
        """
        checked = self._checked
        same = checked is not None and row_index is None and request_ids is checked[0] and request_rows is checked[1]
        if same and replayed:
            return checked[3], checked[4]  # type: ignore[index]
        signature = [(state.shape, state.dtype) for state in states]
        if same and signature == checked[2]:  # type: ignore[index]
            return checked[3], checked[4]  # type: ignore[index]
        config = self.config
        hidden, dtype = config.hidden_size, self._dtype
        rows_in = states[0].shape[0] if states else 0
        spans = []
        for state in states:  # the names only when something is wrong: building them costs
            shape = state.shape
            k = shape[-1] // hidden if len(shape) == 2 else 0
            if not k or shape[0] != rows_in or shape[1] != k * hidden:
                raise ValueError(
                    f"states[{self._state_name(spans)}]: planned [{rows_in}, {hidden}], got {list(shape)} "
                    f"(a state holding k captured tensors side by side is [{rows_in}, k * {hidden}])"
                )
            if state.dtype != dtype:
                raise ValueError(
                    f"states[{self._state_name(spans)}]: planned dtype {config.dtype}, got {dtype_name(state.dtype)}"
                )
            spans.append(k)
        if sum(spans) != self._num_tensors:
            raise ValueError(f"states: planned {config.num_tensors} tensors {config.tensor_names}, got {sum(spans)}")
        rows = rows_in if row_index is None else row_index.numel()
        if self._owned_rows(request_ids, request_rows) != rows or len(request_ids) != len(request_rows):
            raise ValueError(
                f"request_rows: {len(request_ids)} request ids with rows summing to {sum(request_rows)}, "
                f"but the step keeps {rows} rows"
            )
        if rows > config.max_step_rows:
            raise ValueError(
                f"step rows: planned at most max_step_rows={config.max_step_rows}, got {rows}; "
                "raise max_step_rows (and ring_bytes)"
            )
        owners, checked_spans = self._owners, tuple(spans)
        # Owners kept as tuples: the same objects hold the same values next time.
        if (
            row_index is None
            and owners is not None
            and request_ids is owners.request_ids
            and request_rows is owners.request_rows
        ):
            self._checked = (request_ids, request_rows, signature, rows, checked_spans)
        return rows, checked_spans

    def _owned_rows(self, request_ids: Sequence[str], request_rows: Sequence[int]) -> int:
        """The rows ``request_rows`` adds up to; the same tuples as before are checked (and encoded) once."""
        owners = self._owners
        if owners is not None and request_ids is owners.request_ids and request_rows is owners.request_rows:
            return owners.rows
        if request_rows and min(request_rows) <= 0:
            raise ValueError(f"request_rows: every request owns at least one row, got {list(request_rows)[:16]}")
        rows = sum(request_rows)
        if type(request_ids) is tuple and type(request_rows) is tuple and len(request_ids) == len(request_rows):
            ids, counts = protocol.encoded(request_ids), protocol.encoded(request_rows)
            self._owners = _Owners(request_ids, request_rows, rows, ids, counts)
        return rows

    def _state_name(self, spans: Sequence[int]) -> str:
        """The captured tensor a state checked after ``spans`` starts with (its index when past the last)."""
        names, first = self.config.tensor_names, sum(spans)
        return names[first] if first < len(names) else str(len(spans))

    def _write(
        self,
        slot: int,
        states: Sequence[torch.Tensor],
        spans: tuple[int, ...],
        row_index: torch.Tensor | None,
        begin: int,
        count: int,
        first: int = 0,
        row_stride: int = 0,
    ) -> bool:
        """Copy rows ``[begin, begin + count)`` of the step into ``slot``: planes of ``count`` rows, or (a whole
        step, ``row_stride``) rows ``[first, first + count)`` of planes of ``row_stride`` rows. True when the
        copy inside the graph replay just launched writes them."""
        graph = self._graph_rows
        if (
            graph is not None
            and graph.pending
            and row_index is None
            and graph.write(slot, states, spans, begin, count, first, row_stride or count)
        ):
            return True
        kernel = self._row_kernel
        if (
            kernel is not None
            and row_index is None
            and kernel.write(slot, states, spans, begin, count, first, row_stride or count)
        ):
            return False
        if row_stride:  # the slot's views are made once; a step takes rows of them (one slice)
            planes, targets = self._targets(slot, row_stride, spans)
            if targets is None:
                torch.stack(states, out=planes[:, first : first + count])
                return False
            shapes = self._shapes.get((count, spans))
            if shapes is None:
                shapes = self._shapes[count, spans] = tuple((count, k, self.config.hidden_size) for k in spans)
            by_row = targets[0][first : first + count]
            torch.cat([state.reshape(shape) for state, shape in zip(states, shapes)], dim=1, out=by_row)
            return False
        planes, targets = self._targets(slot, count, spans)
        if row_index is not None:
            index, hidden, t = row_index[begin : begin + count], self.config.hidden_size, 0
            for state, k in zip(states, spans):
                for j in range(k):
                    torch.index_select(state[:, j * hidden : (j + 1) * hidden], 0, index, out=planes[t])
                    t += 1
            return False
        whole = begin == 0 and count == states[0].shape[0]  # the usual step: no slicing
        parts = states if whole else [state[begin : begin + count] for state in states]
        if targets is None:  # separate tensors: one launch for all, not one copy each
            torch.stack(parts, out=planes)
            return False
        # Side-by-side states: one launch for all too, each state's rows as [count, k, hidden] planes.
        by_row, shapes = targets
        torch.cat([part.reshape(shape) for part, shape in zip(parts, shapes)], dim=1, out=by_row)
        return False

    def _targets(self, slot: int, count: int, spans: tuple[int, ...]) -> tuple[torch.Tensor, _Targets | None]:
        """Views of ``slot`` for ``count`` rows, made once per shape: every tensor's plane
        ``[num_tensors, count, hidden]``, and (when some state holds several tensors) the planes seen row
        by row with the ``[count, k, hidden]`` shape of each state's rows (:data:`_Targets`)."""
        key = (slot, count, spans)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_TARGETS:
                self._views.clear()
            hidden, num = self.config.hidden_size, self._num_tensors
            planes = self._slots[slot][: num * count * hidden].view(num, count, hidden)
            targets = None
            if len(spans) != num:
                targets = (planes.transpose(0, 1), tuple((count, k, hidden) for k in spans))
            views = self._views[key] = (planes, targets)
        return views

    def _acquire_slot(self) -> int | None:
        if self._free and self._consumer_id is not None:
            return self._free.popleft()
        self._serve()  # releases not taken yet, held chunks the consumer could release, a hello that attaches
        if self._free and self._consumer_id is not None:
            return self._free.popleft()
        if self.config.policy == "drop":
            return None
        if not self._free and not self._in_flight:  # no release can come: waiting would never end
            raise ValueError(
                f"ring: all {self.config.num_slots} slots hold rows written and not announced yet (or are "
                "reserved); announce written steps before writing more, or raise ring_bytes"
            )
        self._wait_until(lambda: bool(self._free) and self._consumer_id is not None, "a free ring slot")
        return self._free.popleft()

    def _send(self, payload: bytes) -> bool:
        """Send to the attached consumer; under ``drop`` give up at once, under ``block`` wait for one."""
        if self._send_now(payload):
            return True
        if self.config.policy == "drop":
            return False
        self._wait_until(lambda: self._send_now(payload), "a consumer to send to")
        return True

    def _send_now(self, payload: bytes) -> bool:
        # Never to a consumer only offered our layout: it gets the slots still in flight first, when it confirms.
        peer = self._consumer_id
        return peer is not None and self._sockets.send(peer, payload)

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
        # Asking for EVENTS is far cheaper than a recv that raises zmq.Again on every step; the
        # flag is a plain int here (zmq.POLLIN is an IntFlag, whose `&` runs in Python).
        while self._release.get(zmq.EVENTS) & _POLLIN:
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
        """Free each slot released by the consumer it was last announced to, with the seq it was announced with.

        Raises:
            ProtocolError: some pair matches no slot in flight (the others are freed; the message is counted rejected).
        """
        consumer, in_flight, bad = message.consumer_id, self._in_flight, []
        for slot, seq in ((message.slot, message.seq), *message.more):
            flight = in_flight.get(slot)
            if flight is None or flight.seq != seq or flight.consumer != consumer:
                bad.append((slot, seq))
                continue
            del in_flight[slot]
            self._free.append(slot)
        if consumer == self._consumer_id and len(bad) < 1 + len(message.more):  # some slot was its to release
            self._peer_heard = time.monotonic()
        if bad:
            (slot, seq), others = bad[0], f" (and {len(bad) - 1} more pairs)" if len(bad) > 1 else ""
            raise ProtocolError(
                f"Release: slot {short_repr(slot)} seq {short_repr(seq)} from consumer {short_repr(consumer)} "
                f"does not match a slot in flight (stale or forged){others}"
            )

    def _on_hello(self, message: protocol.Hello) -> None:
        """Attach one consumer at a time, in two steps: offer the layout, then hand out credit once it confirms.

        A consumer confirms by saying hello with our run id, which it does as soon as it has
        opened the ring; until then nothing but the layout is sent to it (no chunk, no request
        end, no end of stream: ``block`` waits, ``drop`` drops and counts), so a slow first open
        (CUDA context, pinned buffers) costs no rows that could have waited in the ring. While the
        consumer we talk to is alive, any other is refused (:class:`~hscapture.protocol.Refused`);
        once it is gone (its process ended on this host, or silent for ``_TAKEOVER_BEATS``
        heartbeats) the next one takes over: when it confirms, every slot still in flight is
        announced to it again, in seq order, before anything newer (:meth:`_confirm`).
        """
        if self.token and not hmac.compare_digest(message.token.encode(), self.token.encode()):
            raise ProtocolError(
                f"Hello: consumer {short_repr(message.consumer_id)} gave a wrong token; a stray process, or a "
                "consumer of another run"
            )
        now = time.monotonic()
        peer = self._consumer_id or self._offered
        if message.consumer_id == peer:
            self._peer_heard = now
            if peer == self._consumer_id:
                return  # heartbeat of the attached consumer
            if message.run_id == self.run_id:  # it opened the ring of our layout: it confirms
                self._confirm(peer)
                return
        elif peer is not None and self._peer_alive(now):
            self._refuse(message.consumer_id, peer, now)
            return
        elif message.run_id == self.run_id:  # attached to us before (then silent): it holds our layout already
            self._watch(message, now)
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
        if not self._sockets.send(message.consumer_id, protocol.encode(layout)):
            return  # its announce connection is not up yet; it says hello again
        # The consumer we talked to (if any) is gone: no credit until this one confirms.
        self._offered, self._consumer_id = message.consumer_id, None
        self._watch(message, now)

    def _watch(self, message: protocol.Hello, now: float) -> None:
        """Take the consumer of ``message`` as the one we talk to; note how to tell when it is gone."""
        self._peer_heard = now
        same_namespace = message.place == process_place() and pid_alive(message.pid)
        self._peer_pid = message.pid if same_namespace else 0
        heartbeat_s = (message.heartbeat_ms or 200) / 1000
        self._peer_takeover_s = max(_TAKEOVER_MIN_S, _TAKEOVER_BEATS * heartbeat_s)

    def _peer_alive(self, now: float) -> bool:
        if self._peer_pid and not pid_alive(self._peer_pid):
            return False
        return now - self._peer_heard < self._peer_takeover_s

    def _refuse(self, consumer_id: str, peer: str, now: float) -> None:
        """Tell a second consumer that another one is attached (it prints why and exits)."""
        reason = (
            f"consumer {short_repr(peer)} is attached to {self.config.endpoint} (heard from "
            f"{now - self._peer_heard:.1f} s ago) and a producer serves one consumer at a time; stop that one "
            "first, or point this one at another producer"
        )
        refusal = protocol.Refused(
            v=protocol.PROTOCOL_VERSION,
            consumer_id=consumer_id,
            reason=reason,
            takeover_ms=round(self._peer_takeover_s * 1000),
        )
        self._sockets.send(consumer_id, protocol.encode(refusal))
        self.counters.consumers_refused += 1
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
        self._consumer_id, self._offered = consumer_id, None
        self.counters.attaches += 1
        log.info("consumer %s attached", consumer_id)
        for flight in sorted(self._in_flight.values(), key=lambda f: f.seq):
            if flight.consumer == consumer_id:
                continue
            if not self._sockets.send(consumer_id, flight.payload):
                self._consumer_id = None  # gone again mid-way; its successor's hello starts over
                break
            flight.consumer = consumer_id

    def _count_drop(self, request_ids: Sequence[str], request_rows: Sequence[int], begin: int, end: int) -> None:
        self.counters.rows_dropped += end - begin
        self.counters.chunks_dropped += -(-(end - begin) // self.config.rows_per_slot)
        ids, counts = _spans(request_ids, request_rows, begin, end, sum(request_rows))
        for request_id, count in zip(ids, counts):
            self._request_drops[request_id] = self._request_drops.get(request_id, 0) + count

    def _close_sockets(self) -> None:
        self._sockets.close()


class NullProducer:
    """Capture switched off: the same methods as :class:`Producer`, doing nothing."""

    counters = ProducerCounters()
    attached = False

    def capture_step(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def write_step(
        self,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        row_index: torch.Tensor | None = None,
    ) -> WrittenStep:
        return WrittenStep(0, sum(request_rows), 0, request_ids, request_rows, [])

    def announce_step(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def finish_request(self, *args: Any, **kwargs: Any) -> None:
        return None

    def poll(self) -> None:
        return None

    def close(self, timeout_s: float = 0.0, error: str = "") -> ProducerCounters:
        return self.counters

    def __enter__(self) -> NullProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


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


def _as_int64(values: np.ndarray | torch.Tensor | Sequence[int], rows: int, name: str) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == np.int64 and values.shape == (rows,):
        return values  # what an engine adapter usually hands over: nothing to convert
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(
                f"{name}: a tensor on {values.device}; reading it here would make the host wait for the device "
                "every step. Pass host values (a list, numpy array or CPU tensor) the engine already holds"
            )
        values = values.detach().numpy()
    array = np.asarray(values, dtype=np.int64).reshape(-1)
    if array.shape[0] != rows:
        raise ValueError(f"{name}: planned {rows} values (one per kept row), got {array.shape[0]}")
    return array
