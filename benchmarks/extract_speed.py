"""Offline extraction against a plain forward: ``hscapture extract`` tok/s over the same padded batches.

``python benchmarks/run.py extract --device cuda`` (GPU host; ``--tiny --device cpu`` anywhere).
One run, one model, one dataset, all made here (nothing downloaded):

* the model: a random-init Llama at 8B dims (hidden 4096, 32 layers, bf16), saved with the
  embedded tiny tokenizer (``--tiny``: the embedded tiny Llama itself);
* the data: ``--conversations`` chats of ~``--tokens`` tokens in all (lengths spread 0.25x to
  1.75x the mean), JSONL in OpenAI form;
* ``plain``: this process loads the model as ``hscapture extract`` does and runs a forward over
  each padded batch ``hscapture extract`` plans (``--max-batch-tokens``), no capture; timed from
  the first batch to a synchronize after the last. Run first (cold, like the extraction's fresh
  process) and again last (warm); the faster is the baseline.
* ``hscapture extract --device D --layers 2,16,29`` (EAGLE-3's set + the post-norm last state) as
  its own process, bf16 then ``--store-dtype fp8``; its own tok/s line (capture timed from the
  consumer's attach to the store's last fsync).

The goal (issue 11): extraction >= 0.9 of the plain forward, bf16 and fp8.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_ring
from benchmarks.lean_llama import LLAMA_8B, random_llama
from benchmarks.report import Outcome, SuiteSpec
from hscapture import open_store
from hscapture.data import load_samples, pad_batch, plan_batches
from hscapture.integrations.hf import load_model
from hscapture.tiny import demo_conversations, ensure_tiny_model

GOAL = 0.9
LAYERS = "2,16,29"
#: extract's tok/s line.
RATE_LINE = re.compile(r"captured (\d+) samples, (\d+) tokens in ([\d.]+) s \((\d+) tok/s\)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny Llama and ~20k tokens (CPU is fine)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tokens", type=int, help="tokens in all (default 508000; --tiny 20000)")
    parser.add_argument("--conversations", type=int, help="conversations (default 400; --tiny 40)")
    parser.add_argument("--max-batch-tokens", type=int, default=4096, help="as hscapture extract (default 4096)")
    parser.add_argument("--store-dtypes", default="bf16,fp8", help="comma list of bf16, fp8 (default both)")
    parser.add_argument("--work-dir", type=Path, help="where the model, data and stores go (default $TMPDIR)")


def make_model(work: Path, tiny: bool, device: torch.device) -> Path:
    """A local HF model directory: the tiny Llama, or a random-init 8B-dims Llama with the tiny tokenizer."""
    tiny_dir = ensure_tiny_model()
    if tiny:
        return tiny_dir
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    dims = {**LLAMA_8B, "vocab_size": max(LLAMA_8B["vocab_size"], len(tokenizer))}
    model = random_llama(dims, device, torch.bfloat16)
    model.config.pad_token_id = tokenizer.pad_token_id
    path = work / "llama-8b-dims"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return path


def make_data(path: Path, tokenizer: Any, conversations: int, tokens: int) -> Path:
    """``conversations`` chats whose lengths spread evenly around ``tokens / conversations`` tokens.

    Each chat is made of consecutive turns of the demo conversations until its target length
    (counted on the raw text; the chat template adds a few tokens per message).
    """
    rng = random.Random(0)
    pool = [m for record in demo_conversations(4000) for m in record["messages"] if m["role"] != "system"]
    lengths = [len(tokenizer(m["content"]).input_ids) + 4 for m in pool]
    mean = tokens / conversations
    at = 0
    with path.open("w") as handle:
        for i in range(conversations):
            target = mean * rng.uniform(0.25, 1.75)
            messages: list[dict[str, str]] = []
            count = 0
            while count < target or not messages or messages[-1]["role"] != "assistant":
                message = pool[at % len(pool)]
                at += 1
                if not messages and message["role"] != "user":
                    continue
                messages.append(message)
                count += lengths[(at - 1) % len(pool)]
            handle.write(json.dumps({"id": f"conv-{i:05d}", "messages": messages}) + "\n")
    return path


class PlainForward:
    """The model loaded as ``hscapture extract`` loads it, and extract's batches of the data, for timing."""

    def __init__(self, model_dir: Path, data: Path, device: str, max_batch_tokens: int) -> None:
        tokenizer, self.model, _ = load_model(model_dir, None, device)
        samples = list(load_samples(data, tokenizer))
        self.batches = plan_batches(samples, max_batch_tokens, 64)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.device = next(self.model.parameters()).device
        self.figures = {
            "samples": len(samples),
            "tokens": sum(len(s.input_ids) for s in samples),
            "padded_tokens": sum(len(b) * max(len(s.input_ids) for s in b) for b in self.batches),
            "batches": len(self.batches),
        }

    def seconds(self) -> float:
        """One pass over every batch: from the first batch to a synchronize after the last."""
        self._sync()
        started = time.perf_counter()
        with torch.inference_mode():
            for batch in self.batches:
                input_ids, attention_mask = pad_batch(batch, self.pad_id)
                self.model(
                    input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), use_cache=False
                )
        self._sync()
        return time.perf_counter() - started

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run_extract(model_dir: Path, data: Path, out: Path, device: str, options: list[str]) -> dict[str, Any]:
    """``hscapture extract`` as its own process, with ``options``; its tok/s line and the store it left."""
    command = [sys.executable, "-m", "hscapture", "extract", "--model", str(model_dir), "--data", str(data)]
    command += ["--out", str(out), "--device", device, "--no-progress", *options]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=gpu_ring.child_env(), timeout=1800)
    wall = time.perf_counter() - started
    match = RATE_LINE.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"hscapture extract failed ({done.returncode}): {done.stderr[-2000:]}")
    store = open_store(out).summary()
    samples, tokens, seconds, rate = match.groups()
    return {
        "command": " ".join(["hscapture", *command[3:]]),
        "samples": int(samples),
        "tokens": int(tokens),
        "seconds": float(seconds),
        "tok_per_s": round(int(tokens) / max(float(seconds), 1e-9), 1),
        "printed_tok_per_s": int(rate),
        "process_seconds": round(wall, 1),
        "store": store,
    }


def run(args: argparse.Namespace, checkpoint: Callable[[Outcome], None]) -> Outcome:
    device = torch.device(args.device)
    tokens = args.tokens or (20_000 if args.tiny else 508_000)
    conversations = args.conversations or (40 if args.tiny else 400)
    if device.type == "cuda":
        torch.cuda.init()
        name = torch.cuda.get_device_name(device)
        tag = re.sub(r"[^a-z0-9]", "", name.split()[-1].lower()) or "gpu"
    else:
        name, tag = f"CPU ({os.cpu_count()} cores)", "cpu"
    dtypes = [d.strip() for d in args.store_dtypes.split(",") if d.strip()]
    if not set(dtypes) <= {"bf16", "fp8"}:
        raise ValueError(f"--store-dtypes: {args.store_dtypes!r}; use bf16, fp8 or both")
    settings = {
        "model": "tiny Llama (hidden 256, 8 layers)"
        if args.tiny
        else "random-init Llama, 8B dims (hidden 4096, 32 layers)",
        "tokens_asked": tokens,
        "conversations": conversations,
        "max_batch_tokens": args.max_batch_tokens,
        "layers": "default (EAGLE-3)" if args.tiny else LAYERS + " + last",
    }
    outcome = Outcome(
        name=f"extract-tiny-{tag}" if args.tiny else f"extract-{tag}",
        device={"kind": device.type, "name": name},
        settings=settings,
        results={},
    )
    work = Path(tempfile.mkdtemp(prefix="hscapture-extract-speed-", dir=args.work_dir))
    try:
        started = time.perf_counter()
        model_dir = make_model(work, args.tiny, device)
        from transformers import AutoTokenizer

        data = make_data(work / "data.jsonl", AutoTokenizer.from_pretrained(model_dir), conversations, tokens)
        outcome.results["setup_seconds"] = round(time.perf_counter() - started, 1)
        plain = PlainForward(model_dir, data, args.device, args.max_batch_tokens)
        cold = plain.seconds()
        outcome.results["plain"] = {**plain.figures, "cold_seconds": round(cold, 3)}
        checkpoint(outcome)
        options = ["--max-batch-tokens", str(args.max_batch_tokens), *([] if args.tiny else ["--layers", LAYERS])]
        for stored in dtypes:
            print(f"[extract suite] hscapture extract, {stored} ...", flush=True)
            out = work / f"store-{stored}"
            fp8 = ["--store-dtype", "fp8"] if stored == "fp8" else []
            outcome.results[stored] = run_extract(model_dir, data, out, args.device, [*options, *fp8])
            shutil.rmtree(out, ignore_errors=True)
            checkpoint(outcome)
        warm = plain.seconds()
        best = min(cold, warm)
        tok_per_s = round(plain.figures["tokens"] / best, 1)
        outcome.results["plain"].update(
            warm_seconds=round(warm, 3), baseline_seconds=round(best, 3), tok_per_s=tok_per_s
        )
        for stored in dtypes:
            result = outcome.results[stored]
            result["ratio"] = round(result["tok_per_s"] / tok_per_s, 4)
            goal = {"target": f">= {GOAL}", "value": result["ratio"], "met": result["ratio"] >= GOAL}
            outcome.goals[f"extract_vs_plain_forward_{stored}"] = goal
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return outcome


def table(record: dict[str, Any]) -> str:
    results = record["results"]
    plain = results.get("plain", {})
    lines = ["| | tok/s | vs plain forward |", "|---|---:|---:|"]
    if "tok_per_s" in plain:
        lines.append(
            f"| plain HF forward over the same padded batches, no capture | {plain['tok_per_s']:,.0f} | 1.00 |"
        )
    for stored, label in (("bf16", "`hscapture extract`"), ("fp8", "same with `--store-dtype fp8`")):
        if "ratio" in results.get(stored, {}):
            result = results[stored]
            lines.append(f"| {label} (its own tok/s line) | {result['tok_per_s']:,.0f} | **{result['ratio']:.2f}** |")
    settings = record["settings"]
    lines.append(
        f"\n{settings['model']}, layers {settings['layers']}, {plain.get('tokens', '?'):,} tokens in "
        f"{plain.get('samples', '?')} conversations, {plain.get('batches', '?')} batches of at most "
        f"{settings['max_batch_tokens']} padded tokens; baseline: the faster of a cold and a warm pass."
    )
    return "\n".join(lines)


SUITE = SuiteSpec(
    name="extract",
    description="hscapture extract's tok/s against a plain HF forward over the same batches (bf16 and fp8 stores)",
    add_arguments=add_arguments,
    run=run,
    table=table,
    tok_per_s=lambda record: {
        "extract": {
            "off": record["results"].get("plain", {}).get("tok_per_s", 0.0),
            **{
                s: record["results"][s]["tok_per_s"]
                for s in ("bf16", "fp8")
                if "tok_per_s" in record["results"].get(s, {})
            },
        }
    },
)
