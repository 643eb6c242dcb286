"""Shared fixtures: short private ipc endpoints, consumer processes, the tiny model."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hscapture.consumer import consume_command
from hscapture.producer import Producer
from tests.workload import Workload, make_config, make_producer


def run_cli(
    *args: str | Path, in_process: bool = True, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """The one way tests run ``hscapture ARGS``: in this process where no process boundary is under test (no process
    start and no torch import to wait for: seconds each on a 2-core host), else as a process of its own. Returns its
    exit status, stdout and stderr (in this process: what it printed; its log records go to the test's logging).

    ``env``: variables set for the command (in this process: for the call only)."""
    argv = [str(a) for a in args]
    if not in_process:
        command = [sys.executable, "-m", "hscapture", *argv]
        return subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
    from hscapture import cli

    return run_main(cli.main, argv, env, program="hscapture")


def run_main(
    main: Callable[[list[str]], int], argv: list[str], env: dict[str, str] | None = None, program: str = "main"
) -> subprocess.CompletedProcess[str]:
    """``main(argv)`` of a command line, called in this process as its script would run it: its exit status, what it
    printed to stdout and stderr, the logging, signal handlers and ``env`` variables it changed put back after."""
    root = logging.getLogger()  # the command line configures logging and signals: left as they were after
    handlers, level = root.handlers[:], root.level
    signals = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    out, err = io.StringIO(), io.StringIO()
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's own refusals
            status = exc.code if isinstance(exc.code, int) else 1
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
            for signum, handler in signals.items():
                signal.signal(signum, handler)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return subprocess.CompletedProcess([program, *argv], status, out.getvalue(), err.getvalue())


def start_cli(*args: str | Path, **popen: object) -> subprocess.Popen:
    """``hscapture ARGS`` started as a process of its own and not waited for (to be killed, signalled or raced):
    ``run_cli``'s process form, for a command that runs beside the test."""
    return subprocess.Popen([sys.executable, "-m", "hscapture", *map(str, args)], **popen)  # type: ignore[call-overload]


def cli_refusal(*args: str | Path) -> tuple[int, str]:
    """``hscapture ARGS`` refused before any work starts, run in this process: its exit status and its stderr."""
    done = run_cli(*args)
    return done.returncode, done.stderr


@contextlib.contextmanager
def sync_debug(mode: str) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` for the block (``"error"``: any host-device sync raises)."""
    import torch

    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def short_endpoint() -> Iterator[str]:
    """A fresh ipc:// endpoint (ipc paths must stay under ~100 characters, so not in tmp_path)."""
    directory = Path(f"/tmp/hsc-test-{uuid.uuid4().hex[:10]}")
    try:
        yield f"ipc://{directory}/ep"
    finally:
        for child in directory.glob("*"):
            child.unlink(missing_ok=True)
        if directory.exists():
            directory.rmdir()


@pytest.fixture
def endpoint() -> Iterator[str]:
    with short_endpoint() as name:
        yield name


class ThreadConsumer:
    """A consumer run on a thread of the test process: the same ``Consumer`` the command runs, from the same command
    line, without a process start (imports and all: seconds on a 2-core host). For tests where no process boundary is
    under test; it answers ``wait``, ``poll`` and ``kill`` as a ``Popen`` does, with the command's exit status."""

    def __init__(self, command: list[str]) -> None:
        from hscapture.cli import build_parser, options_from
        from hscapture.config import ConsumerConfig
        from hscapture.consumer import Consumer

        args = build_parser().parse_args(command[command.index("consume") :])
        self.config = options_from(ConsumerConfig, args)
        self.consumer = Consumer(self.config)
        self.pid = os.getpid()
        self.returncode: int | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="consumer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.consumer.run()
        except BaseException as exc:  # handed to wait(): the test sees it
            self._error = exc
        finally:
            failed = self.config.exit_on_eos and self.consumer.last_failure
            self.returncode = 1 if failed or self._error is not None else 0

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired("consumer thread", timeout or 0)
        if self._error is not None:
            raise self._error
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        self.consumer.stop()
        self._thread.join(60)


ConsumerFactory = Callable[..., "subprocess.Popen | ThreadConsumer"]


@pytest.fixture
def start_consumer() -> Iterator[ConsumerFactory]:
    """The one way tests start ``hscapture consume``: as a separate process, or (``in_process``) on a thread of the
    test's own, where no process boundary is under test. Every one is stopped at teardown."""
    started: list[subprocess.Popen | ThreadConsumer] = []

    def start(
        out: Path | None,
        endpoint: str,
        *extra: str,
        log: Path | None = None,
        in_process: bool = False,
        quiet: bool = True,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen | ThreadConsumer:
        """``log``: a file its stderr (warnings, rejections, stats lines) goes to, for the test to read (processes
        only); ``quiet``: no stats lines; ``env``: its whole environment (processes only)."""
        command = consume_command(endpoint, out, *(["--quiet"] if quiet else []), "--heartbeat-ms", "50", *extra)
        if in_process:
            assert log is None and env is None, "a consumer thread logs to the test's own logging (caplog)"
            started.append(ThreadConsumer(command))
            return started[-1]
        with contextlib.ExitStack() as stack:
            stderr = None if log is None else stack.enter_context(log.open("wb"))
            process = subprocess.Popen(command, stderr=stderr, env=env)
        started.append(process)
        return process

    yield start
    for consumer in started:
        if consumer.poll() is None:
            consumer.kill()
            if isinstance(consumer, subprocess.Popen):
                consumer.wait()


@dataclass
class LoggedConsumer:
    """A consumer process whose stderr goes to a file the test reads (:func:`logged_consumer`)."""

    process: subprocess.Popen
    out: Path
    log: Path

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def lines(self) -> list[str]:
        return self.stderr().splitlines()

    def wait_for_line(self, pattern: str, timeout_s: float = 60) -> re.Match[str]:
        """The first line of its stderr matching ``pattern``, once it is written; fails if it exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            exited = self.process.poll() is not None
            for line in self.lines():
                if match := re.search(pattern, line):
                    return match
            if exited:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in:\n{self.stderr()[-3000:]}")

    def wait_exit(
        self, timeout_s: float, producer: Producer | None = None, step: Callable[[], object] | None = None
    ) -> int:
        """Its exit status, serving ``producer`` (or running ``step``) meanwhile; fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None:
            assert time.monotonic() < deadline, f"still running after {timeout_s} s:\n{self.stderr()[-2000:]}"
            if step is not None:
                step()
            elif producer is not None:
                producer.poll()
            time.sleep(0.02)
        return self.process.returncode

    def stop(self) -> int:
        """Ctrl-C, then its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        return self.process.wait(60)


@pytest.fixture
def logged_consumer(start_consumer: ConsumerFactory, tmp_path: Path) -> Callable[..., LoggedConsumer]:
    """``hscapture consume`` as a process with its stats lines on, its stderr in ``tmp_path/consumer-N.log``, its store
    ``out`` (default ``tmp_path/store-N``); ``env``: its whole environment."""
    count = 0

    def start(endpoint: str, *extra: str, out: Path | None = None, env: dict[str, str] | None = None) -> LoggedConsumer:
        nonlocal count
        out = tmp_path / f"store-{count}" if out is None else out
        log = tmp_path / f"consumer-{count}.log"
        count += 1
        process = start_consumer(out, endpoint, *extra, log=log, quiet=False, env=env)
        assert isinstance(process, subprocess.Popen)
        return LoggedConsumer(process, out, log)

    return start


def vllm_rank_cores(ranks: int) -> dict[str, str]:
    """The environment that gives each of ``ranks`` vLLM CPU ranks (TP or DP) a core of its own: vLLM's automatic
    binding wants a NUMA node per rank, and the CI host has one. Skips the test on a host with too few cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        pytest.skip(f"vLLM's CPU path binds each of {ranks} ranks to cores of its own: this host has {len(cpus)}")
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cpu) for cpu in cpus[:ranks])}


def wait_attached(producer: Producer, timeout_s: float = 120.0) -> None:
    """Serve the producer's control socket until a consumer has attached (a consumer process's start, imports
    included, takes seconds on a busy 2-core host: the limit only bounds a broken run)."""
    if not producer.wait_attached(timeout_s):
        raise TimeoutError(f"no consumer attached within {timeout_s} s")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hscapture.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(autouse=True)
def _private_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Subprocesses that build the embedded model write it under the test session, not ~/.cache; CURVE keys too."""
    monkeypatch.setenv("HSCAPTURE_HOME", str(tmp_path_factory.getbasetemp() / "home"))
    monkeypatch.setenv("HSCAPTURE_KEYS", str(tmp_path_factory.getbasetemp() / "keys"))
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


TINY_SAMPLES = 32


@pytest.fixture(scope="session")
def tiny_demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hscapture.tiny import write_demo_jsonl

    return write_demo_jsonl(tmp_path_factory.mktemp("tiny-data") / "demo.jsonl", n=TINY_SAMPLES)


def _extract_tiny(model: Path, data: Path, out: Path, store_dtype: str | None) -> Path:
    from hscapture.extract import ExtractOptions, extract

    options = ExtractOptions(
        out=out, model=model, data=data, max_batch_tokens=1024, store_dtype=store_dtype, progress=False
    )
    assert extract(options).store["complete"] == TINY_SAMPLES
    return out


@pytest.fixture(scope="session")
def tiny_store(tiny_model: Path, tiny_demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY_SAMPLES demo conversations through the tiny model, by a real extraction, stored as captured (bf16)."""
    return _extract_tiny(tiny_model, tiny_demo_data, tmp_path_factory.mktemp("tiny-bf16"), None)


@pytest.fixture(scope="session")
def tiny_store_fp8(tiny_model: Path, tiny_demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same extraction (same batches, so the same captured rows) stored with ``--store-dtype fp8``."""
    return _extract_tiny(tiny_model, tiny_demo_data, tmp_path_factory.mktemp("tiny-fp8"), "fp8")


@pytest.fixture(scope="session")
def streaming_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Workload]]:
    """A streaming store under ``drop`` with a consumer process slow at times: complete requests, gaps, drops."""
    out = tmp_path_factory.mktemp("dropped")
    directory = Path(f"/tmp/hsc-test-{uuid.uuid4().hex[:10]}")
    endpoint = f"ipc://{directory}/ep"
    consumer = subprocess.Popen(
        consume_command(endpoint, out, "--quiet", "--heartbeat-ms", "50", "--exit-on-eos", "--delay-ms", "10")
    )
    try:
        producer = make_producer(make_config(endpoint, policy="drop", slots=2, rows_per_slot=16))
        wait_attached(producer)
        workload = Workload(seed=3)
        for step in range(200):  # paced (nothing dropped), then flat out (drops), then paced again
            workload.step(producer)
            time.sleep(0.03 if not 60 <= step < 140 else 0)
        counters = producer.close()
        assert consumer.wait(60) == 0
    finally:
        if consumer.poll() is None:
            consumer.kill()
        shutil.rmtree(directory, ignore_errors=True)
    assert counters.rows_dropped > 0, "the consumer was not slow enough to force drops"
    yield out, workload


@dataclass
class OtherUser:
    """A real second local user, for what another user on a shared host could do to ours."""

    name: str
    uid: int
    gid: int

    def run(self, script: str) -> None:
        """Run a shell script as this user (no supplementary groups of ours)."""
        subprocess.run(["sh", "-c", script], user=self.uid, group=self.gid, extra_groups=[], check=True)


@pytest.fixture
def other_user() -> Iterator[OtherUser]:
    """A user made with ``useradd`` for this test and removed after it; skips unless the tests run as root."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make a second local user")
    name = f"hsc{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        entry = pwd.getpwnam(name)
        yield OtherUser(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], check=False)
