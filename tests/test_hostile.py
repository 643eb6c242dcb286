"""Hostile input on live sockets: a fuzzing peer beside a real producer, a fake producer feeding a real consumer.

Nothing may crash, nothing may be read or written outside the ring, every rejection is counted
and logged with its reason, and the honest side's rows stay bitwise intact. Payloads come from
``random.Random(seed)`` (deterministic, bounded time) plus crafted cases; every one is sent over
real ZeroMQ sockets to a real ``Producer`` or a real ``hscapture consume`` process.
"""

from __future__ import annotations

import ast
import logging
import os
import random
import re
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from hscapture import open_store, protocol
from hscapture.errors import ProtocolError
from hscapture.producer import Producer
from hscapture.protocol import PROTOCOL_VERSION as V
from hscapture.protocol import Chunk, EndOfStream, Hello, Layout, Release, RequestFinished
from hscapture.ring import SHM_DIR, HostRing
from hscapture.transport import ProducerSockets, release_endpoint
from tests.conftest import ConsumerFactory, LoggedConsumer, wait_attached
from tests.workload import Workload, check_store, make_config, make_producer

MiB = 1 << 20
_enc = msgspec.msgpack.encode

#: msgpack headers that promise 4 GiB of elements or bytes, and a nesting far past any sane depth.
BOMBS = [
    b"\xdd\xff\xff\xff\xff",  # array32 of 2**32-1 items
    b"\xdf\xff\xff\xff\xff",  # map32 of 2**32-1 pairs
    b"\xdb\xff\xff\xff\xff",  # str32 of 2**32-1 bytes
    b"\xc6\xff\xff\xff\xff",  # bin32 of 2**32-1 bytes
    b"\x91" * 100_000 + b"\xc0",  # [[[...[nil]...]]]
    b"\x82" + _enc("type") + _enc("hello") + _enc("v") + b"\x91" * 50_000 + b"\xc0",
]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 2 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False, 0.5, float("nan"), -1e300])
    if kind == 2:
        return rng.choice([0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-(10**6), 10**6)])
    if kind == 3:
        return "".join(rng.choice("ab\x00é💥/.") for _ in range(rng.randrange(12)))
    if kind == 4:
        return rng.randbytes(rng.randrange(16))
    if kind == 5:
        return rng.randrange(-5, 50)
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {str(_random_value(rng, depth + 1)): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


_FIELDS = ["v", "type", "consumer_id", "run_id", "token", "slot", "seq", "offset", "nbytes", "rows", "ring", "meta"]


def fields_of(message: protocol.Message) -> dict[str, Any]:
    """A message as the plain msgpack map it travels as (bytes stay bytes), to tamper with."""
    return msgspec.msgpack.decode(protocol.encode(message))


def fuzz_payloads(seed: int, count: int, templates: list[bytes], tags: list[str]) -> list[bytes]:
    """Random bytes, truncations and byte flips of valid messages, and structured msgpack garbage."""
    rng = random.Random(seed)
    payloads = []
    while len(payloads) < count:
        kind = rng.randrange(4)
        if kind == 0:
            data = rng.randbytes(rng.randrange(0, 400))
        elif kind == 1:
            template = rng.choice(templates)
            data = template[: rng.randrange(len(template))]
        elif kind == 2:
            flipped = bytearray(rng.choice(templates))
            for _ in range(rng.randint(1, 4)):
                flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            data = bytes(flipped)
        else:
            fields = {rng.choice(_FIELDS): _random_value(rng) for _ in range(rng.randrange(7))}
            fields["type"] = rng.choice([*tags, "", "?", "release\x00"])
            fields["v"] = rng.choice([V, V, V, 0, 2, -1, "1", None])
            data = _enc(fields)
        payloads.append(data)
    return payloads


# =========================================================================== the producer under fire


def assert_slots_accounted(producer: Producer) -> None:
    """Every slot is exactly once either free, written, held to be announced, or in flight: none was released twice
    or early."""
    ledger = producer.ledger
    free, written, held, flying = list(ledger.free), list(ledger.written), list(ledger.held), list(ledger.in_flight)
    assert sorted(free + written + held + flying) == list(range(producer.config.num_slots)), (free, held, flying)


REJECTED_ON_RELEASE = "rejected message on release socket: "


def rejections(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()[len(REJECTED_ON_RELEASE) :]
        for r in caplog.records
        if r.name == "hscapture.producer.link" and r.getMessage().startswith(REJECTED_ON_RELEASE)
    ]


def wait_rejected(producer: Producer, count: int, timeout_s: float = 15.0) -> None:
    """Serve the control socket until ``count`` messages were rejected (then a little longer)."""
    deadline = time.monotonic() + timeout_s
    while producer.counters.messages_rejected < count and time.monotonic() < deadline:
        producer.poll()
        time.sleep(0.005)
    settle = time.monotonic() + 0.2  # anything more that would be (wrongly) rejected arrives now
    while time.monotonic() < settle:
        producer.poll()
        time.sleep(0.01)


@pytest.fixture
def hostile_push(endpoint: str) -> Iterator[Callable[[], zmq.Socket]]:
    """A stray PUSH socket connected to a producer's release endpoint (connect after the bind)."""
    sockets: list[zmq.Socket] = []

    def connect() -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDTIMEO, 10_000)
        sock.connect(release_endpoint(endpoint))
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close(linger=0)


@pytest.fixture
def new_producer(endpoint: str) -> Iterator[Callable[..., Producer]]:
    """Producers of the test workload on ``endpoint``; each is closed (its ring freed) at teardown."""
    made: list[Producer] = []

    def make(policy: str = "block", block_timeout_s: float = 60.0) -> Producer:
        config = make_config(endpoint, policy=policy)
        config.block_timeout_s = block_timeout_s
        made.append(make_producer(config))
        return made[-1]

    yield make
    for producer in made:
        producer.close(timeout_s=0)


MALFORMED_OR_FORGED = r"malformed message|protocol version|wrong token|stale or forged"


def test_producer_rejects_every_hostile_control_message_and_keeps_the_stream_bitwise(
    tmp_path: Path,
    endpoint: str,
    start_consumer: ConsumerFactory,
    new_producer: Callable[..., Producer],
    hostile_push: Callable[[], zmq.Socket],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="hscapture.producer")
    out = tmp_path / "store"
    consumer = start_consumer(out, endpoint, "--exit-on-eos", "--shard-bytes", "30000")
    producer = new_producer()
    wait_attached(producer)
    hostile = hostile_push()
    real_id = producer.consumer_id  # the attached consumer's id: forgeries that differ only in seq or token
    assert real_id
    num_slots = producer.config.num_slots
    templates = [
        protocol.encode(Hello(v=V, consumer_id="intruder", run_id=producer.run_id, token="0" * 32)),
        protocol.encode(Release(v=V, consumer_id="intruder", slot=1, seq=3)),
    ]
    fuzz = fuzz_payloads(seed=20240501, count=300, templates=templates, tags=["hello", "release", "chunk"])
    # (payload, reason the producer must give); every hostile message must be rejected.
    sent: list[tuple[bytes, str]] = []

    def send(message: protocol.Message | bytes, reason: str) -> None:
        data = message if isinstance(message, bytes) else protocol.encode(message)
        hostile.send(data)
        sent.append((data, reason))

    def forge_against_flight() -> None:
        """Releases aimed at a slot that is in flight right now, each wrong in one way."""
        slot, flight = next(iter(producer.ledger.in_flight.items()))
        # Replayed, out of order, or from the future (not seq + 1: this slot may really carry it next).
        for seq in (flight.seq - 1, flight.seq + 10**9, 0, -1, 2**64 - 1):
            send(Release(v=V, consumer_id=real_id, slot=slot, seq=seq), "stale or forged")
        for other in ("intruder", "", real_id + "x", real_id[:-1]):  # right slot and seq, forged handle
            send(Release(v=V, consumer_id=other, slot=slot, seq=flight.seq), "stale or forged")
        for version in (0, V + 1, 2**63 - 1):  # right in every field but the version: must not free the slot
            send(Release(v=version, consumer_id=real_id, slot=slot, seq=flight.seq), "protocol version")
        released_before.append((slot, flight.seq))

    released_before: list[tuple[int, int]] = []
    crafted: list[tuple[protocol.Message | bytes, str]] = [
        *[(Release(v=V, consumer_id=real_id, slot=s, seq=1), "stale or forged") for s in (-1, num_slots, 2**31)],
        (Release(v=V, consumer_id=real_id, slot=2**63 - 1, seq=2), "stale or forged"),
        (Release(v=V, consumer_id=real_id, slot=-(2**63), seq=2), "stale or forged"),
        (Release(v=V, consumer_id=real_id, slot=2**64 - 1, seq=2**64 - 1), "stale or forged"),
        (Release(v=V, consumer_id=real_id, slot=-1, seq=1, more=[(num_slots, 1), (0, 2**63)]), "stale or forged"),
        (_enc({"type": "release", "v": V, "consumer_id": real_id, "slot": 0, "seq": 1, "more": [[0]]}), "malformed"),
        (Hello(v=V, consumer_id="intruder"), "wrong token"),
        (Hello(v=V, consumer_id="", run_id=producer.run_id), "wrong token"),
        (Hello(v=V, consumer_id="\x00\x01\x7f"), "wrong token"),
        (Hello(v=V, consumer_id="💥" * 1000, token="x" * 10_000), "wrong token"),
        (Hello(v=V, consumer_id=real_id, run_id=producer.run_id, token="0" * 32), "wrong token"),
        (Hello(v=V, consumer_id=real_id, run_id="", token=producer.token + " "), "wrong token"),
        (Hello(v=V + 1, consumer_id="intruder", token=producer.token), "protocol version"),
        (Hello(v=0, consumer_id=real_id, run_id=producer.run_id, token=producer.token), "protocol version"),
        (_enc({"type": "hello", "v": V, "consumer_id": 5, "token": producer.token}), "malformed message"),
        (_enc({"type": "hello", "v": "1", "consumer_id": "c", "token": producer.token}), "malformed message"),
        (_enc({"type": "release", "v": V, "consumer_id": real_id, "slot": "0", "seq": 1}), "malformed message"),
        (_enc({"type": "release", "v": V, "consumer_id": real_id, "slot": 0, "seq": 1.5}), "malformed message"),
        (_enc({"type": "release", "v": V, "consumer_id": real_id, "slot": True, "seq": 1}), "malformed message"),
        (_enc({"type": "release", "v": V, "consumer_id": real_id, "slot": 0}), "malformed message"),
        (_enc({"type": "layout", "v": V, "consumer_id": real_id}), "malformed message"),
        (_enc([V, "release", real_id, 0, 1]), "malformed message"),
        *[(bomb, "malformed message") for bomb in BOMBS],
        (random.Random(1).randbytes(4 * MiB), "malformed message"),  # oversized garbage
        (b"\x00" * (4 * MiB), "malformed message"),
        (Release(v=V, consumer_id="x" * (4 * MiB), slot=0, seq=1), "stale or forged"),  # oversized, well formed
    ]

    workload = Workload(seed=31)
    steps = 100
    for step in range(steps):
        workload.step(producer)
        assert_slots_accounted(producer)
        if producer.ledger.in_flight and step % 4 == 0:
            forge_against_flight()
        if step % 10 == 5:  # replay the consumer's own earlier releases, once their seq is no longer in flight
            for slot, seq in released_before:
                flight = producer.ledger.in_flight.get(slot)
                if flight is None or flight.seq != seq:
                    send(Release(v=V, consumer_id=real_id, slot=slot, seq=seq), "stale or forged")
        for message, reason in crafted[step::steps]:
            send(message, reason)
        for data in fuzz[step * 3 : step * 3 + 3]:
            send(data, MALFORMED_OR_FORGED)
    assert len(fuzz) == 3 * steps and len(crafted) < steps

    wait_rejected(producer, len(sent))
    assert producer.counters.messages_rejected == len(sent), "a hostile message was accepted (or one honest rejected)"
    counters = producer.close()
    assert consumer.wait(30) == 0
    assert counters.messages_rejected == len(sent)
    assert not producer.ledger.in_flight, "a slot never came back"
    assert counters.attaches == 1 and counters.rows_dropped == 0
    assert counters.rows_captured == workload.total_rows

    # Each rejection logged, in the order sent (the honest consumer's messages are never rejected), with its reason.
    reasons = rejections(caplog)
    assert len(reasons) == len(sent)
    for (data, expected), reason in zip(sent, reasons):
        assert re.search(expected, reason), f"{data[:40]!r}: expected /{expected}/, logged {reason[:200]!r}"
    assert not any("not released" in r.getMessage() for r in caplog.records)

    records = check_store(out, [workload])
    assert sum(r["rows"] for r in records.values()) == workload.total_rows
    assert all(records[rid]["status"] == "complete" for rid in workload.finished)


def test_producer_rejection_log_lines_are_bounded(
    new_producer: Callable[..., Producer], hostile_push: Callable[[], zmq.Socket], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hscapture.producer")
    producer = new_producer("drop")
    hostile = hostile_push()
    hostile.send(protocol.encode(Release(v=V, consumer_id="x" * (4 * MiB), slot=0, seq=1)))
    hostile.send(protocol.encode(Hello(v=V, consumer_id="y" * (4 * MiB))))
    wait_rejected(producer, 2)
    assert producer.counters.messages_rejected == 2
    assert [len(reason) < 4096 for reason in rejections(caplog)] == [True, True]


def test_forged_hellos_without_the_token_leave_the_real_consumer_attached(
    tmp_path: Path,
    endpoint: str,
    start_consumer: ConsumerFactory,
    new_producer: Callable[..., Producer],
    hostile_push: Callable[[], zmq.Socket],
) -> None:
    """A stray process saying hello (any consumer id, no token) is rejected; it never detaches the consumer."""
    out = tmp_path / "store"
    consumer = start_consumer(out, endpoint, "--exit-on-eos")
    producer = new_producer()
    wait_attached(producer)
    hostile = hostile_push()
    workload = Workload(seed=41)
    forged = 0
    for step in range(40):
        workload.step(producer)
        if step % 5 == 0:
            for consumer_id in (f"stray-{step}", "", producer.consumer_id):
                hostile.send(protocol.encode(Hello(v=V, consumer_id=consumer_id, run_id=producer.run_id)))
                forged += 1
            wait_rejected(producer, forged, timeout_s=5)
            assert producer.attached and producer.counters.attaches == 1
    assert producer.counters.messages_rejected == forged
    counters = producer.close()
    assert consumer.wait(30) == 0 and counters.rows_dropped == 0 and not producer.ledger.in_flight
    records = check_store(out, [workload])
    assert all(records[rid]["status"] == "complete" for rid in workload.finished)


def test_a_stray_hello_with_the_token_does_not_leak_the_real_consumers_slots(
    tmp_path: Path,
    endpoint: str,
    start_consumer: ConsumerFactory,
    new_producer: Callable[..., Producer],
    hostile_push: Callable[[], zmq.Socket],
) -> None:
    out = tmp_path / "store"
    consumer = start_consumer(out, endpoint, "--exit-on-eos", "--delay-ms", "10")
    producer = new_producer(block_timeout_s=5)
    wait_attached(producer)
    hostile = hostile_push()
    workload = Workload(seed=43)
    for step in range(30):
        workload.step(producer)
        if step == 10:
            # The slow consumer still copies the chunks just announced when the hello lands.
            producer.poll()  # sends the chunks held back
            assert producer.ledger.in_flight
            hostile.send(protocol.encode(Hello(v=V, consumer_id="second-consumer", token=producer.token)))
            deadline = time.monotonic() + 0.2  # takes the hello (and whatever else comes) meanwhile
            while time.monotonic() < deadline:
                producer.poll()
    counters = producer.close(timeout_s=3)
    assert consumer.wait(30) == 0
    assert not producer.ledger.in_flight, "slots of the real consumer were never given back"
    assert counters.rows_dropped == 0 and counters.rows_captured == workload.total_rows
    records = check_store(out, [workload])
    assert all(records[rid]["status"] == "complete" for rid in workload.finished)


# =========================================================================== the consumer under fire

HIDDEN = 32
NAMES = ["layer_1", "layer_3", "last"]
PLANE_ROW = HIDDEN * 4  # float32
ROW_BYTES = len(NAMES) * PLANE_ROW
ROWS_PER_SLOT = 8
SLOT_BYTES = ROWS_PER_SLOT * ROW_BYTES
NUM_SLOTS = 4
REJECTED_ON_ANNOUNCE = "rejected message on announce socket: "


def announce_rejections(consumer: LoggedConsumer) -> list[str]:
    """What the consumer logged it rejected, one reason per announcement."""
    return [line.split(REJECTED_ON_ANNOUNCE, 1)[1] for line in consumer.lines() if REJECTED_ON_ANNOUNCE in line]


def done_stats(consumer: LoggedConsumer) -> dict[str, int]:
    """The counters of its ``done:`` line."""
    done = [line for line in consumer.lines() if line.startswith("done: ")]
    assert len(done) == 1, consumer.stderr()[-3000:]
    return ast.literal_eval(done[0][len("done: ") :])


@pytest.fixture
def live_consumer(logged_consumer: Callable[..., LoggedConsumer]) -> Callable[..., LoggedConsumer]:
    """``hscapture consume --exit-on-eos`` with its stats on, its stderr in a file; killed at teardown."""
    return lambda endpoint, *extra: logged_consumer(endpoint, "--exit-on-eos", *extra)


class FakeProducer:
    """The producer's two sockets bound by the test, and a HostRing the test fills with known rows."""

    def __init__(self, endpoint: str, seed: int) -> None:
        self.sockets = ProducerSockets(endpoint)
        self.release = self.sockets.release
        self.ring = HostRing(NUM_SLOTS, SLOT_BYTES, f"hostile-{uuid.uuid4().hex[:12]}")
        self.run_id = uuid.uuid4().hex[:16]
        self.consumer_id = ""
        self.seq = 0
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        #: Every row announced in a valid chunk: request -> position -> ([tensors, hidden], token id).
        self.rows: dict[str, dict[int, tuple[torch.Tensor, int]]] = {}
        #: The consumer process under test: waits fail at once when it has exited.
        self.consumer: LoggedConsumer | None = None
        #: ``(slot, seq)`` released and not taken by :meth:`next_release` yet (a release may carry several).
        self.released: deque[tuple[int, int]] = deque()

    def close(self) -> None:
        self.sockets.close()
        self.ring.close()

    # ---------------------------------------------------------------- sockets

    def check_alive(self) -> None:
        consumer = self.consumer
        if consumer is not None and consumer.process.poll() is not None:
            raise AssertionError(f"consumer exited with {consumer.process.returncode}:\n{consumer.stderr()[-3000:]}")

    def send(self, message: protocol.Message | bytes) -> None:
        data = message if isinstance(message, bytes) else protocol.encode(message)
        deadline = time.monotonic() + 10
        while not self.sockets.send(self.consumer_id, data):  # the consumer is not connected (any more)
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("no consumer to send to")
            time.sleep(0.01)

    def receive(self, timeout_s: float) -> Hello | Release | None:
        if not self.release.poll(max(0, int(min(timeout_s, 0.1) * 1000))):
            self.check_alive()
            return None
        return protocol.decode_to_producer(self.release.recv())

    def wait_for(self, want: Callable[[Hello | Release], bool], timeout_s: float = 120.0) -> Hello | Release:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = self.receive(deadline - time.monotonic())
            if message is not None and want(message):
                return message
            assert not isinstance(message, Release), f"unexpected {message}"
        raise TimeoutError(f"nothing wanted from the consumer within {timeout_s} s")

    def next_release(self) -> tuple[int, int]:
        if not self.released:
            release = self.wait_for(lambda m: isinstance(m, Release))
            assert isinstance(release, Release) and release.consumer_id == self.consumer_id
            self.released.extend([(release.slot, release.seq), *release.more])
        return self.released.popleft()

    def first_hello(self, consumer: LoggedConsumer, timeout_s: float = 120.0) -> None:
        self.consumer = consumer
        self.consumer_id = self.wait_for(lambda m: isinstance(m, Hello), timeout_s).consumer_id

    def handshake(self, consumer: LoggedConsumer, timeout_s: float = 120.0, **layout: Any) -> None:
        """Answer the consumer's hello with our layout and wait until it confirms."""
        self.first_hello(consumer, timeout_s)
        self.send(self.layout(**layout))
        self.wait_for(lambda m: isinstance(m, Hello) and m.run_id == self.run_id, timeout_s)

    # ---------------------------------------------------------------- messages

    def layout(self, **overrides: Any) -> Layout:
        fields: dict[str, Any] = {
            "v": V,
            "run_id": self.run_id,
            "consumer_id": self.consumer_id,
            "ring": self.ring.describe(),
            "num_slots": NUM_SLOTS,
            "slot_bytes": SLOT_BYTES,
            "dtype": "float32",
            "hidden_size": HIDDEN,
            "tensor_names": NAMES,
            "tensor_descriptions": [f"tensor {name}" for name in NAMES],
            "policy": "block",
            "meta": {"engine": "hostile-test"},
            "pid": os.getpid(),
        }
        fields.update(overrides)
        return Layout(**fields)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def write(self, slot: int, spans: list[tuple[str, int, int]], row_stride: int = 0) -> Chunk:
        """Write rows of ``spans`` (request, first position, rows) into ``slot``; the valid chunk announcing them."""
        rows = sum(n for _, _, n in spans)
        stride = row_stride or rows
        data = torch.randn(len(NAMES), rows, HIDDEN, generator=self.gen)
        tokens = [self.rng.randrange(1, 50_000) for _ in range(rows)]
        planes = self.ring.slot(slot).view(torch.float32)[: len(NAMES) * stride * HIDDEN]
        planes = planes.view(len(NAMES), stride, HIDDEN)
        planes.fill_(1e30)  # the padding rows of a strided chunk must never reach the store
        planes[:, :rows] = data
        positions: list[int] = []
        at = 0
        for rid, start, n in spans:
            for i in range(n):
                assert start + i not in self.rows.setdefault(rid, {})
                self.rows[rid][start + i] = (data[:, at + i].clone(), tokens[at + i])
            positions.extend(range(start, start + n))
            at += n
        return Chunk(
            v=V,
            seq=self.next_seq(),
            step=self.seq,
            slot=slot,
            offset=slot * SLOT_BYTES,
            nbytes=stride * ROW_BYTES,
            rows=rows,
            request_ids=[rid for rid, _, _ in spans],
            request_rows=[n for _, _, n in spans],
            positions=protocol.pack_rows(np.array(positions)),
            token_ids=protocol.pack_rows(np.array(tokens)),
            row_stride=row_stride,
        )

    def forge(self, **overrides: Any) -> Chunk:
        """A chunk of two rows of request ``evil`` in slot 0 with a fresh seq, then ``overrides``."""
        fields: dict[str, Any] = {
            "v": V,
            "seq": overrides.pop("seq", None) or self.next_seq(),
            "step": 0,
            "slot": 0,
            "offset": 0,
            "nbytes": 2 * ROW_BYTES,
            "rows": 2,
            "request_ids": ["evil"],
            "request_rows": [2],
            "positions": protocol.pack_rows(np.arange(2)),
            "token_ids": protocol.pack_rows(np.arange(2) + 7),
        }
        fields.update(overrides)
        return Chunk(**fields)


@pytest.fixture
def fake_producer(endpoint: str) -> Iterator[FakeProducer]:
    fake = FakeProducer(endpoint, seed=77)
    yield fake
    fake.close()


def check_consumer_store(out: Path, fake: FakeProducer) -> dict[str, dict]:
    """The store holds exactly the rows of the valid chunks, bitwise, and nothing else."""
    store = open_store(out)
    assert sorted(store.keys()) == sorted(fake.rows)
    records = {}
    for rid, rows in fake.rows.items():
        sample = store.get(rid)
        positions = sorted(rows)
        assert sample["positions"].tolist() == positions, rid
        expected = torch.stack([rows[p][0] for p in positions])  # [n, tensors, hidden]
        stored = torch.stack([sample[name] for name in NAMES], dim=1)
        assert torch.equal(stored.view(torch.int32), expected.view(torch.int32)), f"{rid}: rows differ"
        assert sample["input_ids"].tolist() == [rows[p][1] for p in positions], rid
        records[rid] = store.record(rid)
    return records


GARBAGE = r"^malformed message|protocol version"


def test_consumer_rejects_every_hostile_announcement_and_stores_exactly_the_valid_rows(
    tmp_path: Path, endpoint: str, fake_producer: FakeProducer, live_consumer: Callable[..., LoggedConsumer]
) -> None:
    fake = fake_producer
    consumer = live_consumer(endpoint, "--shard-bytes", str(5 * ROW_BYTES))  # chunks straddle shards
    fake.handshake(consumer)
    hostile: list[str] = []  # the reason each hostile message must be rejected with, in order sent
    valid: list[tuple[int, int]] = []

    def reject(message: protocol.Message | bytes, reason: str) -> None:
        fake.send(message)
        hostile.append(reason)

    def announce(chunk: Chunk) -> None:
        fake.send(chunk)
        valid.append((chunk.slot, chunk.seq))
        assert fake.next_release() == (chunk.slot, chunk.seq)  # released, and nothing hostile was

    first = fake.write(0, [("good-a", 0, 3), ("good-b", 0, 2)])
    announce(first)

    # -- garbage: random bytes, truncations, byte flips, bombs, oversized; all must fail to decode
    template = protocol.encode(first)
    rng = random.Random(4242)
    payloads = [rng.randbytes(rng.randrange(0, 600)) for _ in range(120)]
    payloads += [template[: rng.randrange(len(template))] for _ in range(20)]
    for _ in range(80):
        flipped = bytearray(template)
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        payloads.append(bytes(flipped))
    payloads += [*BOMBS, rng.randbytes(4 * MiB), b"\xc4" + b"\xff" * (4 * MiB)]
    undecodable = []
    for data in payloads:
        try:
            protocol.decode_to_consumer(data)
        except ProtocolError:
            undecodable.append(data)
    assert len(undecodable) > 150  # some byte flips still decode (another seq, step...): not sent
    for data in undecodable:
        reject(data, GARBAGE)
    for version in (0, V + 1, -1, 2**63 - 1):
        reject(fake.forge(v=version), "protocol version")
    reject(_enc({**fields_of(fake.forge()), "slot": "0"}), "malformed message")
    reject(_enc({**fields_of(fake.forge()), "positions": [0, 1]}), "malformed message")
    reject(_enc({**fields_of(fake.forge()), "request_ids": "evil"}), "malformed message")
    reject(_enc({**fields_of(fake.forge()), "rows": 2.5}), "malformed message")

    second = fake.write(1, [("good-a", 3, 2), ("good-c", 0, 4)])
    announce(second)

    # -- several chunks in one message: the good ones taken, each bad one rejected alone
    together = [fake.write(2, [("good-e", 0, 2)]), fake.write(3, [("good-e", 2, 3)])]
    inside = [
        (fake.forge(seq=first.seq), r"Chunk\.seq"),
        (RequestFinished(v=V, request_id="good-e", reason="finished"), "only chunks travel together"),
        (fake.forge(v=V + 1), "protocol version"),
        ({"type": "chunk", "v": V}, "malformed message"),
    ]
    parts = [msgspec.Raw(protocol.encode(c)) for c in together]
    parts += [msgspec.Raw(protocol.encode(m) if isinstance(m, protocol.Message) else _enc(m)) for m, _ in inside]
    fake.send(protocol.Announcements(v=V, chunks=parts))
    hostile.extend(reason for _, reason in inside)
    for chunk in together:
        valid.append((chunk.slot, chunk.seq))
        assert fake.next_release() == (chunk.slot, chunk.seq)

    # -- chunks that would read outside their slot or whose metadata does not add up
    two = protocol.pack_rows(np.arange(2))
    nine = protocol.pack_rows(np.arange(9))
    for slot in (NUM_SLOTS, -1, 2**40):
        reject(fake.forge(slot=slot, offset=slot * SLOT_BYTES), r"Chunk\.slot")
    reject(fake.forge(slot=2**63 - 1, offset=0), r"Chunk\.slot")
    for slot, offset in ((1, SLOT_BYTES + PLANE_ROW), (1, 0), (0, -1), (0, -SLOT_BYTES), (0, 2**63 - 1)):
        reject(fake.forge(slot=slot, offset=offset), r"Chunk\.offset")
    reject(fake.forge(rows=9, nbytes=9 * ROW_BYTES, request_rows=[9], positions=nine, token_ids=nine), r"Chunk\.nbytes")
    reject(fake.forge(nbytes=2 * SLOT_BYTES), r"Chunk\.nbytes")
    reject(fake.forge(nbytes=3 * ROW_BYTES), r"Chunk\.nbytes")
    reject(fake.forge(nbytes=2 * ROW_BYTES - 1), r"Chunk\.nbytes")
    reject(fake.forge(row_stride=ROWS_PER_SLOT + 1, nbytes=(ROWS_PER_SLOT + 1) * ROW_BYTES), r"Chunk\.nbytes")
    reject(fake.forge(row_stride=1, nbytes=ROW_BYTES), r"Chunk\.rows")
    reject(fake.forge(rows=0, nbytes=0, request_ids=[], request_rows=[], positions=b"", token_ids=b""), r"Chunk\.rows")
    reject(fake.forge(rows=-3, nbytes=-3 * ROW_BYTES, request_rows=[-3]), r"Chunk\.rows")
    reject(fake.forge(request_rows=[1]), r"Chunk\.request_rows")
    reject(fake.forge(request_ids=["evil", "evil-2"]), r"Chunk\.request_rows")
    reject(fake.forge(request_ids=["evil", "evil-2"], request_rows=[3, -1]), r"Chunk\.request_rows")
    reject(fake.forge(request_ids=["evil", "evil-2"], request_rows=[2, 0]), r"Chunk\.request_rows")
    reject(fake.forge(positions=protocol.pack_rows(np.arange(3))), r"Chunk\.positions")
    reject(fake.forge(positions=b""), r"Chunk\.positions")
    reject(fake.forge(positions=two[:-1]), r"Chunk\.positions")
    reject(fake.forge(token_ids=b"\x01"), r"Chunk\.token_ids")
    # -- replayed and out-of-order sequence numbers (well formed otherwise)
    reject(fake.forge(seq=second.seq), r"Chunk\.seq")
    reject(fake.forge(seq=first.seq), r"Chunk\.seq")
    reject(fake.forge(seq=fake.seq), r"Chunk\.seq")  # the last seq a (rejected) chunk used
    reject(fake.forge(seq=-5), r"Chunk\.seq")
    reject(Chunk(**{**msgspec.structs.asdict(second), "request_ids": ["evil"], "request_rows": [6]}), r"Chunk\.seq")

    third = fake.write(2, [("good-b", 2, 1)], row_stride=ROWS_PER_SLOT)  # a graph-style padded slot
    announce(third)

    # -- layouts naming a ring that is no ring of ours, or unusable; the attached run must go on
    def layout(**overrides: Any) -> Layout:
        return fake.layout(run_id=uuid.uuid4().hex[:16], **overrides)

    ring = fake.ring.describe()
    passwd = Path("/etc/passwd")
    stranger = SHM_DIR / f"not-hscapture-{uuid.uuid4().hex[:8]}"
    stranger.write_bytes(b"\x00" * ring["nbytes"])
    try:
        for path, size in ((passwd, passwd.stat().st_size), (Path("/dev/shm/../etc/passwd"), passwd.stat().st_size)):
            reject(layout(ring={"backend": "host", "path": str(path), "nbytes": size}), r"Layout\.ring")
        reject(layout(ring={**ring, "path": str(stranger)}), r"Layout\.ring")
        reject(layout(ring={**ring, "path": f"{SHM_DIR}/hscapture-{uuid.uuid4().hex}.ring"}), r"Layout\.ring")
        reject(layout(ring={**ring, "path": f"{SHM_DIR}/hscapture-x/../../etc/passwd"}), r"Layout\.ring")
        reject(layout(ring={**ring, "nbytes": ring["nbytes"] + 1}), r"Layout\.ring")
        reject(layout(ring={**ring, "nbytes": ring["nbytes"] - SLOT_BYTES}), r"Layout\.ring")
        reject(layout(ring={**ring, "nbytes": str(ring["nbytes"])}), r"Layout\.ring")
        reject(layout(ring={"backend": "host", "path": ring["path"]}), r"Layout\.ring")
        reject(layout(ring={**ring, "path": 5}), r"Layout\.ring")
        reject(layout(ring={**ring, "backend": "nfs"}), r"Layout\.ring\.backend")
        reject(layout(ring={}), r"Layout\.ring\.backend")
        reject(layout(dtype="int8"), "Layout: unusable ring")
        reject(layout(num_slots=0), "Layout: unusable ring")
        reject(layout(slot_bytes=-SLOT_BYTES), "Layout: unusable ring")
        reject(layout(tensor_names=[], tensor_descriptions=[]), r"Layout\.tensor_names")
        reject(layout(tensor_descriptions=["only one"]), r"Layout\.tensor_names")
        reject(layout(v=V + 1), "protocol version")
        reject(_enc({**fields_of(layout()), "ring": [1, 2]}), "malformed message")
        reject(_enc({**fields_of(layout()), "num_slots": None}), "malformed message")
        # Not for us, or a repeat of ours: ignored without a word (not rejections).
        fake.send(layout(consumer_id="someone-else", ring={"backend": "host", "path": str(passwd), "nbytes": 1}))
        fake.send(fake.layout(ring={"backend": "host", "path": str(passwd), "nbytes": 1}))
        fake.send(EndOfStream(v=V, run_id="another-run"))
        # The end of our own stream, but in another protocol version: must not end it.
        reject(EndOfStream(v=V + 1, run_id=fake.run_id), "protocol version")
        reject(RequestFinished(v=0, request_id="good-a", reason="finished"), "protocol version")
        reject(
            _enc({"type": "finished", "v": V, "request_id": "good-a", "reason": "x", "loss_mask": [[1]]}), "malformed"
        )
        reject(_enc({"type": "finished", "v": V, "request_id": 7, "reason": "x"}), "malformed message")

        fourth = fake.write(3, [("good-c", 4, ROWS_PER_SLOT)])  # a full slot
        announce(fourth)
        fifth = fake.write(0, [("good-d", 0, 5)])  # slot 0 again, after its release
        announce(fifth)
    finally:
        stranger.unlink()

    fake.send(RequestFinished(v=V, request_id="good-a", reason="finished", num_tokens=5, loss_mask=[(1, 5)]))
    fake.send(RequestFinished(v=V, request_id="good-b", reason="finished", num_tokens=3))
    fake.send(RequestFinished(v=V, request_id="good-d", reason="aborted", num_tokens=5))
    fake.send(EndOfStream(v=V, run_id=fake.run_id, counters={"rows_captured": 20}))
    assert consumer.process.wait(30) == 0, consumer.stderr()[-3000:]

    fake.consumer = None  # it has exited: read what it left
    while (message := fake.receive(0.2)) is not None:  # after the end: hellos at most, no release
        assert isinstance(message, Hello), message
    assert valid == [(c.slot, c.seq) for c in (first, second, *together, third, fourth, fifth)]

    stderr = consumer.stderr()
    assert "Traceback" not in stderr, stderr[-3000:]
    reasons = announce_rejections(consumer)
    assert len(reasons) == len(hostile), stderr[-3000:]
    for expected, reason in zip(hostile, reasons):
        assert re.search(expected, reason), f"expected /{expected}/, logged {reason[:300]!r}"
    stats = done_stats(consumer)
    assert stats["messages_rejected"] == len(hostile)
    assert stats["chunks"] == len(valid) and stats["rows"] == sum(len(r) for r in fake.rows.values())
    assert stats["runs"] == 1 and stats["end_of_streams"] == 1

    records = check_consumer_store(consumer.out, fake)
    assert records["good-a"]["status"] == "complete" and records["good-b"]["status"] == "complete"
    assert records["good-c"]["status"] == "incomplete" and "end of stream" in records["good-c"]["reason"]
    assert records["good-d"]["status"] == "incomplete" and records["good-d"]["reason"] == "aborted"
    runs = open_store(consumer.out).metadata()["runs"]
    assert [run["run_id"] for run in runs] == [fake.run_id] and runs[0]["end"]["reason"] == "end of stream"


def _survives(fake: FakeProducer, consumer: LoggedConsumer, *run_ids: str) -> None:
    """End every run the consumer may be on; it must exit 0 without a traceback."""
    for run_id in run_ids:
        if consumer.process.poll() is None:
            fake.send(EndOfStream(v=V, run_id=run_id))
    code = consumer.process.wait(15)
    assert code == 0 and "Traceback" not in consumer.stderr(), consumer.stderr()[-3000:]


def test_consumer_survives_a_layout_with_a_pid_beyond_pid_t(
    fake_producer: FakeProducer, endpoint: str, live_consumer: Callable[..., LoggedConsumer]
) -> None:
    fake = fake_producer
    consumer = live_consumer(endpoint)
    fake.handshake(consumer)
    hostile = fake.layout(run_id="hostile-run", pid=2**40)  # the same, valid ring: only the pid is absurd
    fake.send(hostile)
    _survives(fake, consumer, fake.run_id, hostile.run_id)


def test_consumer_survives_a_first_layout_with_zero_hidden_size(
    fake_producer: FakeProducer, endpoint: str, live_consumer: Callable[..., LoggedConsumer]
) -> None:
    fake = fake_producer
    consumer = live_consumer(endpoint)
    fake.first_hello(consumer)
    fake.send(fake.layout(run_id="zero-width", hidden_size=0))
    fake.handshake(consumer)  # the consumer is still there and takes a proper layout
    _survives(fake, consumer, fake.run_id)


def test_a_layout_larger_than_its_ring_is_refused_before_any_row_is_read(
    fake_producer: FakeProducer, endpoint: str, live_consumer: Callable[..., LoggedConsumer]
) -> None:
    fake = fake_producer
    consumer = live_consumer(endpoint, "--shard-bytes", str(4 * ROW_BYTES))  # 4 rows per shard
    # The ring holds 4 * 3072 = 12288 bytes; the layout claims 3 slots of 5120 (= 15360 bytes).
    fake.first_hello(consumer)
    fake.send(fake.layout(run_id="too-big", num_slots=3, slot_bytes=5120))
    # Slot 2 starts at 10240: of 6 rows, planes 0 and 1 and the first 4 rows of plane 2 lie inside the ring.
    fake.send(
        fake.forge(
            slot=2,
            offset=2 * 5120,
            rows=6,
            nbytes=6 * ROW_BYTES,
            request_rows=[6],
            positions=protocol.pack_rows(np.arange(6)),
            token_ids=protocol.pack_rows(np.arange(6)),
        )
    )
    fake.handshake(consumer)  # still there, and takes a proper layout
    _survives(fake, consumer, fake.run_id)
    rejections = announce_rejections(consumer)
    assert len(rejections) == 1 and "do not fit the ring" in rejections[0], rejections  # the layout itself
    assert not (consumer.out / "meta.json").exists() or "evil" not in open_store(consumer.out)


def _ring_lookalike(kind: str, tmp_path: Path, nbytes: int) -> tuple[Path, int]:
    """A path in /dev/shm named like a ring that is not a regular file of ours with ring contents."""
    path = SHM_DIR / f"hscapture-{os.getuid()}-hostile-{kind}-{uuid.uuid4().hex[:8]}.ring"
    if kind == "empty":
        path.write_bytes(b"")
        return path, 0
    if kind == "directory":
        path.mkdir()
        return path, path.stat().st_size
    if kind == "fifo":
        os.mkfifo(path)
        return path, 0
    secret = tmp_path / "secret"  # kind == "symlink": a file outside /dev/shm
    secret.write_bytes(b"secret!\n" * (nbytes // 8))
    path.symlink_to(secret)
    return path, nbytes


@pytest.mark.parametrize("kind", ["symlink", "empty", "directory", "fifo"])
def test_consumer_rejects_a_layout_naming_a_ring_lookalike(
    kind: str, tmp_path: Path, fake_producer: FakeProducer, endpoint: str, live_consumer: Callable[..., LoggedConsumer]
) -> None:
    fake = fake_producer
    path, nbytes = _ring_lookalike(kind, tmp_path, fake.ring.describe()["nbytes"])
    try:
        consumer = live_consumer(endpoint)
        fake.first_hello(consumer)
        lookalike = {"backend": "host", "path": str(path), "nbytes": nbytes}
        fake.send(fake.layout(run_id=f"lookalike-{kind}", ring=lookalike))
        fake.handshake(consumer)  # a proper layout after it: taken, so the consumer is alive, not stuck
        _survives(fake, consumer, fake.run_id)
        assert [r for r in announce_rejections(consumer) if r.startswith("Layout.ring")], consumer.stderr()[-2000:]
        assert f"lookalike-{kind}" not in [run["run_id"] for run in open_store(consumer.out).metadata()["runs"]]
    finally:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()


def test_consumer_survives_a_layout_with_a_forged_cuda_handle(
    fake_producer: FakeProducer, endpoint: str, live_consumer: Callable[..., LoggedConsumer]
) -> None:
    fake = fake_producer
    consumer = live_consumer(endpoint)
    fake.handshake(consumer)
    forged = {"backend": "cuda", "handle": b"\x00" * 64, "events": [b"\x01" * 64] * NUM_SLOTS, "nbytes": 1 << 21}
    fake.send(fake.layout(run_id="forged-cuda", ring={**forged, "device_uuid": "GPU-00000000"}))
    _survives(fake, consumer, fake.run_id)


def test_consumer_stops_cleanly_on_sigterm_after_hostile_garbage(
    fake_producer: FakeProducer, endpoint: str, live_consumer: Callable[..., LoggedConsumer]
) -> None:
    """Garbage before any layout is rejected too, and a consumer never attached still finishes on SIGTERM."""
    fake = fake_producer
    consumer = live_consumer(endpoint)
    fake.first_hello(consumer)
    rng = random.Random(99)
    garbage = [rng.randbytes(rng.randrange(1, 200)) for _ in range(50)]
    for data in garbage:
        with pytest.raises(ProtocolError):
            protocol.decode_to_consumer(data)
        fake.send(data)
    fake.send(EndOfStream(v=V, run_id=""))  # no run yet: not ours
    deadline = time.monotonic() + 10
    while len(announce_rejections(consumer)) < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    consumer.process.send_signal(signal.SIGTERM)
    assert consumer.process.wait(15) == 0
    assert len(announce_rejections(consumer)) == 50 and done_stats(consumer)["messages_rejected"] == 50
    assert done_stats(consumer)["runs"] == 0
