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
#: Rows quantized per block: bounds the float32 temporaries (16 MiB at hidden 4096).
_BLOCK_ELEMENTS = 1 << 22


def scale_name(tensor: str) -> str:
    """The name of the scales of ``tensor`` in a shard and in a raw ``Store.get`` sample."""
    return tensor + SCALE_SUFFIX


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
    nonfinite = 0
    step = max(1, _BLOCK_ELEMENTS // max(hidden, 1))
    for begin in range(0, n, step):
        block = rows[begin : begin + step]
        amax = block.abs().amax(dim=1).float()  # exact in the captured dtype
        bad = None
        if not bool(torch.isfinite(amax).all()):  # NaN and inf propagate into amax: the rare slow path
            bad = ~torch.isfinite(block)
            nonfinite += int(bad.sum())
            amax = block.float().abs().masked_fill_(bad, 0.0).amax(dim=1)
        scale = amax / E4M3_MAX
        scale = torch.where(scale > 0, scale, 1.0)  # zero rows (and amax below 448 float32 ulps) store zeros
        out = codes[begin : begin + step]
        torch.div(block, scale[:, None], out=out)  # |x / scale| <= 448 up to float32 rounding: no overflow
        if bad is not None:
            out.view(torch.uint8).masked_fill_(bad, NAN_CODE)
        scales[begin : begin + step] = scale
    return codes, scales, nonfinite


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, hidden]`` e4m3fn codes and ``[n]`` scales -> ``[n, hidden]`` rows in ``dtype``."""
    return (codes.float() * scales[:, None]).to(dtype)
