"""What the transport's security costs: ROUTER addressing (one consumer at a time) and CURVE on tcp://.

    python benchmarks/transport_security.py [--out benchmarks/results/transport-security-cpu.json]

Two measurements, each side by side in one run, variants interleaved round by round:

1. **Sockets alone** (one process): per message, the sending thread's time (in a burst), the time
   to send and receive a burst, and to send and receive one message at a time (latency), for a
   decode announcement (64 one-row requests) and a prefill one (4 x 512 rows):
   ipc PUSH->PULL (the announce socket before) vs ipc ROUTER->DEALER (now), and tcp ROUTER->DEALER
   without security vs with CURVE (the CURVE sockets are set up exactly as the producer and
   consumer set them up, keys and ZAP handler included).
2. **The producer** (a real ``hscapture consume --discard`` process per endpoint): host time of
   ``Producer.capture_step`` for decode steps of 64 one-row requests on the host ring, ipc vs
   tcp+CURVE, and tcp+CURVE while a stray process knocks with a refused key every 100 ms (every
   knock runs the ZAP callback on the authenticator thread: the only time it wants the GIL).
   Also the CPU time the authenticator thread used over the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zmq

from hscapture import CaptureConfig, Producer, protocol
from hscapture.keys import ensure_keys
from hscapture.transport import ConsumerSockets, ProducerSockets, client_credentials, make_socket

RESULTS = Path(__file__).parent / "results"


def _free_base() -> int:
    """A port P with P and P + 1 free now (a tcp:// endpoint uses both)."""
    for port in range(31_000 + os.getpid() % 1000 * 20, 60_000, 7):
        probes = [socket.socket() for _ in range(2)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError("no free port pair")


def _message(requests: int, rows: int) -> bytes:
    n = requests * rows
    chunk = protocol.Chunk(
        v=protocol.PROTOCOL_VERSION, seq=1, step=1, slot=0, offset=0, nbytes=n * 4096, rows=n,
        request_ids=[f"req-{i:06d}" for i in range(requests)], request_rows=[rows] * requests,
        positions=protocol.pack_rows(np.arange(n)), token_ids=protocol.pack_rows(np.arange(n) + 7),
    )  # fmt: skip
    return protocol.encode(chunk)


class _Pair:
    """A sender and a receiver over one transport; ``send`` is what the producer's thread pays per message."""

    def __init__(self, kind: str, directory: Path) -> None:
        context = zmq.Context.instance()
        if kind in ("ipc ROUTER", "tcp CURVE"):  # the sockets exactly as producer and consumer make them
            endpoint = f"ipc://{directory}/router" if kind == "ipc ROUTER" else f"tcp://127.0.0.1:{_free_base()}"
            server = ProducerSockets(endpoint, directory / "keys")
            client = ConsumerSockets(endpoint, "bench-consumer", client_credentials(endpoint, directory / "keys"))
            self.tx, self.rx = server.announce, client.announce
            self.send = lambda payload: server.send("bench-consumer", payload)
            self._closers = [client.close, server.close]
        elif kind == "ipc PUSH":  # the announce socket before one consumer at a time
            self.tx, self.rx = make_socket(context, zmq.PUSH), make_socket(context, zmq.PULL)
            self.tx.setsockopt(zmq.SNDHWM, 100_000)
            self.tx.bind(f"ipc://{directory}/push")
            self.rx.connect(f"ipc://{directory}/push")
            self.send = lambda payload: self.tx.send(payload, zmq.NOBLOCK) or True
            self._closers = [self.tx.close, self.rx.close]
        else:  # "tcp plain": ROUTER -> DEALER without security, for reference only
            self.tx, self.rx = make_socket(context, zmq.ROUTER), make_socket(context, zmq.DEALER)
            self.tx.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.tx.setsockopt(zmq.SNDHWM, 100_000)
            self.rx.setsockopt(zmq.ROUTING_ID, b"bench-consumer")
            base = _free_base()
            self.tx.bind(f"tcp://127.0.0.1:{base}")
            self.rx.connect(f"tcp://127.0.0.1:{base}")
            self.send = self._route
            self._closers = [self.tx.close, self.rx.close]
        deadline = time.monotonic() + 10
        while not self._ping():  # connected (and through the CURVE handshake)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{kind}: no connection")

    def _route(self, payload: bytes) -> bool:
        try:
            self.tx.send(b"bench-consumer", zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        self.tx.send(payload, zmq.NOBLOCK)
        return True

    def _ping(self) -> bool:
        try:
            sent = self.send(b"ping")
        except zmq.Again:  # a PUSH with no peer yet
            sent = False
        if not sent:
            time.sleep(0.05)
            return False
        return self.rx.recv() == b"ping"

    def measure(self, payload: bytes, count: int) -> tuple[float, float, float]:
        """Per message, in us: sending in a burst of ``count`` (the sender's cost), the burst sent and received
        (throughput), and one message sent and received at a time (latency)."""
        started = time.perf_counter_ns()
        for _ in range(count):
            self.send(payload)
        sent = time.perf_counter_ns()
        for _ in range(count):
            self.rx.recv()
        drained = time.perf_counter_ns()
        for _ in range(count):
            self.send(payload)
            self.rx.recv()
        done = time.perf_counter_ns()
        return (sent - started) / count / 1e3, (drained - started) / count / 1e3, (done - drained) / count / 1e3

    def close(self) -> None:
        for close in self._closers:
            close()


def sockets_alone(directory: Path, rounds: int, count: int) -> dict:
    kinds = ["ipc PUSH", "ipc ROUTER", "tcp plain", "tcp CURVE"]
    pairs = {kind: _Pair(kind, directory) for kind in kinds}
    results: dict = {}
    try:
        for shape, payload in {"decode 64x1": _message(64, 1), "prefill 4x512": _message(4, 512)}.items():
            samples: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in kinds}
            for _ in range(rounds):
                for kind in kinds:
                    samples[kind].append(pairs[kind].measure(payload, count))
            results[shape] = {"bytes": len(payload)}
            for kind, values in samples.items():
                columns = zip(("send_us", "burst_send_and_receive_us", "one_at_a_time_us"), zip(*values))
                results[shape][kind] = {name: round(statistics.median(column), 2) for name, column in columns}
    finally:
        for pair in pairs.values():
            pair.close()
    return results


def _knock(endpoint: str, server_key: bytes) -> subprocess.Popen:
    """A stray process that connects with a key the producer refuses; ZeroMQ retries every 100 ms."""
    code = (
        "import sys, time, zmq\n"
        "s = zmq.Context().socket(zmq.DEALER)\n"
        "s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()\n"
        f"s.curve_serverkey = {server_key!r}\n"
        f"s.connect({endpoint!r})\n"
        "time.sleep(3600)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def producer_steps(directory: Path, rounds: int, steps: int, hidden: int) -> dict:
    requests = 64
    os.environ["HSCAPTURE_KEYS"] = str(directory / "keys")
    endpoints = {"ipc": f"ipc://{directory}/run", "tcp CURVE": f"tcp://127.0.0.1:{_free_base()}"}
    producers: dict[str, Producer] = {}
    consumers = []
    for name, endpoint in endpoints.items():
        config = CaptureConfig(
            layers=(1,), hidden_size=hidden, num_layers=4, dtype="bfloat16", policy="drop", endpoint=endpoint,
            slot_bytes=requests * 2 * hidden * 2, ring_bytes=64 * requests * 2 * hidden * 2, max_step_rows=requests,
        )  # fmt: skip
        producers[name] = Producer(config, tensor_descriptions=["synthetic"] * 2)
        command = [sys.executable, "-m", "hscapture", "consume", "--endpoint", endpoint, "--discard", "--quiet"]
        consumers.append(subprocess.Popen([*command, "--exit-on-eos", "--watch-pid", str(os.getpid())]))
    for producer in producers.values():
        deadline = time.monotonic() + 60
        while not producer.attached:
            assert time.monotonic() < deadline, "no consumer attached"
            producer.poll()
            time.sleep(0.01)
    states = [torch.randn(requests, hidden).bfloat16() for _ in range(2)]
    ids, rows, positions, tokens = [f"r{i}" for i in range(requests)], [1] * requests, np.arange(64), np.arange(64)
    auth = producers["tcp CURVE"]._sockets._auth
    auth_thread = auth.thread.native_id if auth is not None else None
    cpu_before = _thread_cpu_s(auth_thread)

    def run(producer: Producer) -> list[float]:
        times = []
        for i in range(steps):
            t0 = time.perf_counter_ns()
            producer.capture_step(states, ids, rows, positions, tokens)
            times.append((time.perf_counter_ns() - t0) / 1e3)
            if i % 8 == 7:
                time.sleep(0.002)  # the consumer keeps up: nothing is dropped (not timed)
        return times

    samples: dict[str, list[float]] = {"ipc": [], "tcp CURVE": [], "tcp CURVE, stray knocking every 100 ms": []}
    knocker = _knock(endpoints["tcp CURVE"], ensure_keys().public)
    time.sleep(1.0)
    knocker.send_signal(signal.SIGSTOP)  # it knocks only in its own rounds
    try:
        for producer in producers.values():
            run(producer)  # warm-up, not counted
        names = list(samples)
        for round_index in range(rounds):
            for name in names[round_index % 3 :] + names[: round_index % 3]:  # each variant first in turn
                knocking = name.endswith("every 100 ms")
                if knocking:
                    knocker.send_signal(signal.SIGCONT)
                    time.sleep(0.3)
                samples[name].append(statistics.median(run(producers[name.split(",")[0]])))
                if knocking:
                    knocker.send_signal(signal.SIGSTOP)
        cpu_auth = _thread_cpu_s(auth_thread) - cpu_before
        counters = {name: producer.close().to_dict() for name, producer in producers.items()}
    finally:
        knocker.kill()
        knocker.wait()
        for producer in producers.values():
            producer.close()
        for consumer in consumers:
            consumer.wait(30)
    ipc = statistics.median(samples["ipc"])
    return {
        "requests_per_step": requests,
        "hidden": hidden,
        "tensors": 2,
        "steps_per_round": steps,
        "rounds": rounds,
        "capture_step_median_us": {name: round(statistics.median(v), 1) for name, v in samples.items()},
        "ratio_to_ipc": {name: round(statistics.median(v) / ipc, 3) for name, v in samples.items()},
        "authenticator_thread_cpu_s": round(cpu_auth, 4),
        "rows_dropped": {name: c["rows_dropped"] for name, c in counters.items()},
    }


def _thread_cpu_s(native_id: int | None) -> float:
    """User + system CPU seconds of one thread of this process (from /proc)."""
    if native_id is None:
        return 0.0
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--messages", type=int, default=2000, help="messages per socket measurement")
    parser.add_argument("--steps", type=int, default=400, help="capture steps per producer measurement")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS / "transport-security-cpu.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hsc-bench-") as tmp:
        directory = Path(tmp)
        directory.chmod(0o700)
        alone = sockets_alone(directory, args.rounds, args.messages)
        steps = producer_steps(directory, args.rounds, args.steps, args.hidden)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    record = {
        "benchmark": "transport_security",
        "command": shlex.join(["python", "benchmarks/transport_security.py", *(argv or sys.argv[1:])]),
        "commit": commit.stdout.strip(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "protocol": protocol.PROTOCOL_VERSION},
        "method": "medians over rounds of per-message (sockets) or per-step (producer) medians; variants "
        "interleaved within each round",
        "sockets_alone": alone,
        "producer": steps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({"sockets_alone": alone, "producer": steps}, indent=2))


if __name__ == "__main__":
    main()
