"""``hscapture serve``: an engine's HTTP server with capture on, plus the consumer(s) writing the store.

The server runs unchanged (SGLang's ``python -m sglang.launch_server``, or ``vllm serve``, with the user's arguments)
plus what makes it keep the EAGLE-3 states; the hscapture plugin in its processes publishes them (``drop`` policy by
default: serving never waits). What is engine-specific (the command, its flags, the plugin's settings, what is
refused) is each integration's ``server_launch``; the rest is here. One consumer per stream writes the store: one
stream, or one per SGLang attention-DP group or vLLM DP rank (``DIR/dp<rank>``).

Ctrl-C (or SIGTERM, SIGHUP) stops the server the graceful way each engine has: SIGTERM to it; it finishes the
requests it serves (vLLM for its ``--shutdown-timeout`` at most, which the launch sets), then the plugin ends its
stream (end of stream, a clean end in the store) as the engine shuts down; each consumer then finishes the
store and exits. The server runs in its own session, so a terminal's Ctrl-C reaches ``serve`` alone, not the
engine's processes midway; it gets SIGTERM too when ``serve`` dies. A second Ctrl-C kills the server; the consumers
then record that their producer died. A consumer killed by a signal while the server serves is replaced: the new one
attaches to the same stream, records the killed one's run as ended by its death, and the rows lost meanwhile are
counted as dropped (under ``drop``; ``block`` waits for it).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hscapture.config import POLICIES, MiB, ensure_writable_dir, flag, layer_spec
from hscapture.consumer import consume_command
from hscapture.inspection import capture_failure
from hscapture.integrations.engines import ServeCapture, ServerLaunch, endpoint_for
from hscapture.keys import KEYS_ENV, ensure_keys
from hscapture.selection import check_rate
from hscapture.store.collection import open_store
from hscapture.store.files import prepare_store_dir

#: The engines whose servers ``serve`` runs.
ENGINES = ("sglang", "vllm")


@dataclass
class ServeOptions:
    """What ``hscapture serve`` does; every field is the command-line flag of the same name."""

    #: Store directory (appended to if it exists; one per DP group or rank below it with DP).
    out: Path
    #: The engine whose OpenAI-compatible server runs: ``sglang`` (``python -m sglang.launch_server ARGS``) or
    #: ``vllm`` (``vllm serve ARGS``).
    engine: str = field(default="sglang", metadata=flag(choices=ENGINES))
    #: Layer ids and ranges, k = the residual stream entering decoder layer k: 2,16,29 or 1-31:2, or all (every
    #: layer this architecture's capture reaches, from 1); default the engine's EAGLE-3 layers.
    layers: str | tuple[int, ...] | None = field(default=None, metadata=flag(parse=layer_spec))
    #: Capture this share of the requests (0 < rate <= 1), chosen by a hash of the request id (vLLM: its store key), so
    #: a rerun with the same ids picks the same ones; the others leave no rows (default: every request).
    sample_rate: float | None = None
    #: Also capture the post-norm final hidden state (what the LM head reads).
    capture_last: bool = field(default=True, metadata=flag(name="--last"))
    #: ``drop`` (serving never waits; drops are counted) or ``block`` (nothing lost).
    policy: str = field(default="drop", metadata=flag(choices=POLICIES))
    #: Base ZeroMQ endpoint (default: a private ipc:// path).
    endpoint: str | None = None
    #: Key directory for a tcp:// endpoint (``hscapture keys`` makes it); by default ``$HSCAPTURE_KEYS``
    #: or ``~/.config/hscapture/keys``.
    keys: Path | None = None
    #: Target bytes per shard.
    shard_bytes: int = 256 * MiB
    #: Seconds between the consumer's flushes to disk (default: the consumer's): a consumer killed loses at most
    #: this much of what it copied out.
    flush_s: float | None = None
    #: Bytes of one ring slot (default: room for 2048 rows, a decode run of 16 steps at batch 128; at least 4 MiB).
    slot_bytes: int | None = None
    #: Bytes of the ring, a whole number of ``--slot-bytes`` slots (default: two of the engine's largest steps, at
    #: least 8 slots). Under ``drop`` a consumer that falls this many slots behind (each step's rows take one until
    #: released) makes the producer drop rows: more slots ride out longer stalls of a busy host.
    ring_bytes: int | None = None
    #: On a GPU, copy decode rows from inside SGLang's decode CUDA graphs, planned by the forward hook (no
    #: launch per step); --no-graph-copy: one launch per decode step from the hook.
    graph_copy: bool = True
    #: Seconds the consumers get to close the store after the server stopped.
    grace_s: float = 30.0
    #: Extra arguments for the consumer processes (tests).
    consumer_args: list[str] = field(default_factory=list)
    #: Let this group read the store (directory setgid 2750, files 0640); by default it is private
    #: to you (0700, 0600), or shared as an existing store already is.
    share_group: str | None = None


def serve(options: ServeOptions, engine_args: list[str]) -> int:
    """Run server and consumers until the server exits or we are told to stop; the server's status."""
    if options.engine not in ENGINES:
        raise ValueError(f"--engine: {options.engine!r} is unknown; use one of {ENGINES}")
    check_rate(options.sample_rate)
    check_ring(options.slot_bytes, options.ring_bytes)
    base = options.endpoint or f"ipc:///tmp/hscapture-{os.getuid()}/serve-{os.getpid()}"
    capture = ServeCapture(
        endpoint=base,
        layers=options.layers,
        capture_last=options.capture_last,
        policy=options.policy,
        slot_bytes=options.slot_bytes,
        ring_bytes=options.ring_bytes,
        meta={
            "launcher": "hscapture serve",
            "server_args": engine_args,
            **({"sample_rate": options.sample_rate} if options.sample_rate is not None else {}),
        },
        graph_copy=options.graph_copy,
        sample_rate=options.sample_rate,
    )
    launch = _server_launch(options.engine, engine_args, capture)  # refuses what cannot be captured, before it starts
    prepare_store_dir(ensure_writable_dir(Path(options.out), "--out"), options.share_group)
    env = {**os.environ, **launch.env}
    keys_args: list[str] = []
    if base.startswith("tcp://"):  # both sides are ours: make the key pair before the consumers look for it
        ensure_keys(options.keys)
        if options.keys is not None:
            env[KEYS_ENV] = str(options.keys)
            keys_args = ["--keys", str(options.keys)]
    folders = _store_folders(Path(options.out), launch.streams)
    consumers = [
        _Consumer(
            folder,
            consume_command(
                endpoint_for(base, rank, launch.streams),
                folder,
                "--exit-on-eos",
                "--shard-bytes",
                str(options.shard_bytes),
                *(("--flush-s", str(options.flush_s)) if options.flush_s is not None else ()),
                *keys_args,
                *(("--share-group", options.share_group) if options.share_group is not None else ()),
                *options.consumer_args,
            ),
        )
        for rank, folder in enumerate(folders)
    ]
    print(f"hscapture serve: {' '.join(launch.command)}", file=sys.stderr, flush=True)
    server = subprocess.Popen(launch.command, env=env, start_new_session=True, preexec_fn=_stop_with_parent)
    stopping: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        if server.poll() is None and len(stopping) == 1:
            print(f"hscapture serve: stopping: {launch.on_stop}; Ctrl-C again to kill it", file=sys.stderr, flush=True)
            server.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = _wait_server(server, stopping, consumers, launch.name)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop_consumers([c.process for c in consumers], options.grace_s)
    _summary(folders)
    return 0 if stopping else code


def check_ring(slot_bytes: int | None, ring_bytes: int | None) -> None:
    """Refuse, before the engine starts, a ring that is not a whole number (at least 2) of the slots given.

    Raises:
        ValueError: ``ring_bytes`` without ``slot_bytes`` (the default slot depends on the model's rows), or not
            a whole number of at least 2 slots.
    """
    if ring_bytes is None:
        return
    if slot_bytes is None:
        raise ValueError(
            "--ring-bytes: give --slot-bytes with it (the ring is a whole number of slots, and the default slot "
            "depends on the model's row size)"
        )
    if ring_bytes < 2 * slot_bytes or ring_bytes % slot_bytes:
        raise ValueError(
            f"--ring-bytes: {ring_bytes} is not a whole number of at least 2 slots of --slot-bytes {slot_bytes}; "
            f"use {max(2, ring_bytes // slot_bytes) * slot_bytes}"
        )


def _server_launch(engine: str, engine_args: list[str], capture: ServeCapture) -> ServerLaunch:
    """The engine's server launch (its integration's ``server_launch``), imported for the engine asked for only."""
    if engine == "vllm":
        from hscapture.integrations.vllm import server_launch
    else:
        from hscapture.integrations.sglang import server_launch
    return server_launch(engine_args, capture)


class _Consumer:
    """One stream's consumer process, started again by :meth:`restart` (same command, same store)."""

    def __init__(self, folder: Path, command: list[str]) -> None:
        self.folder, self.command = folder, command
        #: Told the user that capture into :attr:`folder` stopped for good.
        self.told = False
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        # its own session: a terminal's Ctrl-C reaches us; we stop the consumers in order
        return subprocess.Popen(self.command, start_new_session=True)

    def restart(self) -> None:
        self.process = self._start()


def _stop_with_parent() -> None:
    """In the server's process before the engine starts: SIGTERM (its graceful stop) when ``serve`` dies, even by
    SIGKILL, as the engine's own processes follow theirs (Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _store_folders(out: Path, streams: int) -> list[Path]:
    """One store per capture stream: ``out`` itself, or ``out/dp<rank>`` with data parallelism."""
    return [out / f"dp{rank}" for rank in range(streams)] if streams > 1 else [out]


def _wait_server(server: subprocess.Popen, stopping: list[int], consumers: list[_Consumer], engine: str) -> int:
    """The server's exit status. A consumer killed by a signal meanwhile is replaced; one that exited (a capture
    failure, an error it reported) is said at once while the server serves on."""
    while True:
        try:
            return server.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if stopping and len(stopping) > 1:  # a second Ctrl-C: do not wait for a graceful stop
                server.kill()
            for consumer in consumers:
                code = consumer.process.poll()
                if stopping or consumer.told or code is None:
                    continue
                if code < 0:  # killed (a user, the OOM killer): the next one records the gap and captures on
                    print(
                        f"hscapture serve: the consumer writing {consumer.folder} was killed "
                        f"({signal.Signals(-code).name}); starting another: the rows lost meanwhile are counted",
                        file=sys.stderr,
                        flush=True,
                    )
                    consumer.restart()
                    continue
                consumer.told = True
                why = capture_failure(consumer.folder) or f"its consumer exited with code {code}"
                print(
                    f"hscapture serve: capture into {consumer.folder} stopped: {why}; {engine} serves on without "
                    "capture",
                    file=sys.stderr,
                    flush=True,
                )


def _stop_consumers(consumers: list[subprocess.Popen], grace_s: float) -> None:
    """Consumers close the store once they see the server's scheduler gone; SIGTERM after the grace."""
    deadline = time.monotonic() + grace_s
    for consumer in consumers:
        try:
            consumer.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            consumer.terminate()  # the consumer finishes the store on SIGTERM
            try:
                consumer.wait(60)
            except subprocess.TimeoutExpired:
                consumer.kill()
                consumer.wait()


def _summary(folders: list[Path]) -> None:
    for folder in folders:
        try:
            summary = open_store(folder).summary()
        except Exception as exc:  # nothing was captured (the server never served), or no store
            print(f"hscapture serve: no store at {folder} ({exc})", file=sys.stderr)
            continue
        print(
            f"store {folder}: {summary['complete']} complete requests, {summary['incomplete']} incomplete, "
            f"{summary['rows']} rows, {summary['rows_dropped']} rows dropped",
            file=sys.stderr,
        )
