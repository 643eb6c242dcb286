"""What this user owns, checked before it is trusted: private directories and files, live processes.

A multi-user GPU host is the normal home of hscapture, so another user may create a directory
first that we meant to create, or plant a symbolic link where we are about to write. Hence:

* a directory we keep sockets, tokens or keys in must be ours, a real directory (no link) and
  closed to others (0700); one that is not is refused, never repaired behind the user's back;
* a file we write is created afresh under an unpredictable name of our own (:func:`temp_sibling`) with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, then renamed over its name (a link planted
  there is replaced, never followed); given a directory's descriptor (``dir_fd``), the file is made,
  renamed and removed in that directory whatever its path has come to name since it was opened;
* a path we keep a store at passes no link and no directory that another user could change
  (:func:`check_path_to`), so no one can put a directory of theirs where the user will look for it;
* a file we read a secret from is opened with ``O_NOFOLLOW`` and must be a regular file of ours
  that no one else can read (secrets) or write (public keys).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import secrets
import socket
import stat
from pathlib import Path

from hscapture.errors import AccessError

#: What every temp name of ours starts with, after its dot.
TEMP_PREFIX = "hscapture-"
#: Our temp files: ``.NAME.PID.RANDOM.tmp`` (NAME starting with TEMP_PREFIX since version 2 of the store);
#: the pid lets a later run reclaim those of a dead writer.
_TEMP = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{12}\.tmp$")

#: Secrets and keys are small; a larger file in their place is not one of ours.
_MAX_READ = 1 << 16
#: Links followed on one path before it is taken for a loop (Linux's own limit).
_MAX_LINKS = 40


def private_dir(path: Path, what: str) -> Path:
    """``path`` as a directory of this user closed to others; created with mode 0700 if missing.

    Raises:
        AccessError: it is a link, not a directory, another user's, or open to group or others;
            the message names the directory and the fix.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_private_dir(path, what)
    return path


def check_private_dir(path: Path, what: str) -> None:
    """Raise :class:`AccessError` unless ``path`` is a real directory of ours that no one else may enter."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise AccessError(
            f"{what} {path} is a symbolic link (to {os.readlink(path)!r}), which hscapture never follows: "
            "another user may have planted it; remove it, or choose another path"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise AccessError(f"{what} {path} is not a directory; remove it, or choose another path")
    fix = f"if you made it and trust its contents run `chmod 700 {path}`, else remove it"
    check_owner(info, path, what, 0o077, fix)


def check_owner(info: os.stat_result, path: Path, what: str, open_bits: int, fix_mode: str) -> None:
    """Raise :class:`AccessError` when ``info`` is another user's, or has any of ``open_bits`` set."""
    if info.st_uid != os.getuid():
        raise AccessError(
            f"{what} {path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): another user may have "
            "made it to read or redirect your files; have it removed (by its owner or root), or choose another path"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & open_bits:
        raise AccessError(f"{what} {path} has mode {mode:04o}, open to other users; {fix_mode}")


def check_path_to(path: Path, what: str) -> None:
    """Raise :class:`AccessError` unless no other user can change what ``path`` leads to.

    Walks ``path`` one name at a time, following links as the kernel would: every link on the way must be
    ours or root's (its owner can point it anywhere, at any time), and every directory holding the next name
    must be ours or root's and writable by no one else unless it is sticky (whoever may write into it can
    rename what it holds and put something of theirs in its place; a sticky directory such as /tmp lets
    each user rename only their own). The walk stops at the first name that does not exist yet: we create
    the rest. ``path`` itself, if it exists, is the caller's to check.
    """
    uid = os.getuid()
    todo = list(reversed(Path(os.getcwd(), path).parts[1:]))
    at, links, held = Path("/"), 0, set()
    while todo:
        name = todo.pop()
        if name == "..":
            at = at.parent
            continue
        if at not in held:
            _check_holder(at, path, what, uid)
            held.add(at)
        step = at / name
        try:
            info = os.lstat(step)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid not in (uid, 0):
                raise AccessError(
                    f"{what} {path}: {step} is a symbolic link of uid {info.st_uid}, not yours (uid {uid}): its owner "
                    "may point it anywhere, at any time; give a path that passes no link of another user"
                )
            links += 1
            if links > _MAX_LINKS:
                raise AccessError(f"{what} {path}: more than {_MAX_LINKS} links on the way (a loop); give another path")
            target = Path(os.readlink(step))
            at = Path("/") if target.is_absolute() else at
            todo.extend(reversed(target.parts[1:] if target.is_absolute() else target.parts))
        elif stat.S_ISDIR(info.st_mode):
            at = step
        else:
            return  # not a directory: opening what lies below it fails with its own error


def _check_holder(directory: Path, path: Path, what: str, uid: int) -> None:
    """A directory on the way to ``path`` must be ours or root's and writable by no one else unless sticky."""
    info = os.lstat(directory)
    where = f"{what} {path}: {directory}"
    if info.st_uid not in (uid, 0):
        raise AccessError(
            f"{where} belongs to uid {info.st_uid}, who may rename what it holds and put theirs in its place; "
            "put it under directories of yours (or root's)"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise AccessError(
            f"{where} has mode {mode:04o}: others may write into it, so they could rename what it holds and put "
            f"theirs in its place; make it sticky (`chmod +t {directory}`, as /tmp is) or put it under directories "
            "only you (or root) may write into"
        )


def temp_sibling(path: Path) -> Path:
    """An unpredictable temp name beside ``path``, ``.hscapture-NAME.PID.RANDOM.tmp`` (the pid lets a
    later run reclaim it if this process dies; the prefix tells it from any temp file of the user's)."""
    return path.with_name(f".{TEMP_PREFIX}{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def write_private(path: Path, data: bytes, mode: int = 0o600, dir_fd: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically, with ``mode``, never writing through a link planted anywhere.

    With ``dir_fd`` (a directory's descriptor), the file named ``path.name`` in that directory is replaced
    (``path`` only names it in messages), wherever the directory has been moved meanwhile.
    """
    path = Path(path)
    temp = temp_sibling(path)
    fd = create_private(temp, os.O_WRONLY, mode, dir_fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(in_dir(temp, dir_fd), in_dir(path, dir_fd), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(in_dir(temp, dir_fd), dir_fd=dir_fd)
        raise


def create_private(path: Path, flags: int = os.O_RDWR, mode: int = 0o600, dir_fd: int | None = None) -> int:
    """A new file at ``path`` (never an existing one, never through a link), exactly ``mode``; its descriptor.
    With ``dir_fd``, ``path.name`` in that directory."""
    flags |= os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(in_dir(path, dir_fd), flags, mode, dir_fd=dir_fd)
    if mode & 0o077:  # the umask may have taken bits the caller asked for (a shared store's group read)
        os.fchmod(fd, mode)
    return fd


def open_own(path: Path, flags: int, what: str, mode: int = 0o600, dir_fd: int | None = None) -> int:
    """Open ``path`` never through a link (created with ``mode`` if ``flags`` say so); it must be a regular
    file of ours. Returns its descriptor. With ``dir_fd``, ``path.name`` in that directory.

    Raises:
        AccessError: a link, not a regular file, or another user's; the message names the path and the fix.
        FileNotFoundError: it does not exist (and ``flags`` do not create it).
    """
    fd = open_regular(path, flags, what, mode, dir_fd)
    try:
        check_owner(os.fstat(fd), path, what, 0, "")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(
    path: Path,
    flags: int,
    what: str,
    mode: int = 0o600,
    dir_fd: int | None = None,
    error: type[Exception] = AccessError,
) -> int:
    """Open ``path`` (``path.name`` in ``dir_fd``) never through a link; it must be a regular file, anyone's.
    Returns its descriptor.

    Raises:
        error: a link, not a regular file, or it cannot be opened; the message names ``what`` and the path.
        FileNotFoundError: it does not exist (and ``flags`` do not create it).
    """
    try:
        fd = os.open(in_dir(path, dir_fd), flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(
                f"{what} {path} is a symbolic link, which hscapture never follows: another user may have planted "
                "it; remove it"
            ) from None
        raise error(f"{what} {path}: cannot open it ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{what} {path} is not a regular file; remove it")
    return fd


def in_dir(path: Path, dir_fd: int | None) -> Path | str:
    """What the ``os`` calls take for ``path``: itself, or with a directory's descriptor only its name there."""
    return path if dir_fd is None else path.name


def read_private(path: Path, what: str, *, secret: bool = True) -> bytes | None:
    """The bytes of a file of ours (None when it does not exist).

    Args:
        path: the file; a symbolic link there is refused, not followed.
        what: its name in messages (e.g. "token file").
        secret: no one else may read it (mode 0600 or stricter); otherwise no one else may write it.

    Raises:
        AccessError: a link, not a regular file, another user's, or too open; the message says the fix.
    """
    try:
        fd = open_own(path, os.O_RDONLY | os.O_NONBLOCK, what)
    except FileNotFoundError:
        return None
    try:
        fix = f"run `chmod {600 if secret else 644} {path}`"
        check_owner(os.fstat(fd), path, what, 0o077 if secret else 0o022, fix)
        return os.read(fd, _MAX_READ)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists in our pid namespace (one of another user's counts as alive)."""
    if not 0 < pid < 2**31:  # 0 and -N would signal process groups; larger ones are no pid_t
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim_temp(entry: os.DirEntry) -> bool:
    """Remove ``entry`` if it is a temp file of ours (see :func:`write_private`) whose writer died."""
    match = _TEMP.match(entry.name)
    if match is None or pid_alive(int(match.group(1))):
        return False
    return unlink_ours(Path(entry.path))


def unlink_ours(path: Path, dir_fd: int | None = None) -> bool:
    """Unlink ``path`` (``path.name`` in ``dir_fd``) if it is ours (never another user's file, even as root);
    whether it was removed."""
    try:
        if os.stat(in_dir(path, dir_fd), dir_fd=dir_fd, follow_symlinks=False).st_uid != os.getuid():
            return False
        os.unlink(in_dir(path, dir_fd), dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


@functools.cache
def process_place() -> str:
    """Where this process's pid means something: host name and pid namespace (pids compare only within one)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "?"
    return f"{socket.gethostname()}/{namespace}"
