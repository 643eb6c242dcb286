"""Reading a store, row checks on and off: samples/s through ``open_store().get`` and ``CaptureDataset``.

``python benchmarks/run.py read`` (any host; ``--tiny`` is a seconds-long smoke run). One run:

* the store: ``--gib`` of random bf16 rows (4 tensors x hidden 4096: EAGLE-3's layers 2, 16, 29 of
  a 32-layer model plus the post-norm last state; ``--tiny``: hidden 256) written here through the
  real :class:`~hscapture.store.writer.StoreWriter` (shards written, fsync'd, indexed, row CRC-32s
  recorded) as requests of ``--sample-tokens`` rows on average (0.5x to 1.5x, seeded);
* three reading paths, each with ``verify=True`` (every row returned checked against its CRC-32,
  the default) and ``verify=False``: ``get`` (``open_store(path).get(key)`` over every key, this
  process), ``loader-0`` and ``loader-2`` (a ``torch.utils.data.DataLoader`` over
  ``CaptureDataset``, ``batch_size=None``, 0 and 2 persistent workers);
* one untimed warm-up pass of each of the six, then ``--repeats`` timed passes of each, the six in
  a rotating order per repeat. A pass reads every sample, every tensor, once.

Reported per path and check: samples/s, tok/s (rows/s), GB/s (1e9 bytes/s of captured rows
returned), medians over repeats, and ``verify on / off`` of samples/s. The store was just written
and every pass reads it again, so the shards are in the page cache: these are warm-cache figures
(memory copies and CRC-32s, no disk). A cold-cache figure needs the page cache dropped
(``echo 1 > /proc/sys/vm/drop_caches`` as root) before each pass; this suite does not do that.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmarks.report import Outcome, SuiteSpec
from hscapture import open_store
from hscapture.config import MiB
from hscapture.dataset import CaptureDataset
from hscapture.integrations.hf import describe
from hscapture.store.records import Finish
from hscapture.store.writer import RowGeometry, StoreWriter

GiB = 1 << 30
LAYERS = (2, 16, 29)  # EAGLE-3's set for a 32-layer model, plus the post-norm last state
NUM_LAYERS = 32
#: Reading paths, in the order shown.
PATHS = ("get", "loader-0", "loader-2")
CHECKS = ("off", "on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="hidden 256, 16 MiB of rows: a smoke run of seconds")
    parser.add_argument("--gib", type=float, help="GiB of captured rows in the store (default 1; --tiny 1/64)")
    parser.add_argument("--sample-tokens", type=int, help="mean rows per sample (default 512; --tiny 64)")
    parser.add_argument("--repeats", type=int, help="timed passes of each variant (default 3; --tiny 2)")
    parser.add_argument("--work-dir", type=Path, help="where the store goes (default $TMPDIR)")


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of this run; bad values fail here, before the store is written."""
    settings = {
        "tiny": args.tiny,
        "gib": args.gib if args.gib is not None else (1 / 64 if args.tiny else 1.0),
        "sample_tokens": args.sample_tokens if args.sample_tokens is not None else (64 if args.tiny else 512),
        "repeats": args.repeats if args.repeats is not None else (2 if args.tiny else 3),
        "hidden": 256 if args.tiny else 4096,
        "shard_mib": 4 if args.tiny else 256,
        "dtype": "bfloat16",
    }
    for key in ("gib", "sample_tokens", "repeats"):
        if settings[key] <= 0:
            raise ValueError(f"--{key.replace('_', '-')} {settings[key]}: must be > 0")
    return settings


def write_store(root: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Random rows through the real StoreWriter: requests of 0.5x-1.5x ``sample_tokens`` rows, each finished."""
    names = (*(f"layer_{k}" for k in LAYERS), "last")
    geometry = RowGeometry(names, tuple(describe(LAYERS, True, NUM_LAYERS)), settings["dtype"], settings["hidden"])
    plane_bytes = geometry.plane_row_bytes
    total_rows = max(1, int(settings["gib"] * GiB) // geometry.row_bytes)
    rng = np.random.default_rng(0)
    mean = settings["sample_tokens"]
    pool_rows = 2 * mean
    pool = rng.integers(0, 256, size=(len(names), pool_rows + 2 * mean, plane_bytes), dtype=np.uint8)
    writer = StoreWriter(root, shard_bytes=settings["shard_mib"] * MiB)
    started = time.perf_counter()
    samples = rows = 0
    try:
        writer.begin_run("read-bench", geometry, {"engine": "read-bench"})
        while rows < total_rows:
            count = min(int(rng.integers(max(1, mean // 2), mean + mean // 2 + 1)), total_rows - rows)
            offset = int(rng.integers(0, pool_rows))  # rows differ from sample to sample
            reservation = writer.reserve(count)
            begin = 0
            for piece in reservation.pieces:
                for t, plane in enumerate(piece.planes):
                    plane[:] = pool[t, offset + begin : offset + begin + piece.rows]
                begin += piece.rows
            key = f"sample-{samples:06d}"
            positions = np.arange(count, dtype=np.int64)
            writer.commit(reservation, [key], [count], positions, rng.integers(1, 50_000, count, dtype=np.int64))
            writer.finish_request(key, Finish("finished", num_tokens=count, loss_mask=[(0, count)]))
            samples += 1
            rows += count
    except BaseException:
        with contextlib.suppress(Exception):  # the first error is the one to see
            writer.close("benchmark stopped")
        raise
    writer.close("benchmark store written")
    seconds = time.perf_counter() - started
    shard_bytes = sum(p.stat().st_size for p in root.glob("shard-*.safetensors"))
    return {
        "samples": samples,
        "rows": rows,
        "row_bytes": geometry.row_bytes,
        "captured_bytes": rows * geometry.row_bytes,
        "shard_bytes": shard_bytes,
        "shards": len(list(root.glob("shard-*.safetensors"))),
        "write_seconds": round(seconds, 3),
    }


class Reader:
    """One reading path with one check setting: ``passes()`` reads every sample once, counting rows."""

    def __init__(self, path: str, check: str, root: Path) -> None:
        self.path, self.check = path, check
        verify = check == "on"
        if path == "get":
            store = open_store(root, verify=verify)
            keys = store.keys(complete_only=True)
            self._source: Callable[[], Iterable[dict[str, torch.Tensor]]] = lambda: (store.get(k) for k in keys)
        else:
            workers = int(path.split("-")[1])
            dataset = CaptureDataset(root, verify=verify)
            loader = DataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
            self._source = lambda: loader
        self.seconds: list[float] = []

    def read_all(self) -> tuple[float, int, int]:
        """(seconds, samples, rows) of one pass over every sample."""
        samples = rows = 0
        started = time.perf_counter()
        for sample in self._source():
            samples += 1
            rows += len(sample["input_ids"])
        return time.perf_counter() - started, samples, rows


def measure(root: Path, store: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Every path with checks on and off: a warm-up pass each, then ``repeats`` passes each in rotating order."""
    readers = [Reader(path, check, root) for path in PATHS for check in CHECKS]
    for reader in readers:  # warm-up: worker start, first mappings, whole-tensor checks of the small fields
        _, samples, rows = reader.read_all()
        if (samples, rows) != (store["samples"], store["rows"]):
            raise RuntimeError(f"{reader.path} verify {reader.check}: read {samples} samples, {rows} rows of {store}")
    for repeat in range(repeats):
        shift = repeat % len(readers)
        for reader in readers[shift:] + readers[:shift]:
            reader.seconds.append(reader.read_all()[0])
    results: dict[str, Any] = {}
    for path in PATHS:
        entry: dict[str, Any] = {}
        for reader in (r for r in readers if r.path == path):
            median = statistics.median(reader.seconds)
            entry[reader.check] = {
                "samples_per_s": round(store["samples"] / median, 1),
                "tok_per_s": round(store["rows"] / median, 1),
                "gbps": round(store["captured_bytes"] / median / 1e9, 3),
                "seconds": [round(s, 4) for s in reader.seconds],
            }
        entry["verify_on_vs_off"] = round(entry["on"]["samples_per_s"] / entry["off"]["samples_per_s"], 4)
        results[path] = entry
    return results


def host() -> tuple[dict[str, Any], str]:
    """The machine read on (its CPU does the work) and the tag naming its results: its GPU's, else ``cpu``."""
    device: dict[str, Any] = {"kind": "cpu", "name": f"CPU ({os.cpu_count()} cores)"}
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        device["host_gpu"] = gpu
        return device, re.sub(r"[^a-z0-9]", "", gpu.split()[-1].lower()) or "gpu"
    return device, "cpu"


def run(args: argparse.Namespace, checkpoint: Callable[[Outcome], None]) -> Outcome:
    settings = resolve(args)
    device, tag = host()
    outcome = Outcome(
        name=f"read-tiny-{tag}" if args.tiny else f"read-{tag}", device=device, settings=settings, results={}
    )
    work = Path(tempfile.mkdtemp(prefix="hscapture-read-", dir=args.work_dir))
    try:
        root = work / "store"
        print(f"[read suite] writing {settings['gib']:.3g} GiB of rows ...", flush=True)
        outcome.results["store"] = write_store(root, settings)
        checkpoint(outcome)
        print("[read suite] reading ...", flush=True)
        outcome.results.update(measure(root, outcome.results["store"], settings["repeats"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return outcome


def table(record: dict[str, Any]) -> str:
    results, settings = record["results"], record["settings"]
    store = results["store"]
    lines = [
        "| path | verify | samples/s | tok/s | GB/s | verify on / off |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for path in PATHS:
        entry = results.get(path)
        if entry is None:
            continue
        for check in CHECKS:
            figures = entry[check]
            ratio = f"**{entry['verify_on_vs_off']:.3f}**" if check == "on" else ""
            lines.append(
                f"| {path} | {check} | {figures['samples_per_s']:,.1f} | {figures['tok_per_s']:,.0f} | "
                f"{figures['gbps']:.2f} | {ratio} |"
            )
    lines.append(
        f"\n{store['samples']} samples, {store['rows']:,} rows ({store['captured_bytes'] / GiB:.2f} GiB; 4 tensors x "
        f"hidden {settings['hidden']}, bf16, ~{settings['sample_tokens']} rows a sample) in {store['shards']} shards; "
        f"`get`: `open_store().get` in this process; `loader-N`: `DataLoader(CaptureDataset, batch_size=None, "
        f"num_workers=N)`. Medians of {settings['repeats']} passes each, the six in rotating order after a warm-up "
        "pass each. Warm page cache (the store was just written): memory copies and CRC-32s, no disk."
    )
    return "\n".join(lines)


def tok_per_s(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Rows/s per path, check off (labelled ``off``, the chart's baseline) and on."""
    return {
        path: {"off": entry["off"]["tok_per_s"], "verify": entry["on"]["tok_per_s"]}
        for path, entry in record["results"].items()
        if path in PATHS
    }


SUITE = SuiteSpec(
    name="read",
    description="reading a store: samples/s through get and CaptureDataset in a DataLoader, row checks on and off",
    add_arguments=add_arguments,
    run=run,
    table=table,
    tok_per_s=tok_per_s,
)
