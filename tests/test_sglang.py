"""Real SGLang on this host (its CPU path): the plugin, ``hscapture serve`` and ``extract --engine sglang``.

Every check runs on two tiny random-init models: a Llama and a DeepSeek-V2 (MLA + MoE), whose
layer-id conventions differ. Each engine runs in its own process (``tests/sglang_driver.py``
or the CLI), as SGLang expects.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hscapture.consumer import consume_command
from hscapture.integrations.sglang import ENV, PluginSettings, load_plugin
from hscapture.store.reader import open_store
from hscapture.store.verify import verify_store

pytest.importorskip("sglang", reason="SGLang is not installed (pip install -e '.[sglang]')")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama", "deepseek_v2")
#: Short, chunked (> chunked-prefill-size 32) and tiny prompts.
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 80)), [3, 4], list(range(100, 140))]


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hscapture.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("sglang-models") / request.param, request.param)


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(ENV, None)
    return env


def test_plugin_is_inert_unless_switched_on_and_refuses_bad_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    monkeypatch.delenv(ENV, raising=False)
    load_plugin()
    assert {target: list(hooks) for target, hooks in HookRegistry._hooks.items()} == before
    monkeypatch.setenv(ENV, '{"endpoint": "ipc:///tmp/x", "colour": "blue"}')
    with pytest.raises(ValueError, match="HSCAPTURE_SGLANG: not valid capture settings"):
        load_plugin()
    assert PluginSettings.from_env(PluginSettings(endpoint="ipc:///tmp/x").to_env()).endpoint == "ipc:///tmp/x"


def test_serve_refuses_pipeline_parallelism_and_a_missing_model(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "hscapture", "serve", "--out", str(tmp_path / "s"), "--"]
    done = subprocess.run([*command, "--model-path", "m", "--pp-size", "2"], capture_output=True, text=True)
    assert done.returncode == 2 and "pipeline parallelism" in done.stderr
    done = subprocess.run([*command, "--port", "1"], capture_output=True, text=True)
    assert done.returncode == 2 and "--model-path" in done.stderr


def run_engine(model: Path, tmp: Path, name: str, *options: str, env: dict[str, str] | None = None) -> list[dict]:
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp / f"{name}.json"
    command = [sys.executable, "-m", "tests.sglang_driver", "--model", str(model), "--prompts", str(prompts)]
    subprocess.run([*command, "--out", str(out), *options], check=True, env=env or _env(), timeout=600)
    return json.loads(out.read_text())


def test_store_equals_what_sglang_returns_and_capture_changes_nothing(
    model: Path, tmp_path: Path, endpoint: str
) -> None:
    store_dir = tmp_path / "store"
    consumer = subprocess.Popen(consume_command(endpoint, store_dir, "--exit-on-eos", "--quiet"))
    captured = run_engine(model, tmp_path, "captured", "--capture", endpoint)
    assert consumer.wait(60) == 0
    off = run_engine(model, tmp_path, "off")  # plugin installed, capture switched off: plain SGLang
    without = run_engine(model, tmp_path, "without", env={**_env(), "SGLANG_PLUGINS": "no-such-plugin"})

    # 3. With capture off the plugin changes nothing: same tokens, same states as without it.
    assert [r["output_ids"] for r in off] == [r["output_ids"] for r in without]
    assert [r["hidden_states"] for r in off] == [r["hidden_states"] for r in without]
    # Capturing does not change what the model generates either.
    assert [r["output_ids"] for r in captured] == [r["output_ids"] for r in off]

    # 1. Oracle: the stored rows are exactly what SGLang returns (aux states under the aux flags,
    # the post-norm last layer from the plain server), with the right token ids.
    store = open_store(store_dir)
    assert store.summary()["complete"] == len(PROMPTS)
    config = store.metadata()["runs"][0]["meta"]["config"]
    aux_names = [f"layer_{k}" for k in config["layers"]]
    assert config["layers"] == [2, 4, 5]  # SGLang's EAGLE-3 default for 8 layers, both families
    for mine, plain in zip(captured, off):
        rows = store.get(mine["rid"])
        total = len(mine["prompt"]) + len(mine["output_ids"]) - 1
        assert rows["input_ids"].tolist() == (mine["prompt"] + mine["output_ids"])[:-1]
        assert rows["positions"].tolist() == list(range(total))
        # SGLang's own path skips the rows of a long prompt's middle prefill chunks: compare
        # the rows it does return, which end where the request ends.
        returned = torch.tensor(mine["hidden_states"], dtype=torch.float32)
        assert 0 < len(returned) <= total
        aux = torch.cat([rows[n].float() for n in aux_names], dim=1)[total - len(returned) :]
        assert torch.equal(aux, returned), f"{mine['rid']}: aux rows differ from SGLang's"
        last = torch.tensor(plain["hidden_states"], dtype=torch.float32)
        assert torch.equal(rows["last"].float()[total - len(last) :], last)
        if len(mine["prompt"]) <= 32:  # prompts not chunked come back whole
            assert len(returned) == total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _abort_after_first_chunks(url: str, body: dict[str, Any]) -> None:
    """Stream a long answer and hang up after two chunks: SGLang aborts the request."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        response = urllib.request.urlopen(request, timeout=300)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{body['rid']}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
    for _ in range(2):
        response.readline()
    response.close()


@pytest.fixture
def server(model: Path, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    port = _free_port()
    store_dir = tmp_path / "live"
    command = [sys.executable, "-m", "hscapture", "serve", "--out", str(store_dir), "--", "--model-path", str(model)]
    command += ["--port", str(port), "--chunked-prefill-size", "32", "--mem-fraction-static", "0.3"]
    command += ["--enable-cache-report", "--enable-mixed-chunk", "--log-level", "warning"]
    process = subprocess.Popen(command, env=_env())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        assert process.poll() is None, "hscapture serve exited before the server came up"
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, "SGLang did not come up in 600 s"
        time.sleep(1)
    try:
        yield base, process, store_dir
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_live_server_stores_every_finished_request_attributed_and_marks_aborted(
    server: tuple[str, subprocess.Popen, Path],
) -> None:
    base, process, store_dir = server
    words = "the quick brown fox jumps over the lazy dog while seven cats watch from a sunny wall "
    bodies = [
        {
            "model": "default",
            "messages": [{"role": "user", "content": (words * (1 + i % 4))[: 40 + 50 * (i % 4)]}],
            "max_tokens": 6 + i % 5,
            "temperature": 0,
            "rid": f"live-{i}",
            "return_prompt_token_ids": True,
            "return_token_ids": True,
        }
        for i in range(12)
    ]
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def ask(body: dict) -> None:
        try:
            results[body["rid"]] = _post(f"{base}/v1/chat/completions", body)
        except BaseException as exc:
            errors.append(exc)

    aborted = [
        {"model": "default", "messages": bodies[i]["messages"], "max_tokens": 1000, "stream": True, "rid": f"abort-{i}"}
        for i in range(2)
    ]
    threads = [threading.Thread(target=ask, args=(b,)) for b in bodies]
    url = f"{base}/v1/chat/completions"
    threads += [threading.Thread(target=_abort_after_first_chunks, args=(url, b)) for b in aborted]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    time.sleep(2)  # the server notices the hang-ups and aborts those requests
    process.send_signal(signal.SIGINT)
    assert process.wait(180) == 0
    report = verify_store(store_dir)
    assert report.ok
    store = open_store(store_dir)
    for rid, reply in results.items():
        choice = reply["choices"][0]
        prompt, output = choice["prompt_token_ids"], choice["response_token_ids"]
        record = store.record(rid)
        cached = (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        total = len(prompt) + len(output) - 1
        if cached:  # a radix-cache hit: the store says exactly which positions it lacks
            assert record["status"] == "incomplete" and record["missing"] == [[0, cached]], record
        else:
            assert record["status"] == "complete", record
        rows = store.get(rid)
        assert rows["input_ids"].tolist() == (prompt + output)[cached:total]
        assert rows["positions"].tolist() == list(range(cached, total))
    for body in aborted:
        record = store.record(body["rid"])
        assert record["status"] == "incomplete" and "aborted" in record["reason"], record


def test_extract_with_sglang_gives_a_store_that_passes_the_hf_engine_checks(model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from hscapture.data import load_samples
    from hscapture.extract import default_data_path

    out = tmp_path / "store"
    command = [sys.executable, "-m", "hscapture", "extract", "--engine", "sglang", "--model", str(model)]
    done = subprocess.run([*command, "--out", str(out), "--limit", "50", "--no-progress"], env=_env(), timeout=900)
    assert done.returncode == 0
    assert verify_store(out).ok
    store = open_store(out)
    samples = list(load_samples(default_data_path(), AutoTokenizer.from_pretrained(model), None))[:50]
    assert sorted(store.keys(complete_only=True)) == sorted(s.key for s in samples)
    for sample in samples:
        rows = store.get(sample.key)
        assert rows["input_ids"].tolist() == sample.input_ids
        assert rows["loss_mask"].tolist() == sample.loss_mask
        assert rows["positions"].tolist() == list(range(len(sample.input_ids)))
        assert all(rows[f"layer_{k}"].shape == (len(sample.input_ids), rows["last"].shape[1]) for k in (2, 4, 5))


def test_examples_run_as_written(tmp_path: Path) -> None:
    """python examples/sglang_serve.py and examples/sglang_extract.py, on the embedded tiny Llama."""
    for script, expect in (
        ("sglang_serve.py", "complete requests"),
        ("sglang_extract.py", "regenerate: 4 samples"),
    ):
        command = [sys.executable, str(ROOT / "examples" / script), "--out", str(tmp_path / script)]
        if script == "sglang_extract.py":
            command += ["--samples", "4"]
        done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert expect in done.stdout, done.stdout
