"""SGLang suite: one model served three ways, the same request set, tok/s side by side.

    python benchmarks/run.py sglang [--model DIR] [--requests 32] [--new-tokens 64] [--repeats 5]

Variants, each a real ``sglang.Engine`` in its own process, one engine at a time (an idle
engine's scheduler still spins on the CPU), in two passes of rotated order so drift hits all
alike; engine start-up and a warm-up round per start are not timed:

* ``off``: plain SGLang.
* ``builtin``: SGLang's own path, ``--enable-return-aux-hidden-states`` and every request asking
  ``return_hidden_states`` (the ``.cpu().tolist()`` per request in the scheduler, then the
  states travel to the client).
* ``hscapture``: the same aux flags with the hscapture plugin on (``drop`` policy) and a consumer
  process writing the store to disk.

Each request generates exactly ``--new-tokens`` tokens (``ignore_eos``), greedy. On a host
without a GPU SGLang runs its CPU path and only the ratios mean anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import engine_rounds
from benchmarks.report import Outcome, SuiteSkipped, SuiteSpec

VARIANTS = ("off", "builtin", "hscapture")
#: Each variant's engine is started this many times (:func:`engine_rounds.measure`).
PASSES = 2
ROOT = Path(__file__).resolve().parent.parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="HF model directory (default: the embedded tiny Llama)")
    parser.add_argument("--requests", type=int, default=32, help="requests per round (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per variant (default 5)")


def run(args: argparse.Namespace, checkpoint: Callable[[Outcome], None]) -> Outcome:
    try:
        import sglang
    except ImportError:
        raise SuiteSkipped("SGLang is not installed: pip install -e '.[sglang]'") from None
    from hscapture.tiny import ensure_tiny_model

    model = args.model or ensure_tiny_model()
    settings = {
        "model": str(model),
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "sglang": sglang.__version__,
    }
    outcome = Outcome(
        name="sglang-cpu",
        device={"kind": "cpu", "name": f"CPU ({os.cpu_count()} cores)"},
        settings=settings,
        results={},
    )
    store = Path(tempfile.mkdtemp(prefix="hscapture-bench-sglang-"))
    try:
        rounds = engine_rounds.measure(VARIANTS, lambda v: _start_worker(v, model, store, args), args.repeats, PASSES)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    outcome.results = engine_rounds.figures(rounds, args.requests * args.new_tokens)
    outcome.results["hscapture_vs_builtin"] = statistics.median(rounds["builtin"]) / statistics.median(
        rounds["hscapture"]
    )
    checkpoint(outcome)
    return outcome


def _start_worker(variant: str, model: Path, store: Path, args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, "-m", "benchmarks.sglang_serving", "--variant", variant, "--model", str(model)]
    command += ["--store", str(store), "--requests", str(args.requests), "--new-tokens", str(args.new_tokens)]
    command += ["--prompt-tokens", str(args.prompt_tokens)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def worker_main() -> None:
    """One engine; ``ready`` once warm-up-free start-up is done, then one timed round per ``go``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    args = parser.parse_args()
    from hscapture.consumer import consume_command
    from hscapture.integrations.sglang import (
        CPU_ENGINE_KWARGS,
        ENV,
        PluginSettings,
        engine_kwargs,
        use_cpu_host_env,
    )

    on_cpu = use_cpu_host_env()
    consumer = None
    if args.variant == "hscapture":
        endpoint = f"ipc:///tmp/hscapture-{os.getuid()}/bench-sglang-{os.getpid()}"
        os.environ[ENV] = PluginSettings(endpoint=endpoint, policy="drop").to_env()
        consumer = subprocess.Popen(consume_command(endpoint, args.store, "--exit-on-eos", "--quiet"))
    import sglang

    engine = sglang.Engine(
        model_path=args.model,
        log_level="error",
        max_total_tokens=4 * args.requests * (args.prompt_tokens + args.new_tokens),
        disable_radix_cache=True,  # every round computes every prompt token
        **(CPU_ENGINE_KWARGS if on_cpu else {}),
        **(engine_kwargs() if args.variant != "off" else {}),
    )
    prompts = [[1 + (i * 7 + j) % 1000 for j in range(args.prompt_tokens)] for i in range(args.requests)]
    params = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    try:
        engine_rounds.serve(
            lambda: engine.generate(
                input_ids=prompts, sampling_params=params, return_hidden_states=args.variant == "builtin"
            )
        )
    finally:
        if consumer is not None:
            from hscapture.integrations.sglang import CLOSE_RPC

            engine.collective_rpc(CLOSE_RPC)
            consumer.wait(60)
        engine.shutdown()


def tok_per_s(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    results = record["results"]
    return {"decode": {v: results[v]["tok_per_s"] for v in VARIANTS if v in results}}


def table(record: dict[str, Any]) -> str:
    results = record["results"]
    lines = engine_rounds.table(results, VARIANTS)
    lines.append(f"\nhscapture is {results['hscapture_vs_builtin']:.2f}x the built-in path's tok/s.")
    return "\n".join(lines)


SUITE = SuiteSpec(
    name="sglang",
    description="the same model served three ways on SGLang: capture off, built-in return_hidden_states, hscapture",
    add_arguments=add_arguments,
    run=run,
    table=table,
    tok_per_s=tok_per_s,
)

if __name__ == "__main__":
    worker_main()
