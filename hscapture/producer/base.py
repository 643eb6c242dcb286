"""The one engine-facing API: what every engine integration calls, and the producer that does nothing.

Who calls what, and how often (the habit of vLLM's KV connector base class):

* **Engine thread, once per forward step**, one of:

  - :meth:`EngineProducer.capture_step`: the step's rows and, per row, its request, position and
    token id. Copies the rows into a ring slot now; announces them to the consumer. A decode engine
    that passes the same request tuples step after step has its steps put into one slot and
    announced together (up to ``RUN_STEPS`` steps or a full slot, until the requests change, one of
    them ends, the engine polls or the producer closes), so the announcement's cost is paid once
    per several steps.
  - :meth:`EngineProducer.write_step` right after the forward, then :meth:`EngineProducer.announce_step`
    once the host holds the step's token ids (an overlap scheduler, as SGLang's, learns them only
    after the next forward was launched). A step written ``extendable`` may take the rows of later
    steps of the same requests (:meth:`EngineProducer.extend_step`): one chunk for them all.
* **Engine thread, once per CUDA graph capture** (GPU engines that replay decode from graphs):
  :meth:`EngineProducer.graph_rows` gives the copy to capture inside the graph, after the forward;
  each replay then tells it :meth:`~hscapture.producer.row_kernel.GraphRows.launched` and the step's
  ``capture_step`` / ``write_step`` only says where its rows go (no launch).
* **Engine thread, once per request that ends**: :meth:`EngineProducer.finish_request`, after every
  step holding its rows was captured or announced.
* **Once at start** (optional): :meth:`EngineProducer.wait_attached` waits for the consumer, so
  that the first steps under ``drop`` are not dropped for want of one.
* **Engine thread, when idle** (optional): :meth:`EngineProducer.poll` sends what is held and lets a
  consumer attach at once. (:class:`~hscapture.producer.producer.Producer` serves its sockets from a
  thread of its own too, every few milliseconds: nothing is left unsent when the engine never polls.)
* **Once at shutdown**: :meth:`EngineProducer.close` (or the ``with`` block's end).

Under ``drop`` none of these ever waits: rows without a free slot are dropped and counted exactly,
per request. Under ``block`` they wait for credit and lose nothing. :class:`NullProducer` implements
the same API and does nothing, so call sites need no ``if capture_enabled``; a class that misses a
method of the API cannot be instantiated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from hscapture.producer.row_kernel import GraphRows


@dataclass
class ProducerCounters:
    """Running totals kept by the producer itself (the store records the final ones)."""

    steps: int = 0
    rows_captured: int = 0
    rows_dropped: int = 0
    chunks_announced: int = 0
    chunks_dropped: int = 0
    #: Times ``block`` had to wait for credit or a consumer, and the microseconds spent waiting.
    credit_waits: int = 0
    credit_wait_us: int = 0
    events_dropped: int = 0
    messages_rejected: int = 0
    attaches: int = 0
    #: Hellos of a second consumer refused while another was attached.
    consumers_refused: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class WrittenStep:
    """One step's rows copied into ring slots (the copies queued), not announced yet.

    Made by :meth:`EngineProducer.write_step`; handed back once to :meth:`EngineProducer.announce_step`.
    """

    #: The producer's step number when the rows were written.
    step: int
    #: Kept rows of the step (what ``positions`` and ``token_ids`` cover at announce time).
    rows: int
    #: Kept rows copied into the ring: the first ``written``; the rest were dropped and counted.
    written: int
    #: The first step's owners: its requests, and the consecutive kept rows each owns.
    request_ids: Sequence[str]
    request_rows: Sequence[int]
    #: ``(slot, first kept row, rows)`` of each slot written, in row order; emptied when announced.
    slots: list[tuple[int, int, int]]
    #: Rows per plane of its one slot when later steps may add rows there (:meth:`EngineProducer.extend_step`);
    #: 0 when the planes hold just its rows.
    row_stride: int = 0
    #: The stream its copies were queued on, when its slot's event waits for its announcement (``row_stride``).
    stream: int = 0
    #: Its rows were written by the copy inside a graph replay (:class:`GraphRows`): that graph's own outputs.
    replayed: bool = False
    #: The owners of each later step's rows (:meth:`EngineProducer.extend_step`), joined to the first's when
    #: announced: a decode step adds two references here, not one per request.
    joined: list[tuple[Sequence[str], Sequence[int]]] = field(default_factory=list)

    def owners(self) -> tuple[Sequence[str], Sequence[int]]:
        """Request ids and rows of every step it holds, in row order."""
        return joined_owners(self.request_ids, self.request_rows, self.joined)


def joined_owners(
    request_ids: Sequence[str], request_rows: Sequence[int], joined: Sequence[tuple[Sequence[str], Sequence[int]]]
) -> tuple[Sequence[str], Sequence[int]]:
    """The owners of a first step followed by those of each step that ``joined`` it, in row order (the first step's
    own tuples when none did)."""
    if not joined:
        return request_ids, request_rows
    ids, rows = list(request_ids), list(request_rows)
    for step_ids, step_rows in joined:
        ids += step_ids
        rows += step_rows
    return ids, rows


class EngineProducer(ABC):
    """What an engine hook calls; see the module docstring for who calls what and how often."""

    #: Running totals (the store records the final ones).
    counters: ProducerCounters

    @abstractmethod
    def capture_step(
        self,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        positions: np.ndarray | torch.Tensor | Sequence[int],
        token_ids: np.ndarray | torch.Tensor | Sequence[int],
        row_index: torch.Tensor | None = None,
    ) -> int:
        """Capture one forward step's rows; returns how many rows were copied into the ring (announced now or
        with the steps after them; a send that ``drop`` cannot make later counts them dropped).

        Args:
            states: the captured tensors in ``config.tensor_names`` order, in ``config.dtype``, all on one
                device: each ``[N, hidden]``, or ``[N, k * hidden]`` holding ``k`` consecutive captured tensors
                side by side (SGLang's concatenated aux layers).
            request_ids: the requests owning the kept rows, in row order. Pass the same tuple step after step
                while the batch does not change: it is checked and encoded once, and those steps share a slot.
            request_rows: how many consecutive kept rows each request owns (a tuple, likewise).
            positions: ``[R]`` int position of each kept row in its request (host values: a list, numpy array
                or CPU tensor; reading a device tensor would synchronize). Read during the call: the caller may
                reuse its array after. A ``[R]`` int64 numpy array is read as it is, the cheapest on a decode step.
            token_ids: ``[R]`` int token id of each kept row (host values, likewise).
            row_index: ``[R]`` int64 indices into the ``N`` rows of ``states`` to keep (drops padding), on the
                states' device; ``None`` keeps all ``N`` rows in order.

        Raises:
            ValueError: shapes, dtypes or counts do not match what was planned, or positions or token ids are
                on a device.
            CreditTimeout: ``block`` waited longer than ``block_timeout_s``.
        """

    @abstractmethod
    def write_step(
        self,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        row_index: torch.Tensor | None = None,
        *,
        extendable: bool = False,
    ) -> WrittenStep:
        """Copy one forward step's rows into ring slots now; announce them later (:meth:`announce_step`).

        The copy is queued on the current stream, so it runs before whatever the engine queues there next
        (a graph replay that overwrites its outputs). Nothing is sent: the slots stay the producer's until
        announced.

        Args:
            states, request_ids, request_rows, row_index: as for :meth:`capture_step`.
            extendable: lay the rows out so that later steps may add theirs to the same slot
                (:meth:`extend_step`), when they fit one slot and keep every row.

        Raises:
            ValueError: as for :meth:`capture_step`; or every slot holds rows written and not announced.
            CreditTimeout: ``block`` waited longer than ``block_timeout_s``.
        """

    @abstractmethod
    def extend_step(
        self,
        step: WrittenStep,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
    ) -> bool:
        """Copy one more forward step's rows into the slot of ``step`` (written ``extendable``, not announced),
        after its rows; they extend its owners and the positions and token ids it is announced with.

        Returns:
            False, writing nothing, when the rows do not fit the slot, ``step`` was dropped or not written
            ``extendable``, or the current stream is not the one it was written on: write them as a step of
            their own.
        """

    @abstractmethod
    def announce_step(
        self,
        step: WrittenStep,
        positions: np.ndarray | torch.Tensor | Sequence[int],
        token_ids: np.ndarray | torch.Tensor | Sequence[int],
    ) -> int:
        """Announce a step made by :meth:`write_step`, once, in the order the steps were written and before
        :meth:`finish_request` of any request owning rows in it; returns how many rows were announced.

        Args:
            step: what :meth:`write_step` returned.
            positions, token_ids: ``[step.rows]`` int per kept row (host values).

        Raises:
            ValueError: announced already; or the lengths do not match it, or the values are on a device (then
                its slots are freed and its rows counted dropped).
        """

    @abstractmethod
    def finish_request(
        self,
        request_id: str,
        reason: str = "finished",
        *,
        num_tokens: int = 0,
        loss_mask: Sequence[tuple[int, int]] = (),
        meta: dict[str, Any] | None = None,
        prefix_token_ids: Sequence[int] | np.ndarray = (),
        positions: str = "",
    ) -> None:
        """Say that no more rows come for ``request_id``, and why.

        Args:
            request_id: as given with its rows.
            reason: ``finished``, ``aborted``, ``retracted`` or another engine word.
            num_tokens: rows the request should have in total (0 if unknown).
            loss_mask: half-open position ranges ``[start, end)`` trained on.
            meta: msgpack-safe facts stored with the request.
            prefix_token_ids: host token ids of the request's first positions that the engine never forwarded (a
                prefix-cache hit); the store takes their rows from the request that computed them.
            positions: the positions its rows were kept at (``--positions``: ``loss``, ``last``, ``every:K``, as
                :class:`~hscapture.selection.Positions` spells them; empty: every one), so that the store judges it
                complete against those.
        """

    @abstractmethod
    def graph_rows(self) -> GraphRows | None:
        """The ring's copy for the engine's CUDA graphs (made on first call); None where there is none (a host
        ring, kernels that do not compile, capture off)."""

    @abstractmethod
    def poll(self) -> None:
        """Send what is held, answer attaching consumers and take releases; call when the engine is idle."""

    @abstractmethod
    def wait_attached(self, timeout_s: float) -> bool:
        """Serve the sockets until a consumer has attached, at most ``timeout_s`` seconds; returns whether one has.
        Call it before serving starts: under ``drop`` every row captured with no consumer attached is dropped."""

    @abstractmethod
    def close(self, timeout_s: float = 30.0, error: str = "") -> ProducerCounters:
        """Announce the end of stream (with ``error``, why capture failed, if it did), wait up to ``timeout_s``
        for the consumer to copy out what is in flight, free the ring. Idempotent; returns the final counters."""

    @property
    @abstractmethod
    def attached(self) -> bool:
        """Whether a consumer has completed the handshake with this run."""

    def __enter__(self) -> EngineProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullProducer(EngineProducer):
    """Capture switched off: the engine-facing API, doing nothing."""

    def __init__(self) -> None:
        self.counters = ProducerCounters()

    def capture_step(
        self,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        positions: np.ndarray | torch.Tensor | Sequence[int],
        token_ids: np.ndarray | torch.Tensor | Sequence[int],
        row_index: torch.Tensor | None = None,
    ) -> int:
        return 0

    def write_step(
        self,
        states: Sequence[torch.Tensor],
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        row_index: torch.Tensor | None = None,
        *,
        extendable: bool = False,
    ) -> WrittenStep:
        return WrittenStep(0, sum(request_rows), 0, request_ids, request_rows, [])

    def extend_step(
        self, step: WrittenStep, states: Sequence[torch.Tensor], request_ids: Sequence[str], request_rows: Sequence[int]
    ) -> bool:
        return False

    def announce_step(
        self,
        step: WrittenStep,
        positions: np.ndarray | torch.Tensor | Sequence[int],
        token_ids: np.ndarray | torch.Tensor | Sequence[int],
    ) -> int:
        return 0

    def finish_request(
        self,
        request_id: str,
        reason: str = "finished",
        *,
        num_tokens: int = 0,
        loss_mask: Sequence[tuple[int, int]] = (),
        meta: dict[str, Any] | None = None,
        prefix_token_ids: Sequence[int] | np.ndarray = (),
        positions: str = "",
    ) -> None:
        return None

    def graph_rows(self) -> GraphRows | None:
        return None

    def poll(self) -> None:
        return None

    def wait_attached(self, timeout_s: float) -> bool:
        return False

    def close(self, timeout_s: float = 30.0, error: str = "") -> ProducerCounters:
        return self.counters

    @property
    def attached(self) -> bool:
        return False


def device_index(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """A ``row_index`` for :meth:`EngineProducer.capture_step` / ``write_step`` from host rows, on ``device``.

    On a GPU the rows are staged in pinned memory first (torch's caching host allocator holds the block until
    the copy is done): a ``non_blocking`` copy from pageable memory may make the host wait for the stream."""
    index = torch.from_numpy(rows)
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)
