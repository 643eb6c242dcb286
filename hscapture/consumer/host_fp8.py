"""fp8 quantization of a host ring's rows where they lie, for the consumer: no copy of the slot.

For an fp8 store fed from a host ring (an engine on the CPU), the consumer quantizes each chunk
straight out of the ring's shared memory into the rows the store reserved (codes, scales,
non-finite counts and the CRC-32 of each row of codes), with :func:`hscapture.fp8.host_kernels`'
fused kernel: each row is read from the ring twice and its codes written once, where copying
the slot out first and quantizing it on a writer thread moved the rows twice more. The writer
threads then only write. Bit for bit what the writer threads would store (the same kernel).

The chunk's tensors are quantized on a few threads at once (the kernels release the GIL) while
the consumer's thread waits: on one thread this work set the pace of a host ring's fp8 store
(~1 ms of kernels per 4 MiB slot, the producer waiting for free slots meanwhile).

Without numba there is no fused kernel: the consumer copies the rows out and the writer threads
quantize them with torch's passes (~6x the time, spread over the writer threads).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hscapture.config import DTYPES, usable_cores
from hscapture.fp8_kernel import host_kernels
from hscapture.ring.host import HostRingReader
from hscapture.store.checksum import row_crcs
from hscapture.store.writer import Reservation, Rows

#: numpy dtypes of the bits the kernels take, by captured dtype (float16 goes through a float32 scratch).
_BITS = {"bfloat16": np.uint16, "float32": np.uint32, "float16": np.float16}


def default_quantize_threads(tensors: int) -> int:
    """One thread per tensor, at most half the cores: the other half are the engine's, whose rows these are.

    On the 2-core CPU host that is 1: there two threads stored fp8 no faster (1.11-1.41 s per 2 GiB
    repeat against 0.95-1.24 s on the consumer's thread, same run), the producer's copy in wanting
    the other core.
    """
    return max(1, min(tensors, usable_cores() // 2))


class HostQuantizer:
    """Quantizes chunks of one host ring into reserved fp8 store rows.

    Args:
        ring: the opened ring.
        tensors: captured tensors per row.
        hidden: values per row of one tensor.
        dtype: the captured dtype's name (a ``config.DTYPES`` key).
        max_rows: rows a slot holds at most.
        threads: threads quantizing a chunk's tensors at once (None: :func:`default_quantize_threads`;
            1: on the calling thread).

    Raises:
        RuntimeError: no fused kernel (numba is not installed): use :func:`available` first.
    """

    def __init__(
        self, ring: HostRingReader, tensors: int, hidden: int, dtype: str, max_rows: int, threads: int | None
    ) -> None:
        kernels = host_kernels()
        if kernels is None:
            raise RuntimeError("HostQuantizer: needs numba for the fused kernel")
        self._ring, self._tensors, self._hidden = ring, tensors, hidden
        self._bits, self._itemsize = _BITS[dtype], DTYPES[dtype]
        self._kernel = kernels[4 if dtype != "bfloat16" else 2]
        #: float16 rows are widened into a float32 scratch first, at their tensor's and slot row's place.
        self._scratch = np.empty((tensors, max_rows, hidden), dtype=np.float32) if dtype == "float16" else None
        self.threads = default_quantize_threads(tensors) if threads is None else threads
        #: What it does, for the consumer's attach line.
        self.doing = f"fp8 quantized out of the ring on {self.threads} threads"
        self._pool = ThreadPoolExecutor(self.threads, "hscapture-fp8") if self.threads > 1 else None

    @staticmethod
    def available(dtype: str) -> bool:
        """Whether chunks of ``dtype`` rows can be quantized here (numba installed, a storable dtype)."""
        return dtype in _BITS and host_kernels() is not None

    def copy(self, offset: int, rows: int, row_stride: int, reservation: Reservation) -> None:
        """Quantize the slot at ``offset`` (``[tensors, row_stride, hidden]``, the first ``rows`` rows used)
        into ``reservation``: its codes, scales, non-finite counts and row CRCs; returns when all are in."""
        jobs, begin = [], 0
        for piece in reservation.pieces:
            jobs += [(offset, row_stride, begin, piece, t) for t in range(self._tensors)]
            begin += piece.rows
        assert begin == rows, (begin, rows)
        if self._pool is None:
            for job in jobs:
                self._quantize(*job)
        else:
            for done in [self._pool.submit(self._quantize, *job) for job in jobs]:
                done.result()

    def _quantize(self, offset: int, row_stride: int, begin: int, piece: Rows, t: int) -> None:
        """Tensor ``t``'s rows of ``piece`` (from row ``begin`` of the slot at ``offset``)."""
        plane_row = self._hidden * self._itemsize
        at = offset + (t * row_stride + begin) * plane_row
        values = self._ring.view(at, piece.rows * plane_row).view(self._bits).reshape(piece.rows, -1)
        if not values.flags.aligned:  # a layout whose slots are no multiple of the item size
            values = values.copy()
        if self._scratch is not None:  # float16: widened exactly into float32 first
            wide = self._scratch[t, begin : begin + piece.rows]  # the pieces' rows never overlap
            np.copyto(wide, values)
            values = wide.view(np.uint32)
        codes = piece.planes[t]
        self._kernel(values, codes, piece.scales[t], piece.nonfinite[t])
        piece.crcs[t][:] = row_crcs(codes, compiled=True, wait=False).view(np.int32)

    def close(self) -> None:
        """Stop the threads (the ring is closing)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
