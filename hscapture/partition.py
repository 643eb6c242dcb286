"""Splitting a dataset into parts by sample key, so that N jobs capture every sample exactly once.

Part ``I`` of ``N`` holds the samples whose key hashes to ``I`` modulo ``N``. The hash is the first
8 bytes of BLAKE2b over the key's UTF-8 bytes, read little-endian: the same on every host, Python
version and run (Python's own ``hash`` of a string is salted per process, so it cannot be used).
``extract --shard I/N`` captures part ``I`` of ``N``; the ``--data-parallel`` jobs of one host do not
split it further by key but share its batches (:mod:`hscapture.extract`), since a static split of a
few thousand samples is uneven. Parts of different counts still combine: parts ``I + N*j`` of
``N*K`` (``j < K``) together hold exactly part ``I`` of ``N`` (a residue modulo ``N*K`` fixes the
residue modulo ``N``), and :func:`coverage` checks any collection of parts against the key space.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

_TEXT = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")
#: Parts whose counts have a least common multiple above this are not checked for coverage.
COVERAGE_LIMIT = 1 << 20


def key_hash(key: str) -> int:
    """A stable 64-bit hash of a sample key (BLAKE2b, 8-byte digest, little-endian)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Part:
    """Part ``index`` of ``count`` of a dataset: the samples whose key hash is ``index`` modulo ``count``.

    Raises:
        ValueError: ``count`` < 1 or ``index`` outside ``0 .. count-1``.
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"part {self.index}/{self.count}: the part count must be at least 1")
        if not 0 <= self.index < self.count:
            raise ValueError(
                f"part {self.index}/{self.count}: the part index must be 0..{self.count - 1} (parts are numbered "
                f"from 0: the {self.count} jobs take 0/{self.count} .. {self.count - 1}/{self.count})"
            )

    @classmethod
    def parse(cls, text: str, what: str = "--shard") -> Part:
        """``"I/N"`` -> ``Part(I, N)``.

        Raises:
            ValueError: not two integers ``I/N`` with ``0 <= I < N``; the message names ``what``.
        """
        match = _TEXT.fullmatch(str(text))
        if match is None:
            raise ValueError(f"{what}: {text!r} is not I/N; give this job's part and the part count, e.g. 0/4 .. 3/4")
        try:
            return cls(int(match.group(1)), int(match.group(2)))
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None

    def owns(self, key: str) -> bool:
        """Whether the sample keyed ``key`` belongs to this part."""
        return key_hash(key) % self.count == self.index

    def overlaps(self, other: Part) -> bool:
        """Whether some key belongs to both parts (by the Chinese remainder theorem: their indices agree
        modulo the greatest common divisor of their counts)."""
        return (self.index - other.index) % math.gcd(self.count, other.count) == 0

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def coverage(parts: Iterable[Part]) -> tuple[list[Part], list[tuple[Part, list[Part]]]]:
    """How a collection of parts covers the key space, in parts of the least common multiple ``L`` of their counts.

    Returns:
        ``(missing, doubled)``: the parts of ``L`` that no part holds, and those that several hold,
        each with the parts holding it. Both empty: every key is in exactly one part. Not checked
        (both empty) when ``L`` exceeds :data:`COVERAGE_LIMIT`.
    """
    parts = list(parts)
    if not parts:
        return [], []
    total = math.lcm(*(p.count for p in parts))
    if total > COVERAGE_LIMIT:
        return [], []
    holders: list[list[Part]] = [[] for _ in range(total)]
    for part in parts:
        for residue in range(part.index, total, part.count):
            holders[residue].append(part)
    missing = [Part(r, total) for r, held in enumerate(holders) if not held]
    doubled = [(Part(r, total), held) for r, held in enumerate(holders) if len(held) > 1]
    return missing, doubled
