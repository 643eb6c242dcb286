"""Shards whose row planes go to the disk with O_DIRECT, and the fallback where the filesystem refuses it.

Every case writes the same rows twice, with O_DIRECT and without, on a real filesystem: the files
must hold the same tensor bytes (the index lines' CRCs), read back bit for bit, verify, and export
the rows given. A filesystem without O_DIRECT (ramfs, mounted in a private mount namespace, which
needs root and ``unshare``) must get the same store through the page cache, said once in the log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from hscapture import CaptureConfig, Producer
from hscapture.export import MANIFEST, ExportOptions, export
from hscapture.fp8 import quantize_rows
from hscapture.store.format import read_index
from hscapture.store.reader import open_store
from hscapture.store.shardfile import ShardFile
from hscapture.store.shards import DIRECT_ALIGN, DIRECT_MIN_BYTES
from hscapture.store.verify import verify_store
from tests.conftest import ConsumerFactory, wait_attached
from tests.directfeed import CASES, NAMES, NUM_LAYERS, Case, request_rows, takes_direct, write_store


def shard_lines(root: Path) -> list[dict[str, Any]]:
    """The store's shard lines by shard id: two writer threads list shards in the order their writes end."""
    return sorted((r for r in read_index(root) if r["type"] == "shard"), key=lambda line: line["id"])


def assert_store_holds(root: Path, case: Case) -> None:
    """The store verifies, reads back the rows given bit for bit (fp8: their codes and scales), and
    exports them."""
    assert verify_store(root).ok
    store = open_store(root)
    requests = request_rows(case)
    assert sorted(store.keys()) == sorted(requests)
    for key, (rows, tokens) in requests.items():
        sample = store.get(key, dequantize=False)
        assert sample["input_ids"].tolist() == tokens.tolist()
        assert sample["positions"].tolist() == list(range(len(tokens)))
        for t, name in enumerate(NAMES):
            if case.fp8:
                codes, scales, _ = quantize_rows(rows[t])
                assert torch.equal(sample[name].view(torch.uint8), codes.view(torch.uint8)), (key, name)
                assert torch.equal(sample[f"{name}.scale"], scales), (key, name)
            else:
                assert torch.equal(sample[name].view(torch.uint8), rows[t].contiguous().view(torch.uint8)), (key, name)
    if case.fp8:
        return  # export dequantizes: its bits are the reader's, checked above
    out = root.parent / f"{root.name}-export"
    export(ExportOptions(root, out, "specforge", any_aux_count=True, num_layers=NUM_LAYERS, progress=False))
    ids = {line["index"]: line["id"] for line in map(json.loads, (out / MANIFEST).read_text().splitlines()[1:])}
    assert sorted(ids.values()) == sorted(requests)
    for index, key in ids.items():
        item = torch.load(out / "rows_0-2000" / f"data_{index}.ckpt", weights_only=True)
        rows = requests[key][0]  # layer_2, layer_5 (the aux layers), last
        assert torch.equal(item["hidden_state"][0].view(torch.uint8), rows[2].contiguous().view(torch.uint8)), key
        aux = torch.cat([rows[0], rows[1]], dim=-1)
        assert torch.equal(item["aux_hidden_state"][0].view(torch.uint8), aux.view(torch.uint8)), key


@pytest.mark.parametrize("name", sorted(CASES))
def test_direct_shards_hold_the_bytes_of_buffered_ones(tmp_path: Path, name: str) -> None:
    case = CASES[name]
    if not takes_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT; test_refused_direct_io_falls_back covers that")
    direct = write_store(case, tmp_path / "direct", direct_io=True)
    cached = write_store(case, tmp_path / "cached", direct_io=False)
    assert direct.direct.direct_bytes > 0 and direct.direct.enabled, "the planes went out with O_DIRECT"
    assert cached.direct.direct_bytes == 0
    lines, plain = shard_lines(tmp_path / "direct"), shard_lines(tmp_path / "cached")
    assert [line["rows"] for line in lines] == [line["rows"] for line in plain] == [301, 301, 99]
    for line, other in zip(lines, plain):  # the same bytes in every tensor; headers padded or not
        assert line["tensor_crc32"] == other["tensor_crc32"], line["file"]
    meta = json.loads((tmp_path / "direct" / "meta.json").read_text())
    for line, other in zip(lines, plain):
        shard = ShardFile(tmp_path / "direct" / line["file"], meta, line["bytes"], line["id"])
        first = shard.header.tensors[min(NAMES)]
        assert shard.header.base % 8 == 0
        if first.end - first.begin < DIRECT_MIN_BYTES:
            assert line["bytes"] == other["bytes"], "a small shard's header is not padded"
        else:  # its first plane starts a page, or 4 bytes short of one (8-byte alignment of the data)
            assert first.begin % DIRECT_ALIGN in (0, DIRECT_ALIGN - 4), (line["file"], first.begin)
        padded, plain_file = load_file(shard.path), load_file(tmp_path / "cached" / other["file"])
        assert padded.keys() == plain_file.keys()  # safetensors itself reads the padded header
        assert all(torch.equal(padded[k].view(torch.uint8), plain_file[k].view(torch.uint8)) for k in padded)
    assert direct.direct.cached_bytes + direct.direct.direct_bytes == sum(
        line["bytes"] for line in lines if line["rows"] == 301
    )
    for root in (tmp_path / "direct", tmp_path / "cached"):
        assert_store_holds(root, case)


def test_refused_direct_io_falls_back(tmp_path: Path) -> None:
    """On ramfs (no O_DIRECT) the writer asks, is refused, says so once and writes through the page cache."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare(1) to mount a ramfs in a private mount namespace")
    mount = tmp_path / "ramfs"
    mount.mkdir()
    case = "bf16-aligned-rows"
    script = 'mount -t ramfs ramfs "$0" && "$1" -m tests.directfeed "$2" "$0/store" && cp -a "$0/store" "$3/store"'
    result = subprocess.run(
        [unshare, "-m", "sh", "-c", script, mount, sys.executable, case, tmp_path],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    if (
        result.returncode != 0
        and "tests.directfeed" not in result.stderr
        and ("mount" in result.stderr or "unshare" in result.stderr)
    ):  # a container without the right to make a mount namespace or mount
        pytest.skip(f"cannot mount a ramfs here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts["direct_bytes"] == 0, "nothing went out with O_DIRECT"
    refused = [line for line in result.stderr.splitlines() if "O_DIRECT refused" in line]
    assert len(refused) == 1 and "shards are written through the page cache" in refused[0], result.stderr
    assert not list(mount.iterdir()), "the ramfs lived in the child's mount namespace only"
    assert [line["rows"] for line in shard_lines(tmp_path / "store")] == [301, 301, 99]
    assert_store_holds(tmp_path / "store", CASES[case])


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_a_host_rings_consumer_writes_row_planes_with_o_direct_unless_told_not_to(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, mode: str
) -> None:
    """``--direct-io auto`` (the default) takes O_DIRECT for a host ring (a CPU engine's cores are the limit):
    the first row plane of a big shard starts a page; ``off`` leaves the header unpadded."""
    if not takes_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    hidden, rows, steps = 1024, 128, 3  # float32: 4 KiB a row of a tensor; 256 rows (1 MiB a plane) a shard
    out = tmp_path / "store"
    consumer = start_consumer(out, endpoint, "--exit-on-eos", "--shard-bytes", str(4 << 20), "--direct-io", mode)
    slot_bytes = 4 * rows * hidden * 4
    config = CaptureConfig(
        layers=(1, 2, 3), hidden_size=hidden, num_layers=4, dtype="float32", device="cpu", policy="block",
        endpoint=endpoint, slot_bytes=slot_bytes, ring_bytes=4 * slot_bytes, max_step_rows=rows, block_timeout_s=60,
    )  # fmt: skip
    producer = Producer(config, tensor_descriptions=[f"tensor {i}" for i in range(4)], meta={"engine": "test"})
    wait_attached(producer)
    states = [torch.randn(rows, hidden) for _ in range(4)]
    for step in range(steps):
        positions = torch.arange(step * rows, (step + 1) * rows)
        producer.capture_step(states, ["r"], [rows], positions, positions + 7)
    producer.finish_request("r", num_tokens=steps * rows)
    producer.close()
    assert consumer.wait(60) == 0
    assert verify_store(out).ok
    line = shard_lines(out)[0]
    assert line["rows"] == 256
    shard = ShardFile(out / line["file"], json.loads((out / "meta.json").read_text()), line["bytes"], line["id"])
    first = shard.header.tensors[min(shard.header.tensors)]
    aligned = first.begin % DIRECT_ALIGN in (0, DIRECT_ALIGN - 4)
    assert aligned == (mode == "auto"), (mode, first.begin)
    got = open_store(out).get("r")
    assert all(torch.equal(got[name][:rows], states[t]) for t, name in enumerate(open_store(out).tensor_names))
