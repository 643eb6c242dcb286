"""fp8 quantization on the GPU, before the copy out of a CUDA ring: half the bytes cross PCIe, none on the host.

For an fp8 store fed from a CUDA ring, the consumer quantizes each chunk where its rows already
are. On the ring reader's stream, after :meth:`~hscapture.ring.cuda.CudaRingReader.begin` and
before the mark the slot is released on, each block of the slot's ``[tensors, rows, hidden]`` rows
is quantized into a device staging buffer (:func:`hscapture.fp8.quantize_into`, bit for bit what
the store's writer threads would store), and its codes, scales and non-finite counts are copied
into the rows the store reserved. The engine's stream never waits for any of it: the slot's rows
are read after the producer's event, on the consumer's own stream, as the plain copy out did.

Cost: about ten elementwise kernels and ``3 x tensors`` small copies per block of up to
:data:`~hscapture.fp8.BLOCK_ELEMENTS` values, ~18 bytes of device memory traffic per byte of bf16
rows (a 4 MiB chunk: ~75 MB, tens of microseconds of HBM time on an H200), and ~1.5 bytes of
device memory per value of a block for staging and temporaries (~28 MiB at most). The benchmark's
``store`` suite measures it beside a plain copy of the same rows.
"""

from __future__ import annotations

import torch

from hscapture.fp8 import BLOCK_ELEMENTS, FP8, quantize_into
from hscapture.ring.cuda import CudaRingReader
from hscapture.store.writer import Reservation


class DeviceQuantizer:
    """Quantizes chunks of one CUDA ring on its GPU into reserved fp8 store rows.

    Args:
        ring: the opened ring; its stream orders the work.
        tensors: captured tensors per row.
        hidden: values per row of one tensor.
        dtype: the captured dtype.
        max_rows: rows a slot holds at most.
    """

    def __init__(self, ring: CudaRingReader, tensors: int, hidden: int, dtype: torch.dtype, max_rows: int) -> None:
        self._ring = ring
        self._tensors, self._hidden, self._dtype = tensors, hidden, dtype
        self._block_rows = max(1, min(max_rows, BLOCK_ELEMENTS // (tensors * hidden)))
        self._device = torch.device("cuda", ring.device)
        self._stream = ring.torch_stream()
        shape = (tensors, self._block_rows)
        self._codes = torch.empty(*shape, hidden, dtype=FP8, device=self._device)
        self._scales = torch.empty(shape, dtype=torch.float32, device=self._device)
        self._nonfinite = torch.empty(shape, dtype=torch.int32, device=self._device)

    def copy(self, offset: int, rows: int, row_stride: int, reservation: Reservation) -> None:
        """Queue the quantization of the slot at ``offset`` (``[tensors, row_stride, hidden]``, the first
        ``rows`` rows used) and the copies of its codes, scales and counts into ``reservation``."""
        tensors, hidden, ring = self._tensors, self._hidden, self._ring
        slot = ring.device_bytes(offset, tensors * row_stride * hidden * self._dtype.itemsize)
        slot = slot.view(self._dtype).view(tensors, row_stride, hidden)
        starts, begin = [], 0
        for piece in reservation.pieces:
            starts.append(begin)
            begin += piece.rows
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            for low in range(0, rows, self._block_rows):
                high = min(rows, low + self._block_rows)
                codes, scales, counts = (a[:, : high - low] for a in (self._codes, self._scales, self._nonfinite))
                quantize_into(slot[:, low:high], codes, scales, counts)
                for start, piece in zip(starts, reservation.pieces):
                    a, b = max(low, start), min(high, start + piece.rows)
                    if a >= b:
                        continue
                    staged, reserved = slice(a - low, b - low), slice(a - start, b - start)
                    for t in range(tensors):
                        ring.copy_from_device(codes[t, staged], piece.planes[t][reserved])
                        ring.copy_from_device(scales[t, staged], piece.scales[t][reserved])
                        ring.copy_from_device(counts[t, staged], piece.nonfinite[t][reserved])
