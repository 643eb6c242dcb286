"""Feeding a StoreWriter directly, as the consumer does: reserve rows, copy their bytes in, commit.

Shared by the store's tests (no sockets, no ring): rows are random and never zero, so a row
that lands in the wrong place cannot pass for the right one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hscapture.config import DTYPES
from hscapture.store.records import Finish
from hscapture.store.writer import RowGeometry, StoreWriter

NAMES = ["layer_2", "layer_5", "last"]
DESCRIPTIONS = ["residual entering layer 2", "residual entering layer 5", "final norm output"]
HIDDEN = 24
ROWS_PER_SHARD = 7


def row_bytes(dtype: str, names: Sequence[str] = NAMES, hidden: int = HIDDEN) -> int:
    return len(names) * hidden * DTYPES[dtype].itemsize


def shard_bytes(dtype: str) -> int:
    """Small shards of ROWS_PER_SHARD rows (plus slack that is not a whole row)."""
    return ROWS_PER_SHARD * row_bytes(dtype) + 5


def make_layout(
    run_id: str = "run-a",
    dtype: str = "float32",
    hidden: int = HIDDEN,
    names: Sequence[str] = NAMES,
    descriptions: Sequence[str] = DESCRIPTIONS,
) -> tuple[str, RowGeometry, dict[str, Any]]:
    """``StoreWriter.begin_run``'s arguments: run id, geometry, run meta."""
    return run_id, RowGeometry(tuple(names), tuple(descriptions), dtype, hidden), {"test": run_id}


def write_rows(
    writer: StoreWriter,
    rows: torch.Tensor,
    request_ids: Sequence[str],
    request_rows: Sequence[int],
    positions: Sequence[int] | np.ndarray,
    token_ids: Sequence[int] | np.ndarray,
) -> None:
    """Reserve ``rows.shape[1]`` rows, copy ``rows`` (``[tensors, n, hidden]``) into them, commit."""
    count = rows.shape[1]
    planes = rows.contiguous().view(torch.uint8).numpy()  # [tensors, n, hidden * itemsize]
    reservation = writer.reserve(count)
    assert reservation is not None and reservation.rows == count
    begin = 0
    for piece in reservation.pieces:
        for t, plane in enumerate(piece.planes):
            plane[:] = planes[t, begin : begin + piece.rows]
        begin += piece.rows
    writer.commit(
        reservation,
        list(request_ids),
        list(request_rows),
        np.asarray(positions, dtype=np.int64),
        np.asarray(token_ids, dtype=np.int64),
    )


@dataclass
class Request:
    """What the engine produced for one request: every position's rows and token id."""

    rows: torch.Tensor  # [tensors, n, hidden]
    token_ids: np.ndarray  # [n]


def make_request(n: int, dtype: str, rng: np.random.Generator, num_tensors: int = len(NAMES)) -> Request:
    magnitude = rng.uniform(0.5, 1.5, size=(num_tensors, n, HIDDEN))
    sign = rng.choice([-1.0, 1.0], size=magnitude.shape)
    rows = torch.from_numpy(magnitude * sign).to(DTYPES[dtype])
    assert bool((rows != 0).all())
    return Request(rows=rows, token_ids=rng.integers(1, 50_000, size=n, dtype=np.int64))


@dataclass
class Feed:
    """Writes batches of segments ``(request id, positions)`` of requests' rows, and request ends."""

    writer: StoreWriter
    requests: dict[str, Request]
    dtype: str = "float32"
    sent: dict[str, list[int]] = field(default_factory=dict)

    def chunk(self, segments: Sequence[tuple[str, Sequence[int]]]) -> None:
        pieces, positions, token_ids = [], [], []
        for request_id, where in segments:
            index = torch.as_tensor(list(where), dtype=torch.long)
            request = self.requests[request_id]
            pieces.append(request.rows[:, index])
            positions.extend(where)
            token_ids.extend(request.token_ids[list(where)].tolist())
            self.sent.setdefault(request_id, []).extend(where)
        rows = torch.cat(pieces, dim=1)
        write_rows(self.writer, rows, [s[0] for s in segments], [len(s[1]) for s in segments], positions, token_ids)

    def finish(self, request_id: str, reason: str = "finished", **fields: Any) -> None:
        self.writer.finish_request(request_id, Finish(reason, **fields))


def shard_files(root: Path) -> list[Path]:
    return sorted(root.glob("shard-*.safetensors"))


def sharing(donor: Request, own: Request, shared: int) -> Request:
    """A request whose first ``shared`` tokens and rows are the donor's (what the engine would compute)."""
    rows = torch.cat([donor.rows[:, :shared], own.rows[:, shared:]], dim=1)
    return Request(rows, np.concatenate([donor.token_ids[:shared], own.token_ids[shared:]]))


def send(feed: Feed, request_id: str, start: int, chunk: int = 9) -> None:
    """The request's rows from ``start`` on (the engine forwarded only those), in chunks like a chunked prefill."""
    n = len(feed.requests[request_id].token_ids)
    for at in range(start, n, chunk):
        feed.chunk([(request_id, range(at, min(at + chunk, n)))])


def finish_hit(feed: Feed, request_id: str, cached: int) -> None:
    """The end of a request whose first ``cached`` positions came from the prefix cache."""
    request = feed.requests[request_id]
    feed.finish(request_id, num_tokens=len(request.token_ids), prefix_token_ids=request.token_ids[:cached])


def capture(feed: Feed, request_id: str, cached: int = 0, chunk: int = 9) -> None:
    """A whole request: its rows from ``cached`` on, then its end (the first ``cached`` from the prefix cache)."""
    send(feed, request_id, cached, chunk)
    finish_hit(feed, request_id, cached)
