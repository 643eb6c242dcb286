"""One validated configuration for a capture run, shared by the producer and the consumer.

Every field is checked in ``__post_init__`` so a bad value fails at start-up, before any
model is loaded or any socket is bound, with a message that names the field, the value
received and the allowed range.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch is imported where a tensor is made: a consumer writing a store never imports it
    import torch

MiB = 1 << 20
#: Slots start on this boundary so every dtype view and vectorised copy is aligned.
SLOT_ALIGN = 256

#: Rows a ring slot holds by default for a serving engine: a decode run of 16 steps at batch 128, 8 at batch 256.
#: A run's host work (its token ids from every request, its announcement) is paid once per run: at 512 rows a
#: slot, batch 256 made runs of 2 steps and SGLang's hooks cost ~240 µs a step on the H200 (a 4 MiB slot holds
#: 73 rows of Kimi-K2.5's EAGLE-3 set, 57 KiB each: not even one step at batch 256).
SLOT_ROWS = 2048
#: Slots a ring has by default at least: a run holds its slot while it grows.
RING_SLOTS = 8


def default_slot_bytes(row_bytes: int, rows: int = SLOT_ROWS) -> int:
    """Slot bytes for ``rows`` rows of ``row_bytes``, at least 4 MiB, whole :data:`SLOT_ALIGN` blocks.

    Sized in rows, not bytes: every slot costs the same host work whatever it holds (an announcement, a copy
    per tensor out of the ring), so wide rows in fixed-size slots pay it every few rows.
    """
    return max(4 * MiB, -(-rows * row_bytes // SLOT_ALIGN) * SLOT_ALIGN)


def default_ring_bytes(slot_bytes: int, row_bytes: int, max_rows: int) -> int:
    """Room for two of the engine's largest steps (``max_rows`` rows), and at least :data:`RING_SLOTS` slots."""
    return max(RING_SLOTS, 2 * -(-max_rows // (slot_bytes // row_bytes))) * slot_bytes


#: Storage dtypes by name, with their bytes per value. The ring and the shards hold rows in exactly this dtype.
DTYPES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}

#: What ``ConsumerConfig.direct_io`` accepts.
DIRECT_IO = ("auto", "on", "off")
#: What ``store_dtype`` accepts, by name: the name written to ``meta.json``. None stores the captured dtype.
STORE_DTYPES: dict[str, str] = {"fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}

Policy = Literal["block", "drop"]
POLICIES = ("block", "drop")


def default_endpoint() -> str:
    """An ipc:// endpoint in a per-user directory, so two users on one host never meet."""
    return f"ipc:///tmp/hscapture-{os.getuid()}/default"


def usable_cores() -> int:
    """Cores this process may run on (its affinity, which a container's cpuset narrows; all of them where
    the platform does not say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_writer_threads(direct: bool) -> int:
    """Shard writer threads for a store whose row planes go out with O_DIRECT (``direct``) or not.

    Through the page cache, 2: one shard is checksummed and handed to the kernel while the other
    reaches the disk. Measured on the H200 host's disk (ext4, ``benchmarks/run.py store
    --consumer-args '--writer-threads N'``, 4 GiB of bf16 rows): 1 thread wrote at 0.87 of a raw
    sequential write + fsync, 2 at 1.10, 4 at 0.80, 8 at 0.65; more shards written at once
    interleave in the cache and on the disk and slow every one of them.

    With O_DIRECT, 4: each write waits for the disk and its thread idles there, so more of them keep
    the disk busy. On the 2-core CPU host (``--compare-consumer-args '--writer-threads 4'``, 2 GiB per
    repeat, five pairs side by side) 4 threads stored bf16 in 1.23-1.45 s against 1.53-1.86 s with 2,
    fp8 in 1.00-1.26 s against 0.99-1.45 s.
    """
    return 4 if direct else 2


def store_dtype_name(value: str | None, field_name: str = "store_dtype") -> str | None:
    """The ``meta.json`` name of a requested storage dtype (None: as captured), or a ValueError naming the field."""
    if value is None or value in STORE_DTYPES:
        return None if value is None else STORE_DTYPES[value]
    raise ValueError(
        f"{field_name}: {value!r} is not a storage dtype; use 'fp8' (float8_e4m3fn with one scale per row, "
        "half the bytes of bf16) or leave it unset to store rows as captured"
    )


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``DTYPES`` name."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported for capture; use one of {sorted(DTYPES)}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The config name of a torch dtype (inverse of :func:`torch_dtype`)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} is not supported for capture; use one of {sorted(DTYPES)}")
    return name


def eagle3_default_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default aux layers in hscapture's convention: ``[2, L // 2, L - 3]``.

    These are the tensors SGLang captures by default and SpecForge's ``[1, L//2-1, L-4]``
    names with ids one lower.
    """
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


def flag(
    *,
    name: str | None = None,
    positional: str | None = None,
    choices: Sequence[str] | None = None,
    cli: bool = True,
    parse: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """Metadata for the command-line flag an options-dataclass field becomes (``hscapture.cli`` reads it).

    A field is a flag by default: ``--field-name``, its ``#:`` comment as the help text, parsed by
    its type (``*_bytes`` fields take sizes like ``256M``). Pass this as ``field(metadata=...)``
    only to change that.

    Args:
        name: the flag's spelling instead of ``--field-name`` (for a boolean that defaults to
            true, the spelling whose ``--no-`` form turns it off).
        positional: make it a positional argument shown as this name.
        choices: the values it accepts.
        cli: False keeps the field off the command line.
        parse: what turns its text into the field's value, instead of its type (a ValueError says what is wrong).
    """
    return {"cli": {"name": name, "positional": positional, "choices": choices, "cli": cli, "parse": parse}}


def check_layer_ids(layers: Sequence[int], num_layers: int, field_name: str = "layers") -> None:
    """Layer ids of a model with ``num_layers`` decoder layers are ``0..num_layers``.

    Raises:
        ValueError: an id is out of range; the message gives the range and what its ends mean.
    """
    bad = [k for k in layers if not 0 <= k <= num_layers]
    if bad:
        raise ValueError(
            f"{field_name}: {bad} out of range; the model has {num_layers} decoder layers, so ids must be in "
            f"0..{num_layers} (id k = residual stream entering layer k; {num_layers} = leaving the last layer, "
            "before the final norm); use capture_last for the post-norm final state"
        )


#: ``--layers all``: every decoder layer's output the engine can capture (ids ``1..L`` where it can).
ALL_LAYERS = "all"
_LAYER_ITEM = re.compile(r"(\d+)(?:-(\d+)(?::(\d+))?)?")
#: What a layer spec looks like, said in every error about one.
_LAYER_FORMS = "give ids and ranges, e.g. 2,16,29 or 0-32 or 0-32:4 or 1-8,16,24-32:4, or all"


def layer_spec(value: str | Sequence[int], field_name: str = "--layers") -> str | tuple[int, ...]:
    """A layer selection checked for form alone (no model needed): :data:`ALL_LAYERS`, or the ids it names in order.

    Text is ids and ranges separated by commas or spaces: ``K``; ``A-B`` (``A..B``, both included);
    ``A-B:S`` (every ``S``-th from ``A``, up to ``B``); or ``all`` alone. A sequence of ints is taken as the ids.

    Raises:
        ValueError: a part that is neither, a range running backwards or with step 0, a layer named twice.
    """
    if not isinstance(value, str):
        ids = tuple(value)
        for k in ids:
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise ValueError(f"{field_name}: {k!r} is not a layer id; ids are ints >= 0 ({_LAYER_FORMS})")
        repeated = sorted({k for k in ids if ids.count(k) > 1})
        if repeated:
            raise ValueError(f"{field_name}: layers {repeated} named twice in {list(ids)}; name each layer once")
        return ids
    items = value.replace(",", " ").split()
    if [item.lower() for item in items] == [ALL_LAYERS]:
        return ALL_LAYERS
    ids: list[int] = []  # none: only what capture_last adds
    named: dict[int, str] = {}
    for item in items:
        match = _LAYER_ITEM.fullmatch(item)
        if match is None:
            why = "all stands alone (it names every layer)" if item.lower() == ALL_LAYERS else _LAYER_FORMS
            raise ValueError(f"{field_name}: {item!r} in {value!r} is not a layer id or range; {why}")
        start, end, step = match.groups()
        first, last, every = int(start), int(end if end is not None else start), int(step or 1)
        if last < first or every < 1:
            raise ValueError(
                f"{field_name}: {item!r} is an empty range; give START-END[:STEP] with START <= END and STEP >= 1"
            )
        for k in range(first, last + 1, every):
            if k in named:
                raise ValueError(f"{field_name}: layer {k} named twice ({named[k]} and {item}); name each layer once")
            named[k] = item
            ids.append(k)
    return tuple(ids)


def resolve_layers(
    value: str | Sequence[int],
    num_layers: int,
    capturable: tuple[int, int] | None = None,
    engine: str = "",
    field_name: str = "--layers",
) -> tuple[int, ...]:
    """The layer ids a selection names for a model of ``num_layers`` decoder layers.

    Args:
        value: as :func:`layer_spec` takes it.
        num_layers: the model's decoder layers ``L`` (ids are ``0..L``).
        capturable: the first and last id the engine can capture (default ``0..L``).
        engine: who captures, for the error (``SGLang's LlamaForCausalLM``).
        field_name: the option named in errors.

    Returns:
        The ids, in the order named. ``all``: every decoder layer's output the engine captures, ids
        ``max(1, first)..last`` (layer 0, the embedding output, is a function of the token id alone:
        name it to have it).

    Raises:
        ValueError: as :func:`layer_spec`, or an id the model or the engine does not have, named with
            the range it has.
    """
    lo, hi = capturable if capturable is not None else (0, num_layers)
    spec = layer_spec(value, field_name)
    if spec == ALL_LAYERS:
        return tuple(range(max(1, lo), hi + 1))
    assert not isinstance(spec, str)
    check_layer_ids(spec, num_layers, field_name)
    bad = [k for k in spec if not lo <= k <= hi]
    if bad:
        who = engine or "this engine"
        raise ValueError(
            f"{field_name}: {who} captures layers {lo}..{hi} of the model's {num_layers}, got {bad} "
            "(hscapture's numbering: layer k = the residual stream entering decoder layer k)"
        )
    return spec


@dataclass
class CaptureConfig:
    """Everything a capture run needs; both processes validate the same object.

    Layer ids follow one convention everywhere in hscapture: layer ``k`` is the residual
    stream *entering* decoder layer ``k`` (hidden + residual, before its input norm). That is
    HF's ``output_hidden_states[k]`` and SGLang's ``layers_to_capture`` entry ``k`` (which
    SGLang's Llama setter derives from a requested EAGLE-3 id ``k - 1``). Id ``num_layers``
    is the residual stream leaving the last layer, before the final norm (vLLM's aux layer id
    ``num_layers``, speculators' verifier state). ``capture_last`` adds the final hidden state
    after the model's last norm.
    """

    #: Decoder layers whose entering residual stream is captured, in store order.
    layers: tuple[int, ...]
    #: Width of one row (the model's hidden size).
    hidden_size: int
    #: Decoder layers in the model; when known, layer ids are checked against it.
    num_layers: int | None = None
    #: Also capture the post-norm output of the last layer (what the LM head reads).
    capture_last: bool = True
    #: Dtype of the rows in the ring and on disk; the engine's activation dtype.
    dtype: str = "bfloat16"
    #: Bytes of one ring slot; one slot carries one chunk of rows of all captured layers.
    slot_bytes: int = 4 * MiB
    #: Total ring bytes (a whole number of slots); more slots absorb consumer hiccups.
    #: None sizes it for two steps of ``max_step_rows`` (at least 4 slots).
    ring_bytes: int | None = None
    #: Most rows one forward step may bring (the engine's max tokens per batch).
    max_step_rows: int = 8192
    #: ``block`` waits for ring credit and loses nothing; ``drop`` never waits and counts drops.
    policy: Policy = "block"
    #: Base ZeroMQ endpoint; ``-announce`` and ``-release`` sockets hang off it.
    endpoint: str = field(default_factory=default_endpoint)
    #: Secret a consumer must present to attach; None makes one per run for an ipc:// endpoint
    #: (published in a 0600 file beside it, for consumers of the same user) and none for tcp://,
    #: where the consumer's CURVE key is the credential (a token given here is checked as well).
    token: str | None = None
    #: Key directory for a tcp:// endpoint: this user's CURVE key pair (made if missing) and the
    #: consumer keys admitted besides its own (``allowed/``); None = ``$HSCAPTURE_KEYS`` or
    #: ``~/.config/hscapture/keys``. See :mod:`hscapture.keys`.
    keys: Path | None = None
    #: Where the engine's activations live: ``cpu`` (host shared-memory ring) or ``cuda[:N]``
    #: (GPU ring exported over CUDA IPC).
    device: str = "cpu"
    #: In ``block`` mode, seconds to wait for credit before raising (0 = forever).
    block_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        self.layers = tuple(self.layers)
        if not self.layers and not self.capture_last:
            raise ValueError("layers: nothing to capture; give at least one layer id or set capture_last")
        for layer in self.layers:
            if not isinstance(layer, int) or isinstance(layer, bool):
                raise TypeError(f"layers: ids must be ints, got {layer!r}")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers: duplicate ids in {list(self.layers)}; list each layer once")
        if self.num_layers is not None:
            _check_int("num_layers", self.num_layers, 1)
            check_layer_ids(self.layers, self.num_layers)
        elif any(k < 0 for k in self.layers):
            raise ValueError(f"layers: ids must be >= 0, got {list(self.layers)}")
        _check_int("hidden_size", self.hidden_size, 1)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is unknown; use 'block' (lossless) or 'drop' (never waits)")
        _check_int("slot_bytes", self.slot_bytes, 1)
        if self.slot_bytes < self.row_bytes:
            raise ValueError(
                f"slot_bytes: {self.slot_bytes} cannot hold one row of {self.row_bytes} bytes "
                f"({self.num_tensors} tensors x hidden {self.hidden_size} x {self.itemsize} bytes); "
                f"raise slot_bytes to at least {self.row_bytes}"
            )
        if self.slot_bytes % SLOT_ALIGN:
            raise ValueError(
                f"slot_bytes: {self.slot_bytes} is not a multiple of {SLOT_ALIGN}; "
                f"use {-(-self.slot_bytes // SLOT_ALIGN) * SLOT_ALIGN}"
            )
        _check_int("max_step_rows", self.max_step_rows, 1)
        if self.ring_bytes is None:
            self.ring_bytes = max(4, 2 * -(-self.max_step_rows // self.rows_per_slot)) * self.slot_bytes
        _check_int("ring_bytes", self.ring_bytes, 2 * self.slot_bytes)
        if self.ring_bytes % self.slot_bytes:
            raise ValueError(
                f"ring_bytes: {self.ring_bytes} is not a whole number of slots of slot_bytes={self.slot_bytes}; "
                f"use {self.num_slots * self.slot_bytes} or {(self.num_slots + 1) * self.slot_bytes}"
            )
        ring_rows = self.num_slots * self.rows_per_slot
        if ring_rows < self.max_step_rows:
            need = -(-self.max_step_rows // self.rows_per_slot) * self.slot_bytes
            raise ValueError(
                f"ring_bytes: the ring holds {ring_rows} rows ({self.num_slots} slots x {self.rows_per_slot} rows of "
                f"{self.row_bytes} bytes) but one step may bring max_step_rows={self.max_step_rows}; "
                f"raise ring_bytes to at least {need} or lower max_step_rows"
            )
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"endpoint: {self.endpoint!r} must start with ipc:// or tcp://")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(self.device)):
            raise ValueError(f"device: {self.device!r} is not supported; use 'cpu' or 'cuda' / 'cuda:N'")
        if self.block_timeout_s < 0:
            raise ValueError(f"block_timeout_s: must be >= 0 (0 waits forever), got {self.block_timeout_s}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def tensor_names(self) -> list[str]:
        """Store names of the captured tensors, in slot order."""
        return [f"layer_{k}" for k in self.layers] + (["last"] if self.capture_last else [])

    @property
    def num_tensors(self) -> int:
        return len(self.layers) + int(self.capture_last)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row across all captured tensors."""
        return self.num_tensors * self.hidden_size * self.itemsize

    @property
    def rows_per_slot(self) -> int:
        return self.slot_bytes // self.row_bytes

    @property
    def num_slots(self) -> int:
        assert self.ring_bytes is not None  # set in __post_init__
        return self.ring_bytes // self.slot_bytes

    def to_dict(self) -> dict:
        data = asdict(self)
        data["layers"] = list(self.layers)
        data["keys"] = None if self.keys is None else str(self.keys)
        return data


@dataclass
class ConsumerConfig:
    """The consumer process's settings; what to read comes from the producer's handshake."""

    #: Store directory (created; an existing store is appended to); none when discarding.
    out_dir: Path | None = field(default=None, metadata=flag(name="--out"))
    #: The producer's base ZeroMQ endpoint to attach to.
    endpoint: str = field(default_factory=default_endpoint)
    #: Target bytes per shard.
    shard_bytes: int = 256 * MiB
    #: Threads writing shards to disk in parallel; by default 4 where the row planes go out with
    #: O_DIRECT (each write waits for the disk), else 2.
    writer_threads: int | None = None
    #: Shard buffers (``shard_bytes`` of host memory each, pinned for a CUDA ring); by default writer threads + 2.
    shard_buffers: int | None = None
    #: A shard open longer than this is written even if not full (quiet servers still persist).
    flush_s: float = 30.0
    #: Bytes of a shard a writer thread writes before it asks the kernel to start writing them to the
    #: disk (0: nothing reaches the disk before the shard's fsync, so it idles while shards are copied).
    writeback_bytes: int = 16 * MiB
    #: Write the shards' row planes with O_DIRECT, straight from the shard buffers to the disk: no copy
    #: into the page cache (CPU time), but each write waits for the disk. ``auto``: on for a host ring
    #: (a CPU engine, whose cores are the limit), off for a CUDA ring (idle cores: the cache keeps the
    #: disk busier). Off where the filesystem refuses it (said in the log).
    direct_io: str = field(default="auto", metadata=flag(choices=DIRECT_IO))
    #: How often the consumer says hello while waiting, and heartbeats while attached.
    heartbeat_ms: int = 200
    #: Exit after the producer's end of stream (offline extraction) instead of waiting for the next run.
    exit_on_eos: bool = False
    #: Sleep this long per chunk: simulates a slow consumer (tests, drop-policy benchmarks).
    delay_ms: float = 0.0
    #: Confirm an attach only once this file exists: holds the consumer between opening the producer's ring
    #: and confirming, where a CUDA one spends seconds, so a test decides what the producer does meanwhile.
    attach_gate: Path | None = None
    #: Finish the store and exit when this process is gone (the extraction that started us).
    watch_pid: int | None = None
    #: Copy chunks out and release them but write nothing (drain-rate benchmarks).
    discard: bool = False
    #: The producer's token; None reads it from the file beside an ipc:// endpoint (a tcp:// producer
    #: needs one only when it was given one).
    token: str | None = None
    #: Key directory for a tcp:// endpoint: this consumer's CURVE key pair (``hscapture keys`` makes
    #: it); by default ``$HSCAPTURE_KEYS`` or ``~/.config/hscapture/keys``.
    keys: Path | None = None
    #: The tcp:// producer's public key file; by default ``id.key`` of the key directory (a producer
    #: of the same user sharing it).
    producer_key: Path | None = None
    #: ``fp8`` stores rows as float8_e4m3fn with one float32 scale per row, half the bytes of bf16,
    #: quantized by this consumer, never the engine (on the GPU before the copy out of a CUDA ring,
    #: by the writer threads for a host ring); unset stores them as captured (or as the existing
    #: store does).
    store_dtype: str | None = field(default=None, metadata=flag(choices=sorted(STORE_DTYPES)))
    #: Threads quantizing a host ring's rows to fp8 at once, one tensor each; by default one per
    #: captured tensor, at most half the cores (1: all on the consumer's own thread).
    quantize_threads: int | None = None
    #: Let this group read the store (directory setgid 2750, files 0640); by default the store is
    #: private to you (0700, 0600), or shared as an existing store already is.
    share_group: str | None = None
    #: A descriptor of the store's ``.lock`` that the process starting this consumer has locked
    #: already (``hscapture extract`` passes its own, so no other writer gets in between): the
    #: consumer writes under that lock instead of taking it.
    store_lock_fd: int | None = None

    def __post_init__(self) -> None:
        self.store_dtype = store_dtype_name(self.store_dtype)
        if self.out_dir is None and not self.discard:
            raise ValueError("out_dir: the consumer needs an output directory (or discard=True)")
        self.out_dir = None if self.out_dir is None else Path(self.out_dir)
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"endpoint: {self.endpoint!r} must start with ipc:// or tcp://")
        _check_int("shard_bytes", self.shard_bytes, 1)
        _check_int("writeback_bytes", self.writeback_bytes, 0)
        if self.direct_io not in DIRECT_IO:
            raise ValueError(f"direct_io: {self.direct_io!r}; one of {', '.join(DIRECT_IO)}")
        if self.writer_threads is not None:
            _check_int("writer_threads", self.writer_threads, 1, 64)
        if self.shard_buffers is not None:
            _check_int("shard_buffers", self.shard_buffers, 2, 256)
        if self.quantize_threads is not None:
            _check_int("quantize_threads", self.quantize_threads, 1, 64)
        _check_int("heartbeat_ms", self.heartbeat_ms, 1, 60_000)
        if self.flush_s <= 0:
            raise ValueError(f"flush_s: must be > 0 seconds, got {self.flush_s}")
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms: must be >= 0, got {self.delay_ms}")

    def check_out_dir(self) -> Path:
        """Create ``out_dir`` if needed and prove it writable, or raise naming the path."""
        assert self.out_dir is not None
        return ensure_writable_dir(self.out_dir, "out_dir")


def ensure_writable_dir(path: Path, field_name: str) -> Path:
    """Create ``path`` if needed (private: 0700) and prove it writable, or raise a ValueError naming ``field_name``.

    The probe is a new file of an unpredictable name, created exclusively without following links.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # made meanwhile by another job sharing it: fine, if writable
            os.mkdir(path, 0o700)
        probe = path / f".hscapture-write-probe.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{field_name}: {str(path)!r} is not writable ({exc.strerror}); pick another") from None
    return path


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name}: {value} is out of range; must be {allowed}")


def read_model_config(model: Path | str) -> dict[str, Any]:
    """config.json of a model, read as JSON (not by transformers: Kimi-K2.5's model type is an engine's own).

    ``model`` is a local directory, or a hub id whose config.json is fetched the way the engines
    fetch the model (huggingface_hub's cache; ``HF_HUB_OFFLINE`` respected).
    """
    path = Path(model) / "config.json"
    if not Path(model).exists():
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(str(model), "config.json"))
        except Exception as exc:
            raise ValueError(
                f"model {str(model)!r}: no such directory, and no config.json on the hub ({exc})"
            ) from None
    try:
        values = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"model {str(model)!r} has no config.json; give a HF model directory") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return values


def num_layers_of(config: dict[str, Any]) -> int:
    """Decoder layers of the (text) model: ``text_config.num_hidden_layers`` for multimodal wrappers."""
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers")
    if not isinstance(layers, int) or layers <= 0:
        raise ValueError(f"config.json: no positive num_hidden_layers (got {layers!r})")
    return layers
