"""Prefix sharing: rows an engine never computed for a request, found in the request that did.

An engine with a prefix cache (SGLang's radix cache) skips the forward of a request's cached
prefix ``[0, p)``, so those rows never reach the store. The states of a prefix depend only on its
tokens (causal attention), so they are the rows of any stored request whose tokens ``[0, p)`` are
the same. :class:`PrefixIndex` finds such a donor by token content, and the writer records a
reference to the donor's rows in place of ``missing`` (FORMAT.md, ``shared``).

The index holds, per donor, its token ids ``[0, q)`` where ``q`` is how far its rows (its own or
referenced) cover it from position 0 without a gap; and a tree over blocks of :data:`BLOCK` tokens:
each node, the hash of a prefix of whole blocks chained from position 0, lists the distinct next
blocks (or shorter tails) that donors hold after it, sorted, each with the latest donor holding it.
A lookup of ``[0, p)`` hashes the whole blocks before its last (partial or whole) block, finds the
next blocks starting with that last block's tokens by bisection, and compares the tokens of their
donors with the asked ones exactly, so a hash collision can never attach another's rows, and a donor
is found however many others share its blocks.
Requests still being captured are donors too (for the positions they hold from 0 so far); the
writer records a request's line only after its donors' lines, and a line whose donor may be a request
still being captured whose own first positions were a cache hit (known at its finish) waits for it.
The index is rebuilt from the store's index lines and the shards' token ids the first time a lookup
needs it, so later runs and resumed extractions find donors from earlier ones.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hscapture.errors import StoreError
from hscapture.store.directory import StoreDir
from hscapture.store.format import read_meta, shard_name, shared_rows, tokens_crc32
from hscapture.store.shardfile import ShardFile

#: Tokens per hashed block. A donor of ``[0, p)`` is found through the block chain of ``[0, (p - 1) // BLOCK * BLOCK)``.
BLOCK = 16
#: Per request in flight, pieces of token ids kept before they are joined into one array.
_JOIN_AFTER = 64


def held_from_start(record: dict[str, Any]) -> int:
    """How far a request line's rows (own or shared) cover it from position 0 without a gap; 0 when its rows
    are not one per position (duplicates), so it never serves as a donor."""
    missing, expected = record["missing"], record["num_tokens"]
    covered = expected - sum(end - start for start, end in missing)
    if record["rows"] + shared_rows(record) != covered:
        return 0
    return min(missing[0][0], expected) if missing else expected


@dataclass
class _Flight:
    """Token ids of a request still being captured: its rows' positions ``[start, end)`` in order, no gap."""

    start: int
    end: int
    parts: list[np.ndarray] = field(default_factory=list)
    broken: bool = False

    def tokens(self) -> np.ndarray:
        if len(self.parts) != 1:
            self.parts = [np.concatenate(self.parts).astype(np.int32, copy=False)] if self.parts else []
        return self.parts[0] if self.parts else np.empty(0, np.int32)


class _Branches:
    """The distinct next blocks (``BLOCK`` token ids or fewer, as little-endian int32 bytes) donors hold after one
    node, sorted, each with the latest donor holding it."""

    __slots__ = ("blocks", "donor")

    def __init__(self) -> None:
        self.blocks: list[bytes] = []
        self.donor: dict[bytes, str] = {}

    def add(self, block: bytes, key: str) -> None:
        if block not in self.donor:
            bisect.insort(self.blocks, block)
        self.donor[block] = key

    def starting_with(self, tail: bytes) -> list[str]:
        """Donors of the next blocks that begin with ``tail`` (byte order keeps them together)."""
        found, at = [], bisect.bisect_left(self.blocks, tail)
        while at < len(self.blocks) and self.blocks[at].startswith(tail):
            found.append(self.donor[self.blocks[at]])
            at += 1
        return found


class PrefixIndex:
    """Donors of prefixes by token content, over every request of a store and those in flight.

    Args:
        directory: the store (its handle).
        records: its index lines at open (rebuilt from lazily, on the first lookup).
    """

    def __init__(self, directory: StoreDir, records: list[dict[str, Any]]) -> None:
        self.directory = directory
        self._records: list[dict[str, Any]] | None = records
        self._meta: dict[str, Any] | None = None
        self._tokens: dict[str, np.ndarray] = {}  # recorded donors: int32 token ids [0, held)
        self._branches: dict[bytes, _Branches] = {}
        self._flight: dict[str, _Flight] = {}
        #: Request ids whose served line is recorded (a line naming a donor waits for the donor's).
        self.recorded: set[str] = set()
        self._session: set[str] = set()  # recorded by this writer: the build leaves them as they are
        self._complete: set[str] = set()
        for record in records:
            if record["type"] == "request":
                self.recorded.add(record["id"])
                self._note_served(record)

    # ------------------------------------------------------------------ writer side

    def add_rows(
        self, request_ids: Sequence[str], request_rows: Sequence[int], positions: np.ndarray, token_ids: np.ndarray
    ) -> None:
        """Committed rows: keep each request's token ids while its positions run on without a gap."""
        flight, offset = self._flight, 0
        for request_id, count in zip(request_ids, request_rows):
            first = int(positions[offset])
            entry = flight.get(request_id)
            if entry is None:
                entry = flight[request_id] = _Flight(first, first)
            if not entry.broken:
                ours = positions[offset : offset + count]
                if first != entry.end or (count > 1 and bool((np.diff(ours) != 1).any())):
                    entry.broken, entry.parts = True, []
                else:
                    entry.parts.append(token_ids[offset : offset + count])
                    entry.end += count
                    if len(entry.parts) > _JOIN_AFTER:
                        entry.tokens()
            offset += count

    def references(self, line: dict[str, Any], prefix_token_ids: np.ndarray | None) -> list[dict[str, Any]]:
        """The ``shared`` entries for a request line whose first positions are missing: one donor for
        ``[0, p)``, ``p`` the end of its first missing range (when the engine gave their token ids), or none."""
        missing = line["missing"]
        if prefix_token_ids is None or not len(prefix_token_ids) or not missing or missing[0][0] != 0:
            return []
        end = min(missing[0][1], len(prefix_token_ids))
        wanted = np.asarray(prefix_token_ids[:end], dtype=np.int64)
        donor = self._find(wanted, line["id"])
        if donor is None:
            return []
        return [{"id": donor, "start": 0, "end": end, "tokens_crc32": tokens_crc32(wanted)}]

    def donor_in_flight(self, line: dict[str, Any], prefix_token_ids: np.ndarray | None) -> bool:
        """Whether a request still being captured may yet hold ``line``'s missing ``[0, p)``: one whose own rows
        start inside it, after 0, with the same tokens there. Its first positions were a prefix-cache hit too, known
        only at its finish (``prefix_token_ids``); the engine's hit on ``[0, p)`` for ``line`` may have been its rows
        (parallel samples of one prompt under a cached system prompt). Until it finishes, ``line`` may wait."""
        missing = line["missing"]
        if prefix_token_ids is None or not len(prefix_token_ids) or not missing or missing[0][0] != 0:
            return False
        end = min(missing[0][1], len(prefix_token_ids))
        wanted = np.asarray(prefix_token_ids[:end], dtype=np.int64)
        for key, flight in self._flight.items():
            if key == line["id"] or key in self._complete or flight.broken or not 0 < flight.start < end:
                continue
            if flight.end >= end and np.array_equal(flight.tokens()[: end - flight.start], wanted[flight.start :]):
                return True
        return False

    def waiting(self, line: dict[str, Any]) -> bool:
        """Whether a line names a donor whose own line is not recorded yet."""
        return any(entry["id"] not in self.recorded for entry in line.get("shared", ()))

    def record(self, line: dict[str, Any], prefix_token_ids: np.ndarray | None) -> None:
        """A request line goes to the index: it becomes a donor, as readers will serve it.

        Args:
            line: the request line, as written.
            prefix_token_ids: the token ids of its first positions that the engine gave (or None).
        """
        key = line["id"]
        flight = self._flight.pop(key, None)
        self.recorded.add(key)
        self._session.add(key)
        if not self._note_served(line):
            return
        held = held_from_start(line)
        tokens = np.full(held, -1, np.int64)
        if prefix_token_ids is not None:
            given = np.asarray(prefix_token_ids[:held], dtype=np.int64)
            tokens[: len(given)] = given
        if flight is not None and not flight.broken and flight.start < held:
            own = flight.tokens()[: held - flight.start]
            tokens[flight.start : flight.start + len(own)] = own
        self._add(key, _until_unknown(tokens))

    # ------------------------------------------------------------------ lookup

    def _note_served(self, line: dict[str, Any]) -> bool:
        """Track which line readers serve (the first complete one, else the last); True if it is this one."""
        key = line["id"]
        if key in self._complete:
            return False
        if line["status"] == "complete":
            self._complete.add(key)
        self._tokens.pop(key, None)
        return True

    def _find(self, wanted: np.ndarray, asker: str) -> str | None:
        if self._records is not None:
            self._build()
        end = len(wanted)
        last = (end - 1) // BLOCK * BLOCK
        branches = self._branches.get(_chain(wanted[:last])[-1])
        tail = np.ascontiguousarray(wanted[last:end], dtype="<i4").tobytes()
        for key in branches.starting_with(tail) if branches is not None else ():
            tokens = self._tokens.get(key)
            if key != asker and tokens is not None and len(tokens) >= end and np.array_equal(tokens[:end], wanted):
                return key
        for key, flight in self._flight.items():  # in flight: only rows held from position 0
            if key == asker or key in self._complete or flight.broken or flight.start or flight.end < end:
                continue
            if np.array_equal(flight.tokens()[:end], wanted):
                return key
        return None

    def _add(self, key: str, tokens: np.ndarray) -> None:
        if not len(tokens):
            return
        self._tokens[key] = tokens
        data = np.ascontiguousarray(tokens, dtype="<i4")
        for at, node in zip(range(0, len(data), BLOCK), _chain(tokens)):
            branches = self._branches.get(node)
            if branches is None:
                branches = self._branches[node] = _Branches()
            branches.add(data[at : at + BLOCK].tobytes(), key)

    def _build(self) -> None:
        """Index every served line of the store at open, its tokens read from the shards' ``token_ids``."""
        records, self._records = self._records or [], None
        served: dict[str, dict[str, Any]] = {}
        complete: set[str] = set()
        for record in records:
            if record["type"] == "request" and record["id"] not in complete:
                served.pop(record["id"], None)
                served[record["id"]] = record
                if record["status"] == "complete":
                    complete.add(record["id"])
        shards = {r["id"]: r for r in records if r["type"] == "shard"}
        with _Shards(self.directory, shards) as files:
            for line in served.values():  # donors' lines come before the lines naming them
                held = held_from_start(line)
                if held and line["id"] not in self._session:
                    self._add(line["id"], self._stored_tokens(line, held, files))

    def _stored_tokens(self, line: dict[str, Any], held: int, files: _Shards) -> np.ndarray:
        tokens = np.full(held, -1, np.int64)
        for entry in line.get("shared", ()):
            donor = self._tokens.get(entry["id"], np.empty(0, np.int32))[entry["start"] : min(entry["end"], held)]
            tokens[entry["start"] : entry["start"] + len(donor)] = donor
        for shard_id, start, count in line["spans"]:
            shard = files.get(shard_id)
            if shard is None:
                return np.empty(0, np.int32)
            positions = shard.array("positions")[start : start + count]
            keep = positions < held
            tokens[positions[keep]] = shard.array("token_ids")[start : start + count][keep]
        return _until_unknown(tokens)


def _until_unknown(tokens: np.ndarray) -> np.ndarray:
    """int32 token ids up to the first unknown one (-1)."""
    unknown = np.flatnonzero(tokens < 0)
    return (tokens[: unknown[0]] if len(unknown) else tokens).astype(np.int32)


def _chain(tokens: np.ndarray) -> list[bytes]:
    """Hashes of ``tokens[:0]``, ``tokens[:BLOCK]``, ``tokens[:2 * BLOCK]``, ... (every whole block, chained)."""
    hasher = hashlib.blake2b(digest_size=16)
    nodes = [hasher.digest()]
    data = np.ascontiguousarray(tokens, dtype="<i4")
    for at in range(0, len(data) // BLOCK * BLOCK, BLOCK):
        hasher.update(data[at : at + BLOCK].tobytes())
        nodes.append(hasher.digest())
    return nodes


class _Shards:
    """Shards opened while the index is built (at most 64 mapped at once)."""

    def __init__(self, directory: StoreDir, lines: dict[int, dict[str, Any]]) -> None:
        self.directory, self.lines, self.meta = directory, lines, read_meta(directory)
        self.open: dict[int, ShardFile | None] = {}

    def __enter__(self) -> _Shards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.open.clear()

    def get(self, shard_id: int) -> ShardFile | None:
        """The shard, or None when it cannot be read (its requests then serve as no donors)."""
        if shard_id not in self.open:
            if len(self.open) >= 64:
                self.open.pop(next(iter(self.open)))
            line = self.lines.get(shard_id)
            try:
                self.open[shard_id] = (
                    None if line is None or self.meta is None
                    else ShardFile(
                        self.directory.file(shard_name(shard_id)), self.meta, line["bytes"], shard_id, self.directory.fd
                    )
                )  # fmt: skip
            except StoreError:
                self.open[shard_id] = None
        return self.open[shard_id]
