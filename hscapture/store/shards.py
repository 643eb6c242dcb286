"""Shard buffers, and writing one shard file straight from its buffer (on a writer thread).

A shard buffer holds ``capacity`` rows: one ``[capacity, hidden * itemsize]`` byte plane per
captured tensor (pinned memory when the consumer drains a CUDA ring) and the rows' positions, token
ids and request indices. :func:`write_shard` writes the safetensors header, then every tensor from
the buffer in blocks of :data:`BLOCK_BYTES` (:data:`DIRECT_BLOCK_BYTES` for planes written with
O_DIRECT), each block checksummed just before it is written: the captured tensors row by row (the
``row_crc32`` table a reader checks the rows it serves against; each tensor's CRC follows from its
rows'), the rest whole. Nothing builds the file in memory. Every :data:`WRITEBACK_BYTES` written
through the page cache, the kernel is asked to start writing them to the disk, so the disk works
while the rest of the shard is written and the closing fsync waits for the tail only (left to
itself, the kernel would write nothing until that fsync).

The captured tensors' planes go to the disk with ``O_DIRECT`` where the filesystem takes it (see
:class:`DirectIO`): straight from the shard buffer, no copy into the page cache, so the CPU time
that copy and the kernel's writeback took is left to the rows (on the 2-core CPU host, where fp8
stores were CPU-bound). For that the buffer's planes start at page boundaries, the header is
padded with spaces (safetensors' trailing whitespace) so the first plane starts at one in the
file, and each plane is written in whole pages; the header, the small tensors and each plane's
unaligned ends go through the page cache. Pages whose rows do not lie in memory where the file
wants them (a later plane when a row is no multiple of a page, codes quantized into a scratch)
go through a page-aligned scratch of the thread's. The closing fsync makes both durable, as before.

In an fp8 store rows arrive either as captured (each block is quantized into a scratch first;
the scales and the row table, known only when their tensors are done, are written at their
place afterwards) or already quantized (the consumer quantizes a GPU ring's rows on the GPU, a
host ring's where they lie): then a
buffer plane holds ``[capacity, hidden]`` codes, and the buffer each row's scale and count of
non-finite values, and the shard is written as it stands.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hscapture.config import torch_dtype
from hscapture.fp8_kernel import FP8_NAME, scale_name
from hscapture.ownership import create_private, temp_sibling
from hscapture.store.checksum import combine, combine_columns, row_crcs
from hscapture.store.directory import PRIVATE_FILE_MODE, StoreDir
from hscapture.store.format import (
    ITEM_BYTES,
    ROW_CRC,
    ROW_FIELDS,
    SHARD_FORMAT,
    STORE_VERSION,
    shard_header,
    shard_name,
)

log = logging.getLogger(__name__)

#: Bytes checksummed and written per call: large enough for the disk, small enough for the cache.
BLOCK_BYTES = 2 << 20
#: Default bytes written between requests to start writeback (0: leave it all to the fsync).
WRITEBACK_BYTES = 16 << 20
#: What O_DIRECT wants aligned: file offsets, lengths and memory addresses (a page; covers 512-byte
#: and 4 KiB sectors).
DIRECT_ALIGN = 4096
#: Bytes per O_DIRECT write: each waits for the disk, so larger blocks keep it busier (1 GiB from one
#: thread on the CPU host: 0.42-0.50 s in 2 MiB writes, 0.32-0.41 s in 8 MiB ones).
DIRECT_BLOCK_BYTES = 8 << 20
#: Shards whose captured planes hold fewer bytes are written through the page cache, header unpadded.
DIRECT_MIN_BYTES = 1 << 20
#: safetensors dtype codes of what shards hold, by dtype name.
DTYPE_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", FP8_NAME: "F8_E4M3"}


@dataclass
class ShardBuffer:
    """Host memory for one shard being filled."""

    #: One ``[capacity, hidden * itemsize]`` uint8 array per captured tensor (``[capacity, hidden]``
    #: fp8 codes when rows arrive quantized).
    planes: list[np.ndarray]
    positions: np.ndarray
    token_ids: np.ndarray
    request_index: np.ndarray
    #: Rows that arrive quantized only: per tensor, each row's float32 scale, int32 count of
    #: non-finite values and CRC-32 of its codes (uint32 bits in an int32; empty otherwise).
    scales: list[np.ndarray] = field(default_factory=list)
    nonfinite: list[np.ndarray] = field(default_factory=list)
    row_crcs: list[np.ndarray] = field(default_factory=list)

    @property
    def quantized(self) -> bool:
        return bool(self.scales)

    def arrays(self) -> tuple[list[np.ndarray], ...]:
        """What a caller copies rows into: the planes, and for quantized rows the scales, counts and CRCs."""
        return self.planes, self.scales, self.nonfinite, self.row_crcs


def new_buffer(
    tensors: int, capacity: int, plane_row_bytes: int, allocate: Callable[[int], np.ndarray], quantized: bool = False
) -> ShardBuffer:
    """A shard buffer of ``capacity`` rows; ``allocate(nbytes)`` gives the uint8 memory rows are copied into.

    Its pages are not written yet: :func:`touch` it before rows go in.

    With ``quantized``, ``plane_row_bytes`` is the hidden size (one byte per code) and the buffer
    also holds each row's scale, non-finite count and CRC-32, per tensor.
    """
    side = allocate(3 * tensors * capacity * 4).reshape(3, tensors, capacity * 4) if quantized else None
    # The planes in one allocation, each starting a page (O_DIRECT writes from there), evenly spaced: one 2D
    # copy out of a CUDA ring fills a slot's rows of every tensor, and one allocation pins them all.
    plane_bytes = capacity * plane_row_bytes
    stride = -(-plane_bytes // DIRECT_ALIGN) * DIRECT_ALIGN
    arena = page_aligned(allocate, stride * tensors)
    return ShardBuffer(
        planes=[
            arena[t * stride : t * stride + plane_bytes].reshape(capacity, plane_row_bytes) for t in range(tensors)
        ],
        positions=np.empty(capacity, dtype=np.int64),
        token_ids=np.empty(capacity, dtype=np.int64),
        request_index=np.empty(capacity, dtype=np.int32),
        scales=[] if side is None else [plane.view(np.float32) for plane in side[0]],
        nonfinite=[] if side is None else [plane.view(np.int32) for plane in side[1]],
        row_crcs=[] if side is None else [plane.view(np.int32) for plane in side[2]],
    )


def touch(buffer: ShardBuffer) -> ShardBuffer:
    """Write every page rows go into once; returns ``buffer``.

    A fresh page faults on its first write, which must not happen under the rows (on the CPU
    host's VM, first writes to fresh memory ran at 0.46 GB/s, the copy out of a host ring into
    touched memory at 20 GB/s). numpy's fill lets go of the GIL: buffers are touched on several
    threads at once.
    """
    for array in (*buffer.planes, *buffer.scales, *buffer.nonfinite, *buffer.row_crcs):
        array.fill(0)
    return buffer


def page_aligned(allocate: Callable[[int], np.ndarray], nbytes: int) -> np.ndarray:
    """``nbytes`` of ``allocate``'s memory starting at a multiple of :data:`DIRECT_ALIGN` (what O_DIRECT
    writes from; glibc's large mallocs start 16 bytes past a page)."""
    array = allocate(nbytes + DIRECT_ALIGN)
    skip = -array.ctypes.data % DIRECT_ALIGN
    return array[skip : skip + nbytes]


class DirectIO:
    """Whether a store's writer threads write row planes with ``O_DIRECT``, and the bytes written each way.

    One per store writer, shared by its threads. The first refusal (EINVAL: a filesystem without
    O_DIRECT, e.g. ramfs, tmpfs before Linux 6.6, some network filesystems) turns it off for the
    store, said once in the log; the refused bytes are written through the page cache.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and hasattr(os, "O_DIRECT")
        self._allowed = self.enabled
        #: Bytes written with O_DIRECT, and through the page cache (headers, small tensors, plane ends).
        self.direct_bytes = 0
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    def use(self, on: bool) -> None:
        """Write the shards begun from now on with O_DIRECT or not (never where it was off or refused)."""
        with self._lock:
            self.enabled = on and self._allowed

    def refused(self, path: Path, exc: OSError) -> None:
        with self._lock:
            self._allowed = False
            if self.enabled:
                self.enabled = False
                log.info("%s: O_DIRECT refused (%s); shards are written through the page cache", path, exc.strerror)

    def count(self, direct: int, cached: int) -> None:
        with self._lock:
            self.direct_bytes += direct
            self.cached_bytes += cached

    def bounce(self) -> np.ndarray:
        """This thread's page-aligned scratch of :data:`DIRECT_BLOCK_BYTES`, for rows that do not lie
        where the file wants them in memory (made and touched once per thread)."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = page_aligned(lambda n: np.zeros(n, dtype=np.uint8), DIRECT_BLOCK_BYTES)
        return scratch


@dataclass(frozen=True)
class ShardSpec:
    """What one shard file holds: its first ``rows`` buffer rows of tensors ``names`` in ``dtype`` (its name)."""

    shard_id: int
    run_id: str
    rows: int
    names: tuple[str, ...]
    dtype: str
    hidden_size: int
    #: Store the rows as fp8 codes with one float32 scale per row.
    fp8: bool
    #: The ``request_index`` table, in order.
    request_ids: tuple[str, ...]
    #: Bytes written between requests to start writeback (0: none before the fsync).
    writeback_bytes: int = WRITEBACK_BYTES


def write_shard(
    directory: StoreDir,
    spec: ShardSpec,
    buffer: ShardBuffer,
    mode: int = PRIVATE_FILE_MODE,
    direct: DirectIO | None = None,
) -> dict[str, Any]:
    """Write a shard to a temp file (created with ``mode``) in the store ``directory``, fsync it, rename it,
    fsync the directory; returns its index line. With ``direct`` (and it enabled) the row planes are written
    with O_DIRECT.

    Raises:
        OSError: the write failed (the temp file is removed, nothing is renamed).
    """
    n = spec.rows
    fields = {
        "positions": buffer.positions[:n],
        "token_ids": buffer.token_ids[:n],
        "request_index": buffer.request_index[:n],
    }
    stored = DTYPE_CODES[FP8_NAME if spec.fp8 else spec.dtype]
    tensors = [(name, code, (n,)) for name, code in ROW_FIELDS.items()]
    tensors += [(name, stored, (n, spec.hidden_size)) for name in spec.names]
    tensors += [(scale_name(name), "F32", (n,)) for name in spec.names] if spec.fp8 else []
    tensors.append((ROW_CRC, "U32", (n, len(spec.names))))
    metadata = {
        "format": SHARD_FORMAT,
        "version": str(STORE_VERSION),
        "run_id": spec.run_id,
        "request_ids": json.dumps(list(spec.request_ids)),
    }
    if direct is not None and (not direct.enabled or n * spec.hidden_size * ITEM_BYTES[stored] < DIRECT_MIN_BYTES):
        direct = None  # nothing to gain on small planes: no padding, no O_DIRECT
    # The planes share a dtype, so they follow each other by name: the first one starts a page.
    head, order = shard_header(tensors, metadata, None if direct is None else (min(spec.names), DIRECT_ALIGN))
    layout = [tensors[i] for i in order]
    sizes = {name: int(np.prod(shape)) * ITEM_BYTES[code] for name, code, shape in layout}
    offsets, at = {}, len(head)
    for name, _, _ in layout:
        offsets[name], at = at, at + sizes[name]
    path = directory.file(shard_name(spec.shard_id))
    tmp = temp_sibling(path)
    fd = create_private(tmp, os.O_WRONLY, mode, directory.fd)
    try:
        out = _Output(fd, spec.writeback_bytes, direct, tmp)
        crcs = {"": out.write(0, _bytes(head))}
        planes = dict(zip(spec.names, buffer.planes))
        table = np.empty((n, len(spec.names)), dtype=np.uint32)
        counts: dict[str, int] = {}
        if buffer.quantized:  # codes, scales and counts as they arrived
            fields |= {scale_name(name): scales[:n] for name, scales in zip(spec.names, buffer.scales)}
            counts = {name: int(count[:n].sum()) for name, count in zip(spec.names, buffer.nonfinite)}
        # In file order, but the scales of rows quantized here come with their codes, the row table last.
        for name, _, _ in layout:
            if name in planes:
                column = spec.names.index(name)
                if buffer.quantized:  # each row's CRC came with it
                    table[:, column] = buffer.row_crcs[column][:n].view(np.uint32)
                    out.write_plane(offsets[name], planes[name][:n])
                elif not spec.fp8:
                    table[:, column] = out.write_rows(offsets[name], planes[name][:n])
                else:
                    plane = planes[name][:n]
                    table[:, column], scales, counts[name] = _write_fp8(out, offsets[name], plane, spec.dtype)
                    crcs[scale_name(name)] = out.write(offsets[scale_name(name)], _bytes(scales))
            elif name in fields:
                crcs[name] = out.write(offsets[name], _bytes(fields[name]))
        crcs[ROW_CRC] = out.write(offsets[ROW_CRC], _bytes(table.reshape(-1)))
        # Each tensor's CRC from its rows', every tensor in one pass (a pass per tensor held the GIL for long).
        crcs |= dict(zip(spec.names, (int(c) for c in combine_columns(table, sizes[spec.names[0]] // max(n, 1)))))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            directory.unlink(tmp.name)
        raise
    os.close(fd)
    if direct is not None:
        direct.count(out.direct_bytes, at - out.direct_bytes)
    directory.replace(tmp.name, path.name)
    directory.fsync()
    line = {
        "type": "shard",
        "id": spec.shard_id,
        "file": path.name,
        "rows": n,
        "bytes": at,
        "crc32": f"{combine([(crcs[''], len(head))] + [(crcs[name], sizes[name]) for name, _, _ in layout]):08x}",
        "tensor_crc32": {name: f"{crcs[name]:08x}" for name, _, _ in layout},
    }
    nonfinite = {name: counts[name] for name, _, _ in layout if counts.get(name)}
    if nonfinite:
        log.warning("shard %d: non-finite values stored as fp8 NaN: %s", spec.shard_id, nonfinite)
        line["nonfinite"] = nonfinite
    return line


def _bytes(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes."""
    return memoryview(array).cast("B")


class _Output:
    """A shard file being written at given offsets, its CRCs computed on the way, writeback started as it
    goes; row planes with O_DIRECT where ``direct`` says so (its fcntl flag is set around those writes only)."""

    def __init__(self, fd: int, writeback_bytes: int, direct: DirectIO | None = None, path: Path | None = None) -> None:
        self.fd = fd
        self.writeback_bytes = writeback_bytes if hasattr(os, "posix_fadvise") else 0
        self.direct, self.path = direct, path
        #: Bytes of row planes per write: O_DIRECT writes wait for the disk, so they take larger blocks.
        self.plane_block = BLOCK_BYTES if direct is None else DIRECT_BLOCK_BYTES
        self.direct_bytes = 0
        self._flags = fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0)
        self._direct_on = False
        #: Bytes written since writeback was last started, and the file range they fall in.
        self._unflushed = 0
        self._low, self._high = 0, 0

    def write(self, offset: int, data: memoryview) -> int:
        """Write ``data`` at ``offset`` through the page cache in blocks, each checksummed just before it
        goes; returns the CRC-32."""
        crc = 0
        for begin in range(0, len(data), BLOCK_BYTES):
            block = data[begin : begin + BLOCK_BYTES]
            crc = zlib.crc32(block, crc)
            self._put(offset + begin, block)
        return crc

    def write_plane(self, offset: int, rows: np.ndarray) -> None:
        """Write ``[n, row_bytes]`` uint8 rows whose CRCs are known at ``offset``."""
        flat = rows.reshape(-1)
        for begin in range(0, len(flat), self.plane_block):
            self._put_plane(offset + begin, flat[begin : begin + self.plane_block])

    def write_rows(self, offset: int, rows: np.ndarray) -> np.ndarray:
        """Write ``[n, row_bytes]`` uint8 rows at ``offset`` in blocks, each row checksummed just before its
        block goes; returns the ``[n]`` uint32 CRC-32 of each row."""
        n, width = rows.shape
        step = max(1, BLOCK_BYTES // max(width, 1))
        if self.direct is not None:  # blocks of whole pages, so a plane's pages go whole
            unit = DIRECT_ALIGN // math.gcd(width, DIRECT_ALIGN)
            step = max(unit, DIRECT_BLOCK_BYTES // width // unit * unit)
        crcs = np.empty(n, dtype=np.uint32)
        for begin in range(0, n, step):
            block = np.ascontiguousarray(rows[begin : begin + step])
            crcs[begin : begin + len(block)] = row_crcs(block, compiled=True, wait=False)  # zlib while compiling
            self._put_plane(offset + begin * width, block.reshape(-1))
        return crcs

    def _put_plane(self, offset: int, data: np.ndarray) -> None:
        """Write a block of a row plane: its whole pages with O_DIRECT if on, its ends through the cache."""
        end = offset + len(data)
        first = min(end, -(-offset // DIRECT_ALIGN) * DIRECT_ALIGN)
        last = max(first, end // DIRECT_ALIGN * DIRECT_ALIGN)
        if self.direct is None or last == first:
            self._put(offset, _bytes(data))
            return
        if first > offset:
            self._put(offset, _bytes(data[: first - offset]))
        self._put_direct(first, data[first - offset : last - offset])
        if end > last:
            self._put(last, _bytes(data[last - offset :]))

    def _put_direct(self, offset: int, data: np.ndarray) -> None:
        """Write whole pages at a page-aligned ``offset`` with O_DIRECT; through the cache if refused."""
        assert self.direct is not None
        try:
            self._set_direct(True)
            if data.ctypes.data % DIRECT_ALIGN == 0:
                self._pwrite(offset, _bytes(data))
            else:  # rows that are not where the file wants them in memory: through an aligned scratch
                scratch = self.direct.bounce()
                for begin in range(0, len(data), len(scratch)):
                    piece = data[begin : begin + len(scratch)]
                    scratch[: len(piece)] = piece
                    self._pwrite(offset + begin, _bytes(scratch[: len(piece)]))
            self.direct_bytes += len(data)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct.refused(self.path.parent if self.path is not None else Path("."), exc)
            self.direct = None
            self._put(offset, _bytes(data))

    def _set_direct(self, on: bool) -> None:
        if on != self._direct_on:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, self._flags | os.O_DIRECT if on else self._flags)
            self._direct_on = on

    def _put(self, offset: int, block: memoryview) -> None:
        self._set_direct(False)
        self._pwrite(offset, block)
        if self.writeback_bytes:
            self._written(offset, offset + len(block))

    def _pwrite(self, offset: int, block: memoryview) -> None:
        done = 0
        while done < len(block):
            done += os.pwrite(self.fd, block[done:], offset + done)

    def _written(self, begin: int, end: int) -> None:
        """Once enough is written, have the kernel start writing it to the disk and return (on Linux,
        ``POSIX_FADV_DONTNEED`` starts writeback of a range's dirty pages; it drops only pages already
        clean). Durability still comes from the fsync; this keeps the disk busy until then."""
        self._low, self._high = (begin, end) if not self._unflushed else (min(self._low, begin), max(self._high, end))
        self._unflushed += end - begin
        if self._unflushed >= self.writeback_bytes:
            os.posix_fadvise(self.fd, self._low, self._high - self._low, os.POSIX_FADV_DONTNEED)
            self._unflushed = 0


def _write_fp8(out: _Output, offset: int, plane: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Quantize ``[n, hidden]`` rows block by block, writing the codes at ``offset``.

    Returns the ``[n]`` CRC-32 of each row of codes, the ``[n]`` float32 scales, and the count of
    non-finite values.
    """
    import torch  # only where rows are quantized here: a bf16 store's writer never imports it

    from hscapture.fp8 import Quantizer

    rows = torch.from_numpy(plane).view(torch_dtype(dtype))
    n, hidden = rows.shape
    step = max(1, BLOCK_BYTES // (hidden * 4))  # rows per block, by the size of the float32 scratch
    quantize = Quantizer(hidden, min(step, max(n, 1)))
    scales = np.empty(n, dtype=np.float32)
    crcs = np.empty(n, dtype=np.uint32)
    nonfinite = 0
    for begin in range(0, n, step):
        codes, count = quantize(rows[begin : begin + step], torch.from_numpy(scales[begin : begin + step]))
        nonfinite += count
        crcs[begin : begin + len(codes)] = out.write_rows(offset + begin * hidden, codes.view(torch.uint8).numpy())
    return crcs, scales, nonfinite
