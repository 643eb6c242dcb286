"""Shared fixtures: short private ipc endpoints, consumer processes, the tiny model."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pwd
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hscapture.consumer import consume_command
from hscapture.producer import Producer
from tests.workload import Workload, make_config, make_producer


def cli_refusal(*args: str | Path) -> tuple[int, str]:
    """``hscapture ARGS`` run in this process, for a command line refused before any work starts (no process
    start, no torch import to wait for): its exit status and what it wrote to stderr."""
    from hscapture import cli

    root = logging.getLogger()  # the command line configures logging: left as it was for the tests after
    handlers, level = root.handlers[:], root.level
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = cli.main([str(a) for a in args])
        except SystemExit as exc:  # argparse's own refusals
            status = exc.code if isinstance(exc.code, int) else 1
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
    return status, err.getvalue()


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


ConsumerFactory = Callable[..., subprocess.Popen]


@pytest.fixture
def start_consumer() -> Iterator[ConsumerFactory]:
    """Start ``hscapture consume`` as a separate process; every one is killed at teardown."""
    started: list[subprocess.Popen] = []

    def start(out: Path, endpoint: str, *extra: str, log: Path | None = None) -> subprocess.Popen:
        """``log``: a file its stderr (warnings, rejections) goes to, for the test to read."""
        with contextlib.ExitStack() as stack:
            stderr = None if log is None else stack.enter_context(log.open("wb"))
            command = consume_command(endpoint, out, "--quiet", "--heartbeat-ms", "50", *extra)
            process = subprocess.Popen(command, stderr=stderr)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


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
