"""The wire between producer and consumer: endpoints, sockets, and who may use them.

Two sockets per run, both bound by the producer (zguide habit: the long-lived side binds):

* ``announce``: a ROUTER that addresses every message to one consumer by its id (the consumer
  connects a DEALER whose routing id is its consumer id), so a second process connected there is
  never sent what is meant for the attached consumer.
* ``release``: a PULL that takes hellos and releases from every connected consumer.

Who may connect:

* ``ipc://``: the socket files live in a directory of this user closed to others (0700); one
  that is another user's, a link, or open to others is refused. The producer's per-run token
  sits beside the sockets in a 0600 file that only this user's consumers can read.
* ``tcp://``: ZeroMQ's CURVE security. The producer's sockets are CURVE servers holding this
  user's key pair; a ZAP handler (pyzmq's :class:`~zmq.auth.thread.ThreadAuthenticator`, a thread
  that runs only while a connection shakes hands, never per message) admits only the client keys
  its key directory lists (:mod:`hscapture.keys`). A peer without an admitted key never completes
  a handshake: it can neither say hello nor receive a byte. A consumer is a CURVE client with its
  own key pair and the producer's public key, and learns at once when its key is refused.

A producer removes its socket and token files on close and, on start, those that dead producers
left in its socket directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils.monitor import parse_monitor_message

from hscapture.errors import AccessError
from hscapture.keys import PUBLIC as PUBLIC_KEY
from hscapture.keys import KeyGate, KeyPair, default_keys_dir, ensure_keys, load_keys, read_public_key
from hscapture.ownership import check_private_dir, private_dir, read_private, reclaim_temp, unlink_ours, write_private

log = logging.getLogger(__name__)

#: ZAP domain of hscapture's CURVE sockets.
ZAP_DOMAIN = "hscapture"
#: Handshake failures a consumer sees before it gives up on a producer that keeps failing them.
_HANDSHAKE_FAILURES = 3
_ROLES = ("announce", "release")


def announce_endpoint(base: str) -> str:
    """Producer ROUTER (bound) -> consumer DEALER: layout, chunks, request events, end of stream, refusals."""
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


def _ipc_path(base: str) -> Path | None:
    """The socket path prefix of an ipc:// endpoint on the file system (None: tcp://, or Linux's abstract names)."""
    if not base.startswith("ipc://") or base.startswith("ipc://@"):
        return None
    return Path(base[len("ipc://") :])


def prepare_ipc_dir(base: str) -> None:
    """Make sure the directory of an ipc:// endpoint is this user's and closed to others (0700).

    Raises:
        AccessError: the directory is another user's, a link, or open to others.
    """
    path = _ipc_path(base)
    if path is not None:
        private_dir(path.parent, "socket directory")


def make_socket(context: zmq.Context, kind: int, *, immediate: bool = False) -> zmq.Socket:
    """A socket that never lingers on close and, with ``immediate``, queues only to live peers."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    return sock


class ProducerSockets:
    """The producer's two bound sockets (see the module docstring).

    Args:
        endpoint: the run's base endpoint.
        keys: key directory for a tcp:// endpoint (made, with a key pair, if missing); None = default.

    Raises:
        AccessError: the socket or key directory cannot be trusted.
        zmq.ZMQError: the endpoint is in use (by a live producer, for ipc://).
    """

    def __init__(self, endpoint: str, keys: Path | None = None) -> None:
        self.endpoint = endpoint
        self._files: list[tuple[Path, int, int]] = []
        self._auth = None
        path = _ipc_path(endpoint)
        with contextlib.ExitStack() as binding:
            if path is not None:
                prepare_ipc_dir(endpoint)
                binding.enter_context(binding_in(path.parent))
                reclaim_socket_dir(path.parent)
                for role in _ROLES:
                    if _listening(Path(f"{path}-{role}")):
                        raise zmq.ZMQError(
                            errno.EADDRINUSE, f"endpoint {endpoint!r}: another producer is running there"
                        )
            self._bind(endpoint, keys)

    def _bind(self, endpoint: str, keys: Path | None) -> None:
        """Make both sockets and bind them (a tcp:// endpoint: as CURVE servers admitting the keys of ``keys``)."""
        if endpoint.startswith("tcp://"):
            folder = Path(keys or default_keys_dir())
            pair = ensure_keys(folder)
            gate = KeyGate(folder)
            self.context = zmq.Context()  # our own: a context has one ZAP handler
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self.context, log=logging.getLogger("hscapture.zap"))
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN, gate)
        else:
            self.context = zmq.Context.instance()
        self.announce = make_socket(self.context, zmq.ROUTER)
        self.announce.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer or full pipe: an error, never a silent drop
        self.announce.setsockopt(zmq.SNDHWM, 100_000)
        self.release = make_socket(self.context, zmq.PULL)
        try:
            for sock, where in (
                (self.announce, announce_endpoint(endpoint)),
                (self.release, release_endpoint(endpoint)),
            ):
                if self._auth is not None:
                    sock.curve_server = True
                    sock.curve_publickey, sock.curve_secretkey = pair.public, pair.secret
                    sock.zap_domain = ZAP_DOMAIN.encode()
                sock.bind(where)
                self._remember(where)
        except zmq.ZMQError as exc:
            self.close()
            raise zmq.ZMQError(
                exc.errno, f"endpoint {endpoint!r}: {exc.strerror}; is another producer running there?"
            ) from None

    def send(self, peer: str, payload: bytes) -> bool:
        """Send ``payload`` to consumer ``peer`` without waiting; False: it is not connected, or its queue is full."""
        try:
            self.announce.send(peer.encode(), zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # Again: its queue is full; EHOSTUNREACH: no such peer (yet, or any more)
            if exc.errno in (zmq.EAGAIN, zmq.EHOSTUNREACH):
                return False
            raise
        self.announce.send(payload, zmq.NOBLOCK)  # the routing frame was taken: the message part always follows
        return True

    def close(self) -> None:
        """Close both sockets and the authenticator; remove our socket files. Idempotent."""
        self.announce.close(linger=0)
        self.release.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
            self.context.term()
        for path, device, inode in self._files:  # only the files we bound: a later producer may own the name
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(path)
                if (info.st_dev, info.st_ino) == (device, inode):
                    unlink_ours(path)
        self._files = []

    def _remember(self, where: str) -> None:
        path = _ipc_path(where)
        if path is not None:
            info = os.lstat(path)
            self._files.append((path, info.st_dev, info.st_ino))


@dataclass(frozen=True)
class ClientCredentials:
    """What a consumer of a tcp:// endpoint shakes hands with: its key pair and the producer's public key."""

    pair: KeyPair
    producer_key: bytes
    #: Where they came from, for messages.
    keys_dir: Path
    producer_key_file: Path


def client_credentials(
    endpoint: str, keys: Path | None = None, producer_key: Path | None = None
) -> ClientCredentials | None:
    """Check what a consumer needs before it opens anything (None for ipc://, which needs no keys).

    Args:
        endpoint: the producer's base endpoint.
        keys: key directory for a tcp:// endpoint (this consumer's key pair); None = default.
        producer_key: the producer's public key file; None = ``id.key`` of ``keys`` (a producer of the same user).

    Raises:
        AccessError: no usable key pair or producer key for tcp://; an ipc:// socket directory that exists
            and is not this user's private one.
    """
    path = _ipc_path(endpoint)
    if path is not None and path.parent.exists():
        check_private_dir(path.parent, "socket directory")
    if not endpoint.startswith("tcp://"):
        return None
    folder = Path(keys or default_keys_dir())
    key_file = Path(producer_key or folder / PUBLIC_KEY)
    return ClientCredentials(load_keys(folder), read_public_key(key_file, "producer key file"), folder, key_file)


class ConsumerSockets:
    """The consumer's two connected sockets: a DEALER named ``consumer_id`` on announce, a PUSH on release.

    Args:
        endpoint: the producer's base endpoint.
        consumer_id: this consumer's id (the routing id the producer addresses it by).
        curve: from :func:`client_credentials`; required for tcp://.

    Raises:
        AccessError: an ipc:// socket directory that is not this user's private one.
    """

    def __init__(self, endpoint: str, consumer_id: str, curve: ClientCredentials | None = None) -> None:
        if endpoint.startswith("tcp://") and curve is None:
            raise ValueError(f"endpoint {endpoint!r}: a tcp:// consumer needs CURVE credentials (client_credentials)")
        self.endpoint = endpoint
        self.curve = curve
        self._monitor: zmq.Socket | None = None
        self._failures = 0
        prepare_ipc_dir(endpoint)
        self.context = zmq.Context.instance()
        self.announce = make_socket(self.context, zmq.DEALER)
        self.announce.setsockopt(zmq.ROUTING_ID, consumer_id.encode())
        self.release = make_socket(self.context, zmq.PUSH, immediate=True)
        if curve is not None:
            for sock in (self.announce, self.release):
                sock.curve_publickey, sock.curve_secretkey = curve.pair.public, curve.pair.secret
                sock.curve_serverkey = curve.producer_key
            self._monitor = self.release.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            )
        self.announce.connect(announce_endpoint(endpoint))
        self.release.connect(release_endpoint(endpoint))

    def check(self) -> None:
        """Raise :class:`AccessError` when the producer refused our key or handshakes keep failing (tcp://)."""
        monitor, curve = self._monitor, self.curve
        while monitor is not None and curve is not None and monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failures = 0
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise AccessError(
                    f"the producer at {self.endpoint} refused this consumer's key {curve.keys_dir / PUBLIC_KEY} "
                    f"(ZAP status {event['value']}); admit it on the producer's side with `hscapture keys --allow "
                    "<a copy of that file>`, then start this consumer again"
                )
            self._failures += 1
            if self._failures >= _HANDSHAKE_FAILURES:
                raise AccessError(
                    f"the CURVE handshake with {self.endpoint} failed {self._failures} times: the producer there "
                    f"does not hold the key in {curve.producer_key_file}, or is no hscapture producer of this version; "
                    "copy the producer's id.key (`hscapture keys` on its side shows it) and pass it with --producer-key"
                )

    def close(self) -> None:
        if self._monitor is not None:
            self.release.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self.announce.close(linger=0)
        self.release.close(linger=0)


# ---------------------------------------------------------------------- tokens


def token_path(base: str) -> Path | None:
    """Where an ipc:// producer leaves its per-run token (in the 0700 socket directory)."""
    path = _ipc_path(base)
    return None if path is None else Path(f"{path}-token")


def publish_token(base: str, token: str) -> None:
    """Write the run's token for consumers of this user (0600, atomically, never through a link)."""
    path = token_path(base)
    if path is not None:
        write_private(path, token.encode())


def read_token(base: str) -> str:
    """The current run's token of an ipc:// producer ('' when none is published).

    Raises:
        AccessError: the token file is a link, another user's, or readable by others.
    """
    path = token_path(base)
    data = None if path is None else read_private(path, "token file")
    return "" if data is None else data.decode(errors="replace").strip()


def withdraw_token(base: str, token: str) -> None:
    """Remove our token file, unless a newer run has replaced it."""
    path = token_path(base)
    with contextlib.suppress(AccessError):
        if path is not None and read_token(base) == token:
            unlink_ours(path)


# ---------------------------------------------------------------------- leftovers of dead producers

_SOCKET = re.compile(r"^(.+)-(announce|release)$")


def reclaim_socket_dir(directory: Path) -> list[Path]:
    """Remove what dead producers left in a socket directory of ours; the paths removed.

    A socket file nobody listens on any more (a connection is refused), a token file whose
    producer's sockets are gone, a temp file whose writer died. Files of other users are never
    touched.
    """
    removed: list[Path] = []
    uid = os.getuid()
    with os.scandir(directory) as entries:
        ours = [(entry, entry.stat(follow_symlinks=False)) for entry in entries]
    ours = [(entry, info) for entry, info in ours if info.st_uid == uid]
    for entry, info in ours:
        if stat.S_ISSOCK(info.st_mode) and _SOCKET.match(entry.name) and not _listening(Path(entry.path)):
            removed += [Path(entry.path)] if unlink_ours(Path(entry.path)) else []
        elif stat.S_ISREG(info.st_mode) and reclaim_temp(entry):
            removed.append(Path(entry.path))
    for entry, info in ours:
        base = entry.name.removesuffix("-token")
        orphan = base != entry.name and not any((directory / f"{base}-{role}").exists() for role in _ROLES)
        if orphan and stat.S_ISREG(info.st_mode) and unlink_ours(Path(entry.path)):
            removed.append(Path(entry.path))
    if removed:
        log.info("removed %d files left by dead producers in %s", len(removed), directory)
    return removed


@contextlib.contextmanager
def binding_in(directory: Path) -> Iterator[None]:
    """Held while a producer reclaims and binds in its socket directory: an ``flock`` of the directory itself (no
    file to leave behind). Between a socket file's bind and its listen a connect is refused, so a producer starting
    beside another (data-parallel jobs) would take the other's new socket for a dead producer's and remove it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):  # a file system that locks no directory (NFS): only that race is back
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _listening(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket ``path`` (a refused connect: nobody does)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # full backlog, no permission, a timeout: someone is there, or we cannot tell
    finally:
        probe.close()
    return True
