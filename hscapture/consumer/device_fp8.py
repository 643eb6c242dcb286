"""fp8 quantization on the GPU, before the copy out of a CUDA ring: half the bytes cross PCIe, none on the host.

For an fp8 store fed from a CUDA ring, the consumer quantizes each chunk where its rows already
are. On the ring reader's stream, after :meth:`~hscapture.ring.cuda.CudaRingReader.begin` and
before the mark the slot is released on, each block of the slot's ``[tensors, rows, hidden]`` rows
is quantized into a device staging buffer (:func:`hscapture.fp8.quantize_into`, bit for bit what
the store's writer threads would store), each row of codes gets its CRC-32 there too
(:class:`RowCrcs`: a writer thread checksumming 4 KiB rows holds the
GIL, which stalled this process's main thread), and its codes, scales, non-finite counts and CRCs
are copied into the rows the store reserved. A CRC made before the copy out also catches a copy
that went wrong. The engine's stream never waits for any of it: the slot's rows
are read after the producer's event, on the consumer's own stream, as the plain copy out did.

Cost, for bf16 rows: one kernel per slot (``hscapture/csrc/quantize_fp8.cu``, compiled with NVRTC: each
row read twice, its codes written once), one for the rows' CRCs (``hscapture/csrc/crc32_rows.cu``) and four
2D copies (codes, scales, counts, CRCs of every tensor) per shard the slot's rows fall in. The torch path it falls
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

from hscapture.config import torch_dtype
from hscapture.cuda_kernels import kernel
from hscapture.fp8 import BLOCK_ELEMENTS, FP8, quantize_into
from hscapture.ring.cuda import CudaRingReader
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
        dtype: the captured dtype's name (a ``config.DTYPES`` key).
        max_rows: rows a slot holds at most.
    """

    #: What it does, for the consumer's attach line.
    doing = "fp8 quantized on the GPU"

    def __init__(self, ring: CudaRingReader, tensors: int, hidden: int, dtype: str, max_rows: int) -> None:
        self._ring = ring
        self._tensors, self._hidden, self._dtype = tensors, hidden, torch_dtype(dtype)
        self._kernel = bf16_kernel() if dtype == "bfloat16" else None
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
                    # Each a 2D copy into the shard buffer's evenly spaced planes: 4 calls a piece, not 4 a tensor.
                    for rows_of, planes in ((codes, piece.planes), (scales, piece.scales),
                                            (counts, piece.nonfinite), (crcs, piece.crcs)):  # fmt: skip
                        ring.copy_planes_from_device(rows_of[:, staged], [plane[reserved] for plane in planes])

    def close(self) -> None:
        """Nothing to stop: the work is queued on the ring's stream, which the ring's close waits for."""

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


class RowCrcs:
    """``zlib.crc32`` of each row of ``[n, width]`` uint8 tensors, computed where the rows are (GPU or CPU).

    CRC-32 is affine over GF(2): ``crc(row) = crc(zeros) ^ xor of basis[k] over the set bits k of
    the row``, where ``basis[k] = crc(e_k) ^ crc(zeros)`` for the row ``e_k`` holding bit ``k % 8``
    of byte ``k // 8`` alone. So the CRCs of ``n`` rows are one int8 matrix product of their bits
    ``[n, 8 * width]`` with the basis bits ``[8 * width, 32]``, each sum taken modulo 2: exact
    integer arithmetic, the same bits as ``zlib.crc32`` (tests compare them). The basis is built
    with ``zlib.crc32`` once per width (~30 ms for 4,096 bytes).

    Args:
        width: bytes per row.
        rows: the most rows checksummed at once (the scratch's size).
        device: where the rows are.
    """

    def __init__(self, width: int, rows: int, device: torch.device) -> None:
        self.width, self.rows = width, rows
        zero = zlib.crc32(bytes(width))
        row = bytearray(width)
        basis = np.empty(8 * width, dtype=np.uint32)
        for byte in range(width):
            for bit in range(8):
                row[byte] = 1 << bit
                basis[8 * byte + bit] = zlib.crc32(row) ^ zero
            row[byte] = 0
        # cuBLAS's int8 product wants more than 16 rows, a multiple of 8, and a long enough inner
        # dimension: the scratch has rows to spare, and zero bytes before each row (which leave a
        # CRC from zero at zero), to a multiple of 16 bytes.
        self._padded = max(24, -(-rows // 8) * 8)
        self._lead = -width % 16
        bits = (basis[:, None] >> np.arange(32, dtype=np.uint32)) & 1
        bits = np.concatenate([np.zeros((8 * self._lead, 32), dtype=bits.dtype), bits])
        self._basis = torch.from_numpy(bits.astype(np.int8)).to(device)
        self._bits = torch.zeros(self._padded, self._lead + width, 8, dtype=torch.uint8, device=device)
        self._shifts = torch.arange(8, dtype=torch.uint8, device=device)
        weights = np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32)).view(np.int32)
        self._weights = torch.from_numpy(weights.astype(np.int32)).to(device)
        self._zero = int(np.uint32(zero).view(np.int32))

    def __call__(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Write the CRC-32 of each row of ``rows`` (``[n, width]`` uint8, ``n <= self.rows``) into ``out``
        (``[n]`` int32: the uint32's bits). Only kernels on the current stream, no host read."""
        n = rows.shape[0]
        if rows.dtype != torch.uint8 or rows.shape[1:] != (self.width,) or n > self.rows:
            shape = f"rows {tuple(rows.shape)} {rows.dtype}"
            raise ValueError(f"RowCrcs: {shape}; want [<= {self.rows}, {self.width}] uint8")
        bits = self._bits[:n, self._lead :]
        torch.bitwise_right_shift(rows.unsqueeze(-1), self._shifts, out=bits)
        bits.bitwise_and_(1)
        flat = self._bits.view(torch.int8).view(self._padded, 8 * (self._lead + self.width))
        counts = torch._int_mm(flat, self._basis)
        counts = counts[:n].bitwise_and_(1).mul_(self._weights)
        torch.sum(counts, dim=1, dtype=torch.int32, out=out)
        out.bitwise_xor_(self._zero)
