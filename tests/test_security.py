"""Who can attach, and what is left behind: issue 12's findings 1, 2, 8, 9 and 11's tcp:// consumer.

Real processes, real sockets, real files. Where another local user is needed and the tests run
as root, a real one is made with ``useradd`` (and removed afterwards); otherwise those tests skip.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import zmq

from hscapture import open_store, protocol
from hscapture.errors import AccessError
from hscapture.keys import PUBLIC, ensure_keys
from hscapture.producer import Producer
from hscapture.protocol import PROTOCOL_VERSION, Hello
from hscapture.ring import SHM_DIR, reclaim_host_rings
from hscapture.transport import announce_endpoint, binding_in, release_endpoint, token_path
from tests.conftest import ConsumerFactory, LoggedConsumer, OtherUser, cli_refusal, run_cli, wait_attached
from tests.workload import Workload, make_config, make_producer

ROOT = Path(__file__).resolve().parents[1]


def check_finished_complete(out: Path, workload: Workload) -> None:
    """Every request the workload finished is complete in the store at ``out``, row for row as produced."""
    store = open_store(out)
    for rid in workload.finished:
        assert store.record(rid)["status"] == "complete", rid
        sample = store.get(rid)
        rows, tokens = workload.reference(rid)
        assert torch.equal(torch.stack([sample[n] for n in ("layer_1", "layer_3", "last")], dim=1), rows), rid
        assert sample["input_ids"].tolist() == tokens, rid


def tcp_producer(policy: str = "block", keys: Path | None = None) -> Producer:
    """A producer on a tcp:// endpoint of two free ports on 127.0.0.1 (it binds P and P + 1)."""
    for _ in range(100):
        config = make_config(f"tcp://127.0.0.1:{random.randrange(20_000, 60_000)}", policy=policy)
        config.keys = keys
        try:
            return make_producer(config)
        except zmq.ZMQError:  # taken: try other ports
            continue
    raise RuntimeError("no two free ports found for a tcp:// producer")


# =========================================================================== 1: foreign directories and links


def test_a_socket_directory_another_user_made_first_is_refused_and_nothing_is_written_through_its_links(
    tmp_path: Path, other_user: OtherUser, logged_consumer: Callable[..., LoggedConsumer]
) -> None:
    """Issue 12.1: another user makes our socket directory first (0777) with links where the token is written."""
    directory = Path(f"/tmp/hsc-sec-{uuid.uuid4().hex[:10]}")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    other_user.run(
        f"mkdir -m 0777 {directory} && ln -s {victim} {directory}/default-token.tmp "
        f"&& ln -s {victim} {directory}/default-token"
    )
    endpoint = f"ipc://{directory}/default"
    refusal = f"socket directory {directory} belongs to uid {other_user.uid}"
    try:
        with pytest.raises(AccessError, match=refusal):
            make_producer(make_config(endpoint))
        consumer = logged_consumer(endpoint, "--exit-on-eos")
        assert consumer.wait_exit(60) == 1 and refusal in consumer.stderr()
        assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
        assert sorted(os.listdir(directory)) == ["default-token", "default-token.tmp"]  # nothing of ours in there
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("kind", ["open to others", "a link"])
def test_a_socket_directory_of_ours_that_is_open_or_a_link_is_refused(kind: str, tmp_path: Path) -> None:
    directory = Path(f"/tmp/hsc-sec-{uuid.uuid4().hex[:10]}")
    try:
        if kind == "open to others":
            directory.mkdir()
            directory.chmod(0o777)
            expected = rf"has mode 0777, open to other users.*chmod 700 {directory}"
        else:
            (tmp_path / "elsewhere").mkdir(mode=0o700)
            directory.symlink_to(tmp_path / "elsewhere")
            expected = rf"socket directory {directory} is a symbolic link"
        with pytest.raises(AccessError, match=expected):
            make_producer(make_config(f"ipc://{directory}/ep"))
        assert not any((tmp_path / "elsewhere").glob("*")) if kind == "a link" else not any(directory.iterdir())
    finally:
        if directory.is_symlink():
            directory.unlink()
        else:
            shutil.rmtree(directory, ignore_errors=True)


def test_the_token_is_written_afresh_never_through_a_planted_link(endpoint: str, tmp_path: Path) -> None:
    directory = Path(endpoint[len("ipc://") :]).parent
    directory.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    token = token_path(endpoint)
    assert token is not None
    token.symlink_to(victim)
    token.with_name(token.name + ".tmp").symlink_to(victim)  # where the token was first written until now
    producer = make_producer(make_config(endpoint))
    try:
        assert victim.read_text() == "precious\n"
        info = os.lstat(token)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        assert token.read_text() == producer.token
    finally:
        producer.close()
    token.with_name(token.name + ".tmp").unlink()


@pytest.mark.parametrize("kind", ["a link", "readable by others", "another user's"])
def test_a_consumer_refuses_a_token_file_it_cannot_trust(
    kind: str,
    endpoint: str,
    tmp_path: Path,
    logged_consumer: Callable[..., LoggedConsumer],
    request: pytest.FixtureRequest,
) -> None:
    directory = Path(endpoint[len("ipc://") :]).parent
    directory.mkdir(mode=0o700)
    token = token_path(endpoint)
    assert token is not None
    if kind == "a link":
        (tmp_path / "elsewhere").write_text("token-from-elsewhere")
        token.symlink_to(tmp_path / "elsewhere")
        expected = f"token file {token} is a symbolic link"
    else:
        token.write_text("some-token")
        token.chmod(0o644 if kind == "readable by others" else 0o600)
        expected = f"token file {token} has mode 0644"
        if kind == "another user's":
            other: OtherUser = request.getfixturevalue("other_user")
            os.chown(token, other.uid, other.gid)
            expected = f"token file {token} belongs to uid {other.uid}"
    consumer = logged_consumer(endpoint, "--exit-on-eos")
    assert consumer.wait_exit(60) == 1
    assert expected in consumer.stderr(), consumer.stderr()[-2000:]


# =========================================================================== 2 and 11: tcp:// is authenticated


def test_tcp_strays_without_an_admitted_key_receive_nothing_and_the_consumer_keeps_every_row(
    tmp_path: Path, start_consumer: ConsumerFactory
) -> None:
    """Issue 12.2: a PULL socket on the announce port got the layout, every chunk and the end of stream."""
    producer = tcp_producer()  # makes this user's key pair (in HSCAPTURE_KEYS)
    endpoint = producer.config.endpoint
    context = zmq.Context()
    strays: list[zmq.Socket] = []
    server_key = ensure_keys().public
    for kind in (zmq.PULL, zmq.DEALER):  # no keys at all, and a key pair the producer never admitted
        for curve in (False, True):
            stray = context.socket(kind)
            stray.setsockopt(zmq.LINGER, 0)
            if curve:
                stray.curve_publickey, stray.curve_secretkey = zmq.curve_keypair()
                stray.curve_serverkey = server_key
            stray.connect(announce_endpoint(endpoint))
            strays.append(stray)
    hello = context.socket(zmq.PUSH)  # a stray hello without keys, aimed at the release port
    hello.setsockopt(zmq.LINGER, 0)
    hello.connect(release_endpoint(endpoint))
    out = tmp_path / "store"
    consumer = start_consumer(out, endpoint, "--exit-on-eos")
    try:
        wait_attached(producer)
        workload = Workload(seed=61)
        for _ in range(60):
            workload.step(producer)
            with contextlib.suppress(zmq.Again):  # on tcp:// no token is asked: the key is the credential
                hello.send(protocol.encode(Hello(v=PROTOCOL_VERSION, consumer_id="stray")), zmq.NOBLOCK)
        counters = producer.close()
        assert consumer.wait(30) == 0
        received = [stray.poll(500) for stray in strays]
        assert received == [0, 0, 0, 0], "a stray socket without an admitted key received announcements"
        assert counters.attaches == 1 and counters.rows_dropped == 0 and counters.messages_rejected == 0
        check_finished_complete(out, workload)
    finally:
        for sock in [*strays, hello]:
            sock.close(linger=0)
        context.term()
        producer.close()


def test_consume_on_tcp_without_keys_fails_at_once_with_a_clear_message(
    tmp_path: Path, logged_consumer: Callable[..., LoggedConsumer]
) -> None:
    """Issue 12.11: `consume` on tcp:// without credentials waited forever saying only 'no producer attached'."""
    keys = tmp_path / "no-keys-here"
    producer = tcp_producer()
    try:
        consumer = logged_consumer(producer.config.endpoint, "--keys", str(keys))
        assert consumer.wait_exit(60, producer) == 1
        message = consumer.stderr()
        assert f"no CURVE keys: {keys} does not exist" in message and "hscapture keys" in message, message
        assert not producer.attached and not (tmp_path / "store-0").exists()
    finally:
        producer.close()


def test_a_consumer_of_another_key_is_told_its_key_is_refused_until_the_producer_admits_it(
    tmp_path: Path, logged_consumer: Callable[..., LoggedConsumer]
) -> None:
    """The UX across users or hosts: `hscapture keys` on each side, the producer's id.key copied, --allow."""
    producer_keys, consumer_keys = tmp_path / "producer-keys", tmp_path / "consumer-keys"
    shown = run_cli("keys", "--keys", consumer_keys)
    assert shown.returncode == 0, shown.stderr
    assert str(consumer_keys / PUBLIC) in shown.stdout
    producer = tcp_producer(keys=producer_keys)
    endpoint = producer.config.endpoint
    try:
        copy = tmp_path / "producer-id.key"  # what the producer's user hands over
        shutil.copy(producer_keys / PUBLIC, copy)
        options = ("--keys", str(consumer_keys), "--producer-key", str(copy), "--exit-on-eos")
        refused = logged_consumer(endpoint, *options)
        assert refused.wait_exit(60, producer) == 1
        assert "refused this consumer's key" in refused.stderr() and "--allow" in refused.stderr()

        wrong = logged_consumer(endpoint, "--keys", str(consumer_keys), "--producer-key", str(consumer_keys / PUBLIC))
        assert wrong.wait_exit(60, producer) == 1
        assert "CURVE handshake" in wrong.stderr() and "--producer-key" in wrong.stderr(), wrong.stderr()[-2000:]
        assert not producer.attached

        allowed = run_cli("keys", "--keys", producer_keys, "--allow", consumer_keys / PUBLIC)
        assert allowed.returncode == 0, allowed.stderr
        admitted = logged_consumer(endpoint, *options)  # the running producer reads allowed/ again
        wait_attached(producer)
        workload = Workload(seed=62)
        for _ in range(20):
            workload.step(producer)
        producer.close()
        assert admitted.wait_exit(30) == 0
        check_finished_complete(tmp_path / "store-2", workload)
    finally:
        producer.close()


@pytest.mark.parametrize("kind", ["missing", "a directory", "unreadable", "endless"])
def test_keys_allow_of_a_file_it_cannot_take_is_one_line_naming_it_and_the_fix(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Issue 30.9: `hscapture keys --allow PATH` gave a traceback for a missing file, a directory, an unreadable one."""
    keys = tmp_path / "keys"
    given = {"missing": tmp_path / "nope.key", "a directory": tmp_path, "endless": Path("/dev/zero")}.get(kind)
    expected = {"missing": "does not exist", "a directory": "is not a regular file", "endless": "is not a regular file"}
    if kind != "unreadable":
        status, stderr = cli_refusal("keys", "--keys", keys, "--allow", given)
    else:
        given = tmp_path / "id.key"
        ensure_keys(tmp_path / "theirs")
        shutil.copy(tmp_path / "theirs" / PUBLIC, given)
        given.chmod(0)
        expected[kind] = "cannot be read (Permission denied)"
        if os.geteuid() != 0:
            status, stderr = cli_refusal("keys", "--keys", keys, "--allow", given)
        else:  # root reads any file: another user is refused it (this process forked as that user)
            other: OtherUser = request.getfixturevalue("other_user")
            status, stderr = _as_user(other, lambda: cli_refusal("keys", "--keys", keys, "--allow", given))
    assert status == 2, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert f"--allow: {str(given)!r} {expected[kind]}" in stderr and "id.key" in stderr, stderr
    assert not (keys / "allowed").exists()


def _as_user(user: OtherUser, call: Callable[[], tuple[int, str]]) -> tuple[int, str]:
    """``call()`` in a child of this process that runs as ``user`` (no process start: hscapture is imported)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(user.gid)
            os.setuid(user.uid)
            status, text = call()
            os.write(write, f"{status}\n{text}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        status, _, text = pipe.read().decode().partition("\n")
    os.waitpid(pid, 0)
    return int(status), text


# =========================================================================== 8: nothing leaks


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_what_a_killed_producer_left_goes_at_the_next_start_and_a_clean_run_leaves_nothing(
    endpoint: str, tmp_path: Path, start_consumer: ConsumerFactory
) -> None:
    """Issue 12.8: killed runs left their host ring in /dev/shm and their socket files; clean runs 2 sockets."""
    directory = Path(endpoint[len("ipc://") :]).parent
    consumer = start_consumer(tmp_path / "a", endpoint)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.workload", "--endpoint", endpoint, "--seed", "8", "--prefix", "a"]
    crashed = subprocess.Popen(command, stdout=subprocess.PIPE, env=env)
    assert crashed.stdout is not None
    for _ in range(5):  # attached and producing
        crashed.stdout.readline()
    crashed.kill()
    crashed.wait()
    consumer.kill()
    consumer.wait()
    rings = list(SHM_DIR.glob(f"hscapture-{os.getuid()}-{crashed.pid}-*.ring"))
    assert len(rings) == 1
    assert sorted(os.listdir(directory)) == ["ep-announce", "ep-release", "ep-token"]
    torn = directory / f".ep-token.{_dead_pid()}.0123456789ab.tmp"  # a token write cut short by a crash
    torn.write_bytes(b"")

    producer = make_producer(make_config(f"ipc://{directory}/next"))  # the next run in this directory
    assert not rings[0].exists(), "the dead producer's host ring is still in /dev/shm"
    assert sorted(os.listdir(directory)) == ["next-announce", "next-release", "next-token"]
    ring = Path(producer.ring.describe()["path"])
    producer.close()
    assert os.listdir(directory) == [] and not ring.exists(), "a clean run left files behind"


def test_a_producer_starting_beside_another_leaves_the_others_new_socket_alone(endpoint: str) -> None:
    """Data-parallel jobs start producers in one directory at once. Between a socket file's bind and its listen a
    connect is refused: a reclaim then took the other's new socket for a dead producer's and removed it (the job
    failed with "No such file" at its start). A start now waits for the other's bind to finish."""
    directory = Path(endpoint[len("ipc://") :]).parent
    directory.mkdir(mode=0o700)
    other = directory / "other-release"
    producers: list[Producer] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mid_bind:
        with binding_in(directory):  # what the other producer holds from its reclaim until its sockets listen
            mid_bind.bind(str(other))  # bound, not listening yet
            starting = threading.Thread(target=lambda: producers.append(make_producer(make_config(endpoint))))
            starting.start()
            starting.join(0.5)
            assert starting.is_alive(), "a producer bound while another was binding in its directory"
            assert other.exists()
            mid_bind.listen()
        starting.join(60)
        assert producers and other.exists(), "the other producer's new socket was removed as a dead one's"
        producers[0].close()
        assert sorted(os.listdir(directory)) == ["other-release"]


def test_reclaim_spares_a_ring_whose_lock_is_held_although_its_pid_is_gone() -> None:
    """An owner in another pid namespace looks dead by its pid; its lock says otherwise."""
    dead = _dead_pid()
    held = SHM_DIR / f"hscapture-{os.getuid()}-{dead}-held-{uuid.uuid4().hex[:8]}.ring"
    stale = SHM_DIR / f"hscapture-{os.getuid()}-{dead}-stale-{uuid.uuid4().hex[:8]}.ring"
    for path in (held, stale):
        path.write_bytes(b"\0" * 4096)
        path.chmod(0o600)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(held)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
            "time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        removed = reclaim_host_rings()
        assert stale in removed and not stale.exists()
        assert held.exists() and held not in removed
    finally:
        holder.kill()
        holder.wait()
        held.unlink(missing_ok=True)
        stale.unlink(missing_ok=True)


def test_reclaim_never_removes_another_users_files(other_user: OtherUser) -> None:
    dead = _dead_pid()
    theirs = SHM_DIR / f"hscapture-{os.getuid()}-{dead}-theirs-{uuid.uuid4().hex[:8]}.ring"  # named like ours
    theirs.write_bytes(b"\0" * 4096)
    os.chown(theirs, other_user.uid, other_user.gid)
    try:
        assert theirs not in reclaim_host_rings() and theirs.exists()
    finally:
        theirs.unlink()


def test_a_live_producers_endpoint_is_refused_not_taken_over(endpoint: str) -> None:
    producer = make_producer(make_config(endpoint))
    try:
        with pytest.raises(zmq.ZMQError, match="another producer is running there"):
            make_producer(make_config(endpoint))
        assert token_path(endpoint).read_text() == producer.token  # type: ignore[union-attr]
    finally:
        producer.close()


@pytest.mark.slow
def test_a_killed_extraction_leaves_nothing_once_the_next_ran_and_a_clean_one_leaves_nothing(
    tmp_path: Path, tiny_model: Path, tiny_demo_data: Path
) -> None:
    """The issue's own trial: `hscapture extract` killed mid-run, then run again to completion."""
    out = tmp_path / "store"
    command = [sys.executable, "-m", "hscapture", "extract", "--out", str(out), "--model", str(tiny_model)]
    command += ["--data", str(tiny_demo_data), "--no-progress", "--max-batch-tokens", "64"]
    sockets = Path(f"/tmp/hscapture-{os.getuid()}")

    def leftovers(pid: int) -> list[Path]:
        return [*SHM_DIR.glob(f"hscapture-{os.getuid()}-{pid}-*.ring"), *sockets.glob(f"extract-{pid}-*")]

    killed = subprocess.Popen(command)
    deadline = time.monotonic() + 120
    while not (out / "index.jsonl").exists() or not leftovers(killed.pid):  # capturing, with something indexed
        assert killed.poll() is None and time.monotonic() < deadline, "the extraction did not get going"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert leftovers(killed.pid)
    done = run_cli(*command[3:])  # the next run, in this process: it must clear what the killed process left
    assert done.returncode == 0, done.stderr[-2000:]
    assert leftovers(killed.pid) == [], "what the killed extraction left is still there"
    assert not list(sockets.glob("extract-*")) or all(  # other extractions of this user may be running
        int(p.name.split("-")[1]) != killed.pid for p in sockets.glob("extract-*")
    )
    assert open_store(out).summary()["complete"] > 0


# =========================================================================== 9: one consumer at a time


def test_a_second_consumer_is_refused_and_the_first_keeps_every_row(
    endpoint: str, tmp_path: Path, start_consumer: ConsumerFactory, logged_consumer: Callable[..., LoggedConsumer]
) -> None:
    """Issue 12.9: both were accepted, the producer alternated between them, both stores ended incomplete."""
    out = tmp_path / "first"
    first = start_consumer(out, endpoint, "--exit-on-eos")
    producer = make_producer(make_config(endpoint, policy="block"))
    wait_attached(producer)
    workload = Workload(seed=91)
    second = logged_consumer(endpoint, "--exit-on-eos")
    assert second.wait_exit(60, step=lambda: workload.step(producer)) == 1
    assert "refused this consumer" in second.stderr() and "is attached to" in second.stderr()
    for _ in range(20):
        workload.step(producer)
    counters = producer.close()
    assert first.wait(30) == 0
    assert counters.attaches == 1 and counters.consumers_refused > 0 and counters.rows_dropped == 0
    check_finished_complete(out, workload)
    assert not (tmp_path / "store-0" / "meta.json").exists(), "the refused consumer stored something"


def test_a_consumer_silent_past_the_takeover_time_is_replaced_and_then_refused(
    endpoint: str, logged_consumer: Callable[..., LoggedConsumer]
) -> None:
    """What a consumer on another host that died looks like: no pid to watch, only its silence."""
    producer = make_producer(make_config(endpoint, policy="block"))
    first = logged_consumer(endpoint)
    wait_attached(producer)
    workload = Workload(seed=92)
    for _ in range(10):
        workload.step(producer)
    first.process.send_signal(signal.SIGSTOP)  # alive (its pid stays), but silent
    try:
        second = logged_consumer(endpoint, "--exit-on-eos")
        deadline = time.monotonic() + 60
        while producer.counters.attaches < 2:  # blocks for credit, serving hellos, until the second takes over
            assert time.monotonic() < deadline and second.process.poll() is None, second.stderr()[-2000:]
            workload.step(producer)
    finally:
        first.process.send_signal(signal.SIGCONT)
    assert first.wait_exit(60, step=lambda: workload.step(producer)) == 1  # it comes back: refused, it stops
    assert "refused this consumer" in first.stderr()
    counters = producer.close()
    assert second.wait_exit(30) == 0 and counters.rows_dropped == 0
    store = open_store(second.out)
    late = [rid for rid in workload.finished if rid in store and store.record(rid)["status"] == "complete"]
    assert late, "the consumer that took over stored no complete request"
