"""Offline bulk extraction: run a model over a dataset and capture its hidden states to a store.

The extraction process is the producer (block policy: nothing is lost); it starts a consumer
in its own process (``hscapture consume``) that writes the store, exactly as in streaming
capture. Each record is one request keyed by its id; batches are right-padded and the padding
rows are never announced. A rerun over the same data skips every sample the store already
holds complete, so an interrupted extraction resumes without duplicating or losing samples.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hscapture.config import (
    DTYPES,
    STORE_DTYPES,
    CaptureConfig,
    MiB,
    dtype_name,
    ensure_writable_dir,
    flag,
    store_dtype_name,
)
from hscapture.consumer import consume_command
from hscapture.data import Sample, load_samples, pad_batch, plan_batches
from hscapture.errors import HSCaptureError
from hscapture.integrations.hf import HFCapture, describe, eagle3_default_layers
from hscapture.producer import Producer
from hscapture.reader import open_store
from hscapture.store import META_FILE, check_store_dtype

log = logging.getLogger(__name__)


@dataclass
class ExtractOptions:
    """What ``hscapture extract`` does; every field is the command-line flag of the same name."""

    #: Store directory to write (appended to and resumed if it exists).
    out: Path
    #: Local HF model directory (default: the embedded tiny Llama, built on first use).
    model: Path | None = None
    #: JSONL of OpenAI messages, ShareGPT conversations, prompt or text records (default: 200 demo conversations).
    data: Path | None = None
    #: Layer ids, k = the residual stream entering decoder layer k (default: EAGLE-3's 2, L/2, L-3).
    layers: tuple[int, ...] | None = None
    #: Also capture the post-norm final hidden state (what the LM head reads).
    capture_last: bool = field(default=True, metadata=flag(name="--last"))
    #: Activation and storage dtype: bfloat16, float16 or float32 (default: the model's own).
    dtype: str | None = None
    #: Torch device to run the model on.
    device: str = "cpu"
    #: Truncate samples to this many tokens.
    max_length: int | None = None
    #: Padded tokens per forward call.
    max_batch_tokens: int = 4096
    #: Samples per forward call.
    max_batch_size: int = 64
    #: Stop after this many samples (for trials).
    limit: int | None = None
    #: Target bytes per shard.
    shard_bytes: int = 256 * MiB
    #: ``fp8``: the consumer stores rows as float8_e4m3fn with one float32 scale per row, half the
    #: bytes of bf16 (default: as captured, or as the existing store does).
    store_dtype: str | None = field(default=None, metadata=flag(choices=sorted(STORE_DTYPES)))
    #: Threads of the consumer writing shards.
    writer_threads: int = 2
    #: Show a progress bar.
    progress: bool = True
    #: Extra arguments for the consumer process (e.g. ``["--delay-ms", "5"]`` in tests).
    consumer_args: list[str] = field(default_factory=list)
    #: ``hf`` (transformers, in this process) or ``sglang`` (``sglang.Engine`` with the plugin).
    engine: str = field(default="hf", metadata=flag(choices=("hf", "sglang")))
    #: SGLang only: ``teacher`` (the data's tokens) or ``regenerate`` (the model writes the last turn).
    mode: str = field(default="teacher", metadata=flag(choices=("teacher", "regenerate")))
    #: SGLang regenerate mode: most tokens generated per sample.
    max_new_tokens: int = 512
    #: SGLang regenerate mode: the sampling temperature.
    temperature: float = 0.0
    #: SGLang only: more SGLang server arguments (``hscapture extract ... -- ARGS``, as for ``serve``).
    sglang_args: list[str] = field(default_factory=list)


@dataclass
class ExtractSummary:
    samples: int
    tokens: int
    seconds: float
    skipped: int
    store: dict[str, Any]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def default_data_path() -> Path:
    """The embedded demo dataset, written once next to the tiny model."""
    from hscapture.tiny import DEFAULT_DIR, write_demo_jsonl

    path = DEFAULT_DIR.parent / "demo-200.jsonl"
    if not path.exists():
        write_demo_jsonl(path, n=200)
    return path


def load_model(model_dir: Path | None, dtype: str | None, device: str) -> tuple[Any, Any, Path]:
    """Tokenizer and eval-mode causal LM; with no directory, the embedded tiny Llama."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from hscapture.tiny import ensure_tiny_model

    path = Path(model_dir) if model_dir is not None else ensure_tiny_model()
    if not (path / "config.json").exists():
        raise ValueError(f"--model: {str(path)!r} has no config.json; give a local HF model directory")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path)
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype] if dtype else "auto"}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
    return tokenizer, model, path


def done_keys(out: Path) -> set[str]:
    """Keys the store at ``out`` already holds complete (empty for a new store)."""
    if not (out / META_FILE).exists():
        return set()
    return set(open_store(out).keys(complete_only=True))


def loss_mask_ranges(mask: list[int]) -> list[tuple[int, int]]:
    """0/1 per token -> half-open ``[start, end)`` ranges of ones."""
    ranges: list[tuple[int, int]] = []
    start = None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            ranges.append((start, i))
            start = None
    return ranges


def kept_rows(attention_mask: torch.Tensor) -> torch.Tensor:
    """Flat indices of the real (non-padding) rows of a ``[B, T]`` batch, request by request."""
    return torch.nonzero(attention_mask.reshape(-1), as_tuple=True)[0]


def run_batch(capture: HFCapture, producer: Producer, model: Any, batch: list[Sample], pad_id: int) -> int:
    """One forward call over a right-padded batch; announce the real rows; finish each request."""
    input_ids, attention_mask = pad_batch(batch, pad_id)
    device = next(model.parameters()).device
    with torch.inference_mode():
        model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    states = capture.collect()
    lengths = [len(s.input_ids) for s in batch]
    producer.capture_step(
        states,
        request_ids=[s.key for s in batch],
        request_rows=lengths,
        positions=torch.cat([torch.arange(n) for n in lengths]),
        token_ids=torch.cat([torch.tensor(s.input_ids) for s in batch]),
        row_index=kept_rows(attention_mask).to(device),
    )
    for sample in batch:
        producer.finish_request(
            sample.key, num_tokens=len(sample.input_ids), loss_mask=loss_mask_ranges(sample.loss_mask)
        )
    return sum(lengths)


def start_consumer(endpoint: str, options: ExtractOptions) -> subprocess.Popen:
    """``hscapture consume`` in its own process, exiting at our end of stream or when we die."""
    command = consume_command(
        endpoint,
        options.out,
        *("--shard-bytes", str(options.shard_bytes), "--writer-threads", str(options.writer_threads)),
        *(("--store-dtype", options.store_dtype) if options.store_dtype is not None else ()),
        *("--exit-on-eos", "--watch-pid", str(os.getpid()), "--quiet", *options.consumer_args),
    )
    return subprocess.Popen(command)


def extract(options: ExtractOptions) -> ExtractSummary:
    """Run the whole extraction; see the module docstring.

    Raises:
        ValueError: bad options (layer out of range, unreadable data, unwritable output).
        HSCaptureError: the consumer process failed.
    """
    out = Path(options.out)
    ensure_writable_dir(out, "--out")
    check_store_dtype(out, store_dtype_name(options.store_dtype, "--store-dtype"))
    if options.engine == "sglang":
        from hscapture.integrations.sglang_offline import extract_with_sglang

        return extract_with_sglang(options)
    if options.engine != "hf":
        raise ValueError(f"--engine: {options.engine!r} is unknown; use hf or sglang")
    if options.mode != "teacher":
        raise ValueError("--mode regenerate needs --engine sglang (the HF engine runs teacher forcing only)")
    if options.sglang_args:
        raise ValueError(f"{' '.join(options.sglang_args)}: arguments after -- are SGLang's; they need --engine sglang")
    tokenizer, model, model_path = load_model(options.model, options.dtype, options.device)
    num_layers = model.config.num_hidden_layers
    layers = options.layers if options.layers is not None else eagle3_default_layers(num_layers)
    data = Path(options.data) if options.data is not None else default_data_path()
    skip = done_keys(out)
    samples = list(load_samples(data, tokenizer, options.max_length, skip_keys=skip))
    if options.limit is not None:
        samples = samples[: options.limit]
    if skip:
        print(f"resuming {out}: {len(skip)} samples already captured, {len(samples)} to go", file=sys.stderr)
    if not samples:  # nothing left to capture: no producer, no consumer
        return ExtractSummary(0, 0, 0.0, len(skip), open_store(out).summary() if skip else {})
    batches = plan_batches(samples, options.max_batch_tokens, options.max_batch_size)
    longest = max((len(s.input_ids) for s in samples), default=1)
    config = _capture_config(model, layers, options, max(options.max_batch_tokens, longest))
    endpoint = config.endpoint
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    meta = {"engine": "hf", "model": str(model_path), "data": str(data), "dtype": config.dtype}
    started = time.monotonic()
    tokens = done = 0
    with HFCapture(model, layers, options.capture_last) as capture:
        consumer = start_consumer(endpoint, options)

        def consumer_alive() -> None:
            if consumer.poll() is not None:
                raise HSCaptureError(f"consumer exited with code {consumer.returncode}; see its message above")

        try:
            producer = Producer(
                config,
                tensor_descriptions=describe(layers, options.capture_last, num_layers),
                meta=meta,
                watchdog=consumer_alive,
            )
        except BaseException:
            consumer.kill()
            raise
        try:
            bar = tqdm(total=sum(len(s.input_ids) for s in samples), unit="tok", disable=not options.progress)
            with bar:
                for batch in batches:
                    consumer_alive()
                    tokens += run_batch(capture, producer, model, batch, pad_id)
                    done += len(batch)
                    bar.set_postfix(samples=f"{done}/{len(samples)}", refresh=False)
                    bar.update(sum(len(s.input_ids) for s in batch))
        finally:
            counters = producer.close()
            code = wait_consumer(consumer)
    seconds = time.monotonic() - started
    if code != 0:
        raise HSCaptureError(f"consumer exited with code {code}; the store at {out} keeps what was committed")
    if counters.rows_dropped:
        raise HSCaptureError(f"{counters.rows_dropped} rows dropped under block policy: this is a bug")
    store = open_store(out).summary()
    return ExtractSummary(len(samples), tokens, seconds, len(skip), store)


def _capture_config(model: Any, layers: tuple[int, ...], options: ExtractOptions, max_rows: int) -> CaptureConfig:
    dtype = options.dtype or dtype_name(next(model.parameters()).dtype)
    hidden = model.config.hidden_size
    row_bytes = (len(layers) + int(options.capture_last)) * hidden * DTYPES[dtype].itemsize
    slot_bytes = max(MiB, -(-row_bytes // 256) * 256)
    rows_per_slot = slot_bytes // row_bytes
    slots = max(8, 2 * -(-max_rows // rows_per_slot))
    return CaptureConfig(
        layers=layers,
        hidden_size=hidden,
        num_layers=model.config.num_hidden_layers,
        capture_last=options.capture_last,
        dtype=dtype,
        slot_bytes=slot_bytes,
        ring_bytes=slots * slot_bytes,
        max_step_rows=max_rows,
        policy="block",
        endpoint=f"ipc:///tmp/hscapture-{os.getuid()}/extract-{os.getpid()}",
        device="cuda" if torch.device(options.device).type == "cuda" else "cpu",  # GPU models get the CUDA ring
    )


def wait_consumer(consumer: subprocess.Popen, timeout_s: float = 120.0) -> int:
    """The consumer's exit status, stopping it (it then finishes the store) if it outlives the timeout."""
    try:
        return consumer.wait(timeout_s)
    except subprocess.TimeoutExpired:
        consumer.terminate()
        return consumer.wait(10)
