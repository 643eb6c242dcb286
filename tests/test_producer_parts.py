"""The producer's parts alone, without a socket or a second process: the slot ledger, the announcer, the consumer
session, the step checks, the row copier, and the engine-facing base class."""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import zmq

from hscapture import protocol
from hscapture.errors import CreditTimeout, ProtocolError
from hscapture.ownership import process_place
from hscapture.producer import EngineProducer, NullProducer, WrittenStep
from hscapture.producer.announcer import FLUSH_CHUNKS, Announcer
from hscapture.producer.base import ProducerCounters
from hscapture.producer.checks import StepChecks, as_int64
from hscapture.producer.copier import RowCopier
from hscapture.producer.ledger import SlotLedger
from hscapture.producer.link import ConsumerLink
from hscapture.producer.service import ServiceThread
from hscapture.producer.session import TAKEOVER_MIN_S, ConsumerSession
from tests.workload import HIDDEN, NUM_TENSORS, make_config

V = protocol.PROTOCOL_VERSION


# ---------------------------------------------------------------------------------------------- ledger


def test_the_ledger_frees_a_slot_only_for_the_consumer_and_seq_it_was_announced_with() -> None:
    ledger = SlotLedger(3)
    assert [ledger.take(), ledger.take(), ledger.take(), ledger.take()] == [0, 1, 2, None]
    for slot in (0, 1, 2):
        ledger.write(slot, 8)
        ledger.hold(slot)
    ledger.announced(0, 1, 8, b"zero", "c1")
    ledger.announced(1, 2, 8, b"one", "c1")
    ledger.give_back(2)  # its chunk could not be sent
    assert list(ledger.free) == [2] and ledger.held == set() and set(ledger.in_flight) == {0, 1}
    freed, bad = ledger.release("c2", [(0, 1)])  # another consumer's release
    assert (freed, bad) == (0, [(0, 1)])
    freed, bad = ledger.release("c1", [(0, 7), (1, 2), (1, 2), (9, 1)])  # a wrong seq, a repeat, no such slot
    assert (freed, bad) == (1, [(0, 7), (1, 2), (9, 1)])
    assert list(ledger.free) == [2, 1] and set(ledger.in_flight) == {0}


def test_a_consumer_taking_over_is_handed_the_slots_in_flight_oldest_first() -> None:
    ledger = SlotLedger(4)
    for slot, seq in ((2, 5), (0, 3), (1, 4)):
        assert ledger.take() is not None
        ledger.write(slot, 1)
        ledger.hold(slot)
        ledger.announced(slot, seq, 1, f"s{seq}".encode(), "old" if seq != 4 else "new")
    assert [f.seq for f in ledger.hand_over("new")] == [3, 5]  # slot 1 was announced to "new" already
    assert ledger.running_low is True  # 1 free of 4


def test_the_ledger_counts_what_was_written_and_never_announced() -> None:
    ledger = SlotLedger(2)
    ledger.write(ledger.take(), 5)  # type: ignore[arg-type]
    ledger.write(ledger.take(), 3)  # type: ignore[arg-type]
    assert ledger.drop_written() == (8, 2) and not ledger.written


# ---------------------------------------------------------------------------------------------- announcer


def announcer(rows_per_slot: int = 8) -> tuple[Announcer, StepChecks]:
    config = make_config("ipc:///tmp/unused", rows_per_slot=rows_per_slot)
    checks = StepChecks(config)
    return Announcer(config.slot_bytes, config.row_bytes, checks), checks


def test_held_chunks_go_out_as_one_message_in_seq_order_each_decodable_alone() -> None:
    ann, _ = announcer()
    rows = np.arange(3, dtype=np.int64)
    for slot in (2, 0, 1):
        ann.hold(
            slot, 3, 0, ["a"], [3], rows.tobytes(), (rows + 100).tobytes(), step=slot, dropped_rows=4, slots_in_flight=1
        )
    payload, held = ann.take()  # type: ignore[misc]
    assert ann.take() is None and not ann.held
    message = protocol.decode_to_consumer(payload)
    assert isinstance(message, protocol.Announcements)
    chunks = [protocol.decode_to_consumer(bytes(raw)) for raw in message.chunks]
    assert [c.seq for c in chunks] == [1, 2, 3] and [c.slot for c in chunks] == [2, 0, 1]  # type: ignore[union-attr]
    assert [h.payload for h in held] == [bytes(raw) for raw in message.chunks]
    first = chunks[0]
    assert isinstance(first, protocol.Chunk)
    assert (first.ring_slots_used, first.dropped_rows, first.rows) == (2, 4, 3)
    assert protocol.unpack_rows(first.token_ids, 3, "token_ids").tolist() == [100, 101, 102]


def test_a_lone_held_chunk_is_sent_as_itself_and_owners_given_as_tuples_are_encoded_once() -> None:
    ann, checks = announcer()
    owners = (("a", "b"), (1, 1))
    assert checks.owned_rows(*owners) == 2
    rows = np.array([4, 9], dtype=np.int64).tobytes()
    ann.hold(0, 2, 8, *owners, rows, rows, step=1, dropped_rows=0, slots_in_flight=0)
    payload, _ = ann.take()  # type: ignore[misc]
    chunk = protocol.decode_to_consumer(payload)
    assert isinstance(chunk, protocol.Chunk)
    assert (chunk.request_ids, chunk.request_rows, chunk.row_stride) == (["a", "b"], [1, 1], 8)
    assert chunk.nbytes == 8 * NUM_TENSORS * HIDDEN * 4  # the planes' whole stride


def test_a_runs_owners_are_listed_when_its_chunk_is_encoded_not_when_it_is_held() -> None:
    """A run's steps join its slot as references to their owner tuples; its chunk lists them all, in row order."""
    ann, checks = announcer()
    first = (("a", "b"), (1, 1))
    checks.owned_rows(*first)  # the engine's owners, encoded once: a run must not send only these
    joined = [first, (("a", "b"), (1, 1)), (("c",), (2,))]
    rows = np.arange(8, dtype=np.int64)
    ann.hold(
        3,
        8,
        8,
        *first,
        [rows.tobytes()],
        [(rows + 10).tobytes()],
        step=4,
        dropped_rows=0,
        slots_in_flight=0,
        joined=joined,
    )
    held = ann.held[0]
    assert held.owners() == (["a", "b", "a", "b", "a", "b", "c"], [1, 1, 1, 1, 1, 1, 2])
    chunk = protocol.decode_to_consumer(ann.take()[0])  # type: ignore[index]
    assert isinstance(chunk, protocol.Chunk)
    assert (chunk.request_ids, chunk.request_rows) == held.owners()
    assert protocol.unpack_rows(chunk.positions, 8, "positions").tolist() == list(range(8))


def test_a_held_chunk_is_encoded_when_taken_from_what_it_was_given_and_put_back_keeps_seq_order() -> None:
    """The engine's thread only holds a chunk; the service thread encodes it when it takes it, from the pieces the
    run kept, and a chunk ``block`` could not send is held again before those held since."""
    ann, _ = announcer()
    pieces = [np.array([5], dtype=np.int64).tobytes(), np.array([6], dtype=np.int64).tobytes()]
    tokens = [np.array([105], dtype=np.int64).tobytes(), np.array([106], dtype=np.int64).tobytes()]
    ann.hold(0, 2, 8, ["a"], [2], pieces, tokens, step=1, dropped_rows=0, slots_in_flight=0)
    assert ann.held[0].payload == b""  # nothing encoded on the engine's thread
    for slot in range(1, FLUSH_CHUNKS):
        assert not ann.full
        ann.hold(slot, 1, 0, ["a"], [1], pieces[0], pieces[0], step=1, dropped_rows=0, slots_in_flight=0)
    assert ann.full
    _, held = ann.take()  # type: ignore[misc]
    first = protocol.decode_to_consumer(held[0].payload)
    assert isinstance(first, protocol.Chunk)
    assert protocol.unpack_rows(first.positions, 2, "positions").tolist() == [5, 6]
    assert protocol.unpack_rows(first.token_ids, 2, "token_ids").tolist() == [105, 106]
    ann.hold(7, 1, 0, ["a"], [1], pieces[0], pieces[0], step=2, dropped_rows=0, slots_in_flight=0)
    ann.put_back(held[:2])
    payload, again = ann.take()  # type: ignore[misc]
    assert [h.seq for h in again] == [1, 2, FLUSH_CHUNKS + 1]
    assert again[0].payload == held[0].payload  # made once: byte for byte what a consumer taking over gets again
    message = protocol.decode_to_consumer(payload)
    assert isinstance(message, protocol.Announcements) and len(message.chunks) == 3


# ---------------------------------------------------------------------------------------------- service thread


class Turns:
    """A producer's turn as the service thread sees it: counts calls, says when to stop."""

    def __init__(self, wait_s: float = 3600.0) -> None:
        self.calls = 0
        self.stop = False
        self.seen = threading.Event()
        self.wait_s = wait_s  # by default: until woken

    def turn(self) -> float:
        self.calls += 1
        self.seen.set()
        return -1.0 if self.stop else self.wait_s


def service_threads() -> int:
    return sum(t.name == "hscapture-producer" for t in threading.enumerate())


def wait_for(what: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + 30
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_the_service_thread_turns_when_woken_and_ends_when_its_turn_says_or_its_producer_is_gone() -> None:
    before = service_threads()
    turns = Turns()
    service = ServiceThread(turns.turn)
    assert turns.seen.wait(30), "no first turn"  # after SERVICE_S, by itself
    turns.seen.clear()
    service.wake()
    assert turns.seen.wait(30) and turns.calls == 2, "woken, it did not turn"
    turns.stop = True
    service.stop()
    assert wait_for(lambda: service_threads() == before) and turns.calls == 3
    gone = Turns(wait_s=0.01)  # a producer's turn asks for the next within IDLE_S at most
    ServiceThread(gone.turn)  # held weakly: once its owner is dropped, the next turn finds nobody
    assert gone.seen.wait(30)
    del gone
    gc.collect()
    assert wait_for(lambda: service_threads() == before), "a thread outlived its producer"


# ---------------------------------------------------------------------------------------------- session


class Wire:
    """What the session sends, by peer; peers in ``down`` cannot be sent to (their connection is not up)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.down: set[str] = set()

    def send(self, peer: str, payload: bytes) -> bool:
        if peer in self.down:
            return False
        self.sent.append((peer, payload))
        return True

    def to(self, peer: str) -> list[protocol.Message]:
        return [protocol.decode_to_consumer(p) for who, p in self.sent if who == peer]


def session(token: str = "t" * 32) -> tuple[ConsumerSession, SlotLedger, Wire, ProducerCounters]:
    ledger, wire, counters = SlotLedger(4), Wire(), ProducerCounters()

    def layout(consumer_id: str) -> bytes:
        return protocol.encode(protocol.Refused(v=V, consumer_id=consumer_id, reason="layout stand-in"))

    run = ConsumerSession(
        run_id="run1", token=token, endpoint="ipc:///x", layout=layout, send=wire.send, ledger=ledger, counters=counters
    )
    return run, ledger, wire, counters


def hello(consumer_id: str, run_id: str = "", token: str = "t" * 32, pid: int = 0, beat_ms: int = 50) -> protocol.Hello:
    return protocol.Hello(
        v=V, consumer_id=consumer_id, run_id=run_id, token=token, pid=pid, place=process_place(), heartbeat_ms=beat_ms
    )


def in_flight(ledger: SlotLedger, slot: int, seq: int, consumer: str) -> None:
    assert ledger.take() is not None
    ledger.write(slot, 1)
    ledger.hold(slot)
    ledger.announced(slot, seq, 1, f"chunk {seq}".encode(), consumer)


def test_a_consumer_gets_the_layout_and_no_chunk_until_it_confirms() -> None:
    run, _, wire, counters = session()
    run.on_hello(hello("c1"))
    assert run.offered == "c1" and run.attached is None
    assert not run.send(b"chunk")  # nothing but the layout before it confirms
    run.on_hello(hello("c1", run_id="run1"))
    assert run.attached == "c1" and counters.attaches == 1
    assert run.send(b"chunk") and wire.sent[-1] == ("c1", b"chunk")


def test_a_wrong_token_is_refused_and_nothing_is_sent() -> None:
    run, _, wire, _ = session()
    with pytest.raises(ProtocolError, match="gave a wrong token"):
        run.on_hello(hello("stray", token="x" * 32))
    assert not wire.sent and run.offered is None


def test_a_second_consumer_is_refused_while_the_first_is_alive_and_takes_over_once_it_is_gone() -> None:
    run, ledger, wire, counters = session()
    run.on_hello(hello("c1", beat_ms=1))
    run.on_hello(hello("c1", run_id="run1", beat_ms=1))
    in_flight(ledger, 0, 1, "c1")
    in_flight(ledger, 1, 2, "c1")
    run.on_hello(hello("c2"))
    refusal = wire.to("c2")[-1]
    assert isinstance(refusal, protocol.Refused) and "consumer 'c1' is attached" in refusal.reason
    assert counters.consumers_refused == 1 and run.attached == "c1"
    time.sleep(TAKEOVER_MIN_S + 0.1)  # c1 silent past the takeover time (its pid is not watched: 0)
    run.on_hello(hello("c2"))
    assert run.offered == "c2" and run.attached is None
    run.on_hello(hello("c2", run_id="run1"))
    assert run.attached == "c2"
    assert [p for who, p in wire.sent if who == "c2"][-2:] == [b"chunk 1", b"chunk 2"]  # in flight, oldest first
    assert {f.consumer for f in ledger.in_flight.values()} == {"c2"}
    with pytest.raises(ProtocolError, match="stale or forged"):
        run.on_release(protocol.Release(v=V, consumer_id="c1", slot=0, seq=1))  # c1 no longer frees it
    run.on_release(protocol.Release(v=V, consumer_id="c2", slot=0, seq=1, more=[(1, 2)]))
    assert not ledger.in_flight


def test_a_consumer_whose_process_ended_is_replaced_at_once() -> None:
    run, _, _, _ = session()
    process = subprocess.Popen(["sleep", "60"])  # stands in for the first consumer's process on this host
    try:
        run.on_hello(hello("c1", pid=process.pid))
        run.on_hello(hello("c1", run_id="run1", pid=process.pid))
        run.on_hello(hello("c2"))
        assert run.attached == "c1"  # alive: refused
    finally:
        process.kill()
        process.wait()
    run.on_hello(hello("c2"))  # well within the takeover time, but its process is gone
    assert run.offered == "c2"


def test_a_confirmation_cut_short_leaves_no_consumer_attached() -> None:
    run, ledger, wire, _ = session()
    in_flight(ledger, 0, 1, "gone")
    wire.down.add("c1")
    run.on_hello(hello("c1", run_id="run1"))  # attached to us before: confirms at once, but its connection is down
    assert run.attached is None and ledger.in_flight[0].consumer == "gone"


# ---------------------------------------------------------------------------------------------- link


@pytest.fixture
def link_pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A control socket (PULL, as the producer's) and a consumer's PUSH into it, in this process."""
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.bind("inproc://control")
    push.connect("inproc://control")
    yield pull, push
    push.close(linger=0)
    pull.close(linger=0)
    context.term()


def test_the_link_hands_hellos_and_releases_to_the_session_and_counts_what_does_not_decode(
    link_pair: tuple[zmq.Socket, zmq.Socket], caplog: pytest.LogCaptureFixture
) -> None:
    pull, push = link_pair
    run, ledger, wire, counters = session()
    link = ConsumerLink(pull, run, make_config("ipc:///x", policy="drop"), counters)
    assert not link.send(b"chunk") and not wire.sent, "drop: no consumer attached, no wait"
    push.send(protocol.encode(hello("c1")))
    push.send(b"\x93not a message")
    push.send(protocol.encode(hello("c1", run_id="run1")))
    assert link.wait(5000)
    while run.attached is None:
        link.wait(100)
    assert run.attached == "c1" and counters.messages_rejected == 1
    assert "rejected message on release socket" in caplog.text
    in_flight(ledger, 0, 1, "c1")
    push.send(protocol.encode(protocol.Release(v=V, consumer_id="c1", slot=0, seq=1)))
    while ledger.in_flight:
        link.wait(100)
    assert list(ledger.free)[-1] == 0 and link.send(b"chunk") and wire.sent[-1] == ("c1", b"chunk")


def test_a_block_wait_ends_when_ready_when_its_watchdog_raises_or_at_its_timeout(
    link_pair: tuple[zmq.Socket, zmq.Socket],
) -> None:
    pull, _ = link_pair
    run, _, _, counters = session()
    link = ConsumerLink(pull, run, make_config("ipc:///x", policy="block"), counters)
    turns = iter(range(3))
    link.wait_until(lambda: next(turns) == 2, "a free ring slot")
    assert counters.credit_waits == 1 and counters.credit_wait_us >= 2 * 20_000 * 0.9  # two polls of POLL_MS

    def watchdog() -> None:
        raise RuntimeError("the consumer process exited")

    watched = ConsumerLink(pull, run, make_config("ipc:///x", policy="block"), counters, watchdog)
    with pytest.raises(RuntimeError, match="consumer process exited"):
        watched.send(b"chunk")  # nobody attached: it waits, and the watchdog stops it
    config = dataclasses.replace(make_config("ipc:///x", policy="block"), block_timeout_s=0.05)
    with pytest.raises(CreditTimeout, match=r"for a consumer to send to \(block_timeout_s=0.05\); is `hscapture con"):
        ConsumerLink(pull, run, config, counters).send(b"chunk")
    assert counters.credit_waits == 3


# ---------------------------------------------------------------------------------------------- checks


def test_a_step_is_checked_once_while_its_owner_tuples_and_shapes_stay() -> None:
    checks = StepChecks(make_config("ipc:///tmp/unused"))
    states = [torch.zeros(2, HIDDEN) for _ in range(NUM_TENSORS)]
    owners = (("a", "b"), (1, 1))
    assert checks.step(states, *owners, None) == (2, (1,) * NUM_TENSORS)
    assert checks.same_owners(*owners)
    wrong = [torch.zeros(2, HIDDEN + 1), *states[1:]]
    with pytest.raises(ValueError, match=rf"states\[layer_1\]: planned \[2, {HIDDEN}\], got \[2, {HIDDEN + 1}\]"):
        checks.step(wrong, *owners, None)  # same owners, other shapes: checked again
    with pytest.raises(ValueError, match="planned dtype float32, got bfloat16"):
        checks.step([s.bfloat16() for s in states], *owners, None)
    with pytest.raises(ValueError, match=r"2 request ids with rows summing to 3, but the step keeps 2 rows"):
        checks.step(states, ("a", "b"), (1, 2), None)
    with pytest.raises(ValueError, match="every request owns at least one row"):
        checks.step(states, ["a", "b"], [2, 0], None)
    with pytest.raises(ValueError, match="max_step_rows=32, got 33"):
        checks.step([torch.zeros(33, HIDDEN)] * NUM_TENSORS, ["a"], [33], None)
    side_by_side = [torch.zeros(2, (NUM_TENSORS - 1) * HIDDEN), states[-1]]
    assert checks.step(side_by_side, ["a"], [2], None) == (2, (NUM_TENSORS - 1, 1))


def test_host_values_are_taken_as_int64_and_device_values_refused() -> None:
    given = np.arange(3, dtype=np.int64)
    assert as_int64(given, 3, "positions") is given
    assert as_int64([1, 2, 3], 3, "positions").dtype == np.int64
    big_endian = np.arange(3, dtype=">i8")  # equal values, other bytes: taken as the wire's little-endian ones
    assert as_int64(big_endian, 3, "positions").tobytes() == given.tobytes() == protocol.pack_rows(given)
    assert as_int64(given.reshape(3, 1), 3, "positions").tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"positions: planned 2 values \(one per kept row\), got 3"):
        as_int64(given, 2, "positions")
    with pytest.raises(ValueError, match=r"positions: planned 3 values \(one per kept row\), got 2"):
        as_int64([1, 2], 3, "positions")
    with pytest.raises(ValueError, match="token_ids: a tensor on meta; reading it here would make the host wait"):
        as_int64(torch.arange(3, device="meta"), 3, "token_ids")


# ---------------------------------------------------------------------------------------------- copier


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu])])
@pytest.mark.parametrize("spans", [(2, 1), (1, 2), (3,), (1, 1, 1)])
def test_a_slot_written_in_one_launch_holds_each_tensors_plane(device: str, spans: tuple[int, ...]) -> None:
    """Side-by-side states go into a slot by one ``torch.cat`` (or the row kernel), separate ones by one
    ``torch.stack``: the slot holds each tensor's rows plane after plane, as one copy per tensor leaves them. For a
    whole step, a slot's part of a step, states whose rows are wider than their values, rows picked by an index, and
    rows added after others in planes of a decode run's stride."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    assert sum(spans) == NUM_TENSORS
    slot_elements = NUM_TENSORS * 16 * HIDDEN
    ring = torch.zeros(2 * slot_elements, device=device)
    slots = [ring[i * slot_elements : (i + 1) * slot_elements] for i in range(2)]
    copier = RowCopier(slots, slot_elements * 4, HIDDEN, NUM_TENSORS, lambda: 0, graph_wait_s=1.0)
    tensors = torch.randn(NUM_TENSORS, 12, HIDDEN, generator=torch.Generator().manual_seed(7)).to(device)
    firsts = [sum(spans[:i]) for i in range(len(spans))]
    states = [torch.cat(list(tensors[t : t + k]), dim=1) for t, k in zip(firsts, spans)]
    wide = [torch.cat([state, state[:, :3]], dim=1)[:, : state.shape[1]] for state in states]
    index = torch.tensor([11, 0, 5, 6, 2, 9, 3, 1], device=device)
    cases = [  # states, row_index, begin, the rows the slot must hold
        ([state[:8] for state in states], None, 0, slice(0, 8)),
        (states, None, 4, slice(4, 12)),
        (wide, None, 2, slice(2, 10)),
        (states, index, 0, index),
    ]
    for slot in (0, 1, 0):
        for given, row_index, begin, want in cases:
            slots[slot].zero_()
            assert copier.write(slot, given, spans, row_index, begin, 8) is False  # no graph replay wrote them
            planes = slots[slot][: NUM_TENSORS * 8 * HIDDEN].view(NUM_TENSORS, 8, HIDDEN)
            assert torch.equal(planes, tensors[:, want]), (slot, begin, row_index)
    slots[1].zero_()
    copier.write(1, [s[:5] for s in states], spans, None, 0, 5, 0, 16)  # a decode run: planes of 16 rows
    copier.write(1, [s[5:8] for s in states], spans, None, 0, 3, 5, 16)
    assert torch.equal(slots[1].view(NUM_TENSORS, 16, HIDDEN)[:, :8], tensors[:, :8])
    copier.close()


# ---------------------------------------------------------------------------------------------- the base class


def test_every_producer_implements_the_whole_engine_facing_api() -> None:
    class Partial(EngineProducer):
        def capture_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return 0

    with pytest.raises(TypeError, match="abstract"):
        Partial()  # type: ignore[abstract]
    null = NullProducer()
    states = [torch.zeros(4, HIDDEN)] * NUM_TENSORS
    step = null.write_step(states, ["a", "b"], [1, 3], extendable=True)
    assert isinstance(step, WrittenStep) and (step.rows, step.written) == (4, 0)
    assert null.extend_step(step, states, ["a", "b"], [1, 3]) is False
    assert null.announce_step(step, [0, 0, 1, 2], [1, 2, 3, 4]) == 0
    assert null.capture_step(states, ["a"], [4], [0, 1, 2, 3], [1, 2, 3, 4]) == 0
    assert null.graph_rows() is None and null.attached is False
    null.finish_request("a", num_tokens=4)
    with null as same:
        same.poll()
    assert null.close() == ProducerCounters()
