"""The producer's replay paths on a CPU host: a decode run's steps joined in one slot, its roll into the next,
a replay with no rows of its own, each planned in :class:`GraphRows`' real plan table and copied by a host
stand-in of its kernel.

The kernel itself (``csrc/rows_to_planes.cu``) reads those entries on the GPU in ``test_gpu`` and ``test_row_kernel``;
here the host does what it would do with each entry, so CI checks the producer's plans and announcements bitwise.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from hscapture import CaptureConfig, Producer, open_store
from hscapture.producer import RUN_STEPS
from hscapture.producer.row_kernel import PLAN_ENTRIES, GraphRows
from tests.conftest import ConsumerFactory, wait_attached

HIDDEN = 64
TENSORS = 4


class HostGraphRows(GraphRows):
    """:class:`GraphRows` over a host ring: the producer plans each replay's rows in the same table, by the same
    methods (``launched``, ``plan``, ``write``, ``settle``); :meth:`copy` then does what the graph's copy does with
    that replay's entry."""

    def __init__(self, slots: Sequence[torch.Tensor], slot_bytes: int, hidden: int, num_tensors: int, *_: object):
        # The host side of GraphRows.__init__ (its pinned table and device words need a GPU).
        self._base, self._slot_bytes, self._hidden_bytes = slots[0].data_ptr(), slot_bytes, hidden * slots[0].itemsize
        self._num_tensors = num_tensors
        self._entries = np.zeros((PLAN_ENTRIES + 1, 8), dtype=np.int64)
        self._entries[:PLAN_ENTRIES, 0] = -1
        self._words = memoryview(self._entries).cast("B").cast("q")
        self._control = memoryview(self._entries[PLAN_ENTRIES]).cast("B").cast("i")
        self._next, self.wait_s, self._sources, self.pending, self._off = 0, 0.0, set(), False, False
        self._slots, self._hidden = slots, hidden
        self._outputs: list[torch.Tensor] = []
        #: Replays whose copy ran.
        self.replays = 0

    def capture(self, states: Sequence[torch.Tensor]) -> None:
        """The graph's static outputs, ``[N, k * hidden]`` each, as the copy takes them."""
        self._sources.add(states[0].data_ptr())
        h = self._hidden
        self._outputs = [s[:, j * h : (j + 1) * h] for s in states for j in range(s.shape[1] // h)]

    def copy(self) -> None:
        """The copy of the replay launched last, once its entry is there (it must be: the replay waits for it)."""
        step, self.replays = self.replays, self.replays + 1
        tag, destination, plane, begin, count = (int(v) for v in self._entries[step % PLAN_ENTRIES, :5])
        assert tag == step, f"replay {step} found no plan entry (tag {tag})"
        slot, at = divmod(destination - self._base, self._slot_bytes)
        flat, size, h = self._slots[slot], self._slots[slot].itemsize, self._hidden
        at, plane = at // size, plane * 16 // size
        for t, output in enumerate(self._outputs):
            flat[at + t * plane : at + t * plane + count * h].view(count, h).copy_(output[begin : begin + count])


@pytest.fixture
def host_graph_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Producer.graph_rows`` gives a :class:`HostGraphRows` (a host ring has no copy of its own)."""
    monkeypatch.setattr(GraphRows, "load", classmethod(lambda cls, *args: HostGraphRows(*args)))


def runs_of(steps: Sequence[tuple[int, bool]], rows_per_slot: int) -> tuple[int, int]:
    """The chunks that ``steps`` (each ``(rows, indexed)``, all of the same requests) are announced as, and how many
    times a run rolls into a new slot: a run takes the next step while it holds fewer than RUN_STEPS steps and its slot
    has room, else that step opens the next run; an indexed step is a chunk of its own and ends the run before it."""
    chunks = rolls = run_steps = run_rows = 0
    for rows, indexed in steps:
        if not indexed and run_steps and run_steps < RUN_STEPS and run_rows + rows <= rows_per_slot:
            run_steps, run_rows = run_steps + 1, run_rows + rows
            continue
        rolls += 1 if run_steps and not indexed else 0
        chunks += (1 if run_steps else 0) + (1 if indexed else 0)
        run_steps, run_rows = (0, 0) if indexed else (1, rows)
    return chunks + (1 if run_steps else 0), rolls


@pytest.mark.parametrize("policy", ["block", "drop"])
def test_replayed_decode_runs_are_stored_bitwise_through_joins_and_rolls(
    tmp_path: Path,
    endpoint: str,
    start_consumer: ConsumerFactory,
    host_graph_rows: None,
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
) -> None:
    """Replays of one graph (batch 32, then its first 3 rows as a smaller batch, then the whole again): each run's
    steps join one slot until RUN_STEPS or a full slot rolls them into the next; a step with a row index copies
    eagerly and its replay gets an empty entry. Every row, position and token id is stored as the graph made them,
    every replay got exactly one entry, and no run was announced while a replay waited for its plan (its event
    would wait for that replay, and the replay for the host)."""
    batch = 32
    config = CaptureConfig(
        layers=(1, 2, 3), hidden_size=HIDDEN, num_layers=4, dtype="bfloat16", device="cpu", policy=policy,
        endpoint=endpoint, slot_bytes=48 << 10, ring_bytes=(48 << 10) * 6, max_step_rows=batch,
        block_timeout_s=60,
    )  # fmt: skip  # 96 rows a slot: 3 steps of the whole batch, RUN_STEPS of 3 rows
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", in_process=True)
    producer = Producer(config, tensor_descriptions=[f"t{i}" for i in range(TENSORS)])
    wait_attached(producer)
    copy = producer.graph_rows()
    assert isinstance(copy, HostGraphRows)
    outputs = [torch.empty(batch, 3 * HIDDEN, dtype=torch.bfloat16), torch.empty(batch, HIDDEN, dtype=torch.bfloat16)]
    copy.capture(outputs)
    marked_while_pending: list[bool] = []
    mark_written = producer.ring.mark_written

    def watched(index: int, stream: int | None = None) -> None:
        if stream is not None:  # a run's slot, whose event is recorded when it is announced
            marked_while_pending.append(copy.pending)
        mark_written(index, stream)

    producer.ring.mark_written = watched  # type: ignore[method-assign]
    rolled: list[bool] = []  # the path under test: each run's roll into its next slot, in one call under the lock
    roll = Producer._roll

    def counted(self: Producer, *args: object) -> bool:
        rolled.append(roll(self, *args))  # type: ignore[arg-type]
        return rolled[-1]

    monkeypatch.setattr(Producer, "_roll", counted)
    whole = tuple(f"w{i}" for i in range(batch)), (1,) * batch
    small = whole[0][:3], (1,) * 3
    references: dict[str, list[torch.Tensor]] = {}
    generator = torch.Generator().manual_seed(0)
    phases = [(whole, 20), (small, 2 * RUN_STEPS + 5), (whole, 7)]
    step, taken = 0, []
    for owners, steps in phases:
        rows = len(owners[0])
        states = outputs if rows == batch else [o[:rows] for o in outputs]
        for _ in range(steps):
            for output in outputs:  # the replay writes its static outputs
                output.copy_(torch.randn(output.shape, generator=generator).bfloat16())
            copy.launched()
            position = np.array([len(references.get(r, ())) for r in owners[0]], dtype=np.int64)
            taken.append((rows, step in (5, 59)))
            if step in (5, 59):  # rows picked by an index: copied eagerly, the replay's entry has none
                producer.capture_step(states, *owners, position, position + 7, row_index=torch.arange(rows))
            else:
                producer.capture_step(states, *owners, position, position + 7)
            copy.copy()
            kept = torch.cat([o[:rows] for o in outputs], dim=1).view(rows, TENSORS, HIDDEN).clone()
            for i, request in enumerate(owners[0]):
                references.setdefault(request, []).append(kept[i])
            step += 1
    for request in whole[0]:
        producer.finish_request(request, num_tokens=len(references[request]))
    counters = producer.close()
    assert consumer.wait(60) == 0
    assert copy.replays == step and copy.entries == step, "every replay gets exactly one entry"
    # Each run's slot marked once it was announced, never while a replay waited (drop: as many as found a slot).
    assert marked_while_pending and not any(marked_while_pending), marked_while_pending
    store = open_store(tmp_path)
    stored = store.keys(complete_only=True)
    if policy == "block":
        assert counters.rows_dropped == 0 and sorted(stored) == sorted(whole[0])
        phase_starts = [0, 20, 20 + 2 * RUN_STEPS + 5, step]  # each phase's requests: runs of their own
        chunks, rolls = (sum(n) for n in zip(*(runs_of(taken[a:b], 96) for a, b in itertools.pairwise(phase_starts))))
        assert counters.chunks_announced == chunks and len(marked_while_pending) > 10
        assert len(rolled) == rolls > 5 and any(rolled), rolled  # (a roll finding no free slot takes the general path)
    assert counters.rows_captured + counters.rows_dropped == sum(len(r) for r in references.values())
    for request in stored:
        sample, want = store.get(request), torch.stack(references[request])
        got = torch.stack([sample[name] for name in config.tensor_names], dim=1)
        assert torch.equal(got, want), request
        assert sample["positions"].tolist() == list(range(len(want)))
        assert sample["input_ids"].tolist() == list(range(7, 7 + len(want)))
