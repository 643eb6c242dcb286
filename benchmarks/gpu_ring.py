"""GPU ring benchmarks: drain rate, producer host time, ring-write kernel, compute slowdown; one run.

    python benchmarks/gpu_ring.py [--out benchmarks/results/gpu-ring-h200.json] [--quick]

(``--quick`` writes ``gpu-ring-h200-quick.json`` unless ``--out`` is given; ``--sections`` reruns a part.)

Why these four numbers. The CUDA ring exists to move hidden states off the GPU without costing
the engine anything, so each claim gets a measurement beside the thing it is compared with:

1. **Drain rate vs plain pinned D2H.** The ceiling for getting bytes off the GPU is one stream of
   ``cudaMemcpyAsync`` into pinned host memory. hscapture adds a producer (D2D copy into a slot,
   IPC event, ZeroMQ announce), a consumer process (wait on the event, DMA into pinned memory,
   release) and a credit loop between them. If that machinery keeps the copy engine busy, the
   ratio is close to 1; the goal is >= 0.90. Baseline and hscapture repeats are interleaved, so
   drift hits both alike; each hscapture repeat has its own producer/consumer pair, primed and
   warmed before the clock starts, and ends when ``Producer.close`` returns (every slot released).
2. **Producer host time per step.** The engine thread pays this on every forward step. It is
   timed around ``capture_step`` alone (no synchronize inside), and around ``plan()`` +
   ``commit()`` for the CUDA-graph path (the write itself is in the graph).
3. **Ring-write kernel vs fallback.** ``GraphRingWriter`` has a fused NVRTC kernel and an
   ``index_copy_`` fallback; this says which one a graph should carry. ``us_per_replay`` times
   1000 replays of a graph holding one write (queued behind a GPU sleep so launches do not gate
   it); ``us_per_write_unrolled`` times a graph of 50 writes, which is launch-free GPU time.
4. **Matmul slowdown while draining.** The DMA drain shares HBM and PCIe with the engine's
   compute. A separate process (this script with ``--drain-worker``) runs a block-mode producer
   and its ``--discard`` consumer flat out while this process times bf16 8192^3 matmuls. Two
   worker modes: ``capture`` (the full ``capture_step`` path, per the goal; its D2D slot writes
   run in another CUDA context, where they may time-slice with the matmul, unlike in a real
   engine) and ``announce`` (slots announced without being rewritten: the DMA drain alone).
   Goal < 1 %.

Everything is written to one JSON (command, commit, versions, GPU, settings, results, goals) and
printed as Markdown tables. A section that fails is recorded as an error; the others still run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/gpu_ring.py` puts benchmarks/ first, not the repo
    sys.path.insert(0, str(ROOT))

from hscapture import CaptureConfig, Producer  # noqa: E402
from hscapture.config import Policy  # noqa: E402
from hscapture.producer.graph import GraphRingWriter  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MiB = 1 << 20
GiB = 1 << 30
DTYPE = torch.bfloat16
ITEMSIZE = 2
#: Captured tensors: aux layers 0, 1, 2 plus the post-norm last state, as EAGLE-3 takes them.
LAYERS = (0, 1, 2)
NUM_LAYERS = 8
TENSORS = len(LAYERS) + 1
DESCRIPTIONS = [f"synthetic random bf16 rows standing in for layer {k}" for k in LAYERS] + [
    "synthetic random bf16 rows standing in for the post-norm last hidden state"
]
#: Slots of the drain ring (section 1 and the drain worker).
DRAIN_SLOTS = 16
#: Slots of the host-time ring (section 2): room for a 4096-row step plus graph scratch slots.
HOST_SLOTS = 32
HOST_HIDDEN = (4096, 7168)
HOST_ROWS = (1, 64, 4096)
KERNEL_HIDDEN = (4096, 7168)
KERNEL_BATCH = (64, 256)
#: Writes per graph for the launch-free kernel timing.
UNROLL = 50
MATMUL_N = 8192
#: An upper bound on the SM clock (H200: 1.98 GHz), to turn seconds into torch.cuda._sleep cycles.
SLEEP_HZ = 2.0e9
IDS = ["r"]

_children: list[subprocess.Popen[Any]] = []
_endpoints: list[str] = []


# ---------------------------------------------------------------------------------------------- processes


def child_env() -> dict[str, str]:
    """os.environ as is, with the repo root on PYTHONPATH so ``python -m hscapture`` resolves."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in parts:
        parts.insert(0, str(ROOT))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def endpoint(name: str) -> str:
    ep = f"ipc:///tmp/hscapture-{os.getuid()}/bench-{name}-{os.getpid()}"
    _endpoints.append(ep)
    return ep


def remove_endpoints() -> None:
    """Unlink the ipc socket files of this process's endpoints (ZeroMQ leaves them behind)."""
    for ep in _endpoints:
        for role in ("announce", "release"):
            Path(f"{ep.removeprefix('ipc://')}-{role}").unlink(missing_ok=True)


def start_consumer(ep: str, stdout: int | None = None) -> subprocess.Popen[bytes]:
    """``hscapture consume --discard`` on ``ep``; it also exits if this process dies (--watch-pid)."""
    command = [sys.executable, "-m", "hscapture", "consume", "--endpoint", ep, "--discard", "--exit-on-eos"]
    command += ["--quiet", "--watch-pid", str(os.getpid())]
    proc = subprocess.Popen(command, env=child_env(), cwd=ROOT, stdout=stdout)
    _children.append(proc)
    return proc


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def stop_children() -> None:
    for proc in reversed(_children):
        try:
            stop_process(proc)
        except Exception as exc:  # teardown: keep stopping the others
            print(f"could not stop pid {proc.pid}: {exc}", file=sys.stderr)


def finish_consumer(proc: subprocess.Popen[Any], timeout_s: float = 60.0) -> int | None:
    """Wait for a consumer that got its end of stream; stop it if it does not exit."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        return None


# ---------------------------------------------------------------------------------------------- producers


def make_config(ep: str, hidden: int, policy: Policy, slot_bytes: int, num_slots: int, max_rows: int) -> CaptureConfig:
    return CaptureConfig(
        layers=LAYERS,
        capture_last=True,
        hidden_size=hidden,
        num_layers=NUM_LAYERS,
        dtype="bfloat16",
        device="cuda",
        slot_bytes=slot_bytes,
        ring_bytes=num_slots * slot_bytes,
        max_step_rows=max_rows,
        policy=policy,
        endpoint=ep,
        block_timeout_s=30.0,
    )


def make_producer(config: CaptureConfig) -> Producer:
    return Producer(config, tensor_descriptions=DESCRIPTIONS, meta={"engine": "benchmarks/gpu_ring.py"})


def rows_per_slot(hidden: int, slot_bytes: int) -> int:
    return slot_bytes // (TENSORS * hidden * ITEMSIZE)


def random_states(rows: int, hidden: int) -> list[torch.Tensor]:
    return [torch.randn(rows, hidden, device="cuda", dtype=DTYPE) for _ in range(TENSORS)]


def row_meta(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Host int64 positions and token ids: metadata never comes from the GPU (that would sync)."""
    return np.arange(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)


def _check_consumer(consumer: subprocess.Popen[Any] | None, what: str) -> None:
    if consumer is not None and consumer.poll() is not None:
        raise RuntimeError(f"consumer exited with code {consumer.returncode} while {what}; see its stderr above")


def attach(producer: Producer, consumer: subprocess.Popen[Any], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not producer.attached:
        _check_consumer(consumer, "attaching")
        if time.monotonic() > deadline:
            raise RuntimeError(f"consumer did not attach to {producer.config.endpoint} within {timeout_s:.0f} s")
        producer.poll()
        time.sleep(0.005)


def wait_released(producer: Producer, consumer: subprocess.Popen[Any] | None, timeout_s: float = 60.0) -> None:
    """Serve releases until no slot is in flight.

    Reads ``Producer._in_flight``: the producer has no public "all released" query, and close()
    (the only public wait) ends the run.
    """
    deadline = time.monotonic() + timeout_s
    while producer._in_flight:
        _check_consumer(consumer, "draining")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(producer._in_flight)} slots still in flight after {timeout_s:.0f} s")
        producer.poll()
        time.sleep(50e-6)


def prime(producer: Producer, consumer: subprocess.Popen[Any], states: Sequence[torch.Tensor], rows: int) -> None:
    """Attach, then one step all the way round: the consumer has opened the ring and its CUDA context."""
    attach(producer, consumer)
    positions, tokens = row_meta(rows)
    producer.capture_step(states, IDS, [rows], positions, tokens)
    torch.cuda.synchronize()
    wait_released(producer, consumer, timeout_s=120.0)


# ---------------------------------------------------------------------------------------------- helpers


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def git(*args: str) -> str:
    try:
        result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def machine() -> dict[str, Any]:
    import cupy

    try:
        driver = int(cupy.cuda.runtime.driverGetVersion())
    except Exception:
        driver = None
    props = torch.cuda.get_device_properties(0)
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cupy": cupy.__version__,
        "cuda_driver": driver,
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": round(props.total_memory / GiB, 1),
        "gpu_count": torch.cuda.device_count(),
    }


def report_error(exc: Exception) -> None:
    """A ValueError is a planned refusal (one line); anything else gets its traceback."""
    if isinstance(exc, ValueError):
        print(f"[gpu_ring] {type(exc).__name__}: {exc}", file=sys.stderr)
    else:
        traceback.print_exception(exc)


def safe_machine() -> dict[str, Any]:
    try:
        return machine()
    except Exception as exc:  # never lose the results for want of a version string
        return {"error": f"{type(exc).__name__}: {exc}", "platform": platform.platform(), "torch": torch.__version__}


def gpu_sleep(seconds: float) -> None:
    """Keep the stream busy so that work queued next starts back to back (no launch gaps)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None and seconds > 0:
        sleep(int(seconds * SLEEP_HZ))


# ---------------------------------------------------------------------------------------------- 1. drain


def bench_drain(args: argparse.Namespace) -> dict[str, Any]:
    """Plain pinned D2H vs the hscapture drain, interleaved repeat by repeat."""
    slot = args.slot_mib * MiB
    hidden = 4096
    rows = rows_per_slot(hidden, slot)
    step_bytes = rows * TENSORS * hidden * ITEMSIZE
    steps = max(1, round(args.gib * GiB / step_bytes))
    total = steps * step_bytes
    warm_steps = 2 * DRAIN_SLOTS
    states = random_states(rows, hidden)
    positions, tokens = row_meta(rows)

    # Baseline: the same bytes, the same chunk size, one stream, into one reused pinned buffer of a
    # slot (the --discard consumer reuses one pinned slot buffer too), sources cycling over a ring.
    src = torch.randint(0, 256, (DRAIN_SLOTS * slot,), dtype=torch.uint8, device="cuda")
    chunks = [src[i * slot : i * slot + step_bytes] for i in range(DRAIN_SLOTS)]
    dst = torch.empty(step_bytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()

    def baseline() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            start.record()
            for i in range(steps):
                dst.copy_(chunks[i % DRAIN_SLOTS], non_blocking=True)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    # One producer/consumer pair per repeat (the consumer exits at end of stream), all started
    # and primed before any timing so process start-up and CUDA context creation are excluded.
    pairs: list[tuple[Producer, subprocess.Popen[bytes]]] = []
    try:
        for r in range(args.repeats):
            config = make_config(endpoint(f"drain{r}"), hidden, "block", slot, DRAIN_SLOTS, rows)
            consumer = start_consumer(config.endpoint)
            pairs.append((make_producer(config), consumer))
        for producer, consumer in pairs:
            prime(producer, consumer, states, rows)

        baseline()  # warm-up, not recorded
        base_s: list[float] = []
        ring_s: list[float] = []
        released_s: list[float] = []
        runs: list[dict[str, Any]] = []
        for producer, consumer in pairs:
            base_s.append(baseline())
            for _ in range(warm_steps):
                producer.capture_step(states, IDS, [rows], positions, tokens)
            torch.cuda.synchronize()
            wait_released(producer, consumer)
            announced = producer.counters.chunks_announced
            started = time.perf_counter()
            for _ in range(steps):
                producer.capture_step(states, IDS, [rows], positions, tokens)
            wait_released(producer, consumer)
            released = time.perf_counter()
            counters = producer.close(timeout_s=120.0)
            closed = time.perf_counter()
            ring_s.append(closed - started)
            released_s.append(released - started)
            runs.append(
                {
                    "seconds": round(closed - started, 5),
                    "chunks_timed": counters.chunks_announced - announced,
                    "rows_dropped": counters.rows_dropped,
                    "credit_waits": counters.credit_waits,
                    "all_released": not producer._in_flight,
                    "consumer_exit": finish_consumer(consumer),
                }
            )
    finally:
        for producer, _ in pairs:
            producer.close(timeout_s=10.0)

    base_gbps = [total / s / 1e9 for s in base_s]
    ring_gbps = [total / s / 1e9 for s in ring_s]
    ratio = median(ring_gbps) / median(base_gbps)
    return {
        "bytes_per_repeat": total,
        "gib_per_repeat": round(total / GiB, 3),
        "slot_bytes": slot,
        "rows_per_slot": rows,
        "ring_slots": DRAIN_SLOTS,
        "steps_per_repeat": steps,
        "warmup_steps_per_repeat": warm_steps,
        "repeats": args.repeats,
        "baseline_pinned_d2h": {
            "gbps": round(median(base_gbps), 2),
            "gbps_repeats": [round(x, 2) for x in base_gbps],
        },
        "hscapture": {
            "gbps": round(median(ring_gbps), 2),
            "gbps_repeats": [round(x, 2) for x in ring_gbps],
            "gbps_to_last_release": round(median([total / s / 1e9 for s in released_s]), 2),
            "runs": runs,
        },
        "ratio": round(ratio, 4),
        "note": "GB/s = 1e9 bytes/s; hscapture time runs from the first timed capture_step to close() returning "
        "(every slot released, ring freed); baseline times one stream of slot-sized D2H copies with CUDA events",
    }


# ---------------------------------------------------------------------------------------------- 2. host time


def capture_write_graph(writer: GraphRingWriter, states: Sequence[torch.Tensor], inner: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph holding only ``inner`` calls of ``writer.write(states)`` (plan() must come first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch's graph docs ask
        for _ in range(3):
            writer.write(states)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            writer.write(states)
    torch.cuda.synchronize()
    return graph


def run_timed(
    step: Callable[[], int],
    producer: Producer,
    consumer: subprocess.Popen[Any],
    calls: int,
    warmup: int,
    interval: int,
) -> tuple[list[float], int]:
    """Host microseconds of ``calls`` steps after ``warmup``, and rows dropped in the timed calls.

    Every ``interval`` calls (never inside a timed call): synchronize, let the consumer release
    everything, sleep briefly. ``interval`` is at most 16 and small enough that the steps in
    between fit the free slots, so under ``drop`` nothing needs to be dropped.
    """
    samples: list[float] = []
    dropped_before = producer.counters.rows_dropped
    for i in range(warmup + calls):
        if i % interval == 0:
            torch.cuda.synchronize()
            wait_released(producer, consumer)
            time.sleep(0.001)
        if i == warmup:
            dropped_before = producer.counters.rows_dropped
        ns = step()
        if i >= warmup:
            samples.append(ns / 1e3)
    torch.cuda.synchronize()
    wait_released(producer, consumer)
    return samples, producer.counters.rows_dropped - dropped_before


def capture_timer(
    producer: Producer, states: Sequence[torch.Tensor], rows: int, positions: np.ndarray, tokens: np.ndarray
) -> Callable[[], int]:
    """One ``capture_step`` per call; returns its host nanoseconds."""
    counts = [rows]

    def step() -> int:
        started = time.perf_counter_ns()
        producer.capture_step(states, IDS, counts, positions, tokens)
        return time.perf_counter_ns() - started

    return step


def graph_timer(
    writer: GraphRingWriter,
    graph: torch.cuda.CUDAGraph,
    rows: int,
    positions: np.ndarray,
    tokens: np.ndarray,
    replay_us: list[float],
) -> Callable[[], int]:
    """plan(); replay; commit() per call; returns the host nanoseconds of plan() + commit()."""
    counts = [rows]

    def step() -> int:
        t0 = time.perf_counter_ns()
        writer.plan()
        t1 = time.perf_counter_ns()
        graph.replay()
        t2 = time.perf_counter_ns()
        writer.commit(rows, IDS, counts, positions, tokens)
        t3 = time.perf_counter_ns()
        replay_us.append((t2 - t1) / 1e3)
        return (t1 - t0) + (t3 - t2)

    return step


def summary(samples: Sequence[float]) -> dict[str, float]:
    return {
        "median_us": round(median(samples), 2),
        "p90_us": round(pct(samples, 90), 2),
        "min_us": round(min(samples), 2),
        "mean_us": round(float(np.mean(samples)), 2),
    }


def bench_host(args: argparse.Namespace) -> dict[str, Any]:
    """Host time of capture_step, and of plan()+commit() around a graph replay, under ``drop``."""
    slot = args.slot_mib * MiB
    rows_out: list[dict[str, Any]] = []
    for hidden in HOST_HIDDEN:
        per_slot = rows_per_slot(hidden, slot)
        max_rows = max(HOST_ROWS)
        num_slots = max(HOST_SLOTS, 2 * math.ceil(max_rows / per_slot) + 4)  # +4: graph writers' scratch slots
        config = make_config(endpoint(f"host{hidden}"), hidden, "drop", slot, num_slots, max_rows)
        consumer = start_consumer(config.endpoint)
        producer = make_producer(config)
        reserved = 0
        try:
            prime(producer, consumer, random_states(1, hidden), 1)
            for rows in HOST_ROWS:
                states = random_states(rows, hidden)
                positions, tokens = row_meta(rows)
                slots_per_step = math.ceil(rows / per_slot)
                interval = max(1, min(16, num_slots // slots_per_step))
                step = capture_timer(producer, states, rows, positions, tokens)
                samples, dropped = run_timed(step, producer, consumer, args.calls, args.warmup_calls, interval)
                rows_out.append(
                    {
                        "hidden": hidden,
                        "rows": rows,
                        "path": "capture_step",
                        "slots_per_step": slots_per_step,
                        "sync_every": interval,
                        **summary(samples),
                        "rows_dropped": dropped,
                    }
                )
            for rows in HOST_ROWS:
                if rows > per_slot:
                    for use_kernel in (True, False):
                        rows_out.append(
                            {
                                "hidden": hidden,
                                "rows": rows,
                                "path": f"graph plan+commit ({'kernel' if use_kernel else 'index_copy_'})",
                                "skipped": f"batch_rows {rows} > {per_slot} rows per slot; graphs are for "
                                "decode batches that fit one slot",
                            }
                        )
                    continue
                states = random_states(rows, hidden)
                positions, tokens = row_meta(rows)
                counts = [rows]
                for use_kernel in (True, False):
                    name = f"graph plan+commit ({'kernel' if use_kernel else 'index_copy_'})"
                    reserved += 1  # the writer takes a scratch slot for good, even if it then fails
                    try:
                        writer = GraphRingWriter(producer, batch_rows=rows, use_kernel=use_kernel)
                        writer.plan()
                        graph = capture_write_graph(writer, states, 1)
                        writer.commit(rows, IDS, counts, positions, tokens)  # the warm-up writes go out as one chunk
                        replay_us: list[float] = []
                        graph_step = graph_timer(writer, graph, rows, positions, tokens, replay_us)
                        interval = max(1, min(16, num_slots - reserved))
                        samples, dropped = run_timed(
                            graph_step, producer, consumer, args.calls, args.warmup_calls, interval
                        )
                    except Exception as exc:  # e.g. use_kernel=True where NVRTC cannot compile: record, go on
                        report_error(exc)
                        rows_out.append(
                            {"hidden": hidden, "rows": rows, "path": name, "error": f"{type(exc).__name__}: {exc}"}
                        )
                        continue
                    rows_out.append(
                        {
                            "hidden": hidden,
                            "rows": rows,
                            "path": name,
                            "uses_kernel": writer.uses_kernel,
                            "sync_every": interval,
                            **summary(samples),
                            "replay_launch_median_us": round(median(replay_us[args.warmup_calls :]), 2),
                            "rows_dropped": dropped,
                        }
                    )
                    del graph
        finally:
            producer.close(timeout_s=60.0)
            finish_consumer(consumer)
    return {
        "policy": "drop",
        "tensors": TENSORS,
        "dtype": "bfloat16",
        "slot_bytes": slot,
        "calls": args.calls,
        "warmup_calls": args.warmup_calls,
        "rows": rows_out,
        "note": "host wall time (perf_counter_ns) of each call, no synchronize inside; graph rows time plan() + "
        "commit() only (replay launch reported apart); synchronize + release wait + 1 ms sleep every sync_every "
        "calls, untimed",
    }


# ---------------------------------------------------------------------------------------------- 3. kernel


def time_replays(graph: torch.cuda.CUDAGraph, replays: int, repeats: int) -> tuple[float, float]:
    """Median GPU and host microseconds per replay over ``repeats`` batches of ``replays`` replays.

    Each batch is queued behind a GPU sleep longer than its launches take, so the replays run
    back to back and the events time the GPU, not the host's launch rate.
    """
    started = time.perf_counter()
    for _ in range(replays):  # warm-up, and the launch-time estimate for the sleep
        graph.replay()
    launch_s = time.perf_counter() - started
    torch.cuda.synchronize()
    gpu: list[float] = []
    host: list[float] = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gpu_sleep(min(0.5, 1.5 * launch_s + 0.002))
        start.record()
        h0 = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        h1 = time.perf_counter()
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3 / replays)
        host.append((h1 - h0) * 1e6 / replays)
    return median(gpu), median(host)


def bench_kernel(args: argparse.Namespace) -> dict[str, Any]:
    """GPU time of the graph-captured ring write: fused NVRTC kernel vs index_copy_ fallback."""
    slot = args.slot_mib * MiB
    rows_out: list[dict[str, Any]] = []
    for hidden in KERNEL_HIDDEN:
        for batch in KERNEL_BATCH:
            states = random_states(batch, hidden)
            row: dict[str, Any] = {
                "hidden": hidden,
                "batch_rows": batch,
                "bytes_per_write": batch * TENSORS * hidden * ITEMSIZE,
            }
            for use_kernel in (True, False):
                key = "kernel" if use_kernel else "fallback"
                ep = endpoint(f"kernel{hidden}-{batch}-{key}")
                # No consumer: under drop, plan() hands out the reserved scratch slot every time.
                # max_step_rows capped so the config is valid; GraphRingWriter says if a batch cannot fit a slot.
                config = make_config(ep, hidden, "drop", slot, 2, min(batch, rows_per_slot(hidden, slot)))
                producer = make_producer(config)
                try:
                    writer = GraphRingWriter(producer, batch_rows=batch, use_kernel=use_kernel)
                    target = writer.plan()
                    single = capture_write_graph(writer, states, 1)
                    unrolled = capture_write_graph(writer, states, UNROLL)
                    gpu_us, host_us = time_replays(single, args.replays, args.repeats)
                    unrolled_us, _ = time_replays(unrolled, max(1, args.replays // UNROLL), args.repeats)
                    written = producer.ring.slot(target).view(DTYPE)[: TENSORS * batch * hidden]
                    written = written.view(TENSORS, batch, hidden)
                    exact = all(torch.equal(written[t], states[t]) for t in range(TENSORS))
                    row[key] = {
                        "uses_kernel": writer.uses_kernel,
                        "us_per_replay": round(gpu_us, 3),
                        "host_launch_us_per_replay": round(host_us, 3),
                        "us_per_write_unrolled": round(unrolled_us / UNROLL, 3),
                        "gbps_unrolled": round(row["bytes_per_write"] * UNROLL / unrolled_us / 1e3, 1),
                        "bitwise_ok": exact,
                    }
                    del single, unrolled, written
                except Exception as exc:  # e.g. use_kernel=True where NVRTC cannot compile: record, go on
                    report_error(exc)
                    row[key] = {"error": f"{type(exc).__name__}: {exc}"}
                finally:
                    producer.close(timeout_s=5.0)
            kernel, fallback = row.get("kernel", {}), row.get("fallback", {})
            for metric, label in (("us_per_replay", "winner"), ("us_per_write_unrolled", "winner_unrolled")):
                if metric in kernel and metric in fallback:
                    row[label] = "kernel" if kernel[metric] < fallback[metric] else "fallback"
            rows_out.append(row)
    return {
        "tensors": TENSORS,
        "dtype": "bfloat16",
        "replays": args.replays,
        "repeats": args.repeats,
        "unroll": UNROLL,
        "rows": rows_out,
        "note": "us_per_replay: CUDA events around `replays` replays of a graph holding one write, queued behind "
        "torch.cuda._sleep so launches do not gate them (compare host_launch_us_per_replay: if close, the figure "
        "is launch-bound); us_per_write_unrolled: a graph of `unroll` writes, event time / writes",
    }


# ---------------------------------------------------------------------------------------------- 4. matmul


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def wait_line(lines: queue.Queue[str | None], prefix: str, proc: subprocess.Popen[Any], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"drain worker printed no {prefix!r} line within {timeout_s:.0f} s")
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        if line is None:
            raise RuntimeError(f"drain worker exited (code {proc.wait()}) before printing {prefix!r}")
        if line.startswith(prefix):
            return line
        print(f"[drain worker] {line}", file=sys.stderr)


def bench_matmul(args: argparse.Namespace) -> dict[str, Any]:
    """bf16 matmul TFLOP/s alone and while another process drains a ring flat out."""
    n = MATMUL_N
    a = torch.randn(n, n, device="cuda", dtype=DTYPE)
    b = torch.randn(n, n, device="cuda", dtype=DTYPE)
    c = torch.empty(n, n, device="cuda", dtype=DTYPE)
    count = args.matmuls
    flops = count * 2 * n**3

    def run() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            torch.mm(a, b, out=c)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    run()  # warm-up: cuBLAS handle, heuristics, clocks
    alone_before = [run() for _ in range(args.repeats)]
    modes: dict[str, Any] = {}
    for mode in ("plain", "capture", "announce"):
        command = [sys.executable, str(Path(__file__).resolve()), "--drain-worker", "--seconds", "300"]
        command += ["--endpoint", endpoint(f"worker-{mode}"), "--worker-mode", mode, "--slot-mib", str(args.slot_mib)]
        worker = subprocess.Popen(command, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True, bufsize=1)
        _children.append(worker)
        assert worker.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(worker.stdout, lines), daemon=True).start()
        try:
            wait_line(lines, "ready", worker, timeout_s=180.0)
            run()  # warm-up under drain, not recorded
            during = [run() for _ in range(args.repeats)]
            worker.send_signal(signal.SIGTERM)  # the worker stops capturing, closes, prints its result
            result = json.loads(wait_line(lines, "result ", worker, timeout_s=120.0).removeprefix("result "))
            worker.wait(60)
            modes[mode] = {"seconds": during, "worker": result}
        except Exception as exc:  # one mode failing must not lose the other, nor the alone figures
            report_error(exc)
            modes[mode] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            stop_process(worker)
    try:
        modes["engine"] = matmul_in_engine(args, run)
    except Exception as exc:
        report_error(exc)
        modes["engine"] = {"error": f"{type(exc).__name__}: {exc}"}
    alone_after = [run() for _ in range(args.repeats)]
    alone = median(alone_before + alone_after)

    def tflops(seconds: float) -> float:
        return flops / seconds / 1e12

    out: dict[str, Any] = {
        "shape": [n, n, n],
        "dtype": "bfloat16",
        "matmuls_per_repeat": count,
        "repeats": args.repeats,
        "alone": {
            "tflops": round(tflops(alone), 1),
            "tflops_before": round(tflops(median(alone_before)), 1),
            "tflops_after": round(tflops(median(alone_after)), 1),
        },
    }
    for mode, data in modes.items():
        if "error" in data:
            out[f"during_{mode}"] = data
            continue
        during_s = median(data["seconds"])
        out[f"during_{mode}"] = {
            "tflops": round(tflops(during_s), 1),
            "slowdown_pct": round((during_s / alone - 1) * 100, 3),
            "tflops_repeats": [round(tflops(s), 1) for s in data["seconds"]],
            "drain_gbps": data["worker"]["gbps"],
            "worker": data["worker"],
        }
    out["note"] = (
        "alone = median of repeats before and after the drain runs; slowdown = time during / time alone - 1; "
        "during_capture: the worker calls capture_step (its D2D slot writes run in another CUDA context and "
        "may time-slice with the matmul); during_announce: slots announced without rewriting them (the DMA drain "
        "alone); during_engine: the real topology, matmul in the producer's own process while its consumer "
        "drains (the goal is held against this one); during_plain: control without hscapture, one process "
        "doing plain pinned D2H copies; "
        "drain_gbps: the worker's bytes from 'ready' to the end"
    )
    return out


def matmul_in_engine(args: argparse.Namespace, run: Callable[[], float]) -> dict[str, Any]:
    """The real topology: the matmul runs in the producer's own process (the engine), as a model
    forward would, and only the consumer is another process, draining by DMA.

    A thread of this process announces ring slots (each slot's event recorded on its own side
    stream) as fast as the consumer releases them, while the main thread times the matmuls.
    """
    slot = args.slot_mib * MiB
    rows = rows_per_slot(args.hidden, slot)
    step_bytes = rows * TENSORS * args.hidden * ITEMSIZE
    config = make_config(endpoint("engine"), args.hidden, "drop", slot, DRAIN_SLOTS, rows)
    consumer = start_consumer(config.endpoint)
    producer = make_producer(config)
    stop = threading.Event()
    announced = [0]

    def announce() -> None:
        positions, tokens = row_meta(rows)
        with torch.cuda.stream(torch.cuda.Stream()):
            while not stop.is_set():
                slot_index = producer.acquire_slot()
                if slot_index is None:
                    time.sleep(50e-6)
                    continue
                if producer.announce_written(slot_index, rows, 0, IDS, [rows], positions, tokens):
                    announced[0] += 1

    try:
        prime(producer, consumer, random_states(rows, args.hidden), rows)
        thread = threading.Thread(target=announce, name="announce", daemon=True)
        thread.start()
        time.sleep(0.2)  # the drain reaches steady state
        started, before = time.perf_counter(), announced[0]
        during = [run() for _ in range(args.repeats)]
        seconds, count = time.perf_counter() - started, announced[0] - before
        stop.set()
        thread.join(10)
        producer.close(timeout_s=30.0)
        return {
            "seconds": during,
            "worker": {"mode": "engine", "gbps": round(count * step_bytes / seconds / 1e9, 2), "slots": count},
        }
    finally:
        stop.set()
        producer.close(timeout_s=10.0)
        finish_consumer(consumer, 30.0)


def plain_drain_worker(args: argparse.Namespace, stopped: Callable[[], bool]) -> int:
    """Control: plain pinned D2H copies flat out in one process, no hscapture at all."""
    slot = args.slot_mib * MiB
    src = torch.randint(0, 255, (DRAIN_SLOTS, slot), dtype=torch.uint8, device="cuda")
    dst = torch.empty(slot, dtype=torch.uint8, pin_memory=True)
    for i in range(DRAIN_SLOTS):
        dst.copy_(src[i], non_blocking=True)
    torch.cuda.synchronize()
    print("ready", flush=True)
    started = time.perf_counter()
    deadline = started + args.seconds
    steps = 0
    while not stopped() and time.perf_counter() < deadline:
        dst.copy_(src[steps % DRAIN_SLOTS], non_blocking=True)
        steps += 1
        if steps % DRAIN_SLOTS == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    result = {"mode": "plain", "steps": steps, "bytes": steps * slot, "seconds": round(seconds, 4)}
    result["gbps"] = round(steps * slot / seconds / 1e9, 2)
    print("result " + json.dumps(result), flush=True)
    return 0


def drain_worker(args: argparse.Namespace) -> int:
    """A block-mode producer + its --discard consumer, capturing flat out until SIGTERM or --seconds."""
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if args.worker_mode == "plain":
        return plain_drain_worker(args, lambda: stopping)
    slot = args.slot_mib * MiB
    hidden = args.hidden
    rows = rows_per_slot(hidden, slot)
    step_bytes = rows * TENSORS * hidden * ITEMSIZE
    config = make_config(args.endpoint, hidden, "block", slot, DRAIN_SLOTS, rows)
    # stdout to /dev/null: the parent reads ours and must see EOF when we exit.
    consumer = start_consumer(config.endpoint, stdout=subprocess.DEVNULL)
    producer = make_producer(config)
    try:
        states = random_states(rows, hidden)
        positions, tokens = row_meta(rows)
        counts = [rows]
        prime(producer, consumer, states, rows)
        if args.worker_mode == "capture":

            def step() -> None:
                producer.capture_step(states, IDS, counts, positions, tokens)

        else:

            def step() -> None:
                slot_index = producer.acquire_slot()
                if slot_index is None:
                    raise RuntimeError("block policy returned no slot")
                producer.announce_written(slot_index, rows, 0, IDS, counts, positions, tokens)

        for _ in range(2 * DRAIN_SLOTS):
            step()
        torch.cuda.synchronize()
        wait_released(producer, consumer)
        print("ready", flush=True)
        started = time.perf_counter()
        deadline = started + args.seconds
        steps = 0
        while not stopping and time.perf_counter() < deadline:
            step()
            steps += 1
        counters = producer.close(timeout_s=60.0)
        seconds = time.perf_counter() - started
        result = {
            "mode": args.worker_mode,
            "steps": steps,
            "bytes": steps * step_bytes,
            "seconds": round(seconds, 4),
            "gbps": round(steps * step_bytes / seconds / 1e9, 2),
            "rows_dropped": counters.rows_dropped,
            "credit_waits": counters.credit_waits,
        }
        print("result " + json.dumps(result), flush=True)
        return 0
    finally:
        producer.close(timeout_s=10.0)
        finish_consumer(consumer, 30.0)
        stop_children()
        remove_endpoints()


# ---------------------------------------------------------------------------------------------- report


def _fmt(value: Any, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "—"


def print_tables(results: dict[str, Any], goals: dict[str, Any]) -> None:
    drain = results.get("drain", {})
    if "ratio" in drain:
        print(
            f"\n### Drain rate ({drain['gib_per_repeat']} GiB, slot {drain['slot_bytes'] >> 20} MiB, median of "
            f"{drain['repeats']})\n"
        )
        print("| path | GB/s | vs pinned D2H |\n|---|---:|---:|")
        print(f"| plain pinned D2H (one stream) | {drain['baseline_pinned_d2h']['gbps']:.2f} | 1.000 |")
        print(
            f"| hscapture ring (producer → consumer --discard) | {drain['hscapture']['gbps']:.2f} | "
            f"{drain['ratio']:.3f} |"
        )
    host = results.get("host_time", {})
    if "rows" in host:
        print("\n### Producer host time per step (drop policy, consumer attached)\n")
        print("| hidden | rows | path | median µs | p90 µs | rows dropped |\n|---:|---:|---|---:|---:|---:|")
        for r in host["rows"]:
            extra = r.get("skipped") or r.get("error")
            if extra:
                print(f"| {r['hidden']} | {r['rows']} | {r['path']} | — | — | {extra} |")
            else:
                print(
                    f"| {r['hidden']} | {r['rows']} | {r['path']} | {r['median_us']:.1f} | {r['p90_us']:.1f} | "
                    f"{r['rows_dropped']} |"
                )
    kernel = results.get("kernel_vs_fallback", {})
    if "rows" in kernel:
        print("\n### Graph ring write: fused kernel vs index_copy_ fallback (µs)\n")
        print(
            "| hidden | batch | kernel /replay | fallback /replay | kernel /write unrolled | "
            "fallback /write unrolled | winner (replay / unrolled) |\n|---:|---:|---:|---:|---:|---:|---|"
        )
        for r in kernel["rows"]:
            k, f = r.get("kernel", {}), r.get("fallback", {})
            print(
                f"| {r['hidden']} | {r['batch_rows']} | {_fmt(k.get('us_per_replay'), '.2f')} | "
                f"{_fmt(f.get('us_per_replay'), '.2f')} | {_fmt(k.get('us_per_write_unrolled'), '.2f')} | "
                f"{_fmt(f.get('us_per_write_unrolled'), '.2f')} | {r.get('winner', '—')} / "
                f"{r.get('winner_unrolled', '—')} |"
            )
        failures = [
            f"- hidden {r['hidden']} batch {r['batch_rows']} {key}: {r[key]['error']}"
            for r in kernel["rows"]
            for key in ("kernel", "fallback")
            if "error" in r.get(key, {})
        ]
        if failures:
            print("\n" + "\n".join(failures))
    mm = results.get("matmul", {})
    if "alone" in mm:
        print(f"\n### bf16 {MATMUL_N}³ matmul while another process drains\n")
        print("| condition | TFLOP/s | slowdown % | drain GB/s |\n|---|---:|---:|---:|")
        print(f"| alone | {mm['alone']['tflops']:.1f} | — | — |")
        for mode in ("plain", "engine", "capture", "announce"):
            d = mm.get(f"during_{mode}")
            if d and "error" in d:
                print(f"| during drain ({mode}) | — | — | {d['error']} |")
            elif d:
                print(
                    f"| during drain ({mode}) | {d['tflops']:.1f} | {d['slowdown_pct']:.2f} | {d['drain_gbps']:.2f} |"
                )
    errors = {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    if errors:
        print("\n### Errors\n")
        for name, error in errors.items():
            print(f"- {name}: {error}")
    print("\n### Goals\n\n| goal | target | value | met |\n|---|---|---:|---|")
    for name, goal in goals.items():
        print(f"| {name} | {goal['target']} | {_fmt(goal['value'], '.3f')} | {goal['met']} |")


def compute_goals(results: dict[str, Any]) -> dict[str, Any]:
    ratio = results.get("drain", {}).get("ratio")
    slowdown = results.get("matmul", {}).get("during_engine", {}).get("slowdown_pct")
    return {
        "drain_ratio_vs_pinned_d2h": {
            "target": ">= 0.90",
            "value": ratio,
            "met": None if ratio is None else bool(ratio >= 0.90),
        },
        "matmul_slowdown_pct_during_drain": {
            "target": "< 1",
            "value": slowdown,
            "met": None if slowdown is None else bool(slowdown < 1.0),
        },
    }


# ---------------------------------------------------------------------------------------------- main

SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "drain": bench_drain,
    "host_time": bench_host,
    "kernel_vs_fallback": bench_kernel,
    "matmul": bench_matmul,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON path (default results/gpu-ring-h200[-quick].json)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (< 2 minutes)")
    parser.add_argument("--gib", type=float, help="GiB per drain repeat (default 8, --quick 1)")
    parser.add_argument("--slot-mib", type=int, default=32, help="ring slot size in MiB (default 32)")
    parser.add_argument("--repeats", type=int, help="repeats per measurement (default 5, --quick 3)")
    parser.add_argument("--calls", type=int, help="timed calls per host-time case (default 200, --quick 100)")
    parser.add_argument("--warmup-calls", type=int, default=20, help="untimed calls first (default 20)")
    parser.add_argument("--replays", type=int, default=1000, help="graph replays per timing (default 1000)")
    parser.add_argument("--matmuls", type=int, help="matmuls per timing (default 50, --quick 20)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma list of: " + ", ".join(SECTIONS))
    worker = parser.add_argument_group("drain worker (internal: spawned by the matmul section)")
    worker.add_argument("--drain-worker", action="store_true", help=argparse.SUPPRESS)
    worker.add_argument("--seconds", type=float, default=10.0, help="worker: capture this long at most")
    worker.add_argument("--endpoint", help="worker: producer endpoint")
    worker.add_argument("--worker-mode", choices=("plain", "capture", "announce"), default="capture")
    worker.add_argument("--hidden", type=int, default=4096, help="worker: hidden size")
    args = parser.parse_args(argv)
    args.gib = args.gib if args.gib is not None else (1.0 if args.quick else 8.0)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    args.calls = args.calls if args.calls is not None else (100 if args.quick else 200)
    args.matmuls = args.matmuls if args.matmuls is not None else (20 if args.quick else 50)
    if args.out is None:
        args.out = RESULTS / ("gpu-ring-h200-quick.json" if args.quick else "gpu-ring-h200.json")
    if args.slot_mib < 1 or args.repeats < 1 or args.calls < 1 or args.replays < UNROLL:
        parser.error(f"--slot-mib, --repeats and --calls must be >= 1 and --replays >= {UNROLL}")
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from {list(SECTIONS)}")
    if args.drain_worker and not args.endpoint:
        parser.error("--drain-worker needs --endpoint")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_ring: no CUDA GPU visible; this benchmark needs one", file=sys.stderr)
        return 2
    if args.drain_worker:
        try:
            return drain_worker(args)
        finally:
            stop_children()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below on SIGTERM too
    torch.cuda.init()
    started = time.monotonic()
    results: dict[str, Any] = {}
    timings: dict[str, float] = {}
    failed = False
    try:
        for name in args.sections.split(","):
            t0 = time.monotonic()
            print(f"[gpu_ring] {name} ...", file=sys.stderr, flush=True)
            try:
                results[name] = SECTIONS[name](args)
            except Exception as exc:
                failed = True
                traceback.print_exc()
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                torch.cuda.synchronize()
                timings[name] = round(time.monotonic() - t0, 1)
    finally:
        stop_children()
        remove_endpoints()

    goals = compute_goals(results)
    record = {
        "benchmark": "gpu_ring",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "commit": git("rev-parse", "HEAD"),
        "dirty": git("status", "--porcelain") not in ("", "unknown"),
        "machine": safe_machine(),
        "device": "cuda",
        "settings": {
            "quick": args.quick,
            "gib_per_drain_repeat": args.gib,
            "slot_mib": args.slot_mib,
            "repeats": args.repeats,
            "calls": args.calls,
            "warmup_calls": args.warmup_calls,
            "replays": args.replays,
            "matmuls": args.matmuls,
            "layers": list(LAYERS),
            "capture_last": True,
            "tensors": TENSORS,
        },
        "results": results,
        "goals": goals,
        "section_seconds": timings,
        "total_seconds": round(time.monotonic() - started, 1),
        "note": "medians over repeats, warm-up excluded; GPU work timed with CUDA events or after synchronize",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print_tables(results, goals)
    print(f"\nwrote {args.out} ({record['total_seconds']} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
