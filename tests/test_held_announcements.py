"""Announcements held back and sent together (see ``hscapture.producer.announcer``): the consumer gets every chunk, in
seq order, before the end of a request that owns rows in them, at close, when the engine polls, and from the
producer's service thread while the engine does nothing. A real consumer (on a thread: no process boundary is
under test) writes the store."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hscapture import Producer, open_store
from hscapture.producer import announcer as announcer_module
from tests.conftest import ConsumerFactory, wait_attached
from tests.workload import HIDDEN, NUM_TENSORS, make_config, make_producer


class Decode:
    """One-row decode steps of a few requests; remembers what each request was sent."""

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.seed = 0

    def states(self, rids: list[str]) -> list[torch.Tensor]:
        self.seed += 1
        planes = torch.randn(NUM_TENSORS, len(rids), HIDDEN, generator=torch.Generator().manual_seed(self.seed))
        for i, rid in enumerate(rids):
            self.rows.setdefault(rid, []).append(planes[:, i])
        return list(planes)

    def meta(self, rids: list[str]) -> tuple[list[int], list[int]]:
        positions = [len(self.tokens.setdefault(rid, [])) for rid in rids]
        tokens = [100 * (ord(rid) - ord("a") + 1) + p for rid, p in zip(rids, positions)]
        for rid, token in zip(rids, tokens):
            self.tokens[rid].append(token)
        return positions, tokens

    def step(self, producer: Producer, rids: list[str]) -> int:
        return producer.capture_step(self.states(rids), rids, [1] * len(rids), *self.meta(rids))

    def check(self, out: Path, unfinished: str = "") -> None:
        """Every row stored once, in order, bitwise as sent."""
        store = open_store(out)
        for rid, rows in self.rows.items():
            assert store.record(rid)["status"] == ("incomplete" if rid in unfinished else "complete"), rid
            sample = store.get(rid)
            assert sample["positions"].tolist() == list(range(len(rows))), rid
            assert sample["input_ids"].tolist() == self.tokens[rid], rid
            for t, name in enumerate(store.tensor_names):
                assert torch.equal(sample[name], torch.stack([row[t] for row in rows])), (rid, name)


def test_held_chunks_reach_the_consumer_in_order_before_a_request_end_and_at_close(
    tmp_path: Path,
    endpoint: str,
    start_consumer: ConsumerFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(announcer_module, "SERVICE_S", 3600.0)  # no time limit: only the events under test send
    caplog.set_level(logging.WARNING, logger="hscapture.consumer")
    consumer = start_consumer(tmp_path / "store", endpoint, "--exit-on-eos", in_process=True)
    producer = make_producer(make_config(endpoint, policy="drop", slots=16))
    wait_attached(producer)
    decode = Decode()
    for _ in range(3):
        assert decode.step(producer, ["a", "b"]) == 2
    assert producer.counters.chunks_announced == 0, "sent at once, not held"
    producer.finish_request("a", num_tokens=3)
    assert producer.counters.chunks_announced == 3, "the end of a request went out before its rows"
    for _ in range(2):
        decode.step(producer, ["b"])
    assert producer.counters.chunks_announced == 3
    counters = producer.close()
    assert counters.chunks_announced == 5 and counters.rows_captured == 8
    assert counters.rows_dropped == counters.chunks_dropped == counters.events_dropped == 0
    assert consumer.wait(30) == 0
    assert "rejected" not in caplog.text, caplog.text[-3000:]
    decode.check(tmp_path / "store", unfinished="b")


def test_a_chunk_held_goes_out_from_the_service_thread_while_the_engine_is_idle(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    """No call of the engine sends it: the producer's own thread does, within its service time."""
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", in_process=True)
    producer = make_producer(make_config(endpoint, policy="block", slots=16))
    wait_attached(producer)
    decode = Decode()
    decode.step(producer, ["a"])
    deadline = time.monotonic() + 30
    while producer.counters.chunks_announced == 0:
        assert time.monotonic() < deadline, "a chunk held on an idle engine was never sent"
        time.sleep(0.005)
    producer.finish_request("a", num_tokens=1)
    assert producer.close().rows_captured == 1
    assert consumer.wait(30) == 0
    decode.check(tmp_path)


def test_a_chunk_held_goes_out_when_the_engine_polls_and_never_from_a_step_of_the_engine(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(announcer_module, "SERVICE_S", 3600.0)  # the service thread waits until woken
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", in_process=True)
    producer = make_producer(make_config(endpoint, policy="block", slots=16))
    wait_attached(producer)
    decode = Decode()
    decode.step(producer, ["a"])
    written = producer.write_step(decode.states(["a"]), ["a"], [1])  # the engine's next forward
    producer.announce_step(written, *decode.meta(["a"]))
    assert producer.counters.chunks_announced == 0, "a step of the engine sent what it could leave to the thread"
    producer.poll()  # what an idle engine calls
    assert producer.counters.chunks_announced == 2, "a chunk held on an engine that polls was not sent"
    producer.finish_request("a", num_tokens=2)
    counters = producer.close()
    assert counters.rows_captured == 2 and counters.rows_dropped == 0
    assert consumer.wait(30) == 0
    decode.check(tmp_path)


def test_the_service_thread_ends_with_the_producer(endpoint: str) -> None:
    """One thread per producer while it is open, none left once it is closed (with no consumer ever attached too)."""

    def threads() -> int:
        return sum(t.name == "hscapture-producer" for t in threading.enumerate())

    before = threads()
    producer = make_producer(make_config(endpoint, policy="drop", slots=4))
    assert threads() == before + 1
    Decode().step(producer, ["a"])  # dropped: nobody attached
    counters = producer.close(timeout_s=1)
    assert threads() == before and counters.rows_dropped == 1


def test_an_engine_may_reuse_its_position_and_token_arrays_after_every_call(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks are encoded later, on the service thread; what they send is what the engine handed over during each
    call, though it overwrites the same int64 arrays in place before the next (a decode run of the same tuples, a
    step of its own, and ``write_step`` / ``announce_step``)."""
    monkeypatch.setattr(announcer_module, "SERVICE_S", 3600.0)  # nothing goes out before every array was reused
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", in_process=True)
    producer = make_producer(make_config(endpoint, policy="block", slots=16))
    wait_attached(producer)
    decode = Decode()
    owners = ("a", "b"), (1, 1)
    positions, tokens = np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64)

    def handed(rids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        sent = decode.meta(rids)
        positions[: len(rids)], tokens[: len(rids)] = sent  # the engine's own buffers, overwritten in place
        return positions[: len(rids)], tokens[: len(rids)]

    for _ in range(5):  # a run: one slot, its chunk held
        assert producer.capture_step(decode.states(["a", "b"]), *owners, *handed(["a", "b"])) == 2
    producer.capture_step(decode.states(["a"]), ["a"], [1], *handed(["a"]))  # other owners: a step of its own
    written = producer.write_step(decode.states(["b"]), ["b"], [1])
    producer.announce_step(written, *handed(["b"]))
    positions[:], tokens[:] = -1, -1
    assert producer.counters.chunks_announced == 0, "sent before the arrays were reused"
    producer.finish_request("a", num_tokens=6)
    producer.finish_request("b", num_tokens=6)
    assert producer.close().rows_captured == 12
    assert consumer.wait(30) == 0
    decode.check(tmp_path)
