"""Capture overhead in tok/s on a real HF serving loop, every variant side by side in one run.

    python benchmarks/hf_overhead.py [--model DIR] [--batch 16] [--new-tokens 64] [--repeats 5]

The loop is ``hscapture.integrations.hf.greedy_generate``: a left-padded prefill, then
KV-cached decode steps, over the embedded tiny Llama unless ``--model`` is given. Variants,
interleaved repeat by repeat so drift hits all alike, median tok/s reported:

* ``off``: no hooks, a NullProducer (the serving loop alone);
* ``drop``: hscapture, drop policy, consumer process writing the store;
* ``block``: hscapture, block policy, consumer process writing the store;
* ``dump``: the usual engine patch: synchronous ``.cpu()`` + ``torch.save`` every step;
* ``tolist``: SGLang's built-in path: ``.cpu().tolist()`` per request every step.

On a CPU host only the ratios mean anything; GPU figures come from the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hscapture import CaptureConfig, NullProducer, Producer
from hscapture.consumer import consume_command
from hscapture.integrations.hf import HFCapture, describe, eagle3_default_layers, greedy_generate
from hscapture.tiny import demo_conversations, ensure_tiny_model

RESULTS = Path(__file__).parent / "results"


class DumpBaseline:
    """Per step: copy the states to the host synchronously and ``torch.save`` them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.step = 0

    def capture_step(self, states: Sequence[torch.Tensor], *args: Any, row_index: Any = None, **kw: Any) -> int:
        rows = [s.cpu() if row_index is None else s[row_index].cpu() for s in states]
        torch.save(rows, self.directory / f"step-{self.step}.pt")
        self.step += 1
        return rows[0].shape[0]

    def finish_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class TolistBaseline:
    """Per step and request: ``.cpu().tolist()`` of its rows, as SGLang's built-in path does."""

    def __init__(self) -> None:
        self.kept: list[Any] = []

    def capture_step(
        self, states: Sequence[torch.Tensor], request_ids: Sequence[str], request_rows: Sequence[int], *a: Any, **k: Any
    ) -> int:
        row_index = k.get("row_index")
        states = [s if row_index is None else s[row_index] for s in states]
        start = 0
        for count in request_rows:
            self.kept.append([s[start : start + count].cpu().clone().tolist() for s in states])
            start += count
        self.kept.clear()
        return start

    def finish_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def start_consumer(endpoint: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen(consume_command(endpoint, out, "--exit-on-eos", "--quiet"))


def attach(producer: Producer) -> None:
    deadline = time.monotonic() + 60
    while not producer.attached and time.monotonic() < deadline:
        producer.poll()
        time.sleep(0.01)
    if not producer.attached:
        raise RuntimeError("consumer did not attach")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="HF model directory (default: embedded tiny Llama)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "hf-overhead-cpu.json")
    args = parser.parse_args()

    model_dir = args.model or ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    layers = eagle3_default_layers(model.config.num_hidden_layers)
    chats = [c["messages"][:1] for c in demo_conversations(args.batch)]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]
    keys = [f"req{i}" for i in range(len(prompts))]
    work = Path(tempfile.mkdtemp(prefix="hscapture-bench-"))
    producers: dict[str, Any] = {}
    consumers = []
    for policy in ("drop", "block"):
        endpoint = f"ipc:///tmp/hscapture-{os.getuid()}/bench-{policy}-{os.getpid()}"
        config = CaptureConfig(
            layers=layers,
            hidden_size=model.config.hidden_size,
            num_layers=model.config.num_hidden_layers,
            policy=policy,  # type: ignore[arg-type]
            endpoint=endpoint,
            max_step_rows=max(4096, sum(map(len, prompts))),
        )
        consumers.append(start_consumer(endpoint, work / policy))
        producers[policy] = Producer(config, tensor_descriptions=describe(layers, True), meta={"engine": "bench"})
        attach(producers[policy])
    (work / "dump").mkdir()
    producers["dump"] = DumpBaseline(work / "dump")
    producers["tolist"] = TolistBaseline()
    variants = ["off", "drop", "block", "dump", "tolist"]
    tokens = len(prompts) * args.new_tokens
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for repeat in range(args.repeats + 1):  # repeat 0 is warm-up
            for variant in variants:
                capture = None if variant == "off" else HFCapture(model, layers)
                producer = producers.get(variant, NullProducer())
                started = time.perf_counter()
                greedy_generate(model, capture, producer, prompts, keys, args.new_tokens, tokenizer.pad_token_id)
                if repeat:
                    seconds[variant].append(time.perf_counter() - started)
                if capture is not None:
                    capture.remove()
    finally:
        counters = {p: producers[p].close().to_dict() for p in ("drop", "block")}
        for consumer in consumers:
            consumer.wait(60)
        shutil.rmtree(work, ignore_errors=True)

    median = {v: tokens / statistics.median(s) for v, s in seconds.items()}
    results = {
        variant: {
            "tok_per_s": round(median[variant], 1),
            "ratio_to_off": round(median[variant] / median["off"], 4),
            "seconds": [round(s, 4) for s in seconds[variant]],
        }
        for variant in variants
    }
    record = {
        "benchmark": "hf_overhead",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "device": "cpu",
        "model": str(model_dir),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "layers": list(layers),
        "results": results,
        "producer_counters": counters,
        "note": "CPU host: only ratios are meaningful; medians over repeats, variants interleaved, warm-up excluded",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print("| variant | tok/s | vs off |\n|---|---:|---:|")
    for variant in variants:
        print(f"| {variant} | {results[variant]['tok_per_s']:.0f} | {results[variant]['ratio_to_off']:.3f} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
