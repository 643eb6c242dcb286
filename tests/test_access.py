"""Who may talk to a producer: private socket directory, per-run token, no pickle on the wire."""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from pathlib import Path

from hscapture.transport import token_path
from tests.conftest import ConsumerFactory
from tests.workload import make_config, make_producer

ROOT = Path(__file__).resolve().parents[1]


def test_socket_directory_is_private_and_the_token_file_is_owner_only(endpoint: str) -> None:
    producer = make_producer(make_config(endpoint))
    try:
        directory = Path(endpoint[len("ipc://") :]).parent
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        token = token_path(endpoint)
        assert token is not None and stat.S_IMODE(token.stat().st_mode) == 0o600
        assert token.read_text() == producer.token and len(producer.token) >= 32
    finally:
        producer.close()
    assert not token.exists(), "the token outlived its run"


def test_a_consumer_with_a_wrong_token_never_attaches(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    producer = make_producer(make_config(endpoint, policy="drop"))
    stray = start_consumer(tmp_path / "stray", endpoint, "--token", "not-the-token")
    deadline = time.monotonic() + 60  # until its hellos arrive: a loaded host starts a process slowly
    while producer.counters.messages_rejected < 3 and time.monotonic() < deadline:
        producer.poll()
        time.sleep(0.05)
    assert not producer.attached and producer.counters.messages_rejected > 0
    stray.kill()
    real = start_consumer(tmp_path / "real", endpoint, "--exit-on-eos")  # reads the token beside the socket
    deadline = time.monotonic() + 30
    while not producer.attached:
        assert time.monotonic() < deadline, "the consumer with the token did not attach"
        producer.poll()
        time.sleep(0.01)
    producer.close()
    assert real.wait(30) == 0


def test_nothing_is_pickled_and_endpoints_are_local_by_default() -> None:
    sources = "\n".join(p.read_text() for p in (ROOT / "hscapture").rglob("*.py"))
    assert "import pickle" not in sources and "pickle.loads" not in sources
    default = subprocess.run(
        [sys.executable, "-c", "from hscapture.config import default_endpoint; print(default_endpoint())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert default.startswith("ipc:///tmp/hscapture-"), default
