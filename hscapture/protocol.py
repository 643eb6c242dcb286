"""Messages between producer and consumer: msgpack on the wire, typed and validated on receipt.

Two sockets per run, named for their role (zguide habit: the long-lived side binds):

* ``announce`` (producer ROUTER, bound -> consumer DEALER): :class:`Layout`, :class:`Chunk` (alone,
  or several in one :class:`Announcements`), :class:`RequestFinished`, :class:`EndOfStream`, in the
  order the engine produced them, to the one attached consumer; :class:`Refused` to a consumer that
  may not attach.
* ``release`` (consumer PUSH -> producer PULL, bound): :class:`Hello` (attach and heartbeat)
  and :class:`Release` (credits: the slots may be written again).

Every message carries the protocol version in its first field ``v``; fields are only ever
added at the end, with defaults. Nothing is pickled. The codec is msgspec's msgpack, which
decodes straight into these typed structs and rejects wrong types in the same pass
(see ``benchmarks/codec.py`` for the comparison with the msgpack package).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from hscapture.errors import ProtocolError
from hscapture.selection import Positions

#: 2: announcements addressed to one consumer (ROUTER/DEALER), :class:`Refused`, liveness fields in :class:`Hello`.
#: 3: :class:`Announcements` (several chunks in one message), ``Release.more`` (several slots released in one).
PROTOCOL_VERSION = 3

#: Row metadata travels as little-endian int64 arrays packed in msgpack bin fields.
ROW_DTYPE = np.dtype("<i8")


class Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=False):
    """Base of all messages; ``v`` is encoded first so any peer can read the version."""

    v: int


class Hello(Message, tag="hello"):
    """Consumer -> producer: attach (``run_id`` empty or stale) or heartbeat (``run_id`` current)."""

    consumer_id: str
    run_id: str = ""
    #: The producer's per-run secret: read from the 0600 token file beside an ipc:// endpoint,
    #: or given with --token. A hello without it cannot attach (on tcp:// the CURVE key is the
    #: credential, and a token is checked only where the producer was given one).
    token: str = ""
    #: The consumer's process id and where it runs (host name and pid namespace, see
    #: ``transport.process_place``): a producer on the same host tells at once when it died.
    pid: int = 0
    place: str = ""
    #: How often this consumer says hello; the producer counts it gone after a silence of many of these.
    heartbeat_ms: int = 0


class Release(Message, tag="release"):
    """Consumer -> producer: the slot announced with ``seq`` is copied out; it may be reused.

    ``more`` holds further ``(slot, seq)`` pairs whose copies landed at the same time: one message,
    one receive on the producer's side, for the chunks of an :class:`Announcements` message.
    """

    consumer_id: str
    slot: int
    seq: int
    more: list[tuple[int, int]] = []


class Refused(Message, tag="refused"):
    """Producer -> consumer: this consumer may not attach; ``reason`` says why and what to do.

    ``takeover_ms`` is the silence after which the producer counts the attached consumer as gone
    (a consumer restarted after a crash is refused until then, and attaches after); 0 means the
    refusal is final.
    """

    consumer_id: str
    reason: str
    takeover_ms: int = 0


class Layout(Message, tag="layout"):
    """Producer -> consumer: everything a late-joining consumer needs to read the ring.

    ``ring`` is the backend's own description (e.g. a shared-memory path or a CUDA IPC
    handle); it is sent once per attach, never per chunk.
    """

    run_id: str
    consumer_id: str
    ring: dict[str, Any]
    num_slots: int
    slot_bytes: int
    dtype: str
    hidden_size: int
    tensor_names: list[str]
    tensor_descriptions: list[str]
    policy: str
    meta: dict[str, Any] = {}
    #: The producer's process id: a consumer on the same host notices it die.
    pid: int = 0


class Chunk(Message, tag="chunk"):
    """Producer -> consumer: ``rows`` rows of every captured tensor sit in ``slot``.

    The slot holds ``[num_tensors, row_stride or rows, hidden]`` from ``offset``. Rows of one
    request are contiguous: request ``request_ids[i]`` owns the next ``request_rows[i]`` rows.
    ``positions`` and ``token_ids`` are int64 arrays of length ``rows``. ``dropped_rows`` and
    ``lost_rows`` are the producer's running totals when it sent this chunk. A sender may set
    ``request_ids`` and ``request_rows`` to their :func:`encoded` form: the bytes are the same.
    """

    seq: int
    step: int
    slot: int
    offset: int
    nbytes: int
    rows: int
    request_ids: list[str]
    request_rows: list[int]
    positions: bytes
    token_ids: bytes
    dropped_rows: int = 0
    lost_rows: int = 0
    #: Rows between the starts of two tensors' planes in the slot (0: packed, = ``rows``).
    #: A CUDA-graph write fills a fixed batch of which only the first ``rows`` are real.
    row_stride: int = 0
    #: Ring slots announced and not yet released when this chunk was sent, this one included
    #: (0: not reported). The consumer shows it as the ring's occupancy.
    ring_slots_used: int = 0


class Announcements(Message, tag="chunks"):
    """Producer -> consumer: several chunks in seq order, sent at once to pay a send's fixed cost once.

    Each element is one whole encoded :class:`Chunk` message (version field included), the very
    bytes the chunk would have been sent as alone; the consumer takes each as if it had come alone.
    """

    chunks: list[msgspec.Raw]


class RequestFinished(Message, tag="finished"):
    """Producer -> consumer: no more rows will come for ``request_id``.

    ``reason`` is ``finished``, ``aborted`` or ``retracted`` (or another engine word).
    ``num_tokens`` is how many rows the request should have (0 when unknown),
    ``dropped_rows`` how many of them the producer dropped, ``loss_mask`` the half-open
    position ranges ``[start, end)`` that are trained on. ``prefix_token_ids`` (int64 array, as
    :func:`pack_rows` packs it) are the token ids of the request's first positions that the engine
    never forwarded (a prefix-cache hit): the store finds the rows of those tokens in the request
    that computed them. ``positions`` is the selection its rows were captured at
    (:class:`~hscapture.selection.Positions`, e.g. ``loss``; empty: every position).
    """

    request_id: str
    reason: str
    num_tokens: int = 0
    dropped_rows: int = 0
    loss_mask: list[tuple[int, int]] = []
    meta: dict[str, Any] = {}
    prefix_token_ids: bytes = b""
    positions: str = ""


class EndOfStream(Message, tag="eos"):
    """Producer -> consumer: the run is over; ``counters`` are the producer's final totals.

    ``error`` is empty at a normal end; otherwise capture failed inside the engine and this is
    the original error (the engine may serve on without capture).
    """

    run_id: str
    counters: dict[str, int] = {}
    error: str = ""


ToProducer = Hello | Release
ToConsumer = Layout | Chunk | Announcements | RequestFinished | EndOfStream | Refused

_encoder = msgspec.msgpack.Encoder()
_to_producer = msgspec.msgpack.Decoder(ToProducer)
_to_consumer = msgspec.msgpack.Decoder(ToConsumer)


class _VersionOnly(msgspec.Struct, forbid_unknown_fields=False):
    v: int = -1
    type: str = "?"


_version_only = msgspec.msgpack.Decoder(_VersionOnly)

#: What msgspec raises on hostile bytes: bad msgpack, invalid UTF-8 in a string, absurd nesting.
_DECODE_FAULTS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def encoded(value: Any) -> msgspec.Raw:
    """``value`` encoded once, for a field a sender repeats in many messages (the request ids of
    a decode batch that stays the same): a ``msgspec.Raw`` field value is written as it is."""
    return msgspec.Raw(_encoder.encode(value))


def decode_to_producer(data: bytes) -> Hello | Release:
    """Decode a message the producer receives, or raise :class:`ProtocolError` saying why."""
    return _decode(_to_producer, data)


def decode_to_consumer(data: bytes) -> Layout | Chunk | Announcements | RequestFinished | EndOfStream | Refused:
    """Decode a message the consumer receives, or raise :class:`ProtocolError` saying why."""
    return _decode(_to_consumer, data)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes) -> Any:
    try:
        message = decoder.decode(data)
    except _DECODE_FAULTS as exc:
        raise ProtocolError(f"malformed message ({len(data)} bytes): {exc}{_version_hint(data)}") from None
    if message.v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{type(message).__name__}: protocol version {message.v}, this side speaks {PROTOCOL_VERSION}; "
            "run the same hscapture version on both sides"
        )
    return message


def _version_hint(data: bytes) -> str:
    try:
        head = _version_only.decode(data)
    except _DECODE_FAULTS:
        return ""
    if head.v != PROTOCOL_VERSION:
        return f" (peer speaks protocol version {head.v}, this side {PROTOCOL_VERSION}: run the same hscapture version)"
    return ""


def pack_rows(values: np.ndarray) -> bytes:
    """int64 row metadata -> bytes for a :class:`Chunk` field."""
    if type(values) is np.ndarray and values.dtype == ROW_DTYPE and values.flags.c_contiguous:  # nothing to convert
        return values.tobytes()
    return np.ascontiguousarray(values, dtype=ROW_DTYPE).tobytes()


def unpack_rows(data: bytes, rows: int, field: str) -> np.ndarray:
    """bytes of a :class:`Chunk` field -> int64 array of ``rows``, checked."""
    if len(data) != rows * ROW_DTYPE.itemsize:
        raise ProtocolError(f"Chunk.{field}: {len(data)} bytes, expected {rows * ROW_DTYPE.itemsize} for {rows} rows")
    return np.frombuffer(data, dtype=ROW_DTYPE)


def unpack_prefix(message: RequestFinished) -> np.ndarray | None:
    """``RequestFinished.prefix_token_ids`` as an int64 array (None when empty), checked."""
    data = message.prefix_token_ids
    if len(data) % ROW_DTYPE.itemsize:
        raise ProtocolError(f"RequestFinished.prefix_token_ids: {len(data)} bytes, not a whole number of int64")
    return np.frombuffer(data, dtype=ROW_DTYPE) if data else None


def checked_positions(message: RequestFinished) -> str:
    """``RequestFinished.positions`` as the store records it ('' for every position), checked."""
    try:
        chosen = Positions.parse(message.positions, "RequestFinished.positions")
    except ValueError as exc:
        raise ProtocolError(f"{exc} (request {message.request_id!r})") from None
    return "" if chosen.everything else str(chosen)


def check_chunk(chunk: Chunk, layout: Layout, row_bytes: int) -> None:
    """Reject a chunk that would read outside its slot or whose row metadata does not add up."""
    if not 0 <= chunk.slot < layout.num_slots:
        raise ProtocolError(f"Chunk.slot: {chunk.slot} out of range 0..{layout.num_slots - 1} (seq {chunk.seq})")
    if chunk.offset != chunk.slot * layout.slot_bytes:
        raise ProtocolError(
            f"Chunk.offset: {chunk.offset} is not the start of slot {chunk.slot} "
            f"({chunk.slot * layout.slot_bytes}) (seq {chunk.seq})"
        )
    stride = chunk.row_stride or chunk.rows
    if chunk.rows <= 0 or stride < chunk.rows:
        raise ProtocolError(f"Chunk.rows: {chunk.rows} with row_stride {chunk.row_stride} (seq {chunk.seq})")
    if chunk.nbytes != stride * row_bytes or chunk.nbytes > layout.slot_bytes:
        raise ProtocolError(
            f"Chunk.nbytes: {chunk.nbytes} for {stride} rows of {row_bytes} bytes does not fit "
            f"slot_bytes={layout.slot_bytes} (seq {chunk.seq})"
        )
    if len(chunk.request_ids) != len(chunk.request_rows) or sum(chunk.request_rows) != chunk.rows:
        raise ProtocolError(
            f"Chunk.request_rows: {len(chunk.request_ids)} ids with rows summing to {sum(chunk.request_rows)}, "
            f"expected {chunk.rows} rows (seq {chunk.seq})"
        )
    if any(n <= 0 for n in chunk.request_rows):
        raise ProtocolError(f"Chunk.request_rows: counts must be positive, got {chunk.request_rows} (seq {chunk.seq})")
