"""Fewer rows where the user wants fewer: which positions of a sample are captured, and which requests.

``--positions`` (:class:`Positions`) keeps some positions of every sample: ``all`` (the default),
``loss`` (the trained tokens: positions in the loss mask), ``last`` (the sample's last position) or
``every:K`` (positions 0, K, 2K, ...). The engine adapters apply it before the rows reach the ring,
and the store records it on each request line (``positions``), so that a request is judged complete
against the positions asked, never against every position (FORMAT.md, *Position selection*).

``--sample-rate`` (:func:`sampled`) keeps whole requests: a request is captured when a hash of its
id falls below the rate, so a rerun over the same ids picks the same ones.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: What ``--positions`` accepts, said in every error about it.
FORMS = "all, loss (the trained tokens), last (each sample's last token) or every:K (positions 0, K, 2K, ...)"
_EVERY = re.compile(r"every:(\d+)")
#: A bound past any position: a request still generating has no known end.
_UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class Positions:
    """Which positions of a sample are captured: ``kind`` ``all``, ``loss``, ``last`` or ``every`` (with ``step``)."""

    kind: str = "all"
    step: int = 1

    @classmethod
    def parse(cls, text: str | None, field_name: str = "--positions") -> Positions:
        """``"all"``, ``"loss"``, ``"last"``, ``"every:K"`` (K >= 1; ``every:1`` is ``all``); None or ``""``: all.

        Raises:
            ValueError: anything else, naming the field and the forms it takes.
        """
        value = (text or "all").strip().lower()
        if value in ("all", "loss", "last"):
            return cls(value)
        match = _EVERY.fullmatch(value)
        if match is None or int(match.group(1)) < 1:
            raise ValueError(f"{field_name}: {text!r} is not a position selection; give {FORMS}")
        step = int(match.group(1))
        return cls() if step == 1 else cls("every", step)

    @property
    def everything(self) -> bool:
        """Every position is kept (nothing to record, nothing to filter)."""
        return self.kind == "all"

    def __str__(self) -> str:
        return f"every:{self.step}" if self.kind == "every" else self.kind

    def asked(self, num_tokens: int, loss_mask: Sequence[Sequence[int]] = ()) -> np.ndarray:
        """``[n]`` int64 positions asked of a sample of ``num_tokens`` positions, ascending.

        Args:
            num_tokens: the sample's positions ``0..num_tokens-1``.
            loss_mask: its trained positions as half-open ``[start, end)`` ranges (for ``loss``).
        """
        if self.kind == "all":
            return np.arange(num_tokens, dtype=np.int64)
        if self.kind == "every":
            return np.arange(0, num_tokens, self.step, dtype=np.int64)
        if self.kind == "last":
            return np.arange(max(0, num_tokens - 1), num_tokens, dtype=np.int64)
        ranges = [np.arange(max(0, int(a)), min(int(b), num_tokens), dtype=np.int64) for a, b in loss_mask]
        return np.unique(np.concatenate(ranges)) if ranges else np.empty(0, np.int64)

    def keep(self, positions: np.ndarray, num_tokens: int, loss_mask: Sequence[Sequence[int]] = ()) -> np.ndarray:
        """``[R]`` bool: which of a sample's rows at ``positions`` are asked for."""
        if self.kind == "all":
            return np.ones(len(positions), dtype=bool)
        positions = np.asarray(positions)
        if self.kind == "every":
            return positions % self.step == 0
        if self.kind == "last":
            return positions == num_tokens - 1
        inside = np.zeros(len(positions), dtype=bool)
        for start, end in loss_mask:
            inside |= (positions >= start) & (positions < min(end, num_tokens))
        return inside

    def kept_running(
        self, positions: np.ndarray, prompt_len: int, loss_mask: Sequence[Sequence[int]] | None = None
    ) -> np.ndarray:
        """``[R]`` bool: which rows of a request an engine is running are asked, before its end is known.

        ``last`` is its prompt's last token (teacher forcing: the sample); ``loss`` its ``loss_mask``, or, without
        one (None), every position past its prompt (what it generates).
        """
        if self.kind == "loss":
            return self.keep(positions, _UNBOUNDED, [(prompt_len, _UNBOUNDED)] if loss_mask is None else loss_mask)
        return self.keep(positions, prompt_len)

    def check_mode(self, mode: str) -> None:
        """Refuse ``last`` with ``--mode regenerate``.

        Raises:
            ValueError: a generated answer's last token is known only at its end, after its row left the engine.
        """
        if mode == "regenerate" and self.kind == "last":
            raise ValueError(
                "--positions last with --mode regenerate: a generated answer's last token is known only once "
                "generation ends, after its row left the engine; use --positions loss (the answer), or --mode teacher "
                "on samples that hold the answers"
            )

    def missing(
        self, num_tokens: int, loss_mask: Sequence[Sequence[int]], held: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """The positions asked and not held, as sorted half-open ``[start, end)`` ranges.

        Args:
            num_tokens: the sample's positions.
            loss_mask: its trained positions (for ``loss``).
            held: the merged, sorted ``[start, end)`` ranges of positions it holds (own rows and shared).
        """
        asked = self.asked(num_tokens, loss_mask)
        if not len(asked):
            return []
        starts = np.asarray([r[0] for r in held], dtype=np.int64)
        ends = np.asarray([r[1] for r in held], dtype=np.int64)
        at = np.searchsorted(starts, asked, side="right") - 1
        inside = (at >= 0) & (asked < ends[np.maximum(at, 0)]) if len(starts) else np.zeros(len(asked), bool)
        lacking = asked[~inside]
        if not len(lacking):
            return []
        cuts = np.flatnonzero(np.diff(lacking) != 1) + 1
        return [[int(run[0]), int(run[-1]) + 1] for run in np.split(lacking, cuts)]


def sampled(request_id: str, rate: float | None) -> bool:
    """Whether a request is captured under ``--sample-rate``: the first 8 bytes of BLAKE2b over its id (personal
    ``hscapture-rate``, so it is independent of the part split), little-endian, below ``rate`` x 2^64; None keeps all.
    """
    if rate is None or rate >= 1.0:
        return True
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8, person=b"hscapture-rate").digest()
    return int.from_bytes(digest, "little") < rate * 2.0**64


def check_rate(rate: float | None, field_name: str = "--sample-rate") -> float | None:
    """A sampling rate, checked: ``0 < rate <= 1`` (None: every request).

    Raises:
        ValueError: out of range.
    """
    if rate is not None and not 0.0 < rate <= 1.0:
        raise ValueError(
            f"{field_name}: {rate} is not a rate; give the share of requests to capture, 0 < rate <= 1 "
            "(0.1: one in ten)"
        )
    return rate
