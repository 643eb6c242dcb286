"""Feeding a StoreWriter directly, as the consumer does: reserve rows, copy their bytes in, commit.

Shared by the store's tests (no sockets, no ring): rows are random and never zero, so a row
that lands in the wrong place cannot pass for the right one.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hscapture.config import DTYPES, torch_dtype
from hscapture.consumer.device_fp8 import RowCrcs
from hscapture.fp8 import FP8, quantize_into
from hscapture.store.records import Finish
from hscapture.store.writer import RowGeometry, StoreWriter

NAMES = ["layer_2", "layer_5", "last"]
DESCRIPTIONS = ["residual entering layer 2", "residual entering layer 5", "final norm output"]
HIDDEN = 24
ROWS_PER_SHARD = 7


def row_bytes(dtype: str, names: Sequence[str] = NAMES, hidden: int = HIDDEN) -> int:
    return len(names) * hidden * DTYPES[dtype]


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
) -> bool:
    """Reserve ``rows.shape[1]`` rows, copy ``rows`` (``[tensors, n, hidden]``) into them, commit.

    Into a run whose rows arrive quantized, copy their codes, scales, non-finite counts and row
    CRCs (from :func:`hscapture.fp8.quantize_into` and :class:`RowCrcs`, as the consumer of a GPU
    ring makes them). Returns whether they were.
    """
    count = rows.shape[1]
    reservation = writer.reserve(count)
    assert reservation is not None and reservation.rows == count
    quantized = bool(reservation.pieces[0].scales)
    if quantized:
        codes = torch.empty(rows.shape, dtype=FP8)
        scales = torch.empty(rows.shape[:2], dtype=torch.float32)
        nonfinite = torch.empty(rows.shape[:2], dtype=torch.int32)
        quantize_into(rows, codes, scales, nonfinite)
        crcs = torch.empty(rows.shape[:2], dtype=torch.int32)
        checksum = RowCrcs(rows.shape[2], count, torch.device("cpu"))
        for t in range(rows.shape[0]):
            checksum(codes[t].view(torch.uint8), crcs[t])
        arrays = [codes.view(torch.uint8).numpy(), scales.numpy(), nonfinite.numpy(), crcs.numpy()]
    else:
        arrays = [rows.contiguous().view(torch.uint8).numpy()]  # [tensors, n, hidden * itemsize]
    begin = 0
    for piece in reservation.pieces:
        for source, destinations in zip(arrays, (piece.planes, piece.scales, piece.nonfinite, piece.crcs)):
            for t, destination in enumerate(destinations):
                destination[:] = source[t, begin : begin + piece.rows]
        begin += piece.rows
    writer.commit(
        reservation,
        list(request_ids),
        list(request_rows),
        np.asarray(positions, dtype=np.int64),
        np.asarray(token_ids, dtype=np.int64),
    )
    return quantized


@dataclass
class Request:
    """What the engine produced for one request: every position's rows and token id."""

    rows: torch.Tensor  # [tensors, n, hidden]
    token_ids: np.ndarray  # [n]


def make_request(n: int, dtype: str, rng: np.random.Generator, num_tensors: int = len(NAMES)) -> Request:
    magnitude = rng.uniform(0.5, 1.5, size=(num_tensors, n, HIDDEN))
    sign = rng.choice([-1.0, 1.0], size=magnitude.shape)
    rows = torch.from_numpy(magnitude * sign).to(torch_dtype(dtype))
    assert bool((rows != 0).all())
    return Request(rows=rows, token_ids=rng.integers(1, 50_000, size=n, dtype=np.int64))


@dataclass
class Feed:
    """Writes batches of segments ``(request id, positions)`` of requests' rows, and request ends."""

    writer: StoreWriter
    requests: dict[str, Request]
    dtype: str = "float32"
    sent: dict[str, list[int]] = field(default_factory=dict)
    #: Per chunk written: whether its rows went in quantized.
    quantized: list[bool] = field(default_factory=list)

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
        self.quantized.append(
            write_rows(self.writer, rows, [s[0] for s in segments], [len(s[1]) for s in segments], positions, token_ids)
        )

    def finish(self, request_id: str, reason: str = "finished", **fields: Any) -> None:
        self.writer.finish_request(request_id, Finish(reason, **fields))


def shard_files(root: Path) -> list[Path]:
    return sorted(root.glob("shard-*.safetensors"))


def spread_rows(rng: np.random.Generator, n: int, hidden: int) -> torch.Tensor:
    """Rows like hidden states: row norms over 8 orders of magnitude, a few outlier channels, signs mixed."""
    row_scale = np.exp(rng.normal(0.0, 4.0, size=(n, 1)))
    values = rng.standard_normal((n, hidden)) * row_scale
    values[:, rng.choice(hidden, 3, replace=False)] *= 50.0  # "massive activation" channels
    return torch.from_numpy(values).float()


def special_rows(dtype: torch.dtype, tensors: int = 3, n: int = 40, hidden: int = 64) -> torch.Tensor:
    """``[tensors, n, hidden]`` rows like hidden states, with every special row of the policy among them."""
    x = spread_rows(np.random.default_rng(5), tensors * n, hidden).reshape(tensors, n, hidden)
    x[0, 1] = 0.0  # zero row
    x[0, 2, :3] = -float("inf")
    x[1, 3, 5] = float("inf")
    x[1, 4] = float("nan")  # nothing finite
    x[2, 5, 0] = float("nan")
    x[2, 6] = 1e-44  # below 448 float32 subnormal steps: stored as zeros
    x[2, 7] = torch.finfo(dtype).max  # the largest finite value
    return x.to(dtype)


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


def header_of(path: Path) -> tuple[int, dict[str, Any]]:
    """(start of the data region, parsed header) of a safetensors file, by hand."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return 8 + length, json.loads(data[8 : 8 + length])


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    """Flip bits of one byte in place (a single-bit error with the default mask)."""
    with path.open("r+b") as handle:
        handle.seek(offset)
        (byte,) = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte ^ mask]))
