"""Closing runs whose consumer died: no request with durable rows goes unrecorded.

A consumer killed mid-run leaves durable shards whose requests never got an index line (their
lines wait for the request to finish). The next writer of the store finds every run without a
``run_end`` line, reads the request table of each of that run's shards (the small
``request_index`` and ``positions`` tensors only), and records each unrecorded request as
incomplete, with its spans and the positions it lacks, before writing anything new.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from hscapture.store.format import shard_name
from hscapture.store.records import Request, request_record

log = logging.getLogger(__name__)

REASON = "consumer died before the request was recorded"


def recover_open_runs(root: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Index lines that close every run left open by a dead consumer (empty when none is).

    Args:
        root: the store directory.
        records: its index lines, as :func:`hscapture.store.format.read_index` returns them.
    """
    # One writer at a time appends to the index, so a session is the stretch of lines from its
    # "run" line to its "run_end"; the same run can have several sessions (a consumer re-attached).
    opened: dict[str, int] = {}
    for position, record in enumerate(records):
        if record["type"] == "run":
            opened[record["run_id"]] = position
        elif record["type"] == "run_end":
            opened.pop(record["run_id"], None)
    found: dict[tuple[str, str], Request] = {}
    for run_id, start in opened.items():
        session = records[start + 1 :]
        recorded = {r["id"] for r in session if r["type"] == "request"}
        for shard in (r for r in session if r["type"] == "shard"):
            _collect(root, shard["id"], run_id, recorded, found)
    lines = [request_record(request_id, request) for (_, request_id), request in found.items()]
    lines += [{"type": "run_end", "run_id": run, "reason": "consumer died", "counters": {}} for run in opened]
    if found:
        log.warning("recovered %d requests of %d run(s) left open by a dead consumer", len(found), len(opened))
    return lines


def _collect(root: Path, shard_id: int, run_id: str, recorded: set[str], found: dict[tuple[str, str], Request]) -> None:
    """Add the rows of one shard to every request of ``run_id`` that has no index line."""
    path = root / shard_name(shard_id)
    try:
        with safe_open(str(path), framework="np") as handle:
            meta = handle.metadata() or {}
            if meta.get("run_id") != run_id:
                return
            owners = handle.get_tensor("request_index")
            positions = handle.get_tensor("positions")
            request_ids = json.loads(meta["request_ids"])
    except (OSError, KeyError, ValueError) as exc:
        log.warning("%s: unreadable while recovering a dead consumer's run (%s); skipped", path, exc)
        return
    for local, request_id in enumerate(request_ids):
        if request_id in recorded:
            continue
        request = found.setdefault((run_id, request_id), Request(run_id, end_reason=REASON))
        rows = np.flatnonzero(owners == local)
        for block in np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1):
            if block.size:
                request.add(shard_id, int(block[0]), positions[block])
