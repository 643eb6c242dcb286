"""Shard buffers, and writing one shard file straight from its buffer (on a writer thread).

A shard buffer holds ``capacity`` rows: one ``[capacity, hidden * itemsize]`` byte plane per
captured tensor (pinned memory when the consumer drains a CUDA ring) and the rows' positions,
token ids and request indices. :func:`write_shard` writes the safetensors header, then every
tensor from the buffer in blocks of :data:`BLOCK_BYTES`, each block checksummed just before it
is written (so it is read from the cache, not twice from memory): the captured tensors row by row
(the ``row_crc32`` table a reader checks the rows it serves against; each tensor's CRC follows from
its rows'), the rest whole. Nothing builds the file in memory. In an fp8 store each block is
quantized into a scratch first; the scales and the row table, known only when their tensors are
done, are written at their place in the file afterwards (``pwrite``).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hscapture.fp8 import FP8, Quantizer, scale_name
from hscapture.ownership import create_private, temp_sibling
from hscapture.store.checksum import combine, combine_rows, row_crcs
from hscapture.store.files import PRIVATE_FILE_MODE, fsync_dir
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
#: safetensors dtype codes of what shards hold.
DTYPE_CODES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    FP8: "F8_E4M3",
}


@dataclass
class ShardBuffer:
    """Host memory for one shard being filled."""

    #: One ``[capacity, hidden * itemsize]`` uint8 array per captured tensor.
    planes: list[np.ndarray]
    positions: np.ndarray
    token_ids: np.ndarray
    request_index: np.ndarray


def new_buffer(tensors: int, capacity: int, plane_row_bytes: int, allocate: Callable[[int], np.ndarray]) -> ShardBuffer:
    """A shard buffer of ``capacity`` rows; ``allocate(nbytes)`` gives each plane's uint8 memory."""
    return ShardBuffer(
        planes=[allocate(capacity * plane_row_bytes).reshape(capacity, plane_row_bytes) for _ in range(tensors)],
        positions=np.empty(capacity, dtype=np.int64),
        token_ids=np.empty(capacity, dtype=np.int64),
        request_index=np.empty(capacity, dtype=np.int32),
    )


@dataclass(frozen=True)
class ShardSpec:
    """What one shard file holds: its first ``rows`` buffer rows of tensors ``names`` in ``dtype``."""

    shard_id: int
    run_id: str
    rows: int
    names: tuple[str, ...]
    dtype: torch.dtype
    hidden_size: int
    #: Store the rows as fp8 codes with one float32 scale per row.
    fp8: bool
    #: The ``request_index`` table, in order.
    request_ids: tuple[str, ...]


def write_shard(root: Path, spec: ShardSpec, buffer: ShardBuffer, mode: int = PRIVATE_FILE_MODE) -> dict[str, Any]:
    """Write a shard to a temp file (created with ``mode``), fsync it, rename it, fsync the directory;
    returns its index line.

    Raises:
        OSError: the write failed (the temp file is removed, nothing is renamed).
    """
    n = spec.rows
    fields = {
        "positions": buffer.positions[:n],
        "token_ids": buffer.token_ids[:n],
        "request_index": buffer.request_index[:n],
    }
    stored = DTYPE_CODES[FP8 if spec.fp8 else spec.dtype]
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
    head, order = shard_header(tensors, metadata)
    layout = [tensors[i] for i in order]
    sizes = {name: int(np.prod(shape)) * ITEM_BYTES[code] for name, code, shape in layout}
    offsets, at = {}, len(head)
    for name, _, _ in layout:
        offsets[name], at = at, at + sizes[name]
    path = root / shard_name(spec.shard_id)
    tmp = temp_sibling(path)
    fd = create_private(tmp, os.O_WRONLY, mode)
    try:
        crcs = {"": _write(fd, 0, memoryview(head))}
        planes = dict(zip(spec.names, buffer.planes))
        table = np.empty((n, len(spec.names)), dtype=np.uint32)
        nonfinite: dict[str, int] = {}
        for name, _, _ in layout:  # in file order, but the fp8 scales come with their codes, the row table last
            if name in planes:
                column = spec.names.index(name)
                if spec.fp8:
                    rows = torch.from_numpy(planes[name][:n]).view(spec.dtype)
                    table[:, column], scales, count = _write_fp8(fd, offsets[name], rows)
                    crcs[scale_name(name)] = _write(fd, offsets[scale_name(name)], memoryview(scales).cast("B"))
                    nonfinite.update({name: count} if count else {})
                else:
                    table[:, column] = _write_rows(fd, offsets[name], planes[name][:n])
                crcs[name] = combine_rows(table[:, column], sizes[name] // max(n, 1))
            elif name in fields:
                crcs[name] = _write(fd, offsets[name], memoryview(fields[name]).cast("B"))
        crcs[ROW_CRC] = _write(fd, offsets[ROW_CRC], memoryview(table.reshape(-1)).cast("B"))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(root)
    line = {
        "type": "shard",
        "id": spec.shard_id,
        "file": path.name,
        "rows": n,
        "bytes": at,
        "crc32": f"{combine([(crcs[''], len(head))] + [(crcs[name], sizes[name]) for name, _, _ in layout]):08x}",
        "tensor_crc32": {name: f"{crcs[name]:08x}" for name, _, _ in layout},
    }
    if nonfinite:
        log.warning("shard %d: non-finite values stored as fp8 NaN: %s", spec.shard_id, nonfinite)
        line["nonfinite"] = nonfinite
    return line


def _write(fd: int, offset: int, data: memoryview) -> int:
    """Write ``data`` at ``offset`` in blocks, each checksummed just before it goes; returns the CRC-32."""
    crc = 0
    for begin in range(0, len(data), BLOCK_BYTES):
        block = data[begin : begin + BLOCK_BYTES]
        crc = zlib.crc32(block, crc)
        _pwrite(fd, offset + begin, block)
    return crc


def _pwrite(fd: int, offset: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _write_rows(fd: int, offset: int, rows: np.ndarray) -> np.ndarray:
    """Write ``[n, row_bytes]`` uint8 rows at ``offset`` in blocks, each row checksummed just before its
    block goes; returns the ``[n]`` uint32 CRC-32 of each row."""
    n, width = rows.shape
    step = max(1, BLOCK_BYTES // max(width, 1))
    crcs = np.empty(n, dtype=np.uint32)
    for begin in range(0, n, step):
        block = np.ascontiguousarray(rows[begin : begin + step])
        crcs[begin : begin + len(block)] = row_crcs(block)
        _pwrite(fd, offset + begin * width, memoryview(block.reshape(-1)))
    return crcs


def _write_fp8(fd: int, offset: int, rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int]:
    """Quantize ``[n, hidden]`` rows block by block, writing the codes at ``offset``.

    Returns the ``[n]`` CRC-32 of each row of codes, the ``[n]`` float32 scales, and the count of
    non-finite values.
    """
    n, hidden = rows.shape
    step = max(1, BLOCK_BYTES // (hidden * 4))  # rows per block, by the size of the float32 scratch
    quantize = Quantizer(hidden, min(step, max(n, 1)))
    scales = np.empty(n, dtype=np.float32)
    crcs = np.empty(n, dtype=np.uint32)
    nonfinite = 0
    for begin in range(0, n, step):
        codes, count = quantize(rows[begin : begin + step], torch.from_numpy(scales[begin : begin + step]))
        nonfinite += count
        crcs[begin : begin + len(codes)] = _write_rows(fd, offset + begin * hidden, codes.view(torch.uint8).numpy())
    return crcs, scales, nonfinite
