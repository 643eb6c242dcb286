"""The on-disk store: safetensors shards plus an append-only JSONL index (see FORMAT.md).

The writer knows nothing of models: it receives chunks of rows (``[num_tensors, rows,
hidden]`` bytes plus per-row request, position and token id), packs them into shard
buffers, and hands full shards to writer threads. A shard becomes visible only after it
was written to a temp file, fsync'd and renamed, and only then does the index get its
``shard`` line; a request's line follows once every shard holding its rows is durable.
So a crash at any moment leaves an index that lists only complete shards and requests.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import queue
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import safetensors.torch
import torch

from hscapture import protocol
from hscapture.config import DTYPES, store_dtype_name
from hscapture.errors import StoreError
from hscapture.fp8 import FP8_NAME, quantize_rows, scale_name
from hscapture.ring import RingReader

log = logging.getLogger(__name__)

STORE_FORMAT = "hscapture-store"
STORE_VERSION = 1
INDEX_FILE = "index.jsonl"
META_FILE = "meta.json"
LOCK_FILE = ".lock"
#: What a failed write leaves, said in every such error.
_KEPT = "what the index lists is intact; free space (or fix the disk) and run again to continue"


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:06d}.safetensors"


def read_index(root: Path) -> list[dict[str, Any]]:
    """All complete lines of ``index.jsonl``; a torn last line (crash mid-append) is skipped."""
    path = root / INDEX_FILE
    if not path.exists():
        return []
    records = []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.endswith(b"\n"):
                log.warning("%s: ignoring torn last line %d", path, number)
                break
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise StoreError(f"{path}:{number}: not JSON ({exc}); the index is corrupt") from None
    return records


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def check_store_dtype(root: Path, requested: str | None) -> None:
    """Refuse to add rows stored as ``requested`` to an existing store that stores them otherwise.

    ``requested`` None (store as captured, or as the store already does) always fits.
    """
    path = root / META_FILE
    if requested is None or not path.exists():
        return
    meta = json.loads(path.read_text())
    held = meta.get("store_dtype", meta.get("dtype"))
    if held != requested:
        raise StoreError(
            f"{root}: stores rows as {held}, not {requested}; leave --store-dtype unset to continue "
            "it as it is, or write to another --out directory"
        )


def _lock_store(root: Path, timeout_s: float) -> IO[str]:
    """Take the store's writer lock (one writer per store), waiting up to ``timeout_s``."""
    handle = (root / LOCK_FILE).open("a+")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.seek(0)
                owner = handle.read().strip() or "another process"
                handle.close()
                raise StoreError(f"{root}: being written by {owner}; stop it or write to another directory") from None
            time.sleep(0.1)
            continue
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        return handle


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _ShardBuffer:
    """Host buffers for one shard being filled: one ``[capacity, row]`` byte array per tensor."""

    tensors: list[np.ndarray]
    positions: np.ndarray
    token_ids: np.ndarray
    request_index: np.ndarray


@dataclass
class _OpenShard:
    shard_id: int
    run_id: str
    buffer: _ShardBuffer
    rows: int = 0
    request_lookup: dict[str, int] = field(default_factory=dict)
    opened: float = field(default_factory=time.monotonic)


@dataclass
class _Request:
    run_id: str
    spans: list[list[int]] = field(default_factory=list)  # [shard_id, first row, rows]
    rows: int = 0
    runs: list[list[int]] = field(default_factory=list)  # position runs [start, end)
    finished: protocol.RequestFinished | None = None
    end_reason: str = ""


@dataclass
class _RunSpec:
    run_id: str
    tensor_names: list[str]
    dtype: torch.dtype
    hidden_size: int
    row_bytes: int
    rows_per_shard: int
    #: Quantize rows to fp8 with a per-row scale when writing the shard.
    fp8: bool = False


class StoreWriter:
    """Writes chunks into shards and the index. One thread calls it (the consumer loop).

    Args:
        root: the store directory (created; an existing store is appended to).
        shard_bytes: target bytes of one shard.
        writer_threads: threads writing shards in parallel.
        flush_s: a shard open longer than this is written even if not full, so streaming
            capture of a quiet server still reaches disk.
        lock_timeout_s: how long to wait for another writer of the same store to finish.
        store_dtype: ``fp8`` (or ``float8_e4m3fn``) quantizes rows on the writer threads; None
            stores them as captured, or as an existing store already does.

    Raises:
        StoreError: another process keeps writing this store, or it holds another format.
    """

    def __init__(
        self,
        root: Path,
        shard_bytes: int,
        writer_threads: int = 2,
        flush_s: float = 30.0,
        lock_timeout_s: float = 30.0,
        store_dtype: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.store_dtype = store_dtype_name(store_dtype)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = _lock_store(self.root, lock_timeout_s)
        try:
            check_store_dtype(self.root, self.store_dtype)
            self._open_existing(shard_bytes, writer_threads, flush_s)
        except BaseException:
            self._lock.close()
            raise

    def _open_existing(self, shard_bytes: int, writer_threads: int, flush_s: float) -> None:
        """Everything after taking the lock: repair and read the index, start the writers."""
        self.shard_bytes = shard_bytes
        self.flush_s = flush_s
        self._repair_index()
        records = read_index(self.root)
        self._indexed = {r["id"] for r in records if r["type"] == "shard"}
        self._next_shard = 1 + max(self._indexed, default=-1)
        for stale in self.root.glob("*.tmp"):
            stale.unlink()
        self._meta = self._load_meta()
        self._index = (self.root / INDEX_FILE).open("ab")
        from hscapture.recovery import recover_open_runs  # recovery builds on this module

        for line in recover_open_runs(self.root, records):
            self._append(line)
        self._pool = ThreadPoolExecutor(writer_threads, thread_name_prefix="hscapture-writer")
        self._buffers: queue.Queue[_ShardBuffer] = queue.Queue()
        self._buffers_made = 0
        self._max_buffers = writer_threads + 1
        self._pending: dict[int, Any] = {}  # shard id -> future
        self._run: _RunSpec | None = None
        self._shard: _OpenShard | None = None
        self._requests: dict[str, _Request] = {}
        self.rows_written = 0
        self.requests_written = 0
        #: Rows and bytes of the shards indexed so far (durable), for live metrics.
        self.rows_durable = 0
        self.bytes_durable = 0
        #: Host memory for shard buffers; the CUDA consumer swaps in pinned memory.
        self.allocate: Callable[[int], np.ndarray] = _pageable
        #: Called before a shard buffer is handed to a writer: waits for copies still in flight.
        self.barrier: Callable[[], None] = _nothing

    # ------------------------------------------------------------------ runs

    def begin_run(self, layout: protocol.Layout) -> None:
        """Start writing rows of a producer run; the store's tensors must match earlier runs."""
        if self._run is not None:
            self.end_run("producer restarted", {})
        if layout.dtype not in DTYPES:
            raise StoreError(f"Layout.dtype: {layout.dtype!r} is not a storable dtype ({sorted(DTYPES)})")
        if len(layout.tensor_names) != len(layout.tensor_descriptions) or not layout.tensor_names:
            raise StoreError(f"Layout.tensor_names: {layout.tensor_names} do not match their descriptions")
        tensors = [{"name": n, "description": d} for n, d in zip(layout.tensor_names, layout.tensor_descriptions)]
        spec = {"dtype": layout.dtype, "hidden_size": layout.hidden_size, "tensors": tensors}
        if self._meta is None:
            stored_as = {"store_dtype": self.store_dtype} if self.store_dtype is not None else {}
            self._meta = {"format": STORE_FORMAT, "version": STORE_VERSION, **spec, **stored_as}
            write_atomic(self.root / META_FILE, json.dumps(self._meta, indent=2).encode())
        else:
            stored = {k: self._meta.get(k) for k in spec}
            if stored != spec:
                raise StoreError(
                    f"{self.root}: holds {stored}, the producer sends {spec}; write this run to another --out directory"
                )
        dtype = DTYPES[layout.dtype]
        row_bytes = len(tensors) * layout.hidden_size * dtype.itemsize
        self._run = _RunSpec(
            run_id=layout.run_id,
            tensor_names=list(layout.tensor_names),
            dtype=dtype,
            hidden_size=layout.hidden_size,
            row_bytes=row_bytes,
            rows_per_shard=max(1, self.shard_bytes // row_bytes),  # fp8 files hold as many rows, in half the bytes
            fp8=self._meta.get("store_dtype") == FP8_NAME,
        )
        self._append({"type": "run", "run_id": layout.run_id, "time": time.time(), "meta": layout.meta})
        if self._buffers_made == 0:  # allocate (pin) the first shard buffer now, not under the first chunk
            self._buffers_made += 1
            self._buffers.put(_new_buffer(self._run, self.allocate))

    def end_run(self, reason: str, counters: dict[str, int]) -> None:
        """Write the open shard, wait for all writes, and close every request of the run.

        Requests that never got a finish event are recorded as incomplete with ``reason``.
        """
        run = self._run
        if run is None:
            return
        self._flush_shard()
        self._wait_writes()
        for request in self._requests.values():
            if request.finished is None and request.run_id == run.run_id:
                request.end_reason = f"{reason} before the request finished"
        self._commit_ready()
        self._append({"type": "run_end", "run_id": run.run_id, "reason": reason, "counters": counters})
        self._run = None

    # ------------------------------------------------------------------ data

    def add_chunk(self, chunk: protocol.Chunk, source: RingReader | np.ndarray) -> None:
        """Copy a chunk's rows into shard buffers.

        Args:
            chunk: the announcement; the slot holds ``[tensors, row_stride or rows, hidden]``.
            source: the ring reader to copy from (at ``chunk.offset``; possibly asynchronous,
                see :attr:`barrier`), or the chunk's bytes themselves as a uint8 array.
        """
        run = self._require_run()
        rows = chunk.rows
        positions = protocol.unpack_rows(chunk.positions, rows, "positions")
        token_ids = protocol.unpack_rows(chunk.token_ids, rows, "token_ids")
        plane_row = run.row_bytes // len(run.tensor_names)
        plane_bytes = (chunk.row_stride or rows) * plane_row
        if isinstance(source, np.ndarray):
            data = source

            def copy(offset: int, dst: np.ndarray) -> None:
                dst[:] = data[offset - chunk.offset : offset - chunk.offset + dst.nbytes]
        else:
            copy = source.copy_into
        owner = np.repeat(np.arange(len(chunk.request_ids)), chunk.request_rows)
        begin = 0
        while begin < rows:
            shard = self._open_shard()
            count = min(rows - begin, run.rows_per_shard - shard.rows)
            at, end = shard.rows, shard.rows + count
            buffer = shard.buffer
            for plane, target in enumerate(buffer.tensors):
                copy(chunk.offset + plane * plane_bytes + begin * plane_row, target[at:end].reshape(-1))
            buffer.positions[at:end] = positions[begin : begin + count]
            buffer.token_ids[at:end] = token_ids[begin : begin + count]
            mine = owner[begin : begin + count]
            local = np.full(len(chunk.request_ids), -1, dtype=np.int32)
            for i in np.unique(mine).tolist():
                local[i] = shard.request_lookup.setdefault(chunk.request_ids[i], len(shard.request_lookup))
            buffer.request_index[at:end] = local[mine]
            self._track(chunk, positions, shard.shard_id, at, begin, begin + count)
            shard.rows = end
            self.rows_written += count
            if shard.rows == run.rows_per_shard:
                self._flush_shard()
            begin += count

    def finish_request(self, message: protocol.RequestFinished) -> None:
        """Close a request; its index line is written once its shards are durable."""
        run = self._require_run()
        request = self._requests.setdefault(message.request_id, _Request(run.run_id))
        request.finished = message
        self._commit_ready()

    def tick(self) -> None:
        """Housekeeping between messages: collect finished writes, flush an old open shard."""
        shard = self._shard
        if shard is not None and shard.rows and time.monotonic() - shard.opened > self.flush_s:
            self._flush_shard()
        self._commit_ready()

    def close(self, reason: str = "consumer stopped") -> None:
        """End the run (if any) and release files and threads. Idempotent."""
        if self._index.closed:
            return
        try:
            self.end_run(reason, {})
        finally:
            self._pool.shutdown(wait=True)
            self._index.close()
            self._lock.close()

    # ------------------------------------------------------------------ internals

    def _require_run(self) -> _RunSpec:
        if self._run is None:
            raise StoreError("store: data before any run began (no Layout received)")
        return self._run

    def _track(
        self, chunk: protocol.Chunk, positions: np.ndarray, shard_id: int, at: int, begin: int, end: int
    ) -> None:
        """Record, per request, which shard rows it owns and which positions they are.

        Plain integer arithmetic per request: a decode step brings one row for each of many
        requests, and numpy calls per request would cost more than the rows themselves.
        """
        run = self._require_run()
        offset = 0
        for request_id, count in zip(chunk.request_ids, chunk.request_rows):
            lo, hi = max(offset, begin), min(offset + count, end)
            offset += count
            if hi <= lo:
                if offset >= end:
                    break
                continue
            request = self._requests.get(request_id)
            if request is None:
                request = self._requests[request_id] = _Request(run.run_id)
            row, spans = at + lo - begin, request.spans
            if spans and spans[-1][0] == shard_id and spans[-1][1] + spans[-1][2] == row:
                spans[-1][2] += hi - lo
            else:
                spans.append([shard_id, row, hi - lo])
            request.rows += hi - lo
            _add_runs(request.runs, positions[lo:hi])

    def _open_shard(self) -> _OpenShard:
        if self._shard is None:
            run = self._require_run()
            self._shard = _OpenShard(self._next_shard, run.run_id, self._take_buffer(run))
            self._next_shard += 1
        return self._shard

    def _take_buffer(self, run: _RunSpec) -> _ShardBuffer:
        try:
            buffer = self._buffers.get_nowait()
        except queue.Empty:
            if self._buffers_made < self._max_buffers:
                self._buffers_made += 1
                return _new_buffer(run, self.allocate)
            buffer = self._buffers.get()  # all buffers are being written: disk backpressure
        return buffer  # every run of a store has the same geometry (checked in begin_run)

    def _flush_shard(self) -> None:
        shard, self._shard = self._shard, None
        if shard is None:
            return
        if shard.rows == 0:
            self._buffers.put(shard.buffer)
            self._next_shard -= 1
            return
        run = self._require_run()
        self.barrier()  # copies into this buffer may still be in flight (CUDA ring)
        self._pending[shard.shard_id] = self._pool.submit(_write_shard, self.root, shard, run, self._buffers)
        self._commit_ready()

    def _wait_writes(self) -> None:
        for future in list(self._pending.values()):
            future.exception()
        self._commit_ready()

    def _commit_ready(self) -> None:
        """Index every shard whose write finished, then every request whose shards all are."""
        for shard_id, future in sorted(self._pending.items()):
            if not future.done():
                continue
            del self._pending[shard_id]
            error = future.exception()
            if error is not None:
                raise StoreError(f"{self.root / shard_name(shard_id)}: write failed: {error}; {_KEPT}") from error
            line = future.result()
            self._append(line)
            self._indexed.add(shard_id)
            self.rows_durable += line["rows"]
            self.bytes_durable += line["bytes"]
        for request_id, request in list(self._requests.items()):
            if request.finished is None and not request.end_reason:
                continue
            if not all(s[0] in self._indexed for s in request.spans):
                continue  # a shard still being written (or whose write failed: then never)
            del self._requests[request_id]
            self._append(_request_record(request_id, request))
            self.requests_written += 1

    def _append(self, record: dict[str, Any]) -> None:
        try:
            self._index.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
            self._index.flush()
            os.fsync(self._index.fileno())
        except OSError as exc:  # a torn line is cut by the next writer; everything before it stands
            raise StoreError(f"{self.root / INDEX_FILE}: append failed ({exc.strerror}); {_KEPT}") from None

    def _load_meta(self) -> dict[str, Any] | None:
        path = self.root / META_FILE
        if not path.exists():
            return None
        meta = json.loads(path.read_text())
        if meta.get("format") != STORE_FORMAT or meta.get("version") != STORE_VERSION:
            raise StoreError(
                f"{path}: format {meta.get('format')!r} v{meta.get('version')}, expected {STORE_FORMAT!r} "
                f"v{STORE_VERSION}; write to another directory"
            )
        return meta

    def _repair_index(self) -> None:
        """Cut a torn last line (crash mid-append) so new lines start clean."""
        path = self.root / INDEX_FILE
        if not path.exists():
            return
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            log.warning("%s: cutting a torn last line of %d bytes", path, len(data) - keep)
            with path.open("r+b") as handle:
                handle.truncate(keep)
                os.fsync(handle.fileno())


def _pageable(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def _nothing() -> None:
    return None


def _new_buffer(run: _RunSpec, allocate: Callable[[int], np.ndarray]) -> _ShardBuffer:
    width = run.row_bytes // len(run.tensor_names)
    capacity = run.rows_per_shard
    return _ShardBuffer(
        tensors=[allocate(capacity * width).reshape(capacity, width) for _ in run.tensor_names],
        positions=np.empty(capacity, dtype=np.int64),
        token_ids=np.empty(capacity, dtype=np.int64),
        request_index=np.empty(capacity, dtype=np.int32),
    )


def _write_shard(root: Path, shard: _OpenShard, run: _RunSpec, free: queue.Queue[_ShardBuffer]) -> dict[str, Any]:
    """Runs on a writer thread: serialize, write to a temp file, fsync, rename; free the buffer."""
    try:
        return _write_shard_file(root, shard, run)
    finally:
        free.put(shard.buffer)


def _write_shard_file(root: Path, shard: _OpenShard, run: _RunSpec) -> dict[str, Any]:
    n, buffer = shard.rows, shard.buffer
    tensors = {
        name: torch.from_numpy(plane[:n]).view(run.dtype) for name, plane in zip(run.tensor_names, buffer.tensors)
    }
    nonfinite: dict[str, int] = {}
    if run.fp8:
        for name in run.tensor_names:
            tensors[name], tensors[scale_name(name)], count = quantize_rows(tensors[name])
            if count:
                nonfinite[name] = count
        if nonfinite:
            log.warning("shard %d: non-finite values stored as fp8 NaN: %s", shard.shard_id, nonfinite)
    tensors["positions"] = torch.from_numpy(buffer.positions[:n])
    tensors["token_ids"] = torch.from_numpy(buffer.token_ids[:n])
    tensors["request_index"] = torch.from_numpy(buffer.request_index[:n])
    metadata = {
        "format": "hscapture-shard",
        "version": str(STORE_VERSION),
        "run_id": shard.run_id,
        "request_ids": json.dumps(list(shard.request_lookup)),
    }
    data = safetensors.torch.save(tensors, metadata=metadata)
    crc32, tensor_crc32 = shard_checksums(data)  # of the bytes about to be written, while they are in memory
    path = root / shard_name(shard.shard_id)
    write_atomic(path, data)
    line = {
        "type": "shard",
        "id": shard.shard_id,
        "file": path.name,
        "rows": n,
        "bytes": len(data),
        "crc32": crc32,
        "tensor_crc32": tensor_crc32,
    }
    return {**line, "nonfinite": nonfinite} if nonfinite else line


def shard_checksums(data: bytes) -> tuple[str, dict[str, str]]:
    """CRC-32 of a serialized shard and of each tensor's data bytes, as 8 lowercase hex digits.

    One pass over ``data``: each tensor's CRC is computed on its own slice (a memoryview, no
    copy) and folded into the whole-file CRC with :func:`crc32_combine`; the header and any
    bytes between tensors are fed to the whole-file CRC directly. Tensors are listed in file order.
    """
    view = memoryview(data)
    header_len = int.from_bytes(view[:8], "little")
    header = json.loads(bytes(view[8 : 8 + header_len]))
    base = 8 + header_len
    entries = sorted(
        ((name, entry["data_offsets"]) for name, entry in header.items() if name != "__metadata__"),
        key=lambda item: item[1],
    )
    whole, at = zlib.crc32(view[:base]), base
    tensor_crc32 = {}
    for name, (begin, end) in entries:
        begin, end = base + begin, base + end
        if begin > at:
            whole = zlib.crc32(view[at:begin], whole)
        crc = zlib.crc32(view[begin:end])
        tensor_crc32[name] = f"{crc:08x}"
        whole, at = crc32_combine(whole, crc, end - begin), end
    if at < len(view):
        whole = zlib.crc32(view[at:], whole)
    return f"{whole:08x}", tensor_crc32


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and ``len2 = len(b)``.

    zlib's ``crc32_combine`` (not exposed by Python): advance ``crc1`` over ``len2`` zero bytes
    with precomputed GF(2) operators, one per set bit of ``len2``, then xor ``crc2``. About 50 us.
    """
    power = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_crc32_zeros_operator(power), crc1)
        len2 >>= 1
        power += 1
    return crc1 ^ crc2


@functools.cache
def _crc32_zeros_operator(power: int) -> tuple[int, ...]:
    """The 32x32 GF(2) matrix (one int per column) that advances a CRC-32 over ``2**power`` zero bytes."""
    if power == 0:
        matrix: tuple[int, ...] = (0xEDB88320, *(1 << k for k in range(31)))  # one zero bit
        for _ in range(3):  # 2, 4, 8 bits
            matrix = _gf2_square(matrix)
        return matrix
    return _gf2_square(_crc32_zeros_operator(power - 1))


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    total = 0
    for column in matrix:
        if not vector:
            break
        if vector & 1:
            total ^= column
        vector >>= 1
    return total


def _gf2_square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_gf2_times(matrix, column) for column in matrix)


def _add_runs(runs: list[list[int]], positions: np.ndarray) -> None:
    """Append ``positions`` to a list of ``[start, end)`` runs, merging consecutive ones."""
    if positions.size == 1:  # the decode case, without numpy
        start = int(positions[0])
        if runs and runs[-1][1] == start:
            runs[-1][1] = start + 1
        else:
            runs.append([start, start + 1])
        return
    if positions.size == 0:
        return
    cuts = np.flatnonzero(np.diff(positions) != 1) + 1
    for piece in np.split(positions, cuts):
        start, end = int(piece[0]), int(piece[-1]) + 1
        if runs and runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end])


def _request_record(request_id: str, request: _Request) -> dict[str, Any]:
    """The index line of a request: where its rows are and whether it is complete, and why not."""
    finished = request.finished
    expected = finished.num_tokens if finished is not None and finished.num_tokens else None
    spans, runs, rows, surplus = _past_end_trimmed(request, expected)
    merged = _merge(runs)
    covered = sum(end - start for start, end in merged)
    upper = expected if expected is not None else (merged[-1][1] if merged else 0)
    missing = _complement(merged, upper)
    problems = []
    if finished is None:
        problems.append(request.end_reason or "no finish event")
    elif finished.reason != "finished":
        problems.append(finished.reason)
    dropped = finished.dropped_rows if finished is not None else 0
    if dropped:
        problems.append(f"producer dropped {dropped} rows")
    if missing:
        problems.append(f"{sum(e - s for s, e in missing)} positions missing")
    if covered != rows:
        problems.append(f"{rows - covered} duplicate rows")
    if expected is not None and merged and merged[-1][1] > expected:
        problems.append(f"positions beyond num_tokens={expected}")
    return {
        "type": "request",
        "id": request_id,
        "run_id": request.run_id,
        "status": "incomplete" if problems else "complete",
        "reason": "; ".join(problems),
        "rows": rows,
        "num_tokens": expected if expected is not None else covered,
        "dropped_rows": dropped,
        "missing": missing,
        "spans": spans,
        **({"surplus_rows": surplus} if surplus else {}),
        "loss_mask": [list(r) for r in finished.loss_mask] if finished is not None else [],
        "meta": finished.meta if finished is not None else {},
    }


def _past_end_trimmed(request: _Request, expected: int | None) -> tuple[list[list[int]], list[list[int]], int, int]:
    """Spans, position runs and rows without trailing rows at positions ``>= num_tokens``.

    An engine that schedules ahead (SGLang's overlap scheduler) runs one more step for a request
    before it learns that the request finished; that step's row arrives last and lies past the
    end. Only such a tail is cut (its shard bytes stay, unreferenced); anything else past the end
    stays and makes the request incomplete.
    """
    spans, runs, rows = request.spans, request.runs, request.rows
    if expected is None or not runs or runs[-1][1] <= expected or not spans:
        return spans, runs, rows, 0
    start, end = runs[-1]
    surplus = end - max(start, expected)
    if spans[-1][2] < surplus:
        return spans, runs, rows, 0
    runs = [*runs[:-1], [start, expected]] if start < expected else runs[:-1]
    last = spans[-1]
    spans = [*spans[:-1], [last[0], last[1], last[2] - surplus]] if last[2] > surplus else spans[:-1]
    return spans, runs, rows - surplus, surplus


def _merge(runs: list[list[int]]) -> list[list[int]]:
    merged: list[list[int]] = []
    for start, end in sorted(runs):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _complement(merged: list[list[int]], upper: int) -> list[list[int]]:
    gaps, cursor = [], 0
    for start, end in merged:
        if start > cursor:
            gaps.append([cursor, min(start, upper)])
        cursor = max(cursor, end)
    if cursor < upper:
        gaps.append([cursor, upper])
    return [g for g in gaps if g[1] > g[0]]
