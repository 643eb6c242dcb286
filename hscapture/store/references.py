"""Following the references of request lines (``shared``, FORMAT.md) on the index alone.

A request whose first positions an engine never computed names the request holding their rows (its
donor), which may itself name another: :func:`follow_references` finds, per request, every request
its rows come from, and why a reference cannot be followed (a donor the store does not hold, one
lacking the positions, a cycle), so ``hscapture verify`` reports a damaged donor for every request
that reads through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class References:
    """Per request with references: every donor its rows come from (chains followed), and the broken ones."""

    donors: dict[str, list[str]] = field(default_factory=dict)
    #: Per request, why one of its references (or its donors') cannot be followed.
    broken: dict[str, str] = field(default_factory=dict)


def follow_references(requests: dict[str, dict[str, Any]]) -> References:
    """Follow every ``shared`` entry of the request lines readers serve (``requests``: id -> line)."""
    found = References()
    for request_id, line in requests.items():
        if line.get("shared"):
            donors: list[str] = []
            problem = _follow(request_id, requests, donors, (request_id,))
            found.donors[request_id] = donors
            if problem:
                found.broken[request_id] = problem
    return found


def _follow(request_id: str, requests: dict[str, dict[str, Any]], donors: list[str], chain: tuple[str, ...]) -> str:
    for entry in requests[request_id].get("shared", ()):
        donor, start, end = entry["id"], entry["start"], entry["end"]
        what = f"request {request_id!r} takes positions {start}..{end - 1} from {donor!r}"
        if donor in chain:
            return f"{what}, which takes them back (a cycle)"
        line = requests.get(donor)
        if line is None:
            return f"{what}, which the store does not hold"
        lacking = [gap for gap in line["missing"] if gap[0] < end and gap[1] > start]
        if end > line["num_tokens"] or lacking:
            return f"{what}, which lacks {lacking[:3] or [[line['num_tokens'], end]]} of them"
        if donor not in donors:
            donors.append(donor)
        problem = _follow(donor, requests, donors, (*chain, donor))
        if problem:
            return problem
    return ""
