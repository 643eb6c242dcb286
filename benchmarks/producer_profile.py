"""Where a decode step's `capture_step` spends its host time, on a GPU host.

    python benchmarks/producer_profile.py [--requests 64] [--hidden 4096] [--out FILE.json]

A drop-policy producer on the CUDA ring with a `--discard` consumer attached; one step is
`requests` requests of one row each (a decode batch), 4 tensors bf16. Reports the median host
time per call (no synchronize inside the timed region) and the top functions of a cProfile run,
so the next optimisation starts from a measurement.
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
from pathlib import Path

import numpy as np
import torch

from hscapture import CaptureConfig, Producer

RESULTS = Path(__file__).parent / "results"


def _git_head() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--out", type=Path, default=RESULTS / "producer-profile-h200.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("producer_profile: needs a CUDA GPU")
    endpoint = f"ipc:///tmp/hscapture-{os.getuid()}/profile-{os.getpid()}"
    config = CaptureConfig(
        layers=(2, 16, 29), hidden_size=args.hidden, num_layers=32, device="cuda", policy="drop",
        endpoint=endpoint, slot_bytes=32 << 20, ring_bytes=32 * (32 << 20), max_step_rows=4096,
    )  # fmt: skip
    command = [sys.executable, "-m", "hscapture", "consume", "--endpoint", endpoint, "--discard", "--exit-on-eos"]
    consumer = subprocess.Popen([*command, "--quiet", "--watch-pid", str(os.getpid())])
    producer = Producer(config, tensor_descriptions=["synthetic"] * 4)
    try:
        while not producer.attached:
            producer.poll()
            time.sleep(0.01)
        n = args.requests
        states = [torch.randn(n, args.hidden, device="cuda").bfloat16() for _ in range(4)]
        positions, tokens, ids, rows = np.arange(n), np.arange(n), [f"r{i}" for i in range(n)], [1] * n

        def step(i: int) -> None:
            producer.capture_step(states, ids, rows, positions, tokens)
            if i % 16 == 15:  # let the consumer keep up (drop policy would drop otherwise); not timed
                torch.cuda.synchronize()
                time.sleep(0.002)

        for i in range(50):
            step(i)
        times = []
        for i in range(args.calls):
            started = time.perf_counter_ns()
            producer.capture_step(states, ids, rows, positions, tokens)
            times.append((time.perf_counter_ns() - started) / 1e3)
            if i % 16 == 15:
                torch.cuda.synchronize()
                time.sleep(0.002)
        profile = cProfile.Profile()
        profile.enable()
        for i in range(args.calls):
            step(i)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        counters = producer.close()
    finally:
        producer.close()
        consumer.wait(30)
    record = {
        "benchmark": "producer_profile",
        "command": shlex.join(["python", *sys.argv]),
        "commit": os.environ.get("HSCAPTURE_COMMIT") or _git_head(),
        "machine": {"platform": platform.platform(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__},
        "requests": args.requests,
        "hidden": args.hidden,
        "calls": args.calls,
        "median_us": round(statistics.median(times), 1),
        "p90_us": round(sorted(times)[int(0.9 * len(times))], 1),
        "rows_dropped": counters.rows_dropped,
        "profile_top": text.getvalue().splitlines()[:30],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"capture_step, {args.requests} one-row requests: median {record['median_us']} us, p90 {record['p90_us']} us")
    print(text.getvalue())


if __name__ == "__main__":
    main()
