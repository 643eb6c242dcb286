"""The CUDA ring: graph-replayed capture, start-up checks, leaks. GPU tests skip on a CPU host."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from hscapture import CaptureConfig, HSCaptureError, Producer, open_store
from hscapture.consumer.device_fp8 import RowCrcs
from hscapture.fp8 import quantize_into, quantize_rows
from hscapture.producer.row_kernel import GraphRows
from hscapture.ring.cuda import CudaRingReader
from hscapture.store.checksum import row_crcs
from hscapture.store.verify import verify_store
from tests.conftest import ConsumerFactory, LoggedConsumer, sync_debug, wait_attached
from tests.storefeed import special_rows

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
HIDDEN = 256
NAMES = ["layer_1", "layer_2", "layer_3", "last"]


def gpu_config(endpoint: str, **overrides: object) -> CaptureConfig:
    settings: dict = dict(
        layers=(1, 2, 3),
        hidden_size=HIDDEN,
        num_layers=4,
        dtype="bfloat16",
        device="cuda",
        slot_bytes=1 << 20,
        ring_bytes=4 << 20,
        max_step_rows=64,
        policy="block",
        endpoint=endpoint,
        block_timeout_s=60,
    )
    settings.update(overrides)
    return CaptureConfig(**settings)


def producer_for(config: CaptureConfig) -> Producer:
    return Producer(config, tensor_descriptions=[f"tensor {n}" for n in NAMES], meta={"engine": "test"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only host gives")
def test_cuda_ring_on_a_host_without_gpu_says_so(endpoint: str) -> None:
    with pytest.raises(HSCaptureError, match="no CUDA GPU is visible"):
        producer_for(gpu_config(endpoint))


def test_unknown_device_kind_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match="device: 'tpu' is not supported"):
        gpu_config(endpoint, device="tpu")


class Block(torch.nn.Module):
    """Three residual layers and a final norm: stand-ins for a decoder's captured states."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.norm = torch.nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        states = []
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
            states.append(x)
        states.append(self.norm(x))
        return states


def graphed_with_copy(
    model: torch.nn.Module, static_x: torch.Tensor, producer: Producer
) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], GraphRows]:
    """A decode graph of ``model`` on ``static_x`` holding the producer's ring copy of its outputs, as an engine
    captures one: its static outputs and the copy (each replay's rows go where ``capture_step`` plans them)."""
    copy = producer.graph_rows()
    assert copy is not None, "the graph copy's kernels did not compile"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch.cuda.graph requires
        model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_states = model(static_x)
        copy.capture(static_states)
    return graph, static_states, copy


@pytest.mark.parametrize("policy", ["block", "drop"])
@pytest.mark.gpu
@requires_gpu
def test_graph_replayed_capture_is_bitwise_and_never_announces_padding(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, policy: str
) -> None:
    """Any engine's decode graph holds the producer's ring copy (``Producer.graph_rows``); after each replay
    ``capture_step`` of the graph's outputs plans where its rows go, reading nothing on the device. Padding rows are
    never announced; steps of the same request tuples share a slot (a decode run) through the same copy."""
    pytest.importorskip("cupy")
    batch = 32
    torch.manual_seed(0)
    model = Block().cuda().bfloat16()
    static_x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos")
    producer = producer_for(gpu_config(endpoint, policy=policy, slot_bytes=256 << 10, ring_bytes=1 << 20))
    wait_attached(producer)
    graph, static_states, copy = graphed_with_copy(model, static_x, producer)
    references: dict[str, list[torch.Tensor]] = {}
    decoding = tuple(f"d{i}" for i in range(batch)), (1,) * batch
    rng = np.random.default_rng(0)
    for step in range(60):  # 4 slots: every slot is reused many times
        static_x.copy_(torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        copy.launched()
        with sync_debug("error"):  # the engine-facing calls never wait for the device
            if step < 30:  # one request per step, the rest of the graph batch padding
                rows = int(rng.integers(1, batch + 1))
                states = [state[:rows] for state in static_states]
                producer.capture_step(states, [f"s{step}"], [rows], np.arange(rows), np.arange(rows) + step)
                producer.finish_request(f"s{step}", num_tokens=rows)
            else:  # the same requests step after step: their rows share a slot
                position = np.full(batch, step - 30)
                producer.capture_step(static_states, *decoding, position, position + 7)
        rows = rows if step < 30 else batch
        kept = torch.stack([s[:rows] for s in static_states], dim=1).cpu()
        if step < 30:
            references[f"s{step}"] = [kept]
        else:
            for i in range(batch):
                references.setdefault(f"d{i}", []).append(kept[i : i + 1])
    assert not copy.failed
    for rid in decoding[0]:
        producer.finish_request(rid, num_tokens=30)
    counters = producer.close()
    assert consumer.wait(60) == 0
    store = open_store(tmp_path)
    stored = store.keys(complete_only=True)
    if policy == "block":
        assert len(stored) == 30 + batch and counters.rows_dropped == 0
    assert len(store.keys()) == 30 + batch
    for key in stored:
        sample = store.get(key)
        got = torch.stack([sample[n] for n in NAMES], dim=1)
        assert torch.equal(got, torch.cat(references[key])), key
        assert sample["positions"].tolist() == list(range(len(got)))
        offset = 7 if key.startswith("d") else int(key[1:])  # each request's token ids as the engine handed them
        assert sample["input_ids"].tolist() == [p + offset for p in range(len(got))]
    assert store.summary()["rows"] == counters.rows_captured, "padding rows were stored"


@pytest.mark.gpu
@requires_gpu
def test_a_run_is_announced_only_after_the_next_replays_rows_are_planned(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    """A decode run's slot event goes on the engine's stream when the run is announced. Announced while the replay
    just launched still waits for its plan, that event waits for the replay, the replay for the host, and a block
    producer waiting for credit or a send while the consumer waits for the event would never move again. Every run
    here ends on a replayed step: none may be marked before it is planned."""
    pytest.importorskip("cupy")
    batch = 8
    model = Block().cuda().bfloat16()
    static_x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos")
    producer = producer_for(gpu_config(endpoint, policy="block", slot_bytes=256 << 10, ring_bytes=512 << 10))
    wait_attached(producer)
    graph, static_states, copy = graphed_with_copy(model, static_x, producer)
    marked_while_pending: list[bool] = []
    mark_written = producer.ring.mark_written

    def watched(index: int, stream: int | None = None) -> None:
        marked_while_pending.append(copy.pending)
        mark_written(index, stream)

    producer.ring.mark_written = watched  # type: ignore[method-assign]
    owners = tuple(f"d{i}" for i in range(batch)), (1,) * batch
    for step in range(100):  # runs of RUN_STEPS steps, and slots that fill first: each ends on a new replay
        graph.replay()
        copy.launched()
        producer.capture_step(static_states, *owners, np.full(batch, step), np.full(batch, step))
    for rid in owners[0]:
        producer.finish_request(rid, num_tokens=100)
    counters = producer.close()
    assert consumer.wait(60) == 0 and not copy.failed
    assert counters.rows_captured == 100 * batch and counters.rows_dropped == 0
    assert len(marked_while_pending) > 5 and not any(marked_while_pending), marked_while_pending


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp8_on_the_gpu_gives_the_cpu_quantizers_bits(dtype: torch.dtype) -> None:
    """What the consumer of a CUDA ring stores equals what the writer threads store from a host ring:
    zero, NaN, inf and largest-value rows included, on a strided view as the ring holds rows."""
    rows = special_rows(dtype, tensors=4, n=200, hidden=HIDDEN)
    slot = torch.zeros(4, 256, HIDDEN, dtype=dtype, device="cuda")
    slot[:, :200] = rows.cuda()
    codes = torch.empty(4, 200, HIDDEN, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.empty(4, 200, device="cuda")
    nonfinite = torch.empty(4, 200, dtype=torch.int32, device="cuda")
    quantize_into(slot[:, :200], codes, scales, nonfinite)
    for t in range(4):
        want_codes, want_scales, count = quantize_rows(rows[t])
        assert torch.equal(codes[t].cpu().view(torch.uint8), want_codes.view(torch.uint8)), t
        assert torch.equal(scales[t].cpu(), want_scales), t
        assert int(nonfinite[t].sum()) == count, t


@pytest.mark.gpu
@requires_gpu
def test_the_fused_fp8_kernel_gives_the_cpu_quantizers_bits_for_every_bf16_value() -> None:
    """The consumer's one-launch quantization of bf16 rows (``hscapture/csrc/quantize_fp8.cu``): special rows, and
    every one of the 65,536 bf16 bit patterns (rows of mixed magnitudes, so each meets several scales)."""
    cupy = pytest.importorskip("cupy")
    from hscapture.consumer.device_fp8 import bf16_kernel

    kernel = bf16_kernel()
    assert kernel is not None, "the kernel did not compile (see the log)"
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, HIDDEN)
    shuffled = every.flatten()[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(3))]
    mixed = torch.cat([every, shuffled.reshape(every.shape)])
    rows = torch.cat([special_rows(torch.bfloat16, tensors=4, n=64, hidden=HIDDEN), mixed.reshape(4, -1, HIDDEN)], 1)
    tensors, n, _ = rows.shape
    slot = torch.zeros(tensors, n + 8, HIDDEN, dtype=torch.bfloat16, device="cuda")  # a strided view, as in a ring
    slot[:, :n] = rows.cuda()
    codes = torch.empty(tensors, n, HIDDEN, dtype=torch.uint8, device="cuda")
    scales = torch.empty(tensors, n, device="cuda")
    nonfinite = torch.empty(tensors, n, dtype=torch.int32, device="cuda")
    args = [np.uint64(slot.data_ptr()), np.int64((n + 8) * HIDDEN), np.int32(HIDDEN)]
    args += [np.uint64(codes.data_ptr()), np.uint64(scales.data_ptr()), np.uint64(nonfinite.data_ptr()), np.int32(n)]
    torch.cuda.synchronize()
    with cupy.cuda.Device(0):
        kernel((n, tensors), (256,), tuple(args))
    torch.cuda.synchronize()
    for t in range(tensors):
        want_codes, want_scales, _ = quantize_rows(rows[t])
        assert torch.equal(codes[t].cpu(), want_codes.view(torch.uint8)), t
        assert torch.equal(scales[t].cpu(), want_scales), t
        want_counts = (~torch.isfinite(rows[t].float())).sum(-1).to(torch.int32)
        assert torch.equal(nonfinite[t].cpu(), want_counts), t


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("width", [1, 256, 4096, 7168])
def test_row_crcs_on_the_gpu_equal_zlib_without_a_sync(width: int) -> None:
    """The CRCs of fp8 rows the consumer computes on the GPU next to them, by the kernel
    (``hscapture/csrc/crc32_rows.cu``) and by its torch fallback, are zlib's; neither reads the device on the host."""
    cupy = pytest.importorskip("cupy")
    from hscapture.consumer.device_fp8 import crc_kernel

    kernel = crc_kernel()
    assert kernel is not None, "the kernel did not compile (see the log)"
    rng = np.random.default_rng(width)
    rows = rng.integers(0, 256, (2, 300, width), dtype=np.uint8)  # [tensors, rows, width]
    rows[0, 0], rows[1, 1] = 0, 255
    want = np.stack([row_crcs(plane) for plane in rows])
    device_rows = torch.from_numpy(rows).cuda()
    by_kernel = torch.zeros(2, 300, dtype=torch.int32, device="cuda")
    by_torch = torch.zeros(2, 300, dtype=torch.int32, device="cuda")
    checksum = RowCrcs(width, 300, torch.device("cuda"))
    args = (np.uint64(device_rows.data_ptr()), np.int64(width), np.int64(300 * width), np.int32(width))
    args += (np.uint64(by_kernel.data_ptr()), np.int32(300), np.uint32(zlib.crc32(bytes(width))))
    torch.cuda.synchronize()
    with sync_debug("error"):
        with cupy.cuda.Device(0):
            kernel((297, 2), (256,), args)  # the last three rows of each tensor left out
        for t in range(2):
            checksum(device_rows[t], by_torch[t])
    torch.cuda.synchronize()
    got = by_kernel.cpu().numpy().view(np.uint32)
    assert np.array_equal(got[:, :297], want[:, :297]) and not got[:, 297:].any()
    assert np.array_equal(by_torch.cpu().numpy().view(np.uint32), want)


@pytest.mark.gpu
@requires_gpu
def test_fp8_store_from_a_cuda_ring_is_quantized_on_the_gpu(
    tmp_path: Path, endpoint: str, logged_consumer: Callable[..., LoggedConsumer]
) -> None:
    """A real consumer of a CUDA ring quantizes on the GPU and stores the CPU quantizer's bits, counts
    the non-finite values per shard, and the store verifies."""
    pytest.importorskip("cupy")
    rows = special_rows(torch.bfloat16, tensors=4, n=60, hidden=HIDDEN)  # special rows in the first request
    options = ("--exit-on-eos", "--store-dtype", "fp8", "--shard-bytes", "64K")
    store_dir = tmp_path / "store"
    consumer = logged_consumer(endpoint, *options, out=store_dir)
    producer = producer_for(gpu_config(endpoint))
    wait_attached(producer)
    states = [plane.cuda() for plane in rows]
    for step, (begin, end) in enumerate([(0, 20), (20, 45), (45, 60)]):
        request_id = f"r{step}"
        producer.capture_step([s[begin:end] for s in states], [request_id], [end - begin],
                              np.arange(end - begin), np.arange(begin, end))  # fmt: skip
        producer.finish_request(request_id, num_tokens=end - begin)
    producer.close()
    assert consumer.wait_exit(60) == 0, consumer.stderr()
    assert "fp8 quantized on the GPU" in consumer.stderr()
    store = open_store(store_dir)
    assert store.quantized and sorted(store.keys(complete_only=True)) == ["r0", "r1", "r2"]
    for step, (begin, end) in enumerate([(0, 20), (20, 45), (45, 60)]):
        raw = store.get(f"r{step}", dequantize=False)
        for t, name in enumerate(NAMES):
            codes, scales, _ = quantize_rows(rows[t, begin:end])
            assert torch.equal(raw[name].view(torch.uint8), codes.view(torch.uint8)), (step, name)
            assert torch.equal(raw[f"{name}.scale"], scales), (step, name)
    lines = [json.loads(line) for line in (store_dir / "index.jsonl").read_text().splitlines()]
    counted: dict[str, int] = {}
    for line in lines:
        for name, count in line.get("nonfinite", {}).items():
            counted[name] = counted.get(name, 0) + count
    assert counted == {"layer_1": 3, "layer_2": 1 + HIDDEN, "layer_3": 1}
    assert verify_store(store_dir).ok


@pytest.mark.gpu
@requires_gpu
def test_a_consumer_of_a_cuda_ring_stores_rows_bitwise_without_importing_torch(
    tmp_path: Path, endpoint: str, logged_consumer: Callable[..., LoggedConsumer]
) -> None:
    """A real ``hscapture consume`` keeping a CUDA ring's rows as captured stores them bit for bit (NaN payloads
    and all) and imports neither torch nor cupy proper: Python's own log of every import (``PYTHONPROFILEIMPORTTIME``)
    names cupy's runtime bindings, which it read the ring with, and no torch or ``cupy`` module."""
    pytest.importorskip("cupy")
    rows = special_rows(torch.bfloat16, tensors=4, n=60, hidden=HIDDEN)
    store_dir = tmp_path / "store"
    logging_imports = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    consumer = logged_consumer(endpoint, "--exit-on-eos", "--shard-bytes", "64K", out=store_dir, env=logging_imports)
    producer = producer_for(gpu_config(endpoint))
    wait_attached(producer)
    states = [plane.cuda() for plane in rows]
    spans = [(0, 20), (20, 45), (45, 60)]
    for step, (begin, end) in enumerate(spans):
        request_id = f"r{step}"
        producer.capture_step([s[begin:end] for s in states], [request_id], [end - begin],
                              np.arange(end - begin), np.arange(begin, end))  # fmt: skip
        producer.finish_request(request_id, num_tokens=end - begin)
    producer.close()
    assert consumer.wait_exit(60) == 0, consumer.stderr()[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in consumer.lines() if line.startswith("import time:")}
    assert "cupy_backends.cuda.api.runtime" in imported and "hscapture.ring.cuda" in imported, "no import log"
    assert not {m for m in imported if m.split(".")[0] in ("torch", "cupy")}, "the consumer imported torch or cupy"
    store = open_store(store_dir)
    assert not store.quantized and sorted(store.keys(complete_only=True)) == ["r0", "r1", "r2"]
    for step, (begin, end) in enumerate(spans):
        sample = store.get(f"r{step}")
        for t, name in enumerate(NAMES):
            assert torch.equal(sample[name].view(torch.int16), rows[t, begin:end].view(torch.int16)), (step, name)
    assert verify_store(store_dir).ok


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", ["other-device", "bad-handle"])
def test_consumer_side_errors_are_clear(case: str) -> None:
    pytest.importorskip("cupy")
    from hscapture.ring.cuda import device_uuid

    description = {"backend": "cuda", "handle": b"\0" * 64, "events": [], "nbytes": 1 << 21}
    if case == "other-device":
        with pytest.raises(HSCaptureError, match="is not visible to this consumer"):
            CudaRingReader({**description, "device_uuid": "GPU-not-here"})
    else:
        with pytest.raises(HSCaptureError, match="CUDA IPC: cannot open"):
            CudaRingReader({**description, "device_uuid": device_uuid(0)})


@pytest.mark.gpu
@requires_gpu
def test_ring_larger_than_free_memory_is_refused(endpoint: str) -> None:
    free, _ = torch.cuda.mem_get_info()
    slot = 64 << 20
    with pytest.raises(HSCaptureError, match="MiB free"):
        producer_for(gpu_config(endpoint, slot_bytes=slot, ring_bytes=(free // slot + 2) * slot))


@pytest.mark.gpu
@requires_gpu
def test_producer_close_frees_the_ring(endpoint: str) -> None:
    torch.cuda.synchronize()
    before, _ = torch.cuda.mem_get_info()
    for _ in range(3):
        producer = producer_for(gpu_config(endpoint, ring_bytes=256 << 20))
        producer.close()
        producer.close()
    torch.cuda.synchronize()
    after, _ = torch.cuda.mem_get_info()
    assert abs(before - after) < (8 << 20), f"{(before - after) >> 20} MiB not given back"


@pytest.mark.gpu
@requires_gpu
def test_offline_extraction_on_gpu_is_bitwise_hf(tiny_model: Path, tmp_path: Path) -> None:
    """`extract --device cuda` goes through the CUDA ring and stores HF's own hidden states of each padded batch,
    bit for bit (the causal forward extract runs: unmasked, each shape's attention kernel chosen alike), and the
    masked forward's up to the attention kernel's rounding (padding never reaches a real row)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hscapture.data import load_samples, pad_batch, padded_length, plan_batches
    from hscapture.extract import ExtractOptions, extract
    from hscapture.integrations.hf import AttentionKernels
    from hscapture.tiny import write_demo_jsonl

    data = write_demo_jsonl(tmp_path / "demo.jsonl", n=40)
    out = tmp_path / "store"
    summary = extract(ExtractOptions(out=out, model=tiny_model, data=data, device="cuda", progress=False))
    assert summary.store["complete"] == 40
    model = AutoModelForCausalLM.from_pretrained(tiny_model).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    store = open_store(out)
    pad_to = ExtractOptions.pad_to_multiple  # the store holds the rows of the batches extract ran
    kernels = AttentionKernels(model)
    for batch in plan_batches(list(load_samples(data, tokenizer)), 4096, 64, pad_to):
        ids, mask = pad_batch(batch, tokenizer.pad_token_id, padded_length(batch, pad_to, 4096))
        with torch.inference_mode(), kernels(*ids.shape):  # the attention kernel extract chose for this batch
            hidden = model(input_ids=ids.cuda(), output_hidden_states=True).hidden_states
        with torch.inference_mode():
            masked = model(input_ids=ids.cuda(), attention_mask=mask.cuda(), output_hidden_states=True).hidden_states
        for i, sample in enumerate(batch):
            n, got = len(sample.input_ids), store.get(sample.key)
            for k in (2, 4, 5):
                assert torch.equal(got[f"layer_{k}"], hidden[k][i, :n].cpu()), (sample.key, k)
                expected = masked[k][i, :n].float().cpu()
                assert (got[f"layer_{k}"].float() - expected).norm() <= 1e-2 * expected.norm(), (sample.key, k)
            assert torch.equal(got["last"], hidden[-1][i, :n].cpu())
            assert got["input_ids"].tolist() == sample.input_ids


@pytest.mark.gpu
@requires_gpu
def test_extraction_batches_never_wait_for_the_gpu_in_our_code(
    tiny_model: Path, tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    """``HFExtraction.run`` makes no synchronizing CUDA call of its own: the host can queue the next batch.

    Every batch runs under ``torch.cuda.set_sync_debug_mode("warn")``; each synchronizing call warns
    from the Python line that made it. None may come from hscapture; those of transformers' own
    forward (its mask code reads a device tensor) are printed, not asserted: they are not ours.
    """
    import warnings

    import hscapture
    from hscapture.data import load_samples, plan_batches
    from hscapture.integrations.hf import HFExtraction
    from hscapture.tiny import write_demo_jsonl

    engine = HFExtraction(tiny_model, None, True, None, "cuda", 1024, 64, 64)
    try:
        samples = list(load_samples(write_demo_jsonl(tmp_path / "demo.jsonl", n=40), engine.tokenizer))
        batches = plan_batches(samples, 1024, 64, 64)
        consumer = start_consumer(tmp_path / "store", endpoint, "--exit-on-eos")
        engine.start(endpoint, {}, lambda: None)
        with sync_debug("warn"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch in batches:
                engine.run(batch)
        engine.end()
        assert consumer.wait(60) == 0
    finally:
        engine.shutdown()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    ours = [f"{w.filename}:{w.lineno}" for w in syncs if w.filename.startswith(str(Path(hscapture.__file__).parent))]
    assert not ours, f"hscapture code synchronized with the GPU: {ours}"
    theirs = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
    print(f"{len(syncs)} synchronizing calls in {len(batches)} batches, none ours; from {theirs}")
    assert open_store(tmp_path / "store").summary()["complete"] == 40
