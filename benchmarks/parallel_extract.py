"""One extraction job per GPU against one GPU alone: ``hscapture extract --data-parallel K`` vs ``1``, same data.

``python benchmarks/run.py parallel`` (a host with 2 GPUs or more; ``--tiny --device cpu`` anywhere,
as a smoke run). One run, one model, one dataset, all made here (nothing downloaded):

* the model: a random-init Llama at Llama-3.2-3B dims (hidden 3072, 28 layers, bf16), saved with
  the embedded tiny tokenizer (``--tiny``: the embedded tiny Llama itself);
* the data: ``--conversations`` chats of ~``--tokens`` tokens in all, JSONL in OpenAI form (as the
  ``extract`` suite makes them);
* ``hscapture extract --data-parallel 1``, then ``--data-parallel K``, each its own process over the
  same data into a fresh ``--out``; tok/s from extract's own line (capture time: for K jobs, from
  the first job's start to the last job's end, so a job that starts late counts against it). The K
  jobs share the batches of one queue, which the command tokenizes and plans once while they load
  their models: each job's "data s" is that tokenizing, its "capture starts at" when it was ready
  to take batches.

By default one middle layer is captured as fp8 (``--no-last --store-dtype fp8``): little to write
per token, so the GPUs, not the disk they share, set the rate (one disk does not scale with GPUs;
``--extract-args '--layers 2,14,25 --last --store-dtype bf16'`` measures the EAGLE-3 set, and each
run's store GB/s shows how near the disk it came). Both stores are checked to hold the same keys.

The goal (issue 15): K jobs >= 0.95 x K times one job's tok/s (1.9x on 2 GPUs).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.extract_speed import make_data, run_extract
from benchmarks.lean_llama import save_random_llama
from benchmarks.report import Outcome, SuiteSkipped, SuiteSpec
from hscapture import open_store
from hscapture.tiny import ensure_tiny_model

#: Scaling asked of K jobs: at least this fraction of K times one job's tok/s.
GOAL = 0.95
#: Llama-3.2-3B's dimensions (vocab grown to the tokenizer's if needed).
LLAMA_3B = {
    "hidden_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 128256,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny Llama and ~16k tokens (CPU is fine)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--jobs", type=int, default=2, help="K of --data-parallel K, one GPU each (default 2)")
    parser.add_argument("--tokens", type=int, help="tokens in all (default 2000000; --tiny 16000)")
    parser.add_argument("--conversations", type=int, help="conversations (default 1600; --tiny 32)")
    parser.add_argument("--max-batch-tokens", type=int, default=4096, help="as hscapture extract (default 4096)")
    parser.add_argument(
        "--extract-args",
        default="",
        help="more hscapture extract options for both runs, after the defaults (a middle layer, --no-last, "
        "--store-dtype fp8), e.g. '--layers 2,14,25 --last --store-dtype bf16'",
    )
    parser.add_argument("--work-dir", type=Path, help="where the model, data and stores go (default $TMPDIR)")


def make_model(work: Path, tiny: bool, device: torch.device) -> tuple[Path, int]:
    """A local HF model directory and its layer count: the tiny Llama, or a random-init 3B-dims Llama."""
    tiny_dir = ensure_tiny_model()
    if tiny:
        from transformers import AutoConfig

        return tiny_dir, AutoConfig.from_pretrained(tiny_dir).num_hidden_layers
    return save_random_llama(work / "llama-3b-dims", LLAMA_3B, tiny_dir, device), LLAMA_3B["num_hidden_layers"]


def describe_device(device: torch.device, jobs: int) -> tuple[dict[str, Any], str]:
    """The device record and the result name's tag.

    Raises:
        SuiteSkipped: fewer GPUs visible than jobs.
    """
    if device.type != "cuda":
        return {"kind": "cpu", "name": f"CPU ({os.cpu_count()} cores)"}, "cpu"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < jobs:
        raise SuiteSkipped(
            f"--jobs {jobs} needs {jobs} GPUs, {count} visible; run it on a host with {jobs} (nvidia-h200-x2 for 2), "
            "or give --tiny --device cpu for a smoke run"
        )
    name = torch.cuda.get_device_name(0)
    tag = re.sub(r"[^a-z0-9]", "", name.split()[-1].lower()) or "gpu"
    return {"kind": "cuda", "name": f"{count} x {name}", "gpus": count}, f"{tag}-x{jobs}"


def run(args: argparse.Namespace, checkpoint: Callable[[Outcome], None]) -> Outcome:
    if args.jobs < 2:
        raise ValueError(f"--jobs: {args.jobs}; give at least 2 (the runs compare K jobs with one)")
    device = torch.device(args.device)
    described, tag = describe_device(device, args.jobs)
    tokens = args.tokens or (16_000 if args.tiny else 2_000_000)
    conversations = args.conversations or (32 if args.tiny else 1600)
    outcome = Outcome(
        name=f"parallel-tiny-{tag}" if args.tiny else f"parallel-{tag}",
        device=described,
        settings={
            "model": "tiny Llama (hidden 256, 8 layers)"
            if args.tiny
            else "random-init Llama, 3B dims (hidden 3072, 28 layers)",
            "jobs": args.jobs,
            "tokens_asked": tokens,
            "conversations": conversations,
            "max_batch_tokens": args.max_batch_tokens,
        },
        results={},
    )
    work = Path(tempfile.mkdtemp(prefix="hscapture-parallel-", dir=args.work_dir))
    try:
        started = time.perf_counter()
        model_dir, layers = make_model(work, args.tiny, device)
        from transformers import AutoTokenizer

        data = make_data(work / "data.jsonl", AutoTokenizer.from_pretrained(model_dir), conversations, tokens)
        options = [
            *("--layers", str(layers // 2), "--no-last", "--store-dtype", "fp8"),
            *("--max-batch-tokens", str(args.max_batch_tokens)),
            *shlex.split(args.extract_args),
        ]
        outcome.settings["extract_options"] = " ".join(options)
        outcome.results["setup_seconds"] = round(time.perf_counter() - started, 1)
        keys: dict[int, set[str]] = {}
        for jobs in (1, args.jobs):
            print(f"[parallel suite] hscapture extract --data-parallel {jobs} ...", flush=True)
            out = work / f"out-{jobs}"
            result = run_extract(model_dir, data, out, args.device, [*options, "--data-parallel", str(jobs)])
            result["store_gbps"] = round(result["store"]["bytes"] / max(result["seconds"], 1e-9) / 1e9, 3)
            keys[jobs] = set(open_store(out).keys())
            outcome.results[f"jobs_{jobs}"] = result
            shutil.rmtree(out, ignore_errors=True)
            checkpoint(outcome)
        if keys[1] != keys[args.jobs] or len(keys[1]) != outcome.results["jobs_1"]["samples"]:
            raise RuntimeError(
                f"the stores differ: {len(keys[1])} keys with 1 job, {len(keys[args.jobs])} with {args.jobs}, "
                f"{len(keys[1] ^ keys[args.jobs])} in one only"
            )
        one, many = outcome.results["jobs_1"], outcome.results[f"jobs_{args.jobs}"]
        ratio = round(many["tok_per_s"] / one["tok_per_s"], 3)
        outcome.results["ratio"] = ratio
        outcome.results["process_ratio"] = round(one["process_seconds"] / many["process_seconds"], 3)
        target = round(GOAL * args.jobs, 2)
        outcome.goals[f"jobs_{args.jobs}_vs_1"] = {"target": f">= {target}", "value": ratio, "met": ratio >= target}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return outcome


def table(record: dict[str, Any]) -> str:
    results, settings = record["results"], record["settings"]
    jobs = settings["jobs"]
    lines = [
        "| `hscapture extract` | tok/s (its own line) | vs 1 job | capture s | process s | store GB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for count in (1, jobs):
        result = results.get(f"jobs_{count}")
        if result is None:
            continue
        ratio = "1.00" if count == 1 else (f"**{results['ratio']:.2f}**" if "ratio" in results else "?")
        lines.append(
            f"| `--data-parallel {count}` | {result['tok_per_s']:,.0f} | {ratio} | {result['seconds']:.1f} | "
            f"{result['process_seconds']:.1f} | {result['store_gbps']:.3f} |"
        )
    phases = [
        f"| {label} | {job.get('start_offset_s', 0.0):.1f} | {job['seconds']:.1f} | {job['load_seconds']:.1f} | "
        f"{job['data_seconds']:.1f} |"
        for count in (1, jobs)
        for label, job in _phases(results.get(f"jobs_{count}", {}), count)
    ]
    if phases:
        lines += [
            "\n| job | capture starts at, s | capture s | model load s | data s (read, tokenize, batch) |",
            "|---|---:|---:|---:|---:|",
            *phases,
        ]
    first = results.get("jobs_1", {})
    lines.append(
        f"\n{settings['model']}, `{settings.get('extract_options', '?')}`, {first.get('tokens', '?'):,} tokens in "
        f"{first.get('samples', '?')} conversations; goal >= {GOAL * jobs:.2f}x. Capture s: from the first job's "
        "start to the last job's end (model loading excluded); process s: the whole command"
        + (f" ({results['process_ratio']:.2f}x as fast with {jobs} jobs)." if "process_ratio" in results else ".")
    )
    return "\n".join(lines)


def _phases(result: dict[str, Any], count: int) -> list[tuple[str, dict[str, Any]]]:
    """Each job's times before and in its capture (from extract's own lines), labelled for the table."""
    found = result.get("preparation", [])
    if count == 1:
        return [("`--data-parallel 1`", {"seconds": result["seconds"], **found[0]})] if found else []
    return [(f"`--data-parallel {count}` {job['job']}", job) for job in found]


SUITE = SuiteSpec(
    name="parallel",
    description="hscapture extract --data-parallel K (one job per GPU) against one job, same data, tok/s ratio",
    add_arguments=add_arguments,
    run=run,
    table=table,
    tok_per_s=lambda record: {
        "extract": {
            f"{count} job{'s' if count > 1 else ''}": record["results"][f"jobs_{count}"]["tok_per_s"]
            for count in (1, record["settings"]["jobs"])
            if f"jobs_{count}" in record["results"]
        }
    },
)
