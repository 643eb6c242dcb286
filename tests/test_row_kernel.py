"""The CUDA ring's one-launch row write (``csrc/rows_to_planes.cu``) gives the bytes of the torch write."""

from __future__ import annotations

import pytest
import torch

from hscapture.producer.row_kernel import RowKernel

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
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert kernel.write(1, states, spans, begin, count, first, plane_rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
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
