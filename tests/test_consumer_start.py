"""The consumer's start-up: what it waits for before a producer can send rows, and what it imports.

The figures are the ``consumer-start`` benchmark's (``benchmarks/README.md``); these tests pin the causes: the
store's run begins without waiting for its shard buffers to be touched or its kernels to compile,
``hscapture consume`` imports no extraction, export or serving code, and a consumer keeping rows as captured
does not import torch (2-3 s of a 2-core host's ~2.5 s from launch to attach, and 3-4 s of the H200's 5.6 s,
before), from a host ring or a CUDA ring (``tests/test_gpu.py`` runs the latter on a GPU).
"""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import hscapture.cuda_runtime as cuda_runtime
import hscapture.ring.cuda as cuda_ring
import hscapture.store.writer as writer_module
from hscapture import open_store
from hscapture.consumer import consume_command
from hscapture.fp8 import dequantize_rows, quantize_rows
from hscapture.ring.base import RingReader
from hscapture.store.shards import ShardBuffer
from hscapture.store.writer import StoreWriter
from tests.storefeed import Feed, make_layout, make_request
from tests.workload import NUM_TENSORS, Workload, make_config, make_producer

ROOT = Path(__file__).resolve().parents[1]


class Touches:
    """When each shard buffer was touched; every touch after the first waits for :attr:`gate` (as first writes
    wait on a loaded host), so what ``begin_run`` waited for shows in how many were touched when it returned."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.gate = threading.Event()

    def touch(self, buffer: ShardBuffer) -> ShardBuffer:
        if self.times:
            self.gate.wait(30)
        self.times.append(time.monotonic())
        return buffer


@pytest.fixture
def touched(monkeypatch: pytest.MonkeyPatch) -> Iterator[Touches]:
    touches = Touches()
    monkeypatch.setattr(writer_module, "touch", touches.touch)
    yield touches
    touches.gate.set()  # a writer a failed test left open finishes touching


def test_a_run_begins_once_its_first_buffer_is_ready_not_all_of_them(tmp_path: Path, touched: Touches) -> None:
    """begin_run returns once the first buffer is touched (the producer may send rows from then on), the others
    are touched behind it, and every row lands where it belongs."""
    writer = StoreWriter(tmp_path / "store", shard_bytes=1 << 20, writer_threads=2, shard_buffers=4)
    try:
        writer.begin_run(*make_layout())
        assert len(touched.times) == 1, f"begin_run returned with {len(touched.times)} buffers touched, not 1"
        touched.gate.set()
        deadline = time.monotonic() + 30
        while len(touched.times) < 4 and time.monotonic() < deadline:  # the others, behind it
            time.sleep(0.05)
        assert len(touched.times) == 4, f"{len(touched.times)} of 4 buffers touched after 30 s"
        rng = np.random.default_rng(1)
        feed = Feed(writer, {"a": make_request(40, "float32", rng)})
        feed.chunk([("a", range(40))])
        feed.finish("a", num_tokens=40)
    finally:
        writer.close()
    assert torch.equal(open_store(tmp_path / "store").get("a")["layer_2"], feed.requests["a"].rows[0])


def test_a_run_for_a_drop_producer_begins_with_every_buffer_touched(tmp_path: Path, touched: Touches) -> None:
    """``ready`` (a drop producer's run): begin_run returns only once every buffer is touched, so the first rows
    meet no page fault and nothing of the store's start-up competes with them."""
    touched.gate.set()
    writer = StoreWriter(tmp_path / "store", shard_bytes=1 << 20, writer_threads=2, shard_buffers=4)
    try:
        writer.begin_run(*make_layout(), ready=True)
        assert len(touched.times) == 4
    finally:
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


def test_the_cuda_ring_module_imports_neither_torch_nor_cupy() -> None:
    """``hscapture consume`` and the CUDA ring's module load without torch, and without cupy until a ring or CUDA's
    start needs it (a host ring's consumer never does)."""
    probe = (
        "import sys\n"
        "import hscapture.cli, hscapture.consumer, hscapture.consumer.metrics, hscapture.ring.cuda\n"
        "print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout[-500:]


def names_reached(owner: type | types.ModuleType, *roots: str) -> set[str]:
    """Every name the code of ``owner``'s methods (or its module's functions; or a module's functions) ``roots``
    uses, following the methods and module functions it names, nested code included: a lazy ``import torch``
    anywhere on the way shows."""
    module = owner if isinstance(owner, types.ModuleType) else sys.modules[owner.__module__]
    todo = [getattr(owner, root, None) or getattr(module, root) for root in roots]
    seen: set[types.CodeType] = set()
    names: set[str] = set()
    while todo:
        codes = [inspect.unwrap(todo.pop()).__code__]
        while codes:
            code = codes.pop()
            if code in seen:
                continue
            seen.add(code)
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
            for name in code.co_names:
                names.add(name)
                target = inspect.unwrap(getattr(owner, name, None) or getattr(module, name, None) or len)
                if inspect.isfunction(target) and target.__module__ == module.__name__:
                    todo.append(target)
    return names


def test_a_cuda_ring_read_into_a_store_of_rows_as_captured_names_no_torch() -> None:
    """What the consumer calls on a CUDA ring for rows kept as captured (opening it, the RingReader interface) and
    CUDA's early start reach no torch; the GPU fp8 path's views do (the check sees a lazy import)."""
    interface = [name for name, value in vars(RingReader).items() if inspect.isfunction(value)]
    assert {"begin", "copy_into", "mark", "done", "allocate", "close"} <= set(interface)
    for bf16_path in (names_reached(cuda_ring.CudaRingReader, "__init__", *interface),
                      names_reached(cuda_ring.CudaRingReader, "device_uuid"),
                      names_reached(cuda_runtime, "start_cuda")):  # fmt: skip
        assert not {"torch", "_cupy"} & bf16_path  # cupy's runtime bindings only (~15 ms to import, cupy ~0.7 s)
    for fp8_view in ("device_bytes", "torch_stream", "copy_from_device"):
        assert "torch" in names_reached(cuda_ring.CudaRingReader, fp8_view), fp8_view
    assert "_cupy" in names_reached(cuda_ring.CudaRingReader, "launch")


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


#: ``hscapture consume ARGS`` in an interpreter where ``import torch`` fails.
WITHOUT_TORCH = "import sys\nsys.modules['torch'] = None\nfrom hscapture.cli import main\nsys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize("store_dtype", ["as-captured", "fp8"])
def test_a_consumer_of_a_host_ring_stores_every_row_without_importing_torch(
    tmp_path: Path, endpoint: str, store_dtype: str
) -> None:
    """torch is imported where a tensor is made: a CUDA ring, or fp8 rows quantized by torch (no numba). A host
    ring's rows reach a store, kept as captured or quantized to fp8 out of the ring, in a consumer that cannot
    import it, and read back as sent."""
    if store_dtype == "fp8" and importlib.util.find_spec("numba") is None:
        pytest.skip("fp8 out of a host ring without torch needs numba (pip install 'hscapture[host-fp8]')")
    out = tmp_path / "store"
    extra = ["--store-dtype", "fp8"] if store_dtype == "fp8" else []
    argv = consume_command(endpoint, out, "--quiet", "--exit-on-eos", *extra)[3:]  # after: python -m hscapture
    consumer = subprocess.Popen([sys.executable, "-c", WITHOUT_TORCH, *argv], stderr=subprocess.PIPE, text=True)
    try:
        producer = make_producer(make_config(endpoint))
        if not producer.wait_attached(120):
            consumer.kill()
            pytest.fail(f"no attach; the consumer said: {consumer.communicate()[1][-3000:]}")
        workload = Workload(seed=11)
        for _ in range(40):
            workload.step(producer)
        producer.close()
        _, stderr = consumer.communicate(timeout=120)
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    assert consumer.returncode == 0, stderr[-3000:]
    store = open_store(out)
    assert len(store.tensor_names) == NUM_TENSORS
    assert store.metadata().get("store_dtype") == ("float8_e4m3fn" if extra else None)
    assert sorted(store.keys(complete_only=True)) == sorted(workload.finished) and workload.finished
    for rid in workload.finished:
        expected, tokens = workload.reference(rid)
        got = store.get(rid)
        assert got["input_ids"].tolist() == tokens
        for t, name in enumerate(store.tensor_names):
            sent = expected[:, t]
            if extra:  # what the torch path stores, bit for bit
                sent = dequantize_rows(*quantize_rows(sent)[:2], sent.dtype)
            assert torch.equal(got[name], sent), (rid, name)
