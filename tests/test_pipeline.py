"""Producer -> consumer in a separate process over real ZeroMQ and the shared-memory ring -> store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hscapture import open_store
from hscapture.producer import Producer, announcer
from hscapture.store.verify import verify_store
from tests.conftest import ConsumerFactory, wait_attached
from tests.workload import HIDDEN, NUM_TENSORS, Workload, check_store, make_config, make_producer

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def device(request: pytest.FixtureRequest) -> str:
    """Every pipeline contract holds for the host ring and, on a GPU host, for the CUDA IPC ring."""
    return request.param


def test_discard_drains_and_releases_everything_and_writes_nothing(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, device: str
) -> None:
    """``--discard``: no store, yet every slot is copied out and released (the block producer never stalls)."""
    out = tmp_path / "never"
    consumer = start_consumer(None, endpoint, "--discard", "--exit-on-eos")
    producer = make_producer(make_config(endpoint, policy="block", device=device))
    workload = Workload(seed=5, device=device)
    for _ in range(60):  # many times the ring: only releases let it go on
        workload.step(producer)
    counters = producer.close()
    assert consumer.wait(30) == 0
    assert counters.rows_dropped == 0 and counters.rows_captured == workload.total_rows > 0
    assert counters.chunks_announced > 2 and not out.exists()


def test_round_trip_is_bitwise_across_slots_and_shards(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, device: str
) -> None:
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", "--shard-bytes", "20000")
    producer = make_producer(make_config(endpoint, policy="block", device=device))
    workload = Workload(seed=1, device=device)
    for _ in range(150):
        workload.step(producer)
    counters = producer.close()
    assert consumer.wait(30) == 0
    records = check_store(tmp_path, [workload])
    assert counters.rows_dropped == 0 and counters.rows_captured == workload.total_rows
    assert set(workload.finished) <= set(records)
    assert all(records[rid]["status"] == "complete" for rid in workload.finished)
    unfinished = set(workload.running)
    assert {rid for rid, r in records.items() if r["status"] != "complete"} == unfinished
    assert all("end of stream" in records[rid]["reason"] for rid in unfinished)
    summary = open_store(tmp_path).summary()
    assert summary["shards"] > 3 and summary["rows"] == workload.total_rows


def test_block_policy_with_slow_consumer_loses_nothing(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, device: str
) -> None:
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", "--delay-ms", "5")
    producer = make_producer(make_config(endpoint, policy="block", slots=2, rows_per_slot=16, device=device))
    workload = Workload(seed=2, device=device)
    for _ in range(80):
        workload.step(producer)
    counters = producer.close()
    assert consumer.wait(30) == 0
    records = check_store(tmp_path, [workload])
    assert counters.credit_waits > 0, "the consumer was not slow enough to exercise back-pressure"
    assert counters.rows_dropped == 0 and counters.rows_captured == workload.total_rows
    assert all(records[rid]["status"] == "complete" for rid in workload.finished)
    assert sum(r["rows"] for r in records.values()) == workload.total_rows


def test_drop_policy_never_waits_and_counts_drops_exactly(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, device: str
) -> None:
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", "--delay-ms", "20")
    producer = make_producer(make_config(endpoint, policy="drop", slots=2, rows_per_slot=16, device=device))
    wait_attached(producer)
    workload = Workload(seed=3, device=device)
    announced = sum(workload.step(producer) for _ in range(200))
    counters = producer.close()
    assert consumer.wait(30) == 0
    # The producer's own counters: it never waited, and every row is either announced or dropped.
    assert counters.credit_waits == 0 and counters.credit_wait_us == 0
    assert counters.rows_dropped > 0, "the consumer was not slow enough to force drops"
    assert counters.rows_captured == announced
    assert counters.rows_captured + counters.rows_dropped == workload.total_rows
    records = check_store(tmp_path, [workload])
    store = open_store(tmp_path)
    assert store.summary()["rows_dropped"] == counters.rows_dropped
    assert sum(r["rows"] for r in records.values()) == counters.rows_captured
    finished = [records[rid] for rid in workload.finished]
    assert sum(r["dropped_rows"] for r in finished) == sum(
        len(workload.requests[rid].rows) - records[rid]["rows"] for rid in workload.finished
    )
    for record in finished:
        missing = sum(end - start for start, end in record["missing"])
        assert missing == record["dropped_rows"]
        assert (record["status"] == "complete") == (record["dropped_rows"] == 0)


def test_consumer_started_after_producer_attaches_and_captures_from_there(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, device: str
) -> None:
    # 16 slots of 32 rows: ~80 ms of a 5 ms serving pace, room for a GPU consumer's first copies.
    producer = make_producer(make_config(endpoint, policy="drop", slots=16, rows_per_slot=32, device=device))
    workload = Workload(seed=4, device=device)
    before = sum(workload.step(producer) for _ in range(30))
    assert before == 0 and producer.counters.rows_dropped == workload.total_rows
    early = set(workload.requests)
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos")
    wait_attached(producer)
    dropped_before = producer.counters.rows_dropped
    for _ in range(60):
        workload.step(producer)
        time.sleep(0.005)  # a serving pace the consumer keeps up with
    counters = producer.close()
    assert consumer.wait(30) == 0
    assert counters.rows_dropped == dropped_before, "rows dropped after the consumer attached"
    records = check_store(tmp_path, [workload])
    late_finished = [rid for rid in workload.finished if rid not in early]
    assert late_finished and all(records[rid]["status"] == "complete" for rid in late_finished)
    spanning = [rid for rid in early if rid in records]
    for rid in spanning:  # requests that began before the consumer: their early rows are missing
        assert records[rid]["status"] == "incomplete" and records[rid]["missing"][0][0] == 0
    assert counters.rows_captured + counters.rows_dropped == workload.total_rows


def test_consumer_restarted_mid_run_reattaches_and_continues(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, device: str
) -> None:
    first = start_consumer(tmp_path, endpoint, "--shard-bytes", "8000", "--flush-s", "0.2")
    producer = make_producer(make_config(endpoint, policy="block", device=device))
    workload = Workload(seed=5, device=device)
    for _ in range(40):
        workload.step(producer)
    first.send_signal(signal.SIGKILL)
    first.wait()
    before_restart = set(workload.requests)
    second = start_consumer(tmp_path, endpoint, "--exit-on-eos", "--shard-bytes", "8000")
    for _ in range(60):  # blocks until the new consumer attaches; in-flight slots are announced again
        workload.step(producer)
    counters = producer.close()
    assert second.wait(30) == 0
    assert counters.attaches == 2 and counters.rows_dropped == 0
    records = check_store(tmp_path, [workload])
    after = [rid for rid in workload.finished if rid not in before_restart]
    assert after and all(records[rid]["status"] == "complete" for rid in after)


class Requests:
    """Requests of 16 rows each, stepped 8 rows (one slot of ``make_config``) at a time; what the store must hold."""

    def __init__(self, ids: str, device: str) -> None:
        generator = torch.Generator().manual_seed(11)
        self.device = device
        self.rows = {rid: torch.randn(NUM_TENSORS, 16, HIDDEN, generator=generator) for rid in ids}
        self.tokens = {rid: list(range(100 * i, 100 * i + 16)) for i, rid in enumerate(ids, 1)}

    def states(self, rid: str, half: int) -> list[torch.Tensor]:
        return [plane[8 * half : 8 * half + 8].to(self.device) for plane in self.rows[rid]]

    def meta(self, rid: str, half: int) -> tuple[list[int], list[int]]:
        return list(range(8 * half, 8 * half + 8)), self.tokens[rid][8 * half : 8 * half + 8]

    def capture(self, producer: Producer, rid: str, half: int, send: bool = True) -> None:
        """``send``: send it now (these tests say which consumer was sent what); else hold it for the next send."""
        assert producer.capture_step(self.states(rid, half), [rid], [8], *self.meta(rid, half)) == 8
        if send:
            producer.poll()

    def finish(self, producer: Producer, rid: str) -> None:
        producer.finish_request(rid, num_tokens=16, loss_mask=[(1, 16)])

    def check(self, out: Path, unfinished: str = "") -> None:
        """Every row in the store once, bitwise as produced; every request complete but the ``unfinished`` ones."""
        store = open_store(out)
        for rid, planes in self.rows.items():
            record = store.record(rid)
            assert record["status"] == ("incomplete" if rid in unfinished else "complete"), f"{record}"
            sample = store.get(rid)
            assert sample["positions"].tolist() == list(range(16)), rid
            assert torch.equal(torch.stack([sample[name] for name in store.tensor_names]), planes), rid
            assert sample["input_ids"].tolist() == self.tokens[rid], rid


def serve_until(producer: Producer, done: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Serve the producer's control socket until ``done()``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        producer.poll()
        time.sleep(0.01)


def first_consumer_holding_a(
    tmp_path: Path,
    endpoint: str,
    start_consumer: ConsumerFactory,
    producer: Producer,
    requests: Requests,
    together: bool = False,
) -> subprocess.Popen:
    """A consumer attached and sent both halves of request "a" (seqs 1 and 2), which it never releases;
    ``together``: in one message (held back, then sent together)."""
    first = start_consumer(tmp_path, endpoint, "--delay-ms", "600000")  # stuck in its first chunk
    wait_attached(producer)
    requests.capture(producer, "a", 0, send=not together)
    requests.capture(producer, "a", 1)
    return first


def second_consumer_held_before_confirming(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, producer: Producer, first: subprocess.Popen
) -> tuple[subprocess.Popen, Path, Path]:
    """Kill ``first``; start another and return once our layout is offered to it. It opens the ring and waits
    to confirm until the test creates its gate file (returned with its log), as a CUDA one is slow to open it:
    until then the producer cannot have heard its confirmation, whatever the timing."""
    first.kill()
    first.wait()
    gate, log = tmp_path / "gate", tmp_path / "second.log"
    second = start_consumer(tmp_path, endpoint, "--exit-on-eos", "--attach-gate", str(gate), log=log)
    serve_until(producer, lambda: not producer.attached, "the layout offered to the second one")
    return second, gate, log


@pytest.mark.parametrize("sent", ["alone", "together"])
def test_a_restarted_consumer_slow_to_attach_takes_over_each_slot_in_flight_once_in_seq_order(
    tmp_path: Path,
    endpoint: str,
    start_consumer: ConsumerFactory,
    device: str,
    sent: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first consumer dies holding every slot it was sent; the next one is offered the layout and has not
    confirmed when the engine announces a step it wrote before the death, then finishes a request whose rows the
    dead one held. The new consumer must get the dead one's slots first, in seq order, then that step and that
    finish, each once: nothing rejected as a replay, nothing lost, no slot left unreleased. (The step once went
    to the consumer before it confirmed, the dead one's slots after: "Chunk.seq: 1 after 3; replayed or out of
    order", seq 3 announced twice and released twice, slots 1 and 2 never released; on the GPU a CreditTimeout.)
    ``together``: the dead one got both slots in one message; the new one gets each again alone."""
    monkeypatch.setattr(announcer, "SERVICE_S", 3600.0)  # held chunks go out only when the test says
    producer = make_producer(make_config(endpoint, policy="block", device=device))  # 4 slots of 8 rows
    requests = Requests("ab", device)
    first = first_consumer_holding_a(tmp_path, endpoint, start_consumer, producer, requests, sent == "together")
    written = producer.write_step(requests.states("b", 0), ["b"], [8])  # announced only after the death
    second, gate, log = second_consumer_held_before_confirming(tmp_path, endpoint, start_consumer, producer, first)
    gate.touch()  # it may confirm now; announcing reads no confirmation before it sends
    assert producer.announce_step(written, *requests.meta("b", 0)) == 8  # seq 3
    requests.finish(producer, "a")
    requests.capture(producer, "b", 1)
    requests.finish(producer, "b")
    counters = producer.close()
    assert second.wait(30) == 0
    assert "rejected" not in log.read_text(), log.read_text()[-3000:]
    assert counters.attaches == 2 and counters.rows_dropped == counters.events_dropped == 0
    assert counters.messages_rejected == 0, "a slot was released twice: announced twice"
    requests.check(tmp_path)


def test_a_producer_closed_while_a_restarted_consumer_attaches_ends_the_stream_after_the_slots_in_flight(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, device: str
) -> None:
    """The end of stream waits for the new consumer to confirm and take the dead one's slots (it once could go
    out first: the consumer ended its run at once and the producer closed with the slots never released)."""
    producer = make_producer(make_config(endpoint, policy="block", device=device))
    requests = Requests("a", device)
    first = first_consumer_holding_a(tmp_path, endpoint, start_consumer, producer, requests)
    second, gate, log = second_consumer_held_before_confirming(tmp_path, endpoint, start_consumer, producer, first)
    gate.touch()
    counters = producer.close()
    assert not producer.ledger.in_flight, "closed with slots never released"
    assert second.wait(30) == 0
    assert "rejected" not in log.read_text(), log.read_text()[-3000:]
    assert counters.attaches == 2 and counters.messages_rejected == 0
    requests.check(tmp_path, unfinished="a")  # never finished: both halves stored, the request marked incomplete


@pytest.mark.parametrize("replacement", ["offered", "attached"])
def test_a_consumer_replaced_while_frozen_is_taken_back_and_loses_no_slot(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, device: str, replacement: str
) -> None:
    """The attached consumer freezes holding slots; after the takeover time another is offered the layout and
    dies, either while opening the ring (``offered``) or attached, holding the slots announced to it again
    (``attached``). The frozen one comes back and is attached again (a second confirm of the same consumer). Its
    own releases free the slots announced to it; those the other held are announced to it again, and it copies
    each row once: an announcement it has seen is released, never copied twice or rejected as a replay."""
    producer = make_producer(make_config(endpoint, policy="block", device=device))
    log = tmp_path / "first.log"
    first = start_consumer(tmp_path, endpoint, "--exit-on-eos", log=log)
    wait_attached(producer)
    requests = Requests("abc", device)
    requests.capture(producer, "a", 0)
    first.send_signal(signal.SIGSTOP)  # alive but silent, the slots announced from now on in its queue
    try:
        requests.capture(producer, "a", 1)
        requests.capture(producer, "b", 0)
        if replacement == "offered":  # opens the ring and never confirms: its gate never opens
            second = start_consumer(tmp_path / "second", endpoint, "--attach-gate", str(tmp_path / "gate"))
            serve_until(producer, lambda: not producer.attached, "the takeover by the second one")
        else:  # attaches, and is stuck in the first chunk announced to it
            second = start_consumer(tmp_path / "second", endpoint, "--delay-ms", "600000")
            serve_until(producer, lambda: producer.counters.attaches == 2, "the takeover by the second one")
        moved = len(producer.ledger.in_flight) if replacement == "attached" else 0  # announced to the second one
        second.kill()
        second.wait()
    finally:
        first.send_signal(signal.SIGCONT)
    attaches = 2 if replacement == "offered" else 3  # not "attached": the producer may not know the second is dead
    serve_until(producer, lambda: producer.counters.attaches == attaches, "the first one attached again")
    requests.finish(producer, "a")
    requests.capture(producer, "b", 1)
    requests.capture(producer, "c", 0)
    requests.capture(producer, "c", 1)
    requests.finish(producer, "b")
    requests.finish(producer, "c")
    counters = producer.close()
    assert first.wait(30) == 0
    assert "rejected" not in log.read_text(), log.read_text()[-3000:]
    assert not producer.ledger.in_flight, "a slot never came back"
    assert counters.rows_dropped == counters.events_dropped == 0
    assert counters.attaches == attaches
    # A slot it got twice it releases twice (unless the second came while still copying it): the producer
    # refuses one of the two as stale. Nothing else is refused.
    assert counters.messages_rejected <= moved, "a release of the consumer the slot was announced to was refused"
    requests.check(tmp_path)


def test_producer_restarted_is_found_again_by_a_running_consumer(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    consumer = start_consumer(tmp_path, endpoint)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    crashed = subprocess.Popen(
        [sys.executable, "-m", "tests.workload", "--endpoint", endpoint, "--seed", "6", "--prefix", "a"],
        stdout=subprocess.PIPE,
        env=env,
    )
    assert crashed.stdout is not None
    for _ in range(40):  # let it produce a while, then kill it without any goodbye
        crashed.stdout.readline()
    crashed.kill()
    crashed.wait()
    producer = make_producer(make_config(endpoint, policy="block"))
    workload = Workload(seed=7, prefix="b")
    for _ in range(60):
        workload.step(producer)
    producer.close()
    time.sleep(0.5)
    consumer.send_signal(signal.SIGTERM)
    assert consumer.wait(30) == 0
    store = open_store(tmp_path)
    runs = store.metadata()["runs"]
    assert len(runs) == 2 and runs[0]["end"]["reason"] in ("producer died", "producer restarted")
    records = check_store(tmp_path, [workload], keys=[rid for rid in store if rid.startswith("b")])
    assert all(records[rid]["status"] == "complete" for rid in workload.finished)
    first = [rid for rid in store if rid.startswith("a")]
    assert first, "nothing captured from the producer that crashed"
    for rid in first:
        record = store.record(rid)
        assert record["status"] == "complete" or record["reason"]


@pytest.mark.parametrize("policy", ["block", "drop"])
def test_producer_rejects_steps_that_do_not_match_the_plan(endpoint: str, policy: str) -> None:
    producer = make_producer(make_config(endpoint, policy=policy))
    good = [torch.zeros(3, 32) for _ in range(3)]
    with pytest.raises(ValueError, match="planned 3 tensors"):
        producer.capture_step(good[:2], ["a"], [3], [0, 1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="planned dtype float32, got bfloat16"):
        producer.capture_step([g.bfloat16() for g in good], ["a"], [3], [0, 1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match=r"planned \[3, 32\], got \[3, 16\]"):
        producer.capture_step([*good[:2], torch.zeros(3, 16)], ["a"], [3], [0, 1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="summing to 2"):
        producer.capture_step(good, ["a"], [2], [0, 1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="positions: planned 3 values"):
        producer.capture_step(good, ["a"], [3], [0, 1], [1, 2, 3])
    big = [torch.zeros(40, 32) for _ in range(3)]
    with pytest.raises(ValueError, match="max_step_rows=32, got 40"):
        producer.capture_step(big, ["a"], [40], list(range(40)), list(range(40)))
    producer.close()
    producer.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        producer.capture_step(good, ["a"], [3], [0, 1, 2], [1, 2, 3])


def test_a_row_computed_past_a_request_end_is_cut_from_its_record(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    """An engine scheduling ahead runs one decode step past a request's end before it learns of
    the end (SGLang's overlap scheduler): that tail row is left out and the request stays complete."""
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos")
    producer = make_producer(make_config(endpoint, policy="block"))
    wait_attached(producer)
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(3, 6, 32, generator=gen)  # [tensors, positions 0..5, hidden]
    producer.capture_step(list(rows[:, :4]), ["r"], [4], list(range(4)), [10, 11, 12, 13])  # prefill
    producer.capture_step(list(rows[:, 4:5]), ["r"], [1], [4], [14])  # the last decode step
    producer.capture_step(list(rows[:, 5:6]), ["r"], [1], [5], [15])  # one step past the end
    producer.finish_request("r", num_tokens=5, loss_mask=[(1, 5)])
    producer.close()
    assert consumer.wait(30) == 0
    store = open_store(tmp_path)
    record = store.record("r")
    assert record["status"] == "complete" and record["surplus_rows"] == 1 and record["rows"] == 5, record
    sample = store.get("r")
    assert sample["positions"].tolist() == [0, 1, 2, 3, 4] and sample["input_ids"].tolist() == [10, 11, 12, 13, 14]
    assert torch.equal(torch.stack([sample[n] for n in ("layer_1", "layer_3", "last")]), rows[:, :5])
    assert verify_store(tmp_path).ok
