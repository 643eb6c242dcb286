"""The CUDA ring's row writes (``hscapture/csrc/rows_to_planes.cu``) give the bytes of the torch write: one launch
per step (``RowKernel``), or a copy captured in a CUDA graph that takes each replay's destination from the host's plan
(``GraphRows``)."""

from __future__ import annotations

import pytest
import torch

from hscapture.producer.row_kernel import GraphRows, RowKernel
from tests.conftest import sync_debug

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
HIDDEN = 384
SLOT_ROWS = 64


def current_stream() -> int:
    """The raw handle of the current stream, where the kernel launches (the ring's ``current_stream``)."""
    return torch.cuda.current_stream().cuda_stream


def ring(num_tensors: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Three slots of one allocation, filled with 0xA5 bytes."""
    slots = 3
    slot_bytes = num_tensors * SLOT_ROWS * HIDDEN * torch.tensor([], dtype=dtype).element_size()
    memory = torch.full((slots * slot_bytes,), 0xA5, dtype=torch.uint8, device="cuda")
    return memory, [memory[i * slot_bytes : (i + 1) * slot_bytes].view(dtype) for i in range(slots)]


def expected(
    slot: torch.Tensor, states: list[torch.Tensor], begin: int, count: int, first: int, plane_rows: int
) -> torch.Tensor:
    """The slot after a torch write of the same rows: tensor t's rows in plane t, from row ``first``."""
    want = slot.clone()
    tensors = [part for state in states for part in state[begin : begin + count].split(HIDDEN, dim=1)]
    planes = want[: len(tensors) * plane_rows * HIDDEN].view(len(tensors), plane_rows, HIDDEN)
    for t, rows in enumerate(tensors):
        planes[t, first : first + count] = rows
    return want


@pytest.mark.parametrize(
    ("case", "begin", "count", "first", "plane_rows"),
    [
        ("sglang-decode", 0, 16, 0, 16),  # aux layers side by side + last: a step of its own
        ("sglang-run", 0, 16, 32, SLOT_ROWS),  # the third step of a decode run, in a slot's rows
        ("split-step", 40, 24, 0, 24),  # the second slot of a step too big for one
        ("separate", 0, 16, 3, SLOT_ROWS),  # one tensor per state
        ("strided-rows", 0, 16, 0, 16),  # a state that is a column slice of a wider tensor
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_row_kernel_writes_the_torch_writes_bytes_without_a_sync(
    case: str, begin: int, count: int, first: int, plane_rows: int, dtype: torch.dtype
) -> None:
    rows = begin + count
    make = lambda width: torch.randn(rows, width, device="cuda").to(dtype)  # noqa: E731
    if case == "separate":
        states = [make(HIDDEN) for _ in range(4)]
    elif case == "strided-rows":
        wide = make(5 * HIDDEN)
        states = [wide[:, HIDDEN : 4 * HIDDEN], make(HIDDEN)]
    else:
        states = [make(3 * HIDDEN), make(HIDDEN)]
    spans = [state.shape[1] // HIDDEN for state in states]
    _, slots = ring(4, dtype)
    kernel = RowKernel.load(slots, slots[0].numel() * slots[0].element_size(), HIDDEN, 4, current_stream)
    assert kernel is not None
    want = expected(slots[1], states, begin, count, first, plane_rows)
    before = [slots[0].clone(), slots[2].clone()]
    torch.cuda.synchronize()
    with sync_debug("error"):
        assert kernel.write(1, states, spans, begin, count, first, plane_rows)
    torch.cuda.synchronize()
    assert torch.equal(slots[1].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(slots[0], before[0]) and torch.equal(slots[2], before[1]), "wrote outside its slot"


def test_row_kernel_declines_what_it_cannot_copy_queuing_nothing() -> None:
    memory, slots = ring(4)
    slot_bytes = slots[0].numel() * slots[0].element_size()
    kernel = RowKernel.load(slots, slot_bytes, HIDDEN, 4, current_stream)
    assert kernel is not None
    five = [torch.randn(8, HIDDEN, device="cuda").bfloat16() for _ in range(5)]
    assert not kernel.write(0, five, [1, 1, 1, 1, 1], 0, 8, 0, 8), "more than 4 sources"
    on_host = torch.randn(8, 4 * HIDDEN).bfloat16()
    assert not kernel.write(0, [on_host], [4], 0, 8, 0, 8), "a state on the host"
    columns = torch.randn(4 * HIDDEN, 8, device="cuda").bfloat16().t()
    assert not kernel.write(0, [columns], [4], 0, 8, 0, 8), "rows not contiguous"
    odd = torch.randn(8 * 4 * HIDDEN + 1, device="cuda").bfloat16()[1:].view(8, 4 * HIDDEN)
    assert not kernel.write(0, [odd], [4], 0, 8, 0, 8), "rows not 16-byte aligned"
    torch.cuda.synchronize()
    assert (memory == 0xA5).all(), "a declined write queued something"
    assert RowKernel.load([s.cpu() for s in slots], slot_bytes, HIDDEN, 4, current_stream) is None, "a host ring"
    assert RowKernel.load(slots, slot_bytes, 3, 4, current_stream) is None, "rows of 6 bytes are not 16-byte vectors"


def captured_copy(
    graph_rows: GraphRows, rows: int, dtype: torch.dtype
) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]:
    """A graph standing for an engine's decode forward: it writes fresh rows into static outputs (aux layers side by
    side, then the last layer), then holds the plan-driven copy of them. Returns it, its outputs and its input."""
    seed = torch.zeros(1, device="cuda")
    aux, last = (
        torch.zeros(rows, 3 * HIDDEN, device="cuda", dtype=dtype),
        torch.zeros(rows, HIDDEN, device="cuda", dtype=dtype),
    )
    pattern = torch.randn(rows, 4 * HIDDEN, device="cuda")

    def forward() -> None:
        fresh = (pattern + seed).to(dtype)
        aux.copy_(fresh[:, : 3 * HIDDEN])
        last.copy_(fresh[:, 3 * HIDDEN :])

    forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
        graph_rows.capture([aux, last])
    return graph, [aux, last], seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_graph_copy_writes_where_each_replay_was_planned_after_its_launch(dtype: torch.dtype) -> None:
    """Replays planned into a fresh slot, then the next rows of a run, then none (a replay whose rows the host did
    not keep), then past the padding of a smaller batch: each slot ends as the torch write of those rows leaves it,
    and the host's side (launched, write, settle) never syncs."""
    memory, slots = ring(4, dtype)
    slot_bytes = slots[0].numel() * slots[0].element_size()
    graph_rows = GraphRows.load(slots, slot_bytes, HIDDEN, 4)
    assert graph_rows is not None
    rows = 16
    graph, outputs, seed = captured_copy(graph_rows, rows, dtype)
    spans = [3, 1]
    plans = [(1, 0, rows, 0, rows), (1, rows, rows, rows, SLOT_ROWS), (None, 0, 0, 0, 0), (2, 0, 5, 7, SLOT_ROWS)]
    wants = {i: slots[i].clone() for i in range(3)}
    torch.cuda.synchronize()
    for step, (slot, _, count, first, plane_rows) in enumerate(plans):
        seed.fill_(step)
        graph.replay()  # launched before the host knows where its rows go
        with sync_debug("error"):
            graph_rows.launched()
            if slot is not None:
                assert graph_rows.write(slot, outputs, spans, 0, count, first, plane_rows)
            graph_rows.settle()
        torch.cuda.synchronize()
        if slot is not None:
            wants[slot] = expected(wants[slot], [o.clone() for o in outputs], 0, count, first, plane_rows)
        for i in range(3):
            assert torch.equal(slots[i].view(torch.uint8), wants[i].view(torch.uint8)), (step, i)
    assert graph_rows.entries == len(plans) and not graph_rows.failed
    # A write for other tensors than the graph's outputs plans nothing: the producer writes those with a launch.
    graph_rows.launched()
    assert not graph_rows.write(1, [o.clone() for o in outputs], spans, 0, rows, 0, rows)
    graph_rows.settle()
    graph.replay()
    torch.cuda.synchronize()
    assert not graph_rows.failed and memory.numel()


def test_graph_copy_without_a_plan_turns_off_and_says_so() -> None:
    """A replay the host never planned waits ``wait_s``, copies nothing and raises ``failed``; every later replay
    returns at once. After ``off`` (the producer closed) replays copy nothing and wait for nothing."""
    _, slots = ring(4)
    slot_bytes = slots[0].numel() * slots[0].element_size()
    before = [slot.clone() for slot in slots]
    graph_rows = GraphRows.load(slots, slot_bytes, HIDDEN, 4, wait_s=0.2)
    assert graph_rows is not None
    graph, _, _ = captured_copy(graph_rows, 8, torch.bfloat16)
    graph.replay()  # never planned
    torch.cuda.synchronize()
    assert graph_rows.failed
    graph_rows.launched()
    assert not graph_rows.pending  # the copies are off: no entry is owed
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) < 100, "an off copy waited for its plan"
    assert all(torch.equal(a, b) for a, b in zip(slots, before)), "an unplanned copy wrote"

    closed = GraphRows.load(slots, slot_bytes, HIDDEN, 4, wait_s=30)
    assert closed is not None
    graph, _, _ = captured_copy(closed, 8, torch.bfloat16)
    closed.off()
    graph.replay()
    torch.cuda.synchronize()  # returns at once, not after 30 s
    assert not closed.failed and all(torch.equal(a, b) for a, b in zip(slots, before))


def test_graph_copy_refuses_outside_a_capture_and_sources_it_cannot_take() -> None:
    _, slots = ring(4)
    graph_rows = GraphRows.load(slots, slots[0].numel() * slots[0].element_size(), HIDDEN, 4)
    assert graph_rows is not None
    aux, last = (
        torch.zeros(8, 3 * HIDDEN, device="cuda", dtype=torch.bfloat16),
        torch.zeros(8, HIDDEN, device="cuda", dtype=torch.bfloat16),
    )
    with pytest.raises(ValueError, match="inside the engine's CUDA graph capture"):
        graph_rows.capture([aux, last])
    for sources, why in (([aux], "hold 3 tensors"), ([aux[:, 1:], last], "16-byte aligned")):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ValueError, match=why), torch.cuda.graph(graph):
            last.add_(1)  # the capture holds something
            graph_rows.capture(sources)
    assert not graph_rows.captured
