"""Many stores read as one dataset: the stores of a split extraction, ``serve``'s DP groups, or a list.

``open_store(path)`` opens a store directory as a :class:`~hscapture.store.reader.Store`. A directory
that is no store but holds parts opens as a :class:`StoreSet`, and so does a list of store directories
(or of directories of parts). Its parts are the subdirectories named ``part-<i>-of-<n>`` (``hscapture
extract --shard I/N``: one job's static part), ``dp<j>`` (job ``j`` of ``extract --data-parallel K``,
or DP group ``j`` of ``hscapture serve``), or ``part-<i>-of-<n>-dp<j>`` (job ``j`` of ``extract --shard
I/N --data-parallel K``: the K jobs' stores together hold part ``I`` of ``N``). A set reads like one
store (``keys``, ``get``, ``record``, ``metadata``, ``summary``); its parts must have captured the same
tensors the same way (equal ``meta.json``).

A key held by two parts is served once, never twice (a complete copy before an incomplete one,
else the first part's), and reported: in ``duplicates`` and ``problems``, in a warning when the set
opens, by ``hscapture inspect``, and by ``hscapture verify``, which fails. So are the gaps of a split
(:mod:`hscapture.partition`): keys that no part holds (a job not run yet, a part not copied in) or
that stores of two different splits both hold. A store's split is what its runs recorded
(``meta.part``, e.g. ``"1/4"``), else what its directory name says; several stores that hold one
split part (the ``-dp<j>`` stores of one ``--shard I/N``) are one holder of it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hscapture.errors import StoreError
from hscapture.partition import Part, coverage
from hscapture.store.format import META_FILE, shared_rows
from hscapture.store.reader import Store
from hscapture.store.verify import ShardCheck, VerifyReport, format_report, verify_store

log = logging.getLogger(__name__)

PART_DIR = re.compile(r"part-(\d+)-of-(\d+)(?:-dp(\d+))?")
DP_DIR = re.compile(r"dp(\d+)")
#: Duplicate keys and other problems named one by one (the rest are counted).
SHOWN = 5


def part_dir(part: Part | None, job: int | None = None) -> str:
    """The directory name of a store of a split extraction: ``part-<i>-of-<n>`` (an ``extract --shard`` job),
    ``dp<j>`` (job ``j`` of ``--data-parallel``) or ``part-<i>-of-<n>-dp<j>`` (job ``j`` of both)."""
    if part is None:
        if job is None:
            raise ValueError("part_dir: give a part, a job or both")
        return f"dp{job}"
    return f"part-{part.index}-of-{part.count}" + (f"-dp{job}" if job is not None else "")


def named_part(path: Path) -> Part | None:
    """The split part a directory name says it holds (None for ``dp<j>`` and other names)."""
    match = PART_DIR.fullmatch(path.name)
    if match is None:
        return None
    try:
        return Part(int(match.group(1)), int(match.group(2)))
    except ValueError:
        return None


def named_job(path: Path) -> int | None:
    """The job index a directory name gives (``dp<j>``, ``part-<i>-of-<n>-dp<j>``), None for other names."""
    match = PART_DIR.fullmatch(path.name) or DP_DIR.fullmatch(path.name)
    job = match.groups()[-1] if match is not None else None
    return int(job) if job is not None else None


def is_store(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def part_dirs(path: str | Path) -> list[Path]:
    """The subdirectories of ``path`` named as parts, stores or not yet: ``part-<i>-of-<n>`` then its
    ``-dp<j>`` stores, by ``(n, i, j)``; then ``dp<j>`` by ``j``."""
    root = Path(path)
    if not root.is_dir():
        return []
    split: list[tuple[int, int, int, Path]] = []
    groups: list[tuple[int, Path]] = []
    for child in root.iterdir():
        if not child.is_dir():
            continue
        part, job = named_part(child), named_job(child)
        if part is not None:
            split.append((part.count, part.index, -1 if job is None else job, child))
        elif job is not None and DP_DIR.fullmatch(child.name):
            groups.append((job, child))
    return [p for *_, p in sorted(split)] + [p for _, p in sorted(groups)]


def open_store(
    path: str | Path | Sequence[str | Path], max_open_shards: int = 64, verify: bool = True
) -> Store | StoreSet:
    """Open a store, a directory of parts, or a list of either, for reading.

    Args:
        path: a store directory (gives a :class:`Store`), a directory of parts, or a list of
            store directories and directories of parts (give a :class:`StoreSet`).
        max_open_shards: shard mappings kept open, per store.
        verify: check the rows returned against their checksums (False: skip it, for speed).

    Raises:
        StoreError: a path is neither a store nor a directory of parts, no part holds a store yet,
            or the parts captured different tensors.
    """
    if isinstance(path, (str, os.PathLike)):
        root = Path(path)
        if is_store(root) or not part_dirs(root):
            # a store, or its own "not a store" error
            return Store(root, max_open_shards=max_open_shards, verify=verify)
        path = [root]
    return StoreSet(path, max_open_shards=max_open_shards, verify=verify)


class StoreSet:
    """Stores read as one dataset; the same reading API as :class:`Store` (see the module docstring).

    Args:
        paths: store directories and directories of parts, in the order their samples are served.
        max_open_shards: shard mappings each store keeps open.

    Each of ``problems`` is logged as a warning when the set opens.

    Raises:
        StoreError: a path is no store and holds no parts, no part holds a store yet, or two parts'
            ``meta.json`` differ (other tensors, dtype or width).
    """

    def __init__(self, paths: Sequence[str | Path], max_open_shards: int = 64, verify: bool = True) -> None:
        given = [Path(p) for p in paths]
        if not given:
            raise ValueError("paths: no store given; give a directory of parts or a list of stores")
        stores, empty = _expand(given)
        #: What the set is called in messages: the directory given, or the common directory of those given.
        self.root = set_name(given)
        if not stores:
            raise StoreError(f"{self.root}: no part holds a store yet (nothing was captured there)")
        self.parts = [Store(path, max_open_shards=max_open_shards, verify=verify) for path in stores]
        first = self.parts[0]
        for part in self.parts[1:]:
            _check_same_capture(first, part)
        self.tensor_names: list[str] = first.tensor_names
        #: The captured dtype: what ``get`` returns.
        self.dtype: torch.dtype = first.dtype
        #: How rows are stored (the captured dtype's name or ``float8_e4m3fn``), the same in every part.
        self.store_dtype: str = first.store_dtype
        self._where: dict[str, int] = {}  # key -> the part serving it, in the order keys were first seen
        #: Keys held by more than one part -> those parts' directories, in part order.
        self.duplicates: dict[str, list[str]] = {}
        for index, part in enumerate(self.parts):
            for key in part:
                held = self._where.get(key)
                if held is None:
                    self._where[key] = index
                    continue
                self.duplicates.setdefault(key, [str(self.parts[held].root)]).append(str(part.root))
                if self.parts[held].record(key)["status"] != "complete" and part.record(key)["status"] == "complete":
                    self._where[key] = index
        #: One line per problem: parts without a store, keys in no part or in two, duplicate keys.
        self.problems: list[str] = _problems(self.parts, empty, self.duplicates)
        for problem in self.problems:
            log.warning("%s: %s", self.root, problem)

    @property
    def quantized(self) -> bool:
        """Rows are stored as fp8 codes with a per-row scale (``get`` dequantizes them)."""
        return self.parts[0].quantized

    def keys(self, complete_only: bool = False) -> list[str]:
        """Request ids, each once: part by part, in the order each part wrote them."""
        return [k for k in self._where if not complete_only or self.record(k)["status"] == "complete"]

    def part_of(self, key: str) -> Store:
        """The part whose copy of ``key`` is served."""
        try:
            return self.parts[self._where[key]]
        except KeyError:
            raise KeyError(f"request {key!r} is in no part of {self.root}") from None

    def record(self, key: str) -> dict[str, Any]:
        """The index line of a request (see :meth:`Store.record`), from the part serving it."""
        return self.part_of(key).record(key)

    def get(self, key: str, tensors: list[str] | None = None, dequantize: bool = True) -> dict[str, torch.Tensor]:
        """One request's rows, sorted by position, from the part serving it (see :meth:`Store.get`)."""
        return self.part_of(key).get(key, tensors, dequantize=dequantize)

    def metadata(self) -> dict[str, Any]:
        """The parts' common ``meta.json``, every part's runs (each with its ``part`` directory), and ``parts``."""
        runs = [{**run, "part": str(part.root)} for part in self.parts for run in part.metadata()["runs"]]
        meta = self.parts[0].metadata()
        return {**meta, "runs": runs, "parts": [str(part.root) for part in self.parts]}

    def summary(self) -> dict[str, Any]:
        """:meth:`Store.summary` of the whole, each key counted once; plus ``parts`` and ``duplicates``."""
        records = [self.record(key) for key in self._where]
        parts = [part.summary() for part in self.parts]
        return {
            "requests": len(records),
            "complete": sum(r["status"] == "complete" for r in records),
            "incomplete": sum(r["status"] != "complete" for r in records),
            "rows": sum(r["rows"] for r in records),
            "rows_shared": sum(shared_rows(r) for r in records),
            "requests_sharing": sum("shared" in r for r in records),
            "shards": sum(p["shards"] for p in parts),
            "bytes": sum(p["bytes"] for p in parts),
            "bytes_shared": sum(p["bytes_shared"] for p in parts),
            "rows_dropped": sum(p["rows_dropped"] for p in parts),
            "runs": sum(p["runs"] for p in parts),
            "parts": len(self.parts),
            "duplicates": len(self.duplicates),
        }

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def close(self) -> None:
        for part in self.parts:
            part.close()

    def __enter__(self) -> StoreSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: What :func:`open_store` gives: one store, or a set of them read as one (the same reading API).
StoreLike = Store | StoreSet


def set_name(paths: Sequence[Path]) -> Path:
    """The name of a set in messages: the one directory given, or the common directory of those given."""
    return paths[0] if len(paths) == 1 else Path(os.path.commonpath([str(p) for p in paths]))


def _expand(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """``(stores, part directories without a store yet)`` of paths that are stores or directories of parts."""
    stores: list[Path] = []
    empty: list[Path] = []
    for path in paths:
        if is_store(path):
            stores.append(path)
            continue
        inside = part_dirs(path)
        if not inside:
            raise StoreError(
                f"{path}: no {META_FILE} and no parts (part-<i>-of-<n>, dp<j>, part-<i>-of-<n>-dp<j>) in it; not an "
                "hscapture store or a directory of stores (or nothing was captured yet)"
            )
        for part in inside:
            (stores if is_store(part) else empty).append(part)
    seen = {p.resolve() for p in stores}
    if len(seen) < len(stores):
        raise StoreError(f"{', '.join(map(str, paths))}: a store is named twice; give each part once")
    return stores, empty


def _check_same_capture(first: Store, other: Store) -> None:
    """Parts of one dataset: the same ``meta.json`` (tensors and their meaning, dtype, width, storage). The version
    may differ: it says which kinds of index line a store holds (references, position selections), not what it
    captured."""
    mine, theirs = first.metadata(), other.metadata()
    fields = sorted({*mine, *theirs} - {"runs", "version"})
    differ = [name for name in fields if mine.get(name) != theirs.get(name)]
    if differ:
        name = differ[0]
        raise StoreError(
            f"{other.root}: its meta.json differs from {first.root}'s in {name!r} ({theirs.get(name)!r:.200} vs "
            f"{mine.get(name)!r:.200}); the parts of one dataset must capture the same tensors the same way"
        )


def _recorded_part(store: Store) -> Part | None:
    """The split part a store's runs recorded (``meta.part``), else the one its directory name says."""
    recorded = {run.get("meta", {}).get("part") for run in store.metadata()["runs"]} - {None}
    if len(recorded) > 1:
        raise StoreError(f"{store.root}: its runs captured different parts {sorted(recorded)}; one store holds one")
    if recorded:
        return Part.parse(recorded.pop(), what=f"{store.root}: meta.part")
    return named_part(store.root)


def _problems(parts: list[Store], empty: list[Path], duplicates: dict[str, list[str]]) -> list[str]:
    problems = [f"{path}: no store yet (nothing captured there)" for path in empty]
    splits = {part.root: split for part in parts if (split := _recorded_part(part)) is not None}
    for root, split in splits.items():
        named = named_part(root)
        if named is not None and named != split:
            problems.append(f"{root}: holds part {split}, as its runs recorded, not the part its name says")
    if splits:
        pending = {p for path in empty if (p := named_part(path)) is not None}
        missing, doubled = coverage(dict.fromkeys(splits.values()))  # the stores of one part: one holder
        unexplained = [m for m in missing if not any(m.index % p.count == p.index for p in pending)]
        if unexplained:
            shown = ", ".join(part_dir(m) for m in unexplained[:SHOWN])
            problems.append(
                f"no part holds the keys of {shown}{_more(unexplained)}: a job of the split did not run here (or its "
                "part was not copied in)"
            )
        for share, holders in doubled[:SHOWN]:
            names = " and ".join(str(root) for root, split in splits.items() if split in holders)
            problems.append(
                f"{names} each hold the keys of {part_dir(share)}: stores of two different splits of the data"
            )
    if duplicates:
        key, held = next(iter(duplicates.items()))
        problems.append(
            f"{len(duplicates)} keys are in more than one part, e.g. {key!r} in {' and '.join(held)}; each is read "
            "once (a complete copy first, else the first part's)"
        )
    return problems


def _more(items: Sequence[object]) -> str:
    return f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""


# ---------------------------------------------------------------------------------------- verify


@dataclass
class SetReport:
    """``hscapture verify`` of a set: each part's :class:`VerifyReport`, and the set's own problems.

    ``ok`` when every part verifies and the set has no problem (duplicate keys, keys in no part).
    """

    root: str
    parts: list[VerifyReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(part.ok for part in self.parts)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "root": self.root, "parts": [p.to_dict() for p in self.parts], "problems": self.problems}


def verify_set(
    paths: Sequence[str | Path],
    jobs: int = 4,
    progress: Callable[[Iterable[ShardCheck], int], Iterable[ShardCheck]] | None = None,
) -> SetReport:
    """Verify every part (:func:`~hscapture.store.verify.verify_store`), then the set as one.

    Raises:
        StoreError: a path is neither a store nor a directory of parts.
    """
    given = [Path(p) for p in paths]
    stores, _ = _expand(given)
    report = SetReport(str(set_name(given)), [verify_store(path, jobs=jobs, progress=progress) for path in stores])
    try:
        report.problems = StoreSet(given).problems
    except StoreError as exc:  # no store at all, parts of other captures, an unreadable index
        report.problems = [f"the parts do not read as one dataset: {exc}"]
    return report


def format_set_report(report: SetReport, show: int = 10) -> str:
    """Each part's report, then the set's problems and the verdict."""
    lines = [format_report(part, show) for part in report.parts]
    lines += [f"set problem: {problem}" for problem in report.problems]
    bad = sum(not part.ok for part in report.parts)
    verdict = "OK" if report.ok else "FAILED"
    lines.append(
        f"{verdict}: {report.root}: {len(report.parts)} parts, {bad} failed verification, "
        f"{len(report.problems)} set problems"
    )
    return "\n".join(lines)
