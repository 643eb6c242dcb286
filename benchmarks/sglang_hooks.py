"""The SGLang plugin's host time per decode step, after ~1.4 ms of queued GPU work, against the old hook.

    python -m benchmarks.sglang_hooks                                   # GPU host: batch 1,16,64,256, 4096 bf16
    python -m benchmarks.sglang_hooks --device cpu --hidden 64 --batches 1,16,64   # a smoke run anywhere

The plugin's real hooks (``SGLangCapture.after_forward`` and ``after_batch_result``) are driven
by the stand-in scheduler of ``benchmarks/sglang_standin.py`` in SGLang's overlap order: each
forward queues ``--queued-ms`` of GPU work (``torch.cuda._sleep``) before its outputs, as a
decode step of a large model does, then the forward hook runs on the forward stream; then the
previous step's result is processed and ``after_batch_result`` runs (it first waits for that
step's token copy, as SGLang does, so at most two forwards are queued on the GPU). Captured: 3 aux
layers and the last layer (``--hidden`` wide, bf16), drop policy, the plugin's default slots and ring
(``default_slot_bytes``, ``default_ring_bytes``: a decode run takes one slot), a ``--discard`` consumer process
attached.
On a CPU (``--device cpu``, host ring) each step instead sleeps ``--queued-ms`` outside the
hooks, so the consumer keeps up; only the GPU run measures what the goal is about.
Six variants on a GPU (five on a CPU), batch size by batch size, alternating, with the same producer and
consumer:

* ``graph`` (the plugin as SGLang runs it on a GPU, where a decode batch up to the largest CUDA graph
  replays one): the stand-in's decode forward is a CUDA graph of the batch, captured with the
  plugin's capture tail hook in it, which adds the ring copy of the graph's outputs
  (``GraphRows``); ``after_forward`` writes where the step's rows go into the copy's plan table
  (a few stores into mapped host memory, no launch), with the same decode runs and announcements
  as ``deferred``.
* ``deferred`` (the plugin where the decode forward is not a graph): ``after_forward`` copies the rows
  into the ring, the aux layers and the last layer by one driver launch of the producer's row kernel
  (``hscapture/producer/row_kernel.py``) into the slot's planes, and records the slot's event; a
  decode step of the same requests as the step before goes into the same slot, after its rows
  (``Producer.extend_step``), up to ``RUN_STEPS`` steps or a full slot. ``after_batch_result``
  announces a run once it is closed, in one chunk, with token ids from each request's host copy
  (``Producer.announce_step``).
* ``deferred-torch``: the plugin with the producer's row kernel off: the same rows written by
  torch, one ``torch.cat`` into a strided view of the slot (what it did before the kernel).
* ``per-step``: the plugin with runs of one step (``run_steps = 1``): every decode step its own slot,
  chunk and announcement, what it did before runs.
* ``sync`` (the hook before that change): the same rows announced at once by ``capture_step``,
  token ids read from the batch's device ``input_ids`` (``.cpu()``: the host waits for the
  forward). Its row bookkeeping is the new one, so it is a lower bound of the old hook's cost.
* ``floor``: a decode step's rows written into a free slot by the same one-launch write and the slot's
  event recorded, nothing else (no positions, token ids or announcement; the slot is handed straight
  back). The least any hook that copies the rows from Python spends on this host; ``deferred``
  minus ``floor`` is the plugin's bookkeeping.

Reported per batch size and variant: host µs per decode step in the hooks (``after_forward``
plus ``after_batch_result`` of one loop turn; median, p90 and mean over ``--steps`` steps (the
producer sends held announcements and takes releases every few steps: that shows in the mean and
the p90, not the median), warm-up
excluded, no synchronize inside the timed region; ``--clock thread`` counts this thread's CPU
time instead, for a shared CPU host where preemption swamps the wall clock), each hook's median,
host-device syncs per step (counted under ``torch.cuda.set_sync_debug_mode("warn")`` over a few untimed steps), and
rows dropped; then a cProfile of ``graph``'s hooks at batch 64 (untimed steps), so the next
optimisation starts from a measurement. The goal: ``graph`` at batch 64 takes at most 40 µs
per step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.sglang_standin import FINISH_ABORT, ForwardMode, OverlapScheduler, Plan, capture_with_producer
from hscapture.config import CaptureConfig, default_ring_bytes, default_slot_bytes
from hscapture.consumer import consume_command
from hscapture.integrations.sglang import SGLangCapture

RESULTS = Path(__file__).parent / "results"
LAYERS = (2, 16, 29)
PROMPT_TOKENS = 4
GOAL_US = 40.0
GOAL_BATCH = 64
#: The plugin as SGLang runs it on a GPU: decode batches up to its largest CUDA graph replay one.
GOAL_VARIANT = "graph"


class SyncCapture(SGLangCapture):
    """The forward hook as it was: token ids read from the device at once, rows announced at once."""

    def _capture_now(self, batch: Any, output: Any) -> None:
        if batch.forward_mode.is_decode():
            plan = self._decode_plan(batch)
            self._decoded = batch.seq_lens_cpu
            rids, counts, total = plan.rids, plan.ones, len(plan.reqs)
            positions = np.subtract(batch.seq_lens_cpu.numpy(), 1, dtype=np.int64)
        else:
            rows = self._rows(batch)
            rids, counts, positions, total = rows.rids, rows.counts, rows.positions, rows.total
        aux, hidden = output.hidden_states, self.producer.config.hidden_size
        states = [*aux.view(total, -1, hidden).unbind(1), output.last_hidden_states]
        tokens = batch.input_ids.cpu()  # what Producer.capture_step did with a device tensor: waits
        self.producer.capture_step(states, rids, counts, positions, tokens)

    _decode = _extend = _capture_now


class FloorCapture(SGLangCapture):
    """The floor of any hook that copies the rows from Python: a decode step's rows go into a free slot by the
    plugin's own one-launch write and the slot's event is recorded; nothing else (no positions, no token ids, no
    announcement, the slot handed straight back). What the plugin's hooks spend above it is bookkeeping."""

    def after_forward(self, result: Any, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> None:
        if batch is None or not batch.forward_mode.is_decode():
            return super().after_forward(result, worker, batch, *args, **kwargs)
        output, producer = result.logits_output, self.producer
        states = (output.hidden_states, output.last_hidden_states)
        slot = producer.ledger.take()
        producer._copier.write(slot, states, (len(LAYERS), 1), None, 0, states[0].shape[0])
        producer.ring.mark_written(slot)
        producer.ledger.give_back(slot)

    def after_batch_result(self, result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
        if not batch.forward_mode.is_decode():
            super().after_batch_result(result, scheduler, batch, *args, **kwargs)


def _git_head() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers separated by commas, e.g. 1,16,64") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


class _Clock:
    """Wraps each hook call: adds its host time to the current loop turn, or counts its syncs."""

    def __init__(self, now: Callable[[], int] = time.perf_counter_ns) -> None:
        self.now = now
        self.turn = {"after_forward": 0, "after_batch_result": 0}
        self.count_syncs = False
        self.syncs = 0
        self.profile: cProfile.Profile | None = None

    def __call__(self, name: str, call: Callable[[], None]) -> None:
        if self.profile is not None:
            self.profile.enable()
            call()
            self.profile.disable()
            return
        if self.count_syncs:
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                call()
            torch.cuda.set_sync_debug_mode("default")
            self.syncs += sum("synchroniz" in str(w.message) for w in caught)
            return
        started = self.now()
        call()
        self.turn[name] += self.now() - started

    def take(self) -> tuple[int, int]:
        turn = self.turn["after_forward"], self.turn["after_batch_result"]
        self.turn = dict.fromkeys(self.turn, 0)
        return turn


def measure(
    capture: SGLangCapture, batch: int, args: argparse.Namespace, first: int, profile: bool = False, graph: bool = False
) -> dict[str, Any]:
    """Decode ``batch`` requests with ``capture``'s hooks; host time per decode step. ``graph``: the decode
    forward is a CUDA graph of batch ``batch``, captured with the plugin's copy in it."""
    clock = _Clock(time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns)
    profile_steps = args.steps if profile else 0
    total_steps = args.warmup + args.sync_steps + args.steps + profile_steps
    plans = [
        Plan(f"b{batch}-{first + i}", [1 + (first + i + j) % 900 for j in range(PROMPT_TOKENS)], total_steps + 8)
        for i in range(batch)
    ]
    scheduler = OverlapScheduler(
        capture,
        plans,
        device=args.device,
        hidden=args.hidden,
        num_aux=len(LAYERS),
        dtype=torch.bfloat16,
        chunk_size=args.chunk,
        mixed=False,
        queued_gpu_s=args.queued_ms / 1e3 if args.device == "cuda" else 0.0,
        graphs=(batch,) if graph else (),
        hook=clock,
    )
    dropped_before = capture.producer.counters.rows_dropped
    forward_us, result_us, decode_steps = [], [], 0
    while decode_steps < total_steps:
        launched = len(scheduler.modes)
        scheduler.step()
        if args.device == "cpu":  # no GPU to keep busy: the step's time passes on the host, untimed
            time.sleep(args.queued_ms / 1e3)
        turn = clock.take()
        if len(scheduler.modes) == launched or scheduler.modes[-1] != ForwardMode.DECODE:
            continue  # prefill, or a turn without a forward
        decode_steps += 1
        clock.count_syncs = args.device == "cuda" and args.warmup <= decode_steps < args.warmup + args.sync_steps
        timed = decode_steps - args.warmup - args.sync_steps
        if 0 < timed <= args.steps:
            forward_us.append(turn[0] / 1e3)
            result_us.append(turn[1] / 1e3)
        if timed == args.steps and profile:
            clock.profile = cProfile.Profile()
    if args.device == "cuda":
        torch.cuda.synchronize()
    for req in scheduler.reqs.values():  # end them, untimed: the rows of the last steps are announced
        req.finished_reason = req.finished_reason or FINISH_ABORT("benchmark over")
    scheduler.step()
    scheduler.step()
    totals = [f + r for f, r in zip(forward_us, result_us)]
    top = []
    if clock.profile is not None:
        text = io.StringIO()
        pstats.Stats(clock.profile, stream=text).sort_stats("tottime").print_stats(15)
        top = [line for line in text.getvalue().splitlines() if line.strip()][:24]
    return {
        "median_us": round(statistics.median(totals), 1),
        # Work done every few steps (sending held announcements, taking releases) shows in the mean, not the median.
        "mean_us": round(statistics.fmean(totals), 1),
        "p90_us": round(float(np.percentile(totals, 90)), 1),
        "after_forward_median_us": round(statistics.median(forward_us), 1),
        "after_batch_result_median_us": round(statistics.median(result_us), 1),
        "syncs_per_step": round(clock.syncs / args.sync_steps, 2) if args.device == "cuda" else None,
        "rows_dropped": capture.producer.counters.rows_dropped - dropped_before,
        "steps": len(totals),
        **({"profile_top": top} if top else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=_ints, default=(1, 16, 64, 256))
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps per batch size and variant")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--sync-steps", type=int, default=10, help="untimed steps counting syncs (GPU)")
    parser.add_argument(
        "--queued-ms", type=float, default=1.4, help="GPU work queued in each forward (CPU: a sleep between steps)"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="time the hooks by the wall clock, or by this thread's CPU time (a shared CPU host: no preemption)",
    )
    parser.add_argument("--chunk", type=int, default=256, help="prefill tokens per batch")
    parser.add_argument("--out", type=Path, help="JSON result (default results/sglang-hooks-<device>.json)")
    args = parser.parse_args()
    if args.device == "cpu":  # a host ring's copy would split across OpenMP threads, whose spin-wait the clock counts
        torch.set_num_threads(1)
    out = args.out or RESULTS / f"sglang-hooks-{'h200' if args.device == 'cuda' else 'cpu'}.json"
    endpoint = f"ipc:///tmp/hscapture-{os.getuid()}/sglang-hooks-{os.getpid()}"
    row_bytes = (len(LAYERS) + 1) * args.hidden * 2
    max_rows = args.chunk + max(args.batches)
    # The plugin's own slots and ring (default_slot_bytes, default_ring_bytes) for the largest step here.
    slot_bytes = default_slot_bytes(row_bytes)
    config = CaptureConfig(
        layers=LAYERS, hidden_size=args.hidden, num_layers=32, dtype="bfloat16", device=args.device,
        policy="drop", endpoint=endpoint, slot_bytes=slot_bytes,
        ring_bytes=default_ring_bytes(slot_bytes, row_bytes, max_rows), max_step_rows=max_rows,
    )  # fmt: skip
    consumer = subprocess.Popen(
        consume_command(endpoint, None, "--discard", "--exit-on-eos", "--quiet", "--watch-pid", str(os.getpid()))
    )
    deferred = capture_with_producer(config)
    sync = SyncCapture(deferred.settings)
    floor = FloorCapture(deferred.settings)
    per_step = SGLangCapture(deferred.settings)
    per_step.run_steps = 1
    torch_write = SGLangCapture(deferred.settings)
    graph = SGLangCapture(deferred.settings)
    row_kernel = deferred.producer._copier._kernel
    for other in (sync, floor, per_step, torch_write, graph):
        other.producer, other.layers, other.hidden, other.checked = (
            deferred.producer,
            deferred.layers,
            deferred.hidden,
            True,
        )
    results: dict[str, dict[str, Any]] = {}
    try:
        while not deferred.producer.attached:
            deferred.producer.poll()
            time.sleep(0.01)
        first = 0
        for n, batch in enumerate(args.batches):
            variants = [
                *([("graph", graph)] if args.device == "cuda" else []),
                ("deferred", deferred),
                ("deferred-torch", torch_write),
                ("per-step", per_step),
                ("sync", sync),
                ("floor", floor),
            ]
            for name, capture in variants if n % 2 == 0 else variants[::-1]:
                capture.producer._copier._kernel = None if name == "deferred-torch" else row_kernel
                profile = name == GOAL_VARIANT and batch == GOAL_BATCH
                result = measure(capture, batch, args, first, profile, graph=name == "graph")
                results.setdefault(str(batch), {})[name] = result
                first += batch
                print(f"batch {batch:>4} {name:>12}: {_brief(result)}", flush=True)
                if profile:
                    print("\n".join(result["profile_top"]), flush=True)
    finally:
        deferred.producer.close()
        consumer.wait(60)
    goal = results.get(str(GOAL_BATCH), {}).get(GOAL_VARIANT, {}).get("median_us")
    record = {
        "benchmark": "sglang_hooks",
        "command": shlex.join(["python", "-m", "benchmarks.sglang_hooks", *sys.argv[1:]]),
        "commit": os.environ.get("HSCAPTURE_COMMIT") or _git_head(),
        "machine": {
            "platform": platform.platform(),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "out"},
        "results": results,
        "goal": {
            "what": f"{GOAL_VARIANT} hooks at batch {GOAL_BATCH}: median host time per decode step <= {GOAL_US} us",
            "value_us": goal,
            "met": None if goal is None or args.device != "cuda" else goal <= GOAL_US,
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(table(record))
    print(f"wrote {out}")


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "profile_top"}


def table(record: dict[str, Any]) -> str:
    """Markdown table of a result record."""
    lines = [
        "| batch | variant | host µs/step, median (p90) | mean | after_forward | after_batch_result | syncs/step "
        "| dropped |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for batch, variants in record["results"].items():
        for name, r in variants.items():
            syncs = "—" if r["syncs_per_step"] is None else r["syncs_per_step"]
            lines.append(
                f"| {batch} | {name} | {r['median_us']} ({r['p90_us']}) | {r.get('mean_us', '—')} | "
                f"{r['after_forward_median_us']} | "
                f"{r['after_batch_result_median_us']} | {syncs} | {r['rows_dropped']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
