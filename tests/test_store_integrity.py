"""No reader returns bytes that differ from what was captured (issue 12, findings 5, 6 and 7).

Stores made by real extractions of the tiny model (and by ``StoreWriter`` fed as the consumer feeds
it) are damaged the way disks and people damage them: a flipped byte in a row, a changed digit in
an index line, an index cut in half, garbage in a shard header, truncated and empty shards, junk
index lines, a ``meta.json`` without ``tensors``. Every reading path (``open_store().get``,
``CaptureDataset``, ``hscapture export``) must refuse with one line naming the file and the
request, ``hscapture verify`` must fail, and ``hscapture verify --repair`` must rebuild what the
shards can tell, so that a rerun of the extraction captures the rest.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hscapture import cli
from hscapture.dataset import CaptureDataset
from hscapture.errors import StoreError
from hscapture.export import ExportOptions, export
from hscapture.store.format import encode_line
from hscapture.store.reader import open_store
from hscapture.store.repair import LOST, repair_store
from hscapture.store.verify import verify_store
from hscapture.store.writer import StoreWriter
from tests.conftest import TINY_SAMPLES, run_cli
from tests.storefeed import Feed, flip, header_of, make_layout, make_request, shard_bytes


def owner_of_row(path: Path, row: int) -> tuple[str, int]:
    """(request id, position) of a shard row, read by hand from its header, request_index and positions."""
    base, header = header_of(path)
    data = path.read_bytes()

    def field(name: str, fmt: str, size: int) -> int:
        begin = base + header[name]["data_offsets"][0] + row * size
        return int(struct.unpack(fmt, data[begin : begin + size])[0])

    request_ids = json.loads(header["__metadata__"]["request_ids"])
    return request_ids[field("request_index", "<i", 4)], field("positions", "<q", 8)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


# ------------------------------------------------------------------ finding 5: a flipped byte in a row


@pytest.mark.parametrize("which", ["tiny_store", "tiny_store_fp8"])
def test_a_flipped_byte_in_a_row_is_refused_by_every_reader(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    pristine = open_store(request.getfixturevalue(which))
    root = tmp_path / "store"
    shutil.copytree(pristine.root, root)
    shard = root / "shard-000000.safetensors"
    base, header = header_of(shard)
    rows, width = header["layer_4"]["shape"][0], header["layer_4"]["shape"][1]
    row = rows // 2
    itemsize = 1 if header["layer_4"]["dtype"] == "F8_E4M3" else 2
    flip(shard, base + header["layer_4"]["data_offsets"][0] + row * width * itemsize + 7, 0x10)
    key, position = owner_of_row(shard, row)

    store = open_store(root)
    with pytest.raises(StoreError) as refused:
        store.get(key)
    message = str(refused.value)
    assert message.startswith(f"{shard}: request {key!r}: layer_4 at position {position} (shard row {row})")
    assert "\n" not in message and "the shard is damaged" in message
    untouched = [k for k in pristine if k != key]
    assert all(same(store.get(k), pristine.get(k)) for k in untouched), "rows not damaged still read bit for bit"

    dataset = CaptureDataset(root)
    with pytest.raises(StoreError, match=f"request {key!r}: layer_4"):
        dataset[dataset.keys.index(key)]
    assert not same(open_store(root, verify=False).get(key), pristine.get(key)), "verify=False reads unchecked"

    out = tmp_path / "export"  # issue 30.11: the damaged sample is named and left out, every other one written
    done = run_cli("export", str(root), str(out), "--format", "specforge", "--no-progress")
    assert done.returncode == 1, done.stdout + done.stderr
    skipped, summary = done.stderr.splitlines()
    assert skipped.startswith(f"hscapture export: skipped {key!r}: {shard}: request {key!r}: layer_4"), skipped
    assert summary.startswith("hscapture export: 1 damaged samples skipped, the rest written; hscapture verify")
    exported = {json.loads(line).get("id") for line in (out / "hscapture-export.jsonl").read_text().splitlines()[1:]}
    assert exported == {k for k in pristine if k != key and pristine.record(k)["loss_mask"]}
    assert not verify_store(root).ok


# ------------------------------------------------------------------ finding 6: the index


def write_store(root: Path, lengths: dict[str, int], seed: int = 1) -> dict[str, Any]:
    """Requests interleaved two rows at a time over shards of seven rows; the rows each request got."""
    rng = np.random.default_rng(seed)
    requests = {key: make_request(n, "float32", rng) for key, n in lengths.items()}
    writer = StoreWriter(root, shard_bytes("float32"))
    writer.begin_run(*make_layout())
    feed = Feed(writer, requests)
    done = dict.fromkeys(lengths, 0)
    while any(done[k] < n for k, n in lengths.items()):
        segments = [(k, range(done[k], min(done[k] + 2, n))) for k, n in lengths.items() if done[k] < n]
        feed.chunk(segments)
        for k, where in segments:
            done[k] = where.stop
            if where.stop == lengths[k]:
                feed.finish(k, num_tokens=lengths[k])
    writer.close()
    return requests


def index_lines(root: Path) -> list[bytes]:
    return (root / "index.jsonl").read_bytes().splitlines(keepends=True)


def test_a_changed_digit_in_a_span_is_caught_and_repaired(tmp_path: Path) -> None:
    root = tmp_path / "store"
    requests = write_store(root, {"a": 9, "b": 12, "c": 5})
    lines = index_lines(root)
    number = next(i for i, line in enumerate(lines) if b'"id":"b"' in line and b'"type":"request"' in line)
    record = json.loads(lines[number])
    shard, start, _ = record["spans"][0]
    old = f"[{shard},{start},".encode()
    lines[number] = lines[number].replace(old, f"[{shard},{start + 1},".encode(), 1)  # still valid JSON
    (root / "index.jsonl").write_bytes(b"".join(lines))

    with pytest.raises(StoreError, match=rf"index\.jsonl:{number + 1}: line_crc32 .*changed after writing") as refused:
        open_store(root)
    assert "hscapture verify --repair" in str(refused.value)
    report = verify_store(root)
    assert not report.ok and [p.line for p in report.bad_index_lines] == [number + 1]

    assert cli.main(["verify", str(root), "--repair"]) == 0
    store = open_store(root)
    assert sorted(store.keys(complete_only=True)) == ["a", "c"]  # listed as their shards list: either order
    assert store.record("b")["status"] == "incomplete" and store.record("b")["reason"] == LOST
    got = store.get("b")
    assert torch.equal(got["layer_2"], requests["b"].rows[0]) and got["positions"].tolist() == list(range(12))
    assert list(root.glob("index.jsonl.before-repair-*")), "the damaged index is kept"


@pytest.mark.parametrize("where", ["a row", "a token id"])
def test_repair_marks_the_requests_a_damaged_shard_cannot_serve_so_readers_skip_them(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 30.11: after ``verify --repair`` a request whose rows are damaged was still listed complete, and
    CaptureDataset raised on reaching it. Repair records it incomplete with the reason; only the requests that
    read damaged bytes (the row's owner; every request of the shard when a small tensor is damaged)."""
    root = tmp_path / "store"
    requests = write_store(root, {"a": 9, "b": 12, "c": 5})
    shard = root / "shard-000001.safetensors"
    base, header = header_of(shard)
    if where == "a row":
        row, width = 3, header["layer_5"]["shape"][1]
        flip(shard, base + header["layer_5"]["data_offsets"][0] + row * width * 4 + 2, 0x10)
        damaged = {owner_of_row(shard, row)[0]}
    else:
        flip(shard, base + header["token_ids"]["data_offsets"][0] + 8, 0x10)
        damaged = {k for k in requests if any(span[0] == 1 for span in open_store(root).record(k)["spans"])}
    assert 0 < len(damaged) < len(requests) or where == "a token id"

    capsys.readouterr()
    assert cli.main(["verify", str(root), "--repair"]) == 1  # the shard's bytes stay damaged: verify says so
    said = capsys.readouterr().out
    assert f"marked: {len(damaged)} requests" in said and "whose rows are damaged" in said, said
    store = open_store(root)
    for key in damaged:
        record = store.record(key)
        assert record["status"] == "incomplete" and record["reason"].startswith(f"damaged: {shard.name}: "), record
    healthy = [k for k in requests if k not in damaged]
    assert sorted(store.keys(complete_only=True)) == sorted(healthy)
    dataset = CaptureDataset(root)
    assert sorted(dataset.keys) == sorted(healthy)
    for i, key in enumerate(dataset.keys):  # every item reads, bit for bit
        assert torch.equal(dataset[i]["layer_5"], requests[key].rows[1])
    options = ExportOptions(root, tmp_path / "out", "specforge", any_aux_count=True, keep_empty_loss_mask=True)
    summary = export(dataclasses.replace(options, progress=False))
    assert (summary.written, summary.skipped_incomplete, summary.damaged) == (len(healthy), len(damaged), [])
    assert not repair_store(root).changed, "a second repair finds nothing more to mark"


def test_an_index_cut_in_half_is_found_rebuilt_and_captured_again(
    tiny_model: Path, tiny_demo_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "store"
    extract = ["extract", "--model", str(tiny_model), "--data", str(tiny_demo_data), "--out", str(out)]
    extract += ["--shard-bytes", "256K", "--max-batch-tokens", "256", "--no-progress"]
    assert run_cli(*extract).returncode == 0
    lines = index_lines(out)
    assert sum(b'"type":"shard"' in line for line in lines) >= 3, "the store needs several shards for this test"
    (out / "index.jsonl").write_bytes(b"".join(lines[: len(lines) // 2]))
    left = len(open_store(out).keys())
    assert left < TINY_SAMPLES

    checked = run_cli("verify", str(out))
    assert checked.returncode == 1, checked.stdout
    assert "lost index line: shard-" in checked.stdout and "FAILED" in checked.stdout
    repaired = run_cli("verify", str(out), "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "listed: shard-" in repaired.stdout and "rebuilt:" in repaired.stdout
    store = open_store(out)
    assert len(store.keys()) == TINY_SAMPLES and len(store.keys(complete_only=True)) == left

    again = run_cli(*extract)
    assert again.returncode == 0, again.stderr
    store = open_store(out)
    assert len(store.keys(complete_only=True)) == TINY_SAMPLES
    complete = [
        r["id"] for r in map(json.loads, index_lines(out)) if r["type"] == "request" and r["status"] == "complete"
    ]
    assert len(complete) == len(set(complete)) == TINY_SAMPLES
    assert verify_store(out).ok


# ------------------------------------------------------------------ finding 7: damaged files


def damage_shard_header(root: Path) -> Path:
    path = root / "shard-000001.safetensors"
    with path.open("r+b") as handle:
        handle.seek(8)
        handle.write(b"\xff" * 16)
    return path


def truncate_shard(root: Path) -> Path:
    path = root / "shard-000001.safetensors"
    os.truncate(path, path.stat().st_size // 2)
    return path


def empty_shard(root: Path) -> Path:
    path = root / "shard-000001.safetensors"
    os.truncate(path, 0)
    return path


def insert_line(line: bytes) -> Callable[[Path], Path]:
    def damage(root: Path) -> Path:
        lines = index_lines(root)
        (root / "index.jsonl").write_bytes(b"".join([lines[0], line, *lines[1:]]))
        return root / "index.jsonl"

    return damage


def meta_without_tensors(root: Path) -> Path:
    meta = json.loads((root / "meta.json").read_text())
    del meta["tensors"]
    (root / "meta.json").write_text(json.dumps(meta))
    return root / "meta.json"


DAMAGE = {
    "garbage in a shard header": damage_shard_header,
    "a truncated shard": truncate_shard,
    "an empty shard": empty_shard,
    "a junk index line": insert_line(b"garbage\n"),
    "an index line of another JSON type": insert_line(b"[1, 2]\n"),
    "an index line without its fields": insert_line(encode_line({"type": "shard"})),
    "a meta.json without tensors": meta_without_tensors,
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_one_line_naming_the_file_from_every_reader_and_verify_fails(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    write_store(root, {"a": 9, "b": 12, "c": 5})
    named = DAMAGE[kind](root)

    with pytest.raises(StoreError) as refused:
        store = open_store(root)
        for key in store:
            store.get(key)
    assert str(named) in str(refused.value) and "\n" not in str(refused.value)

    capsys.readouterr()
    assert cli.main(["verify", str(root)]) == 1
    said = capsys.readouterr()
    assert named.name in said.out and "FAILED" in said.out and not said.err
    commands = [
        ["export", str(root), str(tmp_path / "out"), "--format", "specforge", "--any-aux-count", "--no-progress"]
    ]
    if "shard" not in kind:  # inspect reads no shard
        commands.append(["inspect", str(root)])
    for command in commands:
        assert cli.main(command) != 0, command
        said = capsys.readouterr()
        lines = said.err.strip().splitlines()
        if "shard" in kind and command[0] == "export":  # one line per sample the shard damages, then the count
            *lines, count = lines
            assert count.startswith(f"hscapture export: {len(lines)} damaged samples skipped"), said
        (line, *others) = lines
        assert not others or ("shard" in kind and all(str(named) in other for other in others)), said
        assert line.startswith(f"hscapture {command[0]}: ") and str(named) in line, (command, said)


def test_a_damaged_store_fails_in_its_own_process_with_one_line(tmp_path: Path) -> None:
    root = tmp_path / "store"
    write_store(root, {"a": 9, "b": 12})
    path = damage_shard_header(root)
    exported = ["export", str(root), str(tmp_path / "o"), "--format", "specforge", "--any-aux-count", "--no-progress"]
    for command in (["verify", str(root)], exported):
        done = run_cli(*command, in_process=False)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert path.name in done.stdout + done.stderr
