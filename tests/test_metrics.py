"""Live consumer metrics: a real consumer process, a producer here, the endpoint scraped over HTTP."""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from hscapture import open_store
from hscapture.consumer.metrics import DropTally
from tests.conftest import LoggedConsumer, wait_attached
from tests.workload import Workload, make_config, make_producer

#: One sample line of the text exposition format 0.0.4 as we write it: a name without labels, a number.
SAMPLE = re.compile(r"^(hscapture_[a-z_]+) (-?[0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)$")
STATS_LINE = re.compile(
    r"^hscapture consume: [\d,]+ rows captured, [\d,]+ dropped by the producer \| written [\d,]+ rows, [\d,.]+ MB "
    r"\([\d,]+ rows/s, [\d,.]+ MB/s\) \| lag [\d,]+ rows unreleased, [\d,]+ unwritten \| "
    r"(ring \d+/\d+ slots in use|no producer attached) \| [\d,]+ requests finished"
    r"( \| capture failed in the producer: .+)?$"
)


def scrape(url: str) -> dict[str, float]:
    """GET the endpoint; every line must be a HELP, a TYPE or a sample of a declared metric."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        body = response.read().decode()
    assert body.endswith("\n")
    values: dict[str, float] = {}
    declared: dict[str, str] = {}
    for line in body.splitlines():
        if line.startswith("# HELP "):
            assert len(line.split(" ", 3)) == 4, line
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge"), line
            assert kind != "counter" or name.endswith("_total"), line
            declared[name] = kind
        else:
            match = SAMPLE.match(line)
            assert match and match.group(1) in declared, line
            values[match.group(1)] = float(match.group(2))
    assert set(values) == set(declared)
    return values


def test_metrics_endpoint_and_stats_lines_during_a_real_run(
    tmp_path: Path, endpoint: str, logged_consumer: Callable[..., LoggedConsumer]
) -> None:
    out = tmp_path / "store"
    consumer = logged_consumer(
        endpoint, *("--delay-ms", "10", "--flush-s", "1", "--stats-s", "0.5", "--metrics-port", "0"), out=out
    )
    try:
        url = consumer.wait_for_line(r"metrics at (http://\S+/metrics)").group(1)
        assert url.startswith("http://127.0.0.1:"), "bound to loopback by default"
        idle = scrape(url)
        assert (idle["hscapture_attached"], idle["hscapture_rows_captured_total"]) == (0, 0)
        producer = make_producer(make_config(endpoint, policy="drop", slots=2, rows_per_slot=16))
        wait_attached(producer)
        workload = Workload(seed=7)
        during: list[dict[str, float]] = []

        def paced() -> None:
            for step in range(80):  # ~2 s
                workload.step(producer)
                time.sleep(0.02)
                if step % 20 == 19:
                    during.append(scrape(url))

        paced()
        # Flat out (the ring fills, rows are dropped) until a snapshot, taken every 0.5 s, shows slots in use: a
        # fixed number of steps could all fall between two snapshots.
        deadline = time.monotonic() + 60
        while True:
            for _ in range(20):
                workload.step(producer)
            during.append(scrape(url))
            if 0 < during[-1]["hscapture_ring_slots_used"] <= 2:
                break
            assert time.monotonic() < deadline, "no snapshot showed ring slots in use while the ring was full"
        paced()
        counters = producer.close()
        deadline = time.monotonic() + 30
        final = scrape(url)
        while time.monotonic() < deadline and (final["hscapture_attached"] or final["hscapture_rows_unwritten"]):
            time.sleep(0.2)
            final = scrape(url)
        time.sleep(0.6)  # one more snapshot after the run's end
        final = scrape(url)
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=10)
    finally:
        code = consumer.stop()
    assert code == 0, "\n".join(consumer.lines())
    assert counters.rows_dropped > 0, "the consumer was not slow enough to force drops"
    # At the end: what the producer counted, what the store holds.
    summary = open_store(out).summary()
    assert final["hscapture_rows_captured_total"] == counters.rows_captured == summary["rows"]
    assert final["hscapture_rows_dropped_total"] == counters.rows_dropped == summary["rows_dropped"]
    assert final["hscapture_rows_written_total"] == counters.rows_captured
    assert final["hscapture_bytes_written_total"] == summary["bytes"]
    assert final["hscapture_rows_unreleased"] == final["hscapture_rows_unwritten"] == 0
    assert final["hscapture_requests_finished_total"] == len(workload.finished)
    assert (final["hscapture_runs_total"], final["hscapture_attached"], final["hscapture_ring_slots"]) == (1, 0, 0)
    # During the run: attached, filling up, falling behind, writing; counters never go back.
    assert all(s["hscapture_attached"] == 1 and s["hscapture_ring_slots"] == 2 for s in during)
    assert any(s["hscapture_rows_unwritten"] > 0 for s in during), "rows waiting for their shard (--flush-s 1)"
    assert any(s["hscapture_write_rows_per_second"] > 0 for s in during)
    assert during[-1]["hscapture_rows_dropped_total"] > 0, "drops are reported while the run goes on"
    for name in ("rows_captured_total", "rows_dropped_total", "rows_written_total", "bytes_written_total"):
        series = [s[f"hscapture_{name}"] for s in [idle, *during, final]]
        assert series == sorted(series), name
    assert all(s["hscapture_snapshot_age_seconds"] < 5 for s in during)
    # The stderr: one stats line per interval, each a single line of the documented shape.
    stats = [line for line in consumer.lines() if line.startswith("hscapture consume: ") and "rows captured" in line]
    assert len(stats) >= 4
    assert all(STATS_LINE.match(line) for line in stats), stats
    assert any("slots in use" in line for line in stats) and "no producer attached" in stats[-1]


def test_a_capture_failure_in_the_producer_is_logged_shown_counted_stored_and_ends_exit_on_eos(
    tmp_path: Path, endpoint: str, logged_consumer: Callable[..., LoggedConsumer]
) -> None:
    from hscapture.extract import capture_failure

    error = "RuntimeError: SGLang's aux states are 384 wide,\nnot 2 layers [2, 3] of hidden size 128"
    flat = "RuntimeError: SGLang's aux states are 384 wide, not 2 layers [2, 3] of hidden size 128"
    # A long-lived consumer (as beside a live server): the failure stays on its stats line and in the metric.
    live = logged_consumer(endpoint, "--stats-s", "0.5", "--metrics-port", "0", out=tmp_path / "live")
    try:
        url = live.wait_for_line(r"metrics at (http://\S+/metrics)").group(1)
        producer = make_producer(make_config(endpoint))
        wait_attached(producer)
        workload = Workload(seed=11)
        for _ in range(10):
            workload.step(producer)
        producer.close(error=error)
        live.wait_for_line(f"ERROR run {producer.run_id}: capture failed in the producer: {re.escape(flat)}")
        line = live.wait_for_line(
            r"^hscapture consume: .*no producer attached.* \| capture failed in the producer: (.*)$"
        )
        assert line.group(1) == flat and STATS_LINE.match(line.group(0)), line.group(0)
        assert scrape(url)["hscapture_producer_failures_total"] == 1
    finally:
        assert live.stop() == 0, "\n".join(live.lines())
    store = open_store(tmp_path / "live")
    assert store.metadata()["runs"][-1]["end"]["reason"] == f"capture failed in the producer: {flat}"
    assert capture_failure(tmp_path / "live") == f"capture failed in the producer: {flat}"
    assert all(store.record(rid)["status"] == "incomplete" for rid in workload.running)  # cut off by the failure
    # With --exit-on-eos (extract, serve) the consumer exits with status 1 after a failed run, 0 after a clean one.
    for failure, expected in (("OSError: ring gone", 1), ("", 0)):
        once = logged_consumer(endpoint, "--exit-on-eos", out=tmp_path / f"once-{expected}")
        producer = make_producer(make_config(endpoint))
        wait_attached(producer)
        producer.close(error=failure)
        assert once.stop() == expected, "\n".join(once.lines())


def test_quiet_prints_no_stats_and_a_taken_port_is_a_clear_error(
    tmp_path: Path, endpoint: str, logged_consumer: Callable[..., LoggedConsumer]
) -> None:
    quiet = logged_consumer(endpoint, "--quiet", "--stats-s", "0.1", "--metrics-port", "0", out=tmp_path / "a")
    quiet.wait_for_line(r"metrics at http://")  # up (and its signal handlers set) however loaded the host is
    time.sleep(2)  # 20 stats intervals: a quiet consumer prints none of them
    assert quiet.stop() == 0
    assert not [line for line in quiet.lines() if "rows captured" in line], quiet.lines()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = logged_consumer(endpoint, "--metrics-port", str(port), out=tmp_path / "b")
        assert busy.process.wait(60) == 2
    busy.stop()
    assert any(f"--metrics-port: cannot serve on 127.0.0.1:{port}" in line for line in busy.lines()), busy.lines()


def test_drop_tally_takes_the_larger_of_the_running_total_and_the_requests() -> None:
    tally = DropTally()
    assert tally.reported(5) == 5 and tally.reported(3) == 5  # a running total only grows
    assert tally.request(2) == 5 and tally.request(4) == 6  # drops after the last chunk show in requests
    assert tally.reported(9) == 9
    assert tally.begin_run() == 9 and tally.request(1) == 10 and tally.reported(4) == 13
