"""The CUDA ring's write of a step's rows into a slot: one driver launch of ``hscapture/csrc/rows_to_planes.cu``.

A decode step's rows are a few hundred KiB: the GPU copies them in a microsecond or two, and what
the write costs is the host's time to queue it, on the engine's thread, every step. On the H200
host torch's strided ``cat`` into a slot's planes took ~27 µs of it (two reshapes, a slice, the
dispatcher, a launch); one ``cuLaunchKernel`` through ctypes, its argument block made once and
only the pointers and sizes updated, takes ~6 µs (cupy's own launch call: 8 µs before making its
arguments). ``benchmarks/sglang_hooks.py`` measures the plugin's hooks with and without it.

Inside an engine loop on the H200 hosts, though, any launch from Python costs 25-45 µs (the
benchmark's ``floor``). :class:`GraphRows` takes the launch out of the step: the same copy is
captured once in the engine's own CUDA graph, after the forward, and each replay takes its
destination from a plan table in mapped host memory that the host fills after launching the
replay (a few stores, no driver call); see ``hscapture/csrc/rows_to_planes.cu``.

Sources it takes: up to :data:`MAX_SOURCES` tensors ``[N, k * hidden]`` of the ring's dtype on
the ring's GPU, rows 16-byte aligned, each row contiguous. Anything else (and a step with a
``row_index``) goes the producer's torch path, which gives the same bytes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import torch

from hscapture.cuda_kernels import kernel
from hscapture.errors import HSCaptureError

#: Sources one launch takes (SGLang hands two: its aux layers side by side, and the last layer).
MAX_SOURCES = 4
_THREADS = 128
#: The kernel's arguments: 4 source pointers, 4 row strides and 4 tensor counts, then destination, plane, hvec.
_ARGUMENTS = (
    [ctypes.c_uint64] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 4 + [ctypes.c_uint64] + [ctypes.c_int64] * 2
)
_DST, _PLANE, _HVEC = 12, 13, 14
#: The graph copy's arguments: the sources' (as :data:`_ARGUMENTS`), then hvec and the replay's entry in device memory.
_PLANNED_ARGUMENTS = [*_ARGUMENTS[:12], ctypes.c_int64, ctypes.c_uint64]
#: The plan fetch's arguments: plan table, counter, mask, control words, timeout, the entry's copy in device memory.
_FETCH_ARGUMENTS = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint64]
#: Replays the plan table has room for ahead of the GPU (an engine queues one or two).
PLAN_ENTRIES = 1024
#: How long a graph's copy waits for its plan entry (beyond a ``block`` producer's wait for credit) before
#: it turns the copies off and raises the fault word: only a replay the host never saw waits that long,
#: and then capture stops, loudly.
PLAN_WAIT_S = 2.0


@cache
def _driver() -> tuple[Any, Any]:
    """``cuLaunchKernel`` and ``cuGetErrorName`` of the driver, typed once."""
    driver = ctypes.CDLL("libcuda.so.1")
    launch = driver.cuLaunchKernel
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return launch, driver.cuGetErrorName


def _device_pointer(host: int) -> int:
    """The device's address of pinned host memory at ``host`` (``cuMemHostGetDevicePointer``)."""
    pointer = ctypes.c_uint64()
    status = ctypes.CDLL("libcuda.so.1").cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), ctypes.c_void_p(host), 0)
    if status:
        raise HSCaptureError(f"graph ring write: pinned memory has no device address (CUDA error {status})")
    return pointer.value


def _launch_failed(status: int, what: str) -> HSCaptureError:
    name = ctypes.c_char_p()
    _driver()[1](status, ctypes.byref(name))
    return HSCaptureError(f"{what}: cuLaunchKernel failed with CUDA error {status} ({name.value!r})")


def _functions(slots: Sequence[torch.Tensor], slot_bytes: int, hidden: int, *names: str) -> list[int] | None:
    """The kernels ``names`` for a ring whose slot ``i`` is ``slots[i]``, as driver function handles; None on a
    host ring, where the rows cannot be 16-byte vectors, or where they do not compile."""
    first = slots[0] if slots else None
    if first is None or not first.is_cuda:
        return None
    if (hidden * first.element_size()) % 16 or slot_bytes % 16 or first.data_ptr() % 16:
        return None
    functions = []
    with torch.cuda.device(first.get_device()):
        for name in names:
            raw = kernel("rows_to_planes.cu", name, "the producer writes rows with torch")
            if raw is None:
                return None
            functions.append(raw.kernel.ptr if hasattr(raw, "kernel") else raw.ptr)
    return functions


def _threads(hidden_bytes: int) -> int:
    return min(_THREADS, -(-hidden_bytes // 16 // 32) * 32)


class RowKernel:
    """Writes rows of a step into a CUDA ring's slots by one launch on the current stream.

    Made by :meth:`load`, which returns None where the kernel cannot run (the producer then
    writes with torch).
    """

    def __init__(
        self,
        function: int,
        base: int,
        slot_bytes: int,
        hidden_bytes: int,
        num_tensors: int,
        device: int,
        stream: Callable[[], int],
    ) -> None:
        self._base, self._slot_bytes, self._hidden_bytes = base, slot_bytes, hidden_bytes
        self._device = device
        # The launch's arguments that never change, as ctypes objects (no conversion per call).
        self._function, self._tensors = ctypes.c_void_p(function), ctypes.c_uint(num_tensors)
        self._one, self._none = ctypes.c_uint(1), ctypes.c_uint(0)
        self._threads = ctypes.c_uint(_threads(hidden_bytes))
        self._values = [kind() for kind in _ARGUMENTS]
        self._values[_HVEC].value = hidden_bytes // 16
        self._params = (ctypes.c_void_p * len(_ARGUMENTS))(*[ctypes.addressof(v) for v in self._values])
        self._launch = _driver()[0]
        self._stream = stream

    @classmethod
    def load(
        cls, slots: Sequence[torch.Tensor], slot_bytes: int, hidden: int, num_tensors: int, stream: Callable[[], int]
    ) -> RowKernel | None:
        """The kernel for a ring whose slot ``i`` is ``slots[i]`` (typed views, in order, one allocation),
        launched on ``stream()`` (the ring's :meth:`~hscapture.ring.base.Ring.stream_reader`); None on a host
        ring, where the rows cannot be 16-byte vectors, or where it does not compile."""
        functions = _functions(slots, slot_bytes, hidden, "rows_to_planes")
        if functions is None:
            return None
        first = slots[0]
        return cls(
            functions[0], first.data_ptr(), slot_bytes, hidden * first.element_size(), num_tensors,
            first.get_device(), stream,
        )  # fmt: skip

    def write(
        self,
        slot: int,
        states: Sequence[torch.Tensor],
        spans: Sequence[int],
        begin: int,
        count: int,
        first: int,
        plane_rows: int,
    ) -> bool:
        """Queue the copy of rows ``[begin, begin + count)`` of ``states`` (``spans[i]`` tensors side by side
        in ``states[i]``) into rows ``[first, first + count)`` of ``slot``'s planes of ``plane_rows`` rows.

        Returns False, queuing nothing, for sources the kernel does not take.

        Raises:
            HSCaptureError: the driver refused the launch.
        """
        if len(states) > MAX_SOURCES or not count:
            return False
        values, device = self._values, self._device
        for i, state in enumerate(states):
            if state.get_device() != device:
                return False
            stride = state.stride()
            row = stride[0] * state.itemsize
            address = state.data_ptr() + begin * row
            if stride[1] != 1 or (address | row) & 15:
                return False
            values[i].value = address
            values[4 + i].value = row >> 4
            values[8 + i].value = spans[i]
        for i in range(len(states), MAX_SOURCES):
            values[8 + i].value = 0
        hidden_bytes = self._hidden_bytes
        values[_DST].value = self._base + slot * self._slot_bytes + first * hidden_bytes
        values[_PLANE].value = plane_rows * hidden_bytes >> 4
        one = self._one
        status = self._launch(
            self._function, count, self._tensors, one, self._threads, one, one, self._none, self._stream(),
            self._params, None,
        )  # fmt: skip
        if status:
            raise _launch_failed(status, "ring write")
        return True


class GraphRows:
    """Writes a decode step's rows into the ring from a copy captured in the engine's own CUDA graph.

    An engine that replays its decode forward from CUDA graphs lets a capture hook add work at the
    graph's tail (SGLang: ``ModelRunner.capture_tail_hooks``). There :meth:`capture` queues the copy
    of the graph's static outputs, whatever the replay's slot. After the host launched a replay
    (:meth:`launched`), the producer's write of that step's rows only writes
    their destination into the plan table (:meth:`write`, the :class:`RowKernel` signature): no
    launch on the engine's thread. Every replay of a graph holding the copy must get exactly one
    entry: the step's rows, or none (:meth:`settle`); a replay left without one waits
    ``wait_s``, then turns every copy off and raises :attr:`failed`, which the engine
    integration reads before it announces rows. :meth:`off` (at the producer's close) makes every
    copy return at once: the graphs outlive the ring.

    Made by :meth:`load` (None where the kernels cannot run).
    """

    def __init__(
        self,
        functions: list[int],
        base: int,
        slot_bytes: int,
        hidden_bytes: int,
        num_tensors: int,
        device: int,
        wait_s: float,
    ) -> None:
        self._fetch, self._copy = (ctypes.c_void_p(f) for f in functions)
        self._base, self._slot_bytes, self._hidden_bytes = base, slot_bytes, hidden_bytes
        self._num_tensors, self._device = num_tensors, device
        # Entries, then the control words [off, fault] (int32) in the row after them; pinned, seen by the GPU.
        self._table = torch.zeros((PLAN_ENTRIES + 1, 8), dtype=torch.int64, pin_memory=True)
        self._entries = self._table.numpy()
        self._entries[:PLAN_ENTRIES, 0] = -1  # no entry's tag is a step yet: replay 0 waits for its own
        self._words = memoryview(self._entries).cast("B").cast("q")  # the entries' int64s, stored without numpy
        self._control = memoryview(self._entries[PLAN_ENTRIES]).cast("B").cast("i")  # Python ints: asked every step
        self._table_on_device = _device_pointer(self._table.data_ptr())
        self._counter = torch.zeros(1, dtype=torch.int64, device=device)
        self._current = torch.zeros(4, dtype=torch.int64, device=device)  # the replay's entry, read by every block
        self._next = 0
        #: How long a replay's copy waits for its entry.
        self.wait_s = wait_s
        #: The static output (first source's address) of every graph holding the copy.
        self._sources: set[int] = set()
        #: A replay of such a graph was launched and has no entry yet.
        self.pending = False
        #: The host's copy of the off word (:meth:`off`, or a fault :attr:`failed` read): a step reads no mapped
        #: memory to learn it.
        self._off = False

    @classmethod
    def load(
        cls, slots: Sequence[torch.Tensor], slot_bytes: int, hidden: int, num_tensors: int, wait_s: float = PLAN_WAIT_S
    ) -> GraphRows | None:
        """As :meth:`RowKernel.load`, without a stream (a capture queues on the capturing one); a replay's copy
        waits ``wait_s`` for its entry."""
        functions = _functions(slots, slot_bytes, hidden, "fetch_plan", "planned_rows_to_planes")
        if functions is None:
            return None
        first = slots[0]
        hidden_bytes = hidden * first.element_size()
        return cls(functions, first.data_ptr(), slot_bytes, hidden_bytes, num_tensors, first.get_device(), wait_s)

    @property
    def captured(self) -> bool:
        """Some graph holds the copy."""
        return bool(self._sources)

    @property
    def entries(self) -> int:
        """Plan entries written: one per replay of a graph holding the copy."""
        return self._next

    @property
    def failed(self) -> bool:
        """A replay's copy found no plan entry in time (it copied nothing; every copy is off)."""
        if self._control[1]:
            self._off = True  # that copy set the off word too: no later replay is owed an entry
            return True
        return False

    def capture(self, states: Sequence[torch.Tensor]) -> None:
        """Inside the engine's graph capture, after the forward: queue the copy of the rows of ``states`` (the
        graph's static outputs, ``[N, k * hidden]`` each, the ring's tensors in order) into whatever each replay
        plans, and the counter's step after it.

        Raises:
            ValueError: the stream is not capturing, or sources the copy does not take (the engine integration
                then turns this writer off and writes with a launch per step).
            HSCaptureError: the driver refused the launch.
        """
        if not torch.cuda.is_current_stream_capturing():
            raise ValueError("GraphRows.capture: call it inside the engine's CUDA graph capture")
        if not states or len(states) > MAX_SOURCES:
            raise ValueError(f"GraphRows.capture: 1 to {MAX_SOURCES} sources, got {len(states)}")
        values = [kind() for kind in _PLANNED_ARGUMENTS]
        rows, spans = states[0].shape[0], []
        for i, state in enumerate(states):
            stride = state.stride()
            row_bytes, width = stride[0] * state.itemsize, state.shape[-1] * state.itemsize
            if (
                state.get_device() != self._device
                or state.dim() != 2
                or state.shape[0] != rows
                or stride[1] != 1
                or (state.data_ptr() | row_bytes) & 15
                or width % self._hidden_bytes
            ):
                raise ValueError(
                    f"GraphRows.capture: source {i} is {list(state.shape)} with strides {list(stride)} on "
                    f"{state.device}; the copy takes 16-byte aligned rows of whole tensors on the ring's GPU"
                )
            values[i].value, values[4 + i].value = state.data_ptr(), row_bytes >> 4
            values[8 + i].value = width // self._hidden_bytes
            spans.append(width // self._hidden_bytes)
        if sum(spans) != self._num_tensors:
            raise ValueError(f"GraphRows.capture: the sources hold {sum(spans)} tensors, the ring {self._num_tensors}")
        values[12].value, values[13].value = self._hidden_bytes // 16, self._current.data_ptr()
        table, control = self._table_on_device, self._table_on_device + PLAN_ENTRIES * 64
        given = (table, self._counter.data_ptr(), PLAN_ENTRIES - 1, control, int(self.wait_s * 1e9))
        fetch = [kind(v) for kind, v in zip(_FETCH_ARGUMENTS, (*given, self._current.data_ptr()))]
        stream = torch.cuda.current_stream(self._device).cuda_stream
        launch = _driver()[0]
        for function, grid, block, args in (
            (self._fetch, (1, 1), 1, fetch),
            (self._copy, (rows, self._num_tensors), _threads(self._hidden_bytes), values),
        ):
            params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(v) for v in args])
            status = launch(function, *grid, 1, block, 1, 1, 0, stream, params, None)
            if status:
                raise _launch_failed(status, "graph ring write")
        self._sources.add(states[0].data_ptr())

    def launched(self) -> None:
        """The engine launched a replay of a graph holding the copy: its rows need an entry (:meth:`write`, else
        :meth:`settle`)."""
        if self._sources and not self._off:
            self.pending = True

    def write(
        self,
        slot: int,
        states: Sequence[torch.Tensor],
        spans: Sequence[int],
        begin: int,
        count: int,
        first: int,
        plane_rows: int,
    ) -> bool:
        """:meth:`RowKernel.write` for the replay just launched: its copy writes the rows (False, planning
        nothing, when no replay waits or ``states`` are not its outputs)."""
        if not self.pending or states[0].data_ptr() not in self._sources:
            return False
        self.plan(slot, begin, count, first, plane_rows)
        return True

    def plan(self, slot: int, begin: int, count: int, first: int, plane_rows: int) -> None:
        """:meth:`write` without the look at the states, for a replay whose rows are known to be a graph's holding
        the copy (the producer's next step of the requests whose rows :meth:`write` took). One frame, no call: it runs
        on a decode step, right after a device wait that left the host's caches cold."""
        self.pending = False
        hidden_bytes, words, step = self._hidden_bytes, self._words, self._next
        at = (step & (PLAN_ENTRIES - 1)) * 8
        words[at + 1] = self._base + slot * self._slot_bytes + first * hidden_bytes  # destination
        words[at + 2], words[at + 3], words[at + 4] = plane_rows * hidden_bytes >> 4, begin, count
        words[at] = step  # the tag last: the copy reads the fields once it sees it
        self._next = step + 1

    def settle(self) -> None:
        """After the forward's hook: a replay whose rows were not planned copies none (an entry of no rows)."""
        if self.pending:
            self.plan(0, 0, 0, 0, 0)

    def off(self) -> None:
        """Every copy returns at once from now on (the ring is about to be freed)."""
        self.pending = False
        self._off = True
        self._control[0] = 1
