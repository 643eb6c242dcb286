"""Stores written before the store became a package still read, verify, export and take new runs.

The fixtures under ``tests/fixtures/store-v1`` were written by the old code (commit 087f373, see
``tests/fixtures/make_store_v1.py``): a bf16 store in three shards and an fp8 store in two, each
four demo samples of the tiny Llama; ``expected.json`` holds the SHA-256 of every tensor the old
reader returned. Also here: the readers load neither the writer, the ring nor the wire.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hscapture.export import ExportOptions, export
from hscapture.store.reader import open_store
from hscapture.store.records import Finish
from hscapture.store.verify import verify_store
from hscapture.store.writer import RowGeometry, StoreWriter
from tests.storefeed import write_rows
from tests.trainer_readers import require, specforge_legacy_items

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "store-v1"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


def digests(sample: dict[str, torch.Tensor]) -> dict[str, str]:
    """``dtype shape sha256`` of each tensor's bytes, as the fixture script records them."""
    out = {}
    for name, t in sorted(sample.items()):
        digest = hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        out[name] = f"{t.dtype} {list(t.shape)} {digest}"
    return out


@pytest.fixture(params=["bf16", "fp8"])
def old_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    """A copy of a fixture store (the tests must not change the committed bytes)."""
    root = tmp_path / request.param
    shutil.copytree(FIXTURES / request.param, root)
    return request.param, root


def test_an_old_store_reads_bit_for_bit(old_store: tuple[str, Path]) -> None:
    name, root = old_store
    store = open_store(root)
    expected = EXPECTED[name]
    assert store.keys() == sorted(expected) and store.keys(complete_only=True) == store.keys()
    assert store.quantized == (name == "fp8")
    for key, want in expected.items():
        assert digests(store.get(key)) == want["get"], key
        assert digests(store.get(key, dequantize=False)) == want["raw"], key


def test_an_old_store_verifies_and_a_flipped_byte_is_found(old_store: tuple[str, Path]) -> None:
    _, root = old_store
    report = verify_store(root)
    assert report.ok and not report.unverifiable and len(report.verified) == report.shards >= 2
    shard = root / "shard-000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))
    report = verify_store(root)
    assert [check.id for check in report.corrupted] == [1] and report.corrupted[0].tensors


def test_an_old_store_exports_for_specforge(old_store: tuple[str, Path], tmp_path: Path) -> None:
    """Read back by SpecForge's own ``OfflineEagle3Dataset`` (the fixture has two aux layers: the override)."""
    require("specforge")
    _, root = old_store
    out = tmp_path / "specforge"
    options = ExportOptions(root, out, "specforge", progress=False, any_aux_count=True, keep_empty_loss_mask=True)
    summary = export(options)
    store = open_store(root)
    assert summary.written == len(store) == 4
    items = specforge_legacy_items(out, max_len=4096)
    assert len(items) == 4
    samples = [store.get(key) for key in store]
    for _, item in items:
        sample = next(s for s in samples if torch.equal(s["input_ids"], item["input_ids"][0]))
        assert torch.equal(item["hidden_state"][0], torch.cat([sample["layer_2"], sample["layer_4"]], dim=-1))
        assert torch.equal(item["target"][0], sample["last"])


def test_a_new_run_appends_to_an_old_store(old_store: tuple[str, Path]) -> None:
    name, root = old_store
    before = open_store(root)
    meta = before.metadata()
    geometry = RowGeometry(
        tuple(t["name"] for t in meta["tensors"]),
        tuple(t["description"] for t in meta["tensors"]),
        meta["dtype"],
        meta["hidden_size"],
    )
    rows = torch.from_numpy(np.random.default_rng(5).uniform(0.5, 1.5, size=(3, 10, meta["hidden_size"])))
    rows = rows.to(torch.bfloat16)
    writer = StoreWriter(root, 80 << 10)
    writer.begin_run("new-run", geometry, {"engine": "test"})
    write_rows(writer, rows, ["new-sample"], [10], np.arange(10), np.arange(10) + 7)
    writer.finish_request("new-sample", Finish("finished", num_tokens=10))
    writer.close()
    store = open_store(root)
    assert store.keys() == [*before.keys(), "new-sample"] and verify_store(root).ok
    for key, want in EXPECTED[name].items():
        assert digests(store.get(key)) == want["get"], key
    got = store.get("new-sample", dequantize=False)
    if name == "bf16":
        assert all(torch.equal(got[t], rows[i]) for i, t in enumerate(store.tensor_names))
    else:
        assert (got["layer_2"].float() * got["layer_2.scale"][:, None] - rows[0].float()).abs().max() < 0.1


def test_readers_load_neither_the_writer_nor_the_ring_nor_the_wire() -> None:
    script = (
        "import sys\n"
        "import hscapture.store.reader, hscapture.store.verify, hscapture.store.collection, hscapture.export\n"
        "import hscapture.dataset\n"
        "import hscapture.inspection, hscapture\n"
        "hscapture.open_store\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    loaded = set(
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    )
    forbidden = {"msgspec", "zmq", "hscapture.protocol", "hscapture.transport", "hscapture.store.writer"}
    forbidden |= {m for m in loaded if m.startswith(("hscapture.ring", "hscapture.producer", "hscapture.consumer"))}
    assert "hscapture.store.reader" in loaded and not forbidden & loaded, sorted(forbidden & loaded)
