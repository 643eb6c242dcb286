"""Prefix sharing in the store: a request whose first positions an engine never forwarded (a prefix-cache
hit) takes them by reference from a request holding the same tokens (FORMAT.md, ``shared``).

Engine-neutral: the writer is fed directly, as the consumer does. A request's rows at shared positions are
the donor's (the states of a prefix depend only on its tokens), so readers must serve exactly those bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hscapture.errors import ProtocolError, StoreError
from hscapture.export import ExportOptions, export
from hscapture.inspection import inspect_store
from hscapture.store import prefixes
from hscapture.store.format import INDEX_FILE, META_FILE, read_index, shard_name
from hscapture.store.reader import open_store
from hscapture.store.records import Finish
from hscapture.store.repair import repair_store
from hscapture.store.verify import verify_store
from hscapture.store.writer import StoreWriter
from tests.storefeed import (
    Feed,
    Request,
    capture,
    finish_hit,
    make_layout,
    make_request,
    send,
    shard_bytes,
    sharing,
)

ROOT = Path(__file__).resolve().parents[1]


def _writer(root: Path, run_id: str = "run-a", dtype: str = "float32") -> StoreWriter:
    writer = StoreWriter(root, shard_bytes(dtype), writer_threads=1)
    writer.begin_run(*make_layout(run_id, dtype))
    return writer


def _check_rows(root: Path, requests: dict[str, Request]) -> None:
    store = open_store(root)
    for request_id, request in requests.items():
        sample = store.get(request_id)
        assert sample["positions"].tolist() == list(range(len(request.token_ids))), request_id
        assert sample["input_ids"].tolist() == request.token_ids.tolist(), request_id
        for t, name in enumerate(store.tensor_names):
            assert torch.equal(sample[name], request.rows[t]), (request_id, name)


def _captured(root: Path, hits: dict[str, tuple[Request, int]]) -> None:
    """Capture each request in order, its first ``cached`` positions from the prefix cache, into a new store."""
    writer = _writer(root)
    feed = Feed(writer, {key: request for key, (request, _) in hits.items()})
    for key, (_, cached) in hits.items():
        capture(feed, key, cached)
    writer.close()


def _lose_line(root: Path, request_id: str) -> None:
    """The store's index without the request's line."""
    lines = (root / INDEX_FILE).read_bytes().splitlines(keepends=True)
    records = read_index(root)
    kept = [line for line, r in zip(lines, records) if not (r["type"] == "request" and r["id"] == request_id)]
    (root / INDEX_FILE).write_bytes(b"".join(kept))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(13)


def test_a_cached_prefix_is_taken_from_its_donor_and_chains_resolve(tmp_path: Path, rng: np.random.Generator) -> None:
    a = make_request(40, "float32", rng)
    b = sharing(a, make_request(50, "float32", rng), 30)  # hits a's first 30
    c = sharing(b, make_request(61, "float32", rng), 45)  # hits b's first 45: 30 of them b took from a
    lone = make_request(20, "float32", rng)  # a hit whose donor was never captured
    requests = {"a": a, "b": b, "c": c, "lone": lone}
    _captured(tmp_path, {"a": (a, 0), "b": (b, 30), "c": (c, 45), "lone": (lone, 12)})

    store = open_store(tmp_path)
    b_line, c_line, lone_line = store.record("b"), store.record("c"), store.record("lone")
    assert (b_line["status"], b_line["missing"], b_line["rows"]) == ("complete", [], 20)
    assert b_line["shared"] == [
        {"id": "a", "start": 0, "end": 30, "tokens_crc32": prefixes.tokens_crc32(a.token_ids[:30])}
    ]
    assert c_line["status"] == "complete" and [(e["id"], e["start"], e["end"]) for e in c_line["shared"]] == [
        ("b", 0, 45)
    ]
    assert (lone_line["status"], lone_line["missing"], "shared" in lone_line) == ("incomplete", [[0, 12]], False)
    assert json.loads((tmp_path / META_FILE).read_bytes())["version"] == 3  # references: readers must follow them
    del requests["lone"]
    _check_rows(tmp_path, requests)
    shared = store.get("c", ["layer_2"])["layer_2"][:30]
    assert torch.equal(shared, store.get("a", ["layer_2"])["layer_2"][:30])  # bitwise the donor's rows
    summary = store.summary()
    assert (summary["rows_shared"], summary["requests_sharing"]) == (30 + 45, 2)
    assert summary["bytes_shared"] > 0
    assert inspect_store(tmp_path)["rows_shared"] == 75
    assert verify_store(tmp_path).ok


def test_a_store_without_references_stays_version_2(tmp_path: Path, rng: np.random.Generator) -> None:
    _captured(tmp_path, {"a": (make_request(20, "float32", rng), 5)})  # no donor: nothing to reference
    assert json.loads((tmp_path / META_FILE).read_bytes())["version"] == 2
    assert open_store(tmp_path).record("a")["missing"] == [[0, 5]]


def test_a_donor_diverging_inside_a_block_is_never_taken(tmp_path: Path, rng: np.random.Generator) -> None:
    base = make_request(48, "float32", rng)
    wanted = sharing(base, make_request(48, "float32", rng), 37)  # the one b matches to position 40
    other = sharing(base, make_request(48, "float32", rng), 37)  # the same first block chain, diverging at 37
    b = sharing(wanted, make_request(60, "float32", rng), 40)
    requests = {"wanted": wanted, "other": other, "b": b}
    # "other" is the latest donor of the block chain of [0, 32)
    _captured(tmp_path, {"wanted": (wanted, 0), "other": (other, 0), "b": (b, 40)})
    assert [e["id"] for e in open_store(tmp_path).record("b")["shared"]] == ["wanted"]
    _check_rows(tmp_path, requests)


def test_an_old_donor_is_found_behind_many_later_ones_sharing_its_blocks(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A system prompt shared by many requests: the one donor of a hit reaching past the prompt into a partial
    block is found however many requests through the same blocks were recorded after it."""
    system = make_request(32, "float32", rng)  # two whole blocks every request shares
    old = sharing(system, make_request(48, "float32", rng), 32)
    later = {f"later-{i}": (sharing(system, make_request(48, "float32", rng), 32), 0) for i in range(3 * 40)}
    asker = sharing(old, make_request(52, "float32", rng), 36)  # old's tokens to 36, then its own
    _captured(tmp_path, {"old": (old, 0), **later, "asker": (asker, 36)})
    assert [(e["id"], e["end"]) for e in open_store(tmp_path).record("asker")["shared"]] == [("old", 36)]
    _check_rows(tmp_path, {"old": old, "asker": asker})


def test_a_hash_collision_never_attaches_another_requests_rows(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every block chain collides: only the exact token comparison tells donors apart.
    monkeypatch.setattr(prefixes, "_chain", lambda tokens: [b"same"] * (len(tokens) // prefixes.BLOCK + 1))
    a = make_request(40, "float32", rng)
    stranger = make_request(30, "float32", rng)  # other tokens, same (colliding) hashes
    b = sharing(a, make_request(40, "float32", rng), 33)
    _captured(tmp_path, {"a": (a, 0), "stranger": (stranger, 10), "b": (b, 33)})
    store = open_store(tmp_path)
    assert store.record("stranger")["missing"] == [[0, 10]] and "shared" not in store.record("stranger")
    assert [e["id"] for e in store.record("b")["shared"]] == ["a"]
    _check_rows(tmp_path, {"a": a, "b": b})


def test_a_donor_still_being_captured_is_recorded_first(tmp_path: Path, rng: np.random.Generator) -> None:
    long = make_request(60, "float32", rng)
    short = sharing(long, make_request(36, "float32", rng), 32)
    writer = _writer(tmp_path)
    feed = Feed(writer, {"long": long, "short": short})
    feed.chunk([("long", range(0, 40))])  # the long one's prompt, then a few decode rows later
    capture(feed, "short", 32)  # finishes first, taking rows of a request still open
    writer.tick()
    for at in range(40, 60):
        feed.chunk([("long", [at])])
    feed.finish("long", num_tokens=60)
    writer.close()
    order = [r["id"] for r in read_index(tmp_path) if r["type"] == "request"]
    assert order == ["long", "short"]  # the donor's line first: a line never names a key not yet listed
    assert open_store(tmp_path).record("short")["shared"][0]["id"] == "long"
    _check_rows(tmp_path, {"long": long, "short": short})


@pytest.mark.parametrize("donor_finishes", [True, False], ids=["donor-finishes", "run-ends-first"])
def test_a_donor_whose_own_first_positions_were_a_cache_hit_is_waited_for(
    tmp_path: Path, rng: np.random.Generator, donor_finishes: bool
) -> None:
    """Parallel samples of one prompt under a cached system prompt: ``first`` computes the prompt past the system
    prompt (its own first 40 positions a hit, their tokens known only at its finish), ``second`` hits the cache for
    73 positions and finishes first. Its line waits for ``first``'s and takes its rows (and, through them, the
    system prompt's donor's); when the run ends before ``first`` finishes, ``second`` is written all the same."""
    system = make_request(40, "float32", rng)
    first = sharing(system, make_request(80, "float32", rng), 40)
    second = sharing(first, make_request(83, "float32", rng), 73)
    writer = StoreWriter(tmp_path, shard_bytes("float32"), writer_threads=1, flush_s=0)  # each tick seals a shard
    writer.begin_run(*make_layout("run-a"))
    feed = Feed(writer, {"system": system, "first": first, "second": second})
    capture(feed, "system")
    feed.chunk([("first", range(40, 75))])  # its prompt past the cached system prompt
    capture(feed, "second", 73)  # finishes while first decodes
    deadline = time.monotonic() + 60
    while writer.rows_durable < 40 + 35 + 10 and time.monotonic() < deadline:  # every row sent so far is listed
        writer.tick()
        time.sleep(0.01)
    assert [r["id"] for r in read_index(tmp_path) if r["type"] == "request"] == ["system"]  # second waits
    for at in range(75, 80):
        feed.chunk([("first", [at])])
    if donor_finishes:
        finish_hit(feed, "first", 40)
    writer.close()
    store = open_store(tmp_path)
    if donor_finishes:
        assert store.record("first")["shared"][0]["id"] == "system"
        assert [(e["id"], e["start"], e["end"]) for e in store.record("second")["shared"]] == [("first", 0, 73)]
        _check_rows(tmp_path, {"system": system, "first": first, "second": second})
    else:  # first's first 40 tokens were never given: it holds nothing from 0, so it lends nothing
        assert store.record("first")["status"] == store.record("second")["status"] == "incomplete"
        assert store.record("second")["missing"] == [[0, 73]]
    assert verify_store(tmp_path).ok


def test_later_runs_find_donors_of_earlier_ones(tmp_path: Path, rng: np.random.Generator) -> None:
    a = make_request(40, "bfloat16", rng)
    b = sharing(a, make_request(44, "bfloat16", rng), 39)
    writer = _writer(tmp_path, "run-1", "bfloat16")
    feed = Feed(writer, {"a": a})
    capture(feed, "a")
    writer.close()
    writer = _writer(tmp_path, "run-2", "bfloat16")  # a new process: the index is rebuilt from the store
    feed = Feed(writer, {"b": b})
    capture(feed, "b", 39)
    writer.close()
    assert open_store(tmp_path).record("b")["shared"][0]["id"] == "a"
    _check_rows(tmp_path, {"a": a, "b": b})


def test_readers_follow_references_in_the_dataset_and_exports(tmp_path: Path, rng: np.random.Generator) -> None:
    from hscapture.dataset import CaptureDataset

    a = make_request(40, "float32", rng)
    b = sharing(a, make_request(48, "float32", rng), 35)
    writer = _writer(tmp_path / "s")
    feed = Feed(writer, {"a": a, "b": b})
    send(feed, "a", 0)
    feed.finish("a", num_tokens=40, loss_mask=[(10, 40)])
    capture(feed, "b", 35)
    writer.close()
    dataset = CaptureDataset(tmp_path / "s")
    item = dataset[dataset.keys.index("b")]
    assert torch.equal(item["layer_5"], b.rows[1]) and item["input_ids"].tolist() == b.token_ids.tolist()
    for kind, layers in (("specforge", 6), ("speculators", 5)):  # speculators' final: layer L = 5 here
        options = ExportOptions(
            tmp_path / "s", tmp_path / kind, kind, any_aux_count=True, num_layers=layers, keep_empty_loss_mask=True,
            progress=False,
        )  # fmt: skip
        assert export(options).written == 2, kind
    sample = [torch.load(f, weights_only=True) for f in (tmp_path / "specforge").rglob("*.ckpt")]
    exported = [load_file(f) for f in (tmp_path / "speculators").rglob("*.safetensors")]
    assert sorted(int(e["input_ids"].shape[-1]) for e in sample) == [40, 48]  # b exported whole, shared rows too
    lengths = sorted(len(e["token_ids"]) for e in exported)
    assert lengths == [40, 48]  # b exported whole, its shared rows included


def test_a_damaged_donor_is_reported_for_every_request_reading_it(tmp_path: Path, rng: np.random.Generator) -> None:
    a = make_request(40, "float32", rng)
    b = sharing(a, make_request(44, "float32", rng), 30)
    c = sharing(b, make_request(50, "float32", rng), 40)
    _captured(tmp_path, {"a": (a, 0), "b": (b, 30), "c": (c, 40)})
    store = open_store(tmp_path)
    shard_id = store.record("a")["spans"][0][0]
    path = tmp_path / shard_name(shard_id)
    (length,) = np.frombuffer(path.read_bytes()[:8], "<u8")
    header = json.loads(path.read_bytes()[8 : 8 + int(length)])
    with path.open("r+b") as handle:  # a byte of a's first row in that shard changed
        handle.seek(8 + int(length) + header["layer_2"]["data_offsets"][0] + 3)
        byte = handle.read(1)[0]
        handle.seek(-1, 1)
        handle.write(bytes([byte ^ 0x10]))
    report = verify_store(tmp_path)
    (bad,) = report.corrupted
    assert bad.id == shard_id and {"a", "b", "c"} <= set(bad.requests)
    assert {"a", "b", "c"} <= set(report.affected_requests)
    with pytest.raises(StoreError, match=rf"request 'c' takes positions 0..39 from request 'b'.*{path.name}"):
        open_store(tmp_path).get("c")

    path.unlink()  # the donor's shard gone: reported the same way
    report = verify_store(tmp_path)
    assert report.missing and {"a", "b", "c"} <= set(report.missing[0].requests)


def test_a_reference_to_a_donor_the_store_lacks_is_reported(tmp_path: Path, rng: np.random.Generator) -> None:
    a = make_request(40, "float32", rng)
    b = sharing(a, make_request(44, "float32", rng), 30)
    _captured(tmp_path, {"a": (a, 0), "b": (b, 30)})
    _lose_line(tmp_path, "a")
    report = verify_store(tmp_path)
    assert not report.ok and [(p.request, "does not hold" in p.problem) for p in report.dangling] == [("b", True)]
    with pytest.raises(StoreError, match=r"request 'b' takes positions 0\.\.29 from request 'a', which the store"):
        open_store(tmp_path).get("b")


KILLED_WRITER = """
import sys, time
import numpy as np
from tests.storefeed import Feed, make_layout, make_request, shard_bytes
from tests.storefeed import capture, send, sharing
from hscapture.store.writer import StoreWriter

rng = np.random.default_rng(7)
a = make_request(40, "float32", rng)
b = sharing(a, make_request(50, "float32", rng), 33)
c = sharing(b, make_request(55, "float32", rng), 45)
writer = StoreWriter(sys.argv[1], shard_bytes("float32"), writer_threads=1, flush_s=0.0)
writer.begin_run(*make_layout("run-killed"))
feed = Feed(writer, {"a": a, "b": b, "c": c})
capture(feed, "a")
capture(feed, "b", 33)
send(feed, "c", 45, chunk=4)  # c never finishes: the writer is killed first
while writer.requests_written < 2 or writer.rows_durable < 40 + 17:  # a and b recorded, c's first rows durable
    writer.tick()
    time.sleep(0.01)
writer._index.flush()
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_writer_and_a_resumed_capture_keep_references_right(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    process.send_signal(signal.SIGKILL)
    process.wait()

    rng = np.random.default_rng(7)  # the same requests the killed writer had
    a = make_request(40, "float32", rng)
    b = sharing(a, make_request(50, "float32", rng), 33)
    c = sharing(b, make_request(55, "float32", rng), 45)
    writer = _writer(tmp_path, "run-resumed")  # recovers the dead run: c recorded incomplete
    feed = Feed(writer, {"c": c})
    capture(feed, "c", 45)  # captured again, hitting the cache as before
    writer.close()
    store = open_store(tmp_path)
    assert [store.record(k)["status"] for k in ("a", "b", "c")] == ["complete"] * 3
    recovered = next(r for r in read_index(tmp_path) if r["type"] == "request" and r["id"] == "c")
    assert recovered["status"] == "incomplete" and "consumer died" in recovered["reason"]
    assert store.record("c")["shared"][0]["id"] == "b"
    assert verify_store(tmp_path).ok
    _check_rows(tmp_path, {"a": a, "b": b, "c": c})


def test_finish_carries_the_prefix_token_ids_over_the_wire() -> None:
    from hscapture import protocol

    message = protocol.RequestFinished(
        v=protocol.PROTOCOL_VERSION,
        request_id="r",
        reason="finished",
        prefix_token_ids=protocol.pack_rows(np.arange(5)),
    )
    decoded = protocol.decode_to_consumer(protocol.encode(message))
    assert isinstance(decoded, protocol.RequestFinished)
    prefix = protocol.unpack_prefix(decoded)
    assert prefix is not None and prefix.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ProtocolError, match=r"^RequestFinished.prefix_token_ids: 7 bytes, not a whole number"):
        protocol.unpack_prefix(protocol.RequestFinished(v=1, request_id="r", reason="x", prefix_token_ids=b"1234567"))
    assert protocol.unpack_prefix(protocol.RequestFinished(v=1, request_id="r", reason="x")) is None
    assert Finish().prefix_token_ids is None


def test_repair_keeps_references_but_a_rebuilt_line_has_none(tmp_path: Path, rng: np.random.Generator) -> None:
    """``verify --repair`` keeps the lines it can read as they are, references included; a line it rebuilds
    from the shards holds only the request's own rows (the shards say nothing of references): incomplete."""
    a = make_request(40, "float32", rng)
    b = sharing(a, make_request(44, "float32", rng), 30)
    c = sharing(a, make_request(50, "float32", rng), 35)
    _captured(tmp_path, {"a": (a, 0), "b": (b, 30), "c": (c, 35)})
    _lose_line(tmp_path, "c")

    repaired = repair_store(tmp_path)
    assert repaired.rebuilt == ["c"]
    store = open_store(tmp_path)
    assert store.record("b")["status"] == "complete" and store.record("b")["shared"][0]["id"] == "a"
    _check_rows(tmp_path, {"a": a, "b": b})
    rebuilt = store.record("c")
    assert rebuilt["status"] == "incomplete" and "shared" not in rebuilt, rebuilt
    assert rebuilt["rows"] == 50 - 35 and rebuilt["missing"] == [[0, 35]], rebuilt
    assert store.get("c", ["layer_2"])["positions"].tolist() == list(range(35, 50))  # its own rows only
