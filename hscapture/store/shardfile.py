"""One shard file opened for reading: memory-mapped, its header parsed and checked against the store.

Readers (:mod:`~hscapture.store.reader`) and the tools that rebuild an index from the shards
(:mod:`~hscapture.store.recovery`, :mod:`~hscapture.store.repair`) open shards through
:class:`ShardFile`, so a missing, empty, truncated or garbled file is one :class:`StoreError`
naming it, never a traceback from a parser. Tensors come out as zero-copy numpy views of the
mapping; callers copy what they keep.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from hscapture.errors import StoreError
from hscapture.fp8_kernel import FP8_NAME, scale_name
from hscapture.ownership import in_dir
from hscapture.store.format import ITEM_BYTES, ROW_CRC, ROW_FIELDS, SHARD_FORMAT, ShardHeader, parse_shard_header

#: numpy dtypes of the safetensors codes a shard holds besides the captured rows.
NUMPY_DTYPES = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "U32": np.dtype("<u4"), "F32": np.dtype("<f4")}
#: safetensors codes of the dtypes rows are stored in, by meta.json name.
STORED_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", FP8_NAME: "F8_E4M3"}


class ShardFile:
    """A shard of the store described by ``meta`` (its ``meta.json``), mapped read-only.

    Args:
        path: the shard file.
        meta: the store's ``meta.json``: which tensors, dtype and width every shard must hold.
        size: the size its index line gives (None: not listed, any size).
        shard_id: its id (what its name says).
        dir_fd: the store directory's descriptor: ``path.name`` is opened in it (``path`` then names it in
            messages only).

    Raises:
        StoreError: the file is missing, a link, empty, not of ``size``, or its header is unreadable
            or does not hold what ``meta`` says; the message names the file.
    """

    def __init__(
        self, path: Path, meta: dict[str, Any], size: int | None = None, shard_id: int = -1, dir_fd: int | None = None
    ) -> None:
        self.path = path
        self.shard_id = shard_id
        try:
            fd = os.open(in_dir(path, dir_fd), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            raise StoreError(f"{path}: missing; the store was damaged after it was written") from None
        except OSError as exc:
            what = "a symbolic link, never followed" if exc.errno == errno.ELOOP else exc.strerror
            raise StoreError(f"{path}: cannot open it ({what})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise StoreError(f"{path}: not a regular file")
            self.size = info.st_size
            if size is not None and self.size != size:
                raise StoreError(f"{path}: {self.size} bytes on disk, the index says {size}: truncated or damaged")
            if self.size == 0:
                raise StoreError(f"{path}: an empty file, not a shard")
            self._map = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            self.header: ShardHeader = parse_shard_header(lambda at, count: self._map[at : at + count], self.size)
        except ValueError as exc:
            raise StoreError(f"{path}: header unreadable: {exc}") from None
        self.run_id, self.request_ids = self._metadata()
        self._local = {request_id: i for i, request_id in enumerate(self.request_ids)}
        #: The captured tensors, in ``meta.json`` order (the columns of ``row_crc32``).
        self.names: list[str] = [t["name"] for t in meta["tensors"]]
        self.rows = self._check_tensors(meta)
        #: Names of the tensors whose whole bytes were checked against the index (by the reader).
        self.checked: set[str] = set()

    def _metadata(self) -> tuple[str, list[str]]:
        metadata = self.header.metadata
        if metadata.get("format") != SHARD_FORMAT:
            raise StoreError(f"{self.path}: header says format {metadata.get('format')!r}, not {SHARD_FORMAT!r}")
        try:
            request_ids = json.loads(metadata.get("request_ids", ""))
        except ValueError:
            request_ids = None
        if not isinstance(request_ids, list) or not all(isinstance(r, str) for r in request_ids):
            raise StoreError(f"{self.path}: header's request_ids is not a JSON list of strings")
        if not isinstance(metadata.get("run_id"), str):
            raise StoreError(f"{self.path}: header has no run_id")
        return metadata["run_id"], request_ids

    def _check_tensors(self, meta: dict[str, Any]) -> int:
        """The shard's row count, once every tensor it must hold is there with the right dtype and shape."""
        tensors = self.header.tensors
        positions = tensors.get("positions")
        if positions is None or len(positions.shape) != 1:
            raise StoreError(f"{self.path}: header has no positions tensor of one dimension")
        rows = positions.shape[0]
        stored = meta.get("store_dtype", meta["dtype"])
        names = self.names
        want = {name: (code, (rows,)) for name, code in ROW_FIELDS.items()}
        want.update({name: (STORED_CODES[stored], (rows, meta["hidden_size"])) for name in names})
        if stored == FP8_NAME:
            want.update({scale_name(name): ("F32", (rows,)) for name in names})
        if ROW_CRC in tensors:
            want[ROW_CRC] = ("U32", (rows, len(names)))
        for name, (code, shape) in want.items():
            entry = tensors.get(name)
            if entry is None:
                raise StoreError(f"{self.path}: header has no tensor {name!r}")
            if (entry.dtype, entry.shape) != (code, shape):
                raise StoreError(
                    f"{self.path}: tensor {name!r} is {entry.dtype} {list(entry.shape)}, "
                    f"the store holds {code} {list(shape)}"
                )
        return int(rows)

    # ------------------------------------------------------------------ data

    def data(self, name: str) -> np.ndarray:
        """The bytes of tensor ``name`` as a uint8 view of the mapping, ``[rows, row_bytes]`` (one row per
        stored row; ``row_crc32``: one per stored row too)."""
        entry = self.header.tensors[name]
        flat = np.frombuffer(self._map, dtype=np.uint8, count=entry.end - entry.begin, offset=entry.begin)
        return flat.reshape(self.rows, -1) if self.rows else flat.reshape(0, 0)

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` (a per-row field, a scale or the row table) as a typed view of the mapping."""
        entry = self.header.tensors[name]
        return np.frombuffer(
            self._map, dtype=NUMPY_DTYPES[entry.dtype], count=(entry.end - entry.begin) // ITEM_BYTES[entry.dtype],
            offset=entry.begin,
        ).reshape(entry.shape)  # fmt: skip

    def crc(self, name: str) -> int:
        """CRC-32 of the bytes of tensor ``name``."""
        entry = self.header.tensors[name]
        return zlib.crc32(memoryview(self._map)[entry.begin : entry.end])

    def crcs(self) -> tuple[int, dict[str, int]]:
        """CRC-32 of the whole file and of each tensor (in file order), as a shard line records them."""
        order = sorted(self.header.tensors, key=lambda name: self.header.tensors[name].begin)
        return zlib.crc32(self._map), {name: self.crc(name) for name in order}

    def local_index(self, request_id: str) -> int | None:
        """Where ``request_id`` is in the shard's ``request_ids`` (what ``request_index`` holds for its rows)."""
        return self._local.get(request_id)
