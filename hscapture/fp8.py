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

The writer quantizes on its writer threads, after the rows left the ring; the serving loop and
the consumer's copy-and-release path never pay for it.
"""

from __future__ import annotations

import torch

#: The store dtype name of fp8 storage (``meta.json`` ``store_dtype``) and its torch dtype.
FP8_NAME = "float8_e4m3fn"
FP8 = torch.float8_e4m3fn
#: Largest finite e4m3fn value: a row's largest magnitude is scaled onto it.
E4M3_MAX = 448.0
#: The e4m3fn bit pattern of NaN (positive sign; e4m3fn has no infinity).
NAN_CODE = 0x7F
#: Suffix of the tensor holding each row's scale next to the codes: ``layer_2`` + ``.scale``.
SCALE_SUFFIX = ".scale"
#: Rows quantized per block by :func:`quantize_rows`: bounds the float32 scratch (16 MiB at hidden 4096).
_BLOCK_ELEMENTS = 1 << 22


def scale_name(tensor: str) -> str:
    """The name of the scales of ``tensor`` in a shard and in a raw ``Store.get`` sample."""
    return tensor + SCALE_SUFFIX


class Quantizer:
    """Quantizes blocks of up to ``block_rows`` rows of width ``hidden``, reusing its buffers.

    One per thread. Each block is converted once into a float32 scratch, its row maxima taken
    there, divided in place and cast into the codes buffer: no temporary the size of the block is
    allocated per call (allocating them, and torch's mixed-dtype ``div`` into fp8, cost ~10x more).
    """

    def __init__(self, hidden: int, block_rows: int) -> None:
        self._scratch = torch.empty(block_rows, hidden, dtype=torch.float32)
        self._codes = torch.empty(block_rows, hidden, dtype=FP8)

    def __call__(
        self, rows: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """``[r, hidden]`` floats -> (``[r, hidden]`` codes, non-finite count); writes the ``[r]`` scales.

        The codes land in ``out`` if given, else in this quantizer's buffer (valid until the next call).
        """
        count = rows.shape[0]
        values = self._scratch[:count]
        values.copy_(rows)
        amax = torch.maximum(values.amax(dim=1), values.amin(dim=1).neg_())  # max |x|, exact, no temporary
        bad = None
        nonfinite = 0
        if not bool(torch.isfinite(amax).all()):  # NaN and inf propagate into amax: the rare slow path
            bad = ~torch.isfinite(values)
            nonfinite = int(bad.sum())
            amax = values.abs().masked_fill_(bad, 0.0).amax(dim=1)
        scale = amax / E4M3_MAX
        scale = torch.where(scale > 0, scale, 1.0)  # zero rows (and amax below 448 float32 ulps) store zeros
        values.div_(scale[:, None])  # |x / scale| <= 448 up to float32 rounding: no overflow
        codes = self._codes[:count] if out is None else out
        codes.copy_(values)  # float32 -> e4m3fn, rounded to nearest even
        if bad is not None:
            codes.view(torch.uint8).masked_fill_(bad, NAN_CODE)
        scales.copy_(scale)
        return codes, nonfinite


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
    step = max(1, _BLOCK_ELEMENTS // max(hidden, 1))
    quantize = Quantizer(hidden, min(step, max(n, 1)))
    nonfinite = 0
    for begin in range(0, n, step):
        _, count = quantize(rows[begin : begin + step], scales[begin : begin + step], codes[begin : begin + step])
        nonfinite += count
    return codes, scales, nonfinite


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, hidden]`` e4m3fn codes and ``[n]`` scales -> ``[n, hidden]`` rows in ``dtype``."""
    return (codes.float() * scales[:, None]).to(dtype)
