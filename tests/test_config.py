"""Validation of CaptureConfig and ConsumerConfig: every bad value fails at start-up, saying why and how to fix it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from hscapture.config import (
    RING_SLOTS,
    SLOT_ALIGN,
    SLOT_ROWS,
    CaptureConfig,
    ConsumerConfig,
    MiB,
    default_ring_bytes,
    default_slot_bytes,
    ensure_writable_dir,
)
from hscapture.integrations.hf import EXTRACT_SLOT_ROWS

# A small valid geometry: 2 layers + last, hidden 64, float32 -> row of 3 * 64 * 4 = 768 bytes.
BASE: dict[str, Any] = {
    "layers": (1, 3),
    "hidden_size": 64,
    "num_layers": 4,
    "dtype": "float32",
    "slot_bytes": 256 * 12,  # 3072 bytes = 4 rows
    "ring_bytes": 256 * 12 * 4,  # 4 slots = 16 rows
    "max_step_rows": 16,
    "endpoint": "ipc:///tmp/hsc-test-config/ep",
}


def make(**overrides: Any) -> CaptureConfig:
    return CaptureConfig(**{**BASE, **overrides})


# --------------------------------------------------------------------------- a valid config


def test_base_config_is_valid_and_derived_properties() -> None:
    config = make()
    assert config.layers == (1, 3)
    assert config.tensor_names == ["layer_1", "layer_3", "last"]
    assert config.num_tensors == 3
    assert config.itemsize == 4
    assert config.row_bytes == 3 * 64 * 4 == 768
    assert config.rows_per_slot == 3072 // 768 == 4
    assert config.num_slots == 4
    assert config.to_dict()["layers"] == [1, 3]


def test_derived_properties_bfloat16_without_last() -> None:
    config = make(layers=[0, 2, 5], num_layers=6, dtype="bfloat16", capture_last=False, hidden_size=100)
    assert config.layers == (0, 2, 5)  # lists are normalised to tuples
    assert config.tensor_names == ["layer_0", "layer_2", "layer_5"]
    assert config.row_bytes == 3 * 100 * 2 == 600
    assert config.rows_per_slot == 3072 // 600 == 5
    assert config.num_slots == 4


def test_capture_last_only_is_enough() -> None:
    config = make(layers=())
    assert config.tensor_names == ["last"]
    assert config.row_bytes == 64 * 4


def test_layers_without_num_layers_are_not_range_checked() -> None:
    config = make(layers=(40,), num_layers=None)
    assert config.tensor_names == ["layer_40", "last"]


def test_default_endpoint_is_per_user_ipc() -> None:
    config = CaptureConfig(layers=(0,), hidden_size=16, max_step_rows=16)
    assert config.endpoint.startswith("ipc://")
    assert f"hscapture-{os.getuid()}" in config.endpoint


def test_tcp_endpoint_is_accepted() -> None:
    assert make(endpoint="tcp://127.0.0.1:5555").endpoint == "tcp://127.0.0.1:5555"


# --------------------------------------------------------------------------- layers


@pytest.mark.parametrize("bad", [5, 7, 100])
def test_layer_out_of_range_names_the_valid_range(bad: int) -> None:
    with pytest.raises(ValueError, match=r"^layers: ") as exc:
        make(layers=(0, bad), num_layers=4)
    message = str(exc.value)
    assert f"[{bad}] out of range" in message
    assert "0..4" in message
    assert "4 decoder layers" in message
    assert "capture_last" in message


def test_negative_layer_with_num_layers_is_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"layers: \[-1\] out of range.*0\.\.4"):
        make(layers=(-1, 2), num_layers=4)


def test_negative_layer_without_num_layers() -> None:
    with pytest.raises(ValueError, match=r"layers: ids must be >= 0, got \[2, -3\]"):
        make(layers=(2, -3), num_layers=None)


def test_duplicate_layers() -> None:
    with pytest.raises(ValueError, match=r"layers: duplicate ids in \[1, 2, 1\]; list each layer once"):
        make(layers=(1, 2, 1))


@pytest.mark.parametrize("bad", [1.0, "2", True, None])
def test_non_int_layer(bad: object) -> None:
    with pytest.raises(TypeError, match=r"layers: ids must be ints, got " + re.escape(repr(bad))):
        make(layers=(0, bad))


def test_nothing_to_capture() -> None:
    with pytest.raises(ValueError, match=r"layers: nothing to capture.*capture_last"):
        make(layers=(), capture_last=False)


@pytest.mark.parametrize("bad", [0, -1])
def test_num_layers_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"num_layers: {bad} is out of range; must be >= 1"):
        make(num_layers=bad)


# --------------------------------------------------------------------------- dtype, policy, width


def test_unknown_dtype_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"dtype: 'float64' is not supported") as exc:
        make(dtype="float64")
    for name in ("bfloat16", "float16", "float32"):
        assert name in str(exc.value)


def test_unknown_policy_names_block_and_drop() -> None:
    with pytest.raises(ValueError, match=r"policy: 'wait' is unknown") as exc:
        make(policy="wait")
    assert "'block'" in str(exc.value)
    assert "'drop'" in str(exc.value)


@pytest.mark.parametrize("policy", ["block", "drop"])
def test_known_policies(policy: str) -> None:
    assert make(policy=policy).policy == policy


@pytest.mark.parametrize("bad", [0, -64])
def test_hidden_size_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"hidden_size: {bad} is out of range; must be >= 1"):
        make(hidden_size=bad)


def test_hidden_size_must_be_int() -> None:
    with pytest.raises(TypeError, match=r"hidden_size: must be an int, got 64\.0"):
        make(hidden_size=64.0)


# --------------------------------------------------------------------------- slot and ring geometry


def test_slot_smaller_than_one_row_gives_the_row_bytes() -> None:
    # row = 3 tensors x 64 x 4 = 768 bytes; a 512-byte slot (aligned) cannot hold it.
    with pytest.raises(ValueError, match=r"^slot_bytes: 512 cannot hold one row of 768 bytes") as exc:
        make(slot_bytes=512, ring_bytes=512 * 4)
    message = str(exc.value)
    assert "3 tensors x hidden 64 x 4 bytes" in message
    assert "at least 768" in message


@pytest.mark.parametrize("bad", [3000, 3072 + 1, 300])
def test_slot_bytes_must_be_aligned(bad: int) -> None:
    # hidden 16 float32 x 3 tensors = 192-byte rows, so these sizes hold a row but are misaligned.
    fix = -(-bad // SLOT_ALIGN) * SLOT_ALIGN
    with pytest.raises(ValueError, match=rf"^slot_bytes: {bad} is not a multiple of {SLOT_ALIGN}; use {fix}$"):
        make(hidden_size=16, slot_bytes=bad, ring_bytes=bad * 4)
    # The suggested value is aligned and accepted.
    assert make(hidden_size=16, slot_bytes=fix, ring_bytes=fix * 4, max_step_rows=1).slot_bytes == fix


@pytest.mark.parametrize("bad", [0, -256])
def test_slot_bytes_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"slot_bytes: {bad} is out of range; must be >= 1"):
        make(slot_bytes=bad)


@pytest.mark.parametrize("slots", [0, 1])
def test_ring_smaller_than_two_slots(slots: int) -> None:
    with pytest.raises(ValueError, match=rf"^ring_bytes: {3072 * slots} is out of range; must be >= {2 * 3072}$"):
        make(ring_bytes=3072 * slots, max_step_rows=1)


def test_ring_not_a_whole_number_of_slots() -> None:
    with pytest.raises(
        ValueError, match=r"^ring_bytes: 10000 is not a whole number of slots of slot_bytes=3072"
    ) as exc:
        make(ring_bytes=10000, max_step_rows=1)
    assert f"use {3 * 3072} or {4 * 3072}" in str(exc.value)
    # Both suggestions are accepted.
    make(ring_bytes=3 * 3072, max_step_rows=1)
    make(ring_bytes=4 * 3072, max_step_rows=1)


@pytest.mark.parametrize(
    ("max_step_rows", "slot_bytes", "hidden_size", "dtype"),
    [
        (17, 3072, 64, "float32"),  # one row more than the ring holds
        (100, 3072, 64, "float32"),
        (8192, 4 * MiB, 4096, "bfloat16"),  # a realistic model: 3 x 4096 x 2 = 24 KiB rows
        (1000, 3328, 50, "float16"),  # rows_per_slot does not divide slot_bytes evenly
    ],
)
def test_ring_smaller_than_one_step_suggests_a_sufficient_ring(
    max_step_rows: int, slot_bytes: int, hidden_size: int, dtype: str
) -> None:
    geometry = {"slot_bytes": slot_bytes, "hidden_size": hidden_size, "dtype": dtype, "max_step_rows": max_step_rows}
    with pytest.raises(ValueError, match=r"^ring_bytes: the ring holds \d+ rows") as exc:
        make(ring_bytes=slot_bytes * 4, **geometry)
    message = str(exc.value)
    assert f"max_step_rows={max_step_rows}" in message
    found = re.search(r"raise ring_bytes to at least (\d+)", message)
    assert found, message
    suggested = int(found.group(1))
    config = make(ring_bytes=suggested, **geometry)
    assert config.num_slots * config.rows_per_slot >= max_step_rows
    # ...and it is the minimum: one slot less is rejected again.
    with pytest.raises(ValueError, match=r"ring_bytes: the ring holds"):
        make(ring_bytes=suggested - slot_bytes, **geometry)


def test_default_ring_is_sized_for_two_steps_of_a_realistic_model() -> None:
    config = CaptureConfig(layers=(2, 16), hidden_size=4096, num_layers=32)
    assert config.num_slots * config.rows_per_slot >= 2 * config.max_step_rows
    assert config.ring_bytes == config.num_slots * config.slot_bytes


def test_max_step_rows_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"max_step_rows: 0 is out of range; must be >= 1"):
        make(max_step_rows=0)


# --------------------------------------------------------------------------- endpoint, timeout


@pytest.mark.parametrize("bad", ["http://localhost:1", "/tmp/sock", "inproc://x", ""])
def test_bad_endpoint_scheme(bad: str) -> None:
    with pytest.raises(ValueError, match=rf"^endpoint: {re.escape(repr(bad))} must start with ipc:// or tcp://$"):
        make(endpoint=bad)


def test_negative_block_timeout() -> None:
    with pytest.raises(ValueError, match=r"^block_timeout_s: must be >= 0 \(0 waits forever\), got -0\.5$"):
        make(block_timeout_s=-0.5)


def test_zero_block_timeout_means_forever_and_is_valid() -> None:
    assert make(block_timeout_s=0).block_timeout_s == 0


# --------------------------------------------------------------------------- ConsumerConfig


def test_consumer_config_defaults(tmp_path: Path) -> None:
    config = ConsumerConfig(out_dir=str(tmp_path / "store"))
    assert isinstance(config.out_dir, Path)
    assert config.writer_threads is None  # sized for each run by how the store writes (StoreWriter)
    assert config.check_out_dir() == tmp_path / "store"
    assert (tmp_path / "store").is_dir()
    assert list((tmp_path / "store").iterdir()) == []  # the write probe is cleaned up


def test_unwritable_out_dir_under_a_file(tmp_path: Path) -> None:
    # A path whose parent is a regular file cannot be created, even by root.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    out = blocker / "store"
    config = ConsumerConfig(out_dir=out)
    with pytest.raises(ValueError, match=r"^out_dir: ") as exc:
        config.check_out_dir()
    message = str(exc.value)
    assert repr(str(out)) in message
    assert "not writable" in message
    assert "pick another" in message


def test_unwritable_out_dir_read_only_parent(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: a 0o500 directory stays writable")
        with pytest.raises(ValueError, match=r"out_dir: .*locked/store.* is not writable \(Permission denied\)"):
            ConsumerConfig(out_dir=locked / "store").check_out_dir()
    finally:
        locked.chmod(0o700)


def test_consumer_refuses_unwritable_out_dir_before_opening_sockets(tmp_path: Path) -> None:
    from hscapture.consumer import Consumer

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"out_dir: .*file/out.* is not writable"):
        Consumer(ConsumerConfig(out_dir=blocker / "out", endpoint="ipc:///tmp/hsc-test-config-none/ep"))


def test_ensure_writable_dir_names_the_field(tmp_path: Path) -> None:
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"^cache_dir: "):
        ensure_writable_dir(blocker, "cache_dir")  # exists but is a file


@pytest.mark.parametrize("bad", [0, -1, 65])
def test_bad_writer_threads(tmp_path: Path, bad: int) -> None:
    with pytest.raises(ValueError, match=rf"^writer_threads: {bad} is out of range; must be in 1\.\.64$"):
        ConsumerConfig(out_dir=tmp_path, writer_threads=bad)


def test_writer_threads_must_be_int(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"writer_threads: must be an int, got '2'"):
        ConsumerConfig(out_dir=tmp_path, writer_threads="2")


@pytest.mark.parametrize("bad", [0, -5, 60_001])
def test_bad_heartbeat(tmp_path: Path, bad: int) -> None:
    with pytest.raises(ValueError, match=rf"^heartbeat_ms: {bad} is out of range; must be in 1\.\.60000$"):
        ConsumerConfig(out_dir=tmp_path, heartbeat_ms=bad)


def test_heartbeat_must_be_int(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"heartbeat_ms: must be an int, got 0\.2"):
        ConsumerConfig(out_dir=tmp_path, heartbeat_ms=0.2)


def test_consumer_bad_endpoint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"endpoint: 'udp://x' must start with ipc:// or tcp://"):
        ConsumerConfig(out_dir=tmp_path, endpoint="udp://x")


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("shard_bytes", 0, r"shard_bytes: 0 is out of range; must be >= 1"),
        ("flush_s", 0, r"flush_s: must be > 0 seconds, got 0"),
        ("delay_ms", -1.0, r"delay_ms: must be >= 0, got -1\.0"),
    ],
)
def test_consumer_other_fields(tmp_path: Path, field: str, value: object, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        ConsumerConfig(out_dir=tmp_path, **{field: value})


def test_layer_specs_name_ids_ranges_or_all_and_refuse_the_rest_with_what_they_take() -> None:
    from hscapture.config import layer_spec, resolve_layers

    assert layer_spec("2,16,29,32") == (2, 16, 29, 32) and layer_spec("2 16") == (2, 16)
    assert layer_spec("0-32:8") == (0, 8, 16, 24, 32) and layer_spec("1-3,30-32") == (1, 2, 3, 30, 31, 32)
    assert layer_spec("ALL") == "all" and layer_spec("") == () and layer_spec([3, 1]) == (3, 1)
    assert resolve_layers("all", 32) == tuple(range(1, 33))  # every decoder layer's output; 0 only when named
    assert resolve_layers("all", 32, (0, 31)) == tuple(range(1, 32)) and resolve_layers("0-4:2", 8) == (0, 2, 4)
    refusals = {
        "2,x": "--layers: 'x' in '2,x' is not a layer id or range; give ids and ranges, e.g. 2,16,29 or 0-32",
        "9-3": "--layers: '9-3' is an empty range; give START-END[:STEP] with START <= END and STEP >= 1",
        "0-8:0": "--layers: '0-8:0' is an empty range",
        "1-4,4": "--layers: layer 4 named twice (1-4 and 4); name each layer once",
        "all,3": "--layers: 'all' in 'all,3' is not a layer id or range; all stands alone (it names every layer)",
        "-1": "--layers: '-1' in '-1' is not a layer id or range",
    }
    for spec, message in refusals.items():
        with pytest.raises(ValueError) as refused:
            layer_spec(spec)
        assert str(refused.value).startswith(message), refused.value
    with pytest.raises(ValueError, match=r"^--layers: \[33\] out of range; the model has 32 decoder layers, so ids"):
        resolve_layers("0-33:3", 32)
    with pytest.raises(ValueError, match=r"^--layers: SGLang's X captures layers 1\.\.31 of the model's 32, got \[0\]"):
        resolve_layers("0,2", 32, (1, 31), "SGLang's X")
    with pytest.raises(ValueError, match=r"--layers: layers \[2\] named twice in \[2, 5, 2\]"):
        layer_spec([2, 5, 2])


def test_default_slots_hold_rows_not_bytes() -> None:
    """Kimi-K2.5's EAGLE-3 set (3 aux layers + last, 7168 wide, bf16): 2048 rows a slot (8 decode steps at batch
    256), not the 73 of 4 MiB; every layer of an 8B model in extraction (33 tensors, 4096 wide): 512 rows, not
    the 15 of 4 MiB. The ring holds two of the engine's largest steps, and a few slots at least."""
    kimi, wide = 4 * 7168 * 2, 33 * 4096 * 2
    slot = default_slot_bytes(kimi)
    assert slot // kimi == SLOT_ROWS >= 8 * 256 and slot % SLOT_ALIGN == 0
    assert default_slot_bytes(wide, EXTRACT_SLOT_ROWS) // wide == EXTRACT_SLOT_ROWS >= 512
    assert default_slot_bytes(4 * 64 * 2) == 4 * MiB  # tiny rows: never below 4 MiB
    assert default_ring_bytes(slot, kimi, 16384) == 16 * slot  # two 16k-token prefills
    assert default_ring_bytes(slot, kimi, 256) == RING_SLOTS * slot
