"""fp8 quantization on the GPU, before the copy out of a CUDA ring: half the bytes cross PCIe, none on the host.

For an fp8 store fed from a CUDA ring, the consumer quantizes each chunk where its rows already
are. On the ring reader's stream, after :meth:`~hscapture.ring.cuda.CudaRingReader.begin` and
before the mark the slot is released on, each block of the slot's ``[tensors, rows, hidden]`` rows
is quantized into a device staging buffer (:func:`hscapture.fp8.quantize_into`, bit for bit what
the store's writer threads would store), each row of codes gets its CRC-32 there too
(:class:`~hscapture.store.checksum.RowCrcs`: a writer thread checksumming 4 KiB rows holds the
GIL, which stalled this process's main thread), and its codes, scales, non-finite counts and CRCs
are copied into the rows the store reserved. A CRC made before the copy out also catches a copy
that went wrong. The engine's stream never waits for any of it: the slot's rows
are read after the producer's event, on the consumer's own stream, as the plain copy out did.

Cost, for bf16 rows: one kernel per slot (``hscapture/csrc/quantize_fp8.cu``, compiled with NVRTC: each
row read twice, its codes written once), one for the rows' CRCs (``hscapture/csrc/crc32_rows.cu``) and
``4 x tensors`` small copies. The torch path it falls
back to (other dtypes, or no NVRTC) is about ten elementwise kernels per block of up to
:data:`~hscapture.fp8.BLOCK_ELEMENTS` values, ~18 bytes of device memory traffic per byte of rows,
and competes with the engine for the GPU: the extract benchmark's fp8 run paid ~4 % of its time
for it on an H200. The ``store`` suite measures the quantization beside a plain copy of the same rows.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

from hscapture.cuda_kernels import kernel
from hscapture.fp8 import BLOCK_ELEMENTS, FP8, quantize_into
from hscapture.ring.cuda import CudaRingReader
from hscapture.store.checksum import RowCrcs
from hscapture.store.writer import Reservation

#: Threads per row (the kernels' THREADS).
_THREADS = 256


def bf16_kernel() -> Any:
    """The fused bf16 quantization kernel (``hscapture/csrc/quantize_fp8.cu``); None where it cannot be compiled."""
    return kernel("quantize_fp8.cu", "quantize_bf16_rows", "quantizing with torch kernels")


def crc_kernel() -> Any:
    """The rows' CRC-32 kernel (``hscapture/csrc/crc32_rows.cu``); None where it cannot be compiled."""
    return kernel("crc32_rows.cu", "crc32_rows", "checksumming with torch kernels")


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
        self._kernel = bf16_kernel() if dtype == torch.bfloat16 else None
        # The kernel takes a whole slot at once; torch's temporaries grow with the block, so it takes a few MiB.
        per_block = max_rows if self._kernel is not None else BLOCK_ELEMENTS // (tensors * hidden)
        self._block_rows = max(1, min(max_rows, per_block))
        self._device = torch.device("cuda", ring.device)
        self._stream = ring.torch_stream()
        shape = (tensors, self._block_rows)
        self._codes = torch.empty(*shape, hidden, dtype=FP8, device=self._device)
        self._scales = torch.empty(shape, dtype=torch.float32, device=self._device)
        self._nonfinite = torch.empty(shape, dtype=torch.int32, device=self._device)
        self._crcs = torch.empty(shape, dtype=torch.int32, device=self._device)
        self._crc_kernel = crc_kernel()
        self._zero_crc = np.uint32(zlib.crc32(bytes(hidden)))
        self._checksum = None if self._crc_kernel else RowCrcs(hidden, tensors * self._block_rows, self._device)

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
                staging = (self._codes, self._scales, self._nonfinite, self._crcs)
                codes, scales, counts, crcs = (a[:, : high - low] for a in staging)
                self._quantize(slot[:, low:high], row_stride, codes, scales, counts)
                self._checksum_codes(high - low)
                for start, piece in zip(starts, reservation.pieces):
                    a, b = max(low, start), min(high, start + piece.rows)
                    if a >= b:
                        continue
                    staged, reserved = slice(a - low, b - low), slice(a - start, b - start)
                    for t in range(tensors):
                        ring.copy_from_device(codes[t, staged], piece.planes[t][reserved])
                        ring.copy_from_device(scales[t, staged], piece.scales[t][reserved])
                        ring.copy_from_device(counts[t, staged], piece.nonfinite[t][reserved])
                        ring.copy_from_device(crcs[t, staged], piece.crcs[t][reserved])

    def _checksum_codes(self, n: int) -> None:
        """The CRC-32 of the first ``n`` staged rows of codes of each tensor, into the staging ``crcs``."""
        if self._checksum is not None:  # every staging row: one shape, so one product plan
            self._checksum(self._codes.view(torch.uint8).view(-1, self._hidden), self._crcs.view(-1))
            return
        hidden, block_rows = self._hidden, self._block_rows
        args = (
            np.uint64(self._codes.data_ptr()),
            np.int64(hidden),
            np.int64(block_rows * hidden),
            np.int32(hidden),
            np.uint64(self._crcs.data_ptr()),
            np.int32(block_rows),
            self._zero_crc,
        )
        self._ring.launch(self._crc_kernel, (n, self._tensors), (_THREADS,), args)

    def _quantize(
        self, rows: torch.Tensor, row_stride: int, codes: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor
    ) -> None:
        """``[tensors, n, hidden]`` rows of the slot into the staging ``codes``, ``scales`` and ``counts``."""
        if self._kernel is None:
            quantize_into(rows, codes, scales, counts)
            return
        tensors, n, hidden = rows.shape
        args = (
            np.uint64(rows.data_ptr()),
            np.int64(row_stride * hidden),
            np.int32(hidden),
            np.uint64(codes.data_ptr()),
            np.uint64(scales.data_ptr()),
            np.uint64(counts.data_ptr()),
            np.int32(self._block_rows),
        )
        self._ring.launch(self._kernel, (n, tensors), (_THREADS,), args)
