"""GPU suite: capture overhead in tok/s on a Llama-3.1-8B-sized serving loop, every variant side by side.

    python benchmarks/run.py gpu                            # the GPU run (8B dims, random bf16 weights)
    python benchmarks/run.py gpu --tiny --device cpu        # a smoke run anywhere (tiny dims, host ring)

The engine is :mod:`benchmarks.lean_llama` (HF ``LlamaForCausalLM`` modules, a lean static-cache
forward), driven like a serving loop: every step the sampled tokens are read back to the host,
as an engine must to detokenize and stop requests. Decode runs one CUDA graph per batch size and
variant; prefill runs eagerly on 8192-token batches. The EAGLE-3 set is captured: the residual
stream entering layers ``[2, L/2, L-3]`` and the post-norm last state (``--layers`` names others:
``all`` is every decoder layer's output, 1..L; more than three go into the graph's ring copy side by
side, one concatenation). Variants, interleaved repeat by repeat (order rotated; repeat 0 is warm-up
and not reported), medians of synchronized
wall time. ``--variants`` picks the ones beside ``off`` (default ``drop,block,write-only,dump,tolist``):
with every layer, ``dump`` and ``tolist`` take minutes a step and a storing ring writes every row it gets, so
the run checks the disk first (:func:`check_disk`). Once the loop is built, Python's collector is told to ignore
its start-up heap (``--gc freeze``, as vLLM's EngineCore does after start-up), so that a collection mid-loop scans
only what the loop made; each variant's record counts the collections in its timed steps. Variants:

* ``off``: the loop alone;
* ``drop`` / ``block``: hscapture with a consumer process writing a store to disk, through its
  engine-facing API: decode graphs hold the producer's ring copy (``Producer.graph_rows``), and after
  each replay ``capture_step`` of the graph's outputs only plans where its rows go; prefill calls
  ``capture_step`` on the eager states;
* ``discard`` (in ``--variants``): ``drop`` with a consumer that copies every slot out and writes nothing, so that
  the engine's cost is told apart from the disk's (issue 31: every layer, ``--layers all``);
* ``dump``: the usual engine patch, synchronous ``.cpu()`` + ``torch.save`` every step;
* ``tolist``: SGLang's built-in path, ``.cpu().clone().tolist()`` per request every step (the
  capture set is a graph output, as SGLang's aux hidden states are);
* ``write-only`` (decode on a GPU, a diagnostic outside the goals): the in-graph ring write alone,
  no host hooks and no consumer, which splits hscapture's cost into GPU write and the rest.

Beside the loop, in the same run: the consumer's drain rate against a plain pinned D2H copy of
the same bytes (``gpu_ring.bench_drain``), and the store's write rate against a raw sequential
write + fsync of the same bytes to the same directory (``store_rate.measure``), rows stored as
captured (``store``) and as fp8 (``store_fp8``).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import gpu_ring, store_rate
from benchmarks.lean_llama import LLAMA_8B, TINY, KVCache, LeanLlama, random_llama
from benchmarks.report import Outcome, SuiteSkipped, SuiteSpec
from hscapture import CaptureConfig, Producer, open_store
from hscapture.config import MiB, resolve_layers
from hscapture.consumer import consume_command
from hscapture.integrations.hf import describe, eagle3_default_layers
from hscapture.producer.row_kernel import MAX_SOURCES

GiB = 1 << 30
VARIANTS = ("off", "drop", "block", "dump", "tolist")
#: The usual patch and SGLang's built-in path: seconds a step, timed in rounds of their own (``bench_decode``).
BASELINES = ("dump", "tolist")
#: What ``--variants`` may name, and what it names by default (``off`` is always run).
CHOICES = ("drop", "block", "discard", "write-only", "dump", "tolist")
DEFAULT_VARIANTS = ("drop", "block", "write-only", "dump", "tolist")
#: Share of the work dir's free space a run may fill at most (the results and the OS need the rest).
DISK_SHARE = 0.8
POLICIES = ("drop", "block")
#: Ring variants: name -> its producer's policy, and whether its consumer discards what it copies out.
RINGS = {"drop": ("drop", False), "block": ("block", False), "discard": ("drop", True)}
#: The issue-31 goal with every layer: decode at batch 64 within 2 % of off (discarding; storing under drop).
WIDE_GOAL = 0.98
#: The issue's figure for reading 8B bf16 weights once on the H200, beside the one measured here.
WEIGHT_READ_MS_REFERENCE = 4.4
#: Goals: decode tok/s against capture off at every batch, prefill in every repeat, and the engine thread's time
#: in the capture calls per decode step at batch 1-64 (microseconds).
DECODE_GOAL, PREFILL_GOAL, HOST_US_GOAL = 0.995, 0.99, 20.0
#: Capture costs at or below this are timer noise; the .tolist() speed-up divides by at least this.
COST_FLOOR_US = 1.0
#: Settings per mode: the GPU run, and the tiny smoke run (CPU or GPU).
DEFAULTS: dict[str, dict[str, Any]] = {
    "full": {
        "batches": (1, 16, 64, 256),
        "context": 512,
        "decode_steps": 32,
        "repeats": 5,
        "prefill_tokens": 8192,
        "prefill_seqs": 4,
        "prefill_steps": 6,
        "prefill_repeats": 5,
        "slot_mib": 32,
        "ring_slots": 32,
        "drain_gib": 4.0,
        "drain_repeats": 3,
        "store_gib": 4.0,
        "store_repeats": 2,
    },
    "tiny": {
        "batches": (1, 4),
        "context": 16,
        "decode_steps": 6,
        "repeats": 2,
        "prefill_tokens": 64,
        "prefill_seqs": 2,
        "prefill_steps": 2,
        "prefill_repeats": 1,
        "slot_mib": 1,
        "ring_slots": 16,
        "drain_gib": 0.25,
        "drain_repeats": 2,
        "store_gib": 1 / 64,
        "store_repeats": 1,
    },
}


# ---------------------------------------------------------------------------------------------- options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny Llama dims (a smoke run; runs on a CPU too)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if visible")
    parser.add_argument("--batches", type=_ints, help="decode batch sizes (default 1,16,64,256; --tiny 1,4)")
    parser.add_argument("--context", type=int, help="tokens already in each sequence's cache when decode starts")
    parser.add_argument("--decode-steps", type=int, help="decode steps per timed loop")
    parser.add_argument("--repeats", type=int, help="timed decode repeats per variant (plus one warm-up)")
    parser.add_argument("--prefill-tokens", type=int, help="tokens per prefill batch (default 8192)")
    parser.add_argument("--prefill-seqs", type=int, help="sequences per prefill batch (default 4)")
    parser.add_argument("--prefill-steps", type=int, help="prefill batches per timed loop")
    parser.add_argument("--prefill-repeats", type=int, help="timed prefill repeats per variant (plus one warm-up)")
    parser.add_argument("--slot-mib", type=int, help="ring slot size in MiB")
    parser.add_argument("--ring-slots", type=int, help="slots per ring")
    parser.add_argument(
        "--layers", help="layers captured, as hscapture extract takes them: 2,16,29, 0-32:4 or all (default EAGLE-3's)"
    )
    parser.add_argument(
        "--variants",
        type=_names,
        help=f"variants beside off, from {','.join(CHOICES)} (default {','.join(DEFAULT_VARIANTS)}; discard: a drop "
        "ring whose consumer copies out and discards)",
    )
    parser.add_argument(
        "--gc",
        choices=("freeze", "on"),
        default="freeze",
        help="freeze (default): Python's collector ignores the start-up heap once the loop is built, as vLLM's "
        "EngineCore does (freeze_gc_heap) and SGLang around its graphs; on: a collection may scan it mid-loop",
    )
    parser.add_argument("--drain-gib", type=float, help="GiB per drain-rate repeat (GPU only)")
    parser.add_argument("--drain-repeats", type=int, help="drain-rate repeats")
    parser.add_argument("--store-gib", type=float, help="GiB per store-rate repeat")
    parser.add_argument("--store-repeats", type=int, help="store-rate repeats")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="where stores and dumps go, created if missing (the disk measured; default $TMPDIR)",
    )


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers separated by commas, e.g. 1,16,64") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in CHOICES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: name variants from {','.join(CHOICES)}, separated by commas")
    return names


def check_disk(settings: dict[str, Any]) -> dict[str, float]:
    """Refuse, before any model is built, a run whose stores could fill the work dir: a ``drop`` or ``block`` ring
    stores every row it is given (``drop`` drops only what the disk cannot keep up with), every timed loop and
    warm-up; ``dump`` holds one loop's steps at a time. Every layer of an 8B model is 270 KB a row."""
    s = settings
    row_bytes = (len(s["layers"]) + 1) * s["dims"]["hidden_size"] * 2 + 64  # + position, token id, checksum
    rows = sum(s["batches"]) * s["decode_steps"] * (s["repeats"] + 1)
    rows += s["prefill_tokens"] * s["prefill_steps"] * (s["prefill_repeats"] + 1)
    storing = [ring for ring in s["rings"] if not RINGS[ring][1]]
    need = len(storing) * rows * row_bytes
    if s["dump"]:
        need += max(max(s["batches"]) * s["decode_steps"], s["prefill_tokens"] * s["prefill_steps"]) * row_bytes
    work = Path(s["work_dir"])
    probe = next(path for path in (work, *work.parents) if path.exists())  # the disk it will be made on
    free = shutil.disk_usage(probe).free
    if need > DISK_SHARE * free:
        raise ValueError(
            f"this run could write {need / GiB:.1f} GiB into {work} ({free / GiB:.1f} GiB free there): "
            f"{len(storing)} storing ring(s) ({', '.join(storing) or 'none'}) x {rows:,} rows x {row_bytes:,} B"
            f"{' + one dump loop' if s['dump'] else ''}. Store less (--variants without drop/block/dump, e.g. "
            "discard; fewer --batches, --decode-steps, --repeats, --prefill-steps or --prefill-repeats) or give "
            "--work-dir on a larger disk"
        )
    return {"could_write_gib": round(need / GiB, 1), "free_gib": round(free / GiB, 1)}


def resolve(args: argparse.Namespace) -> tuple[torch.device, dict[str, Any]]:
    """The device to run on and the settings, defaults filled in; SuiteSkipped where it cannot run."""
    has_gpu = torch.cuda.is_available()
    if args.device == "cuda" and not has_gpu:
        raise SuiteSkipped("--device cuda, but no CUDA GPU is visible to this process")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and has_gpu) else "cpu")
    if device.type == "cpu" and not args.tiny:
        raise SuiteSkipped(
            "no CUDA GPU visible: this suite serves Llama-3.1-8B dimensions under CUDA graphs and runs on a GPU "
            "host; `python benchmarks/run.py gpu --tiny --device cpu` runs the same loop with tiny dims here"
        )
    settings = dict(DEFAULTS["tiny" if args.tiny else "full"])
    for key in settings:
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    settings["batches"] = list(settings["batches"])
    for key in ("context", "decode_steps", "repeats", "prefill_tokens", "prefill_seqs", "prefill_steps"):
        if settings[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')}: must be >= 1, got {settings[key]}")
    if settings["prefill_tokens"] % settings["prefill_seqs"]:
        raise ValueError(
            f"--prefill-tokens {settings['prefill_tokens']} is not a multiple of --prefill-seqs "
            f"{settings['prefill_seqs']}; prefill batches hold equal-length sequences"
        )
    settings["dims"] = dict(TINY if args.tiny else LLAMA_8B)
    layers = settings["dims"]["num_hidden_layers"]
    settings["layers"] = list(resolve_layers(args.layers, layers) if args.layers else eagle3_default_layers(layers))
    variants = settings["variants"] = list(args.variants or DEFAULT_VARIANTS)
    settings["rings"] = [name for name in RINGS if name in variants]
    settings["write_only"] = "write-only" in variants
    settings["dump"], settings["tolist"] = "dump" in variants, "tolist" in variants
    if args.slot_mib is None:  # a slot holds as many rows as the EAGLE-3 set's (4 tensors) would: wider slots
        settings["slot_mib"] = -(-settings["slot_mib"] * (len(settings["layers"]) + 1) // 4)
    settings["gc"] = args.gc
    settings["dtype"] = "bfloat16"
    settings["graphs"] = device.type == "cuda"
    settings["work_dir"] = str(args.work_dir or tempfile.gettempdir())
    settings["disk"] = check_disk(settings)
    return device, settings


# ---------------------------------------------------------------------------------------------- variants


@dataclass
class StepMeta:
    """Host-side facts of one step, as an engine holds them: which request owns which row."""

    rows: int
    request_ids: Sequence[str]
    request_rows: Sequence[int]
    positions: np.ndarray
    token_ids: np.ndarray
    #: The step was a graph replay: its states live only in the graph (and wherever it wrote them).
    graphed: bool


class Variant:
    """How a capture method takes part in a step; ``off`` takes no part at all."""

    name = "off"
    #: Variants with the same key share one decode graph per batch size.
    graph_key = "off"

    def prepare(self, rows: int, graphed: bool) -> None:
        """Before any graph is captured: per-shape state (a ring writer, a static output)."""

    def inside(self, rows: int, states: Sequence[torch.Tensor]) -> None:
        """In the forward (captured into the decode graph): device work only."""

    def before(self, meta: StepMeta) -> None:
        """Host work before the forward (or the replay)."""

    def after(self, meta: StepMeta, states: Sequence[torch.Tensor] | None) -> None:
        """Host work after it; ``states`` is None after a replay."""

    def finish(self, request_ids: Sequence[str], num_tokens: int) -> None:
        """After a timed loop, untimed: requests end."""

    def settle(self) -> None:
        """After a timed loop, untimed: let background work of this variant finish."""


class RingWrites(Variant):
    """The ring write inside each decode graph: the producer's graph copy (``Producer.graph_rows``), captured
    after the forward; every replay's rows then go where the host plans them, with no launch."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.copy = producer.graph_rows() if producer.config.device == "cuda" else None
        #: The graph's static outputs per batch size: what each replay's copy takes.
        self.outputs: dict[int, list[torch.Tensor]] = {}

    def inside(self, rows: int, states: Sequence[torch.Tensor]) -> None:
        if self.copy is not None and torch.cuda.is_current_stream_capturing():
            if len(states) > MAX_SOURCES:  # the copy takes a few sources: the aux layers side by side, as SGLang's
                states = [torch.cat(list(states[:-1]), dim=-1), states[-1]]
            self.copy.capture(states)
            self.outputs[rows] = list(states)


class RingVariant(RingWrites):
    """hscapture through its engine-facing API: ``capture_step`` after every step (after a replay, of the graph's
    outputs, whose copy it plans), the same request tuples step after step while the batch does not change."""

    def __init__(self, producer: Producer, consumer: subprocess.Popen[Any], name: str) -> None:
        super().__init__(producer)
        self.consumer = consumer
        self.name = name
        self.graph_key = f"ring-{self.name}"

    def after(self, meta: StepMeta, states: Sequence[torch.Tensor] | None) -> None:
        if meta.graphed:
            self.copy.launched()  # type: ignore[union-attr]
            states = self.outputs[meta.rows]
        self.producer.capture_step(states, meta.request_ids, meta.request_rows, meta.positions, meta.token_ids)  # type: ignore[arg-type]

    def finish(self, request_ids: Sequence[str], num_tokens: int) -> None:
        for request_id in request_ids:
            self.producer.finish_request(request_id, "finished", num_tokens=num_tokens)

    def settle(self) -> None:
        self.producer.poll()
        gpu_ring.wait_released(self.producer, self.consumer, timeout_s=300.0)


class WriteOnlyVariant(RingWrites):
    """Diagnostic (decode under graphs): the in-graph ring write alone, no consumer and no announcement.

    Beside ``off`` it gives the write's GPU cost; ``drop``/``block`` beside it, what the host
    hooks and the consumer's copy-out add. Its producer has no consumer: every replay's copy writes
    slot 0 (one plan entry per replay, the least a host can do for it).
    """

    name = "write-only"
    graph_key = "write-only"

    def after(self, meta: StepMeta, states: Sequence[torch.Tensor] | None) -> None:
        if meta.graphed:
            self.copy.launched()  # type: ignore[union-attr]
            self.copy.plan(0, 0, meta.rows, 0, meta.rows)  # type: ignore[union-attr]


class StaticOutputVariant(Variant):
    """Baselines that read the capture set after the step from a static ``[rows, tensors, hidden]``
    output, as SGLang's graph-captured aux hidden states are read."""

    graph_key = "static"

    def __init__(self, outputs: dict[int, torch.Tensor], make_output: Callable[[int], torch.Tensor]) -> None:
        self.outputs = outputs
        self.make_output = make_output

    def prepare(self, rows: int, graphed: bool) -> None:
        if rows not in self.outputs:
            self.outputs[rows] = self.make_output(rows)

    def inside(self, rows: int, states: Sequence[torch.Tensor]) -> None:
        hidden = states[-1].shape[-1]
        torch.cat([s.reshape(s.shape[0], -1, hidden) for s in states], dim=1, out=self.outputs[rows])


class DumpVariant(StaticOutputVariant):
    """The usual engine patch: a synchronous ``.cpu()`` and ``torch.save`` of the step's states."""

    name = "dump"

    def __init__(self, outputs: dict[int, torch.Tensor], make_output: Callable[[int], torch.Tensor], directory: Path):
        super().__init__(outputs, make_output)
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.files = 0

    def after(self, meta: StepMeta, states: Sequence[torch.Tensor] | None) -> None:
        torch.save(self.outputs[meta.rows][: meta.rows].cpu(), self.directory / f"step-{self.files}.pt")
        self.files += 1

    def settle(self) -> None:
        for path in self.directory.glob("step-*.pt"):  # the disk is shared with the stores; untimed
            path.unlink()


class TolistVariant(StaticOutputVariant):
    """SGLang's built-in path: ``.cpu().clone().tolist()`` of each request's rows, every step."""

    name = "tolist"

    def after(self, meta: StepMeta, states: Sequence[torch.Tensor] | None) -> None:
        rows = self.outputs[meta.rows]
        kept = []
        start = 0
        for count in meta.request_rows:
            kept.append(rows[start : start + count].cpu().clone().tolist())
            start += count
        kept.clear()


# ---------------------------------------------------------------------------------------------- the loop


def _alive(ring: str, consumer: subprocess.Popen[Any]) -> None:
    """A ``block`` producer's watchdog: stop waiting once its consumer has exited (a full disk, a crash)."""
    if consumer.poll() is not None:
        raise RuntimeError(f"the {ring} ring's consumer exited with status {consumer.returncode}; see its stderr above")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


class ServingLoop:
    """The model, its caches, one producer + consumer per policy, the variants and the decode graphs."""

    def __init__(self, settings: dict[str, Any], device: torch.device, work: Path) -> None:
        self.settings = settings
        self.device = device
        self.work = work
        self.dtype = torch.bfloat16
        # Consumers first: their start-up (imports, CUDA context) overlaps the model's construction.
        self.endpoints = {ring: gpu_ring.endpoint(f"serve-{ring}") for ring in settings["rings"]}
        self.consumers: dict[str, subprocess.Popen[Any]] = {}
        for ring, endpoint in self.endpoints.items():
            out, discard = (None, ("--discard",)) if RINGS[ring][1] else (work / f"store-{ring}", ())
            command = consume_command(endpoint, out, "--exit-on-eos", "--quiet", *discard)
            self.consumers[ring] = subprocess.Popen([*command, "--watch-pid", str(os.getpid())])
        torch.manual_seed(0)
        self.model = random_llama(settings["dims"], device, self.dtype)
        config = self.model.config
        self.aux_layers = tuple(settings["layers"])
        self.engine = LeanLlama(self.model, self.aux_layers)
        self.descriptions = describe(self.aux_layers, True, config.num_hidden_layers)
        steps, context = settings["decode_steps"], settings["context"]
        self.capacity = -(-(context + steps + 2) // 64) * 64  # + the two warm-up steps of graph capture
        self.cache = KVCache.allocate(config, max(settings["batches"]), self.capacity, device, self.dtype)
        self.cache.randomize()
        seqs = settings["prefill_seqs"]
        self.prefill_len = settings["prefill_tokens"] // seqs
        self.prefill_cache = KVCache.allocate(config, seqs, self.prefill_len, device, self.dtype)
        rng = np.random.default_rng(0)
        vocab = config.vocab_size
        self.first_tokens = {bs: rng.integers(0, vocab, bs, dtype=np.int64) for bs in settings["batches"]}
        self.prompts = [rng.integers(0, vocab, (seqs, self.prefill_len), dtype=np.int64) for _ in range(8)]
        self.static: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            bs: (torch.zeros(bs, dtype=torch.int64, device=device), torch.zeros(bs, dtype=torch.int64, device=device))
            for bs in settings["batches"]
        }
        self.producers: dict[str, Producer] = {}
        #: The diagnostic write-only variant's producer (no consumer; GPU runs only).
        self.write_only: Producer | None = None
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.variants: list[Variant] = []

    # ------------------------------------------------------------------ setup

    def capture_config(self, policy: str, slots: int, max_rows: int, endpoint: str) -> CaptureConfig:
        """The EAGLE-3 set of this model on this device, in ``slots`` slots of ``slot_mib``."""
        s = self.settings
        return CaptureConfig(
            layers=self.aux_layers,
            hidden_size=self.model.config.hidden_size,
            num_layers=self.model.config.num_hidden_layers,
            dtype=s["dtype"],
            device=self.device.type,
            slot_bytes=s["slot_mib"] * MiB,
            ring_bytes=slots * s["slot_mib"] * MiB,
            max_step_rows=max_rows,
            policy=policy,  # type: ignore[arg-type]
            endpoint=endpoint,
            block_timeout_s=300.0,
        )

    def start_capture(self) -> None:
        """A producer per policy, attached to its consumer process (writing a store under the work dir)."""
        s = self.settings
        hidden = self.model.config.hidden_size
        for ring in s["rings"]:
            config = self.capture_config(
                RINGS[ring][0], s["ring_slots"], max(s["prefill_tokens"], *s["batches"]), self.endpoints[ring]
            )
            self.producers[ring] = Producer(
                config,
                tensor_descriptions=self.descriptions,
                meta={"engine": "benchmarks/gpu_serving.py", "dims": s["dims"]},
                watchdog=partial(_alive, ring, self.consumers[ring]),
            )
        for ring in s["rings"]:
            gpu_ring.attach(self.producers[ring], self.consumers[ring], timeout_s=180.0)
        outputs: dict[int, torch.Tensor] = {}

        def make_output(rows: int) -> torch.Tensor:
            return torch.empty(rows, self.engine.num_states, hidden, device=self.device, dtype=self.dtype)

        self.variants = [
            Variant(),
            *(RingVariant(self.producers[r], self.consumers[r], r) for r in s["rings"]),
            *([DumpVariant(outputs, make_output, self.work / "dump")] if s["dump"] else []),
            *([TolistVariant(outputs, make_output)] if s["tolist"] else []),
        ]
        if s["graphs"] and s["write_only"]:
            diagnostic = self.capture_config(
                "drop", len(s["batches"]) + 2, max(s["batches"]), gpu_ring.endpoint("serve-write-only")
            )
            self.write_only = Producer(diagnostic, tensor_descriptions=self.descriptions)
            self.variants.insert(1 + len(s["rings"]), WriteOnlyVariant(self.write_only))
        for variant in self.variants:
            variant.prepare(s["prefill_tokens"], graphed=False)
            for bs in s["batches"]:
                variant.prepare(bs, graphed=s["graphs"])

    def setup(self) -> dict[str, Any]:
        """Producers, consumers and variants; on a GPU the decode graphs too."""
        self.start_capture()
        info: dict[str, Any] = {
            "policies": list(self.producers),
            "ring": next(iter(self.producers.values())).config.to_dict() if self.producers else None,
        }
        if self.settings["graphs"]:
            copies = [v.copy for v in self.variants if isinstance(v, RingWrites)]
            if not all(copies):
                raise RuntimeError("the producer's graph copy is unavailable here (its kernels did not compile)")
            info.update(self.capture_graphs())
        if self.settings["gc"] == "freeze":  # what an engine does once started: its start-up heap is never scanned
            gc.collect()
            gc.freeze()
            info["gc_frozen_objects"] = gc.get_freeze_count()
        return info

    def decode_body(self, bs: int, variant: Variant) -> list[torch.Tensor]:
        """One decode step on the static inputs of batch ``bs``; advances them for the next step."""
        ids, positions = self.static[bs]
        states, next_ids = self.engine.decode(self.cache, ids, positions)
        variant.inside(bs, states)
        ids.copy_(next_ids)
        positions.add_(1)
        return states

    def capture_graphs(self) -> dict[str, Any]:
        """One CUDA graph per batch size and graph key (off, ring-drop, ring-block, static)."""
        started = time.perf_counter()
        for bs in self.settings["batches"]:
            for variant in self.variants:
                key = (variant.graph_key, bs)
                if key in self.graphs:
                    continue
                self.reset(bs)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up off the capture stream, as torch's graph docs ask
                    for _ in range(2):
                        self.decode_body(bs, variant)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.decode_body(bs, variant)
                self.graphs[key] = graph
        torch.cuda.synchronize()
        return {"graphs": len(self.graphs), "seconds": round(time.perf_counter() - started, 1)}

    def reset(self, bs: int) -> np.ndarray:
        """Every timed decode loop starts from the same tokens at the same position."""
        ids, positions = self.static[bs]
        tokens = self.first_tokens[bs]
        ids.copy_(torch.from_numpy(tokens))
        positions.fill_(self.settings["context"])
        return tokens

    def close(self) -> dict[str, Any]:
        """Close producers (end of stream), wait for the consumers to finish their stores, summarize."""
        self.graphs.clear()
        summaries: dict[str, Any] = {}
        for ring, producer in self.producers.items():
            counters = producer.close(timeout_s=300.0)
            code = gpu_ring.finish_consumer(self.consumers[ring], timeout_s=600.0)
            summary: dict[str, Any] = {"producer": counters.to_dict(), "consumer_exit": code}
            try:
                summary["store"] = "discarded" if RINGS[ring][1] else open_store(self.work / f"store-{ring}").summary()
            except Exception as exc:  # a failed store is a finding, not a reason to lose the figures
                summary["store"] = {"error": f"{type(exc).__name__}: {exc}"}
            summaries[ring] = summary
        if self.write_only is not None:
            self.write_only.close(timeout_s=1.0)
            self.write_only = None
        for policy, consumer in self.consumers.items():
            if policy not in self.producers:  # never attached (the run failed before): nothing to finish
                gpu_ring.stop_process(consumer)
        self.producers.clear()
        return summaries

    # ------------------------------------------------------------------ timed loops

    def time_decode(self, variant: Variant, bs: int, repeat: int) -> Timing:
        """``decode_steps`` steps of batch ``bs`` from the same start every time."""
        steps, context = self.settings["decode_steps"], self.settings["context"]
        ids, _ = self.static[bs]
        tokens = [self.reset(bs)]
        graph = self.graphs.get((variant.graph_key, bs))
        # Tuples, the same ones step after step: what an engine hands over while its batch does not change.
        request_ids = tuple(f"{variant.name}-bs{bs}-r{repeat}-{i}" for i in range(bs))
        request_rows = (1,) * bs

        def meta(step: int) -> StepMeta:
            return StepMeta(bs, request_ids, request_rows, np.full(bs, context + step), tokens[0], graph is not None)

        def forward(step: int) -> list[torch.Tensor] | None:
            if graph is None:
                return self.decode_body(bs, variant)
            graph.replay()
            return None

        def read_back(step: int) -> None:
            tokens[0] = ids.cpu().numpy()  # the engine reads its sampled tokens back every step

        timing = self._timed(variant, steps, meta, forward, read_back)
        variant.finish(request_ids, context + steps)  # the prompt rows were never captured: incomplete
        variant.settle()
        return timing

    def time_prefill(self, variant: Variant, repeat: int, steps: int | None = None) -> Timing:
        """``steps`` (default ``prefill_steps``) eager batches of ``prefill_tokens`` (equal-length sequences); on a
        GPU each forward's own time is taken with events too."""
        s = self.settings
        seqs, length, total = s["prefill_seqs"], self.prefill_len, s["prefill_tokens"]
        positions = np.tile(np.arange(length, dtype=np.int64), seqs)
        prompts = [self.prompts[step % len(self.prompts)] for step in range(steps or s["prefill_steps"])]
        events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        request_ids = [
            [f"{variant.name}-pf-r{repeat}-s{step}-{i}" for i in range(seqs)] for step in range(len(prompts))
        ]
        next_ids: list[torch.Tensor] = []

        def meta(step: int) -> StepMeta:
            return StepMeta(total, request_ids[step], [length] * seqs, positions, prompts[step].reshape(-1), False)

        def forward(step: int) -> list[torch.Tensor]:
            inputs = torch.from_numpy(prompts[step]).to(self.device)
            if self.device.type == "cuda":
                events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                events[-1][0].record()
            states, next_tokens = self.engine.prefill(self.prefill_cache, inputs)
            if events:
                events[-1][1].record()
            variant.inside(total, states)
            next_ids[:] = [next_tokens]
            return states

        def read_back(step: int) -> None:
            next_ids[0].cpu()

        timing = self._timed(variant, len(prompts), meta, forward, read_back)
        timing.gpu_ms = [start.elapsed_time(end) for start, end in events]  # synchronized by _timed
        variant.finish([rid for ids in request_ids for rid in ids], length)
        variant.settle()
        return timing

    def _timed(
        self,
        variant: Variant,
        steps: int,
        meta: Callable[[int], StepMeta],
        forward: Callable[[int], Sequence[torch.Tensor] | None],
        read_back: Callable[[int], None],
    ) -> Timing:
        """Synchronized wall time of ``steps`` steps, and the host time of the variant's hooks apart."""
        before_ns = after_ns = 0
        host_ns = np.zeros(steps, dtype=np.int64)
        collections = GcTime()
        sync(self.device)
        started = time.perf_counter()
        with collections:
            for step in range(steps):
                facts = meta(step)
                t0 = time.perf_counter_ns()
                variant.before(facts)
                t1 = time.perf_counter_ns()
                states = forward(step)
                t2 = time.perf_counter_ns()
                variant.after(facts, states)
                t3 = time.perf_counter_ns()
                read_back(step)
                before_ns += t1 - t0
                after_ns += t3 - t2
                host_ns[step] = t1 - t0 + t3 - t2
        sync(self.device)
        return Timing(
            time.perf_counter() - started, before_ns / steps / 1e3, after_ns / steps / 1e3,
            host_us=host_ns / 1e3, gc_runs=collections.runs, gc_ms=collections.seconds * 1e3,
        )  # fmt: skip

    def interleaved(
        self, timed: Callable[[Variant, int], Timing], repeats: int, variants: list[Variant]
    ) -> dict[str, Measured]:
        """Every variant once per repeat, order rotated; repeat 0 is warm-up and not kept."""
        measured = {v.name: Measured() for v in variants}
        for repeat in range(repeats + 1):
            order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
            for variant in order:
                before = _counters(variant)
                timing = timed(variant, repeat)
                if repeat:
                    measured[variant.name].add(timing, before, _counters(variant))
        return measured


@dataclass
class Timing:
    """One timed loop: synchronized wall seconds, host µs per step in the variant's before/after hooks."""

    seconds: float
    before_us: float
    after_us: float
    #: GPU milliseconds of each step's forward (events around it; eager GPU steps only).
    gpu_ms: list[float] = field(default_factory=list)
    #: Host µs of each step in the variant's hooks (before + after).
    host_us: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: Python garbage collections during the loop (any generation), and their milliseconds.
    gc_runs: int = 0
    gc_ms: float = 0.0


class GcTime:
    """Python's garbage collections while it is entered: how many, and how long they took (``gc.callbacks``).
    A collection runs inside whatever call allocated last, so it lands in some step's host time."""

    def __init__(self) -> None:
        self.runs, self.seconds, self._at = 0, 0.0, 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._at = time.perf_counter()
        else:
            self.runs += 1
            self.seconds += time.perf_counter() - self._at

    def __enter__(self) -> GcTime:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


@dataclass
class Measured:
    """A variant's timed loops over the repeats of one workload, and its producer counters' growth."""

    timings: list[Timing] = field(default_factory=list)
    counted: dict[str, int] = field(default_factory=dict)

    def add(self, timing: Timing, before: dict[str, int], after: dict[str, int]) -> None:
        self.timings.append(timing)
        for key, value in after.items():
            self.counted[key] = self.counted.get(key, 0) + value - before[key]


#: Producer counters reported per variant and workload (summed over the timed repeats).
COUNTED = ("rows_dropped", "credit_waits", "credit_wait_us")


def _counters(variant: Variant) -> dict[str, int]:
    if not isinstance(variant, RingVariant):
        return {}
    counters = variant.producer.counters
    return {key: getattr(counters, key) for key in COUNTED}


def summarize(measured: dict[str, Measured], tokens: int, steps: int) -> dict[str, Any]:
    """tok/s, ratio to off, step time and capture cost per step from each variant's repeat times."""
    off_each = [t.seconds for t in measured["off"].timings]
    off = median(off_each)
    out: dict[str, Any] = {}
    for name, data in measured.items():
        med = median([t.seconds for t in data.timings])
        out[name] = {
            "tok_per_s": round(tokens / med, 1),
            "ratio_to_off": round(off / med, 4),
            # Repeat r of every variant ran in the same round (interleaved): the worst round against off's.
            "worst_repeat_ratio": round(min(o / t.seconds for o, t in zip(off_each, data.timings)), 4),
            "step_ms": round(med / steps * 1e3, 3),
            "capture_us_per_step": round((med - off) / steps * 1e6, 1),
            "before_host_us_per_step": round(median([t.before_us for t in data.timings]), 1),
            "after_host_us_per_step": round(median([t.after_us for t in data.timings]), 1),
            **_host_spread([t.host_us for t in data.timings]),
            "gc_runs": sum(t.gc_runs for t in data.timings),
            "gc_ms": round(sum(t.gc_ms for t in data.timings), 2),
            "seconds": [round(t.seconds, 5) for t in data.timings],
            **(
                {"gpu_forward_ms": round(median([ms for t in data.timings for ms in t.gpu_ms]), 2)}
                if data.timings and data.timings[0].gpu_ms
                else {}
            ),
            **data.counted,
        }
    return out


def _host_spread(per_repeat: list[np.ndarray]) -> dict[str, float]:
    """The hooks' host µs per step over every timed step: its median, tail and mean, and what the steps over
    100 µs (a socket serve, a collection, a preempted thread) add to the mean."""
    steps = np.concatenate(per_repeat) if per_repeat else np.zeros(0)
    if not steps.size:
        return {}
    slow = steps > 100.0
    return {
        "host_us_p50": round(float(np.median(steps)), 1),
        "host_us_p90": round(float(np.percentile(steps, 90)), 1),
        "host_us_p99": round(float(np.percentile(steps, 99)), 1),
        "host_us_mean": round(float(steps.mean()), 1),
        "host_steps_over_100us": int(slow.sum()),
        "host_us_mean_from_them": round(float(steps[slow].sum() / steps.size), 1),
    }


# ---------------------------------------------------------------------------------------------- sections


def engine_facts(loop: ServingLoop) -> dict[str, Any]:
    """Sizes, and on a GPU the time to read the weights once at the copy bandwidth measured here."""
    model = loop.model
    weight_bytes = loop.engine.weight_bytes_per_decode()
    facts: dict[str, Any] = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "weight_bytes_read_per_decode_step": weight_bytes,
        "aux_layers": list(loop.aux_layers),
        "kv_cache_capacity": loop.capacity,
        "kv_cache_bytes": sum(t.numel() * t.element_size() for t in (*loop.cache.k, *loop.cache.v)),
        "attention": "decode: masked matmuls over the whole cache capacity (GQA by grouped query heads); "
        "prefill: causal SDPA",
    }
    if loop.device.type == "cuda":
        nbytes = 2 * GiB
        src = torch.empty(nbytes, dtype=torch.uint8, device=loop.device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            dst.copy_(src)
        end.record()
        end.synchronize()
        copy_bps = 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)  # bytes read + written per second
        del src, dst
        facts["d2d_copy_tb_per_s"] = round(copy_bps / 1e12, 2)
        facts["weight_read_ms"] = round(weight_bytes / copy_bps * 1e3, 3)
        facts["weight_read_ms_reference"] = WEIGHT_READ_MS_REFERENCE
        facts["gpu_memory_allocated_gib"] = round(torch.cuda.memory_allocated() / GiB, 1)
    return facts


def bench_decode(loop: ServingLoop) -> dict[str, Any]:
    """Off, the rings and ``write-only`` interleaved; the slow baselines (``dump``, ``tolist``) in rounds of their own,
    each beside an off loop of its round: a loop right after theirs, which leave the GPU idle for seconds, runs up to
    1-2 % faster at batch 256 (the first loop after ``tolist``), and in one rotation that loop is always the same
    variant's."""
    s = loop.settings
    workloads: dict[str, Any] = {}
    ours = [v for v in loop.variants if v.name not in BASELINES]
    baselines = [v for v in loop.variants if v.name in ("off", *BASELINES)]
    for bs in s["batches"]:

        def timed(variant: Variant, repeat: int, bs: int = bs) -> Timing:
            return loop.time_decode(variant, bs, repeat)

        measured = loop.interleaved(timed, s["repeats"], ours)
        workload = summarize(measured, bs * s["decode_steps"], s["decode_steps"])
        if len(baselines) > 1:
            theirs = summarize(
                loop.interleaved(timed, s["repeats"], baselines), bs * s["decode_steps"], s["decode_steps"]
            )
            workload.update({name: v for name, v in theirs.items() if name != "off"})
        workloads[f"decode bs{bs}"] = workload
    return {
        "workloads": workloads,
        "context": s["context"],
        "steps_per_loop": s["decode_steps"],
        "repeats": s["repeats"],
        "cuda_graphs": s["graphs"],
        "note": "tok/s = batch x steps / median seconds of a loop (dump and tolist against an off loop of their own "
        "rounds); each step reads the sampled tokens back "
        "(a sync, as an engine does); capture µs/step = (median - median off) / steps; before/after host µs/step = "
        "host time in the variant's hooks before the forward (or replay: on the critical path, the GPU waits) and "
        "after it (overlaps the GPU until the token read-back)",
    }


def bench_prefill(loop: ServingLoop) -> dict[str, Any]:
    """hscapture against off over ``prefill_repeats`` rounds of ``prefill_steps`` steps; the slow baselines (a
    prefill of theirs takes seconds) in one round of one step, beside an off loop of their own."""
    s = loop.settings
    ours = [v for v in loop.variants if v.name in ("off", *loop.settings["rings"])]
    baselines = [v for v in loop.variants if v.name in ("off", *BASELINES)]
    measured = loop.interleaved(loop.time_prefill, s["prefill_repeats"], ours)
    once = loop.interleaved(lambda v, r: loop.time_prefill(v, r, steps=1), 1, baselines)
    tokens, steps = s["prefill_tokens"] * s["prefill_steps"], s["prefill_steps"]
    workload = summarize(measured, tokens, steps)
    workload.update({k: v for k, v in summarize(once, s["prefill_tokens"], 1).items() if k != "off"})
    return {
        "workloads": {f"prefill {s['prefill_tokens']}": workload},
        "sequences_per_batch": s["prefill_seqs"],
        "steps_per_loop": steps,
        "repeats": s["prefill_repeats"],
        "note": "eager prefill of equal-length sequences; hscapture uses Producer.capture_step. The forward's own GPU "
        "time varies by a few % from step to step in every variant (off too: gpu_forward_ms is the median over "
        "steps), so hscapture runs several steps per round against off in the same round; dump and tolist (whole "
        "seconds per step) run one step, against an off step of their round",
    }


def bench_drain(settings: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The consumer's drain rate against a plain pinned D2H copy of the same bytes (gpu_ring.bench_drain)."""
    if device.type != "cuda":
        return {"skipped": "a GPU comparison: the drain copies device memory into pinned host memory"}
    args = argparse.Namespace(
        slot_mib=settings["slot_mib"], gib=settings["drain_gib"], repeats=settings["drain_repeats"]
    )
    try:
        return gpu_ring.bench_drain(args)
    finally:
        gpu_ring.stop_children()


def bench_store(settings: dict[str, Any], device: torch.device, work: Path, store_dtype: str | None) -> dict[str, Any]:
    """Store write rate (block producer → consumer → shards on disk) against a raw write of the same bytes.

    See ``benchmarks/store_rate.py``: timed from the first ``capture_step`` until the index's
    ``run_end`` line; the raw write is one stream of 64 MiB writes and an fsync, same directory.
    """
    gib, repeats = settings["store_gib"], settings["store_repeats"]
    return store_rate.measure(
        device, work, gib, repeats, settings["dims"]["hidden_size"], settings["slot_mib"], store_dtype,
        layers=tuple(settings["layers"]), num_layers=settings["dims"]["num_hidden_layers"],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- goals


def compute_goals(results: dict[str, Any], tiny: bool) -> dict[str, Any]:
    """The issue's goals against what was measured, each with the case that decides it."""
    workloads = {**results.get("decode", {}).get("workloads", {}), **results.get("prefill", {}).get("workloads", {})}
    goals: dict[str, Any] = {}

    def worst_ratio(names: list[str], key: str = "ratio_to_off") -> tuple[float | None, str]:
        cases = [(workloads[n][p][key], n, p) for n in names for p in POLICIES if p in workloads[n]]
        if not cases:
            return None, "not measured"
        ratio, name, policy = min(cases)
        entry = workloads[name][policy]
        off_ms = workloads[name]["off"]["step_ms"]
        return ratio, f"worst: {name} {policy}, {entry['capture_us_per_step']:+.0f} µs on a {off_ms:.2f} ms step"

    decode = [n for n in workloads if n.startswith("decode bs")]
    prefill = [n for n in workloads if n.startswith("prefill")]
    value, note = worst_ratio(decode)
    goals["decode_tok_s"] = _goal(f">= {DECODE_GOAL} of off, every batch", value, _met(value, DECODE_GOAL), note)
    value, note = worst_ratio(prefill, "worst_repeat_ratio")
    goals["prefill_tok_s"] = _goal(f">= {PREFILL_GOAL} of off, every repeat", value, _met(value, PREFILL_GOAL), note)
    hosts = [
        (workloads[n][p]["before_host_us_per_step"] + workloads[n][p]["after_host_us_per_step"], n, p)
        for n in decode
        if int(n.removeprefix("decode bs")) <= 64
        for p in POLICIES
        if p in workloads[n]
    ]
    if hosts:
        value, name, policy = max(hosts)
        value = round(value, 1)
        note = f"worst: {name} {policy} (before + after the step)"
        floor = workloads[name].get("write-only", {}).get("host_us_p50")
        if floor:  # the same host's pure-Python floor: these figures follow the host's speed as much as the code
            note += f"; write-only's hooks there {floor} µs median"
        goals["host_us_per_decode_step"] = _goal(f"<= {HOST_US_GOAL} at batch 1-64", value, value <= HOST_US_GOAL, note)

    speedups = []
    for name, entry in workloads.items():
        if "tolist" in entry and all(p in entry for p in POLICIES):
            ours = max(entry[p]["capture_us_per_step"] for p in POLICIES)
            speedups.append((entry["tolist"]["capture_us_per_step"] / max(ours, COST_FLOOR_US), name, ours))
    if speedups:
        value, name, ours = min(speedups)
        note = f"worst: {name}, capture cost .tolist() / hscapture (worse policy {ours:+.0f} µs, floor {COST_FLOOR_US})"
        goals["faster_than_tolist"] = _goal(">= 20x", round(value, 1), value >= 20, note)
    else:
        goals["faster_than_tolist"] = _goal(">= 20x", None, None, "not measured")

    drain = results.get("drain", {})
    ratio = drain.get("ratio")
    goals["drain_vs_pinned_d2h"] = _goal(
        ">= 0.90", ratio, None if ratio is None else ratio >= 0.90, drain.get("skipped", "")
    )
    for section, name in (("store", "store_vs_raw_disk"), ("store_fp8", "store_fp8_vs_raw_disk")):
        ratio = results.get(section, {}).get("ratio")
        goals[name] = _goal(f">= {store_rate.GOAL}", ratio, None if ratio is None else ratio >= store_rate.GOAL, "")

    bs64_rings = workloads.get("decode bs64", {})
    for ring in ("discard", "drop") if "discard" in bs64_rings else ():  # issue 31: serving with every layer
        ratio = bs64_rings[ring]["ratio_to_off"]
        dropped = bs64_rings[ring].get("rows_dropped", 0)
        note = (
            f"{ring}: {'consumer copies out and discards' if ring == 'discard' else 'storing'}; {dropped} rows dropped"
        )
        goals[f"decode_bs64_{ring}"] = _goal(f">= {WIDE_GOAL} of off", ratio, ratio >= WIDE_GOAL, note)

    engine = results.get("engine", {})
    bs64 = workloads.get("decode bs64", {}).get("off")
    if bs64 and engine.get("weight_read_ms"):
        value = round(bs64["step_ms"] / engine["weight_read_ms"], 2)
        note = f"bs64 off step {bs64['step_ms']:.2f} ms vs weights read once {engine['weight_read_ms']:.2f} ms"
        goals["engine_step_vs_weight_read"] = _goal("<= 2.0x", value, value <= 2.0, note)
    if tiny:
        for goal in goals.values():
            goal["note"] = ("tiny dims: a smoke run, the goals are for the 8B GPU run; " + goal["note"]).strip("; ")
    return goals


def _met(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


def _goal(target: str, value: Any, met: bool | None, note: str) -> dict[str, Any]:
    return {"target": target, "value": value, "met": met, "note": note}


# ---------------------------------------------------------------------------------------------- run


def run(args: argparse.Namespace, checkpoint: Callable[[Outcome], None]) -> Outcome:
    device, settings = resolve(args)
    if device.type == "cuda":
        torch.cuda.init()
        device_info = {"kind": "cuda", "name": torch.cuda.get_device_name(device), **gpu_ring.safe_machine()}
        tag = re.sub(r"[^a-z0-9]", "", torch.cuda.get_device_name(device).split()[-1].lower()) or "gpu"
    else:
        # Tiny matrices gain nothing from intra-op threads, whose spin-waits collide with the consumer
        # processes on a small host (steps slowed 30x on 2 cores).
        torch.set_num_threads(1)
        device_info = {"kind": "cpu", "name": f"CPU ({os.cpu_count()} cores)", "torch_threads": 1}
        tag = "cpu"
    outcome = Outcome(
        name=f"gpu-tiny-{tag}" if args.tiny else f"gpu-{tag}", device=device_info, settings=settings, results={}
    )
    work = Path(tempfile.mkdtemp(prefix="hscapture-gpu-suite-", dir=settings["work_dir"]))
    loop: ServingLoop | None = None

    def section(name: str, measure: Callable[[], dict[str, Any]]) -> None:
        started = time.perf_counter()
        print(f"[gpu suite] {name} ...", flush=True)
        try:
            outcome.results[name] = measure()
        except Exception as exc:  # one section failing must not lose the others' figures
            traceback.print_exc()
            outcome.results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        outcome.results[name]["section_seconds"] = round(time.perf_counter() - started, 1)
        outcome.goals = compute_goals(outcome.results, args.tiny)
        checkpoint(outcome)

    try:
        loop = ServingLoop(settings, device, work)
        section("engine", lambda: engine_facts(loop))
        section("setup", loop.setup)
        section("decode", lambda: bench_decode(loop))
        section("prefill", lambda: bench_prefill(loop))
        section("stores", loop.close)  # the serving consumers finish before the disk is measured alone
        section("drain", lambda: bench_drain(settings, device))
        section("store", lambda: bench_store(settings, device, work, None))
        section("store_fp8", lambda: bench_store(settings, device, work, "fp8"))
    finally:
        if loop is not None and (loop.producers or any(c.poll() is None for c in loop.consumers.values())):
            loop.close()
        gpu_ring.stop_children()
        gpu_ring.remove_endpoints()
        shutil.rmtree(work, ignore_errors=True)
        gc.unfreeze()
    return outcome


# ---------------------------------------------------------------------------------------------- report


def tok_per_s(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    groups: dict[str, dict[str, float]] = {}
    for section in ("decode", "prefill"):
        for name, entry in record["results"].get(section, {}).get("workloads", {}).items():
            groups[name] = {variant: figures["tok_per_s"] for variant, figures in entry.items()}
    return groups


def table(record: dict[str, Any]) -> str:
    results = record["results"]
    lines = [
        "| workload | variant | tok/s | vs off | step ms | capture µs/step | host µs before / after "
        "| host µs p50 / p90 | rows dropped |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for section in ("decode", "prefill"):
        data = results.get(section, {})
        if "error" in data:
            lines.append(f"| {section} | — | — | — | — | — | — | — | error: {data['error']} |")
        for name, entry in data.get("workloads", {}).items():
            for v, e in entry.items():
                lines.append(
                    f"| {name} | {v} | {e['tok_per_s']:,.0f} | {e['ratio_to_off']:.3f} | {e['step_ms']:.2f} | "
                    f"{e['capture_us_per_step']:+,.0f} | {_host_us(e)} | {_host_percentiles(e)} | "
                    f"{e.get('rows_dropped', '—')} |"
                )
    lines += ["", "| rate | hscapture GB/s | baseline GB/s | ratio | baseline |", "|---|---:|---:|---:|---|"]
    drain = results.get("drain", {})
    if "ratio" in drain:
        lines.append(
            f"| drain: consumer copy-out, `--discard` | {drain['hscapture']['gbps']:.2f} | "
            f"{drain['baseline_pinned_d2h']['gbps']:.2f} | {drain['ratio']:.3f} | plain pinned D2H, same bytes |"
        )
    else:
        lines.append(f"| drain | — | — | — | {drain.get('skipped') or drain.get('error', 'not measured')} |")
    for section, stored in (("store", ""), ("store_fp8", ", fp8")):
        store = results.get(section, {})
        if "ratio" in store:
            fs = store["filesystem"]
            lines.append(
                f"| store{stored}: capture → consumer → shards on disk | {store['store_gbps']:.2f} | "
                f"{store['raw_write_gbps']:.2f} | "
                f"{store['ratio']:.3f} | raw sequential write + fsync, same bytes, same {fs['type']} directory |"
            )
        elif section == "store" or store:
            lines.append(f"| store{stored} | — | — | — | {store.get('error', 'not measured')} |")
    lines += ["", "| goal | target | value | met | note |", "|---|---|---:|---|---|"]
    for name, goal in record["goals"].items():
        met = {True: "yes", False: "**no**", None: "—"}[goal["met"]]
        value = "—" if goal["value"] is None else goal["value"]
        lines.append(f"| {name} | {goal['target']} | {value} | {met} | {goal['note']} |")
    return "\n".join(lines)


def _host_us(figures: dict[str, Any]) -> str:
    """Host µs per step in the hooks, before / after the forward (older records keep only their sum)."""
    if "before_host_us_per_step" in figures:
        return f"{figures['before_host_us_per_step']:,.0f} / {figures['after_host_us_per_step']:,.0f}"
    return f"{figures['hook_host_us_per_step']:,.0f} (sum)"


def _host_percentiles(figures: dict[str, Any]) -> str:
    """Host µs per step in the hooks (before + after), median / 90th percentile over every step (newer records)."""
    if "host_us_p50" not in figures:
        return "—"
    return f"{figures['host_us_p50']:,.0f} / {figures['host_us_p90']:,.0f}"


SUITE = SuiteSpec(
    name="gpu",
    description="capture overhead on an 8B-Llama-sized serving loop (CUDA graphs), drain and disk rates",
    add_arguments=add_arguments,
    run=run,
    table=table,
    tok_per_s=tok_per_s,
)
