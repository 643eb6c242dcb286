"""The consumer process: attach to a producer, copy slots out, release them, write the store.

It knows nothing of models, and it is the one module that joins the wire, the ring and the
store. It says hello on the ``release`` socket until a producer answers with a
:class:`~hscapture.protocol.Layout`, opens the ring that layout describes (once), and then for
each announced chunk: reserves rows in the store (destination views in its shard buffers),
copies the slot's planes into them (asynchronously on the CUDA ring, where rows bound for an fp8
store are quantized on the GPU first: :mod:`hscapture.consumer.device_fp8`; from a host ring such
rows are quantized where they lie instead of copied: :mod:`hscapture.consumer.host_fp8`), and once
the copies have landed releases the slot and commits the rows with their requests, positions and tokens.
Request ends are handed to the store in wire order, after the rows announced before them.
Writer threads take it from there. It keeps saying hello as a heartbeat, which is how a
restarted producer (new run id) finds it again. With ``discard`` there is no store: each chunk
is copied into one reused buffer (pinned for a CUDA ring) and released, for drain benchmarks.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from hscapture import protocol
from hscapture.config import DTYPES, ConsumerConfig
from hscapture.consumer.metrics import DropTally, Snapshot
from hscapture.cuda_runtime import NVIDIA_CONTROL, start_cuda
from hscapture.errors import AccessError, HSCaptureError, ProtocolError, short_repr
from hscapture.ownership import pid_alive, process_place
from hscapture.ring import RingReader, open_ring
from hscapture.ring.host import HostRingReader
from hscapture.store.records import Finish
from hscapture.store.writer import Reservation, RowGeometry, StoreWriter
from hscapture.transport import ConsumerSockets, client_credentials, read_token

if TYPE_CHECKING:  # torch comes in with an fp8 store alone: rows kept as captured never import it, from any ring
    from hscapture.consumer.device_fp8 import DeviceQuantizer
    from hscapture.consumer.host_fp8 import HostQuantizer

log = logging.getLogger(__name__)

#: Messages handled per poll wake-up before housekeeping runs again.
_BATCH = 256


@dataclass
class ConsumerStats:
    runs: int = 0
    chunks: int = 0
    rows: int = 0
    requests_finished: int = 0
    messages_rejected: int = 0
    end_of_streams: int = 0
    #: Rows the producer reported it dropped (``drop`` policy), over all runs.
    rows_dropped: int = 0
    #: Rows whose ring slot this consumer released.
    rows_released: int = 0
    #: Producer runs that ended because capture failed inside the engine.
    producer_failures: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _Copy:
    """A chunk whose copies are in flight: release its slot and commit its rows once ``token`` is done."""

    slot: int
    seq: int
    rows: int
    token: Any  # from RingReader.mark
    reservation: Reservation | None  # None with discard
    request_ids: list[str]
    request_rows: list[int]
    positions: np.ndarray
    token_ids: np.ndarray


@dataclass
class _End:
    """A request's end, handed to the store after the rows announced before it."""

    request_id: str
    finish: Finish


class Consumer:
    """Attaches to one producer endpoint and writes what it announces into a store.

    Args:
        config: the consumer's settings.

    Raises:
        ValueError: the output directory is not writable.
        AccessError: a tcp:// endpoint without usable keys, or an untrusted socket directory.
    """

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        #: Called on every turn of the loop (live metrics take their snapshots there).
        self.on_tick: Callable[[], None] | None = None
        self.consumer_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # First, so that missing keys or a foreign socket directory fail at once, before a store is touched.
        curve = client_credentials(config.endpoint, config.keys, config.producer_key)
        gpu_host = os.path.exists(NVIDIA_CONTROL)
        if gpu_host:  # a GPU host: a CUDA ring then opens in milliseconds, not a second
            _start_cuda(config.store_dtype)
        self.stats = ConsumerStats()
        self.store: StoreWriter | None = None
        if not config.discard:
            self.store = StoreWriter(
                config.check_out_dir(),
                config.shard_bytes,
                config.writer_threads,
                config.shard_buffers,
                config.flush_s,
                store_dtype=config.store_dtype,
                writeback_bytes=config.writeback_bytes,
                share_group=config.share_group,
                lock_fd=config.store_lock_fd,
                direct_io=config.direct_io != "off",
            )
            # A host ring's rows are quantized by this kernel: compiled before the producer comes. Not on a GPU host,
            # where a CUDA ring's rows are quantized on the GPU: a compile there held the GIL against the copies of
            # the first rows (a host ring there compiles when its layout comes).
            if self.store.fp8 and not gpu_host:
                from hscapture.fp8_kernel import host_kernels

                threading.Thread(target=host_kernels, name="hscapture-fp8-compile", daemon=True).start()
        self._sockets = ConsumerSockets(config.endpoint, self.consumer_id, curve)
        self._announce, self._release = self._sockets.announce, self._sockets.release
        self._layout: protocol.Layout | None = None
        self._ring: RingReader | None = None
        self._row_bytes = 0
        self._plane_row_bytes = 0
        #: With discard: the one buffer every chunk is copied into.
        self._discard: np.ndarray | None = None
        #: For an fp8 store: quantizes each chunk on the GPU before the copy out of a CUDA ring, or out of
        #: a host ring's shared memory in place of the copy.
        self._quantizer: DeviceQuantizer | HostQuantizer | None = None
        self._last_seq = 0
        self._producer_pid = 0
        #: The last announcement taken per slot (seq, hash of its bytes): the very same announcement
        #: coming again after a re-attach is not copied twice, nor rejected as a replay.
        self._announced: dict[int, tuple[int, int]] = {}
        #: Chunks whose copies are in flight and request ends behind them, in wire order.
        self._pending: deque[_Copy | _End] = deque()
        self._drops = DropTally()
        #: Ring slots in flight as the producer reported with its last chunk, and releases since.
        self._ring_used_at_chunk = 0
        self._released_since_chunk = 0
        self._stopping = False
        #: The original error of the last producer run that ended in a capture failure ('' if none did).
        self.last_failure = ""
        self._last_hello = 0.0
        #: When the producer first refused us (another consumer attached); None while not refused.
        self._refused_since: float | None = None
        self._closed = False

    @property
    def run_id(self) -> str:
        """The producer run this consumer is attached to ('' while detached)."""
        return "" if self._layout is None else self._layout.run_id

    def stop(self) -> None:
        """Ask :meth:`run` to finish the store and return (safe from a signal handler)."""
        self._stopping = True

    def run(self) -> ConsumerStats:
        """Serve until stopped, or until end of stream when ``exit_on_eos`` is set."""
        heartbeat_s = self.config.heartbeat_ms / 1000
        try:
            while not self._stopping:
                if time.monotonic() - self._last_hello >= heartbeat_s:
                    if self._producer_died() and self.config.exit_on_eos:
                        return self.stats
                    self._hello()
                if self._pending and not self._announce.poll(0):
                    self._settle(oldest=True)  # nothing new: wait for the oldest copy, not a timer
                if self._pending or self._announce.poll(self.config.heartbeat_ms):
                    for _ in range(_BATCH):
                        try:
                            data = self._announce.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if self._handle(data) and self.config.exit_on_eos:
                            return self.stats
                self._settle()
                if self.store is not None:
                    self.store.tick()
                if self.on_tick is not None:
                    self.on_tick()
                if self.config.watch_pid is not None and not pid_alive(self.config.watch_pid):
                    log.warning("process %d is gone; finishing the store", self.config.watch_pid)
                    self.close(f"process {self.config.watch_pid} exited")
                    break
            return self.stats
        finally:
            self.close()

    def close(self, reason: str = "consumer stopped") -> None:
        """Finish the store (open requests marked incomplete), unmap the ring, close sockets."""
        if self._closed:
            return
        self._closed = True
        try:
            self._settle(wait=True)
            if self.store is not None:
                self.store.close(reason)
        except HSCaptureError as exc:  # e.g. the disk is still full: what is indexed stays intact
            log.error("the store could not be finished: %s", exc)
        finally:
            self._close_ring()
            self._sockets.close()

    # ------------------------------------------------------------------ messages

    def _hello(self) -> None:
        self._last_hello = time.monotonic()
        self._sockets.check()  # a tcp:// producer that refused our key: say so and stop, never wait forever
        token = self.config.token if self.config.token is not None else read_token(self.config.endpoint)
        hello = protocol.Hello(
            v=protocol.PROTOCOL_VERSION,
            consumer_id=self.consumer_id,
            run_id=self.run_id,
            token=token,
            pid=os.getpid(),
            place=process_place(),
            heartbeat_ms=self.config.heartbeat_ms,
        )
        with contextlib.suppress(zmq.Again):  # no producer yet: say it again next heartbeat
            self._release.send(protocol.encode(hello), zmq.NOBLOCK)

    def _handle(self, data: bytes) -> bool:
        """Handle one message; returns True on end of stream."""
        try:
            message = protocol.decode_to_consumer(data)
            if isinstance(message, protocol.Layout):
                self._on_layout(message)
            elif isinstance(message, protocol.Refused):
                self._on_refused(message)
            elif self._layout is None:
                pass  # meant for a consumer before us; the producer re-announces after our layout
            elif isinstance(message, protocol.Chunk):
                self._on_chunk(message, hash(data))
            elif isinstance(message, protocol.Announcements):
                self._on_announcements(message)
            elif isinstance(message, protocol.RequestFinished):
                self._on_finished(message)
                self.stats.requests_finished += 1
            elif isinstance(message, protocol.EndOfStream):
                return self._on_end(message)
        except ProtocolError as exc:
            self._reject(exc)
        return False

    def _reject(self, exc: ProtocolError) -> None:
        self.stats.messages_rejected += 1
        log.warning("rejected message on announce socket: %s", exc)

    def _on_layout(self, layout: protocol.Layout) -> None:
        if layout.consumer_id != self.consumer_id or layout.run_id == self.run_id:
            return  # the answer to another consumer's hello, or a repeat of ours
        started = time.monotonic()
        _check_layout(layout)
        try:
            ring = open_ring(layout.ring)
        except ProtocolError:
            raise
        except Exception as exc:  # a description we cannot open is the peer's fault, not a reason to die
            raise ProtocolError(f"Layout.ring: cannot open it: {exc}") from None
        if ring.nbytes < layout.num_slots * layout.slot_bytes:
            ring.close()
            raise ProtocolError(
                f"Layout: {layout.num_slots} slots of {layout.slot_bytes} bytes do not fit the ring of {ring.nbytes}"
            )
        self._close_ring()
        self._ring = ring
        self._refused_since = None
        if self.store is None:
            self._discard = ring.allocate(layout.slot_bytes)
        else:
            geometry = RowGeometry(
                tuple(layout.tensor_names), tuple(layout.tensor_descriptions), layout.dtype, layout.hidden_size
            )
            tensors, dtype = len(layout.tensor_names), layout.dtype
            max_rows = layout.slot_bytes // geometry.row_bytes
            on_host = isinstance(ring, HostRingReader)
            if self.store.fp8 and on_host:
                from hscapture.consumer.host_fp8 import HostQuantizer

                quantized = HostQuantizer.available(dtype)
            else:  # a CUDA ring's rows are quantized on its GPU
                quantized = self.store.fp8
            if self.config.direct_io == "auto":  # O_DIRECT spares CPU time where the engine's cores are the limit
                self.store.direct.use(on_host)
            allocate = huge_pages if on_host else ring.allocate  # pinned for a CUDA ring
            # A drop producer loses what is not taken at once: its consumer attaches with everything ready.
            ready = layout.policy == "drop"
            self.store.begin_run(layout.run_id, geometry, layout.meta, allocate, quantized, ready)
            if quantized and on_host:
                threads = self.config.quantize_threads
                self._quantizer = HostQuantizer(ring, tensors, layout.hidden_size, dtype, max_rows, threads)
            elif quantized:
                from hscapture.consumer.device_fp8 import DeviceQuantizer

                self._quantizer = DeviceQuantizer(ring, tensors, layout.hidden_size, dtype, max_rows)
        self._layout = layout
        # A producer we cannot see (another pid namespace) is not watched: never end a live run.
        self._producer_pid = layout.pid if 0 < layout.pid < 2**31 and pid_alive(layout.pid) else 0
        self._plane_row_bytes = layout.hidden_size * DTYPES[layout.dtype]
        self._row_bytes = len(layout.tensor_names) * self._plane_row_bytes
        self._last_seq = 0
        self._announced = {}
        self._ring_used_at_chunk = 0
        self.stats.runs += 1
        self.stats.rows_dropped = self._drops.begin_run()
        ready_s = time.monotonic() - started  # mostly the store's shard buffers, touched before rows go in
        gate = self.config.attach_gate
        while gate is not None and not gate.exists() and not self._stopping:
            time.sleep(0.01)
        self._hello()  # confirms the layout: the producer starts announcing
        quantizing = f"; {self._quantizer.doing}" if self._quantizer is not None else ""
        slots = (layout.num_slots, layout.slot_bytes)
        log.info("attached to run %s in %.1f s (%d slots of %d bytes%s)", layout.run_id, ready_s, *slots, quantizing)

    def _on_refused(self, message: protocol.Refused) -> None:
        """Another consumer is attached: ask again for longer than the producer takes to count it gone, then stop."""
        if message.consumer_id != self.consumer_id:
            return
        now = time.monotonic()
        wait_s = 1.5 * message.takeover_ms / 1000 + 2 * self.config.heartbeat_ms / 1000
        if self._refused_since is None:
            self._refused_since = now
            log.warning("the producer refuses this consumer: %s; asking again for %.1f s", message.reason, wait_s)
        elif now - self._refused_since > wait_s:
            raise AccessError(f"the producer at {self.config.endpoint} refused this consumer: {message.reason}")

    def _on_chunk(self, chunk: protocol.Chunk, digest: int, settle: bool = True) -> None:
        layout, ring = self._layout, self._ring
        assert layout is not None and ring is not None
        protocol.check_chunk(chunk, layout, self._row_bytes)
        if chunk.seq <= self._last_seq:
            if self._announced.get(chunk.slot) != (chunk.seq, digest):
                raise ProtocolError(f"Chunk.seq: {chunk.seq} after {self._last_seq}; replayed or out of order")
            # The same announcement again: the producer took us back after another consumer had its place
            # (it ignored our releases meanwhile). A slot still being copied is released when its copy lands,
            # never before; one released already is released again.
            if not any(isinstance(e, _Copy) and (e.slot, e.seq) == (chunk.slot, chunk.seq) for e in self._pending):
                self._send_release([(chunk.slot, chunk.seq)])
            return
        self._last_seq = chunk.seq  # used, even if the chunk is refused below: it cannot be replayed
        self._announced[chunk.slot] = (chunk.seq, digest)
        positions = protocol.unpack_rows(chunk.positions, chunk.rows, "positions")
        token_ids = protocol.unpack_rows(chunk.token_ids, chunk.rows, "token_ids")
        if self.config.delay_ms:
            time.sleep(self.config.delay_ms / 1000)
        log.debug("chunk seq %d slot %d rows %d", chunk.seq, chunk.slot, chunk.rows)
        reservation = self._reserve(chunk.rows)
        ring.begin(chunk.slot)
        if reservation is None:
            assert self._discard is not None
            ring.copy_into(chunk.offset, self._discard[: chunk.nbytes])
        else:
            self._copy(ring, chunk, reservation)
        copy = _Copy(
            chunk.slot, chunk.seq, chunk.rows, ring.mark(), reservation,
            chunk.request_ids, chunk.request_rows, positions, token_ids,
        )  # fmt: skip
        self._pending.append(copy)
        self.stats.chunks += 1
        self.stats.rows += chunk.rows
        self.stats.rows_dropped = self._drops.reported(chunk.dropped_rows)
        self._ring_used_at_chunk, self._released_since_chunk = chunk.ring_slots_used, 0
        if settle:
            self._settle()

    def _on_announcements(self, message: protocol.Announcements) -> None:
        """Take each chunk as if it had come alone (its digest is of its own bytes); a bad one is rejected alone.
        Copies that landed are settled once, after all: their slots go back in one release."""
        for part in message.chunks:
            data = bytes(part)
            try:
                chunk = protocol.decode_to_consumer(data)
                if not isinstance(chunk, protocol.Chunk):
                    raise ProtocolError(f"Announcements: holds a {type(chunk).__name__}; only chunks travel together")
                self._on_chunk(chunk, hash(data), settle=False)
            except ProtocolError as exc:
                self._reject(exc)
        self._settle()

    def _reserve(self, rows: int) -> Reservation | None:
        """Room in the store for ``rows`` rows (None with discard).

        When every shard buffer is full, those waiting for copies in flight are committed first:
        a buffer is written, and so freed, only once all of its rows are in.
        """
        if self.store is None:
            return None
        reservation = self.store.reserve(rows, wait=False)
        if reservation is None:
            self._settle(wait=True)
            reservation = self.store.reserve(rows)  # waits for a writer thread: the disk sets the pace
        assert reservation is not None
        return reservation

    def _copy(self, ring: RingReader, chunk: protocol.Chunk, reservation: Reservation) -> None:
        """Issue the copies of a slot's ``[tensors, row_stride or rows, hidden]`` planes into the reserved rows."""
        if self._quantizer is not None:
            self._quantizer.copy(chunk.offset, chunk.rows, chunk.row_stride or chunk.rows, reservation)
            return
        plane_row = self._plane_row_bytes
        plane_bytes = (chunk.row_stride or chunk.rows) * plane_row
        begin = 0
        for piece in reservation.pieces:
            ring.copy_planes_into(chunk.offset + begin * plane_row, plane_bytes, piece.planes)
            begin += piece.rows

    def _on_finished(self, message: protocol.RequestFinished) -> None:
        """Count the request's drops now; hand its end to the store behind the rows announced before it."""
        self.stats.rows_dropped = self._drops.request(message.dropped_rows)
        if self.store is None:
            return
        prefix = protocol.unpack_prefix(message)
        positions = protocol.checked_positions(message)
        finish = Finish(
            message.reason, message.num_tokens, message.dropped_rows, message.loss_mask, message.meta, prefix, positions
        )
        self._pending.append(_End(message.request_id, finish))
        self._settle()

    def _settle(self, wait: bool = False, oldest: bool = False) -> None:
        """Release every slot whose copies have landed and commit its rows; hand on the request ends behind them.

        Args:
            wait: first wait for every copy issued.
            oldest: first wait for the oldest chunk's copies.
        """
        ring, pending = self._ring, self._pending
        if ring is None:
            return
        if wait:
            ring.complete()
        elif oldest and pending and isinstance(pending[0], _Copy):
            ring.wait(pending[0].token)
        released: list[tuple[int, int]] = []  # sent in one message: one receive for the producer
        while pending:
            entry = pending[0]
            if isinstance(entry, _End):
                assert self.store is not None
                self.store.finish_request(entry.request_id, entry.finish)
            elif ring.done(entry.token):
                released.append((entry.slot, entry.seq))
                self.stats.rows_released += entry.rows
                if entry.reservation is not None:
                    assert self.store is not None
                    self.store.commit(
                        entry.reservation, entry.request_ids, entry.request_rows, entry.positions, entry.token_ids
                    )
            else:
                break
            pending.popleft()
        if released:
            self._send_release(released)

    def _send_release(self, released: list[tuple[int, int]]) -> None:
        """Release ``(slot, seq)`` pairs, oldest first, in one message."""
        log.debug("release %s", released)
        (slot, seq), more = released[0], released[1:]
        message = protocol.Release(
            v=protocol.PROTOCOL_VERSION, consumer_id=self.consumer_id, slot=slot, seq=seq, more=more
        )
        self._released_since_chunk += len(released)
        try:
            self._release.send(protocol.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("producer gone; slots %s not released", [s for s, _ in released])

    def _on_end(self, message: protocol.EndOfStream) -> bool:
        if message.run_id != self.run_id:
            return False
        self.stats.rows_dropped = self._drops.reported(message.counters.get("rows_dropped", 0))
        reason = "end of stream"
        if message.error:
            error = " ".join(message.error.split())  # one line, however the engine worded it
            self.last_failure = error if len(error) <= 2000 else error[:2000] + "..."
            self.stats.producer_failures += 1
            reason = f"capture failed in the producer: {self.last_failure}"
            log.error("run %s: %s; nothing more comes from this run", message.run_id, reason)
        self._end_run(reason, message.counters)  # the producer frees its ring once every slot is back
        self.stats.end_of_streams += 1
        log.info("run %s ended: %s", message.run_id, message.counters)
        return True

    def _end_run(self, reason: str, counters: dict[str, int]) -> None:
        """Land every copy and release its slot, end the store's run, close the ring, detach."""
        self._settle(wait=True)
        if self.store is not None:
            self.store.end_run(reason, counters)
        self._close_ring()
        self._layout = None

    def snapshot(self) -> Snapshot:
        """The counters live metrics show (see :mod:`hscapture.consumer.metrics`)."""
        layout, store = self._layout, self.store
        in_flight = self._ring_used_at_chunk - self._released_since_chunk  # the producer's figure, aged by our releases
        return Snapshot(
            time=time.monotonic(),
            attached=layout is not None,
            runs=self.stats.runs,
            rows_captured=self.stats.rows,
            rows_dropped=self.stats.rows_dropped,
            rows_written=self.stats.rows_released if store is None else store.rows_durable,  # discard: done once copied
            bytes_written=0 if store is None else store.bytes_durable,
            rows_unreleased=self.stats.rows - self.stats.rows_released,
            rows_unwritten=0 if store is None else store.rows_written - store.rows_durable,
            ring_slots=0 if layout is None else layout.num_slots,
            ring_slots_used=0 if layout is None else min(layout.num_slots, max(0, in_flight)),
            requests_finished=self.stats.requests_finished,
            messages_rejected=self.stats.messages_rejected,
            producer_failures=self.stats.producer_failures,
            last_failure=self.last_failure,
        )

    def _producer_died(self) -> bool:
        """End the run if the producer's process is gone (checked once per heartbeat)."""
        layout = self._layout
        if layout is None or not self._producer_pid or pid_alive(self._producer_pid):
            return False
        log.warning("producer process %d of run %s is gone; finishing its requests", self._producer_pid, layout.run_id)
        self._end_run("producer died", {})
        return True

    def _close_ring(self) -> None:
        self._settle(wait=True)
        self._pending.clear()
        self._discard = None
        if self._quantizer is not None:
            self._quantizer.close()
        self._quantizer = None
        if self._ring is not None:
            self._ring.close()
            self._ring = None


def _start_cuda(store_dtype: str | None) -> None:
    """Start CUDA before the hello, so it is done by the time a layout comes (while the producer's engine loads,
    when ``extract`` launches this consumer), and before the store's writer threads compile their kernels.

    Rows kept as captured are read with cupy alone (:func:`hscapture.cuda_runtime.start_cuda`: no torch, whose import
    was most of this consumer's start on the H200). An fp8 store quantizes a CUDA ring's rows with torch: it
    imports torch here, as those rows will need it.
    """
    if store_dtype is None:
        start_cuda()  # a start under way (``hscapture consume`` begins it first thing) is waited for
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.init()


def _check_layout(layout: protocol.Layout) -> None:
    """Refuse a layout whose geometry cannot be real, before opening or writing anything."""
    if layout.dtype not in DTYPES or not 0 < layout.num_slots <= 1 << 20 or layout.slot_bytes <= 0:
        raise ProtocolError(f"Layout: unusable ring ({layout.num_slots} slots, dtype {short_repr(layout.dtype)})")
    if not layout.tensor_names or len(layout.tensor_names) != len(layout.tensor_descriptions):
        raise ProtocolError(f"Layout.tensor_names: {short_repr(layout.tensor_names)} do not match their descriptions")
    row_bytes = len(layout.tensor_names) * layout.hidden_size * DTYPES[layout.dtype]
    if layout.hidden_size <= 0 or row_bytes > layout.slot_bytes:
        raise ProtocolError(f"Layout.hidden_size: {layout.hidden_size} rows do not fit slots of {layout.slot_bytes}")


def huge_pages(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh anonymous memory asking the kernel for 2 MiB pages (``MADV_HUGEPAGE``), for shard buffers.

    The store touches each buffer before rows go in; on the 2-core CPU host's VM a first write faults at ~0.3 GB/s
    with 4 KiB pages and ~1 GB/s with huge ones, which is most of the wait for a run's first rows (a 256 MiB
    shard buffer). Where the kernel gives no huge pages (``transparent_hugepage`` off) it is plain memory.
    """
    memory = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE here: 4 KiB pages, as np.empty
        memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, dtype=np.uint8, count=nbytes)


def consume_command(endpoint: str, out: Path | None, *options: str) -> list[str]:
    """The ``hscapture consume`` command line in this interpreter, for starting a consumer process."""
    command = [sys.executable, "-m", "hscapture", "consume", "--endpoint", endpoint]
    return [*command, *(["--out", str(out)] if out is not None else []), *options]
