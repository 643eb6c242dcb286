"""fp8 storage of captured rows: ``float8_e4m3fn`` codes with one float32 scale per row.

Why per row: a hidden state's magnitude varies by orders of magnitude from token to token (the
first token and a few "massive activation" positions dwarf the rest), so one scale per tensor
would flush ordinary rows into e4m3's subnormals. With ``scale = amax(|row|) / 448`` every row
uses e4m3's full range and each element whose scaled value is normal (>= 2**-6) comes back with
a relative error of at most 2**-4 (3 mantissa bits, round to nearest even).

Policy for special rows, applied by :func:`quantize_rows`:

- all-zero row (or one without a finite value, or whose largest magnitude is below 448 float32
  subnormal steps, ~6e-43): scale 1.0, codes 0; it dequantizes to exact zeros.
- NaN and +-inf elements: the scale comes from the row's finite elements (one overflow does not
  wipe out its row), and the element is stored as NaN (e4m3fn has no infinity), so a non-finite
  value never reads back as a finite one. The writer counts them in the shard's index line.

Where it runs: the consumer of a GPU ring quantizes each chunk on the GPU (:func:`quantize_into`,
on its own stream, before the copy to the host: half the PCIe bytes); the consumer of a host ring
quantizes each chunk where it lies in the ring's shared memory (:mod:`hscapture.consumer.host_fp8`,
with :func:`~hscapture.fp8_kernel.host_kernels`), or, without numba, the store's writer threads quantize the copied rows
(:class:`Quantizer`). All give the same bits; the serving loop never pays for any.

On the host, :class:`Quantizer` runs one fused kernel per block where numba is installed
(:func:`~hscapture.fp8_kernel.host_kernels`: each row read twice, its codes written once; ~17 GB/s of bf16 rows per
thread on the CPU host against ~3 GB/s for the torch passes, whose float32 -> e4m3fn cast alone
runs at 2.5 G values/s: torch converts to fp8 one value at a time). Its conversion is torch's own
(``c10::detail::fp8e4m3fn_from_fp32_value``) written out branch-free, so the bits are the same.
"""

from __future__ import annotations

import numpy as np
import torch

from hscapture.fp8_kernel import E4M3_MAX, NAN_CODE, host_kernels

#: fp8 storage's torch dtype (its store dtype name is :data:`~hscapture.fp8_kernel.FP8_NAME`).
FP8 = torch.float8_e4m3fn
#: Rows quantized per block by :func:`quantize_rows`: bounds the float32 scratch (16 MiB at hidden 4096).
BLOCK_ELEMENTS = 1 << 22


class Quantizer:
    """Quantizes blocks of up to ``block_rows`` rows of width ``hidden``, reusing its buffers.

    One per thread. With the fused kernel (``fused``: by default wherever :func:`host_kernels`
    compiles), each block of bf16 or float32 rows is quantized in one call that releases the GIL;
    other dtypes are first converted into a float32 scratch. Without it, each block is converted once
    into the float32 scratch, its row maxima taken there, divided in place and cast into the codes
    buffer: no temporary the size of the block is allocated per call (allocating them, and torch's
    mixed-dtype ``div`` into fp8, cost ~10x more).
    """

    def __init__(self, hidden: int, block_rows: int, fused: bool | None = None) -> None:
        self._scratch = torch.empty(block_rows, hidden, dtype=torch.float32)
        self._codes = torch.empty(block_rows, hidden, dtype=FP8)
        self._kernels = host_kernels() if fused is not False else None
        self._counts = np.empty(block_rows, dtype=np.int32)
        if fused and self._kernels is None:
            raise RuntimeError("fused: the host kernel needs numba (pip install 'hscapture[host-fp8]')")

    def __call__(
        self, rows: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """``[r, hidden]`` floats -> (``[r, hidden]`` codes, non-finite count); writes the ``[r]`` scales.

        The codes land in ``out`` if given, else in this quantizer's buffer (valid until the next call).
        """
        count = rows.shape[0]
        codes = self._codes[:count] if out is None else out
        if self._kernels is not None and codes.is_contiguous() and scales.is_contiguous():
            return codes, self._fused(rows, scales, codes)
        values = self._scratch[:count]
        values.copy_(rows)
        amax = torch.maximum(values.amax(dim=1), values.amin(dim=1).neg_())  # max |x|, exact, no temporary
        bad = None
        nonfinite = 0
        if not bool(torch.isfinite(amax).all()):  # NaN and inf propagate into amax: the rare slow path
            bad = ~torch.isfinite(values)
            nonfinite = int(bad.sum())
            amax = values.abs().masked_fill_(bad, 0.0).amax(dim=1)
        scale = _scale_of(amax)
        values.div_(scale[:, None])  # |x / scale| <= 448 up to float32 rounding: no overflow
        codes.copy_(values)  # float32 -> e4m3fn, rounded to nearest even
        if bad is not None:
            codes.view(torch.uint8).masked_fill_(bad, NAN_CODE)
        scales.copy_(scale)
        return codes, nonfinite

    def _fused(self, rows: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> int:
        """The fused kernel on ``rows``: contiguous bf16 and float32 host rows as they are, others via the scratch."""
        assert self._kernels is not None
        if not (rows.device.type == "cpu" and rows.dtype in (torch.bfloat16, torch.float32) and rows.is_contiguous()):
            rows = self._scratch[: len(rows)].copy_(rows)
        bits = rows.view(torch.int16 if rows.dtype == torch.bfloat16 else torch.int32).numpy()
        kernel = self._kernels[bits.itemsize]
        counts = self._counts[: len(bits)]
        return int(kernel(bits.view(f"u{bits.itemsize}"), codes.view(torch.uint8).numpy(), scales.numpy(), counts))


def quantize_into(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, nonfinite: torch.Tensor) -> None:
    """:class:`Quantizer`'s codes and scales, bit for bit, without reading anything back to the host.

    For rows on a GPU: the non-finite case is not a branch (which would sync the device), so every
    call pays for the mask. About ten elementwise kernels, ~18 bytes of device memory traffic per
    byte of bf16 rows, no allocation beyond the caching allocator's temporaries (a float32 copy of
    ``rows``: pass blocks of rows to bound it).

    Args:
        rows: ``[..., n, hidden]`` floats, any strides.
        codes: ``[..., n, hidden]`` float8_e4m3fn, written.
        scales: ``[..., n]`` float32, written: each row's scale.
        nonfinite: ``[..., n]`` int32, written: each row's count of NaN and inf elements.
    """
    finite = torch.isfinite(rows)
    amax = rows.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs_().amax(dim=-1)  # max |finite x|, exact
    scales.copy_(_scale_of(amax.float()))
    codes.copy_(torch.div(rows, scales.unsqueeze(-1)))  # in float32, rounded once into e4m3fn
    bad = finite.logical_not_()
    torch.sum(bad, dim=-1, dtype=torch.int32, out=nonfinite)
    codes.view(torch.uint8).masked_fill_(bad, NAN_CODE)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """``[n]`` float32 row maxima -> scales; a zero row (or amax below 448 float32 ulps) gets 1.0 and stores zeros.

    The divisor is a tensor on ``amax``'s device: CUDA divides by a Python number as a multiplication
    by its reciprocal, which can differ from the quotient in the last bit.
    """
    scale = amax / torch.full((), E4M3_MAX, dtype=torch.float32, device=amax.device)
    return torch.where(scale > 0, scale, 1.0)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``[n, hidden]`` floats -> (``[n, hidden]`` float8_e4m3fn codes, ``[n]`` float32 scales, non-finite count).

    ``codes.float() * scales[:, None]`` approximates ``rows`` (see the module docstring for the
    bound and the policy for zero and non-finite rows). The division is computed in float32 and
    rounded once, straight into the codes; blocks of rows keep the temporaries small.
    """
    if rows.dim() != 2 or not rows.is_floating_point():
        raise ValueError(f"rows: expected a float [n, hidden] tensor, got {rows.dtype} {tuple(rows.shape)}")
    n, hidden = rows.shape
    codes = torch.empty(n, hidden, dtype=FP8)
    scales = torch.empty(n, dtype=torch.float32)
    step = max(1, BLOCK_ELEMENTS // max(hidden, 1))
    quantize = Quantizer(hidden, min(step, max(n, 1)))
    nonfinite = 0
    for begin in range(0, n, step):
        _, count = quantize(rows[begin : begin + step], scales[begin : begin + step], codes[begin : begin + step])
        nonfinite += count
    return codes, scales, nonfinite


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, hidden]`` e4m3fn codes and ``[n]`` scales -> ``[n, hidden]`` rows in ``dtype``."""
    return (codes.float() * scales[:, None]).to(dtype)
