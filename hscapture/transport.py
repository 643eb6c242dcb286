"""ZeroMQ endpoints and sockets of a run, shared by both sides so their names never drift."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import zmq


def announce_endpoint(base: str) -> str:
    """Producer PUSH (bound) -> consumer PULL: layout, chunks, request events, end of stream."""
    return _derive(base, "announce", 0)


def release_endpoint(base: str) -> str:
    """Consumer PUSH -> producer PULL (bound): hello/heartbeat and slot releases."""
    return _derive(base, "release", 1)


def _derive(base: str, role: str, port_offset: int) -> str:
    if base.startswith("tcp://"):
        host, _, port = base[len("tcp://") :].rpartition(":")
        if not port.isdigit():
            raise ValueError(f"endpoint: {base!r} needs an explicit port, e.g. tcp://127.0.0.1:5557")
        return f"tcp://{host}:{int(port) + port_offset}"
    return f"{base}-{role}"


def prepare_ipc_dir(base: str) -> None:
    """Create the directory of an ipc:// endpoint, private to this user (0700)."""
    if not base.startswith("ipc://"):
        return
    directory = Path(base[len("ipc://") :]).parent
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = directory.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) != 0o700:
        directory.chmod(0o700)


def make_socket(context: zmq.Context, kind: int, *, immediate: bool = False) -> zmq.Socket:
    """A socket that never lingers on close and, with ``immediate``, queues only to live peers."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    return sock
