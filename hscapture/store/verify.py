"""Integrity check of a store: every listed shard against the checksums in its index line.

``verify_store(path)`` trusts nothing but the bytes: it reads ``index.jsonl`` itself (not through
the reader), parses each shard's safetensors header by hand, and streams the file in 8 MiB blocks,
computing the CRC-32 of every tensor's data (located by the header's offsets) and of the whole
file in one pass. A shard line carries ``crc32`` (whole file) and ``tensor_crc32`` (per tensor), so
a flipped byte is pinned to a tensor, or to the header when every tensor still matches. See FORMAT.md.

Integrity is per shard and per tensor within it, not per chunk: the writer packs the rows of many
chunks and requests into one shard. A request's ``spans`` name the shards holding its rows, which
is how a bad shard maps to the requests it damages.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hscapture.errors import StoreError
from hscapture.store.checksum import crc32_combine
from hscapture.store.format import INDEX_FILE, ITEM_BYTES, META_FILE, STORE_FORMAT, STORE_VERSION

BLOCK_BYTES = 8 << 20
MAX_HEADER_BYTES = 100 << 20  # safetensors refuses larger headers too


@dataclass
class ShardCheck:
    """The verdict on one shard listed in the index.

    ``status`` is ``ok``, ``corrupted``, ``missing`` or ``unverifiable`` (listed without checksums,
    i.e. written before they existed; its header and size were still checked). ``tensors`` names
    the tensors whose bytes do not match their checksum; ``problems`` says what is wrong, one
    phrase each; ``requests`` are the ids whose spans touch this shard (filled when it is bad).
    """

    id: int
    file: str
    status: str
    tensors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


@dataclass
class IndexProblem:
    """An index line that is not JSON or not a valid record, or a request naming an unlisted shard."""

    line: int
    problem: str
    request: str = ""
    shards: list[int] = field(default_factory=list)


@dataclass
class VerifyReport:
    """What ``verify_store`` found. ``ok`` is true when nothing is corrupted, missing or dangling.

    Unverifiable shards, unlisted shard files (``ignored``: readers ignore them too) and a torn
    index tail (a crash mid-append; readers skip it) are reported but are not failures.
    """

    root: str
    shards: int = 0
    requests: int = 0
    verified: list[ShardCheck] = field(default_factory=list)
    corrupted: list[ShardCheck] = field(default_factory=list)
    missing: list[ShardCheck] = field(default_factory=list)
    unverifiable: list[ShardCheck] = field(default_factory=list)
    affected_requests: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    torn_tail: bool = False
    torn_tail_bytes: int = 0
    unknown_shards: list[IndexProblem] = field(default_factory=list)
    bad_index_lines: list[IndexProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.corrupted or self.missing or self.unknown_shards or self.bad_index_lines)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **dataclasses.asdict(self)}


def verify_store(
    path: str | Path,
    jobs: int = 4,
    progress: Callable[[Iterable[ShardCheck], int], Iterable[ShardCheck]] | None = None,
) -> VerifyReport:
    """Check every shard the index lists; report corrupted, missing and unverifiable shards.

    Args:
        path: the store directory.
        jobs: shards checked in parallel (reading and CRC-32 release the GIL).
        progress: wraps the iterator of finished checks, given it and the shard count (e.g. tqdm).

    Raises:
        StoreError: ``path`` is not a store (no directory, no ``index.jsonl`` or ``meta.json``, or
            a ``meta.json`` of another format or version).
    """
    root = Path(path)
    _check_is_store(root)
    report = VerifyReport(root=str(root))
    shards, requests = _read_index(root, report)
    report.shards, report.requests = len(shards), len(requests)

    touching: dict[int, list[str]] = {}
    for request_id, (line, spans) in requests.items():
        unknown = sorted({s for s in spans if s not in shards})
        if unknown:
            report.unknown_shards.append(
                IndexProblem(line, f"request names shards {unknown} that no shard line lists", request_id, unknown)
            )
        for shard_id in dict.fromkeys(spans):
            touching.setdefault(shard_id, []).append(request_id)

    listed = {record["file"] for record in shards.values()}
    report.ignored = sorted(p.name for p in root.glob("shard-*") if p.name not in listed)

    records = sorted(shards.values(), key=lambda record: record["id"])
    buckets = {
        "ok": report.verified,
        "corrupted": report.corrupted,
        "missing": report.missing,
        "unverifiable": report.unverifiable,
    }
    pool = ThreadPoolExecutor(max(1, jobs), thread_name_prefix="hscapture-verify")
    try:
        checks: Iterable[ShardCheck] = pool.map(lambda record: _check_shard(root, record), records)
        if progress is not None:
            checks = progress(checks, len(records))
        for check in checks:
            buckets[check.status].append(check)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # Ctrl-C: do not go on reading a TB store

    bad = {check.id for check in report.corrupted + report.missing}
    for check in report.corrupted + report.missing:
        check.requests = touching.get(check.id, [])
    unknown_requests = {problem.request for problem in report.unknown_shards}
    report.affected_requests = [
        request_id
        for request_id, (_, spans) in requests.items()
        if request_id in unknown_requests or any(s in bad for s in spans)
    ]
    return report


# ---------------------------------------------------------------------------------------- index


def _check_is_store(root: Path) -> None:
    if not root.is_dir():
        raise StoreError(f"{root}: not a directory, so not an hscapture store")
    for name in (INDEX_FILE, META_FILE):
        if not (root / name).is_file():
            raise StoreError(f"{root}: no {name}; not an hscapture store (or nothing was captured into it yet)")
    try:
        meta = json.loads((root / META_FILE).read_bytes())
    except (ValueError, OSError) as exc:
        raise StoreError(f"{root / META_FILE}: unreadable ({exc}); not an hscapture store") from None
    if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise StoreError(f"{root / META_FILE}: format {found!r}, not {STORE_FORMAT!r}; not an hscapture store")
    if meta.get("version") != STORE_VERSION:
        raise StoreError(
            f"{root / META_FILE}: store version {meta.get('version')!r}; this hscapture verifies v{STORE_VERSION}"
        )


def _read_index(root: Path, report: VerifyReport) -> tuple[dict[int, dict[str, Any]], dict[str, tuple[int, list[int]]]]:
    """Shard lines by id, and per request id its last line's number and span shard ids."""
    shards: dict[int, dict[str, Any]] = {}
    requests: dict[str, tuple[int, list[int]]] = {}
    with (root / INDEX_FILE).open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.endswith(b"\n"):
                report.torn_tail, report.torn_tail_bytes = True, len(line)
                break
            try:
                record = json.loads(line)
            except ValueError as exc:
                report.bad_index_lines.append(IndexProblem(number, f"not JSON ({exc})"))
                continue
            kind = record.get("type") if isinstance(record, dict) else None
            if kind == "shard":
                problem = _shard_line_problem(record)
                if problem:
                    report.bad_index_lines.append(IndexProblem(number, problem))
                else:
                    shards[record["id"]] = record
            elif kind == "request":
                spans = record.get("spans")
                if not isinstance(record.get("id"), str) or not _valid_spans(spans):
                    report.bad_index_lines.append(IndexProblem(number, "request line without a string id and spans"))
                    continue
                requests.pop(record["id"], None)  # the last line of an id wins, in its position
                requests[record["id"]] = (number, [span[0] for span in spans])
            elif kind not in ("run", "run_end"):
                report.bad_index_lines.append(IndexProblem(number, f"unknown record type {kind!r}"))
    return shards, requests


def _shard_line_problem(record: dict[str, Any]) -> str:
    file = record.get("file")
    if not _is_int(record.get("id")) or not isinstance(file, str) or not _is_int(record.get("bytes")):
        return "shard line without an integer id and bytes and a file name"
    if "/" in file or "\\" in file or file in ("", ".", ".."):
        return f"shard line names {file!r}, not a file in the store directory"
    if "crc32" in record and not _is_crc(record["crc32"]):
        return f"shard line's crc32 {record['crc32']!r} is not 8 hex digits"
    tensors = record.get("tensor_crc32", {})
    if not isinstance(tensors, dict) or not all(_is_crc(v) for v in tensors.values()):
        return "shard line's tensor_crc32 is not a map of tensor name to 8 hex digits"
    return ""


def _valid_spans(spans: Any) -> bool:
    return isinstance(spans, list) and all(
        isinstance(s, list) and len(s) == 3 and all(_is_int(v) for v in s) for s in spans
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_crc(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 8 and all(c in "0123456789abcdef" for c in value)


# ---------------------------------------------------------------------------------------- shards


def _check_shard(root: Path, record: dict[str, Any]) -> ShardCheck:
    check = ShardCheck(id=record["id"], file=record["file"], status="ok")
    path = root / record["file"]
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        check.status = "missing"
        check.problems.append("file not found")
        return check
    except OSError as exc:
        check.status = "missing"
        check.problems.append(f"cannot open: {exc.strerror or exc}")
        return check
    with handle:
        try:
            _check_shard_bytes(handle, record, check)
        except OSError as exc:
            check.problems.append(f"read error: {exc.strerror or exc}")
    if check.problems:
        check.status = "corrupted"
    elif "crc32" not in record:
        check.status = "unverifiable"
        check.problems.append("no crc32 in its index line (written before checksums); only header and size checked")
    return check


def _check_shard_bytes(handle: Any, record: dict[str, Any], check: ShardCheck) -> None:
    size = _file_size(handle)
    if size != record["bytes"]:
        check.problems.append(f"{size} bytes on disk, the index says {record['bytes']}")
    try:
        base, tensors = _parse_header(handle, size)
    except ValueError as exc:
        check.problems.append(f"header unreadable: {exc}")
        return
    expected: dict[str, str] = record.get("tensor_crc32", {})
    if "crc32" not in record:
        return  # nothing to compare the bytes with
    if expected and set(expected) != set(tensors):
        check.problems.append(f"header lists tensors {sorted(tensors)}, the index checksums {sorted(expected)}")
    whole, crcs = _stream_crcs(handle, base, tensors, size)
    for name, crc in crcs.items():
        want = expected.get(name)
        if want is not None and want != f"{crc:08x}":
            check.tensors.append(name)
            check.problems.append(f"tensor {name}: crc32 {crc:08x}, the index says {want}")
    if f"{whole:08x}" != record["crc32"] and not check.tensors:
        where = "every tensor matches: the header differs" if expected else "no per-tensor checksums to narrow it"
        check.problems.append(f"file crc32 {whole:08x}, the index says {record['crc32']} ({where})")


def _file_size(handle: Any) -> int:
    handle.seek(0, 2)
    size = handle.tell()
    handle.seek(0)
    return int(size)


def _parse_header(handle: Any, size: int) -> tuple[int, dict[str, tuple[int, int]]]:
    """(start of the data region, name -> absolute [begin, end) byte range), validated."""
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise ValueError(f"file of {size} bytes is shorter than the 8-byte header length")
    length = int.from_bytes(prefix, "little")
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"header length {length} does not fit a file of {size} bytes")
    try:
        header = json.loads(handle.read(length))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("not a JSON object")
    base = 8 + length
    tensors: dict[str, tuple[int, int]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
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
        tensors[name] = (base + begin, base + end)
    ranges = sorted(tensors.values())
    for (_, end), (begin, _) in itertools.pairwise(ranges):
        if begin < end:
            raise ValueError("tensors overlap")
    return base, tensors


def _stream_crcs(handle: Any, base: int, tensors: dict[str, tuple[int, int]], size: int) -> tuple[int, dict[str, int]]:
    """Whole-file CRC-32 and each tensor's, reading the file once in BLOCK_BYTES blocks."""
    order = sorted(tensors, key=lambda name: tensors[name])
    crcs = dict.fromkeys(order, 0)
    segments = iter(_segments(order, tensors, size))
    name, begin, end = next(segments)
    whole, crc = 0, 0
    buffer = bytearray(min(BLOCK_BYTES, max(size, 1)))
    handle.seek(0)
    at = 0
    while at < size:
        got = handle.readinto(buffer)
        if not got:
            raise OSError(f"file shrank to {at} bytes while being read")
        view = memoryview(buffer)[:got]
        offset = 0
        while offset < got:
            take = min(end - at, got - offset)
            piece = view[offset : offset + take]
            if name is None:
                whole = zlib.crc32(piece, whole)
            else:
                crc = zlib.crc32(piece, crc)
            offset, at = offset + take, at + take
            if at == end:
                if name is not None:
                    crcs[name] = crc
                    whole = crc32_combine(whole, crc, end - begin)
                    crc = 0
                name, begin, end = next(segments, (None, size, size))
    return whole, crcs


def _segments(
    order: list[str], tensors: dict[str, tuple[int, int]], size: int
) -> Iterator[tuple[str | None, int, int]]:
    """The file cut into non-empty (tensor name or None for other bytes, begin, end) ranges, in order."""
    at = 0
    for name in order:
        begin, end = tensors[name]
        if begin > at:
            yield None, at, begin
        if end > begin:
            yield name, begin, end
        at = end
    if size > at:
        yield None, at, size


# ---------------------------------------------------------------------------------------- text


def format_report(report: VerifyReport, show: int = 10) -> str:
    """The human summary: counts, then one line per problem (file, tensor, affected requests)."""
    lines = [
        f"{report.root}: {report.shards} shards listed: {len(report.verified)} verified, "
        f"{len(report.corrupted)} corrupted, {len(report.missing)} missing, {len(report.unverifiable)} unverifiable; "
        f"{len(report.ignored)} unlisted files ignored; {report.requests} requests, "
        f"{len(report.affected_requests)} affected"
    ]
    for check in report.corrupted + report.missing:
        affects = _affects(check.requests, show)
        lines.extend(
            f"{check.status}: {check.file} (shard {check.id}): {problem}; {affects}" for problem in check.problems
        )
    for problem in report.unknown_shards:
        lines.append(
            f"unknown shard: {INDEX_FILE} line {problem.line}: request {problem.request} names shards "
            f"{problem.shards} that no shard line lists; its rows cannot be read"
        )
    lines.extend(f"bad index line: {INDEX_FILE} line {p.line}: {p.problem}" for p in report.bad_index_lines)
    notes = [f"unverifiable: {c.file} (shard {c.id}): {'; '.join(c.problems)}" for c in report.unverifiable]
    notes += [f"ignored: {name} is not listed in {INDEX_FILE} (readers ignore it too)" for name in report.ignored]
    lines.extend(notes[:show])
    if len(notes) > show:
        lines.append(f"... and {len(notes) - show} more unverifiable or ignored files")
    if report.torn_tail:
        lines.append(
            f"torn tail: {INDEX_FILE} ends in a {report.torn_tail_bytes}-byte line without a newline "
            "(a crash mid-append; readers skip it, the next writer cuts it)"
        )
    if report.ok:
        lines.append("OK: every listed shard that has checksums verifies")
    else:
        lines.append(
            f"FAILED: {len(report.corrupted)} corrupted, {len(report.missing)} missing, "
            f"{len(report.unknown_shards)} requests naming unknown shards, "
            f"{len(report.bad_index_lines)} bad index lines"
        )
    return "\n".join(lines)


def _affects(requests: list[str], show: int) -> str:
    if not requests:
        return "affects no request"
    more = f" and {len(requests) - show} more" if len(requests) > show else ""
    return f"affects {len(requests)} requests: {', '.join(requests[:show])}{more}"
