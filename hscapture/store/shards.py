"""Shard buffers, and writing one shard file straight from its buffer (on a writer thread).

A shard buffer holds ``capacity`` rows: one ``[capacity, hidden * itemsize]`` byte plane per
captured tensor (pinned memory when the consumer drains a CUDA ring) and the rows' positions,
token ids and request indices. :func:`write_shard` writes the safetensors header, then every
tensor from the buffer in blocks of :data:`BLOCK_BYTES`, each block checksummed just before it
is written (so it is read from the cache, not twice from memory). Nothing builds the file in
memory. In an fp8 store each block is quantized into a scratch first; the scales, known only
when their tensor is done, are written at their place in the file afterwards (``pwrite``).
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
from hscapture.store.checksum import combine
from hscapture.store.files import create_file, fsync_dir
from hscapture.store.format import ITEM_BYTES, SHARD_FORMAT, STORE_VERSION, shard_header, shard_name

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
ROW_FIELDS = {"positions": "I64", "token_ids": "I64", "request_index": "I32"}


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


def write_shard(root: Path, spec: ShardSpec, buffer: ShardBuffer) -> dict[str, Any]:
    """Write a shard to a temp file, fsync it, rename it, fsync the directory; returns its index line.

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
    tmp = path.with_name(path.name + ".tmp")
    fd = create_file(tmp)
    try:
        crcs = {"": _write(fd, 0, memoryview(head))}
        planes = dict(zip(spec.names, buffer.planes))
        nonfinite: dict[str, int] = {}
        for name, _, _ in layout:  # in file order, but for the fp8 scales: they come with their codes
            if name in planes:
                rows = torch.from_numpy(planes[name][:n]).view(spec.dtype)
                if spec.fp8:
                    crcs[name], scales, count = _write_fp8(fd, offsets[name], rows)
                    crcs[scale_name(name)] = _write(fd, offsets[scale_name(name)], memoryview(scales).cast("B"))
                    nonfinite.update({name: count} if count else {})
                else:
                    crcs[name] = _write(fd, offsets[name], memoryview(rows.view(torch.uint8).numpy()).cast("B"))
            elif name in fields:
                crcs[name] = _write(fd, offsets[name], memoryview(fields[name]).cast("B"))
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


def _write(fd: int, offset: int, data: memoryview, crc: int = 0) -> int:
    """Write ``data`` at ``offset`` in blocks, each checksummed just before it goes; returns the CRC-32.

    The CRC continues from ``crc`` (a tensor written in several calls).
    """
    for begin in range(0, len(data), BLOCK_BYTES):
        block = data[begin : begin + BLOCK_BYTES]
        crc = zlib.crc32(block, crc)
        done = 0
        while done < len(block):
            done += os.pwrite(fd, block[done:], offset + begin + done)
    return crc


def _write_fp8(fd: int, offset: int, rows: torch.Tensor) -> tuple[int, np.ndarray, int]:
    """Quantize ``[n, hidden]`` rows block by block, writing the codes at ``offset``.

    Returns the codes' CRC-32, the ``[n]`` float32 scales and the count of non-finite values.
    """
    n, hidden = rows.shape
    step = max(1, BLOCK_BYTES // (hidden * 4))  # rows per block, by the size of the float32 scratch
    quantize = Quantizer(hidden, min(step, max(n, 1)))
    scales = np.empty(n, dtype=np.float32)
    crc, nonfinite = 0, 0
    for begin in range(0, n, step):
        codes, count = quantize(rows[begin : begin + step], torch.from_numpy(scales[begin : begin + step]))
        nonfinite += count
        crc = _write(fd, offset + begin * hidden, memoryview(codes.view(torch.uint8).numpy()).cast("B"), crc)
    return crc, scales, nonfinite
