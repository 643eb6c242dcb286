"""Writing a store: rows in, shards and index lines out (see FORMAT.md).

The writer speaks rows. Its caller (the consumer) begins a run with the rows' geometry, then
for each batch of rows: :meth:`StoreWriter.reserve` hands out destination views in shard
buffers, the caller copies the rows' bytes into them (asynchronously if it likes), and
:meth:`StoreWriter.commit` says they landed and whose they are (request, position, token).
:meth:`StoreWriter.finish_request` closes a request. A shard whose rows are all reserved and
committed goes to a writer thread (written straight from its buffer, fsync'd, renamed); only
then is it listed in the index, and a request's line follows once every shard holding its rows
is listed. So a crash at any moment leaves an index that lists only complete shards and requests.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hscapture.config import DTYPES, default_writer_threads, store_dtype_name
from hscapture.errors import StoreError
from hscapture.fp8_kernel import FP8_NAME, host_kernels
from hscapture.ownership import open_own
from hscapture.store.checksum import crc_kernel
from hscapture.store.directory import StoreDir
from hscapture.store.files import lock_store, open_store_dir, remove_stale_temps, replace_file
from hscapture.store.format import (
    INDEX_FILE,
    META_FILE,
    READ_VERSIONS,
    SELECTION_VERSION,
    SHARED_VERSION,
    STORE_FORMAT,
    STORE_VERSION,
    check_store_dtype,
    read_index,
    read_meta,
    shard_files,
    shard_name,
)
from hscapture.store.index import KEPT, IndexLog, rewrite_index
from hscapture.store.prefixes import PrefixIndex
from hscapture.store.records import Finish, Request, once, request_record
from hscapture.store.recovery import recover_open_runs
from hscapture.store.shards import WRITEBACK_BYTES, DirectIO, ShardBuffer, ShardSpec, new_buffer, touch, write_shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowGeometry:
    """What one stored row is: a ``[hidden_size]`` vector of ``dtype`` for each named tensor."""

    tensor_names: tuple[str, ...]
    #: One sentence per tensor saying exactly what was captured (kept in ``meta.json``).
    tensor_descriptions: tuple[str, ...]
    #: The captured dtype's name (``bfloat16``, ``float16``, ``float32``).
    dtype: str
    hidden_size: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not a storable dtype ({sorted(DTYPES)})")
        if not self.tensor_names or len(self.tensor_names) != len(self.tensor_descriptions):
            raise ValueError(f"tensor_names: {list(self.tensor_names)} do not match their descriptions")
        if self.hidden_size <= 0:
            raise ValueError(f"hidden_size: {self.hidden_size} must be > 0")

    @property
    def plane_row_bytes(self) -> int:
        """Bytes of one row of one tensor."""
        return self.hidden_size * DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of all tensors."""
        return len(self.tensor_names) * self.plane_row_bytes

    def spec(self) -> dict[str, Any]:
        """The ``meta.json`` fields every run of a store must agree on."""
        tensors = [{"name": n, "description": d} for n, d in zip(self.tensor_names, self.tensor_descriptions)]
        return {"dtype": self.dtype, "hidden_size": self.hidden_size, "tensors": tensors}


@dataclass
class _Shard:
    shard_id: int
    run_id: str
    buffer: ShardBuffer
    #: Rows handed out by reserve, and rows committed; written once sealed and all committed.
    reserved: int = 0
    committed: int = 0
    sealed: bool = False
    request_lookup: dict[str, int] = field(default_factory=dict)
    opened: float = field(default_factory=time.monotonic)


@dataclass
class Rows:
    """Reserved rows in one shard: copy each tensor's bytes into ``planes[t]``, then commit.

    In a run whose rows arrive quantized (``begin_run(..., quantized=True)``), copy each tensor's
    fp8 codes into ``planes[t]``, each row's scale into ``scales[t]``, its count of non-finite
    values into ``nonfinite[t]`` and the CRC-32 of its codes into ``crcs[t]`` (what
    :class:`~hscapture.consumer.device_fp8.RowCrcs` computes where the codes are).
    """

    #: One ``[rows, hidden * itemsize]`` uint8 view per tensor, in geometry order (``[rows, hidden]``
    #: codes when quantized).
    planes: list[np.ndarray]
    #: Quantized rows only: one ``[rows]`` float32 view per tensor for the scales, one ``[rows]``
    #: int32 view for the non-finite counts and one for the CRC-32s (uint32 bits; empty otherwise).
    scales: list[np.ndarray]
    nonfinite: list[np.ndarray]
    crcs: list[np.ndarray]
    rows: int
    _shard: _Shard
    _start: int


@dataclass
class Reservation:
    """Rows handed out by :meth:`StoreWriter.reserve`, in order: one piece per shard they fall in."""

    pieces: list[Rows]
    rows: int


@dataclass
class _Run:
    run_id: str
    geometry: RowGeometry
    rows_per_shard: int
    fp8: bool
    #: Rows arrive as fp8 codes, scales and non-finite counts (quantized by the caller).
    quantized: bool
    #: Why a shard write of the run failed (None while none did): the run then never gets a ``run_end`` line.
    write_failed: str | None = None


class StoreWriter:
    """Writes rows into shards and the index. One thread calls it (the consumer loop).

    Args:
        root: the store directory (created; an existing store is appended to).
        shard_bytes: target bytes of one shard (of rows as captured; fp8 files are about half).
        writer_threads: threads writing shards in parallel (None: sized for each run by how its row planes
            go out, :func:`~hscapture.config.default_writer_threads`).
        shard_buffers: shard buffers, each ``shard_bytes`` of host memory (None: writer threads + 2:
            one filling, one waiting for its last copies, the rest being written).
        flush_s: a shard open longer than this is written even if not full, so streaming
            capture of a quiet server still reaches disk.
        lock_timeout_s: how long to wait for another writer of the same store to finish.
        store_dtype: ``fp8`` (or ``float8_e4m3fn``) stores rows as fp8 codes with a scale per row,
            quantized on the writer threads unless they arrive quantized; None stores them as
            captured, or as an existing store already does.
        writeback_bytes: bytes a writer thread writes before asking the kernel to start writing them
            to the disk (0: nothing reaches the disk before each shard's fsync).
        direct_io: write the shards' row planes with ``O_DIRECT`` (no copy into the page cache) where
            the filesystem takes it; False writes everything through the page cache.
        share_group: let this group read the store (directory setgid 2750, files 0640); by default
            it is private (0700, 0600), or shared as an existing store already is.
        lock_fd: a descriptor of the store's ``.lock`` that the process which started this one holds
            locked (``hscapture extract``): the writer works under that lock instead of taking it.

    Raises:
        StoreError: another process keeps writing this store, or it holds another format.
        AccessError: the directory, its lock or its index belongs to another user, is a link, or
            others may write into the directory.
    """

    def __init__(
        self,
        root: Path,
        shard_bytes: int,
        writer_threads: int | None = None,
        shard_buffers: int | None = None,
        flush_s: float = 30.0,
        lock_timeout_s: float = 30.0,
        store_dtype: str | None = None,
        writeback_bytes: int = WRITEBACK_BYTES,
        share_group: str | None = None,
        lock_fd: int | None = None,
        direct_io: bool = True,
    ) -> None:
        if shard_buffers is not None and shard_buffers < 2:
            raise ValueError(f"shard_buffers: {shard_buffers}; at least 2 (one filling, one being written)")
        self.root = Path(root)
        self.store_dtype = store_dtype_name(store_dtype)
        #: The store directory, opened once: every file is made through it (wherever it is renamed to).
        self._dir = open_store_dir(self.root, share_group)
        self.file_mode = self._dir.file_mode
        try:
            self._lock = lock_store(self._dir, lock_timeout_s, self.file_mode, lock_fd)
        except BaseException:
            self._dir.close()
            raise
        try:
            check_store_dtype(self._dir, self.store_dtype)
            self._meta = self._load_meta()
            self._open_existing()
        except BaseException:
            self._lock.close()
            self._dir.close()
            raise
        #: Rows are stored as fp8 codes with a scale per row (this store's ``store_dtype``).
        self.fp8 = (self._meta or {}).get("store_dtype", self.store_dtype) == FP8_NAME
        self.shard_bytes = shard_bytes
        self.flush_s = flush_s
        self.writeback_bytes = writeback_bytes
        #: Whether row planes go out with O_DIRECT (off after the filesystem refused it), bytes each way.
        self.direct = DirectIO(direct_io)
        self._threads_asked, self._buffers_asked = writer_threads, shard_buffers
        self.writer_threads, self.shard_buffers = self._sizes()
        self._pool = ThreadPoolExecutor(self.writer_threads, thread_name_prefix="hscapture-writer")
        # The writer threads' row checksums, compiled from now on (~1 s of a core; nothing waits for it: shards
        # written before it is done are checksummed by zlib, the same bits). An fp8 store's rows mostly arrive
        # quantized, their CRCs with them: it compiles them only for a run whose rows it quantizes (begin_run).
        if not self.fp8:
            self._pool.submit(crc_kernel)
        self._free: queue.SimpleQueue[ShardBuffer] = queue.SimpleQueue()
        self._buffers_made = 0
        #: Buffers made and not touched yet, the background toucher's work; a reservation that finds no touched
        #: buffer free takes one of these at once (its first writes fault) rather than wait.
        self._untouched: list[ShardBuffer] = []
        self._untouched_lock = threading.Lock()
        self._toucher: threading.Thread | None = None
        self._buffers_quantized = False
        self._writing: dict[int, Future[dict[str, Any]]] = {}
        self._waiting: dict[int, _Shard] = {}  # sealed, some rows not committed yet
        self._run: _Run | None = None
        self._shard: _Shard | None = None
        self._requests: dict[str, Request] = {}
        #: Requests that ended, by the unlisted shards holding their rows, and the other way round:
        #: a request's line is written when the last of them is listed.
        self._unlisted: dict[str, set[int]] = {}
        self._waiting_on: dict[int, set[str]] = {}
        #: Ended requests whose shards may all be listed now.
        self._ready: list[str] = []
        #: Requests whose shards are listed and whose line names a donor whose own line is not yet.
        self._held: list[str] = []
        self._arrivals = 0
        self._allocate: Callable[[int], np.ndarray] = _pageable_bytes
        #: Rows committed, and requests whose line is written.
        self.rows_written = 0
        self.requests_written = 0
        #: Rows and bytes of the shards indexed and fsync'd (durable), for live metrics.
        self.rows_durable = 0
        self.bytes_durable = 0

    def _open_existing(self) -> None:
        """After taking the lock: remove our stale temp files, cut a torn index tail, upgrade a version-1
        store, close runs a dead writer left open, open the log."""
        for name in remove_stale_temps(self._dir):
            log.info("%s: removed %s, a temp file a writer left", self.root, name)
        self._repair_index()
        records = read_index(self._dir, None if self._meta is None else self._meta["version"])
        if self._meta is not None and self._meta["version"] < STORE_VERSION:
            self._upgrade(records)
        self._indexed = {r["id"] for r in records if r["type"] == "shard"}
        # Past every shard on disk too: one left unlisted (its line lost) is never overwritten.
        self._next_shard = 1 + max(self._indexed | set(shard_files(self._dir)), default=-1)
        self._complete = {r["id"] for r in records if r["type"] == "request" and r["status"] == "complete"}
        self._prefixes = PrefixIndex(self._dir, records)
        self._index = IndexLog(self._dir, self.file_mode)
        self._index.append(recover_open_runs(self._dir, records, self._meta))

    def _upgrade(self, records: list[dict[str, Any]]) -> None:
        """Make a version-1 store version 2: every index line gets its checksum (index first: a crash
        in between leaves checksummed lines in a version-1 store, which version-1 readers ignore)."""
        rewrite_index(self._dir, records, self.file_mode)
        self._set_version(STORE_VERSION)

    def _set_version(self, version: int) -> None:
        """Raise ``meta.json``'s version (before the first line that needs it is written)."""
        assert self._meta is not None
        log.info("%s: store version %d -> %d", self.root, self._meta["version"], version)
        self._meta = {**self._meta, "version": version}
        replace_file(self._dir, META_FILE, json.dumps(self._meta, indent=2).encode(), self.file_mode)

    # ------------------------------------------------------------------ runs

    def begin_run(
        self,
        run_id: str,
        geometry: RowGeometry,
        meta: dict[str, Any],
        allocate: Callable[[int], np.ndarray] | None = None,
        quantized: bool = False,
        ready: bool = False,
    ) -> None:
        """Start writing rows of a run; the store's tensors must match earlier runs.

        Args:
            run_id: the run's id, as recorded in the index.
            geometry: what one row holds.
            meta: facts about the run (engine, model, capture config) for its ``run`` line.
            allocate: host memory for shard buffers allocated from now on (e.g. pinned memory a
                device copies into fastest); by default pageable numpy memory.
            quantized: the caller hands in rows already quantized (fp8 codes, scales and non-finite
                counts, bit for bit what :func:`hscapture.fp8.quantize_rows` gives, and each row's
                CRC-32; see :class:`Rows`), e.g. quantized on the GPU before the copy out, or where they
                lie in a host ring. Only in an fp8 store.
            ready: return only once every shard buffer is touched and the row checksums are compiled, for a
                producer that drops what is not taken at once (``drop``): seconds of a 2-core host, but from then
                on the rows meet no page fault and no compiler holding the GIL. By default the run begins once its
                first buffer is ready and the rest follows behind the rows, for a producer that waits (``block``).

        Raises:
            StoreError: the store holds other tensors.
            ValueError: ``quantized`` rows for a store that keeps rows as captured.
        """
        if quantized and not self.fp8:
            raise ValueError(f"quantized: {self.root} stores rows as captured, not as fp8; hand in the rows themselves")
        if self._run is not None:
            self.end_run("producer restarted", {})
        spec = geometry.spec()
        if self._meta is None:
            stored_as = {"store_dtype": self.store_dtype} if self.store_dtype is not None else {}
            self._meta = {"format": STORE_FORMAT, "version": STORE_VERSION, **spec, **stored_as}
            replace_file(self._dir, META_FILE, json.dumps(self._meta, indent=2).encode(), self.file_mode)
        else:
            stored = {k: self._meta.get(k) for k in spec}
            if stored != spec:
                raise StoreError(
                    f"{self.root}: holds {stored}, the producer sends {spec}; write this run to another --out directory"
                )
        if allocate is not None:
            self._allocate = allocate
        self._size_writers()
        self._stop_toucher()  # between runs: the buffers it had left are made again as this run needs them
        if quantized != self._buffers_quantized:  # buffers of the other shape: every one is free between runs
            while not self._free.empty():
                self._free.get_nowait()
                self._buffers_made -= 1
            self._buffers_quantized = quantized
        while self._buffers_made > self.shard_buffers and not self._free.empty():  # fewer writers than before
            self._free.get_nowait()
            self._buffers_made -= 1
        self._run = _Run(
            run_id=run_id,
            geometry=geometry,
            rows_per_shard=max(1, self.shard_bytes // geometry.row_bytes),  # fp8 files hold as many rows
            fp8=self.fp8,
            quantized=quantized,
        )
        self._index.append([{"type": "run", "run_id": run_id, "time": time.time(), "meta": meta}])
        self._index.flush()  # once per run: the run is on record before its first rows
        self._prepare(quantized, ready)

    def _prepare(self, quantized: bool, ready: bool) -> None:
        """Make the shard buffers missing: allocated on this thread (pinned memory is pinned where the ring's copies
        are issued) and touched (a fresh page faults on its first write: never under the rows).

        ``ready`` (:meth:`begin_run`): return once all are touched, side by side on the writer threads, and the
        row checksums and the quantizer are compiled. Else return once the first is touched: the others are
        touched one after another on a thread of their own at the lowest CPU priority, each free for rows once
        touched, and the compiles run on the writer threads (shards written before the checksums' kernel is
        built use zlib, the same bits; a writer's first quantized shard waits for the quantizer). Waiting for
        all of it took seconds of a 2-core host's start-up before a producer could send a row.
        """
        run = self._require_run()
        fresh = [self._new_buffer(run) for _ in range(self.shard_buffers - self._buffers_made)]
        # Rows an fp8 store quantizes itself need its quantizer and row checksums, which its open left uncompiled.
        builds = (host_kernels, crc_kernel) if self.fp8 and not quantized else ()
        compiles = [self._pool.submit(build) for build in builds]
        if ready:
            for buffer in self._pool.map(touch, fresh):
                self._free.put(buffer)
            if not quantized:
                crc_kernel()
            for compiled in compiles:
                compiled.result()
            return
        if fresh:
            self._free.put(touch(fresh[0]))
        if fresh[1:]:
            with self._untouched_lock:
                self._untouched.extend(fresh[1:])
            self._toucher = threading.Thread(target=self._touch_untouched, name="hscapture-touch", daemon=True)
            self._toucher.start()

    def _touch_untouched(self) -> None:
        """Touch the untouched buffers one after another, each free for rows once touched, on this thread at the
        lowest priority (Linux gives a thread its own nice value): the rows' own work goes first."""
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._untouched_lock:
                if not self._untouched:
                    return
                buffer = self._untouched.pop(0)
            try:
                touch(buffer)
            finally:  # untouched if it failed: slower first writes, never a buffer lost
                self._free.put(buffer)

    def _stop_toucher(self) -> None:
        """Drop the buffers the toucher has not reached (counted as never made) and wait for the one in its hands."""
        with self._untouched_lock:
            self._buffers_made -= len(self._untouched)
            self._untouched.clear()
        if self._toucher is not None:
            self._toucher.join()
            self._toucher = None

    def _take_untouched(self) -> ShardBuffer | None:
        """A buffer the toucher has not reached yet, for rows that need one now."""
        with self._untouched_lock:
            return self._untouched.pop() if self._untouched else None

    def _sizes(self) -> tuple[int, int]:
        """Writer threads and shard buffers: as asked, else by how row planes go out now."""
        threads = self._threads_asked or default_writer_threads(self.direct.enabled)
        return threads, self._buffers_asked or threads + 2

    def _size_writers(self) -> None:
        """Size the writers for the run beginning (``direct.use`` may have changed how its row planes go out
        since the last run; between runs nothing is written)."""
        threads, self.shard_buffers = self._sizes()
        if threads != self.writer_threads:
            self._pool.shutdown(wait=False)  # nothing is written between runs; a compile still running finishes
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hscapture-writer")
            self.writer_threads = threads

    def end_run(self, reason: str, counters: dict[str, int]) -> None:
        """Write the open shard, wait for all writes, and close every request of the run.

        Requests that never got a finish are recorded as incomplete with ``reason``.

        Raises:
            StoreError: rows were reserved and never committed, or a write failed.
        """
        run = self._run
        if run is None:
            return
        self._seal_open()
        if self._waiting:
            raise StoreError(f"{self.root}: shards {sorted(self._waiting)} have rows reserved but never committed")
        for future in list(self._writing.values()):
            future.exception()
        for request_id, request in self._requests.items():
            if request.finished is None and request.run_id == run.run_id:
                request.end_reason = f"{reason} before the request finished"
                self._ended(request_id, request)
        self._commit_ready()
        if self._held:  # waiting for requests whose rows were never listed (a failed write): not any longer
            self._commit_ready(settle=True)
        if run.write_failed is not None:
            # Requests with rows in the shard not written are not recorded. Without a run_end, verify names them as
            # a stopped run's, and the next writer's recovery records them (not this one: the disk may be full).
            self._run = None
            raise StoreError(run.write_failed)
        self._index.append([{"type": "run_end", "run_id": run.run_id, "reason": reason, "counters": counters}])
        self._run = None

    # ------------------------------------------------------------------ rows

    def reserve(self, rows: int, wait: bool = True) -> Reservation | None:
        """Room for ``rows`` rows, in the open shard and new ones as needed.

        Args:
            rows: how many rows.
            wait: when every shard buffer is busy, wait for a writer thread to free one. With
                False, return None instead, so the caller can first commit rows it holds (a
                buffer whose rows are not all committed is never written, so never freed).

        Raises:
            StoreError: no run began.
        """
        run = self._require_run()
        if rows <= 0:
            raise ValueError(f"rows: {rows}; reserve at least one")
        room = 0 if self._shard is None else run.rows_per_shard - self._shard.reserved
        needed = -(-(rows - room) // run.rows_per_shard) if rows > room else 0
        if not wait and needed > self._free.qsize() + len(self._untouched) + self.shard_buffers - self._buffers_made:
            return None
        pieces: list[Rows] = []
        left = rows
        while left:
            shard = self._open_shard(run)
            count = min(left, run.rows_per_shard - shard.reserved)
            at, buffer = shard.reserved, shard.buffer
            planes, scales, nonfinite, crcs = ([a[at : at + count] for a in arrays] for arrays in buffer.arrays())
            pieces.append(Rows(planes, scales, nonfinite, crcs, count, shard, at))
            shard.reserved += count
            left -= count
            if shard.reserved == run.rows_per_shard:
                self._seal(shard)
        return Reservation(pieces, rows)

    def commit(
        self,
        reservation: Reservation,
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        positions: np.ndarray,
        token_ids: np.ndarray,
    ) -> None:
        """The reserved rows' bytes have landed; record whose they are.

        Args:
            reservation: as :meth:`reserve` returned it.
            request_ids: the requests owning the rows, in row order (a request may recur).
            request_rows: how many consecutive rows each of them owns.
            positions: ``[rows]`` int64 position of each row in its request.
            token_ids: ``[rows]`` int64 token id at that position.

        Raises:
            ValueError: the counts do not add up to the reservation's rows.
        """
        rows = reservation.rows
        if sum(request_rows) != rows or len(request_ids) != len(request_rows) or len(positions) != rows:
            raise ValueError(
                f"commit: {len(request_ids)} requests owning {sum(request_rows)} rows and {len(positions)} positions "
                f"for {rows} reserved rows"
            )
        owner = np.repeat(np.arange(len(request_ids)), request_rows) if len(request_ids) > 1 else None
        self._prefixes.add_rows(request_ids, request_rows, positions, token_ids)
        begin = 0
        for piece in reservation.pieces:
            shard, at, count = piece._shard, piece._start, piece.rows
            buffer = shard.buffer
            buffer.positions[at : at + count] = positions[begin : begin + count]
            buffer.token_ids[at : at + count] = token_ids[begin : begin + count]
            lookup = shard.request_lookup
            if owner is None:  # one request: the usual prefill chunk
                buffer.request_index[at : at + count] = lookup.setdefault(request_ids[0], len(lookup))
            else:  # owners run in order: the piece holds requests owner[begin] .. owner[end - 1]
                mine = owner[begin : begin + count]
                first, last = int(mine[0]), int(mine[-1])
                local = np.full(last - first + 1, -1, dtype=np.int32)
                for i in range(first, last + 1):
                    if request_rows[i]:
                        local[i - first] = lookup.setdefault(request_ids[i], len(lookup))
                buffer.request_index[at : at + count] = local[mine - first]
            self._track(request_ids, request_rows, positions, shard.shard_id, at, begin, begin + count)
            shard.committed += count
            self.rows_written += count
            if shard.sealed and shard.committed == shard.reserved:
                self._submit(self._waiting.pop(shard.shard_id))
            begin += count

    def finish_request(self, request_id: str, finish: Finish) -> None:
        """Close a request; its index line is written once its shards are durable."""
        run = self._require_run()
        request = self._requests.get(request_id) or self._new_request(request_id, run.run_id)
        request.finished = finish
        self._ended(request_id, request)
        self._commit_ready()

    def tick(self) -> None:
        """Housekeeping between batches: index finished writes, seal an open shard older than ``flush_s``."""
        shard = self._shard
        if shard is not None and shard.reserved and time.monotonic() - shard.opened > self.flush_s:
            self._seal_open()
        self._commit_ready()

    def close(self, reason: str = "consumer stopped") -> None:
        """End the run (if any), write everything out, release files and threads. Idempotent."""
        if self._lock.closed:
            return
        try:
            self.end_run(reason, {})
        finally:
            self._stop_toucher()
            self._pool.shutdown(wait=True)
            try:
                self._index.close()
            finally:
                self._lock.close()
                self._dir.close()

    # ------------------------------------------------------------------ internals

    def _require_run(self) -> _Run:
        if self._run is None:
            raise StoreError("store: data before any run began (begin_run first)")
        return self._run

    def _track(
        self,
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        positions: np.ndarray,
        shard_id: int,
        at: int,
        begin: int,
        end: int,
    ) -> None:
        """Record, per request, which shard rows it owns and which positions they are.

        Plain integer arithmetic per request: a decode step brings one row for each of many
        requests, and numpy calls per request would cost more than the rows themselves.
        """
        run_id = self._require_run().run_id
        offset = 0
        for request_id, count in zip(request_ids, request_rows):
            lo, hi = max(offset, begin), min(offset + count, end)
            offset += count
            if hi <= lo:
                if offset >= end:
                    break
                continue
            request = self._requests.get(request_id) or self._new_request(request_id, run_id)
            request.add(shard_id, at + lo - begin, positions[lo:hi])
            unlisted = self._unlisted.get(request_id)
            if unlisted is not None and shard_id not in unlisted:  # rows after its end: its line waits for them too
                unlisted.add(shard_id)
                self._waiting_on.setdefault(shard_id, set()).add(request_id)

    def _new_request(self, request_id: str, run_id: str) -> Request:
        self._arrivals += 1
        request = self._requests[request_id] = Request(run_id, order=self._arrivals)
        return request

    def _ended(self, request_id: str, request: Request) -> None:
        """``request`` finished (or its run ended): its line waits for the shards holding its rows."""
        unlisted = {span[0] for span in request.spans if span[0] not in self._indexed}
        self._unlisted[request_id] = unlisted
        for shard_id in unlisted:
            self._waiting_on.setdefault(shard_id, set()).add(request_id)
        if not unlisted:
            self._ready.append(request_id)

    def _open_shard(self, run: _Run) -> _Shard:
        if self._shard is None:
            self._shard = _Shard(self._next_shard, run.run_id, self._take_buffer(run))
            self._next_shard += 1
        return self._shard

    def _take_buffer(self, run: _Run) -> ShardBuffer:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        untouched = self._take_untouched()
        if untouched is not None:
            return untouched
        if self._buffers_made < self.shard_buffers or all(f.done() for f in self._writing.values()):
            # Past the limit only when no write could free one: the rest wait for this reservation's
            # commits (rows spanning more shards than there are buffers).
            return touch(self._new_buffer(run))
        return self._free.get()  # every buffer is being written: the disk sets the pace

    def _new_buffer(self, run: _Run) -> ShardBuffer:
        """A buffer for ``run``'s rows, its pages not touched yet."""
        self._buffers_made += 1
        geometry = run.geometry
        plane_row_bytes = geometry.hidden_size if run.quantized else geometry.plane_row_bytes  # codes: a byte each
        return new_buffer(
            len(geometry.tensor_names), run.rows_per_shard, plane_row_bytes, self._allocate, run.quantized
        )

    def _seal_open(self) -> None:
        if self._shard is not None:
            self._seal(self._shard)

    def _seal(self, shard: _Shard) -> None:
        """No more rows go into ``shard``; write it once all of its rows are committed."""
        shard.sealed = True
        if shard is self._shard:
            self._shard = None
        if shard.reserved == 0:
            self._free.put(shard.buffer)
            self._next_shard -= 1  # it was the newest id
        elif shard.committed == shard.reserved:
            self._submit(shard)
        else:
            self._waiting[shard.shard_id] = shard

    def _submit(self, shard: _Shard) -> None:
        run = self._require_run()
        geometry = run.geometry
        spec = ShardSpec(
            shard_id=shard.shard_id,
            run_id=shard.run_id,
            rows=shard.committed,
            names=geometry.tensor_names,
            dtype=geometry.dtype,
            hidden_size=geometry.hidden_size,
            fp8=run.fp8,
            request_ids=tuple(shard.request_lookup),
            writeback_bytes=self.writeback_bytes,
        )
        self._writing[shard.shard_id] = self._pool.submit(
            _write_and_free, self._dir, spec, shard.buffer, self._free, self.file_mode, self.direct
        )
        self._commit_ready()

    def _commit_ready(self, settle: bool = False) -> None:
        """List every shard whose write finished, then every request whose shards all are listed.

        ``settle``: a line whose donor may be a request still in flight is written without waiting for it (the run
        ended, and that request's rows were never listed)."""
        self._index.check()
        lines = []
        failed: tuple[int, BaseException] | None = None
        for shard_id, future in sorted(self._writing.items()):
            if not future.done():
                continue
            del self._writing[shard_id]
            error = future.exception()
            if error is not None:
                failed = failed or (shard_id, error)
                continue  # never listed, so neither is any request with rows in it
            lines.append(future.result())
            self._indexed.add(shard_id)
            for request_id in self._waiting_on.pop(shard_id, ()):
                unlisted = self._unlisted[request_id]
                unlisted.discard(shard_id)
                if not unlisted:
                    self._ready.append(request_id)
        if lines:  # listed even when another shard's write failed: shards already counted as listed
            rows, nbytes = sum(line["rows"] for line in lines), sum(line["bytes"] for line in lines)
            self._index.append(lines, barrier=True, on_durable=lambda: self._durable(rows, nbytes))
        ready = [request_id for request_id in self._ready if self._unlisted.get(request_id) == set()]
        self._ready.clear()  # a request with rows in a shard whose write failed never gets here
        for request_id in ready:
            del self._unlisted[request_id]
        ready.sort(key=lambda request_id: self._requests[request_id].order)
        done: list[dict[str, Any]] = []
        candidates = self._held + ready
        while candidates:  # again while a line written frees one waiting for its donor's
            held = []
            for request_id in candidates:
                request = self._requests[request_id]
                if request.line is None:
                    line = self._shared_line(request_id, request)
                    prefix = request.finished.prefix_token_ids if request.finished is not None else None
                    if "shared" not in line and not settle and self._prefixes.donor_in_flight(line, prefix):
                        held.append(request_id)
                        continue
                    request.line = line
                if self._prefixes.waiting(request.line):
                    held.append(request_id)
                    continue
                del self._requests[request_id]
                line = once(request.line, self._complete)
                needs = SELECTION_VERSION if "positions" in line else SHARED_VERSION if "shared" in line else 0
                if self._meta is not None and self._meta["version"] < needs:
                    self._set_version(needs)
                self._prefixes.record(line, request.finished.prefix_token_ids if request.finished else None)
                done.append(line)
            if len(held) == len(candidates):
                break
            candidates = held
        self._held = candidates
        self._index.append(done)
        self.requests_written += len(done)
        if failed is not None:
            shard_id, error = failed
            why = f"{self.root / shard_name(shard_id)}: write failed: {error}; {KEPT}"
            if self._run is not None:
                self._run.write_failed = self._run.write_failed or why
            raise StoreError(why) from error

    def _shared_line(self, request_id: str, request: Request) -> dict[str, Any]:
        """The request's line, its missing prefix taken by reference from a donor's rows where one holds it."""
        line = request_record(request_id, request)
        prefix = request.finished.prefix_token_ids if request.finished is not None else None
        shared = self._prefixes.references(line, prefix)
        return request_record(request_id, request, shared) if shared else line

    def _durable(self, rows: int, nbytes: int) -> None:
        """On the index thread, once shard lines are fsync'd."""
        self.rows_durable += rows
        self.bytes_durable += nbytes

    def _load_meta(self) -> dict[str, Any] | None:
        path = self._dir.file(META_FILE)
        text = self._dir.read(META_FILE)
        if text is None:
            return None
        try:
            found = json.loads(text)
        except ValueError:
            found = None  # read_meta says what is wrong
        if isinstance(found, dict) and (
            found.get("format") != STORE_FORMAT or found.get("version") not in READ_VERSIONS
        ):
            raise StoreError(
                f"{path}: format {found.get('format')!r} v{found.get('version')}, expected {STORE_FORMAT!r} "
                f"v{' or v'.join(map(str, READ_VERSIONS))}; write to another directory"
            )
        return read_meta(self._dir)

    def _repair_index(self) -> None:
        """Cut a torn last line (crash mid-append) so new lines start clean."""
        try:
            fd = open_own(self._dir.file(INDEX_FILE), os.O_RDWR, "store index", dir_fd=self._dir.fd)
        except FileNotFoundError:
            return
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                keep = os.pread(fd, size, 0).rfind(b"\n") + 1
                log.warning("%s: cutting a torn last line of %d bytes", self.root / INDEX_FILE, size - keep)
                os.ftruncate(fd, keep)
                os.fsync(fd)
        finally:
            os.close(fd)


def _pageable_bytes(nbytes: int) -> np.ndarray:
    """Pageable host memory (touched before rows go in)."""
    return np.empty(nbytes, dtype=np.uint8)


def _write_and_free(
    directory: StoreDir,
    spec: ShardSpec,
    buffer: ShardBuffer,
    free: queue.SimpleQueue[ShardBuffer],
    mode: int,
    direct: DirectIO,
) -> dict[str, Any]:
    """Runs on a writer thread: write the shard, then give its buffer back."""
    try:
        return write_shard(directory, spec, buffer, mode, direct)
    finally:
        free.put(buffer)
