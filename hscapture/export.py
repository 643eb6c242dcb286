"""Export a store into the files a drafter trainer reads: SpecForge's offline EAGLE-3 data, or speculators'.

``specforge``: one ``torch.save``'d dict per sample, ``rows_{g}-{g+2000}/data_{i}.ckpt``, as
SpecForge's ``scripts/prepare_hidden_states.py`` writes them and its offline path reads them
(``OfflineManifestReader`` -> ``LocalFeatureStore`` -> ``FeatureDataLoader`` with EAGLE-3's
``normalize_offline_sample``): ``input_ids`` and ``loss_mask`` ``[seq]`` int64, ``hidden_state``
``[1, seq, H]`` (the post-norm final state, ``last``) and ``aux_hidden_state`` ``[1, seq, 3*H]``
(three aux layers concatenated, in ascending layer order: SpecForge's EAGLE-3 draft asserts 3H).

``speculators``: what its ``ArrowDataset`` reads from a data directory: a datasets Arrow table
(``input_ids``, ``loss_mask``, ``seq_len``; row ``i``) and ``hidden_states/hs_{i}.safetensors``
with ``token_ids`` ``[seq]`` int64 and ``hidden_states`` ``[seq, n+1, H]``: the aux layers in
ascending order, then layer ``L``, the residual stream leaving the last decoder layer *before*
the final norm (vLLM's aux id ``L``; speculators applies the verifier's norm to it itself).

Samples with an empty loss mask (no trained token) are left out and counted, as speculators'
own data preparation drops them, unless ``keep_empty_loss_mask``.

Sample ``i`` keeps its number across reruns: ``hscapture-export.jsonl`` in the output directory
lists every file once it is durable, so an interrupted export resumes where it stopped and a
rerun after more capture adds only the new samples.

A directory of parts (``extract --shard``/``--data-parallel``, ``serve``'s ``dp<rank>``) exports as
one dataset: samples numbered part by part, each key once (see
:class:`~hscapture.store.collection.StoreSet`); the set's problems (keys in two parts, parts not
captured yet) are in the summary.
"""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from tqdm import tqdm

from hscapture.config import eagle3_default_layers, flag
from hscapture.errors import StoreError
from hscapture.ownership import open_own
from hscapture.store.collection import StoreLike, StoreSet, open_store
from hscapture.store.files import prepare_store_dir, write_all, write_atomic

FORMATS = ("specforge", "speculators")
MANIFEST = "hscapture-export.jsonl"
MANIFEST_VERSION = 1
#: Files per ``rows_{start}-{end}`` folder, as SpecForge's prepare_hidden_states.py groups them.
SPECFORGE_GROUP = 2000
#: Aux layers SpecForge's EAGLE-3 draft reads (``project_hidden_states`` asserts ``3 * hidden``).
SPECFORGE_AUX = 3
LAST = "last"
_LAYER = re.compile(r"layer_(\d+)")


@dataclass
class ExportOptions:
    """What ``hscapture export`` does; every field is the command-line flag of the same name."""

    #: The hscapture store to read, or a directory of parts read as one (``extract --shard``, ``--data-parallel``).
    store: Path = field(metadata=flag(positional="DIR"))
    #: Output directory (created; resumed if it holds an export of the same kind).
    out: Path = field(metadata=flag(positional="OUT"))
    #: The trainer whose layout to write: ``specforge`` or ``speculators``.
    format: str = field(metadata=flag(choices=FORMATS))
    #: Aux layer ids, ascending in the output (default: every captured layer below ``L``).
    aux_layers: tuple[int, ...] | None = None
    #: ``specforge``: export other than three aux layers, for a draft model of your own
    #: (SpecForge's EAGLE-3 draft asserts exactly three).
    any_aux_count: bool = False
    #: The model's decoder layer count ``L``, when the store's runs do not record it.
    num_layers: int | None = None
    #: Also export incomplete samples (their rows from position 0 up to the first gap).
    include_incomplete: bool = False
    #: Also export samples whose loss mask is empty (nothing in them is trained on); by default
    #: they are left out and counted, as speculators' own data preparation drops them.
    keep_empty_loss_mask: bool = False
    #: Export at most this many samples: the first ones of the store the format takes (samples left out, e.g.
    #: for an empty loss mask, do not count; those an earlier run exported into OUT do).
    limit: int | None = None
    #: Let this group read the export (directory setgid 2750, files 0640); by default it is private to you
    #: (0700, 0600), or shared as an existing export directory already is.
    share_group: str | None = None
    #: Show a progress bar.
    progress: bool = True


@dataclass
class ExportSummary:
    #: Sample files written by this run.
    written: int = 0
    #: Samples already in the output from an earlier run (left as they are).
    kept: int = 0
    #: Incomplete samples left out (all, unless ``include_incomplete``; then those lacking position 0).
    skipped_incomplete: int = 0
    #: Samples left out because their loss mask is empty (unless ``keep_empty_loss_mask``).
    skipped_empty_loss_mask: int = 0
    #: Samples written by this run whose loss mask is empty (with ``keep_empty_loss_mask``).
    empty_loss_mask: int = 0
    #: Samples the output holds now.
    total: int = 0
    #: The aux tensors (in output order) and the final one.
    aux: list[str] = field(default_factory=list)
    final: str = ""
    #: A set of parts: keys in two parts (each exported once), parts without a store, keys in no part.
    problems: list[str] = field(default_factory=list)
    #: Samples left out because the store could not serve them (a damaged shard): ``(key, why)``, in order.
    damaged: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class _Tensors:
    aux: list[str]
    final: str


def export(options: ExportOptions) -> ExportSummary:
    """Write the export; see the module docstring.

    A sample the store cannot serve (rows or a shard that fail their checksums, a missing shard) is left
    out and named in ``summary.damaged``; every other sample is still written.

    Raises:
        ValueError: unknown format, or the store lacks a tensor the format needs (the message
            names it and the capture option that produces it), or ``out`` holds another export.
        StoreError: ``store`` is not a store, or its index or ``meta.json`` is damaged.
    """
    if options.format not in FORMATS:
        raise ValueError(f"--format: {options.format!r} is unknown; use one of {', '.join(FORMATS)}")
    if options.limit is not None and options.limit < 0:
        raise ValueError(f"--limit: {options.limit} is negative; give how many samples to export")
    store = open_store(options.store)
    tensors = choose_tensors(store, options.format, options.aux_layers, options.num_layers, options.any_aux_count)
    _refuse_selections(store, options.format)
    writer = _WRITERS[options.format]
    out = Path(options.out)
    mode = prepare_store_dir(out, options.share_group, what="export directory", option="OUT")
    manifest = _Manifest(out, {"format": options.format, "aux": tensors.aux, "final": tensors.final}, mode)
    summary = ExportSummary(aux=tensors.aux, final=tensors.final)
    if isinstance(store, StoreSet):
        summary.problems = store.problems
    keys = _eligible(store, options, summary)
    wanted = len(keys) if options.limit is None else min(options.limit, len(keys))
    bar = tqdm(total=wanted, unit="sample", desc=f"export {options.format}", disable=not options.progress)
    for key in keys:
        if summary.kept + summary.written >= wanted:
            break
        entry = manifest.entries.get(key)
        if entry is not None and (out / entry["file"]).exists():
            summary.kept += 1
            bar.update()
            continue
        index = entry["index"] if entry is not None else len(manifest.entries)
        try:
            sample = _contiguous(store.get(key, [*tensors.aux, tensors.final]))
        except StoreError as exc:  # this sample's rows are damaged: the others are still worth writing
            summary.damaged.append((key, str(exc)))
            continue
        if not len(sample["input_ids"]):  # an incomplete sample without position 0: nothing to train on
            summary.skipped_incomplete += 1
            continue
        empty = not bool(sample["loss_mask"].any())
        if empty and not options.keep_empty_loss_mask:
            summary.skipped_empty_loss_mask += 1
            continue
        path = writer.path(out, index)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(path, writer.encode(sample, tensors), mode)
        manifest.add({"index": index, "id": key, "rows": len(sample["input_ids"]), "file": str(path.relative_to(out))})
        summary.written += 1
        summary.empty_loss_mask += empty
        bar.update()
    bar.close()
    summary.total = len(manifest.entries)
    if writer.finish is not None:
        writer.finish(out, store, manifest, summary.written > 0, options.progress)
    return summary


def choose_tensors(
    store: StoreLike,
    format: str,
    aux_layers: tuple[int, ...] | None,
    num_layers: int | None,
    any_aux_count: bool = False,
) -> _Tensors:
    """The store's tensors that make the format's aux and final states, or a clear error."""
    names = store.tensor_names
    layers = sorted(int(m.group(1)) for name in names if (m := _LAYER.fullmatch(name)))
    total = num_layers if num_layers is not None else _recorded_num_layers(store)
    holds = f"{store.root} holds {names}"
    if aux_layers is None:
        aux = [k for k in layers if total is None or k < total]
    else:
        missing = sorted(set(aux_layers) - set(layers))
        if missing:
            raise ValueError(
                f"--aux-layers: {missing} not captured; {holds}. Capture them: hscapture extract --layers "
                f"{','.join(map(str, sorted({*layers, *aux_layers})))} (or CaptureConfig(layers=...))"
            )
        aux = sorted(set(aux_layers))
    if not aux:
        raise ValueError(
            f"--format {format} needs aux layers (EAGLE-3: three, 2,L/2,L-3 by default); {holds}. "
            "Capture them: hscapture extract --layers 2,16,29 (for L=32), or CaptureConfig(layers=...)"
        )
    if format == "specforge":
        if len(aux) != SPECFORGE_AUX and not any_aux_count:
            raise ValueError(_specforge_aux_error(aux, layers, total, holds))
        if LAST not in names:
            raise ValueError(
                f"--format specforge needs '{LAST}', the hidden state after the model's final norm (SpecForge's "
                f"hidden_state); {holds}. Capture it: hscapture extract without --no-last, or "
                "CaptureConfig(capture_last=True)"
            )
        return _Tensors([f"layer_{k}" for k in aux], LAST)
    if total is None:
        raise ValueError(
            f"--format speculators needs layer L, the residual stream leaving the last decoder layer, and the store "
            f"{store.root} does not record how many decoder layers the model has; give it with --num-layers"
        )
    final = f"layer_{total}"
    if final not in names:
        raise ValueError(
            f"--format speculators needs '{final}': the residual stream leaving the last decoder layer, before the "
            f"final norm (vLLM aux layer id {total}; speculators applies the verifier's norm to it, so '{LAST}', "
            f"taken after the norm, cannot stand in); {holds}. Capture it: hscapture extract --layers "
            f"{','.join(map(str, [*aux, total]))} (or CaptureConfig(layers=(..., {total})))"
        )
    return _Tensors([f"layer_{k}" for k in aux], final)


def _specforge_aux_error(aux: list[int], captured: list[int], total: int | None, holds: str) -> str:
    """Why a specforge export needs three aux layers, and which three to take (or capture)."""
    problem = (
        f"--format specforge: SpecForge's EAGLE-3 draft reads exactly {SPECFORGE_AUX} aux layers (its "
        f"project_hidden_states asserts an aux_hidden_state of {SPECFORGE_AUX} x hidden), and this export would "
        f"have {len(aux)}: {aux}"
    )
    override = "; or pass --any-aux-count for a draft model of your own that reads another number"
    if total is None:
        return (
            f"{problem}. Pick three with --aux-layers (EAGLE-3's are 2, L/2, L-3; give L with --num-layers to "
            f"see them); {holds}{override}"
        )
    eagle = list(eagle3_default_layers(total))
    ids = ",".join(map(str, eagle))
    if len(eagle) < SPECFORGE_AUX:
        return (
            f"{problem}. A model of {total} decoder layers has no three distinct EAGLE-3 layers (2, L/2, L-3): "
            f"capture three of 0..{total - 1} and pick them with --aux-layers; {holds}{override}"
        )
    if set(eagle) <= set(captured):
        return f"{problem}. Pick EAGLE-3's 2, L/2, L-3 for L={total}: --aux-layers {ids}{override}"
    below = [k for k in captured if k < total]
    pick = f" or three of the captured {below} with --aux-layers" if len(below) >= SPECFORGE_AUX else ""
    return (
        f"{problem}. Capture EAGLE-3's 2, L/2, L-3 for L={total}: hscapture extract --layers {ids} (or "
        f"CaptureConfig(layers=...)){pick}; {holds}{override}"
    )


def _recorded_num_layers(store: StoreLike) -> int | None:
    """The decoder layer count the store's runs recorded in their capture config (None if none did)."""
    counts = {
        run["meta"]["config"]["num_layers"]
        for run in store.metadata()["runs"]
        if isinstance(run.get("meta", {}).get("config"), dict) and run["meta"]["config"].get("num_layers")
    }
    if len(counts) > 1:
        raise ValueError(f"{store.root}: runs captured models with {sorted(counts)} decoder layers; export one model")
    return counts.pop() if counts else None


def _eligible(store: StoreLike, options: ExportOptions, summary: ExportSummary) -> list[str]:
    """Keys to export in store order; incomplete ones counted as skipped unless included."""
    keys = []
    for key in store:
        if store.record(key)["status"] != "complete" and not options.include_incomplete:
            summary.skipped_incomplete += 1
            continue
        keys.append(key)
    return keys


def _refuse_selections(store: StoreLike, format: str) -> None:
    """Both trainers read a row for every position (row ``i`` is position ``i``): samples captured at some positions
    only (``--positions``) cannot be exported for them.

    Raises:
        ValueError: the store holds such samples; one line, with the fix.
    """
    chosen = Counter(store.record(key).get("positions") for key in store)
    chosen.pop(None, None)
    if chosen:
        kinds = " and ".join(f"--positions {kind} ({n} samples)" for kind, n in chosen.items())
        raise ValueError(
            f"--format {format}: {store.root} holds samples captured with {kinds}, rows at some positions only, and "
            f"{format} reads a row for every position; extract them again with --positions all (the default) into "
            "another --out, or train on the rows held with hscapture.dataset.CaptureDataset"
        )


def _contiguous(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows at positions 0, 1, 2, ... up to the first gap: both trainers read position = row.

    A complete sample is all of its rows; an incomplete one (with ``include_incomplete``) keeps
    its prefix before the first missing or repeated position.
    """
    positions = sample.pop("positions")
    wrong = torch.nonzero(positions != torch.arange(len(positions)))
    n = int(wrong[0]) if len(wrong) else len(positions)
    return {name: value[:n] for name, value in sample.items()}


# ---------------------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class _Writer:
    path: Callable[[Path, int], Path]
    encode: Callable[[dict[str, torch.Tensor], _Tensors], bytes]
    #: Runs once after the sample files (with whether any was written, and the progress flag).
    finish: Callable[[Path, StoreLike, _Manifest, bool, bool], None] | None = None


def _specforge_path(out: Path, index: int) -> Path:
    group = index // SPECFORGE_GROUP * SPECFORGE_GROUP
    return out / f"rows_{group}-{group + SPECFORGE_GROUP}" / f"data_{index}.ckpt"


def _specforge_encode(sample: dict[str, torch.Tensor], tensors: _Tensors) -> bytes:
    record = {
        "input_ids": sample["input_ids"].clone(),  # clones: torch.save writes a view's whole storage
        "loss_mask": sample["loss_mask"].clone(),
        "hidden_state": sample[tensors.final].clone()[None],
        "aux_hidden_state": torch.cat([sample[name] for name in tensors.aux], dim=-1)[None],
    }
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return buffer.getvalue()


def _speculators_path(out: Path, index: int) -> Path:
    return out / "hidden_states" / f"hs_{index}.safetensors"


def _speculators_encode(sample: dict[str, torch.Tensor], tensors: _Tensors) -> bytes:
    states = torch.stack([sample[name] for name in [*tensors.aux, tensors.final]], dim=1)
    return safetensors.torch.save({"hidden_states": states, "token_ids": sample["input_ids"].contiguous()})


def _speculators_table(out: Path, store: StoreLike, manifest: _Manifest, changed: bool, progress: bool) -> None:
    """The Arrow table speculators' ArrowDataset loads with ``datasets.load_from_disk(out)``.

    Row ``i`` holds sample ``i``'s ``input_ids``, ``loss_mask`` and ``seq_len``. It is written
    into a temporary directory and moved in, ``state.json`` last, whenever samples were added.
    """
    if not changed and (out / "state.json").exists():
        return
    try:
        import datasets
        import numpy as np
        import pyarrow as pa
    except ImportError:
        raise ValueError(
            "--format speculators writes the token table with the datasets library, which is not installed: "
            "pip install 'hscapture[export]'"
        ) from None
    entries = sorted(manifest.entries.values(), key=lambda e: e["index"])
    if [e["index"] for e in entries] != list(range(len(entries))):
        raise StoreError(f"{out / MANIFEST}: sample numbers are not 0..{len(entries) - 1}; export into a new --out")
    ids, masks = [], []
    for entry in entries:
        sample = store.get(entry["id"], tensors=[])
        ids.append(sample["input_ids"][: entry["rows"]].numpy())
        masks.append(sample["loss_mask"][: entry["rows"]].numpy())
    lengths = np.array([len(a) for a in ids], dtype=np.int64)
    ends = np.concatenate([[0], np.cumsum(lengths)])
    large = ends[-1] >= 2**31  # past 32-bit list offsets: Arrow's large list
    offsets = pa.array(ends, pa.int64() if large else pa.int32())
    lists = pa.LargeListArray if large else pa.ListArray

    def column(parts: list[Any]) -> Any:
        values = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return lists.from_arrays(offsets, pa.array(values, pa.int64()))

    table = pa.table({"input_ids": column(ids), "loss_mask": column(masks), "seq_len": pa.array(lengths)})
    dataset = datasets.Dataset(table)
    dataset.set_format("torch")  # as speculators' prepare_data saves it: rows come back as int64 tensors
    staging = Path(tempfile.mkdtemp(prefix=".hscapture-table.", dir=out))  # ours alone (0700, a fresh name)
    shown = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        dataset.save_to_disk(str(staging))
    finally:
        if shown:
            datasets.enable_progress_bars()
    moved = sorted(staging.iterdir(), key=lambda p: p.name == "state.json")
    for stale in out.glob("data-*.arrow"):
        if not (staging / stale.name).exists():
            stale.unlink()
    for path in moved:
        os.chmod(path, manifest.mode)
        os.replace(path, out / path.name)
    staging.rmdir()


_WRITERS = {
    "specforge": _Writer(_specforge_path, _specforge_encode),
    "speculators": _Writer(_speculators_path, _speculators_encode, _speculators_table),
}


# ---------------------------------------------------------------------------------------- manifest


class _Manifest:
    """``hscapture-export.jsonl``: a header line, then one line per sample file once it is durable.

    Opened without following links, created with ``mode`` (the export directory's file mode).
    """

    def __init__(self, out: Path, header: dict[str, Any], mode: int) -> None:
        self.path = out / MANIFEST
        self.mode = mode
        self.entries: dict[str, dict[str, Any]] = {}
        header = {"type": "export", "version": MANIFEST_VERSION, **header}
        lines = self._read()
        if not lines:
            self._append(header)
            return
        found = {k: lines[0].get(k) for k in header}
        if found != header:
            raise ValueError(
                f"OUT: {self.path.parent} holds another export ({found}); this one is {header}. "
                "Export into another OUT directory"
            )
        for line in lines[1:]:
            self.entries[line["id"]] = line

    def add(self, entry: dict[str, Any]) -> None:
        self.entries[entry["id"]] = {"type": "sample", **entry}
        self._append(self.entries[entry["id"]])

    def _read(self) -> list[dict[str, Any]]:
        try:
            fd = open_own(self.path, os.O_RDWR, "export manifest")
        except FileNotFoundError:
            return []
        try:
            data = os.pread(fd, os.fstat(fd).st_size, 0)
            whole = data[: data.rfind(b"\n") + 1]  # a line without its newline is a crash mid-append: cut it
            if len(whole) < len(data):
                os.ftruncate(fd, len(whole))
        finally:
            os.close(fd)
        try:
            return [json.loads(line) for line in whole.splitlines()]
        except json.JSONDecodeError as exc:
            raise StoreError(f"{self.path}: not JSON lines ({exc}); export into a new OUT directory") from None

    def _append(self, record: dict[str, Any]) -> None:
        fd = open_own(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "export manifest", self.mode)
        try:
            write_all(fd, json.dumps(record, separators=(",", ":")).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
