"""Request completeness: which shard rows and positions a request holds, and its index line.

Per request the writer keeps the ``[shard, first row, rows]`` spans of its rows and the runs of
positions they cover; when the request ends, :func:`request_record` turns them into the index
line that says whether it is complete, and if not, why (missing positions, drops, duplicates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hscapture.selection import Positions

#: Why a second complete capture of an id is recorded incomplete.
DUPLICATE = "duplicate: this request id is already stored complete in this store (readers serve that one)"


@dataclass(frozen=True)
class Finish:
    """How a request ended, as its engine said.

    ``reason`` is ``finished``, ``aborted``, ``retracted`` (or another engine word);
    ``num_tokens`` the rows it should have (0: unknown); ``dropped_rows`` how many of them were
    dropped before reaching the store; ``loss_mask`` the half-open position ranges trained on;
    ``prefix_token_ids`` the token ids of its first positions when the engine never forwarded them
    (a prefix-cache hit), so the store can find the request whose rows they are.
    """

    reason: str = "finished"
    num_tokens: int = 0
    dropped_rows: int = 0
    loss_mask: Sequence[Sequence[int]] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    prefix_token_ids: np.ndarray | None = None
    #: The positions asked of it (``--positions``, :class:`~hscapture.selection.Positions`); empty: every one.
    positions: str = ""


@dataclass
class Request:
    run_id: str
    spans: list[list[int]] = field(default_factory=list)  # [shard_id, first row, rows]
    rows: int = 0
    runs: list[list[int]] = field(default_factory=list)  # position runs [start, end)
    finished: Finish | None = None
    end_reason: str = ""
    #: When the writer first saw it: request lines are written in this order.
    order: int = 0
    #: Its index line once its shards are listed, waiting for the lines of donors it names (``shared``).
    line: dict[str, Any] | None = None

    def add(self, shard_id: int, row: int, positions: np.ndarray) -> None:
        """``len(positions)`` rows of this request at shard ``shard_id`` rows ``row...``, in arrival order."""
        count, spans = len(positions), self.spans
        if spans and spans[-1][0] == shard_id and spans[-1][1] + spans[-1][2] == row:
            spans[-1][2] += count
        else:
            spans.append([shard_id, row, count])
        self.rows += count
        add_runs(self.runs, positions)


def add_runs(runs: list[list[int]], positions: np.ndarray) -> None:
    """Append ``positions`` to a list of ``[start, end)`` runs, merging consecutive ones."""
    if positions.size == 1:  # the decode case, without numpy
        start = int(positions[0])
        if runs and runs[-1][1] == start:
            runs[-1][1] = start + 1
        else:
            runs.append([start, start + 1])
        return
    if positions.size == 0:
        return
    cuts = np.flatnonzero(np.diff(positions) != 1) + 1
    for piece in np.split(positions, cuts):
        start, end = int(piece[0]), int(piece[-1]) + 1
        if runs and runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end])


def request_record(request_id: str, request: Request, shared: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The index line of a request: where its rows are and whether it is complete, and why not.

    ``shared`` are references to donors' rows (``{"id", "start", "end", "tokens_crc32"}``, FORMAT.md) for
    positions the request holds no rows of: they count as held, and go on the line.
    """
    finished = request.finished
    expected = finished.num_tokens if finished is not None and finished.num_tokens else None
    spans, runs, rows, surplus = _past_end_trimmed(request, expected)
    merged = _merge(runs)
    covered = sum(end - start for start, end in merged)
    held = _merge(runs + [[entry["start"], entry["end"]] for entry in shared]) if shared else merged
    upper = expected if expected is not None else (held[-1][1] if held else 0)
    selection = Positions.parse(finished.positions if finished is not None else "", "positions")
    loss_mask = finished.loss_mask if finished is not None else ()
    missing = _complement(held, upper) if selection.everything else selection.missing(upper, loss_mask, held)
    problems = []
    if finished is None:
        problems.append(request.end_reason or "no finish event")
    elif finished.reason != "finished":
        problems.append(finished.reason)
    dropped = finished.dropped_rows if finished is not None else 0
    if dropped:
        problems.append(f"producer dropped {dropped} rows")
    if missing:
        problems.append(f"{sum(e - s for s, e in missing)} positions missing")
    if covered != rows:
        problems.append(f"{rows - covered} duplicate rows")
    if expected is not None and merged and merged[-1][1] > expected:
        problems.append(f"positions beyond num_tokens={expected}")
    unasked = 0 if selection.everything else covered - int(selection.keep(_positions(merged), upper, loss_mask).sum())
    if unasked:
        problems.append(f"{unasked} rows at positions --positions {selection} did not ask for")
    return {
        "type": "request",
        "id": request_id,
        "run_id": request.run_id,
        "status": "incomplete" if problems else "complete",
        "reason": "; ".join(problems),
        "rows": rows,
        "num_tokens": expected if expected is not None else covered + sum(e["end"] - e["start"] for e in shared),
        "dropped_rows": dropped,
        "missing": missing,
        "spans": spans,
        **({"shared": list(shared)} if shared else {}),
        **({"surplus_rows": surplus} if surplus else {}),
        "loss_mask": [list(r) for r in finished.loss_mask] if finished is not None else [],
        "meta": finished.meta if finished is not None else {},
        **({} if selection.everything else {"positions": str(selection)}),
    }


def _positions(runs: list[list[int]]) -> np.ndarray:
    """Every position of merged ``[start, end)`` runs."""
    return np.concatenate([np.arange(a, b) for a, b in runs]) if runs else np.empty(0, np.int64)


def _past_end_trimmed(request: Request, expected: int | None) -> tuple[list[list[int]], list[list[int]], int, int]:
    """Spans, position runs and rows without trailing rows at positions ``>= num_tokens``.

    An engine that schedules ahead (SGLang's overlap scheduler) runs one more step for a request
    before it learns that the request finished; that step's row arrives last and lies past the
    end. Only such a tail is cut (its shard bytes stay, unreferenced); anything else past the end
    stays and makes the request incomplete.
    """
    spans, runs, rows = request.spans, request.runs, request.rows
    if expected is None or not runs or runs[-1][1] <= expected or not spans:
        return spans, runs, rows, 0
    start, end = runs[-1]
    surplus = end - max(start, expected)
    if spans[-1][2] < surplus:
        return spans, runs, rows, 0
    runs = [*runs[:-1], [start, expected]] if start < expected else runs[:-1]
    last = spans[-1]
    spans = [*spans[:-1], [last[0], last[1], last[2] - surplus]] if last[2] > surplus else spans[:-1]
    return spans, runs, rows - surplus, surplus


def _merge(runs: list[list[int]]) -> list[list[int]]:
    merged: list[list[int]] = []
    for start, end in sorted(runs):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _complement(merged: list[list[int]], upper: int) -> list[list[int]]:
    gaps, cursor = [], 0
    for start, end in merged:
        if start > cursor:
            gaps.append([cursor, min(start, upper)])
        cursor = max(cursor, end)
    if cursor < upper:
        gaps.append([cursor, upper])
    return [g for g in gaps if g[1] > g[0]]


def once(line: dict[str, Any], complete: set[str]) -> dict[str, Any]:
    """A request line as it may be listed: a store never lists a key complete twice, so a second complete
    capture of an id in ``complete`` (the ids listed complete so far, updated) is recorded incomplete."""
    if line["status"] != "complete":
        return line
    if line["id"] in complete:
        return {**line, "status": "incomplete", "reason": DUPLICATE}
    complete.add(line["id"])
    return line
