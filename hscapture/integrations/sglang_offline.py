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

import os
import sys
import time
from collections.abc import Sequence
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
    CPU_ENGINE_KWARGS,
    ENV,
    LOSS_MASK_PARAM,
    PluginSettings,
    engine_kwargs,
    use_cpu_host_env,
)
from hscapture.reader import open_store

MODES = ("teacher", "regenerate")


def sglang_layer_ids(layers: Sequence[int], model_type: str) -> list[int]:
    """SGLang's ``--return-aux-hidden-state-layer-ids`` that capture hscapture layers ``layers``.

    SGLang's Llama-style setters capture ``id + 1``; DeepSeek's take ids as given unless the
    first one is 1 (then ``id + 1`` as well).
    """
    if model_type.startswith("deepseek"):
        if layers and layers[0] == 1:
            raise ValueError("--layers: SGLang's DeepSeek setter cannot capture layer 1 first; list another first")
        return list(layers)
    if any(k < 1 for k in layers):
        raise ValueError(f"--layers: SGLang captures layer inputs from layer 1 on; got {list(layers)}")
    return [k - 1 for k in layers]


def regenerate_prompt(sample: Sample) -> list[int]:
    """The tokens before the last run of trained tokens (the final assistant turn)."""
    ranges = loss_mask_ranges(sample.loss_mask)
    return sample.input_ids[: ranges[-1][0]] if ranges else list(sample.input_ids)


def extract_with_sglang(options: ExtractOptions) -> ExtractSummary:
    """``hscapture extract --engine sglang``; same store layout and resume rules as the HF engine."""
    if options.mode not in MODES:
        raise ValueError(f"--mode: {options.mode!r} is unknown; use one of {MODES}")
    from transformers import AutoConfig, AutoTokenizer

    from hscapture.tiny import ensure_tiny_model

    model_path = options.model if options.model is not None else ensure_tiny_model()
    if not (model_path / "config.json").exists():
        raise ValueError(f"--model: {str(model_path)!r} has no config.json; give a local HF model directory")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model_type = AutoConfig.from_pretrained(model_path).model_type
    layer_ids = sglang_layer_ids(options.layers, model_type) if options.layers is not None else None
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
    settings = PluginSettings(endpoint=endpoint, capture_last=options.capture_last, policy="block", meta=meta)
    os.environ[ENV] = settings.to_env()  # read by the plugin in SGLang's scheduler process
    consumer = start_consumer(endpoint, options)
    started = time.monotonic()
    tokens = 0
    try:
        import sglang

        engine = sglang.Engine(
            model_path=str(model_path),
            log_level="error",
            disable_radix_cache=True,  # a prefix-cache hit would leave its positions uncaptured
            dtype=options.dtype or "auto",
            **(CPU_ENGINE_KWARGS if on_cpu else {"device": options.device}),
            **engine_kwargs(layer_ids),
        )
    except BaseException:
        consumer.kill()
        raise
    finally:
        os.environ.pop(ENV, None)
    try:
        bar = tqdm(total=len(samples), unit="sample", disable=not options.progress)
        with bar:
            for start in range(0, len(samples), options.max_batch_size):
                if consumer.poll() is not None:
                    raise HSCaptureError(f"consumer exited with code {consumer.returncode}; see its message above")
                batch = samples[start : start + options.max_batch_size]
                tokens += _generate(engine, batch, options)
                bar.update(len(batch))
        engine.collective_rpc(CLOSE_RPC)  # end of stream: the consumer finishes the store and exits
        code = wait_consumer(consumer)
    finally:
        if consumer.poll() is None:
            consumer.terminate()
            wait_consumer(consumer)
        engine.shutdown()
    if code != 0:
        raise HSCaptureError(f"consumer exited with code {code}; the store at {options.out} keeps what was committed")
    store = open_store(options.out)
    _check_layers(store, options.layers)
    return ExtractSummary(len(samples), tokens, time.monotonic() - started, len(skip), store.summary())


def _generate(engine: Any, batch: list[Sample], options: ExtractOptions) -> int:
    """One ``generate`` call over a batch; returns the tokens captured."""
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
    outputs = engine.generate(input_ids=prompts, sampling_params=params, rid=[s.key for s in batch])
    return sum(len(p) + len(o["output_ids"]) - 1 for p, o in zip(prompts, outputs))


def _check_layers(store: Any, wanted: Sequence[int] | None) -> None:
    got = store.metadata()["runs"][-1]["meta"]["config"]["layers"]
    if wanted is not None and list(got) != list(wanted):
        raise HSCaptureError(f"SGLang captured layers {got}, not the {list(wanted)} asked for")
