"""The README works as written: its first-screen commands are the ones CI runs, word for word, and every Python block
in it runs as a user would paste it (paths under /tmp and /data pointed at the test's own directories)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from hscapture import open_store
from tests.conftest import TINY_SAMPLES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return [block.strip() for block in re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)]


def readme_commands() -> list[str]:
    return blocks("bash")[:2]


def test_readme_first_screen_has_install_run_and_test_commands() -> None:
    run, test = readme_commands()
    assert run.startswith("pip install") and "hscapture extract" in run
    assert test.startswith("pip install") and "pytest" in test
    head = README.splitlines()[:25]
    assert run in "\n".join(head) and test in "\n".join(head), "the two commands must be on the first screen"


def test_ci_runs_the_readme_commands_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in readme_commands():
        assert command in ci, f"{command!r} is not a line of .ci/run"


#: What each kind of Python block needs; every block of the README is one of these (a new one fails the test below
#: until it is given a kind and a test that runs it).
def kind(block: str) -> str:
    if 'device="cuda"' in block:
        return "gpu-stream"
    if "/demo" in block and "Producer(" in block:
        return "stream"
    if "/tmp/hs-demo" in block or '"/data/hs"' in block:
        return "store"
    return "unknown"


def test_every_python_block_of_the_readme_is_run_by_a_test() -> None:
    kinds = [kind(block) for block in blocks("python")]
    assert "unknown" not in kinds, [b.splitlines()[:3] for b in blocks("python") if kind(b) == "unknown"]
    assert {"gpu-stream", "stream", "store"} <= set(kinds)


def run_python(block: str, paths: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``block`` as a script with each of ``paths`` replaced (their quotes kept), run from the repository root."""
    for old, new in paths.items():
        block = block.replace(old, new)
    script = tmp_path / f"block-{uuid.uuid4().hex[:8]}.py"
    script.write_text(block + "\n")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block}\n--- stderr ---\n{done.stderr[-4000:]}"
    return done


def start_readme_consumer(endpoint_name: str, out: Path) -> subprocess.Popen[bytes]:
    """The README's ``hscapture consume`` line with the endpoint ``endpoint_name`` and ``--out`` ``out``, in the
    background as its ``&`` says."""
    (line,) = [b for b in blocks("bash") if b.startswith("hscapture consume --endpoint ipc:///tmp/hscapture-$UID/demo")]
    command = line.removesuffix("&").replace("/demo ", f"/{endpoint_name} ").replace("/tmp/hs-stream", str(out))
    argv = [sys.executable, "-m", "hscapture", *shlex.split(command.replace("$UID", str(os.getuid())))[1:]]
    return subprocess.Popen(argv, cwd=ROOT)


def streaming(tmp_path: Path, kind_of_block: str, endpoint_name: str) -> Path:
    """The consumer line, then the Python block of ``kind_of_block`` (which names ``endpoint_name``) against it;
    returns the store."""
    (block,) = [b for b in blocks("python") if kind(b) == kind_of_block]
    out = tmp_path / "hs-stream"
    unique = f"{endpoint_name}-{uuid.uuid4().hex[:8]}"
    consumer = start_readme_consumer(unique, out)
    try:
        run_python(block, {f'/{endpoint_name}"': f'/{unique}"'}, tmp_path)
        assert consumer.wait(120) == 0, "the consumer did not end with the producer's end of stream"
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    return out


def test_the_readme_streaming_snippet_stores_what_it_captures(tmp_path: Path) -> None:
    out = streaming(tmp_path, "stream", "demo")
    store = open_store(out)
    assert sorted(store.keys(complete_only=True)) == ["a", "b"]
    for rid, first_token in (("a", 100), ("b", 200)):
        sample = store.get(rid)
        assert sample["positions"].tolist() == list(range(20))
        assert sample["input_ids"].tolist() == list(range(first_token, first_token + 20))
        assert sample["layer_2"].shape == (20, 64)
    assert store.summary()["rows_dropped"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_the_readme_gpu_snippet_stores_every_kept_row_of_the_graph_replays(tmp_path: Path) -> None:
    out = streaming(tmp_path, "gpu-stream", "demo-gpu")
    store = open_store(out)
    assert len(store.keys(complete_only=True)) == 48
    sample = store.get("r7")
    assert sample["positions"].tolist() == list(range(32))
    assert sample["input_ids"].tolist() == [7 + 1000 * step for step in range(32)]
    assert store.summary()["rows"] == 48 * 32, "padding rows were stored, or rows were dropped"


def test_the_readme_store_snippets_run_on_a_demo_store(tiny_store: Path, tmp_path: Path) -> None:
    """The reading and training snippets over the store the README's first command makes (the tiny model's demo
    extraction), and the set snippet over a directory of parts (``--data-parallel``'s ``dp<j>``) holding it."""
    parts = tmp_path / "hs"
    shutil.copytree(tiny_store, parts / "dp0")
    paths = {'"/tmp/hs-demo"': f'"{tiny_store}"', '"/data/hs"': f'"{parts}"'}
    store_blocks = [b for b in blocks("python") if kind(b) == "store"]
    assert len(store_blocks) >= 3
    for block in store_blocks:
        run_python(block, paths, tmp_path)
    assert len(open_store(tiny_store).keys()) == TINY_SAMPLES
