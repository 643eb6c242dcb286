"""Closing runs whose consumer died: no request with durable rows goes unrecorded.

A consumer killed mid-run leaves durable shards whose requests never got an index line (their
lines wait for the request to finish), and possibly shards it renamed into place but never listed
(killed between the rename and the index append). The next writer of the store finds every run
without a ``run_end`` line, lists that run's unlisted shards from their own bytes (once their rows
match the row checksums written inside them), reads the request table of each of the run's shards
(the small ``request_index`` and ``positions`` tensors only), and records each unrecorded request
as incomplete, with its spans and the positions it lacks, before writing anything new.
``hscapture verify --repair`` rebuilds a damaged index with the same pieces.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hscapture.errors import StoreError
from hscapture.store.checksum import row_crcs
from hscapture.store.directory import StoreDir
from hscapture.store.format import ROW_CRC, shard_files
from hscapture.store.records import Request, request_record
from hscapture.store.shardfile import ShardFile

log = logging.getLogger(__name__)

REASON = "consumer died before the request was recorded"


def recover_open_runs(
    directory: StoreDir, records: list[dict[str, Any]], meta: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """Index lines that close every run left open by a dead consumer (empty when none is).

    Args:
        directory: the store.
        records: its index lines, as :func:`hscapture.store.format.read_index` returns them.
        meta: its ``meta.json`` (None: no run ever began, so none is open).
    """
    # One writer at a time appends to the index, so a session is the stretch of lines from its
    # "run" line to its "run_end"; the same run can have several sessions (a consumer re-attached).
    opened: dict[str, int] = {}
    for position, record in enumerate(records):
        if record["type"] == "run":
            opened[record["run_id"]] = position
        elif record["type"] == "run_end":
            opened.pop(record["run_id"], None)
    if not opened or meta is None:
        return []
    found: dict[tuple[str, str], Request] = {}
    recorded: dict[str, set[str]] = {}
    for run_id, start in opened.items():
        session = records[start + 1 :]
        recorded[run_id] = {r["id"] for r in session if r["type"] == "request"}
        for line in (r for r in session if r["type"] == "shard"):
            shard = open_shard(directory, line["file"], meta, line["bytes"], line["id"])
            if shard is not None and shard.run_id == run_id:
                collect_requests(shard, recorded[run_id], found, REASON)
    listed = {r["id"] for r in records if r["type"] == "shard"}
    adopted = []
    for shard_id, path in sorted(shard_files(directory).items()):
        shard = None if shard_id in listed else open_shard(directory, path.name, meta, shard_id=shard_id)
        if shard is None or shard.run_id not in opened:
            continue
        line = shard_line(shard)
        if line is not None:
            adopted.append(line)
            collect_requests(shard, recorded[shard.run_id], found, REASON)
    lines = adopted + [request_record(request_id, request) for (_, request_id), request in found.items()]
    lines += [{"type": "run_end", "run_id": run, "reason": "consumer died", "counters": {}} for run in opened]
    if found or adopted:
        log.warning(
            "recovered %d requests and %d unlisted shards of %d run(s) left open by a dead consumer",
            len(found), len(adopted), len(opened),
        )  # fmt: skip
    return lines


def open_shard(
    directory: StoreDir, name: str, meta: dict[str, Any], size: int | None = None, shard_id: int = -1
) -> ShardFile | None:
    """The shard ``name`` of the store, or None (logged) when it cannot be read."""
    try:
        return ShardFile(directory.file(name), meta, size, shard_id, directory.fd)
    except StoreError as exc:
        log.warning("%s; skipped", exc)
        return None


def shard_line(shard: ShardFile) -> dict[str, Any] | None:
    """The index line of a shard found on disk but not listed, from its own bytes; None (logged) when its
    rows differ from the row checksums written inside it (a damaged shard is never listed as good)."""
    if ROW_CRC in shard.header.tensors:
        table = shard.array(ROW_CRC)
        for column, name in enumerate(shard.names):
            if not np.array_equal(row_crcs(shard.data(name)), table[:, column]):
                log.warning("%s: rows of %s differ from its row checksums; left unlisted", shard.path, name)
                return None
    whole, tensors = shard.crcs()
    return {
        "type": "shard",
        "id": shard.shard_id,
        "file": shard.path.name,
        "rows": shard.rows,
        "bytes": shard.size,
        "crc32": f"{whole:08x}",
        "tensor_crc32": {name: f"{crc:08x}" for name, crc in tensors.items()},
    }


def collect_requests(shard: ShardFile, recorded: set[str], found: dict[tuple[str, str], Request], reason: str) -> None:
    """Add the rows of one shard to every request of its run that is not in ``recorded``, in row order."""
    owners = shard.array("request_index")
    positions = shard.array("positions")
    for local, request_id in enumerate(shard.request_ids):
        if request_id in recorded:
            continue
        request = found.setdefault((shard.run_id, request_id), Request(shard.run_id, end_reason=reason))
        rows = np.flatnonzero(owners == local)
        for block in np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1):
            if block.size:
                request.add(shard.shard_id, int(block[0]), positions[block])
