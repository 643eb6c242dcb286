"""Tokenizing a chat dataset in one process against several (``extract --tokenize-workers``).

    python benchmarks/tokenize_speed.py [--conversations 400] [--tokens 460000] [--workers 2,4,8]

The data is the ``extract`` suite's (multi-turn chats, lengths 0.25-1.75x the mean; the chat
template renders a conversation once per assistant turn to find the loss mask), tokenized with the
tiny Llama's tokenizer by :func:`hscapture.data.load_samples`: inline (``workers=1``), then with each
``--workers`` count of spawned processes, alternating, ``--repeats`` times; the same Samples each way
(checked). Reported: seconds (median), speed-up over inline, and the default
:func:`~hscapture.data.tokenize_workers` picks on this host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from benchmarks.extract_speed import make_data
from hscapture.config import usable_cores
from hscapture.data import load_samples, tokenize_workers
from hscapture.tiny import ensure_tiny_model

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=460_000)
    parser.add_argument("--workers", default="2,4,8", help="comma list of process counts (default 2,4,8)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, help="JSON result (default results/tokenize-speed-<host>.json)")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    cores = usable_cores()
    with tempfile.TemporaryDirectory() as work:
        data = make_data(Path(work) / "chats.jsonl", tokenizer, args.conversations, args.tokens)
        reference = list(load_samples(data, tokenizer))
        seconds: dict[int, list[float]] = {w: [] for w in [1, *counts]}
        for _ in range(args.repeats):
            for workers in seconds:
                started = time.perf_counter()
                samples = list(load_samples(data, tokenizer, workers=workers))
                seconds[workers].append(time.perf_counter() - started)
                assert samples == reference, f"workers={workers} gave other samples"
        size, default = data.stat().st_size, tokenize_workers(data)
    inline = statistics.median(seconds[1])
    results = {
        str(w): {"seconds": round(statistics.median(s), 2), "speedup": round(inline / statistics.median(s), 2)}
        for w, s in seconds.items()
    }
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent)
    record = {
        "benchmark": "tokenize_speed",
        "command": "python benchmarks/tokenize_speed.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                      vars(args).items() if v is not None),
        "commit": os.environ.get("HSCAPTURE_COMMIT") or commit.stdout.strip(),
        "machine": {"cores": cores, "platform": platform.platform()},
        "data": {"conversations": args.conversations, "tokens": sum(len(s.input_ids) for s in reference),
                 "bytes": size},
        "default_workers": default,
        "results": results,
    }  # fmt: skip
    out = args.out or RESULTS / f"tokenize-speed-{'cpu' if cores < 8 else platform.node()}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
