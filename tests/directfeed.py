"""Stores whose shards are big enough for O_DIRECT writes, written from seeded rows (shared by
``tests/test_store_direct.py`` and the child process it runs on a filesystem that refuses O_DIRECT).

Run as ``python -m tests.directfeed CASE ROOT`` it writes case ``CASE`` to ``ROOT`` with O_DIRECT
asked for, logging at INFO to stderr, and prints the writer's :class:`~hscapture.store.shards.DirectIO`
byte counts as JSON.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hscapture.config import DTYPES, torch_dtype
from hscapture.store.records import Finish
from hscapture.store.writer import StoreWriter
from tests.storefeed import DESCRIPTIONS, NAMES, make_layout, write_rows

#: Rows per request, and per chunk handed to the writer (chunks cross shard ends).
REQUEST_ROWS = (233, 190, 278)
CHUNK = 64
#: Decoder layers of the model the rows stand for (what export is told: layer_2 and layer_5 are aux).
NUM_LAYERS = 8


@dataclass(frozen=True)
class Case:
    """A store shape: captured dtype, hidden size, fp8 or not, rows arriving quantized or not."""

    dtype: str
    hidden: int
    fp8: bool = False
    quantized: bool = False
    #: Rows per shard: 301 (odd) puts an fp8 shard's first plane 4 bytes short of a page.
    rows_per_shard: int = 301

    @property
    def shard_bytes(self) -> int:
        return self.rows_per_shard * len(NAMES) * self.hidden * DTYPES[self.dtype]


CASES = {
    # 4096-byte rows: every plane lies in the buffer where the file wants it in memory
    "bf16-aligned-rows": Case("bfloat16", 2048),
    # 4000-byte rows: planes after the first start mid-page, so through the aligned scratch
    "f32-unaligned-rows": Case("float32", 1000),
    # codes quantized before they reach the store (as the consumer hands them in)
    "fp8-quantized": Case("bfloat16", 4096, fp8=True, quantized=True),
    # codes quantized on the writer threads, written from their scratch
    "fp8-writer-quantized": Case("bfloat16", 4096, fp8=True),
}


def takes_direct(directory: Path) -> bool:
    """Whether the filesystem of ``directory`` lets a file be written with O_DIRECT (probed, not assumed)."""
    probe = directory / f".direct-probe-{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def request_rows(case: Case) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
    """Each request's ``[tensors, n, hidden]`` rows (never zero) and token ids, from a fixed seed."""
    rng = np.random.default_rng(11)
    requests = {}
    for i, n in enumerate(REQUEST_ROWS):
        values = rng.uniform(0.5, 1.5, size=(len(NAMES), n, case.hidden)) * rng.choice([-1.0, 1.0], (len(NAMES), n, 1))
        requests[f"req-{i}"] = (torch.from_numpy(values).to(torch_dtype(case.dtype)), rng.integers(1, 50_000, n))
    return requests


def write_store(case: Case, root: Path, direct_io: bool) -> StoreWriter:
    """Write every request of ``case`` into a store at ``root``, chunks of requests interleaved; the closed writer."""
    writer = StoreWriter(
        root, case.shard_bytes, writer_threads=2, store_dtype="fp8" if case.fp8 else None, direct_io=direct_io
    )
    run_id, geometry, meta = make_layout("run-direct", case.dtype, case.hidden, NAMES, DESCRIPTIONS)
    writer.begin_run(run_id, geometry, meta, quantized=case.quantized)
    requests = request_rows(case)
    sent = dict.fromkeys(requests, 0)
    while any(sent[key] < len(tokens) for key, (_, tokens) in requests.items()):
        for key, (rows, tokens) in requests.items():
            begin, end = sent[key], min(sent[key] + CHUNK, len(tokens))
            if begin < end:
                positions = np.arange(begin, end)
                write_rows(writer, rows[:, begin:end], [key], [end - begin], positions, tokens[begin:end])
                sent[key] = end
    for key, (_, tokens) in requests.items():
        writer.finish_request(key, Finish("finished", num_tokens=len(tokens), loss_mask=[[0, len(tokens)]]))
    writer.close("done")
    return writer


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    done = write_store(CASES[sys.argv[1]], Path(sys.argv[2]), direct_io=True)
    print(json.dumps({"direct_bytes": done.direct.direct_bytes, "cached_bytes": done.direct.cached_bytes}))
