"""How long ``hscapture consume`` takes to start: from its launch to a producer's attach and to its first rows.

``python benchmarks/run.py consumer-start`` (any host; ``--device cuda`` for a CUDA ring; ``--tiny`` is a
smoke run). Each repeat starts a fresh ``hscapture consume`` process writing a fresh store, as ``hscapture
extract`` starts one, against a producer of this process (block policy, EAGLE-3's three layers of a 32-layer
model plus ``last``: 4 tensors x hidden 4096 bf16, 4 MiB slots, a ring of 16), measured two ways:

* ``cold``: the producer is up first and the consumer process is launched then (a consumer started by hand
  beside a running engine). ``attach_s``: launch to the producer's attach (the consumer has opened the ring
  and begun its store run, and confirmed the layout); ``first_rows_s``: launch to the ring's first slot coming
  back, i.e. the consumer has copied rows into its store's buffers (the producer sends 17 one-slot steps; the
  17th waits for a free slot). What it spent the time on, from the same runs: ``imports_s``, an interpreter
  importing what ``hscapture consume`` imports (measured on its own), and ``run_begin_s``, the consumer's own
  figure for opening the ring and beginning the store's run (its log line ``attached to run ... in X s``).
* ``warm``: the consumer is launched ``--head-start`` seconds before the producer is made, as ``hscapture
  extract`` launches it when the model begins to load; ``attach_s`` and ``first_rows_s`` count from the
  producer's creation: what the capture waits for once the engine is ready.

Each is done with the store keeping rows as captured (``bf16``) and as ``fp8``. Medians over ``--repeats``,
variants interleaved. The goal: the cold attach within 3 s on a 2-core CPU host, 1 s on the H200.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.report import Outcome, SuiteSkipped, SuiteSpec
from hscapture.config import CaptureConfig, MiB, usable_cores
from hscapture.consumer import consume_command
from hscapture.integrations.hf import describe
from hscapture.producer import Producer

LAYERS = (2, 16, 29)
NUM_LAYERS = 32
SLOTS = 16
#: Seconds a CPU host / a GPU host may take from launch to attach.
GOALS = {"cpu": 3.0, "gpu": 1.0}
#: The imports of ``hscapture consume``, on their own (cli.main imports these before it builds the consumer).
IMPORTS = "import hscapture.cli, hscapture.consumer, hscapture.consumer.metrics"
RUN_BEGIN = re.compile(r"attached to run \S+ in ([\d.]+) s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="hidden 256, 2 repeats, 4 MiB shards: a smoke run")
    parser.add_argument("--device", default="cpu", help="cpu (host ring) or cuda (CUDA ring)")
    parser.add_argument("--repeats", type=int, help="consumer starts per variant (default 5; --tiny 2)")
    parser.add_argument("--head-start", type=float, default=10.0, help="warm: seconds the consumer starts early")
    parser.add_argument("--work-dir", type=Path, help="where the stores go (default $TMPDIR)")


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of this run; bad values fail here, before any process starts."""
    settings = {
        "tiny": args.tiny,
        "device": args.device,
        "repeats": args.repeats if args.repeats is not None else (2 if args.tiny else 5),
        "head_start_s": args.head_start if not args.tiny else min(args.head_start, 5.0),
        "hidden": 256 if args.tiny else 4096,
        "shard_bytes": 4 * MiB if args.tiny else None,  # None: the consumer's default (256 MiB)
        "dtype": "bfloat16",
        "layers": list(LAYERS),
        "cores": usable_cores(),
    }
    if settings["repeats"] < 1:
        raise ValueError(f"--repeats {settings['repeats']}: must be >= 1")
    if settings["head_start_s"] < 0:
        raise ValueError(f"--head-start {settings['head_start_s']}: must be >= 0")
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device!r}: use cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SuiteSkipped("--device cuda: no CUDA GPU visible; run it on a GPU host, or with --device cpu")
    return settings


def _config(endpoint: str, settings: dict[str, Any]) -> CaptureConfig:
    row_bytes = (len(LAYERS) + 1) * settings["hidden"] * 2
    slot_bytes = 4 * MiB
    return CaptureConfig(
        layers=LAYERS, hidden_size=settings["hidden"], num_layers=NUM_LAYERS, dtype="bfloat16",
        slot_bytes=slot_bytes, ring_bytes=SLOTS * slot_bytes, max_step_rows=slot_bytes // row_bytes,
        policy="block", endpoint=endpoint, device=settings["device"],
    )  # fmt: skip


def measure_imports() -> float:
    """Seconds for a fresh interpreter to import what ``hscapture consume`` imports."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", IMPORTS], check=True)
    return time.monotonic() - started


def start_once(work: Path, settings: dict[str, Any], store_dtype: str, head_start: float | None) -> dict[str, float]:
    """One consumer start: ``head_start`` None (cold: producer first) or the seconds the consumer starts early."""
    endpoint = f"ipc:///tmp/hscapture-{os.getuid()}/bench-start-{uuid.uuid4().hex[:8]}"
    out = work / f"store-{uuid.uuid4().hex[:8]}"
    config = _config(endpoint, settings)
    extra = ["--store-dtype", "fp8"] if store_dtype == "fp8" else []
    if settings["shard_bytes"]:
        extra += ["--shard-bytes", str(settings["shard_bytes"])]
    log = work / f"{out.name}.log"
    rows = config.max_step_rows
    states = [torch.randn(rows, settings["hidden"], dtype=torch.bfloat16, device=settings["device"])] * 4
    producer: Producer | None = None
    with log.open("wb") as stderr:
        if head_start is not None:  # warm: the consumer first, as extract starts it with the model's load
            consumer = subprocess.Popen(consume_command(endpoint, out, "--exit-on-eos", *extra), stderr=stderr)
            time.sleep(head_start)
            origin = time.monotonic()
            producer = _producer(config)
        else:
            producer = _producer(config)
            origin = time.monotonic()
            consumer = subprocess.Popen(consume_command(endpoint, out, "--exit-on-eos", *extra), stderr=stderr)
    try:
        deadline = origin + 300
        while not producer.attached:
            if consumer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the consumer never attached: {log.read_text()[-2000:]}")
            producer.poll()
            time.sleep(0.002)
        attach = time.monotonic() - origin
        for step in range(SLOTS + 1):  # the last one waits for the first slot the consumer gives back
            producer.capture_step(states, [f"r{step}"], [rows], np.arange(rows), np.arange(rows))
        first_rows = time.monotonic() - origin
        for step in range(SLOTS + 1):
            producer.finish_request(f"r{step}", num_tokens=rows)
        producer.close()
        producer = None
        if consumer.wait(120) != 0:
            raise RuntimeError(f"the consumer exited with {consumer.returncode}: {log.read_text()[-2000:]}")
    finally:
        if producer is not None:
            producer.close()
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    begun = RUN_BEGIN.search(log.read_text())
    shutil.rmtree(out, ignore_errors=True)
    return {"attach_s": attach, "first_rows_s": first_rows, "run_begin_s": float(begun.group(1)) if begun else -1.0}


def _producer(config: CaptureConfig) -> Producer:
    return Producer(
        config, tensor_descriptions=describe(LAYERS, True, NUM_LAYERS), meta={"engine": "consumer-start bench"}
    )


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "all": [round(v, 3) for v in values],
    }


def host(settings: dict[str, Any]) -> tuple[dict[str, Any], str]:
    device: dict[str, Any] = {"kind": "cpu", "name": f"CPU ({os.cpu_count()} cores)"}
    if settings["device"] == "cuda":
        gpu = torch.cuda.get_device_name(0)
        device = {"kind": "cuda", "name": gpu}
        return device, re.sub(r"[^a-z0-9]", "", gpu.split()[-1].lower()) or "gpu"
    if torch.cuda.is_available():
        device["host_gpu"] = torch.cuda.get_device_name(0)
    return device, "cpu"


VARIANTS = [(mode, dtype) for mode in ("cold", "warm") for dtype in ("bf16", "fp8")]


def run(args: argparse.Namespace, checkpoint: Callable[[Outcome], None]) -> Outcome:
    settings = resolve(args)
    device, tag = host(settings)
    name = f"consumer-start-tiny-{tag}" if settings["tiny"] else f"consumer-start-{tag}"
    outcome = Outcome(name=name, device=device, settings=settings, results={})
    work = Path(tempfile.mkdtemp(prefix="hscapture-consumer-start-", dir=args.work_dir))
    raw: dict[str, list[dict[str, float]]] = {f"{mode}-{dtype}": [] for mode, dtype in VARIANTS}
    imports: list[float] = []
    try:
        for repeat in range(settings["repeats"]):
            imports.append(measure_imports())
            for mode, dtype in VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]:
                print(f"[consumer-start] repeat {repeat + 1}: {mode} {dtype} ...", flush=True)
                head = settings["head_start_s"] if mode == "warm" else None
                raw[f"{mode}-{dtype}"].append(start_once(work, settings, dtype, head))
            outcome.results = _results(raw, imports)
            checkpoint(outcome)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    goal = GOALS["gpu" if settings["device"] == "cuda" else "cpu"]
    value = outcome.results["cold-bf16"]["attach_s"]["median"]
    outcome.goals = {
        "cold_attach_s": {
            "target": f"<= {goal}",
            "value": value,
            "met": value <= goal,
            "note": f"launch to attach, bf16 store, median of {settings['repeats']}",
        }
    }
    return outcome


def _results(raw: dict[str, list[dict[str, float]]], imports: list[float]) -> dict[str, Any]:
    results: dict[str, Any] = {"imports_s": _summary(imports)}
    for variant, runs in raw.items():
        if runs:
            results[variant] = {
                key: _summary([r[key] for r in runs]) for key in ("attach_s", "first_rows_s", "run_begin_s")
            }
    return results


def table(record: dict[str, Any]) -> str:
    results, settings = record["results"], record["settings"]
    lines = [
        "| variant | store | attach (s) | first rows (s) | of which: run begin (s) |",
        "|---|---|---:|---:|---:|",
    ]
    for mode, dtype in VARIANTS:
        entry = results.get(f"{mode}-{dtype}")
        if entry is None:
            continue
        lines.append(
            f"| {mode} | {dtype} | **{entry['attach_s']['median']:.2f}** ({entry['attach_s']['min']:.2f}–"
            f"{entry['attach_s']['max']:.2f}) | {entry['first_rows_s']['median']:.2f} | "
            f"{entry['run_begin_s']['median']:.2f} |"
        )
    imports = results["imports_s"]
    lines.append(
        f"\n`cold`: launch of `hscapture consume` to the producer's attach (and to the ring's first slot given back), "
        f"the producer up first; `warm`: the same counted from the producer's creation, the consumer launched "
        f"{settings['head_start_s']:g} s before (as `extract` does with the model's load). An interpreter importing "
        f"what `consume` imports: {imports['median']:.2f} s ({imports['min']:.2f}–{imports['max']:.2f}). Run begin: "
        f"the consumer's own figure for opening the ring and beginning its store's run. Medians of "
        f"{settings['repeats']} starts; {(len(LAYERS) + 1)} tensors x hidden {settings['hidden']} bf16, "
        f"{settings['cores']} usable cores."
    )
    for goal, entry in record.get("goals", {}).items():
        lines.append(f"\nGoal `{goal}` {entry['target']}: {entry['value']} ({'met' if entry['met'] else 'missed'}).")
    return "\n".join(lines)


def tok_per_s(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {}  # no throughput here: the table is the record


SUITE = SuiteSpec(
    name="consumer-start",
    description="hscapture consume's start-up: launch to a producer's attach and to its first rows, cold and warm",
    add_arguments=add_arguments,
    run=run,
    table=table,
    tok_per_s=tok_per_s,
)
