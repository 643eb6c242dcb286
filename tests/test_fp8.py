"""fp8 storage: the quantizer's error bound and special rows, the files the writer leaves, verify, a real extraction.

Bounds come from the e4m3 format, not from hscapture: 3 mantissa bits, so rounding to nearest
moves a normal value (scaled magnitude >= 2**-6) by at most 2**-4 of itself; subnormal codes are
spaced 2**-9 apart, so they move by at most 2**-10 (times the row's scale). Dequantizing into
bf16 rounds once more (8 significant bits: at most 2**-8 of the value).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hscapture import CaptureConfig, Producer, open_store
from hscapture.config import DTYPES, ConsumerConfig, torch_dtype
from hscapture.errors import StoreError
from hscapture.fp8 import FP8, Quantizer, dequantize_rows, quantize_into, quantize_rows
from hscapture.fp8_kernel import E4M3_MAX, NAN_CODE, host_kernels
from hscapture.store.verify import verify_store
from hscapture.store.writer import StoreWriter
from tests.conftest import ConsumerFactory, run_cli, wait_attached
from tests.storefeed import (
    HIDDEN,
    NAMES,
    Feed,
    Request,
    flip,
    header_of,
    make_layout,
    shard_bytes,
    shard_files,
    special_rows,
    spread_rows,
)

E4M3_REL = 2**-4
SUBNORMAL_ABS = 2**-10
BF16_REL = 2**-8
NAN = float("nan")
INF = float("inf")


def element_errors(x: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(relative errors of the elements whose scaled value is a normal e4m3 number, the others' absolute
    errors divided by their row's scale), of ``rows`` reconstructing ``x``."""
    x, rows = x.float(), rows.float()
    normal = (x / scales[:, None]).abs() >= 2**-6
    error = (rows - x).abs()
    return (error / x.abs())[normal], (error / scales[:, None])[~normal]


# ------------------------------------------------------------------------------ the quantizer


def test_random_rows_meet_the_e4m3_bound() -> None:
    rng = np.random.default_rng(0)
    x = spread_rows(rng, 4096, 512)
    codes, scales, nonfinite = quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (4096,) and nonfinite == 0
    assert torch.equal(scales, x.abs().amax(dim=1) / E4M3_MAX)
    assert torch.equal(codes.float().abs().amax(dim=1), torch.full((4096,), E4M3_MAX)), "each row's amax maps to 448"
    relative, subnormal = element_errors(x, dequantize_rows(codes, scales, torch.float32), scales)
    assert relative.numel() > 0.9 * x.numel(), "most elements should be normal after scaling"
    assert float(relative.max()) <= E4M3_REL
    assert float(relative.max()) > E4M3_REL / 2, "the bound is tight: some element should come close to it"
    assert float(subnormal.max()) <= SUBNORMAL_ABS


def test_bf16_rows_round_trip_into_bf16_within_both_roundings() -> None:
    x = spread_rows(np.random.default_rng(1), 2048, 256).bfloat16()
    codes, scales, _ = quantize_rows(x)
    back = dequantize_rows(codes, scales, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    relative, subnormal = element_errors(x, back, scales)
    assert float(relative.max()) <= (1 + E4M3_REL) * (1 + BF16_REL) - 1
    assert float(subnormal.max()) <= SUBNORMAL_ABS * (1 + BF16_REL) + BF16_REL


def test_codes_written_out_by_hand() -> None:
    """Row [1, 2, 3, 4]: scale 4/448, so x*112 = 112, 224, 336, 448; 336 lies halfway between the e4m3
    values 320 and 352 and rounds to the even mantissa, 320. e4m3fn bits: sign, 4 exponent (bias 7), 3 mantissa."""
    rows = torch.tensor(
        [
            [1.0, 2.0, 3.0, 4.0],
            [0.0, 0.0, 0.0, 0.0],  # zero row: scale 1, codes 0
            [1.0, INF, -2.0, NAN],  # scale from the finite elements (2); inf and NaN stored as NaN
            [NAN, NAN, -INF, NAN],  # nothing finite: scale 1, all NaN
        ]
    ).bfloat16()
    codes, scales, nonfinite = quantize_rows(rows)
    assert codes.view(torch.uint8).tolist() == [
        [0x6E, 0x76, 0x7A, 0x7E],  # 1.75*2^6, 1.75*2^7, 1.25*2^8, 1.75*2^8
        [0x00, 0x00, 0x00, 0x00],
        [0x76, 0x7F, 0xFE, 0x7F],  # 224, NaN, -448, NaN
        [0x7F, 0x7F, 0x7F, 0x7F],
    ]
    assert scales.tolist() == [np.float32(4 / 448), 1.0, np.float32(2 / 448), 1.0]
    assert nonfinite == 6
    back = dequantize_rows(codes, scales, torch.float32)
    assert back[0].tolist() == pytest.approx([1.0, 2.0, 320 / 112, 4.0], rel=1e-6)
    assert back[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert back[2, 0] == pytest.approx(1.0) and back[2, 2] == pytest.approx(-2.0)
    assert torch.isnan(back[2, [1, 3]]).all() and torch.isnan(back[3]).all(), "non-finite never reads back finite"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_quantize_into_gives_the_quantizers_bits_without_a_host_read(dtype: torch.dtype) -> None:
    """The branch-free quantizer (the consumer runs it on the GPU) against the writer threads' one,
    on a strided ``[tensors, rows, hidden]`` view of a larger slot as the ring holds it."""
    x = special_rows(dtype)
    slot = torch.zeros(3, 48, 64, dtype=dtype)
    slot[:, :40] = x
    codes = torch.empty(3, 40, 64, dtype=torch.float8_e4m3fn)
    scales, nonfinite = torch.empty(3, 40), torch.empty(3, 40, dtype=torch.int32)
    quantize_into(slot[:, :40], codes, scales, nonfinite)
    for t in range(3):
        want_codes, want_scales, count = quantize_rows(x[t])
        assert torch.equal(codes[t].view(torch.uint8), want_codes.view(torch.uint8)), t
        assert torch.equal(scales[t], want_scales), t
        assert nonfinite[t].tolist() == (~torch.isfinite(x[t])).sum(dim=1).tolist() and int(nonfinite[t].sum()) == count
    assert [int(nonfinite[t, r]) for t, r in ((0, 2), (1, 3), (1, 4), (2, 5))] == [3, 1, 64, 1]


def test_the_fused_kernel_casts_every_float32_up_to_448_as_torch_does() -> None:
    """Every float32 of magnitude <= 448, both signs (2.3e9 values: each e4m3 value, every tie between
    two of them and every value next to one, the subnormal codes, zeros, float32 subnormals), in rows
    whose largest magnitude is 448, so the scale is 1 and the codes are the cast of the values."""
    kernels = host_kernels()
    if kernels is None:
        pytest.skip("no fused kernel: numba missing or disabled")
    kernel = kernels[4]
    rows, width = 4096, 4096
    bits = np.empty((rows, width), dtype=np.uint32)
    bits[:, 0] = np.float32(E4M3_MAX).view(np.uint32)
    codes, scales, counts = np.empty((rows, width), np.uint8), np.empty(rows, np.float32), np.empty(rows, np.int32)
    top = int(bits[0, 0])
    per = rows * (width - 1)
    checked = 0
    for sign in (0, 0x80000000):
        for start in range(0, top + 1, per):
            values = np.arange(start, min(start + per, top + 1), dtype=np.uint32) | np.uint32(sign)
            n = -(-len(values) // (width - 1))
            bits[:n, 1:] = np.concatenate([values, np.zeros(-len(values) % (width - 1), np.uint32)]).reshape(n, -1)
            assert kernel(bits[:n], codes[:n], scales[:n], counts[:n]) == 0 and (scales[:n] == 1.0).all()
            want = torch.from_numpy(bits[:n].view(np.float32)).to(FP8).view(torch.uint8).numpy()
            mismatch = np.flatnonzero(codes[:n] != want)
            assert not len(mismatch), f"{bits[:n].view(np.float32).reshape(-1)[mismatch[:5]]} cast differently"
            checked += len(values)
    assert checked == 2 * (top + 1)


def bf16_values_up_to(amax: float) -> torch.Tensor:
    """Every bfloat16 bit pattern of magnitude <= ``amax`` (NaN and inf excluded), in float32."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return every[torch.isfinite(every) & (every.abs() <= amax)]


def policy_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The module docstring's policy, computed the plain way: (codes as uint8, scales, non-finite count)."""
    x = x.float()
    bad = ~torch.isfinite(x)
    amax = x.abs().masked_fill(bad, 0.0).amax(dim=1)
    scales = amax / torch.tensor(E4M3_MAX)
    scales = torch.where(scales > 0, scales, 1.0)
    codes = (x / scales[:, None]).to(FP8).view(torch.uint8).masked_fill(bad, NAN_CODE)
    return codes, scales, int(bad.sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fused_and_torch_quantizers_agree_with_the_policy_bit_for_bit(dtype: torch.dtype) -> None:
    """The fused host kernel, the torch passes it replaces and the policy written out plainly: every
    bf16 value under row maxima from float32 subnormals to the dtype's largest, special rows (zero,
    NaN, inf, nothing finite, below 448 float32 steps), rows over 60 orders of magnitude, strided rows."""
    if host_kernels() is None:
        pytest.skip("no fused kernel: numba missing or disabled")
    width = 512
    blocks = []
    for amax in (448.0, 1.0, 3.140625, 2.0**-6, 2.0**-126, 2.0**-133, 1e-30, 1e30, 65504.0, 3.3895e38):
        values = bf16_values_up_to(amax)
        values = values[values.abs() <= torch.finfo(dtype).max]
        cells = len(values) + -len(values) % (width - 1)
        body = values[torch.arange(cells) % len(values)].reshape(-1, width - 1)  # the last row wraps around
        top = values.abs().max().item()
        blocks.append(torch.cat([torch.full((len(body), 1), top), body], dim=1))
    spread = spread_rows(np.random.default_rng(3), 256, width) * torch.logspace(-30, 30, 256)[:, None]
    blocks += [spread, special_rows(dtype, n=40, hidden=width).reshape(-1, width).float()]
    x = torch.cat(blocks).to(dtype)
    for rows in (x, x[:, ::2], x.t().contiguous().t()):  # contiguous, strided, column-major
        want_codes, want_scales, want_count = policy_reference(rows)
        for fused in (True, False):
            quantize = Quantizer(rows.shape[1], len(rows), fused=fused)
            scales = torch.empty(len(rows))
            codes, count = quantize(rows, scales)
            mismatch = (codes.view(torch.uint8) != want_codes).nonzero()
            assert not len(mismatch), (fused, rows.stride(), mismatch[:5].tolist())
            assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32)), fused
            assert count == want_count > 0, fused


def test_quantize_refuses_what_is_not_rows() -> None:
    with pytest.raises(ValueError, match=r"rows: expected a float \[n, hidden\]"):
        quantize_rows(torch.ones(4))
    with pytest.raises(ValueError, match="rows: expected a float"):
        quantize_rows(torch.ones(2, 4, dtype=torch.int64))


# ------------------------------------------------------------------------------ the store


def bf16_request(rng: np.random.Generator, n: int, special: bool = False) -> Request:
    rows = torch.stack([spread_rows(rng, n, HIDDEN) for _ in NAMES]).bfloat16()
    if special:
        rows[0, 1] = 0.0  # a zero row
        rows[1, 2, 5] = INF
        rows[2, 3, 0] = NAN
    return Request(rows=rows, token_ids=rng.integers(1, 50_000, size=n, dtype=np.int64))


def test_fp8_store_files_reader_and_verify(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    requests = {"a": bf16_request(rng, 12, special=True), "b": bf16_request(rng, 9), "c": bf16_request(rng, 20)}
    writer = StoreWriter(tmp_path, shard_bytes("bfloat16"), store_dtype="fp8")
    writer.begin_run(*make_layout(dtype="bfloat16"))
    feed = Feed(writer, requests, "bfloat16")
    feed.chunk([("a", range(6, 12)), ("b", range(0, 5))])  # a's tail first: read back in position order
    feed.chunk([("a", range(0, 6)), ("c", range(0, 11)), ("b", range(5, 9))])
    feed.chunk([("c", range(11, 20))])
    for key, request in requests.items():
        feed.finish(key, num_tokens=request.rows.shape[1])
    writer.close()

    meta = json.loads((tmp_path / "meta.json").read_text())
    assert (meta["dtype"], meta["store_dtype"]) == ("bfloat16", "float8_e4m3fn")
    files = shard_files(tmp_path)
    assert len(files) == 6  # 41 rows, 7 per shard: as many rows per shard as bf16 would hold
    _, header = header_of(files[0])
    for name in NAMES:
        assert (header[name]["dtype"], header[name]["shape"]) == ("F8_E4M3", [7, HIDDEN])
        assert (header[f"{name}.scale"]["dtype"], header[f"{name}.scale"]["shape"]) == ("F32", [7])
    lines = [json.loads(line) for line in (tmp_path / "index.jsonl").read_text().splitlines()]
    counted = {line["id"]: line["nonfinite"] for line in lines if line["type"] == "shard" and "nonfinite" in line}
    assert counted == {1: {"layer_5": 1}, 2: {"last": 1}}, "counted in the shards holding a2 and a3"

    store = open_store(tmp_path)
    assert store.quantized and store.store_dtype == "float8_e4m3fn" and store.dtype == torch.bfloat16
    for key, request in requests.items():
        sample, raw = store.get(key), store.get(key, dequantize=False)
        assert sample["positions"].tolist() == list(range(request.rows.shape[1]))
        assert sample["input_ids"].tolist() == request.token_ids.tolist()
        for t, name in enumerate(NAMES):
            codes, scales, _ = quantize_rows(request.rows[t])
            assert torch.equal(raw[name].view(torch.uint8), codes.view(torch.uint8)), (key, name)
            assert torch.equal(raw[f"{name}.scale"], scales), (key, name)
            want = dequantize_rows(codes, scales, torch.bfloat16)
            assert sample[name].dtype == torch.bfloat16
            assert torch.equal(sample[name].view(torch.int16), want.view(torch.int16)), (key, name)
    only_last = store.get("c", tensors=["last"], dequantize=False)
    assert sorted(only_last) == ["input_ids", "last", "last.scale", "loss_mask", "positions"]
    assert store.get("a")["layer_2"][1].abs().sum() == 0, "the zero row reads back as zeros"
    assert torch.isnan(store.get("a")["layer_5"][2, 5]) and torch.isnan(store.get("a")["last"][3, 0])

    assert verify_store(tmp_path).ok
    base, header = header_of(files[1])
    for tensor in ("layer_2.scale", "last"):
        begin, end = header[tensor]["data_offsets"]
        flip(files[1], base + (begin + end) // 2)
        report = verify_store(tmp_path)
        assert [(c.id, c.tensors) for c in report.corrupted] == [(1, [tensor])]
        flip(files[1], base + (begin + end) // 2)  # undo
    result = run_cli("verify", tmp_path)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


def test_rows_handed_in_quantized_make_the_same_files(tmp_path: Path) -> None:
    """A run whose rows arrive quantized (the consumer of a GPU ring) writes the very bytes and index
    lines of a run the writer threads quantize; a later run of captured rows reshapes the buffers."""
    rng = np.random.default_rng(11)
    requests = {"a": bf16_request(rng, 12, special=True), "b": bf16_request(rng, 9), "c": bf16_request(rng, 20)}
    stores = {"threads": tmp_path / "threads", "handed-in": tmp_path / "handed-in"}
    for name, root in stores.items():
        writer = StoreWriter(root, shard_bytes("bfloat16"), store_dtype="fp8")
        writer.begin_run(*make_layout(dtype="bfloat16"), quantized=name == "handed-in")
        feed = Feed(writer, requests, "bfloat16")
        feed.chunk([("a", range(6, 12)), ("b", range(0, 5))])
        feed.chunk([("a", range(0, 6)), ("c", range(0, 11)), ("b", range(5, 9))])
        feed.chunk([("c", range(11, 20))])
        for key, request in requests.items():
            feed.finish(key, num_tokens=request.rows.shape[1])
        assert feed.quantized == [name == "handed-in"] * 3
        writer.begin_run(*make_layout(run_id="run-b", dtype="bfloat16"))  # captured rows, in either store
        feed = Feed(writer, {"d": bf16_request(np.random.default_rng(12), 10)}, "bfloat16")
        feed.chunk([("d", range(10))])
        assert feed.quantized == [False]
        writer.close()
    threads, handed_in = (shard_files(root) for root in stores.values())
    assert len(threads) == 8 and [p.name for p in threads] == [p.name for p in handed_in]
    for mine, theirs in zip(threads, handed_in):
        assert mine.read_bytes() == theirs.read_bytes(), mine.name
    lines = [[json.loads(line) for line in (root / "index.jsonl").read_text().splitlines()] for root in stores.values()]
    by_id = [
        {(line["type"], line["id"]): line for line in index if line["type"] in ("shard", "request")} for index in lines
    ]
    assert by_id[0] == by_id[1] and len(by_id[1]) == 8 + 4  # the order of shard lines is the threads' race
    assert {line["id"]: line["nonfinite"] for line in lines[1] if "nonfinite" in line} == {
        1: {"layer_5": 1},
        2: {"last": 1},
    }
    assert verify_store(stores["handed-in"]).ok


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_fp8_store_from_a_host_ring_is_quantized_out_of_the_ring(
    tmp_path: Path,
    endpoint: str,
    start_consumer: ConsumerFactory,
    caplog: pytest.LogCaptureFixture,
    dtype: str,
    threads: int,
) -> None:
    """A real consumer of a host ring (on a thread: no process boundary is under test) quantizes each chunk where it
    lies (no copy of the slot), in pieces where a chunk spans shards, on its own thread or several at once, and
    stores the torch passes' bits; counts the non-finite values per shard; the store verifies."""
    if host_kernels() is None:
        pytest.skip("no fused kernel: numba missing or disabled")
    rows = special_rows(torch_dtype(dtype), tensors=4, n=60, hidden=HIDDEN)  # special rows in the first request
    config = CaptureConfig(layers=(1, 2, 3), hidden_size=HIDDEN, num_layers=4, dtype=dtype, device="cpu",
                           slot_bytes=1 << 16, max_step_rows=32, policy="block", endpoint=endpoint)  # fmt: skip
    row_bytes = 4 * HIDDEN * DTYPES[dtype]
    options = ("--exit-on-eos", "--store-dtype", "fp8", "--shard-bytes", str(7 * row_bytes),
               "--quantize-threads", str(threads))  # fmt: skip
    caplog.set_level(logging.INFO, logger="hscapture.consumer")
    consumer = start_consumer(tmp_path, endpoint, *options, in_process=True)
    steps = [(0, 20), (20, 45), (45, 60)]
    producer = Producer(config, tensor_descriptions=[f"tensor {i}" for i in range(4)], meta={"engine": "test"})
    wait_attached(producer)
    for step, (begin, end) in enumerate(steps):
        producer.capture_step([plane[begin:end] for plane in rows], [f"r{step}"], [end - begin],
                              np.arange(end - begin), np.arange(begin, end))  # fmt: skip
        producer.finish_request(f"r{step}", num_tokens=end - begin)
    producer.close()
    assert consumer.wait(120) == 0, caplog.text[-3000:]
    assert f"fp8 quantized out of the ring on {threads} threads" in caplog.text
    store = open_store(tmp_path)
    assert store.quantized and sorted(store.keys(complete_only=True)) == ["r0", "r1", "r2"]
    assert len(shard_files(tmp_path)) == 9, "7 rows a shard: chunks of 20 and 25 rows span shards"
    for step, (begin, end) in enumerate(steps):
        raw = store.get(f"r{step}", dequantize=False)
        for t, name in enumerate(store.tensor_names):
            scales = torch.empty(end - begin)
            codes, _ = Quantizer(HIDDEN, end - begin, fused=False)(rows[t, begin:end], scales)
            assert torch.equal(raw[name].view(torch.uint8), codes.view(torch.uint8)), (step, name)
            assert torch.equal(raw[f"{name}.scale"], scales), (step, name)
    lines = [json.loads(line) for line in (tmp_path / "index.jsonl").read_text().splitlines()]
    counted: dict[str, int] = {}
    for line in lines:
        for name, count in line.get("nonfinite", {}).items():
            counted[name] = counted.get(name, 0) + count
    want = {name: int((~torch.isfinite(rows[t])).sum()) for t, name in enumerate(store.tensor_names)}
    assert counted == {name: count for name, count in want.items() if count} and counted["layer_2"] >= 1 + HIDDEN
    assert verify_store(tmp_path).ok


def test_quantized_rows_are_refused_by_a_store_of_captured_rows(tmp_path: Path) -> None:
    writer = StoreWriter(tmp_path, shard_bytes("bfloat16"))
    with pytest.raises(ValueError, match=r"quantized: .* stores rows as captured, not as fp8; hand in the rows"):
        writer.begin_run(*make_layout(dtype="bfloat16"), quantized=True)
    writer.close()


def test_a_store_keeps_its_storage_dtype(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    plain, fp8 = tmp_path / "plain", tmp_path / "fp8"
    for root, store_dtype in ((plain, None), (fp8, "fp8")):
        writer = StoreWriter(root, shard_bytes("bfloat16"), store_dtype=store_dtype)
        writer.begin_run(*make_layout(dtype="bfloat16"))
        Feed(writer, {"x": bf16_request(rng, 3)}, "bfloat16").chunk([("x", range(3))])
        writer.close()
    with pytest.raises(StoreError, match=r"stores rows as bfloat16, not float8_e4m3fn; leave --store-dtype unset"):
        StoreWriter(plain, shard_bytes("bfloat16"), store_dtype="fp8", lock_timeout_s=0)
    # Unset follows the store: a second run into the fp8 store is stored as fp8 too (and the lock was freed).
    writer = StoreWriter(fp8, shard_bytes("bfloat16"), lock_timeout_s=0)
    writer.begin_run(*make_layout(run_id="run-b", dtype="bfloat16"))
    Feed(writer, {"y": bf16_request(rng, 2)}, "bfloat16").chunk([("y", range(2))])
    writer.close()
    assert [header_of(path)[1]["last"]["dtype"] for path in shard_files(fp8)] == ["F8_E4M3", "F8_E4M3"]
    StoreWriter(plain, shard_bytes("bfloat16"), lock_timeout_s=0).close()  # the refused writer released the lock


def test_a_reader_refuses_rows_stored_in_a_way_it_does_not_know(tmp_path: Path) -> None:
    writer = StoreWriter(tmp_path, shard_bytes("bfloat16"), store_dtype="fp8")
    writer.begin_run(*make_layout(dtype="bfloat16"))
    writer.close()
    meta = json.loads((tmp_path / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "store_dtype": "int4"}))
    with pytest.raises(StoreError, match=r"rows stored as 'int4'; this hscapture reads 'float8_e4m3fn'"):
        open_store(tmp_path)


def test_consumer_config_names_the_storage_dtype(tmp_path: Path) -> None:
    assert ConsumerConfig(out_dir=tmp_path, store_dtype="fp8").store_dtype == "float8_e4m3fn"
    assert ConsumerConfig(out_dir=tmp_path).store_dtype is None
    with pytest.raises(ValueError, match=r"store_dtype: 'int8' is not a storage dtype; use 'fp8'"):
        ConsumerConfig(out_dir=tmp_path, store_dtype="int8")


# ------------------------------------------------------------------------------ a real extraction


def test_real_hidden_states_in_fp8_within_the_bound_in_half_the_bytes(tiny_store: Path, tiny_store_fp8: Path) -> None:
    """The same demo conversations extracted from the tiny model twice (same batches, so the same rows)."""
    plain, fp8 = open_store(tiny_store), open_store(tiny_store_fp8)
    assert "store_dtype" not in plain.metadata() and fp8.metadata()["store_dtype"] == "float8_e4m3fn"
    assert fp8.keys(complete_only=True) == plain.keys(complete_only=True)
    worst = 0.0
    for key in plain:
        want, got, raw = plain.get(key), fp8.get(key), fp8.get(key, dequantize=False)
        for field in ("input_ids", "positions", "loss_mask"):
            assert torch.equal(got[field], want[field]), (key, field)
        for name in plain.tensor_names:
            codes, scales, nonfinite = quantize_rows(want[name])  # the writer quantized exactly the captured rows
            assert nonfinite == 0
            assert torch.equal(raw[name].view(torch.uint8), codes.view(torch.uint8)), (key, name)
            assert torch.equal(raw[f"{name}.scale"], scales), (key, name)
            assert got[name].dtype == torch.bfloat16
            relative, subnormal = element_errors(want[name], got[name], scales)
            assert float(relative.max()) <= (1 + E4M3_REL) * (1 + BF16_REL) - 1, (key, name)
            assert subnormal.numel() == 0 or float(subnormal.max()) <= SUBNORMAL_ABS * (1 + BF16_REL) + BF16_REL
            worst = max(worst, float(relative.max()))
    assert worst > E4M3_REL / 2
    ratio = fp8.summary()["bytes"] / plain.summary()["bytes"]
    assert 0.45 < ratio < 0.52, f"fp8 store is {ratio:.3f} of bf16 (hidden 256: codes + 4-byte scales + row ids)"
    assert verify_store(tiny_store_fp8).ok


def test_extract_refuses_another_storage_dtype_before_loading_the_model(tiny_store: Path, tiny_model: Path) -> None:
    index = (tiny_store / "index.jsonl").read_bytes()
    result = run_cli("extract", "--out", tiny_store, "--model", tiny_model, "--store-dtype", "fp8")
    assert result.returncode == 1
    assert "stores rows as bfloat16, not float8_e4m3fn" in result.stderr
    assert (tiny_store / "index.jsonl").read_bytes() == index


def test_format_md_fp8_reading_snippet_runs(tiny_store_fp8: Path) -> None:
    """FORMAT.md's fp8 reader, verbatim but for the directory and key: the same rows as Store.get."""
    text = (Path(__file__).resolve().parents[1] / "FORMAT.md").read_text()
    section = text[text.index("From an fp8 store") : text.index("With hscapture, `hscapture.open_store")]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    scope: dict = {}
    key = open_store(tiny_store_fp8).keys()[0]
    snippet = snippet.replace('"store/', f'"{tiny_store_fp8}/').replace('"sample-00000000"', repr(key))
    exec(compile(snippet, "FORMAT.md", "exec"), scope)
    got = torch.cat(scope["rows"])
    want = open_store(tiny_store_fp8).get(key, tensors=["layer_2"])["layer_2"]
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
