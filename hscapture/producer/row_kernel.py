"""The CUDA ring's write of a step's rows into a slot: one driver launch of ``csrc/rows_to_planes.cu``.

A decode step's rows are a few hundred KiB: the GPU copies them in a microsecond or two, and what
the write costs is the host's time to queue it, on the engine's thread, every step. On the H200
host torch's strided ``cat`` into a slot's planes took ~27 µs of it (two reshapes, a slice, the
dispatcher, a launch); one ``cuLaunchKernel`` through ctypes, its argument block made once and
only the pointers and sizes updated, takes ~6 µs (cupy's own launch call: 8 µs before making its
arguments). ``benchmarks/sglang_hooks.py`` measures the plugin's hooks with and without it.

Sources it takes: up to :data:`MAX_SOURCES` tensors ``[N, k * hidden]`` of the ring's dtype on
the ring's GPU, rows 16-byte aligned, each row contiguous. Anything else (and a step with a
``row_index``) goes the producer's torch path, which gives the same bytes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

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
        self._threads = ctypes.c_uint(min(_THREADS, -(-hidden_bytes // 16 // 32) * 32))
        self._values = [kind() for kind in _ARGUMENTS]
        self._values[_HVEC].value = hidden_bytes // 16
        self._params = (ctypes.c_void_p * len(_ARGUMENTS))(*[ctypes.addressof(v) for v in self._values])
        driver = ctypes.CDLL("libcuda.so.1")
        self._launch = driver.cuLaunchKernel
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [
            ctypes.c_void_p,
            *[ctypes.c_uint] * 7,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self._error_name = driver.cuGetErrorName
        self._stream = stream

    @classmethod
    def load(
        cls, slots: Sequence[torch.Tensor], slot_bytes: int, hidden: int, num_tensors: int, stream: Callable[[], int]
    ) -> RowKernel | None:
        """The kernel for a ring whose slot ``i`` is ``slots[i]`` (typed views, in order, one allocation),
        launched on ``stream()`` (the ring's :meth:`~hscapture.ring.base.Ring.current_stream`); None on a host
        ring, where the rows cannot be 16-byte vectors, or where it does not compile."""
        first = slots[0] if slots else None
        if first is None or not first.is_cuda:
            return None
        hidden_bytes = hidden * first.element_size()
        if hidden_bytes % 16 or slot_bytes % 16 or first.data_ptr() % 16:
            return None
        device = first.get_device()
        with torch.cuda.device(device):
            raw = kernel("rows_to_planes.cu", "rows_to_planes", "the producer writes rows with torch")
            if raw is None:
                return None
            function = raw.kernel.ptr if hasattr(raw, "kernel") else raw.ptr
        return cls(function, first.data_ptr(), slot_bytes, hidden_bytes, num_tensors, device, stream)

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
            name = ctypes.c_char_p()
            self._error_name(status, ctypes.byref(name))
            raise HSCaptureError(f"ring write: cuLaunchKernel failed with CUDA error {status} ({name.value!r})")
        return True
