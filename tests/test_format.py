"""Golden values for the on-disk store format of FORMAT.md.

``StoreWriter`` is fed rows (as the consumer feeds it) for two requests with fixed, non-zero
bfloat16 rows; the files it leaves are then read back byte by byte (meta.json, index.jsonl,
the safetensors header parsed by hand, the raw tensor bytes) and with safetensors alone,
exactly as FORMAT.md's "Reading without hscapture" does. Every expected value below is
written out by hand from FORMAT.md, not computed by hscapture.

The feed (two chunks, rows interleaved, one request arriving out of position order):

    chunk 1: req-a positions 0 1 2, req-b position 3
    chunk 2: req-b positions 0 1,   req-a position 3

req-a finishes normally (4 tokens); req-b is aborted with 5 tokens expected, one row dropped
by the producer, so positions 2 and 4 are missing.
"""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hscapture import open_store
from hscapture.store.format import encode_line
from hscapture.store.records import Finish
from hscapture.store.writer import RowGeometry, StoreWriter
from tests.storefeed import write_rows

RUN_ID = "run-golden"
NAMES = ["layer_1", "last"]
DESCRIPTIONS = ["residual stream entering decoder layer 1", "final hidden state after the last norm"]
HIDDEN = 4
RUN_META = {"engine": "golden", "model": "none"}
ONE_SHARD = 1 << 20  # every row fits one shard
THREE_ROWS = 3 * len(NAMES) * HIDDEN * 2  # 48 bytes: three bf16 rows per shard

# Per request: rows[tensor][position] as plain floats, all exactly representable in bfloat16.
# req-a: layer_1 = 1..16, last = 17..32; req-b: layer_1 = -0.5..-10, last = -10.5..-20.
A_ROWS = [[[float(1 + 16 * t + 4 * p + i) for i in range(HIDDEN)] for p in range(4)] for t in range(2)]
B_ROWS = [[[-0.5 * (1 + 20 * t + 4 * p + i) for i in range(HIDDEN)] for p in range(5)] for t in range(2)]
A_TOKEN_BASE, B_TOKEN_BASE = 100, 200  # token id at position p = base + p

# The single shard's rows, in arrival order: (request, position).
SHARD_ROWS = [("a", 0), ("a", 1), ("a", 2), ("b", 3), ("b", 0), ("b", 1), ("a", 3)]

EXPECTED_META = {
    "format": "hscapture-store",
    "version": 2,
    "dtype": "bfloat16",
    "hidden_size": 4,
    "tensors": [
        {"name": "layer_1", "description": "residual stream entering decoder layer 1"},
        {"name": "last", "description": "final hidden state after the last norm"},
    ],
}

EXPECTED_REQ_A = {
    "type": "request",
    "id": "req-a",
    "run_id": "run-golden",
    "status": "complete",
    "reason": "",
    "rows": 4,
    "num_tokens": 4,
    "dropped_rows": 0,
    "missing": [],
    "spans": [[0, 0, 3], [0, 6, 1]],
    "loss_mask": [[2, 4]],
    "meta": {"finish": "stop", "engine_id": 7},
}
EXPECTED_REQ_B = {
    "type": "request",
    "id": "req-b",
    "run_id": "run-golden",
    "status": "incomplete",
    "reason": "aborted; producer dropped 1 rows; 2 positions missing",
    "rows": 3,
    "num_tokens": 5,
    "dropped_rows": 1,
    "missing": [[2, 3], [4, 5]],
    "spans": [[0, 3, 3]],
    "loss_mask": [[3, 5]],
    "meta": {},
}
EXPECTED_RUN_END = {"type": "run_end", "run_id": "run-golden", "reason": "eos", "counters": {"rows_dropped": 1}}

# safetensors puts the 8-byte-aligned dtypes first (U32 before I32), then sorts by name; the header
# is padded with spaces to a multiple of 8 bytes.
EXPECTED_HEADER_LEN = 512
EXPECTED_SHARD_BYTES = 8 + EXPECTED_HEADER_LEN + 308
EXPECTED_HEADER = {
    "__metadata__": {
        "format": "hscapture-shard",
        "version": "2",
        "run_id": "run-golden",
        "request_ids": ["req-a", "req-b"],  # stored as a JSON string; decoded before comparing
    },
    "positions": {"dtype": "I64", "shape": [7], "data_offsets": [0, 56]},
    "token_ids": {"dtype": "I64", "shape": [7], "data_offsets": [56, 112]},
    # CRC-32 of each stored row of each captured tensor, columns in meta.json order (layer_1, last)
    "row_crc32": {"dtype": "U32", "shape": [7, 2], "data_offsets": [112, 168]},
    "request_index": {"dtype": "I32", "shape": [7], "data_offsets": [168, 196]},
    "last": {"dtype": "BF16", "shape": [7, 4], "data_offsets": [196, 252]},
    "layer_1": {"dtype": "BF16", "shape": [7, 4], "data_offsets": [252, 308]},
}
# CRC-32 (zlib.crc32) of each tensor's data bytes, in file order. The whole-file ``crc32`` is not
# golden: safetensors writes ``__metadata__`` keys in hash order, which changes between processes,
# so it is checked against zlib.crc32 of the file instead (pop_file_crc32).
EXPECTED_TENSOR_CRC32 = {
    "positions": "8279f597",
    "token_ids": "aef2b211",
    "row_crc32": "26d64fa1",
    "request_index": "7917aa89",
    "last": "e2ce5567",
    "layer_1": "c6fe9d41",
}
EXPECTED_INDEX = [
    {"type": "run", "run_id": "run-golden", "meta": {"engine": "golden", "model": "none"}},
    {
        "type": "shard",
        "id": 0,
        "file": "shard-000000.safetensors",
        "rows": 7,
        "bytes": EXPECTED_SHARD_BYTES,
        "tensor_crc32": EXPECTED_TENSOR_CRC32,
    },
    EXPECTED_REQ_A,
    EXPECTED_REQ_B,
    EXPECTED_RUN_END,
]


def bf16_bytes(values: list[float]) -> bytes:
    """Little-endian bfloat16 of exactly representable floats: the high half of each float32."""
    return b"".join(struct.pack("<f", v)[2:] for v in values)


def request_rows(request: str) -> list[list[list[float]]]:
    return A_ROWS if request == "a" else B_ROWS


def token_id(request: str, position: int) -> int:
    return (A_TOKEN_BASE if request == "a" else B_TOKEN_BASE) + position


# ---------------------------------------------------------------------------------- writing


def layout() -> tuple[str, RowGeometry, dict[str, Any]]:
    """``StoreWriter.begin_run``'s arguments for the golden run."""
    return RUN_ID, RowGeometry(tuple(NAMES), tuple(DESCRIPTIONS), "bfloat16", HIDDEN), dict(RUN_META)


def chunk(writer: StoreWriter, segments: list[tuple[str, str, list[int]]]) -> None:
    """Write ``(request id, "a"|"b", positions)`` segments: their ``[tensors, rows, hidden]`` rows, in order."""
    planes: list[list[list[float]]] = [[] for _ in NAMES]
    positions, token_ids = [], []
    for _, request, where in segments:
        for p in where:
            for t, plane in enumerate(planes):
                plane.append(request_rows(request)[t][p])
            positions.append(p)
            token_ids.append(token_id(request, p))
    rows = torch.tensor(planes, dtype=torch.float32).to(torch.bfloat16)
    write_rows(writer, rows, [s[0] for s in segments], [len(s[2]) for s in segments], positions, token_ids)


def write_golden(root: Path, shard_bytes: int = ONE_SHARD) -> Path:
    """The golden feed, written through ``StoreWriter`` with one writer thread."""
    writer = StoreWriter(root, shard_bytes=shard_bytes, writer_threads=1)
    try:
        writer.begin_run(*layout())
        chunk(writer, [("req-a", "a", [0, 1, 2]), ("req-b", "b", [3])])
        chunk(writer, [("req-b", "b", [0, 1]), ("req-a", "a", [3])])
        writer.finish_request(
            "req-a", Finish("finished", 4, loss_mask=[(2, 4)], meta={"finish": "stop", "engine_id": 7})
        )
        writer.finish_request("req-b", Finish("aborted", 5, dropped_rows=1, loss_mask=[(3, 5)]))
        writer.end_run("eos", {"rows_dropped": 1})
    finally:
        writer.close()
    return root


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return write_golden(tmp_path / "store")


def index_lines(root: Path) -> list[str]:
    text = (root / "index.jsonl").read_text()
    assert text.endswith("\n"), "every index line ends in a newline"
    return text.splitlines(keepends=True)


def index_records(root: Path) -> list[dict[str, Any]]:
    """The index's records, each line's ``line_crc32`` checked by hand (zlib.crc32 of the bytes before
    ``,"line_crc32"``, its last field) and removed."""
    records = []
    for line in index_lines(root):
        body, tail = line.rsplit(',"line_crc32":"', 1)
        assert tail == f'{zlib.crc32(body.encode()):08x}"}}\n', line
        record = json.loads(line)
        assert list(record)[-1] == "line_crc32"
        del record["line_crc32"]
        records.append(record)
    return records


def pop_file_crc32(root: Path, records: list[dict[str, Any]]) -> None:
    """Each shard line's ``crc32`` is zlib.crc32 of its file's bytes, as 8 lowercase hex digits; removed."""
    for record in records:
        if record["type"] == "shard":
            crc = record.pop("crc32")
            assert crc == f"{zlib.crc32((root / record['file']).read_bytes()):08x}", record["file"]


def parse_header(data: bytes) -> tuple[int, dict[str, Any]]:
    """(N, header) of safetensors bytes: a little-endian u64 N, then N bytes of JSON."""
    (length,) = struct.unpack("<Q", data[:8])
    return length, json.loads(data[8 : 8 + length].decode("utf-8"))


# ---------------------------------------------------------------------------------- (a) meta.json


def test_meta_json_is_exactly_the_captured_tensors(store: Path) -> None:
    assert json.loads((store / "meta.json").read_text()) == EXPECTED_META
    assert sorted(p.name for p in store.iterdir() if p.name != ".lock") == [
        "index.jsonl",
        "meta.json",
        "shard-000000.safetensors",
    ], "no temp files or extra files are left behind"


def test_meta_json_is_written_when_the_first_run_begins(tmp_path: Path) -> None:
    """Before any row arrives, meta.json exists and the index holds only the run line."""
    writer = StoreWriter(tmp_path, shard_bytes=ONE_SHARD, writer_threads=1)
    try:
        writer.begin_run(*layout())
        assert json.loads((tmp_path / "meta.json").read_text()) == EXPECTED_META
        records = index_records(tmp_path)
        assert [r["type"] for r in records] == ["run"]
    finally:
        writer.close()


# ---------------------------------------------------------------------------------- (b) index.jsonl


def test_index_lines_are_exactly_the_golden_records(store: Path) -> None:
    records = index_records(store)
    run_time = records[0].pop("time")
    pop_file_crc32(store, records)
    assert records == EXPECTED_INDEX
    assert isinstance(run_time, float) and 1.7e9 < run_time < 4e9, "run time is unix seconds"


def test_index_lines_stay_golden_with_rows_split_over_three_shards(tmp_path: Path) -> None:
    """Shards of three rows: req-a spans shards 0 and 2, req-b's rows fill shard 1.

    Shard and request lines may interleave (a request is indexed as soon as its own shards
    are), so the order is checked as FORMAT.md states it: every shard a request line names is
    listed on an earlier line.
    """
    root = write_golden(tmp_path, shard_bytes=THREE_ROWS)
    records = index_records(root)
    records[0].pop("time")
    pop_file_crc32(root, records)
    shards = [
        {"type": "shard", "id": 0, "file": "shard-000000.safetensors", "rows": 3, "bytes": 636},
        {"type": "shard", "id": 1, "file": "shard-000001.safetensors", "rows": 3, "bytes": 636},
        {"type": "shard", "id": 2, "file": "shard-000002.safetensors", "rows": 1, "bytes": 548},
    ]
    shards[0]["tensor_crc32"] = {
        "positions": "4f8c5ccc",
        "token_ids": "4751a91d",
        "row_crc32": "c8278cac",
        "request_index": "7bd5c66f",
        "last": "acb49535",
        "layer_1": "c1b09fdf",
    }
    shards[1]["tensor_crc32"] = {
        "positions": "37756396",
        "token_ids": "26ce8834",
        "row_crc32": "497cd208",
        "request_index": "7bd5c66f",  # all zeros (3 x int32), as in shard 0
        "last": "cb46ba83",
        "layer_1": "4959eeef",
    }
    shards[2]["tensor_crc32"] = {
        "positions": "ebadd88a",
        "token_ids": "bf0c76cb",
        "row_crc32": "91eef6b1",
        "request_index": "2144df1c",
        "last": "0d320e93",
        "layer_1": "9f2082e7",
    }
    expected = [
        EXPECTED_INDEX[0],
        *shards,
        {**EXPECTED_REQ_A, "spans": [[0, 0, 3], [2, 0, 1]]},
        {**EXPECTED_REQ_B, "spans": [[1, 0, 3]]},
        EXPECTED_RUN_END,
    ]
    key = json.dumps
    assert sorted(map(key, records)) == sorted(map(key, expected))
    assert records[0]["type"] == "run" and records[-1] == EXPECTED_RUN_END
    assert [r["id"] for r in records if r["type"] == "shard"] == [0, 1, 2]
    listed: set[int] = set()
    for record in records:
        if record["type"] == "shard":
            listed.add(record["id"])
            assert (root / record["file"]).stat().st_size == record["bytes"]
        elif record["type"] == "request":
            assert {s[0] for s in record["spans"]} <= listed, f"{record['id']} indexed before its shards"


# ---------------------------------------------------------------------------------- (c) shard bytes


def test_shard_header_parsed_by_hand_is_golden(store: Path) -> None:
    data = (store / "shard-000000.safetensors").read_bytes()
    length, header = parse_header(data)
    assert length == EXPECTED_HEADER_LEN
    assert len(data) == EXPECTED_SHARD_BYTES == 8 + length + EXPECTED_HEADER["layer_1"]["data_offsets"][1]
    header["__metadata__"]["request_ids"] = json.loads(header["__metadata__"]["request_ids"])
    assert header == EXPECTED_HEADER


def test_shard_tensor_bytes_are_golden(store: Path) -> None:
    data = (store / "shard-000000.safetensors").read_bytes()
    length, header = parse_header(data)
    body = data[8 + length :]

    def raw(name: str) -> bytes:
        start, end = header[name]["data_offsets"]
        return body[start:end]

    # The first stored row of layer_1 is req-a position 0: 1.0 2.0 3.0 4.0 = 0x3f80 0x4000 0x4040 0x4080.
    assert raw("layer_1")[:8] == bytes.fromhex("803f 0040 4040 8040")
    for t, name in enumerate(NAMES):
        expected = b"".join(bf16_bytes(request_rows(r)[t][p]) for r, p in SHARD_ROWS)
        assert raw(name) == expected, name
    # row_crc32[r, t]: zlib.crc32 of row r of tensor t (meta.json order: layer_1, last), as stored
    crcs = [zlib.crc32(bf16_bytes(request_rows(r)[t][p])) for r, p in SHARD_ROWS for t in range(len(NAMES))]
    assert raw("row_crc32") == struct.pack(f"<{len(crcs)}I", *crcs)
    assert raw("positions") == struct.pack("<7q", 0, 1, 2, 3, 0, 1, 3)
    assert raw("token_ids") == struct.pack("<7q", 100, 101, 102, 203, 200, 201, 103)
    assert raw("request_index") == struct.pack("<7i", 0, 0, 0, 1, 1, 1, 0)


# ---------------------------------------------------------------------------------- (d) safetensors alone


@pytest.mark.parametrize("shard_bytes", [ONE_SHARD, THREE_ROWS], ids=["one-shard", "three-shards"])
def test_reading_without_hscapture_follows_format_md(tmp_path: Path, shard_bytes: int) -> None:
    """FORMAT.md's snippet, nearly verbatim: json + safetensors.torch.load_file, nothing else."""
    root = write_golden(tmp_path / "store", shard_bytes)
    with open(root / "index.jsonl") as index:
        records = [json.loads(line) for line in index if line.endswith("\n")]
    requests = {r["id"]: r for r in records if r["type"] == "request"}
    assert sorted(requests) == ["req-a", "req-b"]
    for key, letter, arrival in [("req-a", "a", [0, 1, 2, 3]), ("req-b", "b", [3, 0, 1])]:
        request = requests[key]
        got: dict[str, list[torch.Tensor]] = {name: [] for name in [*NAMES, "positions", "token_ids"]}
        ids_seen = []
        for shard_id, start, count in request["spans"]:
            shard = load_file(f"{root}/shard-{shard_id:06d}.safetensors")
            for name, pieces in got.items():
                pieces.append(shard[name][start : start + count])
            # request_index points into the shard's request_ids metadata list
            with safe_open(f"{root}/shard-{shard_id:06d}.safetensors", framework="pt") as handle:
                request_ids = json.loads(handle.metadata()["request_ids"])
            ids_seen += [request_ids[i] for i in shard["request_index"][start : start + count].tolist()]
        rows = {name: torch.cat(pieces) for name, pieces in got.items()}
        assert ids_seen == [key] * len(arrival)
        assert rows["positions"].tolist() == arrival, "spans give rows in arrival order"
        assert rows["token_ids"].tolist() == [token_id(letter, p) for p in arrival]
        for t, name in enumerate(NAMES):
            assert rows[name].dtype == torch.bfloat16 and rows[name].shape == (len(arrival), HIDDEN)
            assert rows[name].view(torch.uint8).numpy().tobytes() == b"".join(
                bf16_bytes(request_rows(letter)[t][p]) for p in arrival
            )


def test_open_store_agrees_with_the_golden_rows(store: Path) -> None:
    """The hscapture reader sorts by position and expands the loss mask; same golden values."""
    reader = open_store(store)
    assert reader.keys() == ["req-a", "req-b"] and reader.keys(complete_only=True) == ["req-a"]
    b = reader.get("req-b")
    assert b["positions"].tolist() == [0, 1, 3]
    assert b["input_ids"].tolist() == [200, 201, 203]
    assert b["loss_mask"].tolist() == [0, 0, 1]
    assert b["last"].view(torch.uint8).numpy().tobytes() == b"".join(bf16_bytes(B_ROWS[1][p]) for p in [0, 1, 3])
    a = reader.get("req-a")
    assert a["loss_mask"].tolist() == [0, 0, 1, 1]
    assert a["layer_1"].float().tolist() == A_ROWS[0]


# ---------------------------------------------------------------------------------- (e) what a reader ignores


TORN_LINES = {
    # a crash mid-append: part of a line
    "fragment": b'{"type":"request","id":"req-c","run_id":"run-gol',
    # a whole record whose newline never reached the disk: still not a line
    "json-without-newline": json.dumps(
        {**EXPECTED_REQ_A, "status": "incomplete", "reason": "torn", "rows": 1, "spans": [[1, 0, 1]]}
    ).encode(),
}


@pytest.mark.parametrize("torn", list(TORN_LINES), ids=list(TORN_LINES))
def test_reader_ignores_unlisted_shard_and_torn_last_line(store: Path, torn: str) -> None:
    """A crash after a shard was renamed but before its shard line, then a torn request line."""
    shutil.copy(store / "shard-000000.safetensors", store / "shard-000001.safetensors")
    (store / "shard-000002.safetensors.tmp").write_bytes(b"half a shard")
    with open(store / "index.jsonl", "ab") as handle:
        handle.write(TORN_LINES[torn])

    reader = open_store(store)
    assert reader.keys() == ["req-a", "req-b"]
    assert reader.record("req-a") == EXPECTED_REQ_A
    summary = reader.summary()
    assert (summary["shards"], summary["bytes"], summary["rows"]) == (1, EXPECTED_SHARD_BYTES, 7)
    assert reader.get("req-a")["positions"].tolist() == [0, 1, 2, 3]

    # FORMAT.md's plain reader skips the torn line too
    with open(store / "index.jsonl") as index:
        plain = [json.loads(line) for line in index if line.endswith("\n")]
    assert len(plain) == len(EXPECTED_INDEX)


@pytest.mark.parametrize("torn", list(TORN_LINES), ids=list(TORN_LINES))
def test_writer_cuts_a_torn_last_line_before_appending(store: Path, torn: str) -> None:
    before = (store / "index.jsonl").read_bytes()
    with open(store / "index.jsonl", "ab") as handle:
        handle.write(TORN_LINES[torn])
    shutil.copy(store / "shard-000000.safetensors", store / "shard-000001.safetensors")

    writer = StoreWriter(store, shard_bytes=ONE_SHARD, writer_threads=1)
    try:
        writer.begin_run(*layout())
        writer.end_run("eos", {})
    finally:
        writer.close()

    after = (store / "index.jsonl").read_bytes()
    assert after.startswith(before), "lines are only ever appended"
    added = [json.loads(line) for line in after[len(before) :].decode().splitlines(keepends=True)]
    assert [r["type"] for r in added] == ["run", "run_end"], "the torn bytes are gone, new lines start clean"
    assert after.endswith(b"\n")
    assert not list(store.glob("*.tmp"))


def test_a_later_request_line_wins(store: Path) -> None:
    """An id on several lines (a resumed extraction): the last complete line wins."""
    redone = {**EXPECTED_REQ_B, "status": "complete", "reason": "", "meta": {"redone": True}}
    with open(store / "index.jsonl", "ab") as handle:
        handle.write(encode_line(redone))
    assert open_store(store).record("req-b") == redone
    assert open_store(store).keys() == ["req-a", "req-b"]
