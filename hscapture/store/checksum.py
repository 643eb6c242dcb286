"""Folding CRC-32s: the whole-file checksum of a shard from its parts' (FORMAT.md, Integrity).

Checksums are ``zlib.crc32`` (IEEE 802.3), which releases the GIL on large buffers, so writer
threads and verify's threads checksum in parallel. Each tensor's CRC is computed on its own
bytes; the file's follows from them with :func:`crc32_combine`, so no byte is read twice.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable


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
