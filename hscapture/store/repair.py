"""``hscapture verify --repair``: rebuild a store's listing from what its shards say about themselves.

Every shard carries its run id, the ids of the requests whose rows it holds, and each row's
position and token id, so a damaged or shortened ``index.jsonl`` can be rebuilt from the shards:

* lines that are not JSON, not valid records or fail their ``line_crc32`` are dropped;
* shard files on disk that no line lists are listed from their own bytes, once their rows match the
  row checksums written inside them; one that does not (or cannot be read) is set aside as
  ``shard-NNNNNN.safetensors.damaged`` (a reader never serves it);
* every request with rows in a listed shard but no line left is recorded ``incomplete`` with the
  spans and positions its shards hold, so an extraction run again captures it anew;
* a request id listed complete more than once keeps its first complete line, the later ones become
  incomplete (a store never lists a key complete twice);
* every listed shard is checked against its line's checksums; a request that would read damaged bytes
  (its rows that fail their row checksums, any row of a shard whose small tensors fail theirs, a
  shard that is missing or unreadable, or a donor's rows it takes by reference from such a request)
  is recorded ``incomplete`` with reason ``damaged: ...``, so readers, ``CaptureDataset`` and
  ``export`` skip it by default and an extraction run again captures it anew.

What it cannot rebuild it leaves for ``verify`` to report: a request's finish (its loss mask and
expected length are only in its lost line), a shard whose file is gone, damaged rows. The old index is
kept beside the new one as ``index.jsonl.before-repair-<unix time>``. A version-1 store comes out
version 2 (every line with its checksum). The store's lock is held throughout: no writer runs meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hscapture.errors import StoreError
from hscapture.store.checksum import row_crcs
from hscapture.store.directory import StoreDir
from hscapture.store.files import lock_store, replace_file
from hscapture.store.format import (
    INDEX_FILE,
    META_FILE,
    ROW_CRC,
    STORE_VERSION,
    read_meta,
    scan_index,
    shard_files,
)
from hscapture.store.index import rewrite_index
from hscapture.store.records import Request, once, request_record
from hscapture.store.recovery import collect_requests, open_shard, shard_line
from hscapture.store.references import follow_references
from hscapture.store.shardfile import ShardFile

#: Why a request rebuilt from the shards is incomplete.
LOST = "index line lost; rebuilt from the shards by hscapture verify --repair (capture it again)"
#: Why a request that would read damaged bytes is incomplete (the reason begins with ``damaged: ``).
DAMAGED = "damaged: {why}; marked by hscapture verify --repair (capture it again)"


@dataclass
class RepairReport:
    """What ``repair_store`` changed. Lists are file names, request ids, or ``(line, problem)`` pairs;
    ``backup`` names the old index, kept (empty when nothing was rewritten)."""

    root: str
    dropped_lines: list[tuple[int, str]] = field(default_factory=list)
    torn_bytes: int = 0
    listed: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    upgraded: bool = False
    backup: str = ""

    @property
    def changed(self) -> bool:
        return bool(self.backup)


def repair_store(path: str | Path) -> RepairReport:
    """Rebuild the index of the store at ``path`` from its shards; see the module docstring.

    Raises:
        StoreError: not a store, a damaged ``meta.json`` (what was captured cannot be told from the
            shards alone: fix it by hand), or a writer holds the store.
    """
    root = Path(path)
    with StoreDir.open(root) as directory:  # every file below is reached through it, wherever it moves
        return _repair(directory)


def _repair(directory: StoreDir) -> RepairReport:
    root = directory.path
    meta = read_meta(directory)
    if meta is None:
        raise StoreError(f"{root}: no {META_FILE}; not an hscapture store")
    report = RepairReport(str(root))
    mode = directory.file_mode
    lock = lock_store(directory, 1.0, mode)
    try:
        scan = scan_index(directory, meta["version"])
        report.torn_bytes = scan.torn_bytes
        records = [line.record for line in scan.lines if line.record is not None]
        report.dropped_lines = [(line.number, line.problem) for line in scan.lines if line.record is None]
        found = _relist(directory, meta, records, report)
        complete: set[str] = set()
        for i, record in enumerate(records):
            if record["type"] == "request":
                records[i] = once(record, complete)
                if records[i] is not record:
                    report.duplicates.append(record["id"])
        rebuilt = [request_record(request_id, request) for (_, request_id), request in found.items()]
        report.rebuilt = [line["id"] for line in rebuilt]
        _mark_damaged(directory, meta, records, report)
        stale = meta["version"] < STORE_VERSION
        changes = (report.dropped_lines, report.torn_bytes, report.listed, rebuilt, report.duplicates, report.damaged)
        if not (any(changes) or stale):
            return report
        report.backup = f"{INDEX_FILE}.before-repair-{time.time_ns()}"
        with contextlib.suppress(FileNotFoundError):
            directory.link(INDEX_FILE, report.backup)
        rewrite_index(directory, [*records, *rebuilt], mode)
        if stale:
            replace_file(directory, META_FILE, json.dumps({**meta, "version": STORE_VERSION}, indent=2).encode(), mode)
            report.upgraded = True
    finally:
        lock.close()
    return report


def _relist(
    directory: StoreDir, meta: dict[str, Any], records: list[dict[str, Any]], report: RepairReport
) -> dict[tuple[str, str], Request]:
    """List the unlisted shards (appending their lines to ``records``); the requests with rows in the
    store's shards that no line records, with the rows each shard holds."""
    listed = {r["id"]: r for r in records if r["type"] == "shard"}
    recorded = {r["id"] for r in records if r["type"] == "request"}
    found: dict[tuple[str, str], Request] = {}
    for shard_id, path in sorted(shard_files(directory).items()):
        line = listed.get(shard_id)
        shard = open_shard(directory, path.name, meta, None if line is None else line["bytes"], shard_id)
        if line is None:
            line = None if shard is None else shard_line(shard)
            if line is None:
                directory.replace(path.name, path.name + ".damaged")
                report.set_aside.append(path.name)
                continue
            records.append(line)
            report.listed.append(path.name)
        if shard is not None:
            collect_requests(shard, recorded, found, LOST)
    return found


def _mark_damaged(
    directory: StoreDir, meta: dict[str, Any], records: list[dict[str, Any]], report: RepairReport
) -> None:
    """Record incomplete (in ``records``) every request line that would read damaged bytes; see the module
    docstring. Lines marked by an earlier repair are left as they are."""
    damage = {r["id"]: found for r in records if r["type"] == "shard" and (found := _damage(directory, meta, r))}
    if not damage:
        return
    served: dict[str, int] = {}  # per id, the line a reader serves: its first complete one, else its last
    for i, record in enumerate(records):
        if record["type"] == "request":
            held = served.get(record["id"])
            if held is None or records[held]["status"] != "complete":
                served[record["id"]] = i
    why: dict[str, str] = {}
    for request_id, i in served.items():
        for shard_id, start, count in records[i]["spans"]:
            if shard_id in damage:
                problem, rows = damage[shard_id]
                if rows is None or bool(((rows >= start) & (rows < start + count)).any()):
                    why[request_id] = problem
                    break
    references = follow_references({request_id: records[i] for request_id, i in served.items()})
    for request_id, donors in references.donors.items():
        bad = next((donor for donor in donors if donor in why), None)
        if bad is not None and request_id not in why:
            why[request_id] = f"takes rows from request {bad!r}, whose rows are damaged ({why[bad]})"
    for request_id, problem in why.items():
        record = records[served[request_id]]
        if record["reason"].startswith("damaged: ") or "; damaged: " in record["reason"]:
            continue  # marked by an earlier repair
        reason = DAMAGED.format(why=problem)
        records[served[request_id]] = {
            **record,
            "status": "incomplete",
            "reason": reason if record["status"] == "complete" else f"{record['reason']}; {reason}",
        }
        report.damaged.append(request_id)


def _damage(directory: StoreDir, meta: dict[str, Any], line: dict[str, Any]) -> tuple[str, np.ndarray | None] | None:
    """What is wrong with a listed shard and which of its rows it damages (None: all of them, as a reader then
    refuses every request it holds); None when its bytes match the line's checksums (or it has none)."""
    name = line["file"]
    try:
        shard = ShardFile(directory.file(name), meta, line["bytes"], line["id"], directory.fd)
    except StoreError as exc:
        return str(exc).replace(str(directory.file(name)), name), None
    expected: dict[str, str] = line.get("tensor_crc32", {})
    bad = [tensor for tensor, crc in shard.crcs()[1].items() if expected.get(tensor, f"{crc:08x}") != f"{crc:08x}"]
    if not bad:
        return None
    planes = [tensor for tensor in bad if tensor in shard.names]
    if len(planes) < len(bad) or ROW_CRC not in shard.header.tensors:  # read whole by every reader of the shard
        return f"{name}: tensors {bad} fail their checksums", None
    table = shard.array(ROW_CRC)
    rows = [np.flatnonzero(row_crcs(shard.data(t)) != table[:, shard.names.index(t)]) for t in planes]
    return f"{name}: rows of {', '.join(planes)} fail their checksums", np.unique(np.concatenate(rows))


def format_repair(report: RepairReport) -> str:
    """What the repair did, a line per kind of change."""
    if not report.changed:
        return f"{report.root}: the index needed no repair"
    lines = [f"{report.root}: index rebuilt; the old one is kept as {report.backup}"]
    lines += [f"dropped: {INDEX_FILE} line {number}: {problem}" for number, problem in report.dropped_lines]
    if report.torn_bytes:
        lines.append(f"dropped: a torn last line of {report.torn_bytes} bytes")
    lines += [f"listed: {name}, found on disk unlisted (from its own bytes)" for name in report.listed]
    lines += [
        f"set aside: {name} -> {name}.damaged (unreadable, or rows that fail their checksums)"
        for name in report.set_aside
    ]
    if report.rebuilt:
        lines.append(f"rebuilt: {_some(report.rebuilt)} whose lines were lost, recorded incomplete")
    if report.duplicates:
        lines.append(f"duplicates: later complete lines of {_some(report.duplicates)} recorded incomplete")
    if report.damaged:
        lines.append(
            f"marked: {_some(report.damaged)} whose rows are damaged, recorded incomplete (readers, CaptureDataset "
            "and export skip them; capture them again)"
        )
    if report.upgraded:
        lines.append(f"upgraded: store version {STORE_VERSION} (every index line carries its checksum)")
    return "\n".join(lines)


def _some(ids: list[str], show: int = 10) -> str:
    more = f" and {len(ids) - show} more" if len(ids) > show else ""
    return f"{len(ids)} requests ({', '.join(ids[:show])}{more})"
