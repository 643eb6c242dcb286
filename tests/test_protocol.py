"""The wire protocol: round trips, version and type checks, and that only ProtocolError ever comes out."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hscapture import protocol
from hscapture.errors import HSCaptureError, ProtocolError
from hscapture.protocol import (
    PROTOCOL_VERSION,
    Announcements,
    Chunk,
    EndOfStream,
    Hello,
    Layout,
    Refused,
    Release,
    RequestFinished,
    check_chunk,
    decode_to_consumer,
    decode_to_producer,
    encode,
    pack_rows,
    unpack_rows,
)

V = PROTOCOL_VERSION
#: A version this side does not speak (the next one).
W = V + 1


def layout(**overrides: object) -> Layout:
    fields: dict[str, object] = {
        "v": V,
        "run_id": "run-1",
        "consumer_id": "host-1-abc",
        "ring": {"backend": "host", "path": "/dev/shm/hscapture-0-x.ring", "nbytes": 4096},
        "num_slots": 4,
        "slot_bytes": 1024,
        "dtype": "bfloat16",
        "hidden_size": 8,
        "tensor_names": ["layer_1", "last"],
        "tensor_descriptions": ["residual entering layer 1", "final norm output"],
        "policy": "block",
        "meta": {"engine": "hf", "config": {"layers": [1], "nested": {"x": 1.5}}},
    }
    fields.update(overrides)
    return Layout(**fields)


ROW_BYTES = 2 * 8 * 2  # two bf16 tensors of width 8


def chunk(**overrides: object) -> Chunk:
    rows = int(overrides.get("rows", 5))  # type: ignore[call-overload]
    fields: dict[str, object] = {
        "v": V,
        "seq": 7,
        "step": 3,
        "slot": 2,
        "offset": 2 * 1024,
        "nbytes": rows * ROW_BYTES,
        "rows": rows,
        "request_ids": ["a", "b"],
        "request_rows": [2, rows - 2],
        "positions": pack_rows(np.arange(rows) + 10),
        "token_ids": pack_rows(np.arange(rows) * 3 + 1),
        "dropped_rows": 4,
        "lost_rows": 1,
    }
    fields.update(overrides)
    return Chunk(**fields)


TO_PRODUCER = [
    Hello(v=V, consumer_id="c-1"),
    Hello(v=V, consumer_id="c-1", run_id="run-1"),
    Hello(v=V, consumer_id="c-1", token="t" * 32, pid=4321, place="host/pid:[4026531836]", heartbeat_ms=200),
    Release(v=V, consumer_id="c-1", slot=3, seq=12345678901),
    Release(v=V, consumer_id="c-1", slot=3, seq=7, more=[(4, 8), (0, 9)]),
]
TO_CONSUMER = [
    layout(),
    layout(meta={}),
    chunk(),
    Announcements(v=V, chunks=[msgspec.Raw(encode(chunk())), msgspec.Raw(encode(chunk(seq=8, slot=1, offset=4096)))]),
    RequestFinished(v=V, request_id="a", reason="finished"),
    RequestFinished(
        v=V,
        request_id="b",
        reason="aborted",
        num_tokens=17,
        dropped_rows=2,
        loss_mask=[(0, 3), (5, 17)],
        meta={"source": "sharegpt", "turns": 3},
    ),
    EndOfStream(v=V, run_id="run-1"),
    EndOfStream(v=V, run_id="run-1", counters={"rows_captured": 10, "rows_dropped": 0}),
    Refused(v=V, consumer_id="c-2", reason="consumer c-1 is attached", takeover_ms=2000),
]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("message", TO_PRODUCER, ids=lambda m: type(m).__name__)
def test_round_trip_to_producer(message: protocol.Message) -> None:
    decoded = decode_to_producer(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


@pytest.mark.parametrize("message", TO_CONSUMER, ids=lambda m: type(m).__name__)
def test_round_trip_to_consumer(message: protocol.Message) -> None:
    decoded = decode_to_consumer(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_chunk_row_fields_round_trip_exactly() -> None:
    positions = np.array([0, 1, 2, 2**40, -1], dtype=np.int64)
    message = chunk(rows=5, positions=pack_rows(positions))
    decoded = decode_to_consumer(encode(message))
    assert isinstance(decoded, Chunk)
    np.testing.assert_array_equal(unpack_rows(decoded.positions, 5, "positions"), positions)
    np.testing.assert_array_equal(unpack_rows(decoded.token_ids, 5, "token_ids"), np.arange(5) * 3 + 1)


def test_request_finished_defaults() -> None:
    decoded = decode_to_consumer(encode(RequestFinished(v=V, request_id="x", reason="finished")))
    assert isinstance(decoded, RequestFinished)
    assert (decoded.num_tokens, decoded.dropped_rows, decoded.loss_mask, decoded.meta) == (0, 0, [], {})


# --------------------------------------------------------------------------- wrong direction, version, types


@pytest.mark.parametrize("message", TO_CONSUMER, ids=lambda m: type(m).__name__)
def test_consumer_message_rejected_by_producer(message: protocol.Message) -> None:
    with pytest.raises(ProtocolError, match=r"malformed message"):
        decode_to_producer(encode(message))


@pytest.mark.parametrize("message", TO_PRODUCER, ids=lambda m: type(m).__name__)
def test_producer_message_rejected_by_consumer(message: protocol.Message) -> None:
    with pytest.raises(ProtocolError, match=r"malformed message"):
        decode_to_consumer(encode(message))


def test_wrong_version_to_producer() -> None:
    with pytest.raises(ProtocolError, match=rf"Hello: protocol version {W}, this side speaks {V}") as exc:
        decode_to_producer(encode(Hello(v=W, consumer_id="c")))
    assert "same hscapture version" in str(exc.value)


@pytest.mark.parametrize(
    "message",
    [layout(v=W), chunk(v=W), RequestFinished(v=W, request_id="a", reason="finished"), EndOfStream(v=W, run_id="r")],
    ids=lambda m: type(m).__name__,
)
def test_wrong_version_to_consumer(message: protocol.Message) -> None:
    with pytest.raises(ProtocolError, match=rf"protocol version {W}"):
        decode_to_consumer(encode(message))


def test_wrong_version_malformed_message_still_names_the_version() -> None:
    # A newer peer may send a message type or fields this side does not know: the error says why.
    msgpack_encode = msgspec.msgpack.encode
    for data in (
        msgpack_encode({"type": "chunk", "v": W, "seq": 1}),
        msgpack_encode({"type": "brand-new", "v": W}),
    ):
        with pytest.raises(ProtocolError, match=rf"malformed message.*peer speaks protocol version {W}"):
            decode_to_consumer(data)


def test_unknown_trailing_fields_are_accepted() -> None:
    # "fields are only ever added at the end, with defaults": an older reader ignores new fields.
    data = msgspec.msgpack.encode({"type": "hello", "v": V, "consumer_id": "c", "future": [1, {"a": b"x"}]})
    assert decode_to_producer(data) == Hello(v=V, consumer_id="c")


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"type": "release", "v": V, "consumer_id": "c", "slot": "3", "seq": 1}, "slot"),
        ({"type": "release", "v": V, "consumer_id": "c", "slot": 3, "seq": 1.5}, "seq"),
        ({"type": "release", "v": V, "consumer_id": 5, "slot": 3, "seq": 1}, "consumer_id"),
        ({"type": "hello", "v": "1", "consumer_id": "c"}, "v"),
        ({"type": "hello", "v": True, "consumer_id": "c"}, "v"),
        ({"type": "hello", "v": None, "consumer_id": "c"}, "v"),
        ({"type": "hello", "consumer_id": "c"}, "v"),
        ({"v": V, "consumer_id": "c"}, "type"),
        ({"type": 1, "v": V, "consumer_id": "c"}, "type"),
    ],
)
def test_wrong_field_types_to_producer(fields: dict, where: str) -> None:
    with pytest.raises(ProtocolError, match=rf"malformed message.*{where}"):
        decode_to_producer(msgspec.msgpack.encode(fields))


def _chunk_fields(**overrides: object) -> dict:
    base = {"type": "chunk", **{k: getattr(chunk(), k) for k in chunk().__struct_fields__}}
    base.update(overrides)
    return base


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ({"positions": "AAAA"}, "positions"),
        ({"positions": [1, 2, 3]}, "positions"),
        ({"rows": -1.0}, "rows"),
        ({"request_ids": "ab"}, "request_ids"),
        ({"request_rows": ["2", "3"]}, "request_rows"),
        ({"slot": None}, "slot"),
        ({"slot": 1.5}, "slot"),
    ],
)
def test_wrong_field_types_to_consumer(overrides: dict, where: str) -> None:
    data = msgspec.msgpack.encode(_chunk_fields(**overrides))
    with pytest.raises(ProtocolError, match=rf"malformed message.*{where}"):
        decode_to_consumer(data)


def test_layout_field_types() -> None:
    data = msgspec.msgpack.encode({**msgspec.to_builtins(layout()), "type": "layout", "ring": []})
    with pytest.raises(ProtocolError, match=r"Expected `object`, got `array` - at `\$\.ring`"):
        decode_to_consumer(data)
    data = msgspec.msgpack.encode({**msgspec.to_builtins(layout()), "type": "layout", "meta": 3})
    with pytest.raises(ProtocolError, match=r"\$\.meta"):
        decode_to_consumer(data)


def test_loss_mask_pairs_are_checked() -> None:
    for bad in ([[0, 1, 2]], [[0]], [["a", 1]], [0, 1]):
        data = msgspec.msgpack.encode(
            {"type": "finished", "v": V, "request_id": "r", "reason": "finished", "loss_mask": bad}
        )
        with pytest.raises(ProtocolError, match=r"loss_mask"):
            decode_to_consumer(data)


# --------------------------------------------------------------------------- garbage


@pytest.mark.parametrize("message", TO_PRODUCER + TO_CONSUMER, ids=lambda m: type(m).__name__)
def test_every_truncation_is_a_protocol_error(message: protocol.Message) -> None:
    data = encode(message)
    decode = decode_to_producer if isinstance(message, Hello | Release) else decode_to_consumer
    for cut in range(len(data)):
        with pytest.raises(ProtocolError, match=rf"malformed message \({cut} bytes\)"):
            decode(data[:cut])


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\xff" * 16, b"not msgpack at all", b"\x80", b"\x90", b"\xc0", b"\x01", b"\xdd\xff\xff\xff\xff"],
)
def test_garbage_is_a_protocol_error(data: bytes) -> None:
    for decode in (decode_to_producer, decode_to_consumer):
        with pytest.raises(ProtocolError, match=r"^malformed message"):
            decode(data)


def test_pickle_is_not_executed() -> None:
    import pickle

    class Boom:
        def __reduce__(self) -> tuple:
            return (exec, ("raise SystemExit('pickle was executed')",))

    data = pickle.dumps(Boom())
    for decode in (decode_to_producer, decode_to_consumer):
        with pytest.raises(ProtocolError):
            decode(data)


def _nested(depth: int) -> bytes:
    """msgpack of ``[[[...[None]...]]]`` nested ``depth`` levels deep."""
    return b"\x91" * depth + b"\xc0"


_enc = msgspec.msgpack.encode
_BAD_UTF8 = b"\xa2\xff\xfe"  # a msgpack str of two bytes that are not UTF-8

#: Inputs that once escaped the decoders as something other than ProtocolError.
NESTED_HELLO = b"\x83" + _enc("type") + _enc("hello") + _enc("v") + _enc(V) + _enc("future") + _nested(1000)
BAD_UTF8_TAG = b"\x83" + _enc("type") + _BAD_UTF8 + _enc("v") + _enc(V) + _enc("consumer_id") + _enc("c")
BAD_UTF8_FIELD = b"\x83" + _enc("type") + _enc("hello") + _enc("v") + _enc(V) + _enc("consumer_id") + _BAD_UTF8

#: Exceptions the decoders are known to leak; none since protocol catches every msgspec fault.
KNOWN_LEAKS: tuple[type[BaseException], ...] = ()


def _decode_both(data: bytes, tolerate: tuple[type[BaseException], ...] = ()) -> list[protocol.Message]:
    """Feed ``data`` to both decoders; anything but ProtocolError (or ``tolerate``) propagates."""
    accepted = []
    for decode in (decode_to_producer, decode_to_consumer):
        try:
            accepted.append(decode(data))
        except ProtocolError:
            pass
        except tolerate:
            pass
    return accepted


@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize("decode", [decode_to_producer, decode_to_consumer], ids=["producer", "consumer"])
@pytest.mark.parametrize("where", ["unknown-field", "layout-meta"])
def test_deeply_nested_message_is_a_protocol_error(depth: int, decode: Callable[[bytes], object], where: str) -> None:
    if where == "unknown-field":
        # An unknown trailing field is skipped by the decoder (forward compatibility) ...
        data = b"\x83" + _enc("type") + _enc("hello") + _enc("v") + _enc(V) + _enc("future") + _nested(depth)
    else:
        # ... and Layout.meta takes any value.
        fields = msgspec.to_builtins(layout())
        fields.pop("meta")
        head = _enc({"type": "layout", **fields})
        data = bytes([head[0] + 1]) + head[1:] + _enc("meta") + b"\x81" + _enc("k") + _nested(depth)
    with pytest.raises(ProtocolError, match=r"malformed message"):
        decode(data)


@pytest.mark.parametrize("data", [BAD_UTF8_TAG, BAD_UTF8_FIELD], ids=["tag", "field"])
def test_invalid_utf8_to_producer_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError, match=r"malformed message"):
        decode_to_producer(data)


def test_invalid_utf8_to_consumer_is_a_protocol_error() -> None:
    data = _enc({"type": "eos", "v": V, "run_id": "r"})
    assert data.endswith(_enc("r"))
    data = data[: -len(_enc("r"))] + _BAD_UTF8  # run_id is not UTF-8
    with pytest.raises(ProtocolError, match=r"malformed message"):
        decode_to_consumer(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(data=NESTED_HELLO)
@example(data=BAD_UTF8_TAG)
@example(data=BAD_UTF8_FIELD)
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes_only_raise_protocol_error(data: bytes) -> None:
    _decode_both(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes_leak_nothing_new(data: bytes) -> None:
    _decode_both(data, tolerate=KNOWN_LEAKS)


_leaf = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
_value = st.recursive(
    _leaf | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
_field_names = st.sampled_from(
    ["v", "type", "consumer_id", "run_id", "slot", "seq", "rows", "nbytes", "offset", "positions", "ring", "meta"]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tag=st.sampled_from(["hello", "release", "layout", "chunk", "finished", "eos", "?"]),
    version=st.sampled_from([0, 1, 2, -1, 2**63 - 1]) | _leaf,
    fields=st.dictionaries(_field_names, _value, max_size=8),
)
def test_structured_garbage_only_raises_protocol_error(tag: str, version: object, fields: dict) -> None:
    # Well-formed msgpack (valid UTF-8, shallow): here nothing may leak, not even the known leaks.
    for message in _decode_both(_enc({**fields, "type": tag, "v": version})):
        assert message.v == V  # whatever gets through speaks this version


@settings(max_examples=300, deadline=None)
@given(
    index=st.integers(0, len(TO_PRODUCER + TO_CONSUMER) - 1),
    flips=st.lists(st.tuples(st.integers(0), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_corrupted_valid_messages_leak_nothing_new(index: int, flips: list[tuple[int, int]]) -> None:
    data = bytearray(encode((TO_PRODUCER + TO_CONSUMER)[index]))
    for at, value in flips:
        data[at % len(data)] = value
    _decode_both(bytes(data), tolerate=KNOWN_LEAKS)


def test_protocol_error_is_an_hscapture_error() -> None:
    assert issubclass(ProtocolError, HSCaptureError)


# --------------------------------------------------------------------------- the bytes on the wire


def test_wire_is_plain_msgpack_without_pickle() -> None:
    msgpack = pytest.importorskip("msgpack")
    for message in TO_PRODUCER + TO_CONSUMER:
        data = encode(message)
        assert b"\x80\x04\x95" not in data and b"\x80\x05\x95" not in data  # pickle protocol 4/5 headers
        plain = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        assert isinstance(plain, dict)
        assert plain["v"] == V
        assert plain["type"] == type(message).__struct_config__.tag
        for name in message.__struct_fields__:
            value = getattr(message, name)
            if isinstance(value, list):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
                value = [msgpack.unpackb(bytes(v), raw=False) if isinstance(v, msgspec.Raw) else v for v in value]
            assert plain[name] == value, name
        # ext types (which could smuggle anything) are absent: a strict unpacker with no ext hook accepts it
        msgpack.unpackb(data, raw=False, ext_hook=lambda code, payload: pytest.fail(f"ext type {code}"))


def test_plain_msgpack_is_accepted() -> None:
    msgpack = pytest.importorskip("msgpack")
    data = msgpack.packb({"v": V, "type": "release", "consumer_id": "c", "slot": 1, "seq": 2}, use_bin_type=True)
    assert decode_to_producer(data) == Release(v=V, consumer_id="c", slot=1, seq=2)
    positions = np.arange(3, dtype="<i8").tobytes()
    data = msgpack.packb(
        {
            "type": "chunk",
            "v": V,
            "seq": 1,
            "step": 1,
            "slot": 0,
            "offset": 0,
            "nbytes": 3 * ROW_BYTES,
            "rows": 3,
            "request_ids": ["r"],
            "request_rows": [3],
            "positions": positions,
            "token_ids": positions,
        },
        use_bin_type=True,
    )
    decoded = decode_to_consumer(data)
    assert isinstance(decoded, Chunk)
    check_chunk(decoded, layout(), ROW_BYTES)
    assert decoded.dropped_rows == 0


# --------------------------------------------------------------------------- check_chunk


def test_check_chunk_accepts_a_valid_chunk() -> None:
    check_chunk(chunk(), layout(), ROW_BYTES)
    full = (1024 // ROW_BYTES) * ROW_BYTES // ROW_BYTES  # 32 rows fill a 1024-byte slot exactly
    check_chunk(chunk(rows=full, slot=3, offset=3 * 1024), layout(), ROW_BYTES)


@pytest.mark.parametrize("slot", [-1, 4, 100])
def test_check_chunk_slot_out_of_range(slot: int) -> None:
    with pytest.raises(ProtocolError, match=rf"^Chunk\.slot: {slot} out of range 0\.\.3 \(seq 7\)$"):
        check_chunk(chunk(slot=slot, offset=slot * 1024), layout(), ROW_BYTES)


@pytest.mark.parametrize("offset", [0, 2 * 1024 + 32, 2 * 1024 - 1, 3 * 1024, -2048])
def test_check_chunk_offset_not_at_slot_start(offset: int) -> None:
    with pytest.raises(ProtocolError, match=rf"^Chunk\.offset: {offset} is not the start of slot 2 \(2048\)"):
        check_chunk(chunk(offset=offset), layout(), ROW_BYTES)


def test_check_chunk_nbytes_over_slot_size() -> None:
    rows = 1024 // ROW_BYTES + 1  # 33 rows do not fit one slot
    with pytest.raises(ProtocolError, match=rf"^Chunk\.nbytes: {rows * ROW_BYTES} for {rows} rows .*slot_bytes=1024"):
        check_chunk(chunk(rows=rows), layout(), ROW_BYTES)


@pytest.mark.parametrize("nbytes", [5 * ROW_BYTES - 1, 5 * ROW_BYTES + 1, 4 * ROW_BYTES, 0])
def test_check_chunk_nbytes_not_rows_times_row_bytes(nbytes: int) -> None:
    with pytest.raises(ProtocolError, match=rf"^Chunk\.nbytes: {nbytes} for 5 rows of {ROW_BYTES} bytes"):
        check_chunk(chunk(nbytes=nbytes), layout(), ROW_BYTES)


@pytest.mark.parametrize("rows", [0, -3])
def test_check_chunk_non_positive_rows(rows: int) -> None:
    with pytest.raises(ProtocolError, match=r"^Chunk\.rows: "):
        check_chunk(chunk(rows=rows, nbytes=rows * ROW_BYTES, request_rows=[rows]), layout(), ROW_BYTES)


@pytest.mark.parametrize(
    ("ids", "counts", "summing"),
    [(["a", "b"], [2, 2], 4), (["a", "b"], [2, 4], 6), (["a"], [2, 3], 5), (["a", "b", "c"], [5], 5), ([], [], 0)],
)
def test_check_chunk_request_rows_must_sum_to_rows(ids: list[str], counts: list[int], summing: int) -> None:
    with pytest.raises(ProtocolError, match=rf"^Chunk\.request_rows: {len(ids)} ids with rows summing to {summing}"):
        check_chunk(chunk(request_ids=ids, request_rows=counts), layout(), ROW_BYTES)


@pytest.mark.parametrize("counts", [[5, 0], [0, 5], [6, -1], [-1, 6]])
def test_check_chunk_counts_must_be_positive(counts: list[int]) -> None:
    with pytest.raises(ProtocolError, match=r"^Chunk\.request_rows: counts must be positive"):
        check_chunk(chunk(request_rows=counts), layout(), ROW_BYTES)


# --------------------------------------------------------------------------- row fields


def test_pack_unpack_rows() -> None:
    values = np.array([5, -1, 2**62], dtype=np.int64)
    assert unpack_rows(pack_rows(values), 3, "positions").tolist() == values.tolist()
    assert unpack_rows(pack_rows([1, 2, 3]), 3, "positions").dtype == np.dtype("<i8")
    assert len(pack_rows(np.arange(4, dtype=np.int16))) == 32  # widened to int64


@pytest.mark.parametrize(("nbytes", "rows"), [(0, 1), (8, 2), (24, 2), (15, 2), (17, 2), (8, 0)])
def test_unpack_rows_rejects_wrong_lengths(nbytes: int, rows: int) -> None:
    with pytest.raises(
        ProtocolError, match=rf"^Chunk\.token_ids: {nbytes} bytes, expected {rows * 8} for {rows} rows$"
    ):
        unpack_rows(b"\x01" * nbytes, rows, "token_ids")
