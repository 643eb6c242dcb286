"""``hscapture inspect``: what a store holds, for people (a short text) and scripts (a JSON dict).

Everything comes from the index and ``meta.json`` through :class:`~hscapture.store.reader.Store`
(plus a ``stat`` of the directory's files); no shard is opened, so it is quick on any size. A set of
parts (:class:`~hscapture.store.collection.StoreSet`) gets the totals (each key once), one line per
part, the keys held by two parts and the set's other problems.
"""

from __future__ import annotations

import contextlib
import re
import stat
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hscapture.config import MiB
from hscapture.store.collection import StoreSet, open_store
from hscapture.store.format import asked_rows
from hscapture.store.reader import Store

#: Capture-config keys not worth a person's attention in the text view (the JSON has them all).
_QUIET_CONFIG = ("endpoint", "token", "block_timeout_s")


def counted(n: int, noun: str) -> str:
    """``1 shard``, ``2 shards``, ``1,024 samples``: a count and its noun, plural unless one."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def export_formats(store: Any, num_layers: int | None = None) -> dict[str, dict[str, Any]]:
    """Whether ``store`` exports to each format of ``hscapture export`` as it is: per format ``{"ok": True,
    "flags": ...}`` (the export options it needs, e.g. ``--aux-layers 2,16,29``, or ``""``) or ``{"ok": False,
    "why": ...}`` (export's own refusal: the tensor missing and the capture that makes it).

    ``store`` is a store or set of parts, or anything with their ``tensor_names`` and ``root`` (and ``metadata()``
    when ``num_layers``, the model's decoder layer count, is not given).
    """
    from hscapture.config import eagle3_default_layers
    from hscapture.export import FORMATS, SPECFORGE_AUX, _recorded_num_layers, choose_tensors

    total = num_layers if num_layers is not None else _recorded_num_layers(store)
    formats: dict[str, dict[str, Any]] = {}
    for name in FORMATS:
        try:
            choose_tensors(store, name, None, total)
            formats[name] = {"ok": True, "flags": ""}
        except ValueError as exc:
            formats[name] = {"ok": False, "why": str(exc)}
        if name == "specforge" and not formats[name]["ok"] and total is not None:
            eagle = eagle3_default_layers(total)  # more than three captured: EAGLE-3's three, picked at export
            if len(eagle) == SPECFORGE_AUX and {f"layer_{k}" for k in eagle} <= set(store.tensor_names):
                with contextlib.suppress(ValueError):
                    choose_tensors(store, name, eagle, total)
                    formats[name] = {"ok": True, "flags": f"--aux-layers {','.join(map(str, eagle))}"}
    return formats


def inspect_store(path: str | Path | Sequence[str | Path], max_listed: int = 10) -> dict[str, Any]:
    """A summary of the store at ``path`` (or the set of parts there, or in a list); lists (incomplete
    samples, runs, duplicate keys) hold at most ``max_listed``.

    Raises:
        StoreError: ``path`` is neither a store nor a directory of parts.
    """
    store = open_store(path)
    roots = [part.root for part in store.parts] if isinstance(store, StoreSet) else [store.root]
    meta = store.metadata()
    summary = store.summary()
    records = [store.record(key) for key in store]
    incomplete = [r for r in records if r["status"] != "complete"]
    runs = meta["runs"]
    reasons = Counter(_reason_kind(part) for r in incomplete for part in r["reason"].split("; ") if part)
    latest = runs[-1].get("meta", {}) if runs else {}
    rates = sorted({run["meta"]["sample_rate"] for run in runs if run.get("meta", {}).get("sample_rate") is not None})
    return {
        "store": str(store.root),
        "format": meta.get("format"),
        "version": meta.get("version"),
        "dtype": meta.get("dtype"),
        "hidden_size": meta.get("hidden_size"),
        "tensors": meta.get("tensors", []),
        "requests": summary["requests"],
        "complete": summary["complete"],
        "incomplete": summary["incomplete"],
        "tokens": summary["rows"],
        "rows_shared": summary["rows_shared"],
        "requests_sharing": summary["requests_sharing"],
        "bytes_shared": summary["bytes_shared"],
        "expected_tokens": sum(r["num_tokens"] for r in records),
        "asked_tokens": sum(asked_rows(r) for r in records),
        "positions": dict(Counter(r.get("positions", "all") for r in records).most_common()),
        "sample_rates": rates,
        "loss_tokens": sum(end - start for r in records for start, end in r["loss_mask"]),
        "shards": summary["shards"],
        "bytes": summary["bytes"],
        "bytes_on_disk": sum(  # the store's own files: a link's target is not in it
            info.st_size for root in roots for p in root.iterdir() if stat.S_ISREG((info := p.lstat()).st_mode)
        ),
        "rows_dropped": summary["rows_dropped"],
        "requests_with_drops": sum(r["dropped_rows"] > 0 for r in records),
        "incomplete_reasons": dict(reasons.most_common()),
        "incomplete_samples": [
            {"id": r["id"], "reason": r["reason"], "rows": r["rows"], "num_tokens": r["num_tokens"]}
            for r in incomplete[:max_listed]
        ],
        "runs_total": len(runs),
        "runs": [_run(run) for run in runs[-max_listed:]],
        "engine": latest.get("engine"),
        "model": latest.get("model"),
        "capture": latest.get("config", {}),
        "exports": _exports(store),
        **(_set_report(store, max_listed) if isinstance(store, StoreSet) else {}),
    }


def _exports(store: Store | StoreSet) -> dict[str, dict[str, Any]]:
    """:func:`export_formats` of the store, or each format's refusal when its runs disagree on the model."""
    try:
        return export_formats(store)
    except ValueError as exc:  # e.g. runs of models with different layer counts
        from hscapture.export import FORMATS

        return {name: {"ok": False, "why": str(exc)} for name in FORMATS}


def _set_report(store: StoreSet, max_listed: int) -> dict[str, Any]:
    """Each part's counts, the keys held by more than one part, and the set's problems."""
    return {
        "parts": [_part(part) for part in store.parts],
        "duplicates": len(store.duplicates),
        "duplicate_keys": [{"id": key, "parts": held} for key, held in list(store.duplicates.items())[:max_listed]],
        "problems": store.problems,
    }


def _part(part: Store) -> dict[str, Any]:
    summary = part.summary()
    fields = ("requests", "complete", "incomplete", "rows", "shards", "bytes")
    return {"store": str(part.root), **{name: summary[name] for name in fields}}


def _reason_kind(reason: str) -> str:
    """``producer dropped 12 rows`` -> ``producer dropped N rows``: reasons counted by kind."""
    return re.sub(r"\d+", "N", reason)


def _run(run: dict[str, Any]) -> dict[str, Any]:
    end = run.get("end") or {}
    meta = run.get("meta", {})
    return {
        **({"part": run["part"]} if "part" in run else {}),
        "run_id": run["run_id"],
        "time": run.get("time"),
        "engine": meta.get("engine"),
        "model": meta.get("model"),
        "ended": end.get("reason"),
        "counters": end.get("counters", {}),
    }


def format_inspection(report: dict[str, Any]) -> str:
    """The report as a short text for a terminal."""
    dropped = report["rows_dropped"]
    parts = report.get("parts")
    lines = [
        f"store      {report['store']} ({report['format']} v{report['version']})"
        + (f", a set of {len(parts)} parts" if parts is not None else ""),
        f"engine     {report['engine'] or '?'}, model {report['model'] or '?'}",
        f"tensors    {len(report['tensors'])} x {report['hidden_size']} {report['dtype']}",
        *(f"  {t['name']:<9} {t['description']}" for t in report["tensors"]),
        f"requests   {report['requests']:,}: {report['complete']:,} complete, {report['incomplete']:,} incomplete",
        f"tokens     {report['tokens']:,} stored of "
        + (
            f"{report['expected_tokens']:,} expected"
            if report["asked_tokens"] == report["expected_tokens"]
            else f"{report['asked_tokens']:,} asked (of {report['expected_tokens']:,} positions)"
        )
        + f"; {report['loss_tokens']:,} in loss masks",
        *_selection_lines(report),
        f"shared     {report['rows_shared']:,} rows served by reference to a donor's rows "
        f"({report['requests_sharing']:,} requests; ~{report['bytes_shared'] / MiB:,.1f} MiB not stored twice)",
        f"disk       {report['bytes'] / MiB:,.1f} MiB in {counted(report['shards'], 'shard')} "
        f"({report['bytes_on_disk'] / MiB:,.1f} MiB in the directory)",
        f"drops      {dropped:,} rows dropped by the producer"
        + (f" ({report['requests_with_drops']:,} requests lost rows)" if dropped else ""),
    ]
    capture = {k: v for k, v in report["capture"].items() if k not in _QUIET_CONFIG}
    if capture:
        lines.append("capture    " + ", ".join(f"{k}={v}" for k, v in capture.items()))
    for i, (name, verdict) in enumerate(report.get("exports", {}).items()):
        how = f"yes: hscapture export {report['store']} OUT --format {name}" + (
            f" {verdict['flags']}" if verdict["ok"] and verdict["flags"] else ""
        )
        lines.append(f"{'exports' if i == 0 else '':<10} {name}: {how if verdict['ok'] else 'no: ' + verdict['why']}")
    lines.append(f"runs       {report['runs_total']}")
    for run in report["runs"]:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["time"])) if run["time"] else "?"
        lines.append(
            f"  {run['run_id']}  {started}  {run['engine'] or '?'}  "
            f"ended: {run['ended'] or 'open (no end recorded)'}"
            + (f", {run['counters']['rows_dropped']:,} rows dropped" if run["counters"].get("rows_dropped") else "")
        )
    if report["runs_total"] > len(report["runs"]):
        lines.append(f"  ... {report['runs_total'] - len(report['runs'])} earlier runs")
    if parts is not None:
        lines.append(f"parts      {len(parts)}, {report['duplicates']:,} keys in more than one part")
    for part in parts or ():
        lines.append(
            f"  {part['store']}: {part['requests']:,} requests ({part['complete']:,} complete), "
            f"{part['rows']:,} tokens, {counted(part['shards'], 'shard')}, {part['bytes'] / MiB:,.1f} MiB"
        )
    for duplicate in report.get("duplicate_keys", []):
        lines.append(f"  duplicate {duplicate['id']!r} in {' and '.join(duplicate['parts'])}")
    lines.extend(f"  problem: {problem}" for problem in report.get("problems", []))
    if report["incomplete"]:
        lines.append("incomplete " + "; ".join(f"{n:,} x {kind}" for kind, n in report["incomplete_reasons"].items()))
        for sample in report["incomplete_samples"]:
            lines.append(f"  {sample['id']}: {sample['reason']} ({sample['rows']} of {sample['num_tokens']} rows)")
        unlisted = report["incomplete"] - len(report["incomplete_samples"])
        if unlisted:
            lines.append(f"  ... and {unlisted:,} more (hscapture inspect --json --max-listed N lists more)")
    return "\n".join(lines)


def _selection_lines(report: dict[str, Any]) -> list[str]:
    """What was kept of each sample and of the requests, when not everything was: which positions, which share."""
    lines = []
    chosen = {k: n for k, n in report["positions"].items() if k != "all"}
    if chosen:
        said = "; ".join(f"{kind} ({_kept(kind)}): {n:,} samples" for kind, n in chosen.items())
        lines.append(
            f"positions  rows at some positions only: {said}"
            + (f"; all: {report['positions']['all']:,}" if "all" in report["positions"] else "")
            + ". A sample is complete when it holds every position asked; get() returns those, with their positions"
        )
    if report["sample_rates"]:
        shown = ", ".join(f"{rate:g}" for rate in report["sample_rates"])
        lines.append(
            f"sampled    requests captured at rate {shown}, chosen by a hash of the request id (--sample-rate)"
        )
    return lines


def _kept(kind: str) -> str:
    """What a ``--positions`` selection keeps, for people."""
    step = kind.partition(":")[2]
    return {"loss": "the trained tokens", "last": "each sample's last token"}.get(kind, f"positions 0, {step}, ...")


def capture_failure(out: Path) -> str:
    """The store's record of why its last run ended, if capture failed in the producer ('' otherwise)."""
    try:
        end = open_store(out).metadata()["runs"][-1]["end"] or {}
    except Exception:  # no store yet, or none readable: the consumer's own message says why
        return ""
    reason = str(end.get("reason", ""))
    return reason if reason.startswith("capture failed") else ""
