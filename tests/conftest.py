"""Shared fixtures: short private ipc endpoints, consumer processes, the tiny model."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hscapture.consumer import consume_command
from hscapture.producer import Producer


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A fresh ipc:// endpoint (ipc paths must stay under ~100 characters, so not in tmp_path)."""
    directory = Path(f"/tmp/hsc-test-{uuid.uuid4().hex[:10]}")
    yield f"ipc://{directory}/ep"
    for child in directory.glob("*"):
        child.unlink(missing_ok=True)
    if directory.exists():
        directory.rmdir()


ConsumerFactory = Callable[..., subprocess.Popen]


@pytest.fixture
def start_consumer() -> Iterator[ConsumerFactory]:
    """Start ``hscapture consume`` as a separate process; every one is killed at teardown."""
    started: list[subprocess.Popen] = []

    def start(out: Path, endpoint: str, *extra: str) -> subprocess.Popen:
        process = subprocess.Popen(consume_command(endpoint, out, "--quiet", "--heartbeat-ms", "50", *extra))
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_attached(producer: Producer, timeout_s: float = 20.0) -> None:
    """Serve the producer's control socket until a consumer has attached."""
    deadline = time.monotonic() + timeout_s
    while not producer.attached:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no consumer attached within {timeout_s} s")
        producer.poll()
        time.sleep(0.01)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hscapture.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(autouse=True)
def _private_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Subprocesses that build the embedded model write it under the test session, not ~/.cache."""
    monkeypatch.setenv("HSCAPTURE_HOME", str(tmp_path_factory.getbasetemp() / "home"))
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
