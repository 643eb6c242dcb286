"""``hscapture serve``: an SGLang HTTP server with capture on, plus the consumer(s) writing the store.

The server runs unchanged (``python -m sglang.launch_server`` with the user's arguments) plus
the flags that make it keep the EAGLE-3 states; the hscapture plugin in its scheduler process
publishes them (``drop`` policy by default: serving never waits). One consumer per stream
writes the store: one stream, or one per attention-DP group (``DIR/dp<rank>``).

Ctrl-C (or SIGTERM, SIGHUP) stops the server the graceful way SGLang has: SIGTERM to it, it
finishes the requests it serves, then each scheduler's hscapture plugin ends its stream (end of
stream, a clean end in the store) before the scheduler exits; each consumer then finishes the
store and exits. The server runs in its own session, so a terminal's Ctrl-C reaches ``serve``
alone, not SGLang's processes midway; it gets SIGTERM too when ``serve`` dies. A second Ctrl-C
kills the server; the consumers then record that their producer died.
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
from hscapture.integrations.sglang import (
    CPU_SERVER_ARGS,
    ENV,
    PluginSettings,
    cpu_host_env,
    endpoint_for,
    server_args,
)
from hscapture.integrations.sglang_models import launch_plan
from hscapture.keys import KEYS_ENV, ensure_keys
from hscapture.selection import check_rate
from hscapture.store.collection import open_store
from hscapture.store.files import prepare_store_dir


@dataclass
class ServeOptions:
    """What ``hscapture serve`` does; every field is the command-line flag of the same name."""

    #: Store directory (appended to if it exists; one per attention-DP group below it with DP).
    out: Path
    #: Layer ids and ranges, k = the residual stream entering decoder layer k: 2,16,29 or 1-31:2, or all (every
    #: layer this architecture's capture reaches, from 1); default SGLang's EAGLE-3 layers.
    layers: str | tuple[int, ...] | None = field(default=None, metadata=flag(parse=layer_spec))
    #: Capture this share of the requests (0 < rate <= 1), chosen by a hash of the request id, so a rerun with the
    #: same ids picks the same ones; the others cost the engine only the check (default: every request).
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
    #: Bytes of one ring slot (default: room for 512 rows, a decode run of 8 steps at batch 64; at least 4 MiB).
    slot_bytes: int | None = None
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


def option_value(args: list[str], *names: str) -> str | None:
    """The value of an ``--name value`` or ``--name=value`` option in a command line."""
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def capture_streams(args: list[str]) -> int:
    """How many capture streams the server will publish; refuses what cannot be captured."""
    pp = int(option_value(args, "--pp-size", "--pipeline-parallel-size") or 1)
    if pp > 1:
        raise ValueError("hscapture cannot capture with pipeline parallelism (--pp-size > 1); use TP or DP")
    dp = int(option_value(args, "--dp-size", "--data-parallel-size") or 1)
    return dp


def serve(options: ServeOptions, sglang_args: list[str]) -> int:
    """Run server and consumers until the server exits or we are told to stop; the server's status."""
    model = option_value(sglang_args, "--model-path", "--model")
    if model is None:
        raise ValueError("give SGLang's --model-path after --, e.g. hscapture serve --out DIR -- --model-path M")
    streams = capture_streams(sglang_args)
    check_rate(options.sample_rate)
    prepare_store_dir(ensure_writable_dir(Path(options.out), "--out"), options.share_group)
    base = options.endpoint or f"ipc:///tmp/hscapture-{os.getuid()}/serve-{os.getpid()}"
    plan = launch_plan(model, options.layers)  # refuses what SGLang's capture cannot give, before it starts
    settings = PluginSettings(
        endpoint=base,
        capture_last=options.capture_last,
        policy=options.policy,
        slot_bytes=options.slot_bytes,
        meta={
            "launcher": "hscapture serve",
            "server_args": sglang_args,
            **({"sample_rate": options.sample_rate} if options.sample_rate is not None else {}),
        },
        graph_copy=options.graph_copy,
        layers=list(plan.layers),
        http_server=True,
        sample_rate=options.sample_rate,
    )
    env = {**os.environ, ENV: settings.to_env()}
    keys_args: list[str] = []
    if base.startswith("tcp://"):  # both sides are ours: make the key pair before the consumers look for it
        ensure_keys(options.keys)
        if options.keys is not None:
            env[KEYS_ENV] = str(options.keys)
            keys_args = ["--keys", str(options.keys)]
    extra = server_args(plan.sglang_ids)
    cpu_env = cpu_host_env()
    if cpu_env:  # no NVIDIA driver here: SGLang's CPU path
        env.update(cpu_env)
        if option_value(sglang_args, "--device") is None:
            extra += CPU_SERVER_ARGS
    folders = _store_folders(Path(options.out), streams)
    consumers = [
        subprocess.Popen(
            consume_command(
                endpoint_for(base, rank, streams),
                folder,
                "--exit-on-eos",
                "--shard-bytes",
                str(options.shard_bytes),
                *keys_args,
                *(("--share-group", options.share_group) if options.share_group is not None else ()),
                *options.consumer_args,
            ),
            start_new_session=True,  # a terminal's Ctrl-C reaches us; we stop the consumers in order
        )
        for rank, folder in enumerate(folders)
    ]
    command = [sys.executable, "-m", "sglang.launch_server", *sglang_args, *extra]
    print(f"hscapture serve: {' '.join(command)}", file=sys.stderr, flush=True)
    server = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_stop_with_parent)
    stopping: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        if server.poll() is None and len(stopping) == 1:
            print(
                "hscapture serve: stopping: SGLang finishes the requests it serves, then capture ends; "
                "Ctrl-C again to kill it",
                file=sys.stderr,
                flush=True,
            )
            server.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = _wait_server(server, stopping, list(zip(folders, consumers)))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop_consumers(consumers, options.grace_s)
    _summary(folders)
    return 0 if stopping else code


def _stop_with_parent() -> None:
    """In the server's process before SGLang starts: SIGTERM (SGLang's graceful stop) when ``serve`` dies, even
    by SIGKILL, as SGLang's own processes follow theirs (Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _store_folders(out: Path, streams: int) -> list[Path]:
    """One store per capture stream: ``out`` itself, or ``out/dp<rank>`` with data parallelism."""
    return [out / f"dp{rank}" for rank in range(streams)] if streams > 1 else [out]


def _wait_server(server: subprocess.Popen, stopping: list[int], consumers: list[tuple[Path, subprocess.Popen]]) -> int:
    """The server's exit status; says at once when a consumer stops while the server serves on."""
    told: set[Path] = set()
    while True:
        try:
            return server.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if stopping and len(stopping) > 1:  # a second Ctrl-C: do not wait for a graceful stop
                server.kill()
            for folder, consumer in consumers:
                if stopping or folder in told or consumer.poll() is None:
                    continue
                told.add(folder)
                why = capture_failure(folder) or f"its consumer exited with code {consumer.returncode}"
                print(
                    f"hscapture serve: capture into {folder} stopped: {why}; SGLang serves on without capture",
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
