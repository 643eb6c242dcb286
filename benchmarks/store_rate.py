"""The store against the disk: rows through the real path versus a raw write of the same bytes.

``python benchmarks/run.py store`` (any host; ``--device cuda`` drains a CUDA ring). Per repeat, in
rotating order, in one directory (``--work-dir``, default $TMPDIR):

* ``store``: a block-policy producer captures ``--gib`` of bf16 rows (Llama-8B-like: 4 tensors x
  hidden 4096, one request per ``--slot-mib`` slot) into its ring; a real ``hscapture consume``
  process copies them out and writes the store (shards written, fsync'd, renamed, indexed). Timed
  from the first ``capture_step`` until the index's ``run_end`` line.
* ``raw``: one file of the store's shard bytes written sequentially (64 MiB ``os.write`` calls)
  and fsync'd: the issue's baseline.
* ``raw_direct``: the same, opened with ``O_DIRECT`` from a page-aligned buffer (no page-cache copy:
  what the store's row planes now do), so the store is also compared with the fastest plain write.
* with ``--compare-consumer-args``: the store again, its consumer given those flags instead (e.g.
  ``--direct-io off``), so a change to the store is measured against the old behaviour in one run.

Reported: GB/s of shard bytes (1e9 B/s) for each and the ratios store / raw, store / raw_direct
(median over repeats), for rows
stored as captured (bf16) and as fp8 (half the bytes: quantized on the GPU before the copy out of
a CUDA ring, by the consumer's writer threads for a host ring). The issue's goal is store >= 0.9
of raw for both. Where the time goes, per repeat (``phases``): when the first and the last shard
line reached the index, when ``Producer.close`` returned (every slot released) and the
``run_end`` line; the raw write's ``os.write`` and ``fsync`` seconds. So a gap to raw shows as a
start (first shard late), a steady rate (between the first and the last shard line) or a tail.
With ``--device cuda`` a ``device_fp8`` section times the consumer's GPU quantization of one slot
beside a plain device copy and the copies to the host.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import gpu_ring
from benchmarks.report import Outcome, SuiteSpec
from hscapture import CaptureConfig, Producer
from hscapture.config import MiB
from hscapture.consumer import consume_command
from hscapture.consumer.device_fp8 import crc_kernel
from hscapture.fp8 import FP8, Quantizer, quantize_into
from hscapture.fp8_kernel import host_kernels
from hscapture.integrations.hf import describe
from hscapture.store.checksum import row_crcs
from hscapture.store.shards import DIRECT_ALIGN, page_aligned

GiB = 1 << 30
#: The goal: the store writes at this fraction of the raw disk rate or better.
GOAL = 0.9
LAYERS = (2, 16, 29)  # EAGLE-3's set for a 32-layer model, plus the post-norm last state
NUM_LAYERS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu (host ring) or cuda (CUDA ring drained by DMA)")
    parser.add_argument("--gib", type=float, default=2.0, help="GiB of captured rows per repeat (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each side (default 3)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    parser.add_argument("--slot-mib", type=int, default=4, help="ring slot MiB: rows per capture step (default 4)")
    parser.add_argument("--store-dtypes", default="bf16,fp8", help="comma list of bf16, fp8 (default both)")
    parser.add_argument(
        "--consumer-args", default="", help="extra `hscapture consume` flags, e.g. '--writer-threads 4'"
    )
    parser.add_argument("--work-dir", type=Path, help="where stores and raw files go (the disk measured)")
    parser.add_argument(
        "--compare-consumer-args", help="also measure the store with these consumer flags (e.g. '--direct-io off')"
    )


def measure(
    device: torch.device,
    work: Path,
    gib: float,
    repeats: int,
    hidden: int = 4096,
    slot_mib: int = 4,
    store_dtype: str | None = None,
    consumer_args: tuple[str, ...] = (),
    compare_args: tuple[str, ...] | None = None,
    layers: tuple[int, ...] = LAYERS,
    num_layers: int = NUM_LAYERS,
) -> dict[str, Any]:
    """Store rate against a raw sequential write + fsync of the same bytes in ``work`` (buffered, and
    with O_DIRECT), ``repeats`` each; with ``compare_args`` also the store with those consumer flags.
    ``layers`` (of a model of ``num_layers``) and the post-norm last state are the captured tensors.

    Repeats rotate the order of the sides so none always meets a warmer disk.
    """
    tensors = len(layers) + 1
    slot = slot_mib * MiB
    rows = slot // (tensors * hidden * 2)
    steps = max(1, math.ceil(gib * GiB / (rows * tensors * hidden * 2)))
    states = [torch.randn(rows, hidden, device=device).to(torch.bfloat16) for _ in range(tensors)]
    positions, tokens = np.arange(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
    store_s: list[float] = []
    raw_s: list[float] = []
    phases: list[dict[str, float]] = []
    raw_phases: list[dict[str, float]] = []
    direct_s: list[float] = []
    direct_phases: list[dict[str, float]] = []
    compare_s: list[float] = []
    compare_phases: list[dict[str, Any]] = []
    compare_bytes = 0
    shard_bytes = 0
    disk = filesystem_of(work)["device"]
    for repeat in range(repeats):

        def store_side(repeat: int = repeat) -> None:
            nonlocal shard_bytes
            seconds, shard_bytes, found = _store_side(work / f"store-{repeat}", consumer_args)
            store_s.append(seconds)
            phases.append(found)

        def compare_side(repeat: int = repeat) -> None:
            nonlocal compare_bytes
            assert compare_args is not None
            seconds, compare_bytes, found = _store_side(work / f"compare-{repeat}", compare_args)
            compare_s.append(seconds)
            compare_phases.append(found)

        def _store_side(out: Path, args: tuple[str, ...]) -> tuple[float, int, dict[str, Any]]:
            watch, cpu = DiskWatch(disk), CpuWatch()
            seconds, nbytes, timeline = _store_run(device, out, hidden, slot, rows, steps, states, positions, tokens,
                                                   store_dtype, args, watch, cpu, layers, num_layers)  # fmt: skip
            shutil.rmtree(out, ignore_errors=True)
            return seconds, nbytes, {**timeline, "disk": watch.summary(), "cpu": cpu.summary()}

        def raw_side(repeat: int = repeat, direct: bool = False) -> None:
            watch, cpu = DiskWatch(disk), CpuWatch()
            cpu.start()
            write_s, fsync_s = raw_write(
                work / f"raw-{repeat}.bin", shard_bytes or steps * rows * tensors * hidden * 2, watch, direct=direct
            )
            cpu.stop()
            (direct_s if direct else raw_s).append(write_s + fsync_s)
            found = {"write_s": round(write_s, 3), "fsync_s": round(fsync_s, 3), "disk": watch.summary()}
            (direct_phases if direct else raw_phases).append({**found, "cpu": cpu.summary()})

        sides: list[Callable[[], None]] = [store_side, raw_side, lambda repeat=repeat: raw_side(repeat, direct=True)]
        sides += [compare_side] if compare_args is not None else []
        turn = repeat % len(sides)
        for side in sides[turn:] + sides[:turn]:
            side()
    captured = steps * rows * tensors * hidden * 2
    store_gbps = shard_bytes / statistics.median(store_s) / 1e9
    raw_gbps = shard_bytes / statistics.median(raw_s) / 1e9
    direct_gbps = shard_bytes / statistics.median(direct_s) / 1e9
    compared: dict[str, Any] = {}
    if compare_args is not None:
        compare_gbps = compare_bytes / statistics.median(compare_s) / 1e9
        compared = {
            "compare": {
                "consumer_args": " ".join(compare_args),
                "store_gbps": round(compare_gbps, 3),
                "ratio": round(compare_gbps / raw_gbps, 4),
                "ratio_to_direct": round(compare_gbps / direct_gbps, 4),
                "store_seconds": [round(x, 3) for x in compare_s],
                "store_phases": compare_phases,
            }
        }
    return {
        "stored_as": "fp8" if store_dtype else "bf16",
        "tensors": tensors,
        "captured_bytes": captured,
        "bytes_per_repeat": shard_bytes,
        "repeats": repeats,
        "directory": str(work),
        "filesystem": filesystem_of(work),
        "rows_in_gbps": round(captured / statistics.median(store_s) / 1e9, 3),
        "store_gbps": round(store_gbps, 3),
        "raw_write_gbps": round(raw_gbps, 3),
        "raw_direct_gbps": round(direct_gbps, 3),
        "ratio": round(store_gbps / raw_gbps, 4),
        "ratio_to_direct": round(store_gbps / direct_gbps, 4),
        "store_seconds": [round(x, 3) for x in store_s],
        "raw_seconds": [round(x, 3) for x in raw_s],
        "raw_direct_seconds": [round(x, 3) for x in direct_s],
        "store_phases": phases,
        "raw_phases": raw_phases,
        "raw_direct_phases": direct_phases,
        "store_steady_gbps": _median_of(phases, "steady_gbps"),
        **compared,
        "note": "GB/s = 1e9 bytes/s of shard files; store: first capture_step to the run_end line of its index "
        "(every shard fsync'd and indexed); raw: 64 MiB os.write calls then fsync, same directory, same bytes; "
        "raw_direct: the same with O_DIRECT from a page-aligned buffer (the unaligned tail through the cache). "
        "store_phases: attach_s = the consumer's start to attached (its shard buffers touched, its kernels "
        "compiled), then seconds from the first capture_step: first_shard / last_shard = its line in the index, "
        "producer_closed = Producer.close returned (every slot released), run_end; steady_gbps = shard bytes "
        "listed after the first shard line, over the time to the last one",
    }


def _median_of(phases: list[dict[str, float]], key: str) -> float | None:
    values = [p[key] for p in phases if p.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def _store_run(
    device: torch.device,
    out: Path,
    hidden: int,
    slot: int,
    rows: int,
    steps: int,
    states: list[torch.Tensor],
    positions: np.ndarray,
    tokens: np.ndarray,
    store_dtype: str | None,
    consumer_args: tuple[str, ...],
    watch: DiskWatch,
    cpu: CpuWatch,
    layers: tuple[int, ...] = LAYERS,
    num_layers: int = NUM_LAYERS,
) -> tuple[float, int, dict[str, float]]:
    """One capture into a fresh store; (seconds from the first step to the index's run_end, shard bytes, phases)."""
    config = CaptureConfig(
        layers=layers, hidden_size=hidden, num_layers=num_layers, device=device.type, slot_bytes=slot,
        ring_bytes=32 * slot, max_step_rows=rows, policy="block", endpoint=gpu_ring.endpoint(out.name),
        block_timeout_s=600.0,
    )  # fmt: skip
    options = ["--exit-on-eos", "--quiet", "--watch-pid", str(os.getpid()), *consumer_args]
    options += ["--store-dtype", store_dtype] if store_dtype else []
    spawned = time.perf_counter()
    consumer = subprocess.Popen(consume_command(config.endpoint, out, *options), env=gpu_ring.child_env())
    producer = Producer(config, tensor_descriptions=describe(layers, True, num_layers), meta={"engine": "store-rate"})
    try:
        gpu_ring.attach(producer, consumer, timeout_s=180.0)
        attach_s = time.perf_counter() - spawned
        watch.start()
        cpu.start(consumer.pid)
        started = time.perf_counter()
        shards = _ShardWatch(out / "index.jsonl", started)
        for step in range(steps):
            producer.capture_step(states, [f"rate-{step}"], [rows], positions, tokens)
            producer.finish_request(f"rate-{step}", "finished", num_tokens=rows)
        producer.close(timeout_s=600.0)
        closed = time.perf_counter() - started
        seconds = shards.wait_run_end(consumer)
        cpu.stop()
        shards.stop()
        watch.stop()
    finally:
        producer.close(timeout_s=10.0)
        gpu_ring.finish_consumer(consumer, timeout_s=120.0)
    timeline = {"attach_s": round(attach_s, 3), **shards.phases(closed, seconds)}
    return seconds, sum(p.stat().st_size for p in out.glob("shard-*.safetensors")), timeline


class _ShardWatch:
    """Notes when each shard line and the ``run_end`` line reach the index: a thread of this process
    looks every 2 ms whether the file grew (one ``stat``) and parses only the new lines, so the
    watching costs the store's cores next to nothing (reading the index on every look took ~20% of
    a core on the 2-core host)."""

    def __init__(self, index: Path, started: float) -> None:
        self.index, self.started = index, started
        self.listed: list[tuple[float, int]] = []  # (seconds since started, shard bytes)
        self.run_end: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = 0
        while True:
            stopping = self._stop.is_set()  # one last read after the stop: lines written with run_end count too
            try:
                grew = self.index.stat().st_size > seen
            except FileNotFoundError:
                grew = False
            if grew:
                with self.index.open("rb") as handle:
                    handle.seek(seen)
                    data = handle.read()
                now = time.perf_counter() - self.started
                complete = data[: data.rfind(b"\n") + 1]
                for line in complete.splitlines():
                    record = json.loads(line)
                    if record.get("type") == "shard":
                        self.listed.append((now, record["bytes"]))
                    elif record.get("type") == "run_end" and self.run_end is None:
                        self.run_end = now
                seen += len(complete)
            if stopping:
                return
            time.sleep(0.002)

    def wait_run_end(self, consumer: subprocess.Popen[Any], timeout_s: float = 600.0) -> float:
        """Seconds from the start to the index's ``run_end`` line (as this watch saw it)."""
        deadline = time.monotonic() + timeout_s
        while self.run_end is None:
            if consumer.poll() is not None and not self.index.exists():
                raise RuntimeError(f"consumer exited with {consumer.returncode} and wrote no index at {self.index}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.index}: no run_end line within {timeout_s:.0f} s")
            time.sleep(0.01)
        return self.run_end

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def phases(self, closed: float, run_end: float) -> dict[str, Any]:
        if not self.listed:
            return {"producer_closed": round(closed, 3), "run_end": round(run_end, 3)}
        first, last = self.listed[0][0], self.listed[-1][0]
        between = sum(nbytes for _, nbytes in self.listed[1:])
        return {
            "first_shard": round(first, 3),
            "producer_closed": round(closed, 3),
            "last_shard": round(last, 3),
            "run_end": round(run_end, 3),
            "shards": len(self.listed),
            "steady_gbps": round(between / (last - first) / 1e9, 3) if last > first else None,
        }


class DiskWatch:
    """What the block device under the work directory wrote while a side ran (``/proc/diskstats``,
    sampled every 20 ms on a thread): bytes, the share of the time it was busy, and GB/s per 100 ms,
    so a store slower than the raw write shows whether the disk sat idle (a start or a tail) or
    wrote slower (a shallow queue)."""

    def __init__(self, device: str) -> None:
        self.name = Path(device).name if device.startswith("/dev/") else ""
        self.samples: list[tuple[float, int, int]] = []  # (seconds, sectors written, ms busy)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> tuple[int, int] | None:
        try:
            for line in Path("/proc/diskstats").read_text().splitlines():
                fields = line.split()
                if fields[2] == self.name:
                    return int(fields[9]), int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
        return None

    def start(self) -> None:
        if self.name and self._read() is not None:
            self._started = time.perf_counter()
            self._thread = threading.Thread(target=self._run, name="disk-watch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            found = self._read()
            if found is not None:
                self.samples.append((time.perf_counter() - self._started, *found))
            if self._stop.wait(0.02):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        if len(self.samples) < 2:
            return {}
        (t0, s0, b0), (t1, s1, b1) = self.samples[0], self.samples[-1]
        per_100ms, at, sectors = [], t0, s0
        for t, s, _ in self.samples:
            if t - at >= 0.1:
                per_100ms.append(round((s - sectors) * 512 / (t - at) / 1e9, 2))
                at, sectors = t, s
        return {
            "device": self.name,
            "written_gb": round((s1 - s0) * 512 / 1e9, 3),
            "seconds": round(t1 - t0, 3),
            "busy": round((b1 - b0) / 1000 / max(t1 - t0, 1e-9), 3),
            "gbps_per_100ms": per_100ms,
        }


class CpuWatch:
    """Core-seconds spent while a side ran: the whole machine's busy time (``/proc/stat``: user, nice,
    system, irq, softirq; the kernel's writeback included, and anything else running), this thread's
    own (the producer, or the raw writer), and the consumer process's (``/proc/PID/stat``)."""

    def start(self, consumer_pid: int | None = None) -> None:
        self.pid = consumer_pid
        self._begin = (_machine_busy_s(), time.thread_time(), _process_cpu_s(consumer_pid))

    def stop(self) -> None:
        self._end = (_machine_busy_s(), time.thread_time(), _process_cpu_s(self.pid))

    def summary(self) -> dict[str, float]:
        (machine0, mine0, consumer0), (machine1, mine1, consumer1) = self._begin, self._end
        found = {"machine_busy_core_s": round(machine1 - machine0, 3), "this_thread_core_s": round(mine1 - mine0, 3)}
        if self.pid is not None:
            found["consumer_core_s"] = round(consumer1 - consumer0, 3)
        return found


def _machine_busy_s() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, _, _, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    stat = Path(f"/proc/{pid}/stat").read_text()
    utime, stime = stat[stat.rindex(")") + 2 :].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def raw_write(
    path: Path, nbytes: int, watch: DiskWatch, block: int = 64 * MiB, direct: bool = False
) -> tuple[float, float]:
    """Seconds to write ``nbytes`` of random bytes sequentially to ``path``, and then to fsync it; with
    ``direct``, its whole pages with O_DIRECT from a page-aligned buffer, the rest through the cache."""
    data = memoryview(page_aligned(lambda n: np.empty(n, dtype=np.uint8), min(block, nbytes)))
    data[:] = np.random.default_rng(1).integers(0, 256, len(data), dtype=np.uint8).data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
    try:
        watch.start()
        started = time.perf_counter()
        written = 0
        whole = nbytes // DIRECT_ALIGN * DIRECT_ALIGN if direct else nbytes
        while written < whole:
            written += os.write(fd, data[: min(len(data), whole - written)])
        if written < nbytes:  # the tail that is not a whole page
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            while written < nbytes:
                written += os.write(fd, data[: nbytes - written])
        wrote = time.perf_counter()
        os.fsync(fd)
        return wrote - started, time.perf_counter() - wrote
    finally:
        watch.stop()
        os.close(fd)
        path.unlink(missing_ok=True)


def filesystem_of(path: Path) -> dict[str, Any]:
    """The mount holding ``path`` (from /proc/mounts, where there is one) and its free space."""
    target = str(path.resolve())
    best = ("?", "?", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            source, mount, fstype = line.split()[:3]
            if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[2]):
                best = (source, fstype, mount)
    except OSError:
        pass
    return {"device": best[0], "type": best[1], "mount": best[2], "free_gib": round(shutil.disk_usage(path).free / GiB)}


def device_fp8_cost(device: torch.device, hidden: int, slot_mib: int, repeats: int = 200) -> dict[str, Any]:
    """The consumer's GPU quantization of one slot of rows, beside a device copy and the copies to the host.

    Times, with CUDA events on one stream (medians of ``repeats``): :func:`~hscapture.fp8.quantize_into`
    of a ``[tensors, rows, hidden]`` bf16 slot into codes, scales and counts; the CRC-32 of each row of
    codes (``hscapture/csrc/crc32_rows.cu``); a device-to-device copy of the slot; the copy of
    the slot to pinned host memory, and of its codes and scales.
    """
    tensors = len(LAYERS) + 1
    rows = slot_mib * MiB // (tensors * hidden * 2)
    slot = torch.randn(tensors, rows, hidden, device=device).to(torch.bfloat16)
    codes = torch.empty(tensors, rows, hidden, dtype=FP8, device=device)
    scales = torch.empty(tensors, rows, device=device)
    counts = torch.empty(tensors, rows, dtype=torch.int32, device=device)
    copy = torch.empty_like(slot)
    host_rows = torch.empty(slot.shape, dtype=slot.dtype, pin_memory=True)
    host_codes = torch.empty(codes.shape, dtype=codes.dtype, pin_memory=True)
    host_scales = torch.empty(scales.shape, dtype=scales.dtype, pin_memory=True)

    def timed(work: Callable[[], object]) -> float:
        for _ in range(5):
            work()
        times = []
        for _ in range(repeats):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            work()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1000)
        return round(statistics.median(times), 1)

    quantize = timed(lambda: quantize_into(slot, codes, scales, counts))
    crcs = torch.empty(tensors * rows, dtype=torch.int32, device=device)
    kernel = crc_kernel()  # on the default stream, as the events
    args = (np.uint64(codes.data_ptr()), np.int64(hidden), np.int64(rows * hidden), np.int32(hidden))
    args += (np.uint64(crcs.data_ptr()), np.int32(rows), np.uint32(zlib.crc32(bytes(hidden))))
    row_crcs = timed(lambda: kernel((rows, tensors), (256,), args)) if kernel is not None else None
    to_host_rows = timed(lambda: host_rows.copy_(slot, non_blocking=True))
    to_host_fp8 = timed(lambda: (host_codes.copy_(codes, non_blocking=True), host_scales.copy_(scales, True)))
    return {
        "slot": f"[{tensors}, {rows}, {hidden}] bf16, {slot.nbytes / MiB:.0f} MiB",
        "quantize_us": quantize,
        "row_crcs_us": row_crcs,
        "device_copy_us": timed(lambda: copy.copy_(slot)),
        "to_host_rows_us": to_host_rows,
        "to_host_fp8_us": to_host_fp8,
        "quantize_gbps_of_rows": round(slot.nbytes / quantize / 1e3, 1),
        "note": "GPU time per slot (CUDA events, median); the consumer quantizes on its own stream, so the "
        "engine's stream never waits for it; its copy to the host moves codes + scales instead of the rows",
    }


def host_fp8_cost(hidden: int, slot_mib: int, repeats: int = 20) -> dict[str, Any]:
    """What an fp8 store fed from a host ring costs the consumer per slot of bf16 rows, in CPU time
    (``time.thread_time``, median of ``repeats``, one thread): the fused kernel the consumer quantizes
    with out of the ring, the torch passes it replaces (what runs without numba), the CRC-32 of each
    row of codes (the compiled kernel, and zlib), and a plain copy of the slot into touched memory."""
    tensors = len(LAYERS) + 1
    rows = slot_mib * MiB // (tensors * hidden * 2)
    slot = torch.randn(tensors, rows, hidden).to(torch.bfloat16)
    copy = torch.empty_like(slot)
    scales, codes = torch.empty(rows), torch.empty(rows, hidden, dtype=FP8)
    torch_passes = Quantizer(hidden, rows, fused=False)
    fused = Quantizer(hidden, rows) if host_kernels() is not None else None

    def timed(work: Callable[[], object]) -> float:
        work()
        times = []
        for _ in range(repeats):
            begin = time.thread_time()
            work()
            times.append(time.thread_time() - begin)
        return round(statistics.median(times) * 1000, 3)

    code_bytes = codes.view(torch.uint8).numpy()

    def each(quantize: Quantizer) -> Callable[[], None]:
        return lambda: [quantize(slot[t], scales, codes) for t in range(tensors)]

    costs = {
        "fused_kernel_ms": timed(each(fused)) if fused is not None else None,
        "torch_passes_ms": timed(each(torch_passes)),
        "row_crcs_ms": timed(lambda: [row_crcs(code_bytes, compiled=True) for _ in range(tensors)]),
        "row_crcs_zlib_ms": timed(lambda: [row_crcs(code_bytes) for _ in range(tensors)]),
        "copy_ms": timed(lambda: copy.copy_(slot)),
    }
    return {
        "slot": f"[{tensors}, {rows}, {hidden}] bf16, {slot.nbytes / MiB:.0f} MiB",
        **costs,
        "gbps_of_rows": {k[:-3]: round(slot.nbytes / v / 1e6, 2) for k, v in costs.items() if v},
        "note": "CPU time per slot, one thread (median); the consumer quantizes a host ring's rows with the "
        "fused kernel where they lie and checksums each row of codes; without numba it copies the rows out "
        "and the writer threads run the torch passes and zlib",
    }


def goals(results: dict[str, Any]) -> dict[str, Any]:
    return {
        f"store_vs_raw_disk_{name}": {
            "target": f">= {GOAL}",
            "value": data.get("ratio"),
            "met": data.get("ratio", 0) >= GOAL,
        }
        for name, data in results.items()
        if isinstance(data, dict) and "ratio" in data
    }


def run(args: argparse.Namespace, checkpoint: Callable[[Outcome], None]) -> Outcome:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.init()
        name = torch.cuda.get_device_name(device)
        tag = re.sub(r"[^a-z0-9]", "", name.split()[-1].lower()) or "gpu"
    else:
        torch.set_num_threads(1)  # the producer here only copies; leave the cores to the consumer
        name, tag = f"CPU ({os.cpu_count()} cores)", "cpu"
    dtypes = [d.strip() for d in args.store_dtypes.split(",") if d.strip()]
    if not set(dtypes) <= {"bf16", "fp8"}:
        raise ValueError(f"--store-dtypes: {args.store_dtypes!r}; use bf16, fp8 or both")
    keys = ("device", "gib", "repeats", "hidden", "slot_mib", "consumer_args", "compare_consumer_args")
    settings = {key: getattr(args, key) for key in keys}
    outcome = Outcome(name=f"store-{tag}", device={"kind": device.type, "name": name}, settings=settings, results={})
    work = Path(tempfile.mkdtemp(prefix="hscapture-store-rate-", dir=args.work_dir))
    try:
        if device.type == "cuda" and "fp8" in dtypes:
            outcome.results["device_fp8"] = device_fp8_cost(device, args.hidden, args.slot_mib)
        elif "fp8" in dtypes:
            outcome.results["host_fp8"] = host_fp8_cost(args.hidden, args.slot_mib)
        for stored in dtypes:
            print(f"[store suite] {stored} ...", flush=True)
            outcome.results[stored] = measure(
                device, work, args.gib, args.repeats, args.hidden, args.slot_mib,
                "fp8" if stored == "fp8" else None, tuple(args.consumer_args.split()),
                None if args.compare_consumer_args is None else tuple(args.compare_consumer_args.split()),
            )  # fmt: skip
            outcome.goals = goals(outcome.results)
            checkpoint(outcome)
    finally:
        gpu_ring.stop_children()
        gpu_ring.remove_endpoints()
        shutil.rmtree(work, ignore_errors=True)
    return outcome


def table(record: dict[str, Any]) -> str:
    lines = [
        "| stored as | rows in, GB/s | store, GB/s on disk | raw write + fsync, GB/s | store / raw | goal "
        "| raw O_DIRECT + fsync, GB/s | store / raw O_DIRECT |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    stores = {name: data for name, data in record["results"].items() if "ratio" in data}
    for name, data in stores.items():
        goal = record["goals"].get(f"store_vs_raw_disk_{name}", {})
        met = "met" if goal.get("met") else "missed"
        direct = (
            [f"{data['raw_direct_gbps']:.2f}", f"{data['ratio_to_direct']:.3f}"]
            if "raw_direct_gbps" in data
            else ["-", "-"]
        )
        lines.append(
            f"| {name} | {data['rows_in_gbps']:.2f} | {data['store_gbps']:.2f} | {data['raw_write_gbps']:.2f} | "
            f"**{data['ratio']:.3f}** | {goal.get('target', '')} {met} | {direct[0]} | {direct[1]} |"
        )
        compare = data.get("compare")
        if compare:
            lines.append(
                f"| {name}, consumer `{compare['consumer_args']}` | - | {compare['store_gbps']:.2f} | "
                f"{data['raw_write_gbps']:.2f} | {compare['ratio']:.3f} | | {direct[0]} | "
                f"{compare['ratio_to_direct']:.3f} |"
            )
    fs = next(iter(stores.values()), {}).get("filesystem", {})
    settings = record["settings"]
    lines.append(
        f"\n{settings['gib']} GiB of bf16 rows per repeat (4 tensors x hidden {settings['hidden']}), median of "
        f"{settings['repeats']} repeats in rotating order, {fs.get('type', '?')} on {fs.get('device', '?')}."
    )
    head = ("stored as", "first shard listed, s", "steady, GB/s", "producer closed, s", "last shard listed, s",
            "run_end, s", "raw write, s", "raw fsync, s", "disk busy: store / raw",
            "core-s, store: consumer, producer, machine", "core-s, raw: writer, machine",
            "raw O_DIRECT + fsync, s", "core-s, raw O_DIRECT: writer, machine")  # fmt: skip
    compared = any("compare" in data for data in stores.values())
    head += ("store with the compared flags: run_end, s", "core-s: consumer, producer, machine") if compared else ()
    lines += ["", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, data in stores.items():
        direct_phases = data.get("raw_direct_phases", [])
        compare_phases = data.get("compare", {}).get("store_phases", [])
        for repeat, (phase, raw) in enumerate(zip(data.get("store_phases", []), data.get("raw_phases", []))):
            keys = ("first_shard", "steady_gbps", "producer_closed", "last_shard", "run_end")
            cells = ["-" if phase.get(k) is None else phase[k] for k in keys]  # steady: needs two shards
            disks = phase.get("disk"), raw.get("disk")
            busy = f"{disks[0]['busy']:.2f} / {disks[1]['busy']:.2f}" if all(disks) else "-"
            cells += [raw["write_s"], raw["fsync_s"], busy, _cores(phase, _CPU), _cores(raw, _CPU[1:])]
            direct = direct_phases[repeat] if repeat < len(direct_phases) else None
            cells += (
                [round(direct["write_s"] + direct["fsync_s"], 3), _cores(direct, _CPU[1:])] if direct else ["-", "-"]
            )
            if compared:
                other = compare_phases[repeat] if repeat < len(compare_phases) else None
                cells += [other["run_end"], _cores(other, _CPU)] if other else ["-", "-"]
            lines.append(f"| {name} | " + " | ".join(map(str, cells)) + " |")
    cost = record["results"].get("device_fp8")
    if cost:
        lines.append(
            f"\nfp8 on the GPU, per slot {cost['slot']}: quantize {cost['quantize_us']} us "
            f"({cost['quantize_gbps_of_rows']} GB/s of rows), row CRCs {cost.get('row_crcs_us', '-')} us, "
            f"device copy {cost['device_copy_us']} us; to the host: "
            f"rows {cost['to_host_rows_us']} us, codes + scales {cost['to_host_fp8_us']} us."
        )
    host = record["results"].get("host_fp8")
    if host:
        fused = "-" if host["fused_kernel_ms"] is None else f"{host['fused_kernel_ms']} ms"
        lines.append(
            f"\nfp8 on the host, CPU time per slot {host['slot']} on one thread: fused kernel {fused}, torch "
            f"passes {host['torch_passes_ms']} ms, row CRCs {host['row_crcs_ms']} ms (zlib {host['row_crcs_zlib_ms']} "
            f"ms), plain copy {host['copy_ms']} ms."
        )
    return "\n".join(lines)


#: CpuWatch's figures, as the table shows them: the consumer, this thread (producer or raw writer), the machine.
_CPU = ("consumer_core_s", "this_thread_core_s", "machine_busy_core_s")


def _cores(phase: dict[str, Any], keys: tuple[str, ...]) -> str:
    cpu = phase.get("cpu") or {}
    return ", ".join(f"{cpu[k]:.2f}" for k in keys) if all(k in cpu for k in keys) else "-"


SUITE = SuiteSpec(
    name="store",
    description="the store's write rate (producer -> ring -> consumer -> shards) against a raw write of the same bytes",
    add_arguments=add_arguments,
    run=run,
    table=table,
    tok_per_s=lambda record: {},
)
