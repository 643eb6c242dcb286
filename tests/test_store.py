"""The on-disk store, driven directly: StoreWriter fed rows as the consumer feeds it, read back with open_store.

No sockets and no ring: each test reserves rows, copies random, never-zero rows into them, commits
them with their requests, positions and tokens, and checks what lands on disk bit for bit.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from hscapture.errors import StoreError
from hscapture.store.format import INDEX_FILE, META_FILE, read_index, shard_name
from hscapture.store.reader import Store, open_store
from hscapture.store.records import Finish
from hscapture.store.writer import StoreWriter
from tests.storefeed import (
    DESCRIPTIONS,
    HIDDEN,
    NAMES,
    ROWS_PER_SHARD,
    Feed,
    Request,
    make_layout,
    make_request,
    shard_bytes,
    shard_files,
)


def assert_rows(store: Store, key: str, request: Request, positions: Sequence[int]) -> None:
    """``store.get(key)`` holds exactly ``request``'s rows at ``positions`` (sorted), bit for bit."""
    order = sorted(positions)
    sample = store.get(key)
    assert sample["positions"].tolist() == order
    assert sample["input_ids"].tolist() == request.token_ids[order].tolist()
    assert sample["positions"].dtype == torch.int64 and sample["input_ids"].dtype == torch.int64
    for t, name in enumerate(store.tensor_names):
        got = sample[name]
        want = request.rows[t, torch.as_tensor(order, dtype=torch.long)]
        assert got.dtype == want.dtype, name
        assert got.shape == (len(order), HIDDEN), name
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), (key, name)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def new_writer(root: Path, dtype: str = "float32", **kwargs: object) -> StoreWriter:
    return StoreWriter(root, shard_bytes(dtype), **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- reassembly


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("writeback_bytes", [0, 1], ids=["fsync-only", "writeback-every-block"])
def test_rows_reassemble_bitwise_across_shards(tmp_path: Path, dtype: str, seed: int, writeback_bytes: int) -> None:
    """A scheduler-like stream: several requests per chunk, requests spread over many chunks and shards."""
    rng = np.random.default_rng(seed)
    lengths = {"r-short": 1, "r-a": 5, "r-b": 23, "r-c": 40, "r-d": 9, "r-e": 17, "r-f": 31}
    requests = {key: make_request(n, dtype, rng) for key, n in lengths.items()}
    writer = new_writer(tmp_path, dtype, writer_threads=2, writeback_bytes=writeback_bytes)
    writer.begin_run(*make_layout(dtype=dtype))
    feed = Feed(writer, requests, dtype)
    done = dict.fromkeys(lengths, 0)
    waiting = list(lengths)
    active: list[str] = []
    while waiting or active:
        while waiting and len(active) < 3:
            active.append(waiting.pop(0))
        segments = []
        for key in active:
            take = int(rng.integers(1, 9))
            start, end = done[key], min(done[key] + take, lengths[key])
            segments.append((key, range(start, end)))
            done[key] = end
        split = int(rng.integers(1, len(segments) + 1))  # one step may need two chunks
        for part in (segments[:split], segments[split:]):
            if part:
                feed.chunk(part)
        for key in [k for k in active if done[k] == lengths[k]]:
            active.remove(key)
            feed.finish(key, num_tokens=lengths[key])
    writer.close()

    store = open_store(tmp_path)
    assert sorted(store.keys()) == sorted(lengths)
    assert store.keys(complete_only=True) == store.keys()
    files = shard_files(tmp_path)
    total = sum(lengths.values())
    assert len(files) == -(-total // ROWS_PER_SHARD)  # every shard full but the last
    straddling = 0
    for key, n in lengths.items():
        record = store.record(key)
        assert record["status"] == "complete", record
        assert record["reason"] == ""
        assert record["rows"] == n and record["num_tokens"] == n and record["missing"] == []
        straddling += len({span[0] for span in record["spans"]}) > 1
        assert_rows(store, key, requests[key], range(n))
    assert straddling >= 3, "the test should make requests straddle shard boundaries"
    summary = store.summary()
    assert summary["rows"] == total and summary["complete"] == len(lengths) and summary["shards"] == len(files)
    # Re-read with a one-shard handle cache: shards are evicted and reopened on the way.
    small = Store(tmp_path, max_open_shards=1)
    for key, n in lengths.items():
        assert_rows(small, key, requests[key], range(n))


def test_interleaved_requests_within_and_across_chunks(tmp_path: Path, rng: np.random.Generator) -> None:
    requests = {key: make_request(12, "float32", rng) for key in ("a", "b", "c")}
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, requests)
    feed.chunk([("a", range(0, 3)), ("b", range(0, 2)), ("c", range(0, 4))])
    feed.chunk([("b", range(2, 7)), ("a", range(3, 4))])
    # One request twice in one chunk (non-adjacent), positions arriving out of order across chunks.
    feed.chunk([("c", range(8, 12)), ("a", range(4, 10)), ("c", range(4, 8))])
    feed.chunk([("b", range(7, 12)), ("a", range(10, 12))])
    for key in requests:
        feed.finish(key, num_tokens=12)
    writer.close()

    store = open_store(tmp_path)
    assert sorted(store.keys()) == ["a", "b", "c"]
    for key, request in requests.items():
        assert store.record(key)["status"] == "complete", store.record(key)
        assert_rows(store, key, request, range(12))


def test_spans_point_at_the_shard_rows(tmp_path: Path, rng: np.random.Generator) -> None:
    """Spans in the index point at exactly the shard rows of the request, in the order they came."""
    requests = {"x": make_request(10, "float32", rng), "y": make_request(10, "float32", rng)}
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, requests)
    feed.chunk([("x", range(0, 5)), ("y", range(0, 5))])
    feed.chunk([("x", range(5, 10)), ("y", range(5, 10))])
    feed.finish("x", num_tokens=10)
    feed.finish("y", num_tokens=10)
    writer.close()
    record = open_store(tmp_path).record("x")
    # 7 rows per shard: x0-4 -> shard 0 rows 0-4; x5-9 -> shard 1 rows 3-6, shard 2 row 0.
    assert record["spans"] == [[0, 0, 5], [1, 3, 4], [2, 0, 1]]


def test_rows_after_a_finish_hold_back_its_line_until_their_shard_is_listed(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """An engine that schedules ahead may send rows of a request after its finish; its line then waits for
    their shard too, so no line names a shard before that shard's own line."""
    requests = {"x": make_request(9, "float32", rng), "y": make_request(7, "float32", rng)}
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, requests)
    feed.chunk([("x", range(0, 6))])
    feed.finish("x", num_tokens=6)  # shard 0 is still open: x waits for it
    feed.chunk([("x", range(6, 9)), ("y", range(0, 7))])  # x's rows past its end land in shards 0 and 1
    feed.finish("y", num_tokens=7)
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "index.jsonl").read_text().splitlines()]
    where = {(line["type"], line["id"]): n for n, line in enumerate(lines) if line["type"] in ("shard", "request")}
    record = open_store(tmp_path).record("x")
    assert [span[0] for span in record["spans"]] == [0, 1]
    assert where[("request", "x")] > where[("shard", 1)] and where[("request", "y")] > where[("shard", 2)]
    assert record["status"] == "incomplete" and "positions beyond num_tokens=6" in record["reason"]


def test_loss_mask_ranges_are_materialized(tmp_path: Path, rng: np.random.Generator) -> None:
    requests = {"m": make_request(12, "float32", rng), "none": make_request(4, "float32", rng)}
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, requests)
    feed.chunk([("m", range(6, 12)), ("none", range(4))])
    feed.chunk([("m", range(0, 6))])
    feed.finish("m", num_tokens=12, loss_mask=[(2, 5), (8, 10), (11, 40)], meta={"turns": 2})
    feed.finish("none", num_tokens=4)
    writer.close()

    store = open_store(tmp_path)
    sample = store.get("m")
    assert sample["loss_mask"].dtype == torch.int64
    assert sample["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1]
    record = store.record("m")
    assert record["loss_mask"] == [[2, 5], [8, 10], [11, 40]]
    assert record["meta"] == {"turns": 2}
    assert store.get("none")["loss_mask"].tolist() == [0, 0, 0, 0]


# --------------------------------------------------------------------------- incomplete requests


@pytest.mark.parametrize(
    ("sent", "num_tokens", "missing"),
    [
        ([range(0, 5), range(8, 12)], 12, [[5, 8]]),
        ([range(0, 5), range(8, 12)], 14, [[5, 8], [12, 14]]),
        ([range(3, 6)], 6, [[0, 3]]),
        ([range(0, 2), range(4, 5), range(7, 9)], 0, [[2, 4], [5, 7]]),  # num_tokens unknown
        ([range(0, 6)], 9, [[6, 9]]),  # the tail never came
    ],
)
def test_gap_in_positions_is_incomplete_with_missing(
    tmp_path: Path, rng: np.random.Generator, sent: list[range], num_tokens: int, missing: list[list[int]]
) -> None:
    request = make_request(20, "float32", rng)
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, {"g": request})
    for part in sent:
        feed.chunk([("g", part)])
    feed.finish("g", num_tokens=num_tokens)
    writer.close()

    store = open_store(tmp_path)
    record = store.record("g")
    assert record["status"] == "incomplete"
    assert record["missing"] == missing
    gap = sum(end - start for start, end in missing)
    assert f"{gap} positions missing" in record["reason"]
    positions = [p for part in sent for p in part]
    assert record["rows"] == len(positions)
    assert_rows(store, "g", request, positions)  # what did arrive is still readable
    assert store.keys(complete_only=True) == []


def test_request_never_finished_gets_the_end_run_reason(tmp_path: Path, rng: np.random.Generator) -> None:
    requests = {"open": make_request(9, "float32", rng), "done": make_request(3, "float32", rng)}
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, requests)
    feed.chunk([("open", range(0, 9)), ("done", range(3))])
    feed.finish("done", num_tokens=3)
    writer.end_run("end of stream", {"rows_dropped": 0, "rows_captured": 12})
    writer.close()

    store = open_store(tmp_path)
    record = store.record("open")
    assert record["status"] == "incomplete"
    assert record["reason"] == "end of stream before the request finished"
    assert record["missing"] == []
    assert_rows(store, "open", requests["open"], range(9))
    assert store.record("done")["status"] == "complete"
    (run,) = store.metadata()["runs"]
    assert run["run_id"] == "run-a"
    assert run["end"]["reason"] == "end of stream"
    assert run["end"]["counters"]["rows_captured"] == 12


def test_close_marks_open_requests_with_its_reason(tmp_path: Path, rng: np.random.Generator) -> None:
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    Feed(writer, {"r": make_request(4, "float32", rng)}).chunk([("r", range(4))])
    writer.close("process 4242 exited")
    writer.close("again")  # idempotent: nothing more is written
    record = open_store(tmp_path).record("r")
    assert (record["status"], record["reason"]) == ("incomplete", "process 4242 exited before the request finished")
    assert sum(1 for r in read_index(tmp_path) if r["type"] == "run_end") == 1


def test_new_layout_ends_the_previous_run(tmp_path: Path, rng: np.random.Generator) -> None:
    requests = {"old": make_request(4, "float32", rng), "new": make_request(4, "float32", rng)}
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout("run-a"))
    feed = Feed(writer, requests)
    feed.chunk([("old", range(4))])
    writer.begin_run(*make_layout("run-b"))  # the producer restarted
    feed.chunk([("new", range(4))])
    feed.finish("new", num_tokens=4)
    writer.close()
    store = open_store(tmp_path)
    assert store.record("old")["reason"] == "producer restarted before the request finished"
    assert store.record("old")["run_id"] == "run-a"
    assert store.record("new")["run_id"] == "run-b" and store.record("new")["status"] == "complete"
    assert [r["run_id"] for r in store.metadata()["runs"]] == ["run-a", "run-b"]


@pytest.mark.parametrize("reason", ["aborted", "retracted"])
def test_aborted_request_is_incomplete(tmp_path: Path, rng: np.random.Generator, reason: str) -> None:
    request = make_request(6, "bfloat16", rng)
    writer = new_writer(tmp_path, "bfloat16")
    writer.begin_run(*make_layout(dtype="bfloat16"))
    feed = Feed(writer, {"x": request}, "bfloat16")
    feed.chunk([("x", range(6))])
    feed.finish("x", reason, num_tokens=6)
    writer.close()
    store = open_store(tmp_path)
    record = store.record("x")
    assert (record["status"], record["reason"]) == ("incomplete", reason)
    assert_rows(store, "x", request, range(6))


def test_dropped_and_duplicate_rows_make_a_request_incomplete(tmp_path: Path, rng: np.random.Generator) -> None:
    requests = {"drop": make_request(6, "float32", rng), "dup": make_request(6, "float32", rng)}
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, requests)
    feed.chunk([("drop", range(0, 4)), ("dup", range(0, 6))])
    feed.chunk([("dup", range(2, 4))])
    feed.finish("drop", num_tokens=6, dropped_rows=2)
    feed.finish("dup", num_tokens=6)
    writer.close()
    store = open_store(tmp_path)
    drop = store.record("drop")
    assert drop["status"] == "incomplete" and drop["dropped_rows"] == 2
    assert "producer dropped 2 rows" in drop["reason"] and "2 positions missing" in drop["reason"]
    dup = store.record("dup")
    assert dup["status"] == "incomplete" and "2 duplicate rows" in dup["reason"]


def test_finished_request_without_rows(tmp_path: Path) -> None:
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    writer.finish_request("empty", Finish("finished", num_tokens=3))
    writer.close()
    store = open_store(tmp_path)
    record = store.record("empty")
    assert record["status"] == "incomplete" and record["missing"] == [[0, 3]] and record["rows"] == 0
    sample = store.get("empty")
    assert sample["positions"].shape == (0,)
    assert sample["last"].shape == (0, HIDDEN) and sample["last"].dtype == torch.float32


def test_data_before_any_run_is_refused(tmp_path: Path, rng: np.random.Generator) -> None:
    writer = new_writer(tmp_path)
    try:
        with pytest.raises(StoreError, match=r"data before any run began \(begin_run first\)"):
            Feed(writer, {"r": make_request(2, "float32", rng)}).chunk([("r", range(2))])
    finally:
        writer.close()


def test_reserve_without_waiting_says_when_every_buffer_waits_for_commits(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A buffer is written (and freed) only once all of its rows are committed: the caller commits first."""
    request = make_request(3 * ROWS_PER_SHARD, "float32", rng)
    writer = new_writer(tmp_path, writer_threads=1, shard_buffers=2)
    writer.begin_run(*make_layout())
    first = writer.reserve(2 * ROWS_PER_SHARD)  # both buffers, neither committed
    assert first is not None and [p.rows for p in first.pieces] == [ROWS_PER_SHARD, ROWS_PER_SHARD]
    assert writer.reserve(1, wait=False) is None
    planes = request.rows.contiguous().view(torch.uint8).numpy()
    for piece, start in zip(first.pieces, (0, ROWS_PER_SHARD)):
        for t, plane in enumerate(piece.planes):
            plane[:] = planes[t, start : start + piece.rows]
    n = 2 * ROWS_PER_SHARD
    writer.commit(first, ["r"], [n], np.arange(n), request.token_ids[:n])
    second = writer.reserve(ROWS_PER_SHARD)  # waits for a writer thread to free a buffer
    assert second is not None
    for t, plane in enumerate(second.pieces[0].planes):
        plane[:] = planes[t, n:]
    writer.commit(second, ["r"], [ROWS_PER_SHARD], np.arange(n, n + ROWS_PER_SHARD), request.token_ids[n:])
    Feed(writer, {}).finish("r", num_tokens=3 * ROWS_PER_SHARD)
    writer.close()
    assert_rows(open_store(tmp_path), "r", request, range(3 * ROWS_PER_SHARD))


def test_writer_threads_and_buffers_follow_how_each_run_writes(tmp_path: Path, rng: np.random.Generator) -> None:
    """Unset, writer threads are sized per run: 4 where the row planes go out with O_DIRECT (each write
    waits for the disk), 2 through the page cache, with threads + 2 buffers; asked for, they stay."""
    writer = new_writer(tmp_path / "sized")
    asked = new_writer(tmp_path / "asked", writer_threads=3, shard_buffers=5)
    requests = {}
    for run, direct in enumerate((True, False, True)):
        for store in (writer, asked):
            store.direct.use(direct)
            store.begin_run(*make_layout(run_id=f"run-{run}"))
        threads = 4 if writer.direct.enabled else 2  # a filesystem refusing O_DIRECT turns it off for good
        sized = (writer.writer_threads, writer.shard_buffers, writer._buffers_made)
        assert sized == (threads, threads + 2, threads + 2)
        assert writer._pool._max_workers == threads  # the pool that writes this run's shards
        assert (asked.writer_threads, asked.shard_buffers, asked._buffers_made) == (3, 5, 5)
        key = f"r{run}"
        requests[key] = make_request(2 * ROWS_PER_SHARD + 3, "float32", rng)
        for store in (writer, asked):
            feed = Feed(store, {key: requests[key]})
            feed.chunk([(key, range(2 * ROWS_PER_SHARD + 3))])
            feed.finish(key, num_tokens=2 * ROWS_PER_SHARD + 3)
            store.end_run("done", {})
    for store in (writer, asked):
        store.close()
        found = open_store(store.root)
        for key, request in requests.items():
            assert_rows(found, key, request, range(2 * ROWS_PER_SHARD + 3))


def test_a_failed_shard_write_lists_the_shards_written_before_it_and_only_their_requests(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """Shard 1 cannot be written (a directory squats its name): shard 0 and request a are listed, b never."""
    requests = {"a": make_request(ROWS_PER_SHARD, "float32", rng), "b": make_request(ROWS_PER_SHARD, "float32", rng)}
    writer = new_writer(tmp_path, writer_threads=1)
    (tmp_path / shard_name(1)).mkdir()
    (tmp_path / shard_name(1) / "squatter").write_bytes(b"")  # a file cannot be renamed over a non-empty directory
    writer.begin_run(*make_layout())
    feed = Feed(writer, requests)
    feed.chunk([("a", range(ROWS_PER_SHARD))])
    feed.chunk([("b", range(ROWS_PER_SHARD))])
    feed.finish("a", num_tokens=ROWS_PER_SHARD)
    feed.finish("b", num_tokens=ROWS_PER_SHARD)
    with pytest.raises(StoreError, match=rf"{shard_name(1)}: write failed: .*what the index lists is intact"):
        writer.close()
    store = open_store(tmp_path)
    assert store.keys() == ["a"] and store.summary()["shards"] == 1
    assert_rows(store, "a", requests["a"], range(ROWS_PER_SHARD))


# --------------------------------------------------------------------------- streaming durability


def test_flush_s_makes_finished_requests_visible_while_writing(tmp_path: Path, rng: np.random.Generator) -> None:
    request = make_request(3, "float32", rng)  # fewer rows than a shard: only the timer writes it
    writer = new_writer(tmp_path, flush_s=0.05)
    try:
        writer.begin_run(*make_layout())
        feed = Feed(writer, {"q": request})
        feed.chunk([("q", range(3))])
        feed.finish("q", num_tokens=3)
        assert "q" not in open_store(tmp_path)  # its shard is not on disk yet
        deadline = time.monotonic() + 5
        while "q" not in open_store(tmp_path):
            assert time.monotonic() < deadline, "the open shard was never flushed"
            time.sleep(0.02)
            writer.tick()
        assert_rows(open_store(tmp_path), "q", request, range(3))
    finally:
        writer.close()


# --------------------------------------------------------------------------- crash leftovers


def test_torn_index_line_is_ignored_then_repaired(tmp_path: Path, rng: np.random.Generator) -> None:
    first = {"a": make_request(10, "float32", rng)}
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout("run-a"))
    feed = Feed(writer, first)
    feed.chunk([("a", range(10))])
    feed.finish("a", num_tokens=10)
    writer.close()
    index = tmp_path / INDEX_FILE
    clean = index.read_bytes()
    shards_before = shard_files(tmp_path)
    with index.open("ab") as handle:
        handle.write(b'{"type":"request","id":"ghost","run_id":"run-a","sta')  # crash mid-append

    store = open_store(tmp_path)  # the reader skips the torn line
    assert store.keys() == ["a"]
    assert "ghost" not in store
    assert_rows(store, "a", first["a"], range(10))

    second = {"b": make_request(9, "float32", rng)}
    writer = new_writer(tmp_path)
    assert index.read_bytes() == clean  # the torn tail is cut before anything is appended
    writer.begin_run(*make_layout("run-b"))
    feed = Feed(writer, second)
    feed.chunk([("b", range(9))])
    feed.finish("b", num_tokens=9)
    writer.close()

    lines = index.read_bytes().split(b"\n")
    assert lines[-1] == b""
    assert all(json.loads(line) for line in lines[:-1])  # every line is whole JSON again
    assert index.read_bytes().startswith(clean)
    store = open_store(tmp_path)
    assert store.keys() == ["a", "b"]
    assert_rows(store, "a", first["a"], range(10))
    assert_rows(store, "b", second["b"], range(9))
    # The second writer continued the shard numbering: the first run's shards are untouched.
    assert set(shards_before) < set(shard_files(tmp_path))
    assert min(s[0] for s in store.record("b")["spans"]) == len(shards_before)


def test_leftover_tmp_files_are_removed_and_never_listed(tmp_path: Path, rng: np.random.Generator) -> None:
    request = make_request(8, "float32", rng)
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, {"a": request})
    feed.chunk([("a", range(8))])
    feed.finish("a", num_tokens=8)
    writer.close()
    leftovers = [
        tmp_path / (shard_name(99) + ".tmp"),
        tmp_path / (shard_name(2) + ".tmp"),  # the id the next writer would use
        tmp_path / (META_FILE + ".tmp"),
    ]
    for path in leftovers:
        path.write_bytes(os.urandom(100))
    store = open_store(tmp_path)
    assert store.keys() == ["a"] and store.summary()["shards"] == 2

    writer = new_writer(tmp_path)
    try:
        assert [p for p in leftovers if p.exists()] == []
        assert list(tmp_path.glob("*.tmp")) == []
    finally:
        writer.close()
    assert open_store(tmp_path).keys() == ["a"]


# --------------------------------------------------------------------------- the format, without hscapture


def _raw_header(path: Path) -> dict:
    """The safetensors JSON header, parsed by hand (8-byte little-endian length + JSON)."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def test_shards_are_plain_safetensors(tmp_path: Path, rng: np.random.Generator) -> None:
    from safetensors.numpy import load_file

    lengths = {"p": 6, "q": 5, "r": 4}
    requests = {key: make_request(n, "float32", rng) for key, n in lengths.items()}
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, requests)
    feed.chunk([("p", range(0, 3)), ("q", range(0, 5))])
    feed.chunk([("r", range(0, 4)), ("p", range(3, 6))])
    for key, n in lengths.items():
        feed.finish(key, num_tokens=n)
    writer.close()

    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["format"] == "hscapture-store" and meta["dtype"] == "float32" and meta["hidden_size"] == HIDDEN
    assert [t["name"] for t in meta["tensors"]] == NAMES
    assert [t["description"] for t in meta["tensors"]] == DESCRIPTIONS

    collected: dict[str, dict[int, tuple[int, list[np.ndarray]]]] = {key: {} for key in lengths}
    files = shard_files(tmp_path)
    assert len(files) == 3  # 15 rows at 7 per shard
    for path in files:
        header = _raw_header(path)
        table = json.loads(header["__metadata__"]["request_ids"])
        assert header["__metadata__"]["format"] == "hscapture-shard"
        assert header["__metadata__"]["run_id"] == "run-a"
        with safe_open(str(path), framework="np") as handle:
            assert json.loads(handle.metadata()["request_ids"]) == table
            assert set(handle.keys()) == {*NAMES, "positions", "token_ids", "request_index", "row_crc32"}
        tensors = load_file(str(path))
        n = len(tensors["positions"])
        assert n <= ROWS_PER_SHARD
        assert tensors["request_index"].dtype == np.int32 and tensors["positions"].dtype == np.int64
        assert tensors["row_crc32"].dtype == np.uint32 and tensors["row_crc32"].shape == (n, len(NAMES))
        for t, name in enumerate(NAMES):
            assert tensors[name].shape == (n, HIDDEN) and tensors[name].dtype == np.float32
            assert header[name]["dtype"] == "F32"
            assert [zlib.crc32(row.tobytes()) for row in tensors[name]] == tensors["row_crc32"][:, t].tolist()
        assert sorted(set(tensors["request_index"].tolist())) == list(range(len(table)))
        for row in range(n):
            key = table[tensors["request_index"][row]]
            position = int(tensors["positions"][row])
            collected[key][position] = (
                int(tensors["token_ids"][row]),
                [tensors[name][row] for name in NAMES],
            )
    for key, n in lengths.items():
        assert sorted(collected[key]) == list(range(n))
        for position, (token, rows) in collected[key].items():
            assert token == requests[key].token_ids[position]
            for t, row in enumerate(rows):
                np.testing.assert_array_equal(row, requests[key].rows[t, position].numpy())

    index = [json.loads(line) for line in (tmp_path / INDEX_FILE).read_text().splitlines()]
    assert index[0]["type"] == "run"
    assert {r["file"] for r in index if r["type"] == "shard"} == {p.name for p in files}
    assert {r["id"] for r in index if r["type"] == "request"} == set(lengths)


def test_bfloat16_shards_declare_bf16(tmp_path: Path, rng: np.random.Generator) -> None:
    request = make_request(3, "bfloat16", rng)
    writer = new_writer(tmp_path, "bfloat16")
    writer.begin_run(*make_layout(dtype="bfloat16"))
    feed = Feed(writer, {"b": request}, "bfloat16")
    feed.chunk([("b", range(3))])
    feed.finish("b", num_tokens=3)
    writer.close()
    (path,) = shard_files(tmp_path)
    header = _raw_header(path)
    assert {header[name]["dtype"] for name in NAMES} == {"BF16"}
    with safe_open(str(path), framework="pt") as handle:
        for t, name in enumerate(NAMES):
            assert torch.equal(handle.get_tensor(name).view(torch.int16), request.rows[t].view(torch.int16))


# --------------------------------------------------------------------------- one writer per store


def test_second_writer_is_refused_while_the_first_is_open(tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = new_writer(root)
    try:
        began = time.monotonic()
        with pytest.raises(StoreError) as exc:
            new_writer(root, lock_timeout_s=0.2)
        waited = time.monotonic() - began
        message = str(exc.value)
        assert str(root) in message
        assert f"being written by pid {os.getpid()}" in message
        assert "another directory" in message
        assert 0.2 <= waited < 5
    finally:
        first.close()
    new_writer(root, lock_timeout_s=0.2).close()  # released on close


def test_writer_in_another_process_holds_the_lock(tmp_path: Path) -> None:
    root = tmp_path / "store"
    script = (
        "import sys; from hscapture.store.writer import StoreWriter\n"
        f"w = StoreWriter({str(root)!r}, 1 << 20)\n"
        "print('ready', flush=True); sys.stdin.read(); w.close()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(StoreError, match=rf"being written by pid {child.pid};") as exc:
            new_writer(root, lock_timeout_s=0.2)
        assert str(root) in str(exc.value)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    new_writer(root, lock_timeout_s=0.2).close()


@pytest.mark.parametrize(
    ("change", "shown"),
    [
        ({"hidden": HIDDEN * 2}, "'hidden_size': 48"),
        ({"dtype": "bfloat16"}, "'dtype': 'bfloat16'"),
        ({"names": ["layer_2", "layer_6", "last"]}, "layer_6"),
        ({"names": NAMES[:2], "descriptions": DESCRIPTIONS[:2]}, "'residual entering layer 5'}]}"),
        ({"descriptions": ["a", "b", "c"]}, "'description': 'a'"),
    ],
)
def test_begin_run_with_other_tensors_is_refused(
    tmp_path: Path, rng: np.random.Generator, change: dict, shown: str
) -> None:
    request = make_request(4, "float32", rng)
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, {"a": request})
    feed.chunk([("a", range(4))])
    feed.finish("a", num_tokens=4)
    writer.close()
    meta_before = (tmp_path / META_FILE).read_bytes()

    writer = new_writer(tmp_path)
    try:
        with pytest.raises(StoreError) as exc:
            writer.begin_run(*make_layout("run-b", **change))
    finally:
        writer.close()
    message = str(exc.value)
    assert message.startswith(f"{tmp_path}: holds ")
    assert shown in message.split("the producer sends", 1)[1]
    assert "another --out directory" in message
    assert (tmp_path / META_FILE).read_bytes() == meta_before
    store = open_store(tmp_path)
    assert [r["run_id"] for r in store.metadata()["runs"]] == ["run-a"]
    assert_rows(store, "a", request, range(4))


def test_same_tensors_append_a_second_run(tmp_path: Path, rng: np.random.Generator) -> None:
    for run, key in (("run-a", "a"), ("run-b", "b")):
        writer = new_writer(tmp_path)
        writer.begin_run(*make_layout(run))
        feed = Feed(writer, {key: make_request(3, "float32", rng)})
        feed.chunk([(key, range(3))])
        feed.finish(key, num_tokens=3)
        writer.close()
    store = open_store(tmp_path)
    assert store.keys() == ["a", "b"]
    assert store.summary()["runs"] == 2


# --------------------------------------------------------------------------- reader errors


def test_get_unknown_key_names_the_key(tmp_path: Path, rng: np.random.Generator) -> None:
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, {"known": make_request(2, "float32", rng)})
    feed.chunk([("known", range(2))])
    feed.finish("known", num_tokens=2)
    writer.close()
    store = open_store(tmp_path)
    with pytest.raises(KeyError) as exc:
        store.get("no-such-request-17")
    assert "'no-such-request-17'" in str(exc.value)
    assert str(tmp_path) in str(exc.value)
    with pytest.raises(KeyError) as exc:
        store.get("known", tensors=["layer_3"])
    assert "layer_3" in str(exc.value) and "layer_2" in str(exc.value)
    assert store.get("known", tensors=["last"]).keys() == {"input_ids", "positions", "loss_mask", "last"}


def test_missing_shard_file_is_named(tmp_path: Path, rng: np.random.Generator) -> None:
    request = make_request(10, "float32", rng)
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, {"a": request})
    feed.chunk([("a", range(10))])
    feed.finish("a", num_tokens=10)
    writer.close()
    store = open_store(tmp_path)
    victim = tmp_path / shard_name(1)
    victim.unlink()
    with pytest.raises(StoreError) as exc:
        store.get("a")
    assert str(victim) in str(exc.value)
    assert "missing" in str(exc.value)


def test_open_store_on_an_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=rf"{tmp_path}: no meta\.json; not an hscapture store"):
        open_store(tmp_path)


def test_corrupt_index_line_in_the_middle_is_an_error(tmp_path: Path, rng: np.random.Generator) -> None:
    writer = new_writer(tmp_path)
    writer.begin_run(*make_layout())
    feed = Feed(writer, {"a": make_request(2, "float32", rng)})
    feed.chunk([("a", range(2))])
    feed.finish("a", num_tokens=2)
    writer.close()
    index = tmp_path / INDEX_FILE
    lines = index.read_bytes().splitlines(keepends=True)
    index.write_bytes(lines[0] + b"{not json\n" + b"".join(lines[1:]))
    with pytest.raises(StoreError, match=rf"{index}:2: not JSON .*the index is corrupt"):
        open_store(tmp_path)


def test_store_of_another_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / META_FILE).write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(StoreError, match=rf"{tmp_path / META_FILE}: format 'something-else' v1, expected"):
        new_writer(tmp_path, lock_timeout_s=0.2)


def test_a_refused_store_releases_its_lock(tmp_path: Path) -> None:
    (tmp_path / META_FILE).write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(StoreError, match=r"format 'something-else'") as refused:
        new_writer(tmp_path, lock_timeout_s=0.2)
    (tmp_path / META_FILE).unlink()  # the operator fixes the directory and tries again
    assert refused.value is not None  # the error is still held (a log record, a retry loop, pytest.raises)
    new_writer(tmp_path, lock_timeout_s=0.2).close()
