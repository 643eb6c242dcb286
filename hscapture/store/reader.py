"""Reading a store: ``open_store(path)`` then ``keys()``, ``get(key)``, ``metadata()``.

Shards are memory-mapped, and ``get`` copies out only the rows of the asked request, so reading one
sample never loads a whole shard. No reader returns bytes that differ from what was captured: every
row ``get`` returns is checked against the CRC-32 written with it (a version-2 shard's
``row_crc32``), the small per-row tensors of a shard (positions, token ids, owners, scales, the row
table) against their index line once per process, and the rows a span names must belong to the
request asking. A version-1 shard has only whole-tensor checksums: each tensor is checked whole the
first time a process reads it. Anything wrong is one :class:`StoreError` naming the shard and the
request. A ``Store`` can be pickled and used after a fork (DataLoader workers): each process maps
the shards itself, on first use.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hscapture.config import torch_dtype
from hscapture.errors import StoreError
from hscapture.fp8 import FP8, dequantize_rows
from hscapture.fp8_kernel import FP8_NAME, scale_name
from hscapture.store.checksum import row_crcs
from hscapture.store.format import (
    INDEX_FILE,
    META_FILE,
    ROW_CRC,
    read_index,
    read_meta,
    shard_name,
    shared_rows,
    tokens_crc32,
)
from hscapture.store.shardfile import ShardFile

log = logging.getLogger(__name__)

ROW_FIELDS = ("positions", "token_ids")


class Store:
    """A read-only view of a store directory.

    Each request id appears once. When an id is on several lines (an extraction resumed after a
    crash that left it incomplete), its first ``complete`` line wins, or, without one, its last line.

    Args:
        root: the store directory.
        max_open_shards: shard mappings kept open.
        verify: check every row returned against its checksum (the default); False skips the CRC-32s
            (a span's rows must still belong to its request).

    Raises:
        StoreError: not a store, or a damaged ``meta.json`` or index line (named, with the fix).
    """

    def __init__(self, root: str | Path, max_open_shards: int = 64, verify: bool = True) -> None:
        self.root = Path(root)
        meta = read_meta(self.root)
        if meta is None:
            raise StoreError(f"{self.root}: no {META_FILE}; not an hscapture store (or nothing was captured yet)")
        self._meta: dict[str, Any] = meta
        self._runs: list[dict[str, Any]] = []
        open_runs: dict[str, dict[str, Any]] = {}  # a run line pairs with the next run_end of its run
        self._shards: dict[int, dict[str, Any]] = {}
        self._requests: dict[str, dict[str, Any]] = {}
        #: Request ids listed complete more than once (a store must not; ``hscapture verify`` fails on them).
        self.duplicates: dict[str, int] = {}
        for record in read_index(self.root, meta["version"]):
            kind = record["type"]
            if kind == "shard":
                self._shards[record["id"]] = record
            elif kind == "request":
                self._add_request(record)
            elif kind == "run":
                record = {**record, "end": None}
                self._runs.append(record)
                open_runs[record["run_id"]] = record
            elif kind == "run_end":
                session = open_runs.pop(record["run_id"], None)
                if session is not None:
                    session["end"] = record
        if self.duplicates:
            shown = ", ".join(f"{k!r} ({n + 1} lines)" for k, n in list(self.duplicates.items())[:5])
            log.warning(
                "%s: %d request ids are listed complete more than once: %s; serving the first complete line of each "
                "(hscapture verify reports them)",
                self.root, len(self.duplicates), shown,
            )  # fmt: skip
        self.tensor_names: list[str] = [t["name"] for t in self._meta["tensors"]]
        #: The captured dtype: what ``get`` returns.
        self.dtype: torch.dtype = torch_dtype(self._meta["dtype"])
        #: How rows are stored: the captured dtype's name or ``float8_e4m3fn`` (fp8 with per-row scales).
        self.store_dtype: str = self._meta.get("store_dtype", self._meta["dtype"])
        self.verify = verify
        self._max_open = max_open_shards
        self._unverifiable_said = False
        self._forget_shards()

    def _add_request(self, record: dict[str, Any]) -> None:
        held = self._requests.get(record["id"])
        if held is not None and held["status"] == "complete":
            if record["status"] == "complete":
                self.duplicates[record["id"]] = self.duplicates.get(record["id"], 0) + 1
            return
        self._requests.pop(record["id"], None)  # the later line, in its place
        self._requests[record["id"]] = record

    def _forget_shards(self) -> None:
        """Drop every shard mapping; this process maps shards anew as it needs them."""
        self._open: OrderedDict[int, ShardFile] = OrderedDict()
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_open"]  # mappings do not travel: the other process maps the shards itself
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._forget_shards()

    @property
    def quantized(self) -> bool:
        """Rows are stored as fp8 codes with a per-row scale (``get`` dequantizes them)."""
        return self.store_dtype == FP8_NAME

    # ------------------------------------------------------------------ index

    def keys(self, complete_only: bool = False) -> list[str]:
        """Request ids in the order they were written."""
        return [k for k, r in self._requests.items() if not complete_only or r["status"] == "complete"]

    def record(self, key: str) -> dict[str, Any]:
        """The index line of a request: status, reason, rows, spans, loss mask, meta."""
        try:
            return self._requests[key]
        except KeyError:
            raise KeyError(f"request {key!r} is not in the store {self.root}") from None

    def metadata(self) -> dict[str, Any]:
        """What was captured (tensors and their exact meaning, dtype, width) and every run."""
        runs = [dict(run) for run in self._runs]
        return {**self._meta, "runs": runs}

    def summary(self) -> dict[str, Any]:
        """Counts for humans and scripts: requests, rows (stored, and served by reference), shards, bytes, drops.

        ``bytes_shared`` estimates what the rows served by reference would have taken on disk, at the store's
        bytes per stored row."""
        records = self._requests.values()
        ends = {run["run_id"]: run["end"] for run in self._runs if run["end"] is not None}  # the last per run
        dropped = sum(int(end.get("counters", {}).get("rows_dropped", 0)) for end in ends.values())
        nbytes = sum(s["bytes"] for s in self._shards.values())
        stored = sum(s["rows"] for s in self._shards.values())
        shared = sum(shared_rows(r) for r in records)
        return {
            "requests": len(self._requests),
            "complete": sum(r["status"] == "complete" for r in records),
            "incomplete": sum(r["status"] != "complete" for r in records),
            "rows": sum(r["rows"] for r in records),
            "rows_shared": shared,
            "requests_sharing": sum("shared" in r for r in records),
            "shards": len(self._shards),
            "bytes": nbytes,
            "bytes_shared": shared * nbytes // stored if stored else 0,
            "rows_dropped": dropped,
            "runs": len(self._runs),
        }

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, key: object) -> bool:
        return key in self._requests

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    # ------------------------------------------------------------------ data

    def get(self, key: str, tensors: list[str] | None = None, dequantize: bool = True) -> dict[str, torch.Tensor]:
        """One request's rows, sorted by position, each checked against its checksum: the positions it holds, no
        more (a request captured with ``--positions`` holds the positions asked, ``record(key)["positions"]``).

        Args:
            key: the request id.
            tensors: the captured tensors to read (default: all).
            dequantize: on an fp8 store, return rows in the captured dtype (the default) rather
                than as stored.

        Returns:
            ``input_ids`` int64 ``[n]``, ``positions`` int64 ``[n]``, ``loss_mask`` int64 ``[n]``
            (1 where trained on), and each captured tensor (``layer_{k}``, ``last``) as
            ``[n, hidden]`` in the captured dtype. From an fp8 store with ``dequantize=False``:
            each tensor as float8_e4m3fn codes ``[n, hidden]`` plus ``{name}.scale`` float32
            ``[n]``, where a row is ``codes.float() * scale[:, None]``.

        Raises:
            KeyError: no such request. StoreError: a shard it needs is missing or damaged, or its
                index line names rows that are not its own (the message names the shard and the request).
        """
        record = self.record(key)
        names = self.tensor_names if tensors is None else tensors
        unknown = sorted(set(names) - set(self.tensor_names))
        if unknown:
            raise KeyError(f"tensors {unknown} are not in this store; it holds {self.tensor_names}")
        scales = [scale_name(name) for name in names] if self.quantized else []
        parts = self._parts(key, (*ROW_FIELDS, *scales), names, None, ())
        out = {name: self._tensor(name, pieces) for name, pieces in parts.items()}
        positions = out["positions"]
        if not bool((positions[1:] >= positions[:-1]).all()):  # rows arrive in order unless a step was split
            order = torch.argsort(positions, stable=True)
            out = {name: value[order] for name, value in out.items()}
            positions = out["positions"]
        if self.quantized and dequantize:
            for name, scale in zip(names, scales):
                out[name] = dequantize_rows(out[name], out.pop(scale), self.dtype)
        mask = torch.zeros_like(positions)
        for start, end in record["loss_mask"]:
            mask |= ((positions >= start) & (positions < end)).long()
        sample = {"input_ids": out.pop("token_ids"), "positions": positions, "loss_mask": mask}
        sample.update(out)
        return sample

    def _parts(
        self, key: str, small: tuple[str, ...], names: list[str], window: tuple[int, int] | None, chain: tuple[str, ...]
    ) -> dict[str, list[np.ndarray]]:
        """Pieces of each field of a request's rows (taken by reference from donors first, then its own), only
        those at positions in ``window`` when one is given; ``chain`` the requests whose references led here."""
        record = self.record(key)
        parts: dict[str, list[np.ndarray]] = {name: [] for name in (*small, *names)}
        for entry in record.get("shared", ()):
            if window is None or (entry["start"] < window[1] and entry["end"] > window[0]):
                donated = self._donated(key, entry, small, names, chain)
                for name, pieces in _within(donated, window).items():
                    parts[name].extend(pieces)
        for shard_id, start, count in record["spans"]:
            shard = self._shard(shard_id)
            self._check_owner(shard, key, start, count)
            select = None
            if window is not None:
                inside = np.flatnonzero(_between(self._small(shard, "positions")[start : start + count], window))
                if not len(inside):
                    continue
                start, count, select = start + int(inside[0]), int(inside[-1] - inside[0]) + 1, inside - inside[0]
            for name in small:
                piece = self._small(shard, name)[start : start + count]
                parts[name].append(piece.copy() if select is None else piece[select])
            for name in names:
                rows = self._rows(shard, key, name, start, count)
                parts[name].append(rows if select is None else rows[select])
        return parts

    def _donated(
        self, key: str, entry: dict[str, Any], small: tuple[str, ...], names: list[str], chain: tuple[str, ...]
    ) -> dict[str, list[np.ndarray]]:
        """The rows a ``shared`` entry of ``key`` names: the donor's positions ``[start, end)``, one row each,
        whose token ids are those the reference was made for."""
        donor, start, end = entry["id"], entry["start"], entry["end"]
        where = f"{self.root / INDEX_FILE}: request {key!r} takes positions {start}..{end - 1} from request {donor!r}"
        if donor in chain or donor == key:
            raise StoreError(f"{where}, which takes them back from it (a cycle): the index is damaged")
        if donor not in self._requests:
            raise StoreError(f"{where}, which the store does not hold: the index is damaged or cut short")
        try:
            parts = self._parts(donor, tuple(dict.fromkeys(("positions", "token_ids", *small))), names, (start, end),
                                (*chain, key))  # fmt: skip
        except StoreError as exc:
            raise StoreError(f"{where}: {exc}") from None
        positions = np.concatenate(parts["positions"]) if parts["positions"] else np.empty(0, np.int64)
        order = np.argsort(positions, kind="stable")
        if not np.array_equal(positions[order], np.arange(start, end)):
            raise StoreError(f"{where}, which holds {len(np.unique(positions))} of them: the donor cannot serve them")
        tokens = np.concatenate(parts["token_ids"])[order]
        if tokens_crc32(tokens) != entry["tokens_crc32"]:
            raise StoreError(
                f"{where}, whose token ids there have crc32 {tokens_crc32(tokens)}, the reference says "
                f"{entry['tokens_crc32']}: the donor's line is not the one referenced (or is damaged)"
            )
        return {name: parts[name] for name in (*small, *names)}

    def _tensor(self, name: str, pieces: list[np.ndarray]) -> torch.Tensor:
        """The pieces of one field, as returned: per-row fields and scales as they are, rows viewed in their dtype."""
        if not pieces:
            return self._empty(name)
        joined = torch.from_numpy(np.concatenate(pieces))
        if name in self.tensor_names:
            return joined.view(FP8 if self.quantized else self.dtype)
        return joined

    def _check_owner(self, shard: ShardFile, key: str, start: int, count: int) -> None:
        """The rows a span names must be in the shard and belong to ``key``: a damaged span serves another's rows."""
        local = shard.local_index(key)
        owners = self._small(shard, "request_index")[start : start + count]
        if start + count > shard.rows or local is None or bool((owners != local).any()):
            held = sorted({shard.request_ids[i] for i in owners.tolist() if 0 <= i < len(shard.request_ids)})
            raise StoreError(
                f"{shard.path}: request {key!r}: its index line names rows {start}..{start + count - 1} of this shard "
                f"({shard.rows} rows), which hold {held[:3] or 'no rows'}, not its own: the index line is damaged; "
                f"hscapture verify {self.root} checks every line"
            )

    def _small(self, shard: ShardFile, name: str) -> np.ndarray:
        """A per-row field, scale or row table of a shard, checked whole against its index line once per process."""
        if self.verify and name not in shard.checked:
            self._check_whole(shard, name)
        return shard.array(name)

    def _rows(self, shard: ShardFile, key: str, name: str, start: int, count: int) -> np.ndarray:
        """``[count, row_bytes]`` uint8 copy of a captured tensor's rows, each checked against its CRC-32."""
        rows = shard.data(name)[start : start + count].copy()
        if not self.verify:
            return rows
        if ROW_CRC not in shard.header.tensors:  # version 1: whole tensors only, each checked on first touch
            if name not in shard.checked:
                self._check_whole(shard, name)
            return rows
        want = self._small(shard, ROW_CRC)[start : start + count, self.tensor_names.index(name)]
        got = row_crcs(rows)
        bad = np.flatnonzero(got != want)
        if len(bad):
            row = start + int(bad[0])
            position = int(shard.array("positions")[row])
            raise StoreError(
                f"{shard.path}: request {key!r}: {name} at position {position} (shard row {row}) has crc32 "
                f"{int(got[bad[0]]):08x}, written as {int(want[bad[0]]):08x} ({len(bad)} of its {count} rows there "
                f"differ): the shard is damaged; hscapture verify {self.root} lists what else is"
            )
        return rows

    def _check_whole(self, shard: ShardFile, name: str) -> None:
        want = self._shards[shard.shard_id].get("tensor_crc32", {}).get(name)
        if want is None:
            if not self._unverifiable_said:
                self._unverifiable_said = True
                log.warning(
                    "%s: its index line has no checksum for %s (written before checksums existed): served unchecked",
                    shard.path, name,
                )  # fmt: skip
        else:
            got = f"{shard.crc(name):08x}"
            if got != want:
                raise StoreError(
                    f"{shard.path}: tensor {name} has crc32 {got}, the index says {want}: the shard is damaged; "
                    f"hscapture verify {self.root} lists the requests it holds"
                )
        shard.checked.add(name)

    def _empty(self, name: str) -> torch.Tensor:
        if name in ROW_FIELDS:
            return torch.empty(0, dtype=torch.int64)
        if name not in self.tensor_names:  # a scale
            return torch.empty(0, dtype=torch.float32)
        return torch.empty(0, self._meta["hidden_size"], dtype=FP8 if self.quantized else self.dtype)

    def _shard(self, shard_id: int) -> ShardFile:
        if self._pid != os.getpid():  # forked (a DataLoader worker): never read through the parent's mappings
            self._forget_shards()
        shard = self._open.get(shard_id)
        if shard is not None:
            self._open.move_to_end(shard_id)
            return shard
        line = self._shards.get(shard_id)
        if line is None:
            raise StoreError(f"{self.root}: shard {shard_id} is referenced but not indexed; the index is corrupt")
        shard = ShardFile(self.root / shard_name(shard_id), self._meta, line["bytes"], shard_id)
        self._open[shard_id] = shard
        if len(self._open) > self._max_open:
            self._open.popitem(last=False)
        return shard

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(path: str | Path, verify: bool = True) -> Store:
    """Open one store directory for reading (:func:`hscapture.open_store` also opens a set of parts);
    ``verify=False`` skips the checksums of the rows returned."""
    return Store(path, verify=verify)


def _between(positions: np.ndarray, window: tuple[int, int]) -> np.ndarray:
    return (positions >= window[0]) & (positions < window[1])


def _within(parts: dict[str, list[np.ndarray]], window: tuple[int, int] | None) -> dict[str, list[np.ndarray]]:
    """The pieces of a request's fields (positions among them) at positions in ``window`` only."""
    if window is None or not parts["positions"]:
        return parts
    keep = _between(np.concatenate(parts["positions"]), window)
    return {name: [np.concatenate(pieces)[keep]] if pieces else [] for name, pieces in parts.items()}
