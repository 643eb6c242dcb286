"""hscapture inspect on a store written by a real streaming run with drops (text and --json)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from hscapture import open_store
from tests.conftest import run_cli
from tests.workload import HIDDEN, Workload


def inspect_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_cli("inspect", *args)


def test_inspect_json_adds_up_to_the_store(streaming_store: tuple[Path, Workload]) -> None:
    path, workload = streaming_store
    result = inspect_cli(path, "--json", "--max-listed", "3")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    store = open_store(path)
    summary = store.summary()
    records = [store.record(key) for key in store]
    incomplete = [r for r in records if r["status"] != "complete"]
    assert (report["requests"], report["complete"], report["incomplete"]) == (
        summary["requests"],
        summary["complete"],
        summary["incomplete"],
    )
    assert report["requests"] == len(workload.requests) and report["incomplete"] == len(incomplete) > 3
    assert report["tokens"] == summary["rows"] == sum(r["rows"] for r in records)
    assert report["expected_tokens"] == sum(r["num_tokens"] for r in records) > report["tokens"]
    assert all(store.record(rid)["num_tokens"] == len(workload.requests[rid].rows) for rid in workload.finished)
    assert report["loss_tokens"] == sum(e - s for r in records for s, e in r["loss_mask"])
    assert report["rows_dropped"] == summary["rows_dropped"] > 0
    assert report["requests_with_drops"] == sum(r["dropped_rows"] > 0 for r in records) > 0
    assert (report["dtype"], report["hidden_size"]) == ("float32", HIDDEN)
    assert [t["name"] for t in report["tensors"]] == ["layer_1", "layer_3", "last"]
    assert report["shards"] == summary["shards"] and report["bytes"] == summary["bytes"]
    assert report["bytes_on_disk"] > report["bytes"]  # the shards plus index.jsonl and meta.json
    assert [s["id"] for s in report["incomplete_samples"]] == [r["id"] for r in incomplete[:3]]
    assert all(s["reason"] for s in report["incomplete_samples"])
    assert sum(report["incomplete_reasons"].values()) >= len(incomplete)
    assert report["incomplete_reasons"]["producer dropped N rows"] == report["requests_with_drops"]
    assert report["engine"] == "test" and report["capture"]["policy"] == "drop" and report["capture"]["num_layers"] == 4
    assert report["runs_total"] == 1 and report["runs"][0]["ended"] == "end of stream"
    assert report["runs"][0]["counters"]["rows_dropped"] == summary["rows_dropped"]


def test_inspect_text_is_readable_and_bounded(streaming_store: tuple[Path, Workload]) -> None:
    path, _ = streaming_store
    report = json.loads(inspect_cli(path, "--json").stdout)
    result = inspect_cli(path, "--max-listed", "2")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    incomplete = report["incomplete"]
    assert f"requests   {report['requests']:,}: {report['complete']:,} complete, {incomplete:,} incomplete" in text
    assert f"tokens     {report['tokens']:,} stored of {report['expected_tokens']:,} expected" in text
    assert f"drops      {report['rows_dropped']:,} rows dropped by the producer" in text
    assert "engine     test" in text and "policy=drop" in text and "token=" not in text
    assert "  layer_1   tensor 0" in text
    assert re.search(r"^incomplete .*x producer dropped N rows", text, re.M)
    listed = [line for line in text.splitlines() if re.match(r"^  r\d{5}: ", line)]
    assert len(listed) == 2 and f"... and {incomplete - 2:,} more" in text
    assert "ended: end of stream" in text


def test_inspect_of_something_else_says_so(tmp_path: Path) -> None:
    result = inspect_cli(tmp_path)
    assert result.returncode == 2 and "not an hscapture store" in result.stderr and not result.stdout


def test_inspect_says_which_trainers_a_store_exports_to(tiny_store: Path) -> None:
    """The default capture (EAGLE-3's aux layers and last, L = 8) feeds SpecForge, not speculators: inspect says so,
    with the capture that would, in the text and in --json."""
    report = json.loads(inspect_cli(tiny_store, "--json").stdout)
    assert report["exports"]["specforge"] == {"ok": True, "flags": ""}
    speculators = report["exports"]["speculators"]
    assert (
        not speculators["ok"] and "needs 'layer_8'" in speculators["why"] and "--layers 2,4,5,8" in speculators["why"]
    )
    text = inspect_cli(tiny_store).stdout
    assert f"exports    specforge: yes: hscapture export {tiny_store} OUT --format specforge\n" in text
    assert re.search(r"^ {11}speculators: no: --format speculators needs 'layer_8'", text, re.M), text


def test_export_formats_of_more_than_three_aux_layers_name_the_three_to_pick() -> None:
    from types import SimpleNamespace

    from hscapture.inspection import export_formats

    names = ["layer_1", "layer_2", "layer_4", "layer_5", "layer_8", "last"]
    formats = export_formats(SimpleNamespace(tensor_names=names, root="s"), num_layers=8)
    assert formats["specforge"] == {"ok": True, "flags": "--aux-layers 2,4,5"}
    assert formats["speculators"] == {"ok": True, "flags": ""}
