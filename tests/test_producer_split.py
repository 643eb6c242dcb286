"""Producer.write_step now, announce_step later: the contract an engine with late token ids relies on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hscapture import open_store
from tests.conftest import ConsumerFactory, wait_attached
from tests.workload import HIDDEN, NUM_TENSORS, make_config, make_producer


def rows(n: int, seed: int) -> list[torch.Tensor]:
    return list(torch.randn(NUM_TENSORS, n, HIDDEN, generator=torch.Generator().manual_seed(seed)))


def test_rows_written_early_are_stored_with_the_metadata_given_later(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", in_process=True)
    producer = make_producer(make_config(endpoint, policy="block", slots=4, rows_per_slot=8))
    wait_attached(producer)
    prefill, decode = rows(11, 0), rows(2, 1)  # 11 rows: two slots
    first = producer.write_step(prefill, ["a", "b"], [5, 6])
    second = producer.write_step(decode, ["a", "b"], [1, 1])
    for state in (*prefill, *decode):
        state.zero_()  # the engine overwrites its outputs: the ring already holds the rows
    assert producer.announce_step(first, [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5], list(range(100, 111))) == 11
    assert producer.announce_step(second, [5, 6], [200, 201]) == 2
    producer.finish_request("a", num_tokens=6)
    producer.finish_request("b", num_tokens=7)
    producer.close()
    assert consumer.wait(60) == 0
    store = open_store(tmp_path)
    names = store.tensor_names
    want = {"a": (rows(11, 0), slice(0, 5), 0, 100), "b": (rows(11, 0), slice(5, 11), 1, 105)}
    for rid, (states, span, tail, first_token) in want.items():
        got = store.get(rid)
        assert store.record(rid)["status"] == "complete"
        expected = [torch.cat([states[t][span], rows(2, 1)[t][tail : tail + 1]]) for t in range(NUM_TENSORS)]
        for t, name in enumerate(names):
            assert torch.equal(got[name], expected[t]), (rid, name)
        n = span.stop - span.start
        assert got["input_ids"].tolist() == [*range(first_token, first_token + n), 200 + tail]
        assert got["positions"].tolist() == list(range(n + 1))


def test_decode_steps_extend_one_slot_and_are_stored_as_if_written_one_by_one(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    """Steps of the same requests in one slot (a decode run): one chunk, every row where it belongs."""
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", in_process=True)
    producer = make_producer(make_config(endpoint, policy="block", slots=4, rows_per_slot=8))
    wait_attached(producer)
    owners = (("a", "b", "c"), (1, 1, 1))
    steps = [rows(3, 10 + s) for s in range(3)]  # requests a, b, c at position s
    run = producer.write_step(steps[0], *owners, extendable=True)
    assert producer.extend_step(run, steps[1], *owners)
    assert not producer.extend_step(run, steps[2], *owners)  # 9 rows do not fit 8
    alone = producer.write_step(steps[2], *owners)
    assert not producer.extend_step(alone, steps[2], *owners)  # not written extendable
    assert run.rows == run.written == 6 and list(run.owners()[0]) == ["a", "b", "c"] * 2
    for state in (*steps[0], *steps[1]):
        state.zero_()  # the engine overwrites its outputs: the ring holds the rows
    assert producer.announce_step(run, [0, 0, 0, 1, 1, 1], [40, 41, 42, 50, 51, 52]) == 6
    assert not producer.extend_step(run, steps[2], *owners)  # announced: closed
    assert producer.announce_step(alone, [2, 2, 2], [60, 61, 62]) == 3
    for rid in "abc":
        producer.finish_request(rid, num_tokens=3)
    producer.close()
    assert consumer.wait(60) == 0
    store = open_store(tmp_path)
    for i, rid in enumerate("abc"):
        assert store.record(rid)["status"] == "complete"
        got = store.get(rid)
        assert got["positions"].tolist() == [0, 1, 2]
        assert got["input_ids"].tolist() == [40 + i, 50 + i, 60 + i]
        for t, name in enumerate(store.tensor_names):
            want = torch.stack([rows(3, 10 + s)[t][i] for s in range(3)])
            assert torch.equal(got[name], want), (rid, name)


def test_written_slots_stay_the_producers_until_announced(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", in_process=True)
    producer = make_producer(make_config(endpoint, policy="drop", slots=2, rows_per_slot=16))
    wait_attached(producer)
    positions = list(range(16))
    held = [producer.write_step(rows(16, i), [f"r{i}"], [16]) for i in range(2)]
    assert [step.written for step in held] == [16, 16]
    dropped = producer.write_step(rows(16, 2), ["r2"], [16])  # no slot left: drop counts, never waits
    assert dropped.written == 0 and producer.counters.rows_dropped == 16
    assert producer.announce_step(dropped, positions, positions) == 0
    with pytest.raises(ValueError, match=r"positions: planned 16 values \(one per kept row\), got 3"):
        producer.announce_step(held[0], [0, 1, 2], positions)  # its slot is freed, its rows dropped
    assert producer.counters.rows_dropped == 32
    assert producer.announce_step(held[1], positions, positions) == 16
    with pytest.raises(ValueError, match="step 2 was announced already"):
        producer.announce_step(held[1], positions, positions)
    unannounced = producer.write_step(rows(16, 3), ["r3"], [16])  # never announced: dropped at close
    assert unannounced.written == 16
    counters = producer.close()
    assert counters.rows_dropped == 48 and counters.rows_captured == 16
    assert consumer.wait(60) == 0


def test_block_refuses_to_wait_for_slots_only_it_holds(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", in_process=True)
    producer = make_producer(make_config(endpoint, policy="block", slots=2, rows_per_slot=16))
    wait_attached(producer)
    for i in range(2):
        producer.write_step(rows(16, i), [f"r{i}"], [16])
    with pytest.raises(ValueError, match="all 2 slots hold rows written and not announced yet"):
        producer.write_step(rows(16, 2), ["r2"], [16])  # no release can come: waiting would never end
    producer.close()
    assert consumer.wait(60) == 0


def test_tensors_given_side_by_side_are_stored_as_given_one_by_one(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    """SGLang's aux layers come as one [N, layers * hidden] tensor: whole, split over slots, with
    kept rows, and a decode batch's same owner tuples step after step."""
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", in_process=True)
    producer = make_producer(make_config(endpoint, policy="block", slots=4, rows_per_slot=8))
    wait_attached(producer)

    def side_by_side(states: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat(states[:-1], dim=1), states[-1]]

    prefill = rows(12, 0)  # rows 0 and 7 are padding: 10 kept rows, two slots
    keep = torch.tensor([1, 2, 3, 4, 5, 6, 8, 9, 10, 11])
    assert (
        producer.capture_step(side_by_side(prefill), ["a", "b"], [4, 6], [0, 1, 2, 3, *range(6)], list(range(10)), keep)
        == 10
    )
    ids, ones = ("a", "b"), (1, 1)
    for i in range(3):  # the same tuples each step: checked and encoded once
        step = producer.write_step(side_by_side(rows(2, 1 + i)), ids, ones)
        assert producer.announce_step(step, [4 + i, 6 + i], [50 + i, 60 + i]) == 2
    with pytest.raises(ValueError, match=rf"states\[layer_.*\]: planned \[2, {HIDDEN}\], got \[2, {HIDDEN + 1}\]"):
        producer.write_step([torch.zeros(2, HIDDEN + 1), *rows(2, 0)[1:]], ids, ones)
    with pytest.raises(ValueError, match=f"states: planned {NUM_TENSORS} tensors"):
        producer.write_step([torch.cat(rows(2, 0), dim=1), rows(2, 0)[0]], ids, ones)
    producer.finish_request("a", num_tokens=7)
    producer.finish_request("b", num_tokens=9)
    producer.close()
    assert consumer.wait(60) == 0
    store = open_store(tmp_path)
    for rid, kept in {"a": keep[:4], "b": keep[4:]}.items():
        tail = 0 if rid == "a" else 1
        got = store.get(rid)
        for t, name in enumerate(store.tensor_names):
            decoded = [rows(2, 1 + i)[t][tail : tail + 1] for i in range(3)]
            assert torch.equal(got[name], torch.cat([prefill[t][kept], *decoded])), (rid, name)


def test_positions_and_token_ids_on_a_device_are_refused(endpoint: str) -> None:
    producer = make_producer(make_config(endpoint))
    try:
        on_device = torch.arange(3, device="meta")
        with pytest.raises(ValueError, match="token_ids: a tensor on meta; reading it here would make the host wait"):
            producer.capture_step(rows(3, 0), ["a"], [3], [0, 1, 2], on_device)
    finally:
        producer.close(timeout_s=0)
