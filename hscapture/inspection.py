"""``hscapture inspect``: what a store holds, for people (a short text) and scripts (a JSON dict).

Everything comes from the index and ``meta.json`` through :class:`~hscapture.store.reader.Store`
(plus a ``stat`` of the directory's files); no shard is opened, so it is quick on any size.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hscapture.config import MiB
from hscapture.store.reader import open_store

#: Capture-config keys not worth a person's attention in the text view (the JSON has them all).
_QUIET_CONFIG = ("endpoint", "token", "block_timeout_s")


def inspect_store(path: str | Path, max_listed: int = 10) -> dict[str, Any]:
    """A summary of the store at ``path``; lists (incomplete samples, runs) hold at most ``max_listed``.

    Raises:
        StoreError: ``path`` is not a store.
    """
    store = open_store(path)
    meta = store.metadata()
    summary = store.summary()
    records = [store.record(key) for key in store]
    incomplete = [r for r in records if r["status"] != "complete"]
    runs = meta["runs"]
    reasons = Counter(_reason_kind(part) for r in incomplete for part in r["reason"].split("; ") if part)
    latest = runs[-1].get("meta", {}) if runs else {}
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
        "loss_tokens": sum(end - start for r in records for start, end in r["loss_mask"]),
        "shards": summary["shards"],
        "bytes": summary["bytes"],
        "bytes_on_disk": sum(p.stat().st_size for p in store.root.iterdir() if p.is_file()),
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
    }


def _reason_kind(reason: str) -> str:
    """``producer dropped 12 rows`` -> ``producer dropped N rows``: reasons counted by kind."""
    return re.sub(r"\d+", "N", reason)


def _run(run: dict[str, Any]) -> dict[str, Any]:
    end = run.get("end") or {}
    meta = run.get("meta", {})
    return {
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
    lines = [
        f"store      {report['store']} ({report['format']} v{report['version']})",
        f"engine     {report['engine'] or '?'}, model {report['model'] or '?'}",
        f"tensors    {len(report['tensors'])} x {report['hidden_size']} {report['dtype']}",
        *(f"  {t['name']:<9} {t['description']}" for t in report["tensors"]),
        f"requests   {report['requests']:,}: {report['complete']:,} complete, {report['incomplete']:,} incomplete",
        f"tokens     {report['tokens']:,} stored of {report['expected_tokens']:,} expected; "
        f"{report['loss_tokens']:,} in loss masks",
        f"shared     {report['rows_shared']:,} rows served by reference to a donor's rows "
        f"({report['requests_sharing']:,} requests; ~{report['bytes_shared'] / MiB:,.1f} MiB not stored twice)",
        f"disk       {report['bytes'] / MiB:,.1f} MiB in {report['shards']:,} shards "
        f"({report['bytes_on_disk'] / MiB:,.1f} MiB in the directory)",
        f"drops      {dropped:,} rows dropped by the producer"
        + (f" ({report['requests_with_drops']:,} requests lost rows)" if dropped else ""),
    ]
    capture = {k: v for k, v in report["capture"].items() if k not in _QUIET_CONFIG}
    if capture:
        lines.append("capture    " + ", ".join(f"{k}={v}" for k, v in capture.items()))
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
    if report["incomplete"]:
        lines.append("incomplete " + "; ".join(f"{n:,} x {kind}" for kind, n in report["incomplete_reasons"].items()))
        for sample in report["incomplete_samples"]:
            lines.append(f"  {sample['id']}: {sample['reason']} ({sample['rows']} of {sample['num_tokens']} rows)")
        unlisted = report["incomplete"] - len(report["incomplete_samples"])
        if unlisted:
            lines.append(f"  ... and {unlisted:,} more (hscapture inspect --json --max-listed N lists more)")
    return "\n".join(lines)
