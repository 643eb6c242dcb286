"""fp8 quantization of a host ring's rows where they lie, on the consumer's thread: no copy of the slot.

For an fp8 store fed from a host ring (an engine on the CPU), the consumer quantizes each chunk
straight out of the ring's shared memory into the rows the store reserved (codes, scales,
non-finite counts and the CRC-32 of each row of codes), with :func:`hscapture.fp8.host_kernels`'
fused kernel: each row is read from the ring twice and its codes written once, where copying
the slot out first and quantizing it on a writer thread moved the rows twice more. The writer
threads then only write. Bit for bit what the writer threads would store (the same kernel).

Without numba there is no fused kernel: the consumer copies the rows out and the writer threads
quantize them with torch's passes (~6x the time, spread over the writer threads).
"""

from __future__ import annotations

import numpy as np
import torch

from hscapture.fp8 import host_kernels
from hscapture.ring.host import HostRingReader
from hscapture.store.checksum import row_crcs
from hscapture.store.writer import Reservation

#: numpy dtypes of the bits the kernels take, by captured dtype (float16 goes through a float32 scratch).
_BITS = {torch.bfloat16: np.uint16, torch.float32: np.uint32, torch.float16: np.float16}


class HostQuantizer:
    """Quantizes chunks of one host ring into reserved fp8 store rows.

    Args:
        ring: the opened ring.
        tensors: captured tensors per row.
        hidden: values per row of one tensor.
        dtype: the captured dtype.
        max_rows: rows a slot holds at most.

    Raises:
        RuntimeError: no fused kernel (numba is not installed): use :func:`available` first.
    """

    def __init__(self, ring: HostRingReader, tensors: int, hidden: int, dtype: torch.dtype, max_rows: int) -> None:
        kernels = host_kernels()
        if kernels is None:
            raise RuntimeError("HostQuantizer: needs numba for the fused kernel")
        self._ring, self._tensors, self._hidden = ring, tensors, hidden
        self._bits, self._itemsize = _BITS[dtype], dtype.itemsize
        self._kernel = kernels[4 if dtype != torch.bfloat16 else 2]
        self._scratch = np.empty((max_rows, hidden), dtype=np.float32) if dtype == torch.float16 else None

    @staticmethod
    def available(dtype: torch.dtype) -> bool:
        """Whether chunks of ``dtype`` rows can be quantized here (numba installed, a storable dtype)."""
        return dtype in _BITS and host_kernels() is not None

    def copy(self, offset: int, rows: int, row_stride: int, reservation: Reservation) -> None:
        """Quantize the slot at ``offset`` (``[tensors, row_stride, hidden]``, the first ``rows`` rows used)
        into ``reservation``: its codes, scales, non-finite counts and row CRCs."""
        plane_row = self._hidden * self._itemsize
        begin = 0
        for piece in reservation.pieces:
            for t in range(self._tensors):
                at = offset + (t * row_stride + begin) * plane_row
                values = self._ring.view(at, piece.rows * plane_row).view(self._bits).reshape(piece.rows, -1)
                if not values.flags.aligned:  # a layout whose slots are no multiple of the item size
                    values = values.copy()
                if self._scratch is not None:  # float16: widened exactly into float32 first
                    wide = self._scratch[: piece.rows]
                    np.copyto(wide, values)
                    values = wide.view(np.uint32)
                codes = piece.planes[t]
                self._kernel(values, codes, piece.scales[t], piece.nonfinite[t])
                piece.crcs[t][:] = row_crcs(codes, compiled=True).view(np.int32)
            begin += piece.rows
        assert begin == rows, (begin, rows)
