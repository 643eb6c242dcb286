"""Folding CRC-32s: the whole-file checksum of a shard from its parts' (FORMAT.md, Integrity).

Checksums are ``zlib.crc32`` (IEEE 802.3), which releases the GIL on large buffers, so writer
threads and verify's threads checksum in parallel. Each row of a captured tensor gets its own CRC
(what a reader checks); the tensor's follows from its rows' with :func:`combine_rows`, and the
file's from its tensors' with :func:`crc32_combine`, so no byte is checksummed twice.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable

import numpy as np


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
