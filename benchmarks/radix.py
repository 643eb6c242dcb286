"""The radix cache on against off: ``hscapture extract --engine sglang`` over samples sharing a system prompt.

``python benchmarks/run.py radix [--samples 128] [--system-tokens 512] [--repeats 1]`` (needs SGLang; the
CPU host runs its CPU path). One dataset made here: ``--samples`` demo conversations (the tiny model's
tokenizer), each starting with the same system prompt of at least ``--system-tokens`` tokens. Two variants of
the same teacher-mode extraction, each its own ``hscapture extract`` process into its own store, run one after
the other (order alternating per repeat):

* ``on``: the default, radix cache on; a sample whose prefix SGLang finds cached is not forwarded there, and
  the store takes those rows by reference from the sample that computed them;
* ``off``: ``-- --disable-radix-cache``, every sample forwarded whole.

Figures, from what SGLang actually did: tokens forwarded are the rows each store holds itself (every
position SGLang forwarded, the one generated token of teacher mode is never forwarded), rows shared are those
served by reference (``hscapture inspect``'s ``rows_shared``); wall time is the whole process (SGLang's start
included) and extract's own capture time; bytes are the store directory's. Ratios are on / off, one run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.extract_speed import RATE_LINE
from benchmarks.gpu_ring import child_env
from benchmarks.report import Outcome, SuiteSkipped, SuiteSpec
from hscapture.inspection import inspect_store

VARIANTS = ("on", "off")
#: SGLang arguments of each variant, after extract's ``--``.
SGLANG_ARGS = {"on": [], "off": ["--disable-radix-cache"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="HF model directory (default: the embedded tiny Llama)")
    parser.add_argument("--samples", type=int, default=128, help="conversations (default 128)")
    parser.add_argument("--system-tokens", type=int, default=512, help="least tokens of the shared system prompt")
    parser.add_argument("--max-batch-size", type=int, help="samples per generate call (default: extract's)")
    parser.add_argument("--repeats", type=int, default=1, help="extractions per variant (default 1)")
    parser.add_argument("--work-dir", type=Path, help="where the data and stores go (default $TMPDIR)")


def run(args: argparse.Namespace, checkpoint: Callable[[Outcome], None]) -> Outcome:
    for name in ("samples", "system_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: {getattr(args, name)}; must be >= 1")
    try:
        import sglang
    except ImportError:
        raise SuiteSkipped("SGLang is not installed: pip install -e '.[sglang]'") from None
    from transformers import AutoTokenizer

    from hscapture.tiny import ensure_tiny_model, long_system_prompt, write_demo_jsonl

    model = args.model or ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    system = long_system_prompt(tokenizer, args.system_tokens)
    outcome = Outcome(
        name="radix-cpu",
        device={"kind": "cpu", "name": f"CPU ({os.cpu_count()} cores)"},
        settings={
            "model": str(model),
            "samples": args.samples,
            "system_prompt_tokens": len(tokenizer(system, add_special_tokens=False).input_ids),
            "max_batch_size": args.max_batch_size or "extract's default",
            "repeats": args.repeats,
            "mode": "teacher",
            "sglang": sglang.__version__,
        },
        results={},
    )
    work = Path(tempfile.mkdtemp(prefix="hscapture-bench-radix-", dir=args.work_dir))
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    try:
        data = write_demo_jsonl(work / "data.jsonl", args.samples, system_prompt=system)
        batch = ["--max-batch-size", str(args.max_batch_size)] if args.max_batch_size else []
        for repeat in range(args.repeats):
            for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                print(f"[radix suite] extract, radix cache {variant} ({repeat + 1}/{args.repeats}) ...", flush=True)
                out = work / f"store-{variant}-{repeat}"
                runs[variant].append(_extract(model, data, out, [*batch, "--", *SGLANG_ARGS[variant]]))
                shutil.rmtree(out, ignore_errors=True)
                outcome.results = _summarize(runs)
                checkpoint(outcome)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    on = outcome.results["on"]
    outcome.goals["every_sample_complete_with_the_cache_on"] = {
        "target": "0 incomplete",
        "value": on["incomplete"],
        "met": on["incomplete"] == 0 and on["complete"] == args.samples,
    }
    return outcome


def _extract(model: Path, data: Path, out: Path, options: list[str]) -> dict[str, Any]:
    """``hscapture extract --engine sglang`` as its own process; its timing and what its store holds."""
    command = [sys.executable, "-m", "hscapture", "extract", "--engine", "sglang", "--model", str(model)]
    command += ["--data", str(data), "--out", str(out), "--no-progress", *options]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=3600)
    wall = time.perf_counter() - started
    match = RATE_LINE.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"hscapture extract failed ({done.returncode}): {done.stderr[-2000:]}")
    store = inspect_store(out)
    return {
        "command": shlex.join(["hscapture", *command[3:]]),
        "process_seconds": round(wall, 2),
        "capture_seconds": float(match.group(3)),
        "tokens": int(match.group(2)),
        "tokens_forwarded": store["tokens"],
        "rows_shared": store["rows_shared"],
        "requests_sharing": store["requests_sharing"],
        "complete": store["complete"],
        "incomplete": store["incomplete"],
        "bytes_on_disk": store["bytes_on_disk"],
    }


def _summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per variant: medians over its runs (times) and its last store's figures; ratios on / off."""
    results: dict[str, Any] = {}
    for variant, done in runs.items():
        if not done:
            continue
        last = done[-1]
        capture = statistics.median(r["capture_seconds"] for r in done)
        results[variant] = {
            **{k: last[k] for k in ("tokens", "tokens_forwarded", "rows_shared", "requests_sharing")},
            **{k: last[k] for k in ("complete", "incomplete", "bytes_on_disk")},
            "process_seconds": round(statistics.median(r["process_seconds"] for r in done), 2),
            "capture_seconds": round(capture, 2),
            "tok_per_s": round(last["tokens"] / max(capture, 1e-9), 1),
            "runs": done,
        }
    if "on" in results and "off" in results:
        on, off = results["on"], results["off"]
        results["on_vs_off"] = {
            key: round(on[key] / off[key], 4)
            for key in ("tokens_forwarded", "process_seconds", "capture_seconds", "bytes_on_disk")
            if off[key]
        }
    return results


def table(record: dict[str, Any]) -> str:
    results = record["results"]
    lines = [
        "| radix cache | samples complete | tokens forwarded | rows shared | capture s | process s | MiB on disk |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in VARIANTS:
        if variant in results:
            r = results[variant]
            lines.append(
                f"| {variant} | {r['complete']:,} of {r['complete'] + r['incomplete']:,} | {r['tokens_forwarded']:,} "
                f"| {r['rows_shared']:,} | {r['capture_seconds']:.1f} | {r['process_seconds']:.1f} "
                f"| {r['bytes_on_disk'] / 2**20:,.1f} |"
            )
    ratios = results.get("on_vs_off")
    if ratios:
        lines.append(
            "| **on / off** | | **{tokens_forwarded:.3f}** | | **{capture_seconds:.3f}** | **{process_seconds:.3f}** "
            "| **{bytes_on_disk:.3f}** |".format(**ratios)
        )
    settings = record["settings"]
    lines.append(
        f"\n{settings['samples']} conversations in teacher mode, each starting with the same "
        f"{settings['system_prompt_tokens']}-token system prompt; SGLang {settings['sglang']}, {settings['model']}; "
        f"capture s: extract's own time (consumer attach to the store's last fsync); process s: the whole command."
    )
    return "\n".join(lines)


SUITE = SuiteSpec(
    name="radix",
    description="extract --engine sglang over samples sharing a system prompt, radix cache on vs off",
    add_arguments=add_arguments,
    run=run,
    table=table,
    tok_per_s=lambda record: {
        "extract --engine sglang": {
            v: record["results"][v]["tok_per_s"] for v in ("off", "on") if "tok_per_s" in record["results"].get(v, {})
        }
    },
)
