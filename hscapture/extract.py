"""Offline bulk extraction: run an engine over a dataset and capture its hidden states to a store.

Engine-neutral: the job (resume, the consumer process, batches, progress, the summary) lives
here; an engine adapter from :mod:`hscapture.integrations` runs the model (``hf``:
:class:`~hscapture.integrations.hf.HFExtraction`, transformers in this process; ``sglang``:
:class:`~hscapture.integrations.sglang_offline.SGLangExtraction`, ``sglang.Engine`` with the
plugin; ``vllm``: :class:`~hscapture.integrations.vllm_offline.VLLMExtraction`, ``vllm.LLM`` with
its plugin). The producer side captures with the block policy (nothing is lost) and a consumer in
its own process (``hscapture consume``) writes the store, exactly as in streaming capture. Each
record is one request keyed by its id. A rerun over the same data skips every sample the store
already holds complete, so an interrupted extraction resumes without duplicating or losing samples.

Everything that can be checked cheaply is checked before the model loads: the options, every record
of the data (its JSON, key and text), and the store, whose lock this job takes at once and holds to
the end (handing it to its consumer), so a second extraction into the same ``--out`` is refused
right away instead of capturing every sample again.
Split extraction (:mod:`hscapture.partition`): ``--shard I/N`` captures only the samples whose key
hashes to ``I`` modulo ``N`` into ``OUT/part-<I>-of-<N>``, so N jobs on any hosts capture every
sample once, each resumable on its own. ``--data-parallel K`` runs K jobs on this host, one per GPU,
each in its own process with its own engine, ring and consumer, writing its own store ``OUT/dp<j>``
(with ``--shard I/N``: ``OUT/part-<I>-of-<N>-dp<j>``), under one progress bar. The jobs share the
batches (:mod:`hscapture.parallel`): they load their models at once while this process tokenizes the
data (its part, less every key complete in any store of the run, of any earlier K) and plans the
batches with :func:`plan`; each job takes the next batch when it is ready, so none waits for a slower
one and a job that loaded first takes more. A key is captured by one job; the K stores together
hold the part. ``hscapture.open_store(OUT)`` reads the stores as one dataset.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from hscapture.config import (
    STORE_DTYPES,
    MiB,
    ensure_writable_dir,
    flag,
    layer_spec,
    store_dtype_name,
    usable_cores,
)
from hscapture.consumer import consume_command
from hscapture.data import Sample, check_batching, keyed_records, load_samples, plan_batches, tokenize_workers
from hscapture.errors import HSCaptureError
from hscapture.inspection import capture_failure
from hscapture.leftovers import dirs_removed_on_failure, files_of, remove_empty, undo_unrecorded
from hscapture.parallel import Job, Shared, run_jobs
from hscapture.partition import Part
from hscapture.preflight import capture_note, sample_limit
from hscapture.selection import Positions
from hscapture.store.collection import StoreSet, is_store, named_job, named_part, part_dir, part_dirs
from hscapture.store.files import StoreLock, group_id, lock_store, prepare_store_dir
from hscapture.store.format import META_FILE, check_store_dtype
from hscapture.store.reader import Store, open_store

log = logging.getLogger(__name__)

ENGINES = ("hf", "sglang", "vllm")


@dataclass
class ExtractOptions:
    """What ``hscapture extract`` does; every field is the command-line flag of the same name."""

    #: Store directory to write (appended to and resumed if it exists).
    out: Path
    #: Local HF model directory (default: the embedded tiny Llama, built on first use).
    model: Path | None = None
    #: JSONL of OpenAI messages, ShareGPT conversations, prompt or text records (default: 200 demo conversations).
    data: Path | None = None
    #: Layer ids and ranges, k = the residual stream entering decoder layer k: 2,16,29 or 0-32 or 0-32:4
    #: (every 4th), or all (every decoder layer's output the engine captures: 1..L for HF; 0 only when named);
    #: default EAGLE-3's 2, L/2, L-3.
    layers: str | tuple[int, ...] | None = field(default=None, metadata=flag(parse=layer_spec))
    #: Positions of each sample to capture: all; loss (the trained tokens); last (its last token); every:K
    #: (positions 0, K, 2K, ...). The store records it; a rerun must give the same.
    positions: str = "all"
    #: Also capture the post-norm final hidden state (what the LM head reads).
    capture_last: bool = field(default=True, metadata=flag(name="--last"))
    #: Activation and storage dtype: bfloat16, float16 or float32 (default: the model's own).
    dtype: str | None = None
    #: Torch device to run the model on.
    device: str = "cpu"
    #: Cut samples to this many tokens (default: the model's context, its config's max_position_embeddings); the
    #: samples cut are counted and named in a warning.
    max_length: int | None = None
    #: Padded tokens per forward call.
    max_batch_tokens: int = 4096
    #: Samples per forward call.
    max_batch_size: int = 64
    #: HF engine: pad each batch's length up to a multiple of this many tokens (1: to its longest sample).
    #: Every new padded length is a new shape, and a fresh process pays a one-time cost per shape; on the
    #: extract benchmark's data 64 makes a run meet ~5x fewer shapes (168 -> 34) for ~2% more padding.
    pad_to_multiple: int = 64
    #: Capture only the first this many records of the data (with --shard, this part's share of them); a
    #: rerun with the same limit resumes exactly those (not this many more).
    limit: int | None = None
    #: Target bytes per shard.
    shard_bytes: int = 256 * MiB
    #: ``fp8``: the consumer stores rows as float8_e4m3fn with one float32 scale per row, half the
    #: bytes of bf16 (default: as captured, or as the existing store does).
    store_dtype: str | None = field(default=None, metadata=flag(choices=sorted(STORE_DTYPES)))
    #: Threads of the consumer writing shards (default 2: what keeps one disk busiest).
    writer_threads: int | None = None
    #: Processes tokenizing the data side by side (default: one per core, at most 16; none started for a data
    #: file under 1 MiB or under 4 cores). With --data-parallel, this process tokenizes for every job.
    tokenize_workers: int | None = None
    #: Show a progress bar.
    progress: bool = True
    #: Extra arguments for the consumer process (e.g. ``["--delay-ms", "5"]`` in tests).
    consumer_args: list[str] = field(default_factory=list)
    #: ``hf`` (transformers, in this process), ``sglang`` (``sglang.Engine`` with the plugin) or ``vllm``
    #: (``vllm.LLM`` with the plugin; teacher mode).
    engine: str = field(default="hf", metadata=flag(choices=("hf", "sglang", "vllm")))
    #: SGLang and vLLM: ``teacher`` (the data's tokens) or ``regenerate`` (the model writes the last turn).
    mode: str = field(default="teacher", metadata=flag(choices=("teacher", "regenerate")))
    #: Regenerate mode: most tokens generated per sample.
    max_new_tokens: int = 512
    #: SGLang on a GPU: copy decode rows from inside its decode CUDA graphs (no launch per step);
    #: --no-graph-copy: one launch per decode step from the forward hook.
    graph_copy: bool = True
    #: Regenerate mode: the sampling temperature.
    temperature: float = 0.0
    #: SGLang and vLLM: more engine arguments (``hscapture extract ... -- ARGS``: SGLang's server arguments, as for
    #: ``serve``, or vLLM's engine arguments, as ``vllm serve`` takes them).
    sglang_args: list[str] = field(default_factory=list)
    #: Let this group read the store (directory setgid 2750, files 0640); by default it is private
    #: to you (0700, 0600), or shared as an existing store already is.
    share_group: str | None = None
    #: This job's part ``I/N`` of the data: the samples whose key hashes to I modulo N, written to
    #: ``OUT/part-<I>-of-<N>``; N jobs (on any hosts) capture every sample once, each resumable.
    shard: str | None = None
    #: Jobs on this host, one per GPU (``--device cuda``), each with its own engine, ring and consumer,
    #: sharing the batches; job j writes ``OUT/dp<j>`` (with ``--shard I/N``: ``OUT/part-<I>-of-<N>-dp<j>``).
    data_parallel: int = 1


@dataclass
class ExtractSummary:
    samples: int
    tokens: int
    #: Capture time: from the consumer's attach (the first batch can go) to the store's last write.
    seconds: float
    skipped: int
    store: dict[str, Any]
    #: Samples captured by this run whose loss mask is empty (no assistant turn: nothing to train on).
    empty_loss_mask: int = 0
    #: Seconds the engine, once loaded and given its data, waited for the consumer to attach (the consumer process
    #: starts as the model begins to load, so its own start-up mostly overlaps the load).
    startup_seconds: float = 0.0
    #: The store written: ``--out``, its part for a ``--shard`` job, ``--out`` (the set) for several jobs.
    out: Path | None = None
    #: Unix time the capture began (the engine's start), for the span of jobs run side by side.
    started_at: float = 0.0
    #: Seconds to load the model (the engine's start), and to read, tokenize and batch the data: paid before capture.
    load_seconds: float = 0.0
    data_seconds: float = 0.0
    #: Several jobs (``--data-parallel``): each job's own summary, in job order (``data_seconds``: the parent's).
    jobs: tuple[ExtractSummary, ...] = ()
    #: Samples of this run cut to ``limit`` tokens (longer than the model's context or ``--max-length``), and
    #: the most tokens one of them had before.
    cut: int = 0
    longest_cut: int = 0
    #: The most tokens a sample keeps, and what sets it (``the model's context``, ``--max-length``).
    limit: int | None = None
    limit_from: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class OfflineEngine(Protocol):
    """What :func:`extract` asks of an engine adapter (the integrations implement it)."""

    #: The model's tokenizer (a transformers tokenizer: it applies the chat template).
    tokenizer: Any
    #: Facts for the store's run line (engine, model, mode, ...).
    meta: dict[str, Any]

    def start(self, endpoint: str, meta: dict[str, Any], watchdog: Callable[[], None]) -> None:
        """Start capturing to a consumer on ``endpoint``; ``watchdog`` raises if the consumer died. Buffers are sized
        from the engine's limits (e.g. ``--max-batch-tokens``), never from a sample."""

    def run(self, batch: list[Sample]) -> int:
        """Capture one batch; returns the tokens captured."""

    def waited_s(self) -> float | None:
        """Seconds spent waiting for ring credit so far (the consumer's disk), or None if unknown."""

    def end(self) -> None:
        """End the stream: the consumer finishes the store and exits."""

    def shutdown(self) -> None:
        """Release the engine (also after a failure). Idempotent."""

    def check(self, store: Store) -> None:
        """Check the finished store against what was asked (raise HSCaptureError if it differs)."""


def default_data_path() -> Path:
    """The embedded demo dataset, written once next to the tiny model."""
    from hscapture.tiny import DEFAULT_DIR, write_demo_jsonl

    path = DEFAULT_DIR.parent / "demo-200.jsonl"
    if not path.exists():
        write_demo_jsonl(path, n=200)
    return path


def done_keys(out: Path) -> set[str]:
    """Keys the store at ``out`` already holds complete (empty for a new store)."""
    if not (out / META_FILE).exists():
        return set()
    return set(open_store(out).keys(complete_only=True))


def start_consumer(endpoint: str, options: ExtractOptions, lock: StoreLock) -> subprocess.Popen:
    """``hscapture consume`` in its own process, writing under our lock of the store, exiting at our end of
    stream or when we die."""
    command = consume_command(
        endpoint,
        options.out,
        *("--shard-bytes", str(options.shard_bytes)),
        *(("--writer-threads", str(options.writer_threads)) if options.writer_threads is not None else ()),
        *(("--store-dtype", options.store_dtype) if options.store_dtype is not None else ()),
        *("--store-lock-fd", str(lock.fileno())),
        *("--exit-on-eos", "--watch-pid", str(os.getpid()), "--quiet", *options.consumer_args),
    )
    return subprocess.Popen(command, pass_fds=(lock.fileno(),))


def wait_consumer(consumer: subprocess.Popen, timeout_s: float = 120.0) -> int:
    """The consumer's exit status, stopping it (it then finishes the store) if it outlives the timeout, and
    killing it if it outlives that too."""
    try:
        return consumer.wait(timeout_s)
    except subprocess.TimeoutExpired:
        consumer.terminate()
    try:
        return consumer.wait(10)
    except subprocess.TimeoutExpired:
        consumer.kill()
        return consumer.wait()


def _cut(summary: ExtractSummary, samples: Sequence[Sample], limit: tuple[int | None, str]) -> ExtractSummary:
    """``summary`` with the count of ``samples`` that were cut to the limit."""
    cut = [s for s in samples if s.cut]
    longest = max((len(s.input_ids) + s.cut for s in cut), default=0)
    return replace(summary, cut=len(cut), longest_cut=longest, limit=limit[0], limit_from=limit[1])


def check_options(options: ExtractOptions) -> Path:
    """Everything about the options that needs no model, checked; returns the data file.

    Raises:
        ValueError: nothing to capture, a device this host lacks, a bad limit, engine, mode or share
            group, or a data file that is missing, not a file, or holds a bad record (named by line).
    """
    if options.layers is not None and not layer_spec(options.layers) and not options.capture_last:
        raise ValueError("--layers: nothing to capture (no layer ids and --no-last); give layer ids or drop --no-last")
    Positions.parse(options.positions).check_mode(options.mode)
    if options.limit is not None and options.limit < 1:
        raise ValueError(f"--limit: {options.limit}; give how many records of the data to capture (at least 1)")
    if options.max_length is not None and options.max_length < 1:
        raise ValueError(f"--max-length: {options.max_length}; give the most tokens a sample keeps (at least 1)")
    if options.tokenize_workers is not None and not 1 <= options.tokenize_workers <= 256:
        raise ValueError(f"--tokenize-workers: {options.tokenize_workers}; give 1 to 256 processes (1: none started)")
    if options.engine not in ENGINES:
        raise ValueError(f"--engine: {options.engine!r} is unknown; use one of {ENGINES}")
    if options.engine == "hf" and options.mode != "teacher":
        raise ValueError("--mode regenerate needs --engine sglang or vllm (the HF engine runs teacher forcing only)")
    if options.engine == "vllm":
        from hscapture.integrations.vllm_offline import check_engine_args, import_vllm

        import_vllm()  # not installed: said now, before the store or the consumer
        check_engine_args(options.sglang_args)
    check_batching(options.max_batch_tokens, options.max_batch_size, options.pad_to_multiple, as_flags=True)
    if options.engine == "hf" and options.sglang_args:
        raise ValueError(f"{' '.join(options.sglang_args)}: arguments after -- are SGLang's; they need --engine sglang")
    _check_device(options.device)
    if options.share_group is not None:
        group_id(options.share_group)
    data = Path(options.data) if options.data is not None else default_data_path()
    if not data.exists():
        raise ValueError(f"--data: {str(data)!r} does not exist; give a JSONL file of records")
    if not data.is_file():
        raise ValueError(f"--data: {str(data)!r} is not a file; give a JSONL file of records")
    try:
        for _ in keyed_records(data):
            pass
    except OSError as exc:
        raise ValueError(f"--data: {str(data)!r} is not readable ({exc.strerror})") from None
    return data


def _check_device(device: str) -> None:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device: {device!r} is not a torch device; use cpu or cuda[:N]") from None
    if parsed.type != "cuda":
        return
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"--device {device}: no CUDA device is visible on this host; use --device cpu")
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"--device {device}: this host has {count} CUDA device(s), cuda:0..cuda:{count - 1}")


def open_engine(options: ExtractOptions) -> OfflineEngine:
    """The engine adapter ``options.engine`` names (checked by :func:`check_options`), with its model (or
    tokenizer) loaded.

    Raises:
        ValueError: a bad model directory, dtype or layer id.
    """
    if options.engine == "vllm":
        from hscapture.integrations.vllm_offline import VLLMExtraction

        return VLLMExtraction(
            options.model, options.layers, options.capture_last, options.dtype, options.device, options.mode,
            options.max_batch_size, options.max_new_tokens, options.temperature, options.sglang_args,
            positions=options.positions,
        )  # fmt: skip
    if options.engine == "sglang":
        from hscapture.integrations.sglang_offline import SGLangExtraction

        return SGLangExtraction(
            options.model, options.layers, options.capture_last, options.dtype, options.device, options.mode,
            options.max_batch_size, options.max_new_tokens, options.temperature, options.sglang_args,
            graph_copy=options.graph_copy, positions=options.positions,
        )  # fmt: skip
    from hscapture.integrations.hf import HFExtraction

    return HFExtraction(
        options.model, options.layers, options.capture_last, options.dtype, options.device,
        options.max_batch_tokens, options.max_batch_size, options.pad_to_multiple, options.positions,
    )  # fmt: skip


#: Makes a job's progress bar from its total tokens: tqdm, or one feeding a shared bar (``parallel``).
BarFactory = Callable[[int], Any]


def extract(options: ExtractOptions, bar: BarFactory | None = None) -> ExtractSummary:
    """Run the whole extraction; see the module docstring.

    Args:
        options: what to extract.
        bar: makes the progress bar (default: tqdm on stderr unless ``options.progress`` is off).

    Raises:
        ValueError: bad options (nothing to capture, a missing device, layer out of range, unreadable
            data, unwritable output, a bad ``--shard`` or ``--data-parallel``, an ``--out`` holding another
            split); checked before the model loads.
        StoreError: another process writes the store (refused at once, naming its pid).
        HSCaptureError: the consumer process failed (for several jobs: the first job that failed).
    """
    out = Path(options.out)
    part, jobs = parse_split(options)
    data = check_options(options)
    with dirs_removed_on_failure(out):  # a refused run leaves no folder it made
        ensure_writable_dir(out, "--out")
        check_out_layout(out, part, jobs)
        if jobs > 1:
            prepare_store_dir(out, options.share_group, what="directory of parts")
            return _extract_shared(options, out, part, jobs, data)
        if part is not None:  # this job's store is its part of --out
            prepare_store_dir(out, options.share_group, what="directory of parts")
            out = out / part_dir(part)
            options = replace(options, out=out)
        show = bar or _tqdm_bar(options.progress)
        job = _Single(options, out, data, part, show)
        return _with_engine(options, out, job.capture, job.nothing_left, capture_note_of(options, out))


def _tqdm_bar(show: bool) -> BarFactory:
    return lambda total: tqdm(total=total, unit="tok", disable=not show)


def _with_engine(
    options: ExtractOptions,
    out: Path,
    capture: Callable[[OfflineEngine, subprocess.Popen], ExtractSummary],
    nothing_left: Callable[[], ExtractSummary | None] = lambda: None,
    note: str = "",
) -> ExtractSummary:
    """One job's store at ``out``: take its lock; ``nothing_left()`` (a summary: nothing to capture, so no model loads);
    start the consumer process and load the engine meanwhile (the consumer's start-up, its imports mostly, overlaps
    the model's load); ``capture(engine, consumer)``; release them all. A failure before a run was recorded removes
    what this made in ``out`` (:mod:`hscapture.leftovers`), under the lock, once the consumer is gone."""
    before = files_of(out)
    ensure_writable_dir(out, "--out")
    try:
        lock = lock_store(out, 1.0, prepare_store_dir(out, options.share_group))
    except BaseException:
        if before is None:
            remove_empty([out])
        raise
    consumer: subprocess.Popen | None = None
    try:
        check_store_dtype(out, store_dtype_name(options.store_dtype, "--store-dtype"))
        check_store_positions(out, options.positions)
        early = nothing_left()
        if early is not None:
            undo_unrecorded(out, before)  # a store made only to find nothing to do is not left behind
            return early
        if note:
            print(f"hscapture extract: {note}", file=sys.stderr, flush=True)
        consumer = start_consumer(_endpoint(), options, lock)
        _say(options, f"loading the model {model_dir(options)} ({options.engine} engine, {options.device})")
        loading = time.monotonic()
        engine = open_engine(options)
        load_seconds = time.monotonic() - loading
        try:
            summary = capture(engine, consumer)
        finally:
            engine.shutdown()
        if consumer.poll() is None:  # nothing was captured (e.g. a --data-parallel job given no batch)
            _stop_consumer(consumer)
            undo_unrecorded(out, before)
        return replace(summary, load_seconds=load_seconds)
    except BaseException:
        if consumer is not None:
            _stop_consumer(consumer)
        undo_unrecorded(out, before)
        raise
    finally:
        lock.close()


def check_store_positions(out: Path, positions: str) -> None:
    """Refuse to add samples captured at other positions to a store: a rerun skips the samples it holds complete,
    so a store of mixed selections would hold some samples at every position and others at a few.

    Raises:
        ValueError: the store's runs captured another selection (named, with the fix).
    """
    if not (out / META_FILE).exists():
        return
    wanted = str(Positions.parse(positions))
    held = sorted({str(run.get("meta", {}).get("positions", "all")) for run in open_store(out).metadata()["runs"]})
    if held and held != [wanted]:
        raise ValueError(
            f"--positions {wanted}: the store at {out} holds samples captured with --positions {' and '.join(held)}; "
            f"give --positions {held[0]} to resume it, or write to another --out"
        )


def _say(options: ExtractOptions, text: str) -> None:
    """A phase of a long command, on stderr where its progress bar is (nothing without the bar)."""
    if options.progress:
        print(f"hscapture extract: {text} ...", file=sys.stderr, flush=True)


def _endpoint() -> str:
    """This process's extraction endpoint (one job per process)."""
    return f"ipc:///tmp/hscapture-{os.getuid()}/extract-{os.getpid()}"


def _stop_consumer(consumer: subprocess.Popen) -> None:
    """Stop the consumer as Ctrl-C does (it finishes what it began) and wait until it is gone."""
    if consumer.poll() is None:
        consumer.terminate()
    wait_consumer(consumer, 30.0)


def capture_note_of(options: ExtractOptions, out: Path) -> str:
    """:func:`~hscapture.preflight.capture_note` for these options: what the store will hold and feed."""
    return capture_note(model_dir(options), options.layers, options.capture_last, options.engine, out)


def parse_split(options: ExtractOptions) -> tuple[Part | None, int]:
    """This command's part of the data (``--shard``, None: all of it) and its number of jobs (``--data-parallel``).

    Raises:
        ValueError: a bad ``--shard`` (not ``I/N`` with ``0 <= I < N``) or ``--data-parallel`` (< 1, or
            several jobs on one named GPU).
    """
    if isinstance(options.data_parallel, bool) or not isinstance(options.data_parallel, int):
        raise TypeError(f"--data-parallel: must be an int, got {options.data_parallel!r}")
    if options.data_parallel < 1:
        raise ValueError(f"--data-parallel: {options.data_parallel}; give the number of jobs (one per GPU), at least 1")
    if options.data_parallel > 1 and options.device.startswith("cuda") and options.device != "cuda":
        raise ValueError(
            f"--device {options.device} with --data-parallel {options.data_parallel}: give --device cuda; job i "
            "runs on the i-th visible GPU (set CUDA_VISIBLE_DEVICES to choose them)"
        )
    part = Part.parse(options.shard) if options.shard is not None else None
    return part, options.data_parallel


def _describe(held: Part, jobs: bool) -> str:
    """Who writes a store of part ``held``: one ``--shard`` job, or ``--data-parallel`` jobs."""
    if not jobs:
        return f"part {held} of the data, captured by one `--shard {held}` job"
    if held == Part(0, 1):
        return "the data, captured by `--data-parallel` jobs"
    return f"part {held} of the data, captured by `--shard {held} --data-parallel` jobs"


def _resume(held: Part, jobs: bool) -> str:
    """The command that resumes a store of part ``held`` as it was written."""
    if not jobs:
        return f"`--shard {held}` alone (one job writing OUT/{part_dir(held)}), and so for each such part"
    return f"`{f'--shard {held} ' if held != Part(0, 1) else ''}--data-parallel K` (any K)"


def check_out_layout(out: Path, part: Part | None, jobs: int) -> None:
    """Refuse an ``--out`` that holds another layout: a store where parts go, parts where a store goes, or
    stores of another split (or of the same part written otherwise: one ``--shard`` job against shared
    ``--data-parallel`` jobs) holding keys this command would capture again.

    Raises:
        ValueError: naming what ``out`` holds and how to resume it.
    """
    found = part_dirs(out)
    if part is None and jobs == 1:
        if found and not is_store(out):
            names = ", ".join(p.name for p in found[:4])
            raise ValueError(
                f"--out: {out} holds the parts of a split extraction ({names}); resume it with the same --shard "
                "and --data-parallel, read it with hscapture.open_store, or give another --out"
            )
        return
    if is_store(out):
        raise ValueError(
            f"--out: {out} is the store of an extraction without --shard or --data-parallel; a split extraction "
            "writes its stores (OUT/part-<i>-of-<n>, OUT/dp<j>) into a directory of their own: give another --out"
        )
    mine = part if part is not None else Part(0, 1)
    for path in found:
        by_jobs = named_job(path) is not None
        held = named_part(path) or Part(0, 1)  # dp<j>: a job of all the data
        if (held == mine and by_jobs == (jobs > 1)) or not held.overlaps(mine):
            continue  # one of this command's stores (resumed), or keys it never captures
        this = " ".join([f"--shard {part}"] * (part is not None) + [f"--data-parallel {jobs}"] * (jobs > 1))
        raise ValueError(
            f"--out: {path} holds {_describe(held, by_jobs)}; this command ({this}) would capture its keys again. "
            f"Resume that extraction as it was written, with {_resume(held, by_jobs)}, or give another --out"
        )


def run_stores(out: Path, part: Part | None) -> list[Path]:
    """The stores in ``out`` of ``--data-parallel`` jobs over ``part`` (None: all the data), of any earlier K."""
    return [p for p in part_dirs(out) if named_job(p) is not None and named_part(p) == part and is_store(p)]


def job_environments(options: ExtractOptions, jobs: int) -> list[dict[str, str]]:
    """Each job's GPUs, as ``CUDA_VISIBLE_DEVICES``: one GPU per job for ``hf``; for ``sglang`` and ``vllm`` an
    equal share of the visible GPUs (for the engine's own tensor parallelism). CPU jobs: an equal share of the
    cores (``OMP_NUM_THREADS``, unless set already): jobs whose torch threads outnumber the cores run several
    times slower than their share, as they spin waiting for each other.

    Raises:
        ValueError: a device index with several jobs, or fewer GPUs than jobs.
    """
    if jobs == 1 or (not options.device.startswith("cuda") and "OMP_NUM_THREADS" in os.environ):
        return [{} for _ in range(jobs)]
    if not options.device.startswith("cuda"):
        cores = usable_cores()
        return [{"OMP_NUM_THREADS": str(max(1, cores // jobs))} for _ in range(jobs)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        import torch

        gpus = [str(i) for i in range(torch.cuda.device_count())]
    if len(gpus) < jobs:
        raise ValueError(
            f"--data-parallel {jobs}: {len(gpus)} GPUs visible; give at most {len(gpus)} (one job per GPU)"
        )
    share = len(gpus) // jobs if options.engine in ("sglang", "vllm") else 1
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * share : (i + 1) * share])} for i in range(jobs)]


def plan(options: ExtractOptions, samples: Sequence[Sample]) -> list[list[Sample]]:
    """The batches the engine runs, in order: a function of the options and samples alone (no model), so the
    parent of ``--data-parallel`` jobs plans for them. HF: :func:`~hscapture.data.plan_batches` under the
    batch limits; SGLang: ``--max-batch-size`` samples per ``generate`` call."""
    if options.engine in ("sglang", "vllm"):
        size = options.max_batch_size
        return [list(samples[i : i + size]) for i in range(0, len(samples), size)]
    return plan_batches(samples, options.max_batch_tokens, options.max_batch_size, options.pad_to_multiple)


def model_dir(options: ExtractOptions) -> Path:
    """The model directory ``--model`` gives (the embedded tiny Llama, built once, without one).

    Raises:
        ValueError: no ``config.json`` there.
    """
    from hscapture.tiny import ensure_tiny_model

    path = Path(options.model) if options.model is not None else ensure_tiny_model()
    if not (path / "config.json").exists():
        raise ValueError(f"--model: {str(path)!r} has no config.json; give a local HF model directory")
    return path


def _pending(options: ExtractOptions, data: Path, skip: set[str], keep: Callable[[str], bool] | None) -> bool:
    """Whether a record of the data (within ``--limit``, of this part) is not captured yet: JSON only, no tokenizer."""
    records = itertools.islice(keyed_records(data), options.limit)
    return any(key not in skip and (keep is None or keep(key)) for _, _, key, _ in records)


def _extract_shared(options: ExtractOptions, out: Path, part: Part | None, jobs: int, data: Path) -> ExtractSummary:
    """K jobs, each in its own process with its own engine and store, taking the batches this process tokenizes
    and plans from one queue (:mod:`hscapture.parallel`), under one bar."""
    environments = job_environments(options, jobs)
    options = replace(options, model=model_dir(options))  # built here once, never by the jobs at once
    names = [part_dir(part, j) for j in range(jobs)]
    for name in names:
        check_store_dtype(out / name, store_dtype_name(options.store_dtype, "--store-dtype"))
        check_store_positions(out / name, options.positions)
    earlier = run_stores(out, part)
    skip: set[str] = set().union(*(done_keys(store) for store in earlier))
    keep = part.owns if part is not None else None
    if skip and not _pending(options, data, skip, keep):  # nothing left: no model loads
        print(f"resuming {out}: {len(skip)} samples already captured, 0 to go", file=sys.stderr)
        return ExtractSummary(0, 0, 0.0, len(skip), StoreSet(earlier).summary(), out=out)
    prepared: dict[str, float] = {}
    limit = sample_limit(options.max_length, options.model, options.sglang_args)
    cut: list[ExtractSummary] = []
    note = capture_note_of(options, out)
    if note:
        print(f"hscapture extract: {note}", file=sys.stderr, flush=True)
    _say(options, f"{jobs} jobs loading their models while this process reads and tokenizes {data}")

    def share(shared: Shared) -> None:
        from transformers import AutoTokenizer

        reading = time.monotonic()
        tokenizer = AutoTokenizer.from_pretrained(options.model)
        workers = options.tokenize_workers or tokenize_workers(data)
        samples = list(load_samples(data, tokenizer, limit[0], skip, options.limit, keep, workers))
        cut.append(_cut(ExtractSummary(0, 0, 0.0, 0, {}), samples, limit))
        if skip:
            print(f"resuming {out}: {len(skip)} samples already captured, {len(samples)} to go", file=sys.stderr)
        batches = plan(options, samples)
        prepared["data_seconds"] = time.monotonic() - reading
        longest = max((len(s.input_ids) for s in samples), default=None)
        shared.announce(longest, sum(len(s.input_ids) for s in samples))
        for batch in batches:
            shared.put(batch)
        shared.end()

    job_options = replace(options, data_parallel=1, progress=False)
    work = [
        Job(name, (replace(job_options, out=out / name), data, part, j), env)
        for j, (name, env) in enumerate(zip(names, environments))
    ]
    results = [
        replace(r, data_seconds=prepared.get("data_seconds", 0.0))
        for r in run_jobs(_shared_job, work, show=options.progress, share=share)
    ]
    ran = [r for r in results if r.samples]
    began = min((r.started_at for r in ran), default=0.0)
    stores = run_stores(out, part)
    summary = ExtractSummary(
        sum(r.samples for r in results), sum(r.tokens for r in results),
        max((r.started_at + r.seconds for r in ran), default=began) - began, len(skip),
        StoreSet(stores).summary() if stores else {}, sum(r.empty_loss_mask for r in results),
        max((r.startup_seconds for r in ran), default=0.0), out, began,
        max((r.load_seconds for r in results), default=0.0), prepared.get("data_seconds", 0.0), tuple(results),
    )  # fmt: skip
    return (
        replace(summary, **{k: getattr(cut[0], k) for k in ("cut", "longest_cut", "limit", "limit_from")})
        if cut
        else summary
    )


def _shared_job(
    options: ExtractOptions, data: Path, part: Part | None, job: int, bar: BarFactory, shared: Shared
) -> ExtractSummary:
    """Job ``job`` of ``--data-parallel``, in its own process: load the engine at once, then capture the batches
    it takes from ``shared`` into its own store ``options.out``."""
    out = Path(options.out)

    def capture(engine: OfflineEngine, consumer: subprocess.Popen) -> ExtractSummary:
        if shared.plan() is None:  # nothing to capture
            return ExtractSummary(0, 0, 0.0, 0, {}, out=out)
        meta = {"data": str(data), **({"part": str(part)} if part else {}), "job": job}
        return _capture(engine, options, out, consumer, iter(shared), meta, bar, 0)

    return _with_engine(options, out, capture)


@dataclass
class _Single:
    """One job alone, writing ``out``: nothing to do on a rerun that finds every sample captured (checked on the
    data's JSON, before any model or tokenizer loads); else tokenize what the store lacks, plan and capture it."""

    options: ExtractOptions
    out: Path
    data: Path
    part: Part | None
    bar: BarFactory

    def __post_init__(self) -> None:
        self.keep = self.part.owns if self.part is not None else None
        self.skip: set[str] = set()

    def nothing_left(self) -> ExtractSummary | None:
        self.skip = done_keys(self.out)
        if _pending(self.options, self.data, self.skip, self.keep):
            return None
        if self.skip:
            print(f"resuming {self.out}: {len(self.skip)} samples already captured, 0 to go", file=sys.stderr)
        return ExtractSummary(
            0, 0, 0.0, len(self.skip), open_store(self.out).summary() if self.skip else {}, out=self.out
        )

    def capture(self, engine: OfflineEngine, consumer: subprocess.Popen) -> ExtractSummary:
        options, out, data, skip = self.options, self.out, self.data, self.skip
        reading = time.monotonic()
        workers = options.tokenize_workers or tokenize_workers(data)
        limit = sample_limit(options.max_length, model_dir(options), options.sglang_args)
        _say(options, f"reading and tokenizing {data}" + (f" ({workers} processes)" if workers > 1 else ""))
        samples = list(load_samples(data, engine.tokenizer, limit[0], skip, options.limit, self.keep, workers))
        if skip:
            print(f"resuming {out}: {len(skip)} samples already captured, {len(samples)} to go", file=sys.stderr)
        batches = plan(options, samples)
        data_seconds = time.monotonic() - reading
        meta = {"data": str(data), **({"part": str(self.part)} if self.part else {})}
        total = sum(len(s.input_ids) for s in samples)
        summary = _capture(engine, options, out, consumer, batches, meta, self.bar, total, len(samples))
        return _cut(replace(summary, skipped=len(skip), data_seconds=data_seconds), samples, limit)


def _capture(
    engine: OfflineEngine,
    options: ExtractOptions,
    out: Path,
    consumer: subprocess.Popen,
    batches: Iterable[list[Sample]],
    meta: dict[str, Any],
    bar: BarFactory,
    total_tokens: int,
    total_samples: int | None = None,
) -> ExtractSummary:
    """Start the engine's producer for ``consumer`` (started already), run ``batches`` (``total_*``: what the bar
    counts to, if known), end the stream and check the store."""
    launched = time.monotonic()
    # The bar first: a job of --data-parallel asked to stop from here on stops at the bar's next update, once the
    # producer is up, and so finishes its store (stopped before, _with_engine stops the consumer, which finishes it).
    with bar(total_tokens) as progress:

        def consumer_alive() -> None:
            if consumer.poll() is not None:
                raise consumer_error(consumer.returncode, out, "; the engine was stopped")

        progress.set_postfix_str("waiting for the consumer to attach")
        engine.start(_endpoint(), meta, consumer_alive)
        started, started_at = time.monotonic(), time.time()
        progress.set_postfix_str("capturing")
        samples = tokens = empty = 0
        ended = False
        try:
            for batch in batches:
                consumer_alive()
                waited = engine.waited_s()
                tokens += engine.run(batch)
                samples += len(batch)
                empty += sum(not any(sample.loss_mask) for sample in batch)
                progress.set_postfix_str(_status(samples, total_samples, waited, engine.waited_s()), refresh=False)
                progress.update(sum(len(s.input_ids) for s in batch))
            engine.end()
            ended = True
        finally:
            if not ended:
                engine.shutdown()  # the consumer sees its producer end (or die) and finishes the store
            progress.set_postfix_str(_status(samples, total_samples, None, None) + ", finishing the store")
            code = wait_consumer(consumer)
    seconds = time.monotonic() - started
    if code != 0:
        raise consumer_error(code, out)
    store = open_store(out)
    engine.check(store)
    return ExtractSummary(samples, tokens, seconds, 0, store.summary(), empty, started - launched, out, started_at)


def consumer_error(code: int, out: Path, then: str = "") -> HSCaptureError:
    """Why the consumer stopped: the producer's original error when capture failed in the engine."""
    failure = capture_failure(out)
    if failure:
        return HSCaptureError(f"{failure}{then}; the store at {out} keeps what was committed")
    return HSCaptureError(f"consumer exited with code {code}{then}; the store at {out} keeps what was committed")


def _status(done: int, total: int | None, before: float | None, after: float | None) -> str:
    """The progress bar's postfix: samples done (of how many, if known), and whether the last batch waited for disk."""
    text = f"samples={done}/{total}" if total is not None else f"samples={done}"
    if before is None or after is None or after <= before:
        return text
    return f"{text}, waiting for disk ({after:.1f} s in all: the store is slower than the engine)"
