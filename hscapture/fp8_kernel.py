"""fp8 codes on the host without torch: the store's names for them and the fused kernel that writes them.

What a consumer writing an fp8 store out of a host ring needs, and all it needs: it never imports
torch (:mod:`hscapture.fp8` holds the torch side, the same bits). The kernel is numba's, compiled
once per process where numba is installed (:mod:`hscapture.jit`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hscapture.jit import compiled

#: The store dtype name of fp8 storage (``meta.json`` ``store_dtype``).
FP8_NAME = "float8_e4m3fn"
#: Largest finite e4m3fn value: a row's largest magnitude is scaled onto it.
E4M3_MAX = 448.0
#: The e4m3fn bit pattern of NaN (positive sign; e4m3fn has no infinity).
NAN_CODE = 0x7F
#: Suffix of the tensor holding each row's scale next to the codes: ``layer_2`` + ``.scale``.
SCALE_SUFFIX = ".scale"


def scale_name(tensor: str) -> str:
    """The name of the scales of ``tensor`` in a shard and in a raw ``Store.get`` sample."""
    return tensor + SCALE_SUFFIX


def host_kernels() -> dict[int, Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], int]] | None:
    """The fused host quantization kernels, by the bytes of the rows' values; None without numba.

    ``kernel(bits, codes, scales, nonfinite) -> non-finite count`` takes ``[n, hidden]`` rows as the
    bits of their values (uint16 for bfloat16, uint32 for float32, C-contiguous, may be read-only)
    and writes ``[n, hidden]`` uint8 codes, ``[n]`` float32 scales and ``[n]`` int32 counts of
    non-finite values: :class:`hscapture.fp8.Quantizer`'s policy and bits. Compiled once per process (~1 s, on
    the first call: the store calls it when an fp8 run begins, not under the rows).
    """
    return compiled(_compile)


def _compile(numba: Any) -> dict[int, Any]:
    """Compile the kernels for bf16 (uint16 bits) and float32 (uint32 bits) rows."""
    u16, u32, f32 = np.uint16, np.uint32, np.float32

    @numba.njit(inline="always")
    def e4m3(v: float) -> int:
        """``c10::detail::fp8e4m3fn_from_fp32_value``, branch-free: round to nearest even, NaN at >= 480."""
        bits = f32(v).view(u32)
        sign = u32(bits & u32(0x80000000))
        a = u32(bits ^ sign)
        normal = u32(u32(a + u32(0xC407FFFF) + u32(u32(a >> u32(20)) & u32(1))) >> u32(20))  # rebias 127 -> 7
        small = u32(f32(a.view(f32) + f32(16384.0)).view(u32) - u32(141 << 23))  # below 2**-6: 2**-9 steps
        code = small if a < u32(121 << 23) else normal
        code = u32(NAN_CODE) if a >= u32(1087 << 20) else code
        return np.uint8(u32(code | u32(sign >> u32(24))))

    def kernel(uint: Any, shift: int) -> Any:
        """The kernel for rows given as ``uint`` bits, a float32's upper ``32 - shift`` bits."""
        magnitude, infinity = uint((1 << (8 * uint(0).itemsize - 1)) - 1), uint(0x7F800000 >> shift)

        @numba.njit(inline="always")
        def widen(b: int) -> float:
            return u32(u32(b) << u32(shift)).view(f32)

        def quantize(bits: np.ndarray, codes: np.ndarray, scales: np.ndarray, nonfinite: np.ndarray) -> int:
            total = 0
            for r in range(bits.shape[0]):
                row, out = bits[r], codes[r]
                top = uint(0)
                for i in range(row.shape[0]):  # the bits of |x| order like |x|: max |x| without a float
                    top = max(top, uint(row[i] & magnitude))
                bad = 0
                if top >= infinity:  # NaN or inf: the scale comes from the finite values
                    top = uint(0)
                    for i in range(row.shape[0]):
                        a = uint(row[i] & magnitude)
                        if a >= infinity:
                            bad += 1
                        elif a > top:
                            top = a
                scale = f32(widen(top) / f32(E4M3_MAX))
                if not scale > f32(0.0):
                    scale = f32(1.0)
                scales[r], nonfinite[r] = scale, bad
                for i in range(row.shape[0]):
                    out[i] = e4m3(f32(widen(row[i]) / scale))
                if bad:
                    for i in range(row.shape[0]):
                        if uint(row[i] & magnitude) >= infinity:
                            out[i] = NAN_CODE
                total += bad
            return total

        rows = numba.types.Array(numba.from_dtype(np.dtype(uint)), 2, "C", readonly=True)  # e.g. a ring's pages
        out = (numba.uint8[:, ::1], numba.float32[::1], numba.int32[::1])
        return numba.njit(numba.int64(rows, *out), nogil=True, boundscheck=False)(quantize)

    return {2: kernel(u16, 16), 4: kernel(u32, 0)}
