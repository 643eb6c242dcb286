"""Offline extraction with ``sglang.Engine``: the states of the engine users serve with.

The engine's scheduler process runs the hscapture plugin (block policy: nothing is lost) and a
consumer process writes the store, as in live serving. Two modes:

* ``teacher``: each sample's full token ids are prefilled as given (one generated token is
  discarded), so the store holds one row per dataset token, with the dataset's loss mask.
* ``regenerate``: the target model writes the last assistant turn itself; the prompt (every
  token before that turn's first trained token) and the generated tokens are both captured,
  and the loss mask covers the generated ones.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hscapture.data import Sample, load_samples
from hscapture.errors import HSCaptureError
from hscapture.extract import (
    ExtractOptions,
    ExtractSummary,
    default_data_path,
    done_keys,
    loss_mask_ranges,
    start_consumer,
    wait_consumer,
)
from hscapture.integrations.sglang import (
    CLOSE_RPC,
    CPU_SERVER_ARGS,
    ENV,
    LOSS_MASK_PARAM,
    PluginSettings,
    server_args,
    use_cpu_host_env,
)
from hscapture.integrations.sglang_models import LaunchPlan, launch_plan
from hscapture.reader import open_store

MODES = ("teacher", "regenerate")


def regenerate_prompt(sample: Sample) -> list[int]:
    """The tokens before the last run of trained tokens (the final assistant turn)."""
    ranges = loss_mask_ranges(sample.loss_mask)
    return sample.input_ids[: ranges[-1][0]] if ranges else list(sample.input_ids)


def extract_with_sglang(options: ExtractOptions) -> ExtractSummary:
    """``hscapture extract --engine sglang``; same store layout and resume rules as the HF engine."""
    if options.mode not in MODES:
        raise ValueError(f"--mode: {options.mode!r} is unknown; use one of {MODES}")
    from transformers import AutoTokenizer

    from hscapture.tiny import ensure_tiny_model

    model_path = options.model if options.model is not None else ensure_tiny_model()
    plan = launch_plan(model_path, options.layers)  # refuses what SGLang's capture cannot give, before it starts
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = options.data if options.data is not None else default_data_path()
    skip = done_keys(options.out)
    samples = list(load_samples(data, tokenizer, options.max_length, skip_keys=skip))[: options.limit]
    if skip:
        print(f"resuming {options.out}: {len(skip)} samples already captured, {len(samples)} to go", file=sys.stderr)
    if not samples:
        return ExtractSummary(0, 0, 0.0, len(skip), open_store(options.out).summary() if skip else {})
    on_cpu = options.device == "cpu"
    if on_cpu:
        use_cpu_host_env()
    endpoint = f"ipc:///tmp/hscapture-{os.getuid()}/extract-sglang-{os.getpid()}"
    meta = {"model": str(model_path), "data": str(data), "mode": options.mode, "launcher": "hscapture extract"}
    meta["server_args"] = options.sglang_args
    settings = PluginSettings(
        endpoint=endpoint, capture_last=options.capture_last, policy="block", meta=meta, layers=list(plan.layers)
    )
    os.environ[ENV] = settings.to_env()  # read by the plugin in SGLang's scheduler process
    consumer = start_consumer(endpoint, options)
    started = time.monotonic()
    tokens = 0
    try:
        import sglang

        engine = sglang.Engine(server_args=_server_args(model_path, options, plan))
    except BaseException:
        consumer.kill()
        raise
    finally:
        os.environ.pop(ENV, None)
    try:
        bar = tqdm(total=len(samples), unit="sample", disable=not options.progress)
        with bar:
            for start in range(0, len(samples), options.max_batch_size):
                batch = samples[start : start + options.max_batch_size]
                tokens += _generate(engine, batch, options, consumer)
                bar.update(len(batch))
        engine.collective_rpc(CLOSE_RPC)  # end of stream: the consumer finishes the store and exits
        code = wait_consumer(consumer)
        if code != 0:
            raise _consumer_error(code, options.out)
    finally:
        if consumer.poll() is None:
            consumer.terminate()
            wait_consumer(consumer)
        engine.shutdown()
    store = open_store(options.out)
    _check_layers(store, plan.layers)
    return ExtractSummary(len(samples), tokens, time.monotonic() - started, len(skip), store.summary())


def _server_args(model_path: Path, options: ExtractOptions, plan: LaunchPlan) -> Any:
    """SGLang's arguments, parsed by SGLang: ours, then the user's ``-- <sglang args>``, then the capture flags."""
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", str(model_path), "--log-level", "error", "--dtype", options.dtype or "auto"]
    argv += ["--disable-radix-cache"]  # a prefix-cache hit would leave its positions uncaptured
    argv += CPU_SERVER_ARGS if options.device == "cpu" else ["--device", options.device]
    return prepare_server_args([*argv, *options.sglang_args, *server_args(plan.sglang_ids)])


def _generate(engine: Any, batch: list[Sample], options: ExtractOptions, consumer: subprocess.Popen) -> int:
    """One generate call over a batch, stopped at once if the consumer exits; returns the tokens captured."""
    if options.mode == "teacher":
        prompts = [s.input_ids for s in batch]
        params = [
            {
                "max_new_tokens": 1,
                "temperature": 0.0,
                "custom_params": {LOSS_MASK_PARAM: [i for r in loss_mask_ranges(s.loss_mask) for i in r]},
            }
            for s in batch
        ]
    else:
        prompts = [regenerate_prompt(s) for s in batch]
        params = [{"max_new_tokens": options.max_new_tokens, "temperature": options.temperature} for _ in batch]
    generation = engine.async_generate(input_ids=prompts, sampling_params=params, rid=[s.key for s in batch])
    outputs = engine.loop.run_until_complete(_watched(generation, consumer, options.out))
    return sum(len(p) + len(o["output_ids"]) - 1 for p, o in zip(prompts, outputs))


async def _watched(generation: Awaitable[Any], consumer: subprocess.Popen, out: Path) -> Any:
    """Await SGLang's answer, checking the consumer meanwhile: it exits when capture fails inside SGLang."""
    task = asyncio.ensure_future(generation)
    while not task.done():
        await asyncio.wait({task}, timeout=0.2)
        if not task.done() and consumer.poll() is not None:
            task.cancel()
            raise _consumer_error(consumer.returncode, out, "; SGLang's generation was stopped")
    return task.result()


def capture_failure(out: Path) -> str:
    """The store's record of why its last run ended, if capture failed in the producer ('' otherwise)."""
    try:
        end = open_store(out).metadata()["runs"][-1]["end"] or {}
    except Exception:  # no store yet, or none readable: the consumer's own message says why
        return ""
    reason = str(end.get("reason", ""))
    return reason if reason.startswith("capture failed") else ""


def _consumer_error(code: int, out: Path, then: str = "") -> HSCaptureError:
    """Why the consumer stopped: the producer's original error when capture failed inside SGLang."""
    failure = capture_failure(out)
    if failure:
        return HSCaptureError(f"{failure} (in SGLang's scheduler){then}; the store at {out} keeps what was committed")
    return HSCaptureError(f"consumer exited with code {code}{then}; see its message above")


def _check_layers(store: Any, wanted: Sequence[int]) -> None:
    got = store.metadata()["runs"][-1]["meta"]["config"]["layers"]
    if list(got) != list(wanted):
        raise HSCaptureError(f"SGLang captured layers {got}, not the {list(wanted)} asked for")
