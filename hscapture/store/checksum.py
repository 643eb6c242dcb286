"""Folding CRC-32s: the whole-file checksum of a shard from its parts' (FORMAT.md, Integrity).

Checksums are ``zlib.crc32`` (IEEE 802.3), which releases the GIL on large buffers, so writer
threads and verify's threads checksum in parallel. Each row of a captured tensor gets its own CRC
(what a reader checks); the tensor's follows from its rows' with :func:`combine_rows`, and the
file's from its tensors' with :func:`crc32_combine`, so no byte is checksummed twice.

Rows quantized on the GPU get their CRCs there too (:class:`RowCrcs`): ``zlib.crc32`` holds the GIL
on buffers under 5 KiB, so a 4 KiB fp8 row checksummed on a writer thread stalls the consumer's
main thread, which is what set the pace of an fp8 store on the H200.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable

import numpy as np
import torch


def combine(parts: Iterable[tuple[int, int]]) -> int:
    """CRC-32 of consecutive pieces of a file from each piece's ``(CRC-32, length)``, in file order."""
    whole = 0
    for crc, length in parts:
        whole = crc32_combine(whole, crc, length)
    return whole


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and ``len2 = len(b)``.

    zlib's ``crc32_combine`` (not exposed by Python): advance ``crc1`` over ``len2`` zero bytes
    with precomputed GF(2) operators, one per set bit of ``len2``, then xor ``crc2``. About 50 us.
    """
    power = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_crc32_zeros_operator(power), crc1)
        len2 >>= 1
        power += 1
    return crc1 ^ crc2


def row_crcs(rows: np.ndarray) -> np.ndarray:
    """``[n]`` uint32 CRC-32 of each row of a ``[n, row_bytes]`` uint8 array."""
    n, width = rows.shape
    flat = memoryview(np.ascontiguousarray(rows).reshape(-1))
    return np.fromiter((zlib.crc32(flat[i : i + width]) for i in range(0, n * width, width)), np.uint32, n)


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


def combine_rows(crcs: np.ndarray, row_bytes: int) -> int:
    """CRC-32 of ``len(crcs)`` consecutive rows of ``row_bytes`` each, from each row's CRC-32.

    A tree: neighbours are paired with one vectorized GF(2) operator per level (advance over the
    right one's length, xor), so n rows cost ~log2(n) numpy passes, not n combines. An odd row
    out at a level is folded into a running suffix.
    """
    values = np.asarray(crcs, dtype=np.uint32)
    if not len(values):
        return 0
    suffix, suffix_bytes, size = 0, 0, row_bytes
    operator = _zeros_operator(size)
    while len(values) > 1:
        if len(values) % 2:
            suffix = crc32_combine(int(values[-1]), suffix, suffix_bytes)
            suffix_bytes += size
            values = values[:-1]
        values = _gf2_times_all(operator, values[0::2]) ^ values[1::2]
        size *= 2
        operator = _gf2_square(operator)
    return crc32_combine(int(values[0]), suffix, suffix_bytes)


def _zeros_operator(length: int) -> tuple[int, ...]:
    """The operator that advances a CRC-32 over ``length`` zero bytes."""
    matrix: tuple[int, ...] = tuple(1 << k for k in range(32))  # identity
    power = 0
    while length:
        if length & 1:
            step = _crc32_zeros_operator(power)
            matrix = tuple(_gf2_times(step, column) for column in matrix)
        length >>= 1
        power += 1
    return matrix


def _gf2_times_all(matrix: tuple[int, ...], vectors: np.ndarray) -> np.ndarray:
    total = np.zeros_like(vectors)
    for bit, column in enumerate(matrix):
        total ^= ((vectors >> np.uint32(bit)) & np.uint32(1)) * np.uint32(column)
    return total


@functools.cache
def _crc32_zeros_operator(power: int) -> tuple[int, ...]:
    """The 32x32 GF(2) matrix (one int per column) that advances a CRC-32 over ``2**power`` zero bytes."""
    if power == 0:
        matrix: tuple[int, ...] = (0xEDB88320, *(1 << k for k in range(31)))  # one zero bit
        for _ in range(3):  # 2, 4, 8 bits
            matrix = _gf2_square(matrix)
        return matrix
    return _gf2_square(_crc32_zeros_operator(power - 1))


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    total = 0
    for column in matrix:
        if not vector:
            break
        if vector & 1:
            total ^= column
        vector >>= 1
    return total


def _gf2_square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_gf2_times(matrix, column) for column in matrix)
