"""The consumer's start-up: what it waits for before a producer can send rows, and what it imports.

The figures are the ``consumer-start`` benchmark's (``benchmarks/README.md``); these tests pin the causes: the
store's run begins without waiting for its shard buffers to be touched or its kernels to compile, and
``hscapture consume`` imports no extraction, export or serving code.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hscapture.store.writer as writer_module
from hscapture import open_store
from hscapture.store.shards import ShardBuffer
from hscapture.store.writer import StoreWriter
from tests.storefeed import Feed, make_layout, make_request

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def touched(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When each shard buffer was touched, touching made slow (0.4 s, as first writes are on a loaded host)."""
    times: list[float] = []

    def slow_touch(buffer: ShardBuffer) -> ShardBuffer:
        time.sleep(0.4)
        times.append(time.monotonic())
        return buffer

    monkeypatch.setattr(writer_module, "touch", slow_touch)
    return times


def test_a_run_begins_once_its_first_buffer_is_ready_not_all_of_them(tmp_path: Path, touched: list[float]) -> None:
    """begin_run returns once the first buffer is touched (the producer may send rows from then on), the others
    are touched behind it, and every row lands where it belongs."""
    writer = StoreWriter(tmp_path / "store", shard_bytes=1 << 20, writer_threads=2, shard_buffers=4)
    started = time.monotonic()
    writer.begin_run(*make_layout())
    begun = time.monotonic() - started
    assert len(touched) == 1 and begun < 0.75, f"begin_run waited {begun:.2f} s, {len(touched)} buffers touched"
    deadline = time.monotonic() + 30
    while len(touched) < 4 and time.monotonic() < deadline:  # the others, behind it
        time.sleep(0.05)
    assert len(touched) == 4, f"{len(touched)} of 4 buffers touched after 30 s"
    rng = np.random.default_rng(1)
    feed = Feed(writer, {"a": make_request(40, "float32", rng)})
    feed.chunk([("a", range(40))])
    feed.finish("a", num_tokens=40)
    writer.close()
    assert torch.equal(open_store(tmp_path / "store").get("a")["layer_2"], feed.requests["a"].rows[0])


def test_a_run_for_a_drop_producer_begins_with_every_buffer_touched(tmp_path: Path, touched: list[float]) -> None:
    """``ready`` (a drop producer's run): begin_run returns only once every buffer is touched, so the first rows
    meet no page fault and nothing of the store's start-up competes with them."""
    writer = StoreWriter(tmp_path / "store", shard_bytes=1 << 20, writer_threads=2, shard_buffers=4)
    writer.begin_run(*make_layout(), ready=True)
    assert len(touched) == 4
    writer.close()


def test_consume_imports_no_extraction_export_or_serving() -> None:
    probe = (
        "import sys\n"
        "from hscapture.cli import main\n"
        "try:\n    main(['consume', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('hscapture.extract', 'hscapture.export', 'hscapture.serve') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--endpoint" in done.stdout and done.stdout.strip().endswith("[]"), done.stdout[-500:]


def test_a_shard_written_while_the_crc_kernel_compiles_is_checksummed_by_zlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes never wait for the compile (a consumer killed in its first seconds loses no more than --flush-s of
    rows): until the kernel is built, ``wait=False`` gives zlib's bits at once and starts no compile."""
    import zlib

    from hscapture import jit
    from hscapture.store.checksum import row_crcs

    monkeypatch.setattr(jit, "_built", {})
    rows = np.random.default_rng(2).integers(0, 256, (5, 4096), dtype=np.uint8)
    assert row_crcs(rows, compiled=True, wait=False).tolist() == [zlib.crc32(row.tobytes()) for row in rows]
    assert jit._built == {}
