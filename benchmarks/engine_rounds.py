"""Serving suites that time a real engine per variant, each in a process of its own (``sglang``, ``vllm``).

Both halves of their line protocol live here: the driver starts a worker per variant, one engine at a time (an
idle engine may still spin on the CPU), in passes of rotated order so drift hits every variant alike; the worker
prints ``ready`` once its engine is up, then runs one round per ``go`` on stdin and prints ``round`` with its
seconds. The first round of each start is a warm-up, not kept. Start-up is never timed.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def measure(
    variants: Sequence[str], start: Callable[[str], subprocess.Popen], repeats: int, passes: int
) -> dict[str, list[float]]:
    """Seconds of each timed round per variant: ``repeats`` in all (at least), spread over ``passes`` starts."""
    rounds: dict[str, list[float]] = {v: [] for v in variants}
    per_start = -(-repeats // passes)
    for turn in range(passes):
        shift = turn % len(variants)
        for variant in [*variants[shift:], *variants[:shift]]:
            rounds[variant] += _rounds(start(variant), per_start)
    return rounds


def _rounds(worker: subprocess.Popen, repeats: int) -> list[float]:
    """A warm-up round, then ``repeats`` timed rounds of one engine; then it stops."""
    try:
        _expect(worker, "ready")
        _expect(worker, "round")
        return [_expect(worker, "round")["seconds"] for _ in range(repeats)]
    finally:
        if worker.poll() is None:
            worker.stdin.write("stop\n")  # type: ignore[union-attr]
            worker.stdin.flush()  # type: ignore[union-attr]
        try:
            worker.wait(120)
        except subprocess.TimeoutExpired:
            worker.kill()


def _expect(worker: subprocess.Popen, kind: str) -> dict[str, Any]:
    if kind == "round":
        worker.stdin.write("go\n")  # type: ignore[union-attr]
        worker.stdin.flush()  # type: ignore[union-attr]
    for line in worker.stdout:  # type: ignore[union-attr]
        if line.startswith("{"):
            message = json.loads(line)
            if message["kind"] == kind:
                return message
    raise RuntimeError(f"a benchmark worker exited with {worker.wait()} before sending {kind!r}")


def serve(run_round: Callable[[], None]) -> None:
    """The worker's half: ``ready`` now, then one timed ``run_round()`` per ``go`` until anything else (or EOF)."""
    print(json.dumps({"kind": "ready"}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        started = time.perf_counter()
        run_round()
        print(json.dumps({"kind": "round", "seconds": time.perf_counter() - started}), flush=True)


def figures(rounds: dict[str, list[float]], tokens: int) -> dict[str, dict[str, Any]]:
    """Per variant: tok/s of the median round, its ratio to ``off``'s median, and every round's seconds."""
    off = statistics.median(rounds["off"])
    return {
        v: {"tok_per_s": tokens / statistics.median(s), "vs_off": off / statistics.median(s), "seconds": s}
        for v, s in rounds.items()
    }


def table(results: dict[str, Any], variants: Sequence[str]) -> list[str]:
    """Markdown rows: median tok/s, best round's tok/s, ratio to off, spread of the rounds."""
    lines = [
        "| variant | tok/s (median) | tok/s (best) | vs off | seconds per round (min–max) |",
        "|---|---:|---:|---:|---:|",
    ]
    for v in variants:
        r = results[v]
        fast, slow = min(r["seconds"]), max(r["seconds"])
        best = r["tok_per_s"] * statistics.median(r["seconds"]) / fast
        lines.append(f"| {v} | {r['tok_per_s']:.1f} | {best:.1f} | {r['vs_off']:.3f} | {fast:.2f}–{slow:.2f} |")
    return lines
