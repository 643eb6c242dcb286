"""Real SGLang on this host (its CPU path): the plugin, ``hscapture serve`` and ``extract --engine sglang``.

The plugin's full set of checks (the store against what SGLang returns, a live server) runs on two
tiny random-init models: a Llama and a DeepSeek-V2 (MLA + MoE), whose layer-id conventions differ;
``extract --engine sglang``, whose path is the same for any architecture, runs on the Llama (and on
Kimi-K2.5, for its engine options). Four more architectures get one engine run each
(DeepSeek-V3, Kimi-K2.5, a 6-layer Qwen3, Gemma3): rows complete, bitwise what SGLang returns,
the layers asked for, and a description HF confirms. Each engine runs in its own process
(``tests/sglang_driver.py`` or the CLI), as SGLang expects.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hscapture.consumer import consume_command
from hscapture.integrations.sglang import CPU_POOL_TOKENS, ENV, PluginSettings, cpu_server_args, load_plugin
from hscapture.integrations.sglang_models import GEMMA3_MLP_BRANCH, LaunchPlan, launch_plan
from hscapture.store.reader import Store, open_store
from hscapture.store.verify import verify_store
from tests.conftest import ConsumerFactory, LoggedConsumer, cli_refusal, short_endpoint
from tests.sglang_driver import returned_rows

pytest.importorskip("sglang", reason="SGLang is not installed (pip install -e '.[sglang]')")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama", "deepseek_v2")
#: Short, chunked (> chunked-prefill-size 32) and tiny prompts.
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 80)), [3, 4], list(range(100, 140))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The tiny model of an architecture (hscapture.tiny), built once per module."""
    from hscapture.tiny import ensure_tiny_model

    folder = tmp_path_factory.mktemp("sglang-models")
    return lambda architecture: ensure_tiny_model(folder / architecture, architecture)


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest, tiny: Callable[[str], Path]) -> Path:
    return tiny(request.param)


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


def test_the_cpu_path_sizes_sglangs_kv_pool_unless_the_users_arguments_do() -> None:
    """Left to SGLang, its CPU path zero-fills a pool of gigabytes at each start (the live server test checks that
    serve's pool is this one); a size the user gives wins."""
    assert cpu_server_args(["--model-path", "m"])[-2:] == ["--max-total-tokens", str(CPU_POOL_TOKENS)]
    for given in (["--max-total-tokens", "4096"], ["--max-total-tokens=4096"], ["--mem-fraction-static", "0.5"]):
        assert "--max-total-tokens" not in cpu_server_args(["--model-path", "m", *given])


def test_serve_refuses_pipeline_parallelism_a_missing_model_and_a_ring_of_no_whole_slots(tmp_path: Path) -> None:
    command = ["serve", "--out", tmp_path / "s", "--"]
    status, stderr = cli_refusal(*command, "--model-path", "m", "--pp-size", "2")
    assert status == 2 and "pipeline parallelism" in stderr, stderr
    status, stderr = cli_refusal(*command, "--port", "1")
    assert status == 2 and "--model-path" in stderr, stderr
    ring = ["serve", "--out", tmp_path / "s", "--ring-bytes", str(40 << 20)]
    status, stderr = cli_refusal(*ring, "--", "--model-path", "m")
    assert status == 2 and "--ring-bytes: give --slot-bytes with it" in stderr, stderr
    status, stderr = cli_refusal(*ring, "--slot-bytes", str(16 << 20), "--", "--model-path", "m")
    assert status == 2 and f"is not a whole number of at least 2 slots of --slot-bytes {16 << 20}" in stderr, stderr
    assert f"use {32 << 20}" in stderr, stderr
    assert not (tmp_path / "s").exists()  # refused before anything was started or written


def driver_command(model: Path, tmp: Path, name: str, *options: str) -> tuple[list[str], Path]:
    """tests/sglang_driver.py over PROMPTS, and the file its results go to."""
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp / f"{name}.json"
    command = [sys.executable, "-m", "tests.sglang_driver", "--model", str(model), "--prompts", str(prompts)]
    return [*command, "--out", str(out), *options], out


def run_engine(model: Path, tmp: Path, name: str, *options: str, env: dict[str, str] | None = None) -> list[dict]:
    command, out = driver_command(model, tmp, name, *options)
    subprocess.run(command, check=True, env=env or _env(), timeout=600)
    return json.loads(out.read_text())


def test_store_equals_what_sglang_returns_and_capture_changes_nothing(
    model: Path, tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    store_dir = tmp_path / "store"
    consumer = start_consumer(store_dir, endpoint, "--exit-on-eos")
    captured = run_engine(model, tmp_path, "captured", "--capture", endpoint)
    assert consumer.wait(60) == 0
    # Plain SGLang, the plugin not even loaded (switched off, it registers nothing: the test above).
    plain_runs = run_engine(model, tmp_path, "without", env={**_env(), "SGLANG_PLUGINS": "no-such-plugin"})

    # Capturing does not change what the model generates.
    assert [r["output_ids"] for r in captured] == [r["output_ids"] for r in plain_runs]

    # 1. Oracle: the stored rows are exactly what SGLang returns (aux states under the aux flags,
    # the post-norm last layer from the plain server), with the right token ids.
    store = open_store(store_dir)
    assert store.summary()["complete"] == len(PROMPTS)
    config = store.metadata()["runs"][0]["meta"]["config"]
    aux_names = [f"layer_{k}" for k in config["layers"]]
    assert config["layers"] == [2, 4, 5]  # SGLang's EAGLE-3 default for 8 layers, both families
    for mine, plain in zip(captured, plain_runs):
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


#: Radix cache on: a long system prompt (chunked: > 32 tokens), then requests hitting it, whole or in part.
SYSTEM = list(range(200, 270))
FIRST_ROUND = [[*SYSTEM, 5, 6, 7], SYSTEM[:40] + list(range(300, 340))]
SECOND_ROUND = [
    [*SYSTEM, 5, 6, 7],  # identical to a first-round prompt
    [*SYSTEM, 5, 6, 7],  # twice, in one batch
    [*SYSTEM, 9, 10, 11, 12],  # the system prompt, then its own question
    SYSTEM[:53] + list(range(400, 430)),  # diverging mid-prompt (not at a block edge)
    SYSTEM[:40] + list(range(300, 330)) + [1, 2],  # the second donor's prompt, diverging later
]


def test_radix_cache_on_every_request_is_complete_and_shared_rows_are_the_donors(
    tiny: Callable[[str], Path], tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    model = tiny("llama")
    then = tmp_path / "then.json"
    then.write_text(json.dumps(SECOND_ROUND))
    store_dir = tmp_path / "store"
    consumer = start_consumer(store_dir, endpoint, "--exit-on-eos")
    (tmp_path / "first.json").write_text(json.dumps(FIRST_ROUND))
    command = [
        sys.executable,
        "-m",
        "tests.sglang_driver",
        "--model",
        str(model),
        "--prompts",
        str(tmp_path / "first.json"),
    ]
    command += ["--then", str(then), "--out", str(tmp_path / "out.json"), "--capture", endpoint]
    command += ["--engine-json", json.dumps({"disable_radix_cache": False})]
    subprocess.run(command, check=True, env=_env(), timeout=600)
    assert consumer.wait(60) == 0
    results = json.loads((tmp_path / "out.json").read_text())
    assert verify_store(store_dir).ok
    store = open_store(store_dir)
    config = store.metadata()["runs"][0]["meta"]["config"]
    aux_names = [f"layer_{k}" for k in config["layers"]]
    sharing = 0
    for result in results:
        record = _check_complete(store, result["rid"], (result["prompt"] + result["output_ids"])[:-1])
        sharing += len(record.get("shared", ()))
        _check_own_rows(store, result, record, aux_names)
    # The second round hit the cache: SGLang computes at least the last prompt token, so an identical prompt
    # takes all the others from its donor; whatever SGLang's own usage figures say.
    assert sharing >= 3
    identical = [store.record(r["rid"]) for r in results[len(FIRST_ROUND) :][:2]]
    assert all(r["shared"][0]["end"] >= len(SYSTEM) for r in identical), identical
    assert store.summary()["rows_shared"] >= 2 * len(SYSTEM)


def _check_complete(store: Store, rid: str, tokens: list[int]) -> dict[str, Any]:
    """A finished request is complete: its rows are its ``tokens`` (prompt and output but the last) at every
    position, those it shares (a radix-cache hit) bitwise the rows of a donor holding the same tokens there.
    Returns its index line."""
    record, rows = store.record(rid), store.get(rid)
    total = len(tokens)
    assert record["status"] == "complete", record  # every donor was captured: nothing is missing
    assert rows["input_ids"].tolist() == tokens
    assert rows["positions"].tolist() == list(range(total))
    shared = record.get("shared", ())
    assert record["rows"] == total - sum(e["end"] - e["start"] for e in shared), record
    for entry in shared:
        start, end = entry["start"], entry["end"]
        donor = store.get(entry["id"])
        assert donor["input_ids"][start:end].tolist() == tokens[start:end], (rid, entry)
        for name in store.tensor_names:
            assert torch.equal(rows[name][start:end], donor[name][start:end]), (rid, entry, name)
    return record


def _check_own_rows(store: Store, result: dict[str, Any], record: dict[str, Any], aux_names: list[str]) -> None:
    """The rows a request computed itself are what SGLang returns for it (the tail of them it returns: it skips a
    long prompt's middle prefill chunks)."""
    rows = store.get(result["rid"])
    total = len(result["prompt"]) + len(result["output_ids"]) - 1
    returned = torch.tensor(result["hidden_states"], dtype=torch.float32)
    assert 0 < len(returned) <= record["rows"], (result["rid"], len(returned), record)
    aux = torch.cat([rows[n].float() for n in aux_names], dim=1)[total - len(returned) :]
    assert torch.equal(aux, returned), f"{result['rid']}: aux rows differ from SGLang's"


#: More architectures, one engine run each: the hscapture layers asked for (exercising each setter's numbering)
#: and the sglang.Engine options the model needs.
ARCHITECTURE_RUNS: dict[str, tuple[str, list[int], dict[str, Any]]] = {
    # DeepSeek's setter takes ids as given, unless the first is 1 (then it adds 1): layer 1 must not go first.
    "deepseek_v3": ("1,3,6", [1, 3, 6], {}),
    # Kimi-K2.5 forwards to its DeepSeek-V3 text model's setter; served text-only (no image processor here).
    "kimi_k25": ("1,3,6", [1, 3, 6], {"json_model_override_args": json.dumps({"language_model_only": True})}),
    # 6 layers: EAGLE-3's default [2, L//2, L-3] is [2, 3, 3]; hscapture's default drops the repeat.
    "qwen3": ("auto", [2, 3], {}),
    # Gemma3 also captures layer L, and what it captures is an MLP branch, not the residual stream.
    "gemma3": ("2,5,8", [2, 5, 8], {}),
}


@pytest.fixture(scope="module")
def architecture_run(
    tiny: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[LaunchPlan, Store, list[dict]]]:
    """Run each architecture once (capture on, SGLang's own return_hidden_states beside it), on first use."""
    runs: dict[str, tuple[LaunchPlan, Store, list[dict]]] = {}

    def run(name: str) -> tuple[LaunchPlan, Store, list[dict]]:
        if name not in runs:
            model, tmp = tiny(name), tmp_path_factory.mktemp(name)
            layers, _, engine = ARCHITECTURE_RUNS[name]
            with short_endpoint() as endpoint:
                consumer = subprocess.Popen(consume_command(endpoint, tmp / "store", "--exit-on-eos", "--quiet"))
                options = ("--capture", endpoint, "--layers", layers, "--engine-json", json.dumps(engine))
                results = run_engine(model, tmp, name, *options)
                assert consumer.wait(60) == 0
            plan = launch_plan(model, None if layers == "auto" else [int(k) for k in layers.split(",")])
            runs[name] = plan, open_store(tmp / "store"), results
        return runs[name]

    return run


def _hf_reference(model: Path, plan: LaunchPlan, tokens: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """HF transformers on the same tokens: the tensor each description names, and the residual stream beside it."""
    import transformers

    from hscapture.integrations.hf import decoder_parts

    hf_class = getattr(transformers, plan.arch.name)
    hf = hf_class.from_pretrained(model, dtype=torch.bfloat16).eval()
    layers, _ = decoder_parts(hf)
    branch: dict[int, torch.Tensor] = {}
    hooks = [
        layers[k - 1].post_feedforward_layernorm.register_forward_hook(lambda m, i, o, k=k: branch.__setitem__(k, o[0]))
        for k in plan.layers
        if plan.arch.captures == GEMMA3_MLP_BRANCH
    ]
    with torch.no_grad():
        states = hf(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    for hook in hooks:
        hook.remove()
    described = {f"layer_{k}": branch[k] if branch else states[k][0] for k in plan.layers}
    return {**described, "last": states[-1][0]}, {f"layer_{k}": states[k][0] for k in plan.layers}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("name", list(ARCHITECTURE_RUNS))
def test_each_architecture_stores_what_sglang_returns_as_asked_and_described(
    name: str, tiny: Callable[[str], Path], architecture_run: Callable[[str], tuple[LaunchPlan, Store, list[dict]]]
) -> None:
    plan, store, results = architecture_run(name)
    _, layers, _ = ARCHITECTURE_RUNS[name]
    meta = store.metadata()
    run = meta["runs"][0]["meta"]
    assert run["config"]["layers"] == list(plan.layers) == layers
    assert run["architecture"] == plan.arch.name and run["sglang_layers_to_capture"] == layers
    assert [t["description"] for t in meta["tensors"]] == plan.arch.describe(layers, True)
    assert store.summary()["complete"] == len(PROMPTS)
    for result in results:
        rows = store.get(result["rid"])
        tokens = (result["prompt"] + result["output_ids"])[:-1]
        assert rows["input_ids"].tolist() == tokens and rows["positions"].tolist() == list(range(len(tokens)))
        returned = torch.tensor(result["hidden_states"], dtype=torch.float32)  # SGLang's own aux states
        aux = torch.cat([rows[f"layer_{k}"].float() for k in layers], dim=1)[len(tokens) - len(returned) :]
        assert len(returned) > 0 and torch.equal(aux, returned), f"{name} {result['rid']}: not what SGLang returns"
    if name.startswith(("deepseek", "kimi")):
        return  # SGLang's tiny DeepSeek forward and HF's disagree by far more than bf16 (issue 10, finding 7)
    # The descriptions are true: each stored tensor is, to bf16 engine noise, what HF computes for it.
    result = max(results, key=lambda r: len(r["prompt"]))
    rows = store.get(result["rid"])
    described, residual = _hf_reference(tiny(name), plan, (result["prompt"] + result["output_ids"])[:-1])
    for tensor, reference in described.items():
        assert _relative(rows[tensor], reference) < 0.05, (name, tensor, _relative(rows[tensor], reference))
    if plan.arch.captures == GEMMA3_MLP_BRANCH:  # and Gemma3's is not the residual stream other models give
        assert all(_relative(rows[t], reference) > 0.5 for t, reference in residual.items())


def test_kimi_k25_stores_exactly_what_its_deepseek_v3_text_model_does(
    architecture_run: Callable[[str], tuple[LaunchPlan, Store, list[dict]]],
) -> None:
    _, kimi, kimi_results = architecture_run("kimi_k25")
    _, deepseek, deepseek_results = architecture_run("deepseek_v3")  # the same weights, without the wrapper
    assert kimi.tensor_names == deepseek.tensor_names
    for mine, theirs in zip(kimi_results, deepseek_results):
        assert mine["output_ids"] == theirs["output_ids"]
        a, b = kimi.get(mine["rid"]), deepseek.get(theirs["rid"])
        assert all(torch.equal(a[t], b[t]) for t in kimi.tensor_names)


def test_sglang_refuses_to_start_when_its_capture_cannot_be_described(
    tiny: Callable[[str], Path], tmp_path: Path, endpoint: str
) -> None:
    """A server started by hand with SGLang's default ids on a 6-layer model: [2, 3, 3] repeats layer 3."""
    command, _ = driver_command(tiny("qwen3"), tmp_path, "refused", "--capture", endpoint)
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "SGLang's Qwen3ForCausalLM layers_to_capture [2, 3, 3] repeats a layer" in done.stderr, done.stderr[-3000:]


def test_a_capture_failure_while_serving_is_loud_and_serving_goes_on(
    tiny: Callable[[str], Path], tmp_path: Path, endpoint: str, logged_consumer: Callable[..., LoggedConsumer]
) -> None:
    """A real failure inside SGLang: a consumer 3 s per chunk behind a 2-slot ring, under block_timeout_s 0.5."""
    store_dir = tmp_path / "store"
    consumer = logged_consumer(endpoint, "--exit-on-eos", "--quiet", "--delay-ms", "3000", out=store_dir)
    settings = {"slot_bytes": 8 << 20, "ring_bytes": 16 << 20, "block_timeout_s": 0.5}
    command, out = driver_command(tiny("llama"), tmp_path, "failed", "--capture", endpoint)
    done = subprocess.run(
        [*command, "--settings-json", json.dumps(settings)], env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]  # serving went on
    assert [len(r["output_ids"]) for r in json.loads(out.read_text())] == [8] * len(PROMPTS)
    assert "hscapture: capture failed, serving goes on without it: CreditTimeout: waited" in done.stderr
    assert consumer.wait_exit(120) == 1, consumer.stderr()
    assert "capture failed in the producer: CreditTimeout: waited" in consumer.stderr()
    reason = open_store(store_dir).metadata()["runs"][-1]["end"]["reason"]
    assert reason.startswith("capture failed in the producer: CreditTimeout: waited"), reason


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
    # block: every finished request must be complete, and a busy host must not make the ring drop rows (drop's
    # accounting has tests of its own); serving waits for the consumer instead.
    command = [sys.executable, "-m", "hscapture", "serve", "--out", str(store_dir), "--policy", "block"]
    command += ["--", "--model-path", str(model)]
    command += ["--port", str(port), "--chunked-prefill-size", "32", "--enable-mixed-chunk", "--log-level", "warning"]
    # Its own process group, as a shell gives a command it runs: the test's Ctrl-C goes to that group.
    process = subprocess.Popen(command, env=_env(), start_new_session=True)
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
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


#: Live server, radix cache on: /generate prompts sharing a long system prompt (chunked), some identical, some
#: diverging mid-prompt (not at a block edge); SGLang returns their states, the oracle for the rows each computed.
LIVE_SYSTEM = list(range(200, 330))
LIVE_PROMPTS = [
    [*LIVE_SYSTEM, 5, 6, 7],
    [*LIVE_SYSTEM, 5, 6, 7],
    [*LIVE_SYSTEM, 9, 10, 11, 12],
    LIVE_SYSTEM[:53] + list(range(400, 430)),
    LIVE_SYSTEM[:90] + list(range(500, 520)),
    LIVE_SYSTEM[:53] + list(range(400, 420)) + [7, 8],
]


def test_live_server_stores_every_finished_request_attributed_and_marks_aborted(
    server: tuple[str, subprocess.Popen, Path],
) -> None:
    """Concurrent requests over HTTP, radix cache and chunked prefill on, no cache_salt: chat conversations under
    two long system prompts (one diverging from the other mid-prompt), /generate prompts sharing one, and hung-up
    streams. Every finished request is complete, what it shares bitwise its donor's rows."""
    base, process, store_dir = server
    # hscapture serve sized SGLang's KV pool on the CPU path (left to SGLang: gigabytes, zero-filled at each start).
    with urllib.request.urlopen(f"{base}/server_info", timeout=30) as response:
        assert json.load(response)["max_total_tokens"] == CPU_POOL_TOKENS
    words = "the quick brown fox jumps over the lazy dog while seven cats watch from a sunny wall "
    system = (words * 5).strip()
    systems = [system, system[: len(system) // 2] + " seven green rivers run north past the old city"]
    bodies = [
        {
            "model": "default",
            "messages": [
                {"role": "system", "content": systems[i % 3 // 2]},  # two under the first for one under the second
                {"role": "user", "content": (words * (1 + i % 4))[: 40 + 50 * (i % 4)]},
            ],
            "max_tokens": 6 + i % 5,
            "temperature": 0,
            "rid": f"live-{i}",
            "return_prompt_token_ids": True,
            "return_token_ids": True,
        }
        for i in range(12)
    ]
    generate = [
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6 + i % 3, "temperature": 0},
            "return_hidden_states": True,
            "rid": f"gen-{i}",
        }
        for i, prompt in enumerate(LIVE_PROMPTS)
    ]
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def ask(path: str, body: dict) -> None:
        try:
            results[body["rid"]] = _post(f"{base}{path}", body)
        except BaseException as exc:
            errors.append(exc)

    aborted = [
        # ignore_eos: the random model samples its EOS about once in 2,048 tokens, and a request that ends on it
        # before the server sees the hang-up is complete (CI saw that once)
        {"model": "default", "messages": bodies[i]["messages"], "max_tokens": 1000, "ignore_eos": True}
        | {"stream": True, "rid": f"abort-{i}"}
        for i in range(2)
    ]
    threads = [threading.Thread(target=ask, args=("/v1/chat/completions", b)) for b in bodies]
    threads += [threading.Thread(target=ask, args=("/generate", b)) for b in generate]
    url = f"{base}/v1/chat/completions"
    threads += [threading.Thread(target=_abort_after_first_chunks, args=(url, b)) for b in aborted]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    # Radix-cache hits forced, one at a time: live-1's conversation again, a /generate prompt again, and the shared
    # system prompt diverging at a new place. SGLang reuses every cached prompt token but the last of a whole hit
    # (it computes at least one), so exactly positions [0, prompt - 1) of a repeat are never forwarded.
    results["live-again"] = _post(url, {**bodies[1], "rid": "live-again", "max_tokens": 3})
    again = [
        {**generate[0], "rid": "gen-again"},
        {**generate[0], "input_ids": [*LIVE_SYSTEM[:77], 9, 8, 7], "rid": "gen-77"},
    ]
    for body in again:
        results[body["rid"]] = _post(f"{base}/generate", body)
    with urllib.request.urlopen(f"{base}/health", timeout=60) as response:  # a load balancer's probe, idle
        assert response.status == 200
    time.sleep(2)  # the server notices the hang-ups and aborts those requests
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C at a terminal: every process of the foreground group gets it
    assert process.wait(180) == 0
    report = verify_store(store_dir)
    assert report.ok
    store = open_store(store_dir)
    # Only the requests sent are stored: not SGLang's warm-up at start, nor its health checks (the fixture's and the
    # probe above). The stop ended the run cleanly, as SGLang shut down, not as a crash.
    sent = {*results, *(body["rid"] for body in aborted)}
    assert set(store.keys()) == sent, set(store.keys()) ^ sent
    ends = [run["end"] for run in store.metadata()["runs"]]
    assert ends and all(end is not None and end["reason"] == "end of stream" for end in ends), ends
    aux_names = [f"layer_{k}" for k in store.metadata()["runs"][0]["meta"]["config"]["layers"]]
    for rid, reply in results.items():
        if rid.startswith("gen"):
            prompt = next(b["input_ids"] for b in [*generate, *again] if b["rid"] == rid)
            result = {"rid": rid, "prompt": prompt, "output_ids": reply["output_ids"]}
            result["hidden_states"] = returned_rows(reply["meta_info"])
            record = _check_complete(store, rid, (prompt + reply["output_ids"])[:-1])
            _check_own_rows(store, result, record, aux_names)
        else:
            choice = reply["choices"][0]
            prompt = choice["prompt_token_ids"]
            record = _check_complete(store, rid, (prompt + choice["response_token_ids"])[:-1])
        if rid in ("live-again", "gen-again"):  # any request with the same prompt tokens may donate
            assert [(e["start"], e["end"]) for e in record["shared"]] == [(0, len(prompt) - 1)], record
        if rid == "gen-77":  # the system prompt's first 77 tokens were cached
            assert record["shared"][0]["end"] >= 77, record
    for body in aborted:
        record = store.record(body["rid"])
        assert record["status"] == "incomplete" and "aborted" in record["reason"], record


def test_extract_with_the_radix_cache_on_completes_samples_sharing_a_long_system_prompt(
    tiny: Callable[[str], Path], tmp_path: Path
) -> None:
    """Teacher mode over conversations under one 512-token system prompt, radix cache on (the default): batches
    after the first find it cached and forward only the rest; every sample is complete all the same."""
    from transformers import AutoTokenizer

    from hscapture.data import load_samples
    from hscapture.tiny import long_system_prompt, write_demo_jsonl

    model, out = tiny("llama"), tmp_path / "store"
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = write_demo_jsonl(tmp_path / "data.jsonl", 12, system_prompt=long_system_prompt(tokenizer, 512))
    samples = list(load_samples(data, tokenizer, None))
    command = [sys.executable, "-m", "hscapture", "extract", "--engine", "sglang", "--model", str(model)]
    command += ["--data", str(data), "--out", str(out), "--max-batch-size", "4", "--no-progress"]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert verify_store(out).ok
    store = open_store(out)
    assert sorted(store.keys(complete_only=True)) == sorted(s.key for s in samples)
    for sample in samples:
        _check_complete(store, sample.key, sample.input_ids)
        assert store.get(sample.key)["loss_mask"].tolist() == sample.loss_mask
    # The second and third batch of four found the system prompt (>= 512 tokens) in the cache.
    assert store.summary()["rows_shared"] >= 8 * 512


def test_extract_passes_sglang_arguments_through_kimi_k25_text_only(
    tiny: Callable[[str], Path], tmp_path: Path
) -> None:
    """Kimi-K2.5 needs an image processor unless SGLang serves it text-only: an option only SGLang knows."""
    from transformers import AutoTokenizer

    from hscapture.data import load_samples
    from hscapture.extract import default_data_path

    model, out = tiny("kimi_k25"), tmp_path / "store"
    command = [sys.executable, "-m", "hscapture", "extract", "--engine", "sglang", "--model", str(model)]
    command += ["--out", str(out), "--layers", "1,3,6", "--limit", "8", "--no-progress"]
    command += ["--", "--json-model-override-args", json.dumps({"language_model_only": True})]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    store = open_store(out)
    run = store.metadata()["runs"][-1]["meta"]
    assert (run["architecture"], run["config"]["layers"]) == ("KimiK25ForConditionalGeneration", [1, 3, 6])
    samples = list(load_samples(default_data_path(), AutoTokenizer.from_pretrained(model), None))[:8]
    assert sorted(store.keys(complete_only=True)) == sorted(s.key for s in samples)
    for sample in samples:
        rows = store.get(sample.key)
        assert rows["input_ids"].tolist() == sample.input_ids and rows["loss_mask"].tolist() == sample.loss_mask


def test_extract_stops_sglang_at_once_when_its_consumer_stops(tiny: Callable[[str], Path], tmp_path: Path) -> None:
    """Minutes of generation asked for; the consumer dies as SGLang loads the model: extract ends then, saying why."""
    import psutil

    out = tmp_path / "store"
    command = [sys.executable, "-m", "hscapture", "extract", "--engine", "sglang", "--model", str(tiny("qwen3"))]
    command += ["--out", str(out), "--mode", "regenerate", "--max-new-tokens", "1500", "--limit", "32"]
    command += ["--no-progress"]
    process = subprocess.Popen(command, env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (out / "meta.json").exists():  # the consumer attached: the plugin started at model load
            assert process.poll() is None and time.monotonic() < deadline, "extract never attached its consumer"
            time.sleep(0.2)
        (consumer,) = [p for p in psutil.Process(process.pid).children() if "consume" in p.cmdline()]
        consumer.kill()
        _, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, stderr[-3000:]
    assert "EAGLE-3's default layers [2, 3, 3] repeat a layer at 6 decoder layers; capturing [2, 3]" in stderr
    assert "failed: consumer exited with code -9; the engine was stopped" in stderr, stderr[-3000:]


def test_examples_run_as_written_and_extract_gives_a_store_that_passes_the_hf_engine_checks(tmp_path: Path) -> None:
    """python examples/sglang_serve.py and examples/sglang_extract.py, on the embedded tiny Llama; the extract
    example's teacher store holds each sample's tokens, loss mask, positions and layers as the HF engine would."""
    from transformers import AutoTokenizer

    from hscapture.data import load_samples
    from hscapture.extract import default_data_path
    from hscapture.tiny import ensure_tiny_model

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

    # The serve example's 4 requests and nothing else (SGLang's warm-up and its health checks are not samples); its
    # SIGINT stopped the run cleanly.
    served = open_store(tmp_path / "sglang_serve.py")
    assert sorted(served.keys()) == [f"example-{i}" for i in range(4)], served.keys()
    assert [run["end"]["reason"] for run in served.metadata()["runs"]] == ["end of stream"], served.metadata()["runs"]

    out = tmp_path / "sglang_extract.py" / "teacher"
    assert verify_store(out).ok
    store = open_store(out)
    samples = list(load_samples(default_data_path(), AutoTokenizer.from_pretrained(ensure_tiny_model()), None))[:4]
    assert sorted(store.keys(complete_only=True)) == sorted(s.key for s in samples)
    for sample in samples:
        rows = store.get(sample.key)
        assert rows["input_ids"].tolist() == sample.input_ids
        assert rows["loss_mask"].tolist() == sample.loss_mask
        assert rows["positions"].tolist() == list(range(len(sample.input_ids)))
        assert all(rows[f"layer_{k}"].shape == (len(sample.input_ids), rows["last"].shape[1]) for k in (2, 4, 5))
