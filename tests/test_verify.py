"""Integrity checking: checksums in the shard lines, ``verify_store`` and ``hscapture verify``.

Each test writes a real store with ``StoreWriter`` (random, never-zero rows over several shards),
damages it the way disks and people do (a flipped bit in a tensor, in the header, a deleted or
truncated shard, a stray file, a torn index line) and checks what the verifier reports, through
the API and through the CLI run as a separate process. Which requests a shard holds is worked out
from the feed itself (rows fill shards in arrival order), not from the index the verifier reads.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hscapture.consumer.device_fp8 import RowCrcs
from hscapture.errors import StoreError
from hscapture.store.checksum import combine_columns, combine_rows, crc32_combine, crc_kernel, row_crcs
from hscapture.store.format import encode_line
from hscapture.store.records import Finish
from hscapture.store.verify import BLOCK_BYTES, ShardCheck, VerifyReport, format_report, verify_store
from hscapture.store.writer import StoreWriter
from tests.conftest import run_cli
from tests.storefeed import (
    ROWS_PER_SHARD,
    Feed,
    flip,
    header_of,
    make_layout,
    make_request,
    shard_bytes,
    write_rows,
)

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = {"r-a": 5, "r-b": 12, "r-c": 9, "r-d": 16}  # 42 rows: six full shards of 7
NUM_SHARDS = 6
TENSORS = ["layer_2", "layer_5", "last", "positions", "token_ids", "request_index", "row_crc32"]
#: A meta.json a reader accepts, for hand-made stores.
META = {
    "format": "hscapture-store",
    "version": 1,
    "dtype": "float32",
    "hidden_size": 4,
    "tensors": [{"name": "x", "description": "a tensor"}],
}


@dataclass
class Built:
    root: Path
    holders: list[list[str]]  # per shard id: the requests with rows in it (sorted), from the feed

    def shard(self, shard_id: int) -> Path:
        return self.root / f"shard-{shard_id:06d}.safetensors"


def build_store(root: Path, seed: int = 0) -> Built:
    """Four requests interleaved, up to three rows each per chunk, into six shards of seven rows."""
    rng = np.random.default_rng(seed)
    requests = {key: make_request(n, "float32", rng) for key, n in LENGTHS.items()}
    writer = StoreWriter(root, shard_bytes("float32"), writer_threads=2)
    arrival: list[str] = []
    try:
        writer.begin_run(*make_layout())
        feed = Feed(writer, requests, "float32")
        done = dict.fromkeys(LENGTHS, 0)
        while any(done[k] < n for k, n in LENGTHS.items()):
            segments = []
            for key, n in LENGTHS.items():
                if done[key] < n:
                    take = min(int(rng.integers(1, 4)), n - done[key])
                    segments.append((key, range(done[key], done[key] + take)))
                    arrival += [key] * take
                    done[key] += take
            feed.chunk(segments)
            for key, where in segments:
                if where.stop == LENGTHS[key]:
                    feed.finish(key, num_tokens=LENGTHS[key])
    finally:
        writer.close()
    holders = [sorted(set(arrival[s * ROWS_PER_SHARD : (s + 1) * ROWS_PER_SHARD])) for s in range(NUM_SHARDS)]
    assert len(arrival) == NUM_SHARDS * ROWS_PER_SHARD
    return Built(root, holders)


@pytest.fixture
def built(tmp_path: Path) -> Built:
    return build_store(tmp_path / "store")


def shard_lines(root: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, (root / "index.jsonl").read_text().splitlines()) if r["type"] == "shard"]


def request_line(request_id: str, spans: list[list[int]]) -> dict[str, Any]:
    """A well-formed complete request line (what a writer would append) with these spans."""
    rows = sum(span[2] for span in spans)
    return {
        "type": "request", "id": request_id, "run_id": "run-a", "status": "complete", "reason": "", "rows": rows,
        "num_tokens": rows, "dropped_rows": 0, "missing": [], "spans": spans, "loss_mask": [], "meta": {},
    }  # fmt: skip


def problems(report: VerifyReport) -> list[ShardCheck]:
    return report.corrupted + report.missing


# ------------------------------------------------------------------------------ checksums on disk


def test_shard_lines_carry_zlib_crc32_of_the_file_and_of_each_tensor(built: Built) -> None:
    lines = shard_lines(built.root)
    assert sorted(line["id"] for line in lines) == list(range(NUM_SHARDS))
    for line in lines:
        data = (built.root / line["file"]).read_bytes()
        assert line["crc32"] == f"{zlib.crc32(data):08x}"
        base, header = header_of(built.root / line["file"])
        names = [n for n in sorted(header, key=lambda n: header[n].get("data_offsets", [-1])) if n != "__metadata__"]
        assert list(line["tensor_crc32"]) == names, "every tensor, in file order"
        assert sorted(names) == sorted(TENSORS)
        for name in names:
            begin, end = header[name]["data_offsets"]
            assert line["tensor_crc32"][name] == f"{zlib.crc32(data[base + begin : base + end]):08x}", name


def test_format_md_integrity_snippet_runs_and_catches_a_flipped_byte(built: Built, tmp_path: Path) -> None:
    text = (ROOT / "FORMAT.md").read_text()
    section = text[text.index("## Integrity") : text.index("## Reading without hscapture")]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    snippet = snippet.replace('"store/', f'"{built.root}/').replace('f"store/', f'f"{built.root}/')
    assert str(built.root) in snippet
    exec(compile(snippet, "FORMAT.md", "exec"), {})
    base, header = header_of(built.shard(0))
    flip(built.shard(0), base + header["token_ids"]["data_offsets"][0] + 3)
    with pytest.raises(AssertionError):
        exec(compile(snippet, "FORMAT.md", "exec"), {})


def test_crc32_combine_equals_zlib_over_the_concatenation() -> None:
    rng = np.random.default_rng(7)
    for size_a, size_b in [(0, 0), (0, 5), (5, 0), (1, 1), (13, 8 << 20), (1000, 65537), (3, (1 << 20) + 3)]:
        a = rng.integers(0, 256, size_a, dtype=np.uint8).tobytes()
        b = rng.integers(0, 256, size_b, dtype=np.uint8).tobytes()
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b), (size_a, size_b)


def test_combined_row_crcs_equal_zlib_over_the_plane() -> None:
    """A tensor's CRC folded from its rows' (front-padded to a power of two, byte tables per row size) is
    zlib's over the whole plane: no rows, one, odd and even counts, powers of two and one past."""
    rng = np.random.default_rng(11)
    for rows in (0, 1, 2, 3, 7, 8, 9, 100, 513):
        for width in (1, 3, 64, 4096):
            plane = rng.integers(0, 256, (rows, width), dtype=np.uint8)
            crcs = np.array([zlib.crc32(row.tobytes()) for row in plane], dtype=np.uint32)
            assert combine_rows(crcs, width) == zlib.crc32(plane.tobytes()), (rows, width)


def test_combined_columns_equal_zlib_over_each_plane() -> None:
    """Every tensor of a shard folded in one pass (``[rows, tensors]`` row CRCs, as a shard's row table holds
    them) gives each tensor's zlib CRC, as folding it alone does."""
    rng = np.random.default_rng(12)
    for rows in (0, 1, 2, 5, 64, 300):
        planes = rng.integers(0, 256, (7, rows, 48), dtype=np.uint8)
        table = np.array([[zlib.crc32(row.tobytes()) for row in plane] for plane in planes], np.uint32).T
        table = table.reshape(rows, len(planes))
        expected = [zlib.crc32(plane.tobytes()) for plane in planes]
        assert combine_columns(table, 48).tolist() == expected, rows


@pytest.mark.parametrize("width", [1, 8, 64, 4096])
def test_row_crcs_as_a_matrix_product_equal_zlib(width: int) -> None:
    """:class:`RowCrcs` (what the consumer of a GPU ring computes next to the rows, here on the CPU) gives
    zlib's CRC-32 of each row: random rows, all zeros, all ones, a single bit; fewer rows than it holds."""
    rng = np.random.default_rng(width)
    rows = rng.integers(0, 256, (40, width), dtype=np.uint8)
    rows[0], rows[1], rows[2] = 0, 255, 0
    rows[2, -1] = 0x80
    checksum = RowCrcs(width, 40, torch.device("cpu"))
    for n in (40, 3):
        out = torch.empty(n, dtype=torch.int32)
        checksum(torch.from_numpy(rows[:n]), out)
        assert np.array_equal(out.numpy().view(np.uint32), row_crcs(rows[:n])), n
    with pytest.raises(ValueError, match=rf"RowCrcs: rows \(41, {width}\) torch.uint8; want \[<= 40, {width}\] uint8"):
        checksum(torch.zeros(41, width, dtype=torch.uint8), torch.empty(41, dtype=torch.int32))


def test_compiled_row_crcs_equal_zlib_for_every_width_and_pattern() -> None:
    """The writers' carry-less-multiply kernel gives zlib's CRC-32 of each row: every width from 1 to 300
    (under 64 bytes by the table, then folds of 64 and 16 bytes and tails of 1 to 15), large ones, random
    rows, zeros, ones, a single bit at each end, read-only and strided inputs."""
    if crc_kernel() is None:
        pytest.skip("no compiled CRC kernel: numba missing or disabled, or no PCLMULQDQ")
    rng = np.random.default_rng(11)
    for width in [*range(1, 301), 4095, 4096, 4097, 7168, 65536 + 13]:
        rows = rng.integers(0, 256, (6, width), dtype=np.uint8)
        rows[0], rows[1], rows[2], rows[3] = 0, 255, 0, 0
        rows[2, 0], rows[3, -1] = 0x01, 0x80
        want = [zlib.crc32(row.tobytes()) for row in rows]
        assert row_crcs(rows, compiled=True).tolist() == want, width
    rows = rng.integers(0, 256, (8, 4096), dtype=np.uint8)
    rows.flags.writeable = False
    assert np.array_equal(row_crcs(rows, compiled=True), row_crcs(rows))
    assert np.array_equal(row_crcs(rows[::2, 7:], compiled=True), row_crcs(rows[::2, 7:]))


def test_shard_checksums_of_bytes_with_gaps_and_empty_tensors(tmp_path: Path) -> None:
    """A hand-made safetensors file: bytes between tensors, an empty tensor, trailing bytes.

    Listed with zlib's checksums of its bytes, it verifies: verify computes exactly those.
    """
    header = {
        "__metadata__": {"k": "v"},
        "x": {"dtype": "U8", "shape": [3], "data_offsets": [2, 5]},
        "e": {"dtype": "F32", "shape": [0], "data_offsets": [5, 5]},
        "y": {"dtype": "I16", "shape": [2], "data_offsets": [7, 11]},
    }
    text = json.dumps(header).encode()
    data = struct.pack("<Q", len(text)) + text + bytes(range(1, 14))
    base = 8 + len(text)
    whole = f"{zlib.crc32(data):08x}"
    tensors = {
        "x": f"{zlib.crc32(data[base + 2 : base + 5]):08x}",
        "e": "00000000",
        "y": f"{zlib.crc32(data[base + 7 : base + 11]):08x}",
    }
    (tmp_path / "shard-000000.safetensors").write_bytes(data)
    (tmp_path / "meta.json").write_text(json.dumps(META))
    line = {"type": "shard", "id": 0, "file": "shard-000000.safetensors", "rows": 0, "bytes": len(data)}
    (tmp_path / "index.jsonl").write_text(json.dumps({**line, "crc32": whole, "tensor_crc32": tensors}) + "\n")
    report = verify_store(tmp_path)
    assert report.ok and [c.id for c in report.verified] == [0], report
    flip(tmp_path / "shard-000000.safetensors", base + 6)  # a byte between two tensors: the file's crc32 only
    (bad,) = verify_store(tmp_path).corrupted
    assert bad.tensors == [] and "every tensor matches: the header differs" in bad.problems[0]


# ------------------------------------------------------------------------------ clean store


def test_a_clean_store_verifies(built: Built) -> None:
    report = verify_store(built.root)
    assert report.ok
    assert [c.id for c in report.verified] == list(range(NUM_SHARDS))
    assert all(c.status == "ok" and not c.problems and not c.tensors for c in report.verified)
    assert (report.shards, report.requests) == (NUM_SHARDS, len(LENGTHS))
    assert not (report.corrupted or report.missing or report.unverifiable or report.affected_requests)
    assert not (report.ignored or report.torn_tail or report.unknown_shards or report.bad_index_lines)

    result = run_cli("verify", str(built.root))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{NUM_SHARDS} shards listed: {NUM_SHARDS} verified, 0 corrupted, 0 missing" in result.stdout
    assert result.stdout.rstrip().endswith("OK: every listed shard that has checksums verifies")

    result = run_cli("verify", str(built.root), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is True and len(data["verified"]) == NUM_SHARDS and data["corrupted"] == []


def test_holders_of_the_fixture_span_several_shards(built: Built) -> None:
    """The fixture is what the other tests need: requests cross shards, shards hold several requests."""
    assert sum(len(h) >= 2 for h in built.holders) >= 4
    assert sum("r-d" in h for h in built.holders) >= 3


# ------------------------------------------------------------------------------ damage


@pytest.mark.parametrize("tensor", TENSORS)
def test_a_flipped_bit_in_a_tensor_is_pinned_to_it(built: Built, tensor: str) -> None:
    shard_id = 2
    base, header = header_of(built.shard(shard_id))
    begin, end = header[tensor]["data_offsets"]
    flip(built.shard(shard_id), base + (begin + end) // 2)

    report = verify_store(built.root)
    assert not report.ok
    (bad,) = report.corrupted
    assert (bad.id, bad.file, bad.status, bad.tensors) == (2, "shard-000002.safetensors", "corrupted", [tensor])
    assert sorted(bad.requests) == built.holders[shard_id]
    assert sorted(report.affected_requests) == built.holders[shard_id]
    assert [c.id for c in report.verified] == [0, 1, 3, 4, 5]
    assert not report.missing

    result = run_cli("verify", str(built.root))
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("corrupted:")]
    assert "shard-000002.safetensors" in line and f"tensor {tensor}:" in line
    assert f"affects {len(built.holders[shard_id])} requests: " in line
    assert sorted(line.split(" requests: ")[1].split(", ")) == built.holders[shard_id]
    assert "FAILED" in result.stdout


@pytest.mark.parametrize("where", ["length-prefix", "json-brace", "metadata-value", "header-padding"])
def test_a_damaged_header_is_caught(built: Built, where: str) -> None:
    shard_id = 4
    if where == "header-padding":  # a shard whose header is padded (its length is not a multiple of 8 already)
        shard_id = next(
            i for i in range(NUM_SHARDS) if built.shard(i).read_bytes()[header_of(built.shard(i))[0] - 1] == 32
        )
    path = built.shard(shard_id)
    data = path.read_bytes()
    base, _ = header_of(path)
    if where == "length-prefix":
        offset, mask = 3, 0x10
    elif where == "json-brace":
        offset, mask = 8, 0x01  # '{' becomes 'z'
    elif where == "metadata-value":
        offset, mask = data.index(b"run-a"), 0x01  # 'r' becomes 's': still valid JSON
    else:
        assert data[base - 1 : base] == b" ", "safetensors pads the header with spaces"
        offset, mask = base - 1, 0x01  # ' ' becomes '!': trailing garbage after the JSON
    flip(path, offset, mask)

    report = verify_store(built.root)
    (bad,) = report.corrupted
    assert bad.id == shard_id and bad.tensors == [] and sorted(bad.requests) == built.holders[shard_id]
    if where == "metadata-value":
        assert bad.problems == [
            f"file crc32 {zlib.crc32(path.read_bytes()):08x}, the index says "
            f"{shard_lines(built.root)[shard_id]['crc32']} (every tensor matches: the header differs)"
        ]
    else:
        assert [p.split(":")[0] for p in bad.problems] == ["header unreadable"], bad.problems

    result = run_cli("verify", str(built.root))
    assert result.returncode == 1
    assert f"corrupted: shard-00000{shard_id}.safetensors (shard {shard_id}): " in result.stdout


def test_a_deleted_shard_is_missing_with_its_requests(built: Built) -> None:
    built.shard(3).unlink()
    report = verify_store(built.root)
    assert not report.ok and not report.corrupted
    (gone,) = report.missing
    assert (gone.id, gone.file, gone.problems) == (3, "shard-000003.safetensors", ["file not found"])
    assert sorted(gone.requests) == built.holders[3]
    assert sorted(report.affected_requests) == built.holders[3]

    result = run_cli("verify", str(built.root))
    assert result.returncode == 1
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("missing:")]
    assert line.startswith("missing: shard-000003.safetensors (shard 3): file not found; affects")
    assert all(request in line for request in built.holders[3])


def test_a_truncated_shard_is_corrupted(built: Built) -> None:
    path = built.shard(5)
    size = path.stat().st_size
    os.truncate(path, size - 10)
    (bad,) = verify_store(built.root).corrupted
    assert bad.id == 5
    assert bad.problems[0] == f"{size - 10} bytes on disk, the index says {size}"
    assert "past the end" in bad.problems[1]
    assert run_cli("verify", str(built.root)).returncode == 1


def test_a_flip_that_crosses_read_blocks_is_found(tmp_path: Path) -> None:
    """A shard larger than one 8 MiB read block; the damaged byte lies just past the first block."""
    hidden, rows = 2048, 500  # 3 float32 tensors of 4 MiB: one spans the block boundary
    rng = np.random.default_rng(3)
    values = torch.from_numpy(rng.uniform(0.5, 1.5, size=(3, rows, hidden)).astype(np.float32))
    writer = StoreWriter(tmp_path, shard_bytes=64 << 20, writer_threads=1)
    try:
        writer.begin_run(*make_layout(hidden=hidden))
        write_rows(writer, values, ["big"], [rows], np.arange(rows), np.arange(rows) + 1)
        writer.finish_request("big", Finish("finished", num_tokens=rows))
    finally:
        writer.close()
    path = tmp_path / "shard-000000.safetensors"
    assert path.stat().st_size > BLOCK_BYTES + (1 << 20)
    assert verify_store(tmp_path).ok

    base, header = header_of(path)
    offset = BLOCK_BYTES + 12345
    (tensor,) = [
        n
        for n, e in header.items()
        if n != "__metadata__" and base + e["data_offsets"][0] <= offset < base + e["data_offsets"][1]
    ]
    assert base + header[tensor]["data_offsets"][0] < BLOCK_BYTES, "the tensor starts in the first block"
    flip(path, offset, 0x80)
    report = verify_store(tmp_path, jobs=1)
    (bad,) = report.corrupted
    assert bad.tensors == [tensor] and bad.requests == ["big"] and report.affected_requests == ["big"]


# ------------------------------------------------------------------------------ not failures


def test_unlisted_shard_files_are_lost_index_lines_and_temp_files_are_ignored(built: Built) -> None:
    """A shard on disk that no line lists had its line lost (or its writer died before listing it): a
    failure, naming the requests its header holds; a temp file named like a shard is only noted."""
    shutil.copy(built.shard(0), built.root / "shard-000099.safetensors")
    (built.root / "shard-000006.safetensors.tmp").write_bytes(b"half a shard")
    report = verify_store(built.root)
    assert not report.ok and len(report.verified) == NUM_SHARDS
    assert report.ignored == ["shard-000006.safetensors.tmp"]
    (lost,) = report.lost
    assert (lost.id, lost.file, lost.status) == (99, "shard-000099.safetensors", "lost")
    assert sorted(lost.requests) == built.holders[0]

    result = run_cli("verify", str(built.root))
    assert result.returncode == 1, result.stdout
    assert "lost index line: shard-000099.safetensors (shard 99) is on disk but listed by no line" in result.stdout
    assert f"hscapture verify --repair {built.root} lists it" in result.stdout
    assert "ignored: shard-000006.safetensors.tmp is not a shard name" in result.stdout


def test_a_torn_index_tail_is_reported_not_an_error(built: Built) -> None:
    torn = b'{"type":"request","id":"r-half","spans":[[9'
    with (built.root / "index.jsonl").open("ab") as handle:
        handle.write(torn)
    report = verify_store(built.root)
    assert report.ok and report.torn_tail and report.torn_tail_bytes == len(torn)
    assert len(report.verified) == NUM_SHARDS and not report.unknown_shards

    result = run_cli("verify", str(built.root))
    assert result.returncode == 0
    assert f"torn tail: index.jsonl ends in a {len(torn)}-byte line without a newline" in result.stdout
    assert json.loads(run_cli("verify", str(built.root), "--json").stdout)["torn_tail"] is True


def test_shards_without_checksums_are_unverifiable(built: Built) -> None:
    """An index written before checksums: nothing to compare with, so not 'ok', yet not a failure."""
    index = built.root / "index.jsonl"
    records = [json.loads(line) for line in index.read_text().splitlines()]
    for record in records:
        record.pop("crc32", None)
        record.pop("tensor_crc32", None)
        record.pop("line_crc32", None)
    index.write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = json.loads((built.root / "meta.json").read_text())
    (built.root / "meta.json").write_text(json.dumps({**meta, "version": 1}))  # a store of version 1 then
    base, header = header_of(built.shard(1))
    flip(built.shard(1), base + header["last"]["data_offsets"][0])  # undetectable without checksums

    report = verify_store(built.root)
    assert report.ok and not report.verified
    assert [c.id for c in report.unverifiable] == list(range(NUM_SHARDS))
    assert all(c.status == "unverifiable" for c in report.unverifiable)
    result = run_cli("verify", str(built.root))
    assert result.returncode == 0
    assert "0 verified, 0 corrupted, 0 missing, 6 unverifiable" in result.stdout
    assert "unverifiable: shard-000001.safetensors (shard 1): no crc32" in result.stdout

    os.truncate(built.shard(2), 100)  # but a broken header or size is still caught
    (bad,) = verify_store(built.root).corrupted
    assert bad.id == 2 and sorted(bad.requests) == built.holders[2]


# ------------------------------------------------------------------------------ index faults


def test_a_request_naming_an_unlisted_shard_fails(built: Built) -> None:
    line = {**request_line("r-ghost", [[0, 0, 1], [42, 0, 3]])}
    with (built.root / "index.jsonl").open("ab") as handle:
        handle.write(encode_line(line))
    number = len((built.root / "index.jsonl").read_text().splitlines())
    report = verify_store(built.root)
    assert not report.ok and len(report.verified) == NUM_SHARDS
    (problem,) = report.unknown_shards
    assert (problem.line, problem.request, problem.shards) == (number, "r-ghost", [42])
    assert report.affected_requests == ["r-ghost"]
    result = run_cli("verify", str(built.root))
    assert result.returncode == 1
    assert f"unknown shard: index.jsonl line {number}: request r-ghost names shards [42]" in result.stdout


def test_a_corrupt_index_line_fails(built: Built) -> None:
    index = built.root / "index.jsonl"
    lines = index.read_text().splitlines(keepends=True)
    lines[2] = "{not json\n"
    index.write_text("".join(lines))
    report = verify_store(built.root)
    assert not report.ok
    assert [p.line for p in report.bad_index_lines] == [3]
    assert run_cli("verify", str(built.root)).returncode == 1


# ------------------------------------------------------------------------------ not a store


def test_not_a_store_exits_2_with_a_message(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "file.txt"
    a_file.write_text("hello")
    other = tmp_path / "other"
    other.mkdir()
    (other / "index.jsonl").write_text("")
    (other / "meta.json").write_text(json.dumps({"format": "something-else", "version": 1}))
    cases = {
        empty: "no index.jsonl; not an hscapture store",
        tmp_path / "absent": "not a directory, so not an hscapture store",
        a_file: "not a directory, so not an hscapture store",
        other: "format 'something-else', not 'hscapture-store'; not an hscapture store",
    }
    for path, message in cases.items():
        with pytest.raises(StoreError, match=re.escape(message)):
            verify_store(path)
        result = run_cli("verify", str(path))
        assert result.returncode == 2, (path, result.stdout, result.stderr)
        assert result.stdout == ""
        assert result.stderr.startswith(f"hscapture verify: {path}") and message in result.stderr


# ------------------------------------------------------------------------------ output


def test_the_summary_lists_ten_requests_and_a_count() -> None:
    ids = [f"req-{i:03d}" for i in range(25)]
    bad = ShardCheck(7, "shard-000007.safetensors", "corrupted", ["last"], ["tensor last: crc32 x"], ids)
    text = format_report(VerifyReport(root="/s", shards=9, requests=30, corrupted=[bad], affected_requests=ids))
    (line,) = [line for line in text.splitlines() if line.startswith("corrupted:")]
    assert line == (
        "corrupted: shard-000007.safetensors (shard 7): tensor last: crc32 x; affects 25 requests: "
        + ", ".join(ids[:10])
        + " and 15 more"
    )


def test_a_progress_bar_when_stdout_is_a_terminal(built: Built) -> None:
    leader, follower = pty.openpty()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "hscapture", "verify", str(built.root)],
            stdout=follower,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(follower)
    try:
        shown = os.read(leader, 1 << 16).decode()
    finally:
        os.close(leader)
    assert result.returncode == 0
    assert "OK: every listed shard" in shown
    assert re.search(rf"verify: .*{NUM_SHARDS}/{NUM_SHARDS}|verify: .*0/{NUM_SHARDS}", result.stderr), result.stderr
    assert "verify" not in run_cli("verify", str(built.root)).stderr, "no bar when stdout is not a terminal"
