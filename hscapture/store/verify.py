"""Integrity check of a store: ``meta.json``, every index line, every shard against its checksums.

``verify_store(path)`` trusts nothing but the bytes: it reads ``index.jsonl`` itself (not through
the reader), checks every line (its ``line_crc32`` in a version-2 store, and its fields), parses
each shard's safetensors header by hand, and streams the file in 8 MiB blocks, computing the CRC-32
of every tensor's data (located by the header's offsets) and of the whole file in one pass. A shard
line carries ``crc32`` (whole file) and ``tensor_crc32`` (per tensor), so a flipped byte is pinned
to a tensor, or to the header when every tensor still matches. While a shard is open, the rows each
request's spans name must hold that request (``request_index``), so a damaged span is caught even
in a version-1 store, whose lines carry no checksum. Shard files on disk that no line lists, and
requests whose rows a listed shard holds but that no line records, are lost index lines (unless a
writer is at work on the store); a request id listed complete twice is a fault too. See FORMAT.md.

Integrity is per shard and per tensor within it, not per chunk: the writer packs the rows of many
chunks and requests into one shard. A request's ``spans`` name the shards holding its rows, which
is how a bad shard maps to the requests it damages.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hscapture.errors import StoreError
from hscapture.store.checksum import crc32_combine
from hscapture.store.directory import StoreDir
from hscapture.store.format import (
    INDEX_FILE,
    LOCK_FILE,
    META_FILE,
    READ_VERSIONS,
    SHARD_FILE,
    STORE_FORMAT,
    ShardHeader,
    meta_problem,
    parse_shard_header,
    scan_index,
    shard_files,
)
from hscapture.store.references import follow_references

BLOCK_BYTES = 8 << 20

#: A request's span: (request id, its index line, first row, rows).
_Span = tuple[str, int, int, int]


@dataclass
class IndexProblem:
    """An index line that is not JSON, not a valid record or fails its checksum; a request naming an
    unlisted shard, or rows that are not its own; a request id listed complete twice."""

    line: int
    problem: str
    request: str = ""
    shards: list[int] = field(default_factory=list)


@dataclass
class ShardCheck:
    """The verdict on one shard listed in the index, or found on disk unlisted.

    ``status`` is ``ok``, ``corrupted``, ``missing``, ``unverifiable`` (listed without checksums,
    i.e. written before they existed; its header and size were still checked) or ``lost`` (on disk,
    listed by no line). ``tensors`` names the tensors whose bytes do not match their checksum;
    ``problems`` says what is wrong, one phrase each; ``requests`` are the ids whose spans touch this
    shard (filled when it is bad; for a lost shard, the ids its header holds); ``misplaced`` the
    spans naming rows of it that hold another request.
    """

    id: int
    file: str
    status: str
    tensors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    misplaced: list[IndexProblem] = field(default_factory=list)


@dataclass
class VerifyReport:
    """What ``verify_store`` found. ``ok`` is true when nothing is corrupted, missing, lost or dangling.

    Unverifiable shards, stray files named like shards (``ignored``), shards a live writer is
    writing (``writing``) and a torn index tail (a crash mid-append; readers skip it) are reported
    but are not failures.
    """

    root: str
    shards: int = 0
    requests: int = 0
    meta_problem: str = ""
    verified: list[ShardCheck] = field(default_factory=list)
    corrupted: list[ShardCheck] = field(default_factory=list)
    missing: list[ShardCheck] = field(default_factory=list)
    unverifiable: list[ShardCheck] = field(default_factory=list)
    lost: list[ShardCheck] = field(default_factory=list)
    affected_requests: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    writing: list[str] = field(default_factory=list)
    torn_tail: bool = False
    torn_tail_bytes: int = 0
    unknown_shards: list[IndexProblem] = field(default_factory=list)
    bad_index_lines: list[IndexProblem] = field(default_factory=list)
    misplaced: list[IndexProblem] = field(default_factory=list)
    duplicates: list[IndexProblem] = field(default_factory=list)
    #: Requests whose references (``shared``) cannot be followed: a donor not held, lacking the rows, a cycle.
    dangling: list[IndexProblem] = field(default_factory=list)
    #: Requests whose rows listed shards hold, recorded by no line (lost lines, or a dead writer's).
    unrecorded: list[str] = field(default_factory=list)
    #: Those of them whose rows lie in shards of a run that never ended: its writer stopped before recording
    #: them (killed, or a write failed, e.g. on a full disk); the next writer of the store records them.
    unended: list[str] = field(default_factory=list)
    #: How many such requests a live writer has still to record (not a failure).
    pending: int = 0
    #: Requests captured at some positions only, per selection (``--positions``): complete against what they asked.
    selections: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (
            self.meta_problem
            or self.corrupted
            or self.missing
            or self.lost
            or self.unrecorded
            or self.unknown_shards
            or self.bad_index_lines
            or self.misplaced
            or self.duplicates
            or self.dangling
        )

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **dataclasses.asdict(self)}


def verify_store(
    path: str | Path,
    jobs: int = 4,
    progress: Callable[[Iterable[ShardCheck], int], Iterable[ShardCheck]] | None = None,
) -> VerifyReport:
    """Check ``meta.json``, every index line and every shard the index lists; find unlisted shards.

    Args:
        path: the store directory.
        jobs: shards checked in parallel (reading and CRC-32 release the GIL).
        progress: wraps the iterator of finished checks, given it and the shard count (e.g. tqdm).

    Raises:
        StoreError: ``path`` is not a store (no directory, no ``index.jsonl`` or ``meta.json``, or
            a ``meta.json`` of another format or version).
    """
    root = Path(path)
    if not root.is_dir():
        raise StoreError(f"{root}: not a directory, so not an hscapture store")
    with StoreDir.open(root) as directory:  # every file is read through it, never through a link
        return _verify(directory, jobs, progress)


def _verify(
    directory: StoreDir, jobs: int, progress: Callable[[Iterable[ShardCheck], int], Iterable[ShardCheck]] | None
) -> VerifyReport:
    meta = _check_is_store(directory)
    report = VerifyReport(root=str(directory.path), meta_problem=meta_problem(meta))
    shards, requests, stopped = _read_index(directory, report, meta["version"])
    report.shards, report.requests = len(shards), len(requests)

    touching: dict[int, list[str]] = {}
    spans: dict[int, list[_Span]] = {}
    references = follow_references({request_id: record for request_id, (_, record) in requests.items()})
    for request_id, problem in references.broken.items():
        report.dangling.append(IndexProblem(requests[request_id][0], problem, request_id))
    for request_id, (line, record) in requests.items():
        if "positions" in record:
            report.selections[record["positions"]] = report.selections.get(record["positions"], 0) + 1
        request_spans = record["spans"]
        unknown = sorted({s[0] for s in request_spans if s[0] not in shards})
        if unknown:
            report.unknown_shards.append(
                IndexProblem(line, f"request names shards {unknown} that no shard line lists", request_id, unknown)
            )
        for shard_id, start, count in request_spans:
            spans.setdefault(shard_id, []).append((request_id, line, start, count))
        for shard_id in dict.fromkeys(s[0] for s in request_spans):
            touching.setdefault(shard_id, []).append(request_id)
    writing = _writer_alive(directory)
    _find_unlisted(directory, report, set(shards), writing)

    records = sorted(shards.values(), key=lambda record: record["id"])
    holds: dict[int, list[str]] = {}  # per shard, the request ids its header names
    buckets = {
        "ok": report.verified,
        "corrupted": report.corrupted,
        "missing": report.missing,
        "unverifiable": report.unverifiable,
    }
    pool = ThreadPoolExecutor(max(1, jobs), thread_name_prefix="hscapture-verify")
    try:
        checks: Iterable[ShardCheck] = pool.map(
            lambda r: _check_shard(directory, r, spans.get(r["id"], []), holds), records
        )
        if progress is not None:
            checks = progress(checks, len(records))
        for check in checks:
            buckets[check.status].append(check)
            report.misplaced.extend(check.misplaced)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # Ctrl-C: do not go on reading a TB store

    unrecorded = sorted({request_id for ids in holds.values() for request_id in ids} - set(requests))
    if writing:
        report.pending = len(unrecorded)
    else:
        report.unrecorded = unrecorded
        report.unended = sorted({r for shard_id in stopped for r in holds.get(shard_id, ())} & set(unrecorded))
    for request_id, donors in references.donors.items():  # a damaged donor damages every request reading it
        for shard_id in dict.fromkeys(s[0] for donor in donors for s in requests[donor][1]["spans"]):
            if request_id not in touching.setdefault(shard_id, []):
                touching[shard_id].append(request_id)
    bad = {check.id for check in report.corrupted + report.missing}
    for check in report.corrupted + report.missing:
        check.requests = touching.get(check.id, [])
    named = {p.request for p in report.unknown_shards + report.misplaced + report.duplicates + report.dangling}
    reading = {request_id for shard_id in bad for request_id in touching.get(shard_id, [])}
    report.affected_requests = [
        request_id for request_id in requests if request_id in named or request_id in reading
    ] + report.unrecorded
    return report


# ---------------------------------------------------------------------------------------- index


def _check_is_store(directory: StoreDir) -> dict[str, Any]:
    """``meta.json``, parsed, once it says this is a store of a version this hscapture reads."""
    root = directory.path
    found = {}
    for name in (INDEX_FILE, META_FILE):  # a link in their place is refused, never followed
        fd = directory.open_regular(name)
        if fd is None:
            raise StoreError(f"{root}: no {name}; not an hscapture store (or nothing was captured into it yet)")
        with os.fdopen(fd, "rb") as handle:
            found[name] = handle.read() if name == META_FILE else b""
    try:
        meta = json.loads(found[META_FILE])
    except ValueError as exc:
        raise StoreError(f"{root / META_FILE}: unreadable ({exc}); not an hscapture store") from None
    if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise StoreError(f"{root / META_FILE}: format {found!r}, not {STORE_FORMAT!r}; not an hscapture store")
    if meta.get("version") not in READ_VERSIONS:
        raise StoreError(
            f"{root / META_FILE}: store version {meta.get('version')!r}; this hscapture reads versions {READ_VERSIONS}"
        )
    return meta


def _read_index(
    directory: StoreDir, report: VerifyReport, version: int
) -> tuple[dict[int, dict[str, Any]], dict[str, tuple[int, dict[str, Any]]], set[int]]:
    """Shard lines by id; per request id the line a reader serves (its first complete line, else its last)
    with its number; the shards listed by a writer session that never ended (no ``run_end`` after its
    ``run`` line). Bad lines and ids listed complete twice go into the report."""
    scan = scan_index(directory, version)
    report.torn_tail, report.torn_tail_bytes = scan.torn_bytes > 0, scan.torn_bytes
    shards: dict[int, dict[str, Any]] = {}
    requests: dict[str, tuple[int, dict[str, Any]]] = {}
    complete: dict[str, int] = {}
    session: dict[int, int] = {}  # per shard, the line of the run it was listed in (one writer at a time)
    running: dict[str, int] = {}  # per run id, the line of its session not ended yet
    for line in scan.lines:
        record = line.record
        if record is None:
            report.bad_index_lines.append(IndexProblem(line.number, line.problem))
        elif record["type"] == "run":
            running[record["run_id"]] = line.number
        elif record["type"] == "run_end":
            running.pop(record["run_id"], None)
        elif record["type"] == "shard":
            shards[record["id"]] = record
            session[record["id"]] = max(running.values(), default=0)
        elif record["type"] == "request":
            request_id = record["id"]
            if request_id in complete:
                if record["status"] == "complete":
                    problem = f"request listed complete again (first on line {complete[request_id]})"
                    report.duplicates.append(IndexProblem(line.number, problem, request_id))
                continue
            if record["status"] == "complete":
                complete[request_id] = line.number
            requests.pop(request_id, None)  # the later line, in its position
            requests[request_id] = (line.number, record)
    unended = set(running.values())
    return shards, requests, {shard_id for shard_id, start in session.items() if start in unended}


def _find_unlisted(directory: StoreDir, report: VerifyReport, listed: set[int], writing: bool) -> None:
    """Shard files no line lists: lost index lines, unless a live writer is writing them right now."""
    report.ignored = sorted(
        name for name in directory.names() if name.startswith("shard-") and not SHARD_FILE.fullmatch(name)
    )
    newest = max(listed, default=-1)
    for shard_id, path in sorted(shard_files(directory).items()):
        if shard_id in listed:
            continue
        if writing and shard_id > newest:
            report.writing.append(path.name)
            continue
        check = ShardCheck(shard_id, path.name, "lost", problems=[f"on disk but listed by no line of {INDEX_FILE}"])
        try:
            with _open(directory, path.name) as handle:
                check.requests = _request_ids(_parse_header(handle, _file_size(handle)))
        except (OSError, ValueError) as exc:
            check.problems.append(f"header unreadable: {_reason(exc)}")
        report.lost.append(check)


def _writer_alive(directory: StoreDir) -> bool:
    """Whether a writer holds the store's lock (probed with a shared lock, released at once)."""
    try:
        fd = directory.open_file(LOCK_FILE, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False


# ---------------------------------------------------------------------------------------- shards


def _check_shard(
    directory: StoreDir, record: dict[str, Any], spans: list[_Span], holds: dict[int, list[str]]
) -> ShardCheck:
    """The verdict on one listed shard; the request ids its header names go into ``holds``."""
    check = ShardCheck(id=record["id"], file=record["file"], status="ok")
    try:
        handle = _open(directory, record["file"])
    except FileNotFoundError:
        check.status = "missing"
        check.problems.append("file not found")
        return check
    except OSError as exc:
        check.status = "missing"
        check.problems.append(f"cannot open: {_reason(exc)}")
        return check
    with handle:
        try:
            holds[record["id"]] = _check_shard_bytes(handle, record, check, spans)
        except OSError as exc:
            check.problems.append(f"read error: {exc.strerror or exc}")
    if check.problems:
        check.status = "corrupted"
    elif "crc32" not in record:
        check.status = "unverifiable"
        check.problems.append("no crc32 in its index line (written before checksums); only header and size checked")
    return check


def _check_shard_bytes(handle: Any, record: dict[str, Any], check: ShardCheck, spans: list[_Span]) -> list[str]:
    """Check one shard's bytes into ``check``; returns the request ids its header names."""
    size = _file_size(handle)
    if size != record["bytes"]:
        check.problems.append(f"{size} bytes on disk, the index says {record['bytes']}")
    try:
        header = _parse_header(handle, size)
    except ValueError as exc:
        check.problems.append(f"header unreadable: {exc}")
        return []
    table = _request_ids(header)
    _check_spans(handle, header, table, record["id"], spans, check)
    expected: dict[str, str] = record.get("tensor_crc32", {})
    if "crc32" not in record:
        return table  # nothing to compare the bytes with
    tensors = {name: (entry.begin, entry.end) for name, entry in header.tensors.items()}
    if expected and set(expected) != set(tensors):
        check.problems.append(f"header lists tensors {sorted(tensors)}, the index checksums {sorted(expected)}")
    whole, crcs = _stream_crcs(handle, tensors, size)
    for name, crc in crcs.items():
        want = expected.get(name)
        if want is not None and want != f"{crc:08x}":
            check.tensors.append(name)
            check.problems.append(f"tensor {name}: crc32 {crc:08x}, the index says {want}")
    if f"{whole:08x}" != record["crc32"] and not check.tensors:
        where = "every tensor matches: the header differs" if expected else "no per-tensor checksums to narrow it"
        check.problems.append(f"file crc32 {whole:08x}, the index says {record['crc32']} ({where})")
    return table


def _open(directory: StoreDir, name: str) -> Any:
    """A shard file of the store, opened for reading, never through a link (``ELOOP`` if it is one)."""
    return os.fdopen(directory.open_file(name, os.O_RDONLY | os.O_NONBLOCK), "rb")


def _reason(exc: Exception) -> str:
    """What an error opening or reading a shard says, a link named as such."""
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return "a symbolic link, which hscapture never follows (another user may have planted it)"
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _request_ids(header: ShardHeader) -> list[str]:
    try:
        table = json.loads(header.metadata.get("request_ids", "[]"))
    except ValueError:
        return []
    return [r for r in table if isinstance(r, str)] if isinstance(table, list) else []


def _check_spans(
    handle: Any, header: ShardHeader, table: list[str], shard_id: int, spans: list[_Span], check: ShardCheck
) -> None:
    """Each span naming rows of this shard must name rows its request owns (``request_index``)."""
    entry = header.tensors.get("request_index")
    if not spans or entry is None or entry.dtype != "I32":
        return
    handle.seek(entry.begin)
    owners = np.frombuffer(handle.read(entry.end - entry.begin), dtype="<i4")
    for request_id, line, start, count in spans:
        local = table.index(request_id) if request_id in table else -1
        rows = owners[start : start + count]
        if start + count > len(owners) or bool((rows != local).any()):
            held = sorted({table[i] for i in rows.tolist() if 0 <= i < len(table)})[:3]
            problem = f"request names rows {start}..{start + count - 1} of shard {shard_id}, which hold {held}"
            check.misplaced.append(IndexProblem(line, f"{problem}, not its own", request_id, [shard_id]))


def _file_size(handle: Any) -> int:
    handle.seek(0, 2)
    size = handle.tell()
    handle.seek(0)
    return int(size)


def _parse_header(handle: Any, size: int) -> ShardHeader:
    def read(offset: int, count: int) -> bytes:
        handle.seek(offset)
        return bytes(handle.read(count))

    return parse_shard_header(read, size)


def _stream_crcs(handle: Any, tensors: dict[str, tuple[int, int]], size: int) -> tuple[int, dict[str, int]]:
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
        f"{len(report.lost)} unlisted (lost index lines); {len(report.bad_index_lines)} bad index lines; "
        f"{report.requests} requests, "
        f"{len(report.affected_requests)} affected"
    ]
    if report.meta_problem:
        lines.append(f"bad meta.json: {META_FILE}: {report.meta_problem}")
    for check in report.corrupted + report.missing:
        affects = _affects(check.requests, show)
        lines.extend(
            f"{check.status}: {check.file} (shard {check.id}): {problem}; {affects}" for problem in check.problems
        )
    for check in report.lost:
        lines.append(
            f"lost index line: {check.file} (shard {check.id}) is {'; '.join(check.problems)} (holds "
            f"{_listing(check.requests, show)}): its line was lost, or a writer died before listing it; "
            f"hscapture verify --repair {report.root} lists it"
        )
    lost = [request_id for request_id in report.unrecorded if request_id not in report.unended]
    if report.unended:
        lines.append(
            f"unrecorded: {_listing(report.unended, show)} hold rows in listed shards of a run that never ended: its "
            "writer stopped before recording them (a write failed, e.g. on a full disk, or it was killed); run the "
            "same command again, and its writer records them incomplete first (extract then captures them anew), "
            f"or hscapture verify --repair {report.root} records them now"
        )
    if lost:
        lines.append(
            f"lost index lines: {_listing(lost, show)} hold rows in listed shards but no line records "
            f"them: their lines were lost, or a writer died before writing them; hscapture verify --repair "
            f"{report.root} records them incomplete (so does the next writer, for a dead writer's run)"
        )
    for problem in report.unknown_shards:
        lines.append(
            f"unknown shard: {INDEX_FILE} line {problem.line}: request {problem.request} names shards "
            f"{problem.shards} that no shard line lists; its rows cannot be read"
        )
    lines.extend(f"bad index line: {INDEX_FILE} line {p.line}: {p.problem}" for p in report.bad_index_lines)
    kinds = (("misplaced rows", report.misplaced), ("duplicate", report.duplicates), ("dangling", report.dangling))
    for kind, found in kinds:
        lines.extend(f"{kind}: {INDEX_FILE} line {p.line}: request {p.request}: {p.problem}" for p in found[:show])
        if len(found) > show:
            lines.append(f"... and {len(found) - show} more {kind} lines")
    if report.selections:
        kinds = ", ".join(f"--positions {kind}: {n}" for kind, n in report.selections.items())
        lines.append(
            f"positions: requests holding rows at some positions only ({kinds}), complete when holding those asked"
        )
    notes = [f"unverifiable: {c.file} (shard {c.id}): {'; '.join(c.problems)}" for c in report.unverifiable]
    notes += [f"ignored: {name} is not a shard name (readers ignore it too)" for name in report.ignored]
    notes += [f"being written: {name} is not listed yet, and a writer holds the store" for name in report.writing]
    if report.pending:
        notes.append(
            f"being written: {report.pending} requests with rows on disk are not recorded yet (a writer is at work)"
        )
    lines.extend(notes[:show])
    if len(notes) > show:
        lines.append(f"... and {len(notes) - show} more unverifiable, ignored or unlisted files")
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
            f"{len(report.lost)} unlisted shards, {len(report.unrecorded)} unrecorded requests, "
            f"{len(report.unknown_shards)} requests naming unknown shards, "
            f"{len(report.misplaced)} spans naming others' rows, {len(report.duplicates)} duplicate complete lines, "
            f"{len(report.dangling)} references that cannot be followed, "
            f"{len(report.bad_index_lines)} bad index lines{', a bad meta.json' if report.meta_problem else ''}"
        )
    return "\n".join(lines)


def _affects(requests: list[str], show: int) -> str:
    return f"affects {_listing(requests, show)}" if requests else "affects no request"


def _listing(requests: list[str], show: int) -> str:
    more = f" and {len(requests) - show} more" if len(requests) > show else ""
    return f"{len(requests)} requests: {', '.join(requests[:show])}{more}"
