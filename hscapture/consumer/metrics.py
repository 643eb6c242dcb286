"""Live metrics of a consumer: a stderr line every few seconds and a Prometheus text endpoint.

The consumer loop calls :meth:`MetricsReporter.tick` on every turn; at most every half second
it takes a :class:`Snapshot` of the consumer's counters (a frozen object, published by one
reference assignment), computes the write rate, and prints a line when ``stats_s`` has passed.
The HTTP thread only ever reads the last published snapshot, so it never touches the
consumer's state. The endpoint is a plain ``http.server`` thread writing text exposition
format 0.0.4 (no client library: a dozen gauges and counters do not need one), bound to
127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO

#: Seconds between snapshots (the stats line's interval is a whole number of these, at least one).
SAMPLE_S = 0.5
#: Seconds over which the endpoint's write rates are averaged.
RATE_WINDOW_S = 10.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Snapshot:
    """The consumer's counters at one moment (``time`` is ``time.monotonic()``)."""

    time: float
    attached: bool
    runs: int
    #: Rows copied out of the ring by this consumer.
    rows_captured: int
    #: Rows the producer could not capture (``drop`` policy), as it reported them.
    rows_dropped: int
    #: Rows durable in the store's shards, and those shards' bytes.
    rows_written: int
    bytes_written: int
    #: Rows taken from announcements whose ring slot is not released yet.
    rows_unreleased: int
    #: Rows copied out of the ring but not durable yet.
    rows_unwritten: int
    #: Ring slots, and slots announced but not yet released as the producer last reported.
    ring_slots: int
    ring_slots_used: int
    requests_finished: int
    messages_rejected: int
    #: Producer runs that ended because capture failed in the engine, and the last one's error.
    producer_failures: int = 0
    last_failure: str = ""


class DropTally:
    """The producer's dropped rows, summed over runs, from what it tells the consumer.

    Within a run the producer reports its running total on every :class:`~hscapture.protocol.Chunk`
    and in the :class:`~hscapture.protocol.EndOfStream` counters, and each request's own drops
    in its :class:`~hscapture.protocol.RequestFinished`; rows dropped after the last chunk
    show up only in the latter, so the run's figure is the larger of the two.
    """

    def __init__(self) -> None:
        self._earlier_runs = 0
        self._reported = 0
        self._by_request = 0

    def begin_run(self) -> int:
        self._earlier_runs, self._reported, self._by_request = self.total, 0, 0
        return self.total

    def reported(self, running_total: int) -> int:
        """The producer's running total for this run (a chunk's ``dropped_rows``, the end's counter)."""
        self._reported = max(self._reported, running_total)
        return self.total

    def request(self, dropped_rows: int) -> int:
        """One finished request's dropped rows."""
        self._by_request += max(0, dropped_rows)
        return self.total

    @property
    def total(self) -> int:
        return self._earlier_runs + max(self._reported, self._by_request)


class MetricsReporter:
    """Prints a stats line every ``stats_s`` and serves ``/metrics`` on ``host:port`` (either optional).

    Args:
        read: returns the consumer's current :class:`Snapshot` (called on the consumer's thread).
        stats_s: seconds between stderr lines; None prints none.
        port: serve the Prometheus endpoint on this port (0 picks a free one); None serves none.
        host: address to bind; loopback by default, so only this machine can scrape.
        stream: where the lines go.

    Raises:
        ValueError: the port cannot be bound (in use, or not allowed).
    """

    def __init__(
        self,
        read: Callable[[], Snapshot],
        stats_s: float | None = 10.0,
        port: int | None = None,
        host: str = "127.0.0.1",
        stream: IO[str] = sys.stderr,
    ) -> None:
        if stats_s is not None and stats_s <= 0:
            raise ValueError(f"--stats-s: must be > 0 seconds, got {stats_s}")
        self._read = read
        self._stats_s = stats_s
        self._stream = stream
        first = read()
        self._history: deque[Snapshot] = deque([first])
        self._printed = first
        #: (snapshot, rows/s, bytes/s) as last published; replaced whole, read by the HTTP thread.
        self.published: tuple[Snapshot, float, float] = (first, 0.0, 0.0)
        self._server: ThreadingHTTPServer | None = None
        if port is not None:
            self._server = _serve(self, host, port)

    @property
    def address(self) -> str | None:
        """``http://host:port/metrics`` of the endpoint, or None."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/metrics"

    def tick(self) -> None:
        """Take a snapshot if one is due, and print the stats line if that is due."""
        now = time.monotonic()
        if now - self._history[-1].time < SAMPLE_S:
            return
        snapshot = self._read()
        self._history.append(snapshot)
        while len(self._history) > 2 and snapshot.time - self._history[1].time >= RATE_WINDOW_S:
            self._history.popleft()
        self.published = (snapshot, *rates(self._history[0], snapshot))
        if self._stats_s is not None and snapshot.time - self._printed.time >= self._stats_s:
            print(stats_line(self._printed, snapshot), file=self._stream, flush=True)
            self._printed = snapshot

    def close(self) -> None:
        """Stop serving. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def rates(before: Snapshot, after: Snapshot) -> tuple[float, float]:
    """Rows and bytes made durable per second between two snapshots."""
    seconds = after.time - before.time
    if seconds <= 0:
        return 0.0, 0.0
    return (after.rows_written - before.rows_written) / seconds, (after.bytes_written - before.bytes_written) / seconds


def stats_line(before: Snapshot, after: Snapshot) -> str:
    """One line for a person watching the consumer: what came, what was lost, what is behind."""
    rows_s, bytes_s = rates(before, after)
    ring = f"ring {after.ring_slots_used}/{after.ring_slots} slots in use" if after.attached else "no producer attached"
    return (
        f"hscapture consume: {after.rows_captured:,} rows captured, {after.rows_dropped:,} dropped by the producer | "
        f"written {after.rows_written:,} rows, {after.bytes_written / 1e6:,.1f} MB "
        f"({rows_s:,.0f} rows/s, {bytes_s / 1e6:,.1f} MB/s) | "
        f"lag {after.rows_unreleased:,} rows unreleased, {after.rows_unwritten:,} unwritten | {ring} | "
        f"{after.requests_finished:,} requests finished"
        + (f" | capture failed in the producer: {after.last_failure}" if after.last_failure else "")
    )


#: name, type, help, and the figure it shows (a Snapshot field, or one that exposition adds).
_METRICS = [
    ("hscapture_rows_captured_total", "counter", "Rows copied out of the ring.", "rows_captured"),
    ("hscapture_rows_dropped_total", "counter", "Rows the producer could not capture, as reported.", "rows_dropped"),
    ("hscapture_rows_written_total", "counter", "Rows durable in store shards.", "rows_written"),
    ("hscapture_bytes_written_total", "counter", "Bytes of durable store shards.", "bytes_written"),
    ("hscapture_requests_finished_total", "counter", "Requests the producer finished.", "requests_finished"),
    ("hscapture_messages_rejected_total", "counter", "Malformed or foreign messages.", "messages_rejected"),
    ("hscapture_runs_total", "counter", "Producer runs attached to.", "runs"),
    (
        "hscapture_producer_failures_total",
        "counter",
        "Producer runs that ended because capture failed in the engine.",
        "producer_failures",
    ),
    ("hscapture_attached", "gauge", "1 while attached to a producer run.", "attached"),
    ("hscapture_rows_unreleased", "gauge", "Rows taken whose ring slot is not released yet.", "rows_unreleased"),
    ("hscapture_rows_unwritten", "gauge", "Rows copied out of the ring, not durable yet.", "rows_unwritten"),
    ("hscapture_ring_slots", "gauge", "Slots of the producer's ring.", "ring_slots"),
    ("hscapture_ring_slots_used", "gauge", "Slots announced, not yet released (producer's figure).", "ring_slots_used"),
    ("hscapture_write_rows_per_second", "gauge", "Rows made durable per second, last 10 s.", "rows_per_second"),
    ("hscapture_write_bytes_per_second", "gauge", "Bytes made durable per second, last 10 s.", "bytes_per_second"),
    ("hscapture_snapshot_age_seconds", "gauge", "Age of these figures (grows if the loop is stuck).", "age_seconds"),
]


def exposition(snapshot: Snapshot, rows_s: float, bytes_s: float, now: float) -> str:
    """Prometheus text exposition format 0.0.4 of a snapshot taken at ``snapshot.time`` (``now``: monotonic)."""
    figures = {
        **asdict(snapshot),
        "attached": int(snapshot.attached),
        "rows_per_second": float(rows_s),
        "bytes_per_second": float(bytes_s),
        "age_seconds": max(0.0, now - snapshot.time),
    }
    lines = []
    for name, kind, help_text, figure in _METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {figures[figure]}"]
    return "\n".join(lines) + "\n"


def _serve(reporter: MetricsReporter, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            body = exposition(*reporter.published, time.monotonic()).encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return None  # one request per scrape would drown the stats line

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        raise ValueError(
            f"--metrics-port: cannot serve on {host}:{port} ({exc.strerror}); choose another port (0 picks a free one)"
        ) from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="hscapture-metrics", daemon=True).start()
    return server
