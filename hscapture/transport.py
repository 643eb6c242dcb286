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


def token_path(base: str) -> Path | None:
    """Where an ipc:// producer leaves its per-run token (in the 0700 socket directory)."""
    if not base.startswith("ipc://"):
        return None
    return Path(base[len("ipc://") :] + "-token")


def publish_token(base: str, token: str) -> None:
    """Write the run's token for consumers of this user (mode 0600, atomically)."""
    path = token_path(base)
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    os.replace(tmp, path)


def read_token(base: str) -> str:
    """The current run's token of an ipc:// producer ('' when none is published)."""
    path = token_path(base)
    try:
        return path.read_text().strip() if path is not None else ""
    except OSError:
        return ""


def withdraw_token(base: str, token: str) -> None:
    """Remove our token file, unless a newer run has replaced it."""
    if read_token(base) == token:
        path = token_path(base)
        assert path is not None
        path.unlink(missing_ok=True)
