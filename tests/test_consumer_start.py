"""The consumer's start-up: what it waits for before a producer can send rows, and what it imports.

The figures are the ``consumer-start`` benchmark's (``benchmarks/README.md``); these tests pin the causes: the
store's run begins without waiting for its shard buffers to be touched or its kernels to compile, and
``hscapture consume`` imports no extraction, export or serving code.
"""

from __future__ import annotations

import subprocess
import sys
import threading
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


def test_a_run_begins_without_waiting_for_its_buffers_or_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Touching a buffer made slow (as first writes are on a loaded host): begin_run returns at once; the first
    rows wait for the first buffer only, and every row lands where it belongs."""
    touched: list[float] = []
    slow = threading.Event()

    def slow_touch(buffer: ShardBuffer) -> ShardBuffer:
        slow.wait(0.5)
        touched.append(time.monotonic())
        return buffer

    monkeypatch.setattr(writer_module, "touch", slow_touch)
    writer = StoreWriter(tmp_path / "store", shard_bytes=1 << 20, writer_threads=2, shard_buffers=4)
    started = time.monotonic()
    writer.begin_run(*make_layout())
    begun = time.monotonic() - started
    assert begun < 0.4, f"begin_run waited {begun:.2f} s for its buffers"
    rng = np.random.default_rng(1)
    feed = Feed(writer, {"a": make_request(40, "float32", rng)})
    feed.chunk([("a", range(40))])
    assert touched and touched[0] - started < 0.9, "the first rows waited for more than the first buffer"
    feed.finish("a", num_tokens=40)
    writer.close()
    assert torch.equal(open_store(tmp_path / "store").get("a")["layer_2"], feed.requests["a"].rows[0])


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
