"""A step's checks against the plan: what every engine hands the producer, refused with "planned X, got Y".

A decode engine passes the same request tuples and states of the same shapes step after step:
that is checked once and then only compared, since the checks would otherwise cost more than the
copy they guard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import numpy as np
import torch

from hscapture import protocol
from hscapture.config import CaptureConfig, dtype_name


class Owners:
    """Request ids and rows that an engine passes step after step as the same tuples (a decode batch that did
    not change): checked once, not every step, and encoded once a chunk needs them (a run's chunk, of steps
    joined in one slot, lists its owners itself when it is taken: a decode loop never encodes them)."""

    __slots__ = ("_encoded", "request_ids", "request_rows", "rows")

    def __init__(self, request_ids: tuple[str, ...], request_rows: tuple[int, ...], rows: int) -> None:
        self.request_ids, self.request_rows, self.rows = request_ids, request_rows, rows
        self._encoded: tuple[msgspec.Raw, msgspec.Raw] | None = None

    def encoded(self) -> tuple[msgspec.Raw, msgspec.Raw]:
        """The ids and the rows as a chunk's fields hold them (made on first call)."""
        if self._encoded is None:
            self._encoded = protocol.encoded(self.request_ids), protocol.encoded(self.request_rows)
        return self._encoded


class Checked(NamedTuple):
    """The last step checked with the owners of :attr:`StepChecks.owners`: a step with the same tuples and states of
    the same shapes passes without the checks (a replay's, of the graph's own outputs, on the tuples alone)."""

    request_ids: Sequence[str]
    request_rows: Sequence[int]
    #: Each state's (shape, dtype).
    signature: list[tuple[torch.Size, torch.dtype]]
    rows: int
    spans: tuple[int, ...]


class StepChecks:
    """Checks the steps of one run against its :class:`~hscapture.config.CaptureConfig`.

    Args:
        config: the run's configuration (hidden size, dtype, tensors, ``max_step_rows``).
    """

    def __init__(self, config: CaptureConfig) -> None:
        self.config = config
        self._hidden, self._dtype, self._num_tensors = config.hidden_size, config.torch_dtype, config.num_tensors
        #: The owners passed as the same tuples as before (checked once).
        self.owners: Owners | None = None
        #: The last step checked with the owners of ``owners``.
        self.checked: Checked | None = None

    def same_owners(self, request_ids: Sequence[str], request_rows: Sequence[int]) -> bool:
        """``request_ids`` and ``request_rows`` are the very tuples checked and encoded last."""
        owners = self.owners
        return owners is not None and request_ids is owners.request_ids and request_rows is owners.request_rows

    def step(
        self,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        row_index: torch.Tensor | None,
        replayed: bool = False,
    ) -> tuple[int, tuple[int, ...]]:
        """Check a step against the plan; returns its kept rows and how many tensors each state holds.

        ``replayed`` rows (a graph replay's copy of its own outputs, checked when the copy was captured) need only
        the same owners as the step checked last.

        Raises:
            ValueError: a state's shape or dtype, the tensor count, the owners' rows or the step's rows differ from
                the plan; the message names the state and shows the planned value beside the one received.
        """
        checked = self.checked
        same = (
            checked is not None
            and row_index is None
            and request_ids is checked.request_ids
            and request_rows is checked.request_rows
        )
        if same and replayed:
            return checked.rows, checked.spans  # type: ignore[union-attr]
        signature = [(state.shape, state.dtype) for state in states]
        if same and signature == checked.signature:  # type: ignore[union-attr]
            return checked.rows, checked.spans  # type: ignore[union-attr]
        config, hidden, dtype = self.config, self._hidden, self._dtype
        rows_in = states[0].shape[0] if states else 0
        spans: list[int] = []
        for state in states:  # the names only when something is wrong: building them costs
            shape = state.shape
            k = shape[-1] // hidden if len(shape) == 2 else 0
            if not k or shape[0] != rows_in or shape[1] != k * hidden:
                raise ValueError(
                    f"states[{self._state_name(spans)}]: planned [{rows_in}, {hidden}], got {list(shape)} "
                    f"(a state holding k captured tensors side by side is [{rows_in}, k * {hidden}])"
                )
            if state.dtype != dtype:
                raise ValueError(
                    f"states[{self._state_name(spans)}]: planned dtype {config.dtype}, got {dtype_name(state.dtype)}"
                )
            spans.append(k)
        if sum(spans) != self._num_tensors:
            raise ValueError(f"states: planned {config.num_tensors} tensors {config.tensor_names}, got {sum(spans)}")
        rows = rows_in if row_index is None else row_index.numel()
        if self.owned_rows(request_ids, request_rows) != rows or len(request_ids) != len(request_rows):
            raise ValueError(
                f"request_rows: {len(request_ids)} request ids with rows summing to {sum(request_rows)}, "
                f"but the step keeps {rows} rows"
            )
        if rows > config.max_step_rows:
            raise ValueError(
                f"step rows: planned at most max_step_rows={config.max_step_rows}, got {rows}; "
                "raise max_step_rows (and ring_bytes)"
            )
        checked_spans = tuple(spans)
        if row_index is None and self.same_owners(request_ids, request_rows):  # tuples: the same values next time
            self.checked = Checked(request_ids, request_rows, signature, rows, checked_spans)
        return rows, checked_spans

    def owned_rows(self, request_ids: Sequence[str], request_rows: Sequence[int]) -> int:
        """The rows ``request_rows`` adds up to; the same tuples as before are checked once.

        Raises:
            ValueError: a request owns no row.
        """
        owners = self.owners
        if owners is not None and request_ids is owners.request_ids and request_rows is owners.request_rows:
            return owners.rows
        if request_rows and min(request_rows) <= 0:
            raise ValueError(f"request_rows: every request owns at least one row, got {list(request_rows)[:16]}")
        rows = sum(request_rows)
        if type(request_ids) is tuple and type(request_rows) is tuple and len(request_ids) == len(request_rows):
            self.owners = Owners(request_ids, request_rows, rows)
        return rows

    def _state_name(self, spans: Sequence[int]) -> str:
        """The captured tensor a state checked after ``spans`` starts with (its index when past the last)."""
        names, first = self.config.tensor_names, sum(spans)
        return names[first] if first < len(names) else str(len(spans))


#: The wire's int64 (:data:`~hscapture.protocol.ROW_DTYPE`), numpy's own int64 on a little-endian host: an array of
#: it has this very object (``is``, cheaper than ``==``, which converts), and its bytes are what a chunk holds.
INT64 = protocol.ROW_DTYPE


def as_int64(values: np.ndarray | torch.Tensor | Sequence[int], rows: int, name: str) -> np.ndarray:
    """``values`` as ``[rows]`` little-endian int64 host values (the array itself when it is one already).

    Raises:
        ValueError: a device tensor (reading it would make the host wait for the device), or not ``rows`` values.
    """
    if type(values) is np.ndarray and values.dtype is INT64 and values.ndim == 1 and len(values) == rows:
        return values  # what an engine adapter usually hands over: nothing to convert, and no numpy call to look
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(
                f"{name}: a tensor on {values.device}; reading it here would make the host wait for the device "
                "every step. Pass host values (a list, numpy array or CPU tensor) the engine already holds"
            )
        values = values.detach().numpy()
    array = np.asarray(values, dtype=INT64).reshape(-1)
    if array.shape[0] != rows:
        raise ValueError(f"{name}: planned {rows} values (one per kept row), got {array.shape[0]}")
    return array
