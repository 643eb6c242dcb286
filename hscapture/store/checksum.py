"""Folding CRC-32s: the whole-file checksum of a shard from its parts' (FORMAT.md, Integrity).

Checksums are ``zlib.crc32`` (IEEE 802.3), which releases the GIL on large buffers, so writer
threads and verify's threads checksum in parallel. Each row of a captured tensor gets its own CRC
(what a reader checks); the tensor's follows from its rows' with :func:`combine_columns`, and the
file's from its tensors' with :func:`crc32_combine`, so no byte is checksummed twice.

Rows quantized on the GPU get their CRCs there too (:mod:`hscapture.consumer.device_fp8`): ``zlib.crc32`` holds the GIL
on buffers under 5 KiB, so a 4 KiB fp8 row checksummed on a writer thread stalls the consumer's
main thread, which is what set the pace of an fp8 store on the H200. On the host, writers take
:func:`row_crcs` with ``compiled``: a kernel folding each row with the CPU's carry-less multiply
(:func:`crc_kernel`), the same bits at ~12 GB/s per thread against zlib's ~5.6 on 4 KiB rows,
without the GIL.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from hscapture import jit


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


def row_crcs(rows: np.ndarray, compiled: bool = False, wait: bool = True) -> np.ndarray:
    """``[n]`` uint32 CRC-32 of each row of a ``[n, row_bytes]`` uint8 array.

    With ``compiled``, by :func:`crc_kernel` where there is one (it is compiled on the first such
    call: writers ask for it when a store opens; readers never do), else by zlib: the same bits. With
    ``wait=False``, by zlib while the kernel is still compiling (a writer's first shards do not wait for it).
    """
    n, width = rows.shape
    rows = np.ascontiguousarray(rows)
    kernel = crc_kernel(wait) if compiled else None
    if kernel is not None:
        out = np.empty(n, dtype=np.uint32)
        kernel(rows, out)
        return out
    flat = memoryview(rows.reshape(-1))
    return np.fromiter((zlib.crc32(flat[i : i + width]) for i in range(0, n * width, width)), np.uint32, n)


def crc_kernel(wait: bool = True) -> Callable[[np.ndarray, np.ndarray], None] | None:
    """``kernel(rows, out)``: the CRC-32 of each row of ``[n, width]`` uint8 ``rows`` into ``[n]`` uint32
    ``out``, releasing the GIL; None without numba or an x86 CPU with carry-less multiply (PCLMULQDQ), and,
    with ``wait=False``, while it is still compiling."""
    return jit.compiled(_compile_crc, wait)


def _compile_crc(numba: Any) -> Any:
    """zlib's CRC-32 by folding: 64 bytes at a time in four 128-bit lanes, each multiplied (carry-less)
    by x^k modulo the polynomial and xored into the next, then folded to 32 bits and Barrett-reduced
    (Intel, "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", 2009; the constants of
    Linux's ``crc32-pclmul_asm.S``); tails of under 16 bytes, and rows under 64, byte by byte from a table."""
    if not jit.has_cpu_feature("pclmul"):
        return None
    from llvmlite import ir
    from numba.extending import intrinsic

    u64, u32 = np.uint64, np.uint32
    pair = numba.types.UniTuple(numba.uint64, 2)

    def multiply(builder: Any, x: tuple[Any, Any], k: tuple[Any, Any], selector: int) -> Any:
        """``pclmulqdq`` of two 128-bit values given as (low, high) 64-bit halves."""
        lane = ir.VectorType(ir.IntType(64), 2)
        function = builder.module.declare_intrinsic(
            "llvm.x86.pclmulqdq", fnty=ir.FunctionType(lane, [lane, lane, ir.IntType(8)])
        )
        vectors = []
        for low, high in (x, k):
            vector = builder.insert_element(ir.Constant(lane, ir.Undefined), low, ir.Constant(ir.IntType(32), 0))
            vectors.append(builder.insert_element(vector, high, ir.Constant(ir.IntType(32), 1)))
        return builder.call(function, [*vectors, ir.Constant(ir.IntType(8), selector)])

    def halves(context: Any, builder: Any, signature: Any, vector: Any) -> Any:
        low, high = (builder.extract_element(vector, ir.Constant(ir.IntType(32), i)) for i in (0, 1))
        return context.make_tuple(builder, signature.return_type, (low, high))

    @intrinsic
    def fold(typingctx: Any, low: Any, high: Any, k_low: Any, k_high: Any) -> Any:
        """(low, high) * k_low ^ high * k_high, carry-less: a 128-bit lane advanced by the fold distance."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            x, k = (args[0], args[1]), (args[2], args[3])
            lanes = builder.xor(multiply(builder, x, k, 0x00), multiply(builder, x, k, 0x11))
            return halves(context, builder, signature, lanes)

        return pair(numba.uint64, numba.uint64, numba.uint64, numba.uint64), codegen

    @intrinsic
    def times(typingctx: Any, a: Any, b: Any) -> Any:
        """a * b, carry-less, 64 x 64 -> 128 bits as (low, high)."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            zero = ir.Constant(ir.IntType(64), 0)
            return halves(context, builder, signature, multiply(builder, (args[0], zero), (args[1], zero), 0x00))

        return pair(numba.uint64, numba.uint64), codegen

    k1, k2, k3, k4, k5 = u64(0x154442BD4), u64(0x1C6E41596), u64(0x1751997D0), u64(0xCCAA009E), u64(0x163CD6124)
    poly, mu, low32 = u64(0x1DB710641), u64(0x1F7011641), u64(0xFFFFFFFF)
    table = np.arange(256, dtype=np.uint32)  # one byte's step of the reflected CRC: zlib's table
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ u32(0xEDB88320), table >> 1).astype(np.uint32)

    @numba.njit(inline="always")
    def crc32(row: np.ndarray) -> int:
        n = row.shape[0]
        crc = u32(0xFFFFFFFF)
        done = 0
        if n >= 64:
            done = n // 16 * 16
            q = row[:done].view(np.uint64)
            a0, a1, b0, b1 = q[0] ^ u64(crc), q[1], q[2], q[3]
            c0, c1, d0, d1 = q[4], q[5], q[6], q[7]
            j = 8
            while j + 8 <= q.shape[0]:
                a0, a1 = fold(a0, a1, k1, k2)
                b0, b1 = fold(b0, b1, k1, k2)
                c0, c1 = fold(c0, c1, k1, k2)
                d0, d1 = fold(d0, d1, k1, k2)
                a0, a1, b0, b1 = a0 ^ q[j], a1 ^ q[j + 1], b0 ^ q[j + 2], b1 ^ q[j + 3]
                c0, c1, d0, d1 = c0 ^ q[j + 4], c1 ^ q[j + 5], d0 ^ q[j + 6], d1 ^ q[j + 7]
                j += 8
            a0, a1 = fold(a0, a1, k3, k4)  # four lanes into one
            a0, a1 = fold(a0 ^ b0, a1 ^ b1, k3, k4)
            a0, a1 = fold(a0 ^ c0, a1 ^ c1, k3, k4)
            a0, a1 = a0 ^ d0, a1 ^ d1
            while j + 2 <= q.shape[0]:
                a0, a1 = fold(a0, a1, k3, k4)
                a0, a1 = a0 ^ q[j], a1 ^ q[j + 1]
                j += 2
            low, high = times(a0, k4)  # 128 -> 96 bits
            x0, x1 = low ^ a1, high
            low, high = times(x0 & low32, k5)  # 96 -> 64 bits
            y = ((x0 >> u64(32)) | (x1 << u64(32))) ^ low
            low, _ = times(y & low32, mu)  # Barrett: 64 -> 32 bits
            low, _ = times(low & low32, poly)
            crc = u32(((y ^ low) >> u64(32)) & low32)
        for i in range(done, n):
            crc = table[(crc ^ row[i]) & u32(0xFF)] ^ (crc >> u32(8))
        return u32(crc ^ u32(0xFFFFFFFF))

    def rows_crc32(rows: np.ndarray, out: np.ndarray) -> None:
        for r in range(rows.shape[0]):
            out[r] = crc32(rows[r])

    rows = numba.types.Array(numba.uint8, 2, "C", readonly=True)
    return numba.njit(numba.void(rows, numba.uint32[::1]), nogil=True, boundscheck=False)(rows_crc32)


def combine_rows(crcs: np.ndarray, row_bytes: int) -> int:
    """CRC-32 of ``len(crcs)`` consecutive rows of ``row_bytes`` each, from each row's CRC-32 (see
    :func:`combine_columns`)."""
    return int(combine_columns(np.asarray(crcs, dtype=np.uint32)[:, None], row_bytes)[0])


def combine_columns(crcs: np.ndarray, row_bytes: int) -> np.ndarray:
    """``[k]`` uint32: for each column of ``[n, k]`` row CRC-32s, the CRC-32 of its ``n`` consecutive rows of
    ``row_bytes`` each.

    A tree: neighbours are paired per level (the left one advanced over the right one's length, xor),
    each level one vectorized pass through byte tables of that length's operator, cached per row size:
    ~log2(n) short numpy passes for all columns at once, not n combines per column. (A shard of 33 tensors x
    900 rows took ~100 ms of a writer's GIL with a pass per bit, ~9 ms with a tree per tensor on the 2-core host,
    and, on the H200 host, 66 ms a shard of a writer's GIL beside the consumer's copies; a tree for all tensors
    makes a shard's passes 33 times fewer.) The rows are padded in front to a power of two with the CRC of
    nothing (0): combining it in changes nothing, as the left piece's length never enters a combine.
    """
    values = np.asarray(crcs, dtype=np.uint32)
    if len(values) <= 1:
        return values[0].copy() if len(values) else np.zeros(values.shape[1:], np.uint32)
    levels = (len(values) - 1).bit_length()
    values = np.concatenate([np.zeros(((1 << levels) - len(values), *values.shape[1:]), np.uint32), values])
    for level in range(levels):
        values = _advance_all(_zeros_tables(row_bytes, level), values[0::2]) ^ values[1::2]
    return values[0]


@functools.cache
def _zeros_tables(row_bytes: int, level: int) -> np.ndarray:
    """``[4, 256]`` uint32: byte ``p`` of a CRC's contribution after ``row_bytes * 2**level`` zero bytes."""
    columns = np.array(_zeros_matrix(row_bytes, level), dtype=np.uint32)
    byte = np.arange(256, dtype=np.uint32)
    tables = np.zeros((4, 256), dtype=np.uint32)
    for bit in range(32):
        tables[bit // 8] ^= ((byte >> np.uint32(bit % 8)) & np.uint32(1)) * columns[bit]
    return tables


@functools.cache
def _zeros_matrix(row_bytes: int, level: int) -> tuple[int, ...]:
    """The operator advancing a CRC-32 over ``row_bytes * 2**level`` zero bytes."""
    return _zeros_operator(row_bytes) if level == 0 else _gf2_square(_zeros_matrix(row_bytes, level - 1))


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


def _advance_all(tables: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """Each CRC of ``vectors`` advanced by the operator whose byte tables are ``tables``."""
    total = tables[0][vectors & np.uint32(0xFF)]
    for p in range(1, 4):
        total ^= tables[p][(vectors >> np.uint32(8 * p)) & np.uint32(0xFF)]
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
