"""The store's on-disk format (FORMAT.md): file names, ``meta.json``, ``index.jsonl``, shard headers.

Everything here is shared by the writer and the readers (reader, verify, recovery, repair) and
depends on nothing but the format itself: no ring, no wire, no writer. Whatever comes off the disk
is checked here before anyone uses it, and every problem is one phrase naming the file (and line).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hscapture.config import DTYPES, STORE_DTYPES
from hscapture.errors import StoreError
from hscapture.selection import FORMS, Positions
from hscapture.store.directory import StoreDir

log = logging.getLogger(__name__)

STORE_FORMAT = "hscapture-store"
#: The version this hscapture writes; it reads every version in READ_VERSIONS.
STORE_VERSION = 2
#: The version of a store whose request lines may take rows by reference (``shared``); a writer raises a
#: store to it before the first such line, so a store without references stays readable by older readers.
SHARED_VERSION = 3
#: The version of a store whose request lines may hold rows at some positions only (``positions``: a selection);
#: raised to before the first such line, so that no older reader takes such a request for one of every position.
SELECTION_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
SHARD_FORMAT = "hscapture-shard"
INDEX_FILE = "index.jsonl"
META_FILE = "meta.json"
LOCK_FILE = ".lock"
#: The last field of every index line of a version-2 store: CRC-32 of the line's bytes before it.
LINE_CRC = "line_crc32"
#: The per-row checksums of a version-2 shard: ``[rows, tensors]`` CRC-32 of each stored row.
ROW_CRC = "row_crc32"
#: Per-row fields of every shard, beside the captured tensors.
ROW_FIELDS = {"positions": "I64", "token_ids": "I64", "request_index": "I32"}
#: Shard file names; anything else in a store directory is not a shard.
SHARD_FILE = re.compile(r"shard-(\d{6,})\.safetensors")
MAX_HEADER_BYTES = 100 << 20  # safetensors refuses larger headers too
#: How to fix a damaged index, said in every error about one.
REPAIR = "hscapture verify --repair {root} rebuilds the listing from the shards"

_LINE_TAIL = re.compile(rb',"line_crc32":"([0-9a-f]{8})"\}\n\Z')

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


def shard_files(root: Path | StoreDir) -> dict[int, Path]:
    """Shard files present in the store directory, by id (temp files and other names are not shards)."""
    directory = StoreDir.of(root)
    found = {}
    for name in directory.names():
        match = SHARD_FILE.fullmatch(name)
        if match:
            found[int(match.group(1))] = directory.file(name)
    return found


# ---------------------------------------------------------------------------------------- meta.json


def meta_problem(meta: Any) -> str:
    """What is wrong with a parsed ``meta.json`` ('' when nothing is): the fields every reader relies on."""
    if not isinstance(meta, dict):
        return f"not a JSON object but {type(meta).__name__}"
    if meta.get("format") != STORE_FORMAT:
        return f"format {meta.get('format')!r}, not {STORE_FORMAT!r}; not an hscapture store"
    if meta.get("version") not in READ_VERSIONS:
        return f"store version {meta.get('version')!r}; this hscapture reads versions {READ_VERSIONS}"
    if meta.get("dtype") not in DTYPES:
        return f"dtype {meta.get('dtype')!r} is none of {sorted(DTYPES)}"
    if meta.get("store_dtype", meta["dtype"]) not in (meta["dtype"], *STORE_DTYPES.values()):
        known = ", ".join(map(repr, sorted(set(STORE_DTYPES.values()))))
        return f"rows stored as {meta.get('store_dtype')!r}; this hscapture reads {known}"
    if not _is_int(meta.get("hidden_size")) or meta["hidden_size"] <= 0:
        return f"hidden_size {meta.get('hidden_size')!r} is not a positive integer"
    tensors = meta.get("tensors")
    if not isinstance(tensors, list) or not tensors:
        return "no `tensors` list: what was captured is unknown"
    names = []
    for i, entry in enumerate(tensors):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            return f"tensors[{i}] is not an object with a name"
        if not isinstance(entry.get("description"), str):
            return f"tensors[{i}] ({entry['name']}) has no description"
        names.append(entry["name"])
    if len(set(names)) != len(names) or set(names) & {*ROW_FIELDS, ROW_CRC}:
        return f"tensor names {names} repeat or clash with the shards' own fields"
    return ""


def read_meta(root: Path | StoreDir) -> dict[str, Any] | None:
    """``meta.json`` of the store at ``root``, checked (None before the first run began).

    Raises:
        StoreError: a link, unreadable, not JSON, or lacking a field readers rely on; the message names the file.
    """
    directory = StoreDir.of(root)
    path = directory.file(META_FILE)
    text = directory.read(META_FILE)
    if text is None:
        return None
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise StoreError(f"{path}: not JSON ({exc}); the store's meta.json is damaged") from None
    problem = meta_problem(meta)
    if problem:
        raise StoreError(f"{path}: {problem}")
    result: dict[str, Any] = meta
    return result


def check_store_dtype(root: Path | StoreDir, requested: str | None) -> None:
    """Refuse to add rows stored as ``requested`` to an existing store that stores them otherwise.

    ``requested`` None (store as captured, or as the store already does) always fits.
    """
    meta = read_meta(root) if requested is not None else None
    if meta is None:
        return
    held = meta.get("store_dtype", meta.get("dtype"))
    if held != requested:
        raise StoreError(
            f"{StoreDir.of(root).path}: stores rows as {held}, not {requested}; leave --store-dtype unset to continue "
            "it as it is, or write to another --out directory"
        )


# ---------------------------------------------------------------------------------------- index.jsonl


def encode_line(record: dict[str, Any]) -> bytes:
    """One index line: compact JSON whose last field, ``line_crc32``, is the CRC-32 of the bytes before it."""
    body = json.dumps(record, separators=(",", ":")).encode()[:-1]  # without the closing brace
    return body + b',"%s":"%08x"}\n' % (LINE_CRC.encode(), zlib.crc32(body))


@dataclass
class IndexLine:
    """One line of ``index.jsonl``: its number (from 1) and the record, or what is wrong with it."""

    number: int
    record: dict[str, Any] | None
    problem: str = ""


@dataclass
class IndexScan:
    """Every whole line of an index, and the length of a torn last line (a crash mid-append; 0: none)."""

    lines: list[IndexLine] = field(default_factory=list)
    torn_bytes: int = 0


def scan_index(root: Path | StoreDir, version: int) -> IndexScan:
    """Read and check every line of ``index.jsonl`` (version 2: each must carry its ``line_crc32``).

    Raises:
        StoreError: the index is a link, not a regular file, or cannot be opened; the message names it.
    """
    scan = IndexScan()
    fd = StoreDir.of(root).open_regular(INDEX_FILE)
    if fd is None:
        return scan
    with os.fdopen(fd, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.endswith(b"\n"):
                scan.torn_bytes = len(raw)
                break
            record, problem = _decode_line(raw, version >= 2)
            scan.lines.append(IndexLine(number, record, problem))
    return scan


def read_index(root: Path | StoreDir, version: int | None = None) -> list[dict[str, Any]]:
    """All whole lines of ``index.jsonl``, checked; a torn last line (crash mid-append) is skipped.

    Args:
        root: the store directory.
        version: the store's version (None: as its ``meta.json`` says).

    Raises:
        StoreError: a line is not JSON, not a valid record, or fails its checksum; the message
            names the file and line and how to repair it.
    """
    directory = StoreDir.of(root)
    if version is None:
        meta = read_meta(directory)
        version = STORE_VERSION if meta is None else meta["version"]
    scan = scan_index(directory, version)
    path = directory.file(INDEX_FILE)
    if scan.torn_bytes:
        log.warning("%s: ignoring a torn last line of %d bytes", path, scan.torn_bytes)
    for line in scan.lines:
        if line.problem:
            repair = REPAIR.format(root=directory.path)
            raise StoreError(f"{path}:{line.number}: {line.problem}; the index is corrupt: {repair}")
    return [line.record for line in scan.lines if line.record is not None]


def _decode_line(raw: bytes, checksummed: bool) -> tuple[dict[str, Any] | None, str]:
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return None, f"not JSON ({exc})"
    if not isinstance(record, dict):
        return None, f"not a JSON object but {type(record).__name__}"
    if LINE_CRC in record or checksummed:
        tail = _LINE_TAIL.search(raw)
        if tail is None:
            return None, f"no {LINE_CRC} as its last field (every line of a version-2 index ends with one)"
        got = f"{zlib.crc32(raw[: tail.start()]):08x}"
        if got != tail.group(1).decode():
            return None, f"{LINE_CRC} {tail.group(1).decode()}, its bytes give {got}: the line changed after writing"
        del record[LINE_CRC]
    problem = record_problem(record)
    return (None, problem) if problem else (record, "")


#: Fields of each kind of index line, and what each must be.
_FIELDS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "run": {"run_id": lambda v: isinstance(v, str), "meta": lambda v: isinstance(v, dict)},
    "run_end": {"run_id": lambda v: isinstance(v, str), "reason": lambda v: isinstance(v, str)},
    "shard": {
        "id": lambda v: _is_int(v) and v >= 0,
        "file": lambda v: isinstance(v, str),
        "rows": lambda v: _is_int(v) and v >= 0,
        "bytes": lambda v: _is_int(v) and v >= 0,
    },
    "request": {
        "id": lambda v: isinstance(v, str),
        "run_id": lambda v: isinstance(v, str),
        "status": lambda v: v in ("complete", "incomplete"),
        "reason": lambda v: isinstance(v, str),
        "rows": lambda v: _is_int(v) and v >= 0,
        "num_tokens": lambda v: _is_int(v) and v >= 0,
        "dropped_rows": lambda v: _is_int(v) and v >= 0,
        "missing": lambda v: _ranges(v, 2),
        "spans": lambda v: _ranges(v, 3),
        "loss_mask": lambda v: _ranges(v, 2),
        "meta": lambda v: isinstance(v, dict),
    },
}


def record_problem(record: dict[str, Any]) -> str:
    """What is wrong with a parsed index record ('' when nothing is)."""
    kind = record.get("type")
    fields = _FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        return f"unknown record type {kind!r}"
    for name, valid in fields.items():
        if name not in record or not valid(record[name]):
            return f"{kind} line with a bad or no {name!r} ({str(record.get(name))[:40]!r})"
    if kind == "shard":
        return _shard_line_problem(record)
    if kind == "request" and any(count <= 0 or start < 0 or shard < 0 for shard, start, count in record["spans"]):
        return f"request line with an empty or negative span in {record['spans'][:4]}"
    if kind == "request" and "shared" in record and not _shared_valid(record["shared"]):
        return f"request line with a bad 'shared' ({str(record['shared'])[:60]!r})"
    if kind == "request" and "positions" in record and not _selection_valid(record["positions"]):
        return f"request line with a bad 'positions' ({str(record['positions'])[:40]!r}; one of {FORMS})"
    return ""


def tokens_crc32(tokens: Any) -> str:
    """CRC-32 of token ids as little-endian int64 (the ``tokens_crc32`` of a ``shared`` entry)."""
    data = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    return f"{zlib.crc32(data):08x}"


def shared_rows(record: dict[str, Any]) -> int:
    """Rows a request line takes by reference from donors."""
    return sum(entry["end"] - entry["start"] for entry in record.get("shared", ()))


def selection(record: dict[str, Any]) -> Positions:
    """The positions a request line asked for (``positions``; absent: every one)."""
    return Positions.parse(record.get("positions"), "positions")


def asked_rows(record: dict[str, Any]) -> int:
    """How many positions a request line asked for: ``num_tokens``, or its selection's share of them."""
    chosen = selection(record)
    return record["num_tokens"] if chosen.everything else len(chosen.asked(record["num_tokens"], record["loss_mask"]))


def _selection_valid(value: Any) -> bool:
    """A selection other than ``all``, as :class:`~hscapture.selection.Positions` spells it."""
    if not isinstance(value, str):
        return False
    try:
        chosen = Positions.parse(value)
    except ValueError:
        return False
    return not chosen.everything and str(chosen) == value


def _shared_valid(value: Any) -> bool:
    """A list of ``{"id": str, "start": int, "end": int, "tokens_crc32": 8 hex digits}``, ranges non-empty."""
    return isinstance(value, list) and all(
        isinstance(e, dict)
        and isinstance(e.get("id"), str)
        and _is_int(e.get("start"))
        and _is_int(e.get("end"))
        and 0 <= e["start"] < e["end"]
        and _is_crc(e.get("tokens_crc32"))
        for e in value
    )


def _shard_line_problem(record: dict[str, Any]) -> str:
    file = record["file"]
    if file != shard_name(record["id"]):
        return f"shard line names {file!r}, not {shard_name(record['id'])!r}"
    if "crc32" in record and not _is_crc(record["crc32"]):
        return f"shard line's crc32 {record['crc32']!r} is not 8 hex digits"
    tensors = record.get("tensor_crc32", {})
    if not isinstance(tensors, dict) or not all(_is_crc(v) for v in tensors.values()):
        return "shard line's tensor_crc32 is not a map of tensor name to 8 hex digits"
    return ""


def _ranges(value: Any, width: int) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, list) and len(v) == width and all(_is_int(x) for x in v) for v in value
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_crc(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 8 and all(c in "0123456789abcdef" for c in value)


# ---------------------------------------------------------------------------------------- shards


def shard_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]], metadata: dict[str, str], align: tuple[str, int] | None = None
) -> tuple[bytes, list[int]]:
    """The safetensors header of a shard, as ``safetensors.torch.save`` lays it out.

    Args:
        tensors: ``(name, dtype code, shape)`` of every tensor.
        metadata: the ``__metadata__`` strings.
        align: ``(name, alignment)``: pad the header further so that tensor ``name``'s data starts
            at a multiple of ``alignment`` bytes in the file (or 4 bytes short of one, where the 8-byte
            alignment of the data section allows no better), so it can be written with ``O_DIRECT``.

    Returns:
        The file's first bytes (8-byte little-endian header length, then the JSON header padded
        with spaces to a multiple of 8, safetensors' trailing whitespace), and the tensors' indices
        in file order: largest alignment first, then by name, with no byte between two tensors.
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
    if align is not None:
        name, alignment = align
        start = 8 + len(text) + header[name]["data_offsets"][0]
        text += b" " * (-start % alignment // 8 * 8)
    return len(text).to_bytes(8, "little") + text, order


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    #: Absolute byte range of the tensor's data in the file.
    begin: int
    end: int


@dataclass(frozen=True)
class ShardHeader:
    """A parsed and checked safetensors header: where the data starts, each tensor, the metadata strings."""

    base: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def parse_shard_header(read: Callable[[int, int], bytes], size: int) -> ShardHeader:
    """Parse a safetensors header and check that every tensor lies inside the file, none overlapping.

    Args:
        read: ``read(offset, count)`` gives the file's bytes there.
        size: the file's size in bytes.

    Raises:
        ValueError: what is wrong with the header, one phrase.
    """
    prefix = read(0, 8)
    if len(prefix) < 8:
        raise ValueError(f"file of {size} bytes is shorter than the 8-byte header length")
    length = int.from_bytes(prefix, "little")
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"header length {length} does not fit a file of {size} bytes")
    try:
        header = json.loads(read(8, length))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("not a JSON object")
    base = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ is not a map of strings")
    tensors: dict[str, TensorEntry] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise ValueError(f"tensor {name!r}: not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
            raise ValueError(f"tensor {name!r}: shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r}")
        begin, end = offsets
        if dtype not in ITEM_BYTES:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r}")
        if not 0 <= begin <= end or end - begin != math.prod(shape) * ITEM_BYTES[dtype]:
            raise ValueError(f"tensor {name!r}: data_offsets {offsets} do not hold {dtype} {shape}")
        if base + end > size:
            raise ValueError(f"tensor {name!r} ends at byte {base + end}, past the end of the {size}-byte file")
        tensors[name] = TensorEntry(dtype, tuple(shape), base + begin, base + end)
    ranges = sorted((t.begin, t.end) for t in tensors.values())
    for (_, end), (begin, _) in itertools.pairwise(ranges):
        if begin < end:
            raise ValueError("tensors overlap")
    return ShardHeader(base, tensors, metadata)
