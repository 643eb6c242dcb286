"""Reconstruction error of fp8 storage (float8_e4m3fn, one scale per row) and what it saves on disk.

What a user of ``--store-dtype fp8`` gets back from ``Store.get`` compared with the bf16 rows the
engine captured, on two kinds of data:

* random bf16 rows (hidden 4096): Gaussian; "LLM-like" (row norms spread over 8 orders of
  magnitude, three outlier channels 50x larger); Student-t with 3 degrees of freedom (heavy tails);
* real hidden states: the embedded tiny Llama extracted twice with ``hscapture extract`` over the
  same demo conversations (same batches, so the same captured rows), once as captured (bf16) and
  once with ``--store-dtype fp8``, every tensor of every sample compared, and the stores' bytes.

Per row: relative L2 error ``|x' - x| / |x|`` and the largest absolute error relative to the row's
largest magnitude ``max |x' - x| / max |x|``; per element: the relative error of elements whose
scaled value is a normal e4m3 number (the format bounds it by 2**-4, plus 2**-8 for the bf16
rounding on the way back). Each is summarized over rows (mean, median, p99, max). For comparison,
one scale per tensor (the whole block of rows) instead of per row. Also the single-thread speed of
quantizing (what a writer thread pays per shard) and dequantizing, median of repeats.

Run::

    python benchmarks/fp8_error.py [--samples 200] [--out benchmarks/results/fp8-error-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hscapture import open_store
from hscapture.extract import ExtractOptions, extract
from hscapture.fp8 import FP8, dequantize_rows, quantize_rows
from hscapture.fp8_kernel import E4M3_MAX

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "fp8-error-cpu.json"
HIDDEN = 4096


def random_rows(kind: str, rows: int, rng: np.random.Generator) -> torch.Tensor:
    if kind == "gaussian":
        values = rng.standard_normal((rows, HIDDEN))
    elif kind == "llm-like":
        values = rng.standard_normal((rows, HIDDEN)) * np.exp(rng.normal(0.0, 4.0, size=(rows, 1)))
        values[:, rng.choice(HIDDEN, 3, replace=False)] *= 50.0
    elif kind == "student-t3":
        values = rng.standard_t(3, size=(rows, HIDDEN))
    else:
        raise ValueError(kind)
    return torch.from_numpy(values).bfloat16()


def per_tensor_round_trip(x: torch.Tensor) -> torch.Tensor:
    """The alternative: one scale for the whole block of rows."""
    scale = x.float().abs().amax() / E4M3_MAX
    return ((x.float() / scale).to(FP8).float() * scale).to(x.dtype)


def errors(x: torch.Tensor, back: torch.Tensor, scales: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-row relative L2 and max-abs-relative-to-amax errors; per-element relative error of normal values."""
    x, back = x.float(), back.float()
    diff = back - x
    norms = x.norm(dim=1)
    amax = x.abs().amax(dim=1)
    keep = norms > 0
    normal = (x / scales[:, None]).abs() >= 2**-6
    return {
        "row_rel_l2": (diff.norm(dim=1)[keep] / norms[keep]).numpy(),
        "row_max_abs_rel": (diff.abs().amax(dim=1)[keep] / amax[keep]).numpy(),
        "element_rel_normal": (diff.abs()[normal] / x.abs()[normal]).numpy(),
    }


def summarize(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"n": 0}
    return {
        "n": int(values.size),
        "mean": float(values.mean()),
        "median": float(np.median(values)),
        "p99": float(np.quantile(values, 0.99)),
        "max": float(values.max()),
    }


def measure(x: torch.Tensor) -> dict[str, Any]:
    codes, scales, nonfinite = quantize_rows(x)
    per_row = errors(x, dequantize_rows(codes, scales, x.dtype), scales)
    tensor_scale = x.float().abs().amax() / E4M3_MAX
    per_tensor = errors(x, per_tensor_round_trip(x), torch.full((x.shape[0],), float(tensor_scale)))
    return {
        "rows": int(x.shape[0]),
        "nonfinite": nonfinite,
        "per_row_scale": {name: summarize(values) for name, values in per_row.items()},
        "per_tensor_scale": {name: summarize(values) for name, values in per_tensor.items()},
    }


def real_states(samples: int, work: Path) -> dict[str, Any]:
    """Extract the tiny model twice (bf16, fp8) and compare every tensor of every sample."""
    stores = {}
    for store_dtype in (None, "fp8"):
        out = work / (store_dtype or "bf16")
        extract(ExtractOptions(out=out, limit=samples, store_dtype=store_dtype, progress=False))
        stores[store_dtype or "bf16"] = open_store(out)
    plain, fp8 = stores["bf16"], stores["fp8"]
    result: dict[str, Any] = {}
    for name in plain.tensor_names:
        captured = torch.cat([plain.get(key, tensors=[name])[name] for key in plain])
        raw = [fp8.get(key, tensors=[name], dequantize=False) for key in plain]
        back = dequantize_rows(
            torch.cat([r[name] for r in raw]), torch.cat([r[f"{name}.scale"] for r in raw]), captured.dtype
        )
        decoded = torch.cat([fp8.get(key, tensors=[name])[name] for key in plain])
        assert torch.equal(back.view(torch.int16), decoded.view(torch.int16)), "Store.get dequantizes the same way"
        result[name] = measure(captured)
        result[name]["per_row_scale"] = {  # from the fp8 store itself, not re-quantized here
            key: summarize(values)
            for key, values in errors(captured, decoded, torch.cat([r[f"{name}.scale"] for r in raw])).items()
        }
    plain_bytes, fp8_bytes = plain.summary()["bytes"], fp8.summary()["bytes"]
    return {
        "model": "embedded tiny Llama (hscapture.tiny: 8 layers, hidden 256, bf16, random init)",
        "samples": len(plain.keys()),
        "rows": plain.summary()["rows"],
        "tensors": result,
        "bytes": {"bf16": plain_bytes, "fp8": fp8_bytes, "ratio": fp8_bytes / plain_bytes},
    }


def speed(repeats: int) -> dict[str, Any]:
    """Single-thread MB/s of bf16 rows in (quantize) and out (dequantize), 4096 rows x 4096."""
    torch.set_num_threads(1)
    x = random_rows("llm-like", 4096, np.random.default_rng(1))
    codes, scales, _ = quantize_rows(x)
    timings: dict[str, list[float]] = {"quantize": [], "dequantize": []}
    for _ in range(repeats + 1):  # the first is warm-up
        for name, call in (
            ("quantize", lambda: quantize_rows(x)),
            ("dequantize", lambda: dequantize_rows(codes, scales, x.dtype)),
        ):
            start = time.perf_counter()
            call()
            timings[name].append(time.perf_counter() - start)
    bf16_mb = x.numel() * 2 / 1e6
    return {
        "rows": 4096,
        "hidden": HIDDEN,
        "threads": 1,
        "repeats": repeats,
        **{f"{name}_mb_per_s_bf16": bf16_mb / statistics.median(t[1:]) for name, t in timings.items()},
    }


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    return os.environ.get("HSCAPTURE_COMMIT") or head.stdout.strip()


def table(record: dict[str, Any]) -> str:
    lines = [
        "| data | row rel. L2 median | p99 | max | max abs err / row amax, max | element rel. err (normal), max "
        "| per-tensor scale: row rel. L2 median |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    cases = {f"random {kind}": value for kind, value in record["random"].items()}
    cases.update({f"tiny Llama `{name}`": value for name, value in record["real"]["tensors"].items()})
    for label, value in cases.items():
        row, other = value["per_row_scale"], value["per_tensor_scale"]
        lines.append(
            f"| {label} | {row['row_rel_l2']['median']:.4f} | {row['row_rel_l2']['p99']:.4f} | "
            f"{row['row_rel_l2']['max']:.4f} | {row['row_max_abs_rel']['max']:.4f} | "
            f"{row['element_rel_normal']['max']:.4f} | {other['row_rel_l2']['median']:.4f} |"
        )
    size = record["real"]["bytes"]
    lines.append(
        f"\nstore bytes: bf16 {size['bf16']}, fp8 {size['fp8']} (ratio {size['ratio']:.3f}); "
        f"quantize {record['speed']['quantize_mb_per_s_bf16']:.0f} MB/s, "
        f"dequantize {record['speed']['dequantize_mb_per_s_bf16']:.0f} MB/s of bf16 per thread"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200, help="demo conversations extracted from the tiny model")
    parser.add_argument("--rows", type=int, default=8192, help="random rows per distribution")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats of the speed measurement")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    random = {kind: measure(random_rows(kind, args.rows, rng)) for kind in ("gaussian", "llm-like", "student-t3")}
    with tempfile.TemporaryDirectory(prefix="hs-fp8-error-") as work:
        real = real_states(args.samples, Path(work))
    record = {
        "benchmark": "fp8 storage: reconstruction error of float8_e4m3fn with a per-row scale, and bytes on disk",
        "command": shlex.join(["python", *sys.argv]),
        "commit": commit(),
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "bounds": {
            "element_rel_normal": "2**-4 = 0.0625 (e4m3 rounding), +2**-8 for bf16 on the way back: 0.0667",
            "normal": "scaled magnitude |x / scale| >= 2**-6 (e4m3's smallest normal)",
        },
        "random": random,
        "real": real,
        "speed": speed(args.repeats),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(table(record))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
