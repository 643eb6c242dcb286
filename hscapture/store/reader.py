"""Reading a store: ``open_store(path)`` then ``keys()``, ``get(key)``, ``metadata()``.

Shards are memory-mapped through safetensors, and ``get`` slices only the rows of the asked
request, so reading one sample never loads a whole shard. A ``Store`` can be pickled and used
after a fork (DataLoader workers): each process maps the shards itself, on first use.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hscapture.config import DTYPES
from hscapture.errors import StoreError
from hscapture.fp8 import FP8, FP8_NAME, dequantize_rows, scale_name
from hscapture.store.format import META_FILE, read_index, shard_name

ROW_FIELDS = ("positions", "token_ids")


class Store:
    """A read-only view of a store directory.

    Each request id appears once; when an id was written twice (an extraction resumed after a
    crash that left it incomplete), the later line wins.
    """

    def __init__(self, root: str | Path, max_open_shards: int = 64) -> None:
        self.root = Path(root)
        meta_path = self.root / META_FILE
        if not meta_path.exists():
            raise StoreError(f"{self.root}: no {META_FILE}; not an hscapture store (or nothing was captured yet)")
        self._meta: dict[str, Any] = json.loads(meta_path.read_text())
        self._runs: list[dict[str, Any]] = []
        open_runs: dict[str, dict[str, Any]] = {}  # a run line pairs with the next run_end of its run
        self._shards: dict[int, dict[str, Any]] = {}
        self._requests: dict[str, dict[str, Any]] = {}
        for record in read_index(self.root):
            kind = record.get("type")
            if kind == "shard":
                self._shards[record["id"]] = record
            elif kind == "request":
                self._requests.pop(record["id"], None)
                self._requests[record["id"]] = record
            elif kind == "run":
                record = {**record, "end": None}
                self._runs.append(record)
                open_runs[record["run_id"]] = record
            elif kind == "run_end":
                session = open_runs.pop(record["run_id"], None)
                if session is not None:
                    session["end"] = record
        self.tensor_names: list[str] = [t["name"] for t in self._meta["tensors"]]
        #: The captured dtype: what ``get`` returns.
        self.dtype: torch.dtype = DTYPES[self._meta["dtype"]]
        #: How rows are stored: the captured dtype's name or ``float8_e4m3fn`` (fp8 with per-row scales).
        self.store_dtype: str = self._meta.get("store_dtype", self._meta["dtype"])
        if self.store_dtype not in (self._meta["dtype"], FP8_NAME):
            raise StoreError(f"{meta_path}: rows stored as {self.store_dtype!r}; this hscapture reads {FP8_NAME!r}")
        self._max_open = max_open_shards
        self._forget_shards()

    def _forget_shards(self) -> None:
        """Drop every shard mapping; this process maps shards anew as it needs them."""
        self._open: OrderedDict[int, Any] = OrderedDict()
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
        """Counts for humans and scripts: requests, rows, shards, bytes, drops."""
        records = self._requests.values()
        ends = {run["run_id"]: run["end"] for run in self._runs if run["end"] is not None}  # the last per run
        dropped = sum(int(end.get("counters", {}).get("rows_dropped", 0)) for end in ends.values())
        return {
            "requests": len(self._requests),
            "complete": sum(r["status"] == "complete" for r in records),
            "incomplete": sum(r["status"] != "complete" for r in records),
            "rows": sum(r["rows"] for r in records),
            "shards": len(self._shards),
            "bytes": sum(s["bytes"] for s in self._shards.values()),
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
        """One request's rows, sorted by position.

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
            KeyError: no such request. StoreError: a shard it needs is missing.
        """
        record = self.record(key)
        names = self.tensor_names if tensors is None else tensors
        unknown = sorted(set(names) - set(self.tensor_names))
        if unknown:
            raise KeyError(f"tensors {unknown} are not in this store; it holds {self.tensor_names}")
        scales = [scale_name(name) for name in names] if self.quantized else []
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in (*ROW_FIELDS, *names, *scales)}
        for shard_id, start, count in record["spans"]:
            handle = self._shard(shard_id)
            for name, pieces in parts.items():
                pieces.append(handle.get_slice(name)[start : start + count])
        out = {name: torch.cat(pieces) if pieces else self._empty(name) for name, pieces in parts.items()}
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

    def _empty(self, name: str) -> torch.Tensor:
        if name in ROW_FIELDS:
            return torch.empty(0, dtype=torch.int64)
        if name not in self.tensor_names:  # a scale
            return torch.empty(0, dtype=torch.float32)
        return torch.empty(0, self._meta["hidden_size"], dtype=FP8 if self.quantized else self.dtype)

    def _shard(self, shard_id: int) -> Any:
        if self._pid != os.getpid():  # forked (a DataLoader worker): never read through the parent's mappings
            self._forget_shards()
        handle = self._open.get(shard_id)
        if handle is not None:
            self._open.move_to_end(shard_id)
            return handle
        if shard_id not in self._shards:
            raise StoreError(f"{self.root}: shard {shard_id} is referenced but not indexed; the index is corrupt")
        path = self.root / shard_name(shard_id)
        if not path.exists():
            raise StoreError(f"{path}: missing; the store was damaged after it was written")
        handle = safe_open(str(path), framework="pt")
        self._open[shard_id] = handle
        if len(self._open) > self._max_open:
            self._open.popitem(last=False)
        return handle

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(path: str | Path) -> Store:
    """Open one store directory for reading (:func:`hscapture.open_store` also opens a set of parts)."""
    return Store(path)
