"""CURVE keys for ``tcp://`` endpoints: this user's key pair, and the consumer keys a producer admits.

A key directory (``--keys DIR``; by default ``$HSCAPTURE_KEYS``, else ``~/.config/hscapture/keys``)
is private to its user (0700) and holds

* ``id.key_secret``: this user's key pair (0600; it never leaves the directory);
* ``id.key``: its public half, the one file to hand to the other side;
* ``allowed/*.key``: public keys of other users' consumers that this user's producers admit
  (``hscapture keys --allow FILE``). A producer always admits its own ``id.key``, so a consumer of
  the same user with the same key directory (same host, or a shared home) needs nothing more.

The files are in ZeroMQ's certificate format (what ``zmq.auth.create_certificates`` writes), but
are written and read only through :mod:`hscapture.ownership`: created 0600 without following
links, read only when they are ours and private.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from hscapture.errors import AccessError
from hscapture.ownership import private_dir, read_private, write_private

log = logging.getLogger(__name__)

#: Environment variable naming the default key directory.
KEYS_ENV = "HSCAPTURE_KEYS"
PUBLIC = "id.key"
SECRET = "id.key_secret"
ALLOWED = "allowed"
#: A certificate is a few hundred bytes; more than this is not one.
_MAX_KEY_FILE = 1 << 16

_BANNER = (
    "#   ****  Generated on {when} by hscapture  ****\n"
    "#   ZeroMQ CURVE {kind} Certificate\n"
    "#   {advice}\n\n"
    "metadata\ncurve\n"
)


def default_keys_dir() -> Path:
    """``$HSCAPTURE_KEYS``, else ``$XDG_CONFIG_HOME/hscapture/keys`` (``~/.config/hscapture/keys``)."""
    if os.environ.get(KEYS_ENV):
        return Path(os.environ[KEYS_ENV]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "hscapture" / "keys"


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, each half a 40-character Z85 string as bytes."""

    public: bytes
    secret: bytes


def ensure_keys(directory: Path | None = None) -> KeyPair:
    """This user's key pair in ``directory``, made (with the directory) if it has none yet."""
    folder = private_dir(Path(directory or default_keys_dir()), "key directory")
    if read_private(folder / SECRET, "secret key file") is None:
        public, secret = zmq.curve_keypair()
        write_private(folder / SECRET, _certificate(public, secret))
        write_private(folder / PUBLIC, _certificate(public, None))
        log.info("made a CURVE key pair in %s; consumers of other users need %s", folder, folder / PUBLIC)
    return load_keys(folder)


def load_keys(directory: Path | None = None) -> KeyPair:
    """This user's key pair from ``directory``.

    Raises:
        AccessError: there is none, or its file is not ours and private; the message says the fix.
    """
    folder = Path(directory or default_keys_dir())
    if not folder.exists():
        raise AccessError(
            f"no CURVE keys: {folder} does not exist; tcp:// endpoints need them: run `hscapture keys"
            f"{_keys_flag(folder)}` (see README, 'Who can attach')"
        )
    private_dir(folder, "key directory")
    data = read_private(folder / SECRET, "secret key file")
    if data is None:
        raise AccessError(f"no CURVE key pair in {folder}: run `hscapture keys{_keys_flag(folder)}`")
    public, secret = _parse(data, folder / SECRET)
    if secret is None:
        raise AccessError(f"secret key file {folder / SECRET} holds no secret-key line; run `hscapture keys` anew")
    return KeyPair(public, secret)


def read_public_key(path: Path, what: str = "public key file") -> bytes:
    """The public key in ``path`` (a certificate file of ours that no one else may write)."""
    data = read_private(Path(path), what, secret=False)
    if data is None:
        raise AccessError(f"{what} {path} does not exist; copy the producer's id.key there (`hscapture keys` shows it)")
    return _parse(data, Path(path))[0]


def admitted_keys(directory: Path | None = None) -> set[bytes]:
    """Public keys a producer with key directory ``directory`` admits: its own and ``allowed/*.key``."""
    folder = Path(directory or default_keys_dir())
    keys = {load_keys(folder).public}
    allowed = folder / ALLOWED
    if allowed.exists():
        private_dir(allowed, "allowed-keys directory")
        for path in sorted(allowed.glob("*.key")):
            keys.add(read_public_key(path, "allowed key file"))
    return keys


def allow_key(source: Path, directory: Path | None = None) -> Path:
    """Admit the consumer public key in ``source``: copied into ``allowed/``, named by its fingerprint.

    Raises:
        ValueError: ``source`` is missing, not a regular file, or unreadable (the message names it and the fix).
        AccessError: it holds no public key, or the key directory cannot be trusted.
    """
    key = _parse(_read_given(Path(source)), Path(source))[0]
    folder = private_dir(Path(directory or default_keys_dir()) / ALLOWED, "allowed-keys directory")
    target = folder / f"{fingerprint(key)}.key"
    write_private(target, _certificate(key, None))
    return target


def _read_given(path: Path) -> bytes:
    """The first bytes of a key file the user named (anyone's: a public key is no secret), never blocking on
    a FIFO nor reading a device without end."""
    where = f"--allow: {str(path)!r}"
    fix = "give the consumer's id.key (`hscapture keys` on the consumer's side shows where it is)"
    fd = -1
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{where} is not a regular file; {fix}")
        return os.read(fd, _MAX_KEY_FILE)
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist; {fix}") from None
    except OSError as exc:
        raise ValueError(f"{where} cannot be read ({exc.strerror}); {fix}, in a file you can read") from None
    finally:
        if fd >= 0:
            os.close(fd)


def fingerprint(public: bytes) -> str:
    """A short name for a public key (12 hex digits of its SHA-256)."""
    return hashlib.sha256(public).hexdigest()[:12]


class KeyGate:
    """The ZAP callback of a producer: admits a client key if its key directory lists it.

    Runs on pyzmq's authenticator thread, once per connection handshake (never per message). The
    list is read again when ``allowed/`` changes, so ``hscapture keys --allow`` needs no restart.
    A refused key is logged once.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._stamp = self._allowed_stamp()
        self._keys = admitted_keys(self.directory)
        self._refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        stamp = self._allowed_stamp()
        if stamp != self._stamp:
            try:
                self._keys, self._stamp = admitted_keys(self.directory), stamp
            except AccessError as exc:  # keep the keys we had; say why the new list was not taken
                log.error("allowed keys not reloaded: %s", exc)
        if key in self._keys:
            return True
        if key not in self._refused:
            self._refused.add(key)
            log.warning(
                "refused a consumer with CURVE key %s (fingerprint %s): not in %s; admit it with "
                "`hscapture keys --allow FILE`",
                key.decode(errors="replace"),
                fingerprint(key),
                self.directory / ALLOWED,
            )
        return False

    def _allowed_stamp(self) -> float:
        try:
            return os.stat(self.directory / ALLOWED).st_mtime_ns
        except FileNotFoundError:
            return 0


def _certificate(public: bytes, secret: bytes | None) -> bytes:
    kind, advice = (
        ("Secret", "DO NOT PROVIDE THIS FILE TO OTHER USERS")
        if secret
        else ("Public", "Give this file to the other side")
    )
    text = _BANNER.format(when=time.strftime("%Y-%m-%d %H:%M:%S"), kind=kind, advice=advice)
    text += f'    public-key = "{public.decode()}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode()}"\n'
    return text.encode()


def _parse(data: bytes, path: Path) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of a ZeroMQ certificate, each checked to be a Z85 CURVE key."""
    found: dict[bytes, bytes] = {}
    for line in data.splitlines():
        name, sep, value = line.strip().partition(b"=")
        if sep and name.strip() in (b"public-key", b"secret-key"):
            found[name.strip()] = value.strip(b" \t'\"")
    for name, value in found.items():
        try:
            ok = len(value) == 40 and len(z85.decode(value)) == 32
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise AccessError(f"{path}: {name.decode()} is not a CURVE key (40 Z85 characters)")
    if b"public-key" not in found:
        raise AccessError(f"{path} holds no public-key line; it is not a ZeroMQ certificate")
    return found[b"public-key"], found.get(b"secret-key")


def _keys_flag(folder: Path) -> str:
    return "" if folder == default_keys_dir() else f" --keys {folder}"
