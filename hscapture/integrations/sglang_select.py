"""Which rows of an SGLang batch the plugin keeps under ``--positions``, and what a request's loss mask is.

:class:`RowFilter` takes a forward's kept rows (blocks of consecutive positions, one per request, as
the plugin's hooks lay them out) and keeps those at the positions asked
(:class:`~hscapture.selection.Positions`): per request the trained tokens (``loss``: the loss mask the
request carries in ``custom_params``, or in regenerate mode everything it generates), its last prompt
token (``last``, teacher forcing), or every K-th position. Host values only: the request's own
lengths and parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from hscapture.selection import Positions

#: ``sampling_params["custom_params"]`` key: flat ``[start, end, start, end, ...]`` loss mask.
LOSS_MASK_PARAM = "hscapture_loss_mask"


def given_loss_mask(req: Any) -> list[tuple[int, int]] | None:
    """The loss mask a request was sent with (``custom_params``), as half-open ranges; None when it has none."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    flat = params.get(LOSS_MASK_PARAM)
    if flat is None:
        return None
    return [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]


def loss_mask(req: Any, num_tokens: int) -> list[tuple[int, int]]:
    """A finished request's loss mask: the one it was sent with, else what it generated (regenerate mode)."""
    given = given_loss_mask(req)
    if given is not None:
        return given
    return [(len(req.origin_input_ids), num_tokens)] if len(req.output_ids) > 1 else []


class Kept(NamedTuple):
    """The rows a selection keeps of a forward's kept rows."""

    #: ``[R']`` int64 indices into the rows given.
    local: np.ndarray
    #: The requests owning kept rows, in row order, and how many consecutive kept rows each owns.
    rids: list[str]
    counts: list[int]
    #: Runs of consecutive positions, for the token ids: the request, first position and rows of each.
    reqs: list[Any]
    firsts: list[int]
    runs: list[int]


class RowFilter:
    """Keeps the rows of each request at the positions a :class:`~hscapture.selection.Positions` asks for."""

    def __init__(self, selection: Positions) -> None:
        self.selection = selection

    def select(self, reqs: Sequence[Any], counts: Sequence[int], positions: np.ndarray) -> Kept | None:
        """Of ``counts[i]`` consecutive rows of ``reqs[i]`` at ``positions``, those asked
        (:meth:`~hscapture.selection.Positions.kept_running`, with the loss mask sent in ``custom_params``); None when
        all are."""
        keep = np.empty(len(positions), dtype=bool)
        at = 0
        for req, count in zip(reqs, counts):
            mine = positions[at : at + count]
            keep[at : at + count] = self.selection.kept_running(
                mine, len(req.origin_input_ids), given_loss_mask(req) or None
            )
            at += count
        if keep.all():
            return None
        local = np.flatnonzero(keep)
        owner = np.repeat(np.arange(len(reqs)), counts)[local]
        kept = positions[local]
        starts = np.flatnonzero(np.r_[True, (owner[1:] != owner[:-1]) | (np.diff(kept) != 1)]) if len(local) else local
        runs = np.diff(np.r_[starts, len(local)]).tolist()
        held = np.unique(owner)
        return Kept(
            local,
            [reqs[i].rid for i in held.tolist()],
            np.bincount(owner, minlength=len(reqs))[held].tolist(),
            [reqs[i] for i in owner[starts].tolist()],
            kept[starts].tolist(),
            runs,
        )
