"""The store's on-disk format (FORMAT.md): file names, ``meta.json``, ``index.jsonl``, shard headers.

Everything here is shared by the writer and the readers (reader, verify, recovery) and depends on
nothing but the format itself: no ring, no wire, no writer.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hscapture.errors import StoreError

log = logging.getLogger(__name__)

STORE_FORMAT = "hscapture-store"
STORE_VERSION = 1
SHARD_FORMAT = "hscapture-shard"
INDEX_FILE = "index.jsonl"
META_FILE = "meta.json"
LOCK_FILE = ".lock"

#: Bytes per element of each safetensors dtype code.
ITEM_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
#: The order in which safetensors lays out tensors of these dtypes (then by name), which shards keep.
_FILE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8")


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


def read_meta(root: Path) -> dict[str, Any] | None:
    """``meta.json`` of the store at ``root`` (None before the first run began)."""
    path = root / META_FILE
    if not path.exists():
        return None
    meta: dict[str, Any] = json.loads(path.read_text())
    return meta


def check_store_dtype(root: Path, requested: str | None) -> None:
    """Refuse to add rows stored as ``requested`` to an existing store that stores them otherwise.

    ``requested`` None (store as captured, or as the store already does) always fits.
    """
    meta = read_meta(root) if requested is not None else None
    if meta is None:
        return
    held = meta.get("store_dtype", meta.get("dtype"))
    if held != requested:
        raise StoreError(
            f"{root}: stores rows as {held}, not {requested}; leave --store-dtype unset to continue "
            "it as it is, or write to another --out directory"
        )


def shard_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]], metadata: dict[str, str]
) -> tuple[bytes, list[int]]:
    """The safetensors header of a shard, as ``safetensors.torch.save`` lays it out.

    Args:
        tensors: ``(name, dtype code, shape)`` of every tensor.
        metadata: the ``__metadata__`` strings.

    Returns:
        The file's first bytes (8-byte little-endian header length, then the JSON header padded
        with spaces to a multiple of 8), and the tensors' indices in file order: largest
        alignment first, then by name, with no byte between two tensors.
    """
    order = sorted(range(len(tensors)), key=lambda i: (_FILE_ORDER.index(tensors[i][1]), tensors[i][0]))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for i in order:
        name, dtype, shape = tensors[i]
        end = offset + math.prod(shape) * ITEM_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, order
