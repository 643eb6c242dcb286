"""The careless operator's inputs to ``hscapture extract`` (issue 12, findings 10 and 11), from the command line.

Bad options and bad data end in one clear line before the model loads (the tests give a model that
does not exist, so an error about anything else proves the order); a second extraction into a store
another one is writing is refused at once; a store never lists a key complete twice; ``--limit`` on
a rerun means the same records, not that many more; records with no assistant turn are counted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

from hscapture import cli
from hscapture.data import read_records, record_key
from hscapture.errors import HSCaptureError
from hscapture.extract import ExtractOptions, extract
from hscapture.store.format import encode_line
from hscapture.store.reader import open_store
from hscapture.store.records import DUPLICATE
from hscapture.store.verify import verify_store
from hscapture.store.writer import StoreWriter
from tests.conftest import cli_refusal, run_cli
from tests.storefeed import Feed, make_layout, make_request, shard_bytes


def complete_ids(root: Path) -> list[str]:
    lines = map(json.loads, (root / "index.jsonl").read_text().splitlines())
    return [r["id"] for r in lines if r["type"] == "request" and r["status"] == "complete"]


def write_jsonl(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Each case: extra arguments, and the start of the one line it must end in."""
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}\n'
    lone = '{"messages": [{"role": "user", "content": "a\\ud800"}]}\n'
    surrogate = write_jsonl(tmp_path / "surrogate.jsonl", good + lone)
    missing = tmp_path / "nope.jsonl"
    nested = write_jsonl(tmp_path / "nested.jsonl", good + '{"messages": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    gpus = torch.cuda.device_count()
    device = ["--device", f"cuda:{gpus}"] if gpus else ["--device", "cuda"]
    no_gpu = f"this host has {gpus} CUDA device(s)" if gpus else "no CUDA device is visible on this host"
    return {
        "no layers and --no-last": (["--layers", "", "--no-last"], "--layers: nothing to capture"),
        "a GPU this host lacks": (device, f"--device {device[1]}: {no_gpu}"),
        "not a device": (["--device", "tpu9"], "--device: 'tpu9' is not a torch device"),
        "missing data": (["--data", str(missing)], f"--data: '{missing}' does not exist"),
        "data is a directory": (["--data", str(tmp_path)], f"--data: '{tmp_path}' is not a file"),
        "negative limit": (["--limit", "-1"], "--limit: -1; give how many records"),
        "zero limit": (["--limit", "0"], "--limit: 0; give how many records"),
        "no tokenizing process": (["--tokenize-workers", "0"], "--tokenize-workers: 0; give 1 to 256 processes"),
        "a lone surrogate": (["--data", str(surrogate)], f"{surrogate}:2: a string holds a lone surrogate '\\ud800'"),
        "nested too deep": (["--data", str(nested)], f"{nested}:2: invalid JSON: nested too deep"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "no layers and --no-last",
        "a GPU this host lacks",
        "not a device",
        "missing data",
        "data is a directory",
        "negative limit",
        "zero limit",
        "no tokenizing process",
        "a lone surrogate",
        "nested too deep",
    ],
)
def test_bad_options_and_data_fail_in_one_line_before_the_model_loads(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args, expected = bad_inputs(tmp_path)[case]
    out = tmp_path / "store"
    capsys.readouterr()
    code = cli.main(["extract", "--out", str(out), "--model", str(tmp_path / "no-model"), *args, "--no-progress"])
    said = capsys.readouterr()
    assert code == 2, said
    (line,) = said.err.strip().splitlines()
    assert line.startswith(f"hscapture extract: error: {expected}"), line
    assert not out.exists(), "nothing is created for options that cannot run"


def test_a_second_extraction_into_the_same_store_is_refused_at_once(
    tiny_model: Path, tiny_demo_data: Path, tmp_path: Path
) -> None:
    """The first holds the store from before its model loads to its end (stopped with SIGSTOP while the second
    tries, so the second cannot slip in after it); every sample ends up complete exactly once."""
    out = tmp_path / "store"
    args = ["extract", "--model", str(tiny_model), "--data", str(tiny_demo_data), "--out", str(out)]
    args += ["--limit", "12", "--no-progress"]
    first = subprocess.Popen([sys.executable, "-m", "hscapture", *args], stderr=subprocess.PIPE, text=True)
    try:
        lock = out / ".lock"
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text().strip() == f"pid {first.pid}"):
            assert first.poll() is None and time.monotonic() < deadline, "the first extraction never took the store"
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)
        second = run_cli(*args)
        first.send_signal(signal.SIGCONT)
        assert second.returncode == 1, second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert line == (
            f"hscapture extract: failed: {out}: the store is in use, being written by pid {first.pid}; "
            "stop it or write to another directory"
        )
        assert first.wait(timeout=300) == 0
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.wait()
    keys = [record_key(r, i) for i, (_, r) in enumerate(read_records(tiny_demo_data))][:12]
    assert sorted(complete_ids(out)) == sorted(keys)


def test_a_store_never_lists_a_key_complete_twice(tmp_path: Path) -> None:
    """A request captured complete again (by a second writer session) is recorded incomplete as a duplicate;
    readers serve the first capture, verify is clean; a second complete line written by hand fails verify."""
    root = tmp_path / "store"
    rng = np.random.default_rng(10)
    first, again = make_request(6, "float32", rng), make_request(6, "float32", rng)
    for run_id, request in (("run-a", first), ("run-b", again)):
        writer = StoreWriter(root, shard_bytes("float32"))
        writer.begin_run(*make_layout(run_id))
        feed = Feed(writer, {"a": request})
        feed.chunk([("a", range(6))])
        feed.finish("a", num_tokens=6)
        writer.close()
    lines = [json.loads(line) for line in (root / "index.jsonl").read_text().splitlines()]
    statuses = [(r["status"], r.get("reason")) for r in lines if r["type"] == "request"]
    assert statuses == [("complete", ""), ("incomplete", DUPLICATE)]
    assert torch.equal(open_store(root).get("a")["layer_2"], first.rows[0])
    assert verify_store(root).ok

    line = next(r for r in lines if r["type"] == "request" and r["status"] == "complete")
    with (root / "index.jsonl").open("ab") as index:
        index.write(encode_line({k: v for k, v in line.items() if k != "line_crc32"}))
    report = verify_store(root)
    assert not report.ok and [(p.request, p.line) for p in report.duplicates] == [("a", len(lines) + 1)]


def test_limit_on_a_rerun_means_the_same_records(tiny_model: Path, tiny_demo_data: Path, tmp_path: Path) -> None:
    keys = [record_key(r, i) for i, (_, r) in enumerate(read_records(tiny_demo_data))]
    out = tmp_path / "store"

    def run(limit: int) -> int:
        return extract(ExtractOptions(out, tiny_model, tiny_demo_data, limit=limit, progress=False)).samples

    assert run(3) == 3
    assert run(3) == 0, "a rerun with the same limit finishes the same records, it does not take 3 more"
    assert run(5) == 2
    assert sorted(complete_ids(out)) == sorted(keys[:5])


def test_records_without_an_assistant_turn_are_stored_and_counted(tiny_model: Path, tmp_path: Path) -> None:
    data = write_jsonl(
        tmp_path / "data.jsonl",
        '{"id": "ask", "messages": [{"role": "user", "content": "only a question"}]}\n'
        '{"id": "chat", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}\n'
        '{"id": "prompt", "prompt": "a bare prompt"}\n',
    )
    out = tmp_path / "store"
    args = ["extract", "--model", str(tiny_model), "--data", str(data), "--out", str(out), "--no-progress"]
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    assert "warning: 2 of the 3 samples captured have an empty loss mask" in done.stderr
    store = open_store(out)
    assert sorted(store.keys(complete_only=True)) == ["ask", "chat", "prompt"]
    masks = {key: store.get(key)["loss_mask"] for key in store}
    assert not masks["ask"].any() and not masks["prompt"].any() and masks["chat"].any()
    assert os.stat(out).st_mode & 0o077 == 0


def unsupported_model(tmp_path: Path) -> Path:
    """A model directory whose architecture SGLang's capture cannot describe (refused from its config.json)."""
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 4}))
    return model


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("out_exists", [False, True], ids=["new out", "existing out"])
@pytest.mark.parametrize("split", [[], ["--shard", "1/2"]], ids=["one store", "a part"])
@pytest.mark.parametrize("refusal", ["bad layers", "unsupported architecture"])
def test_a_refused_run_leaves_nothing_it_created(
    refusal: str, split: list[str], out_exists: bool, tiny_model: Path, tiny_demo_data: Path, tmp_path: Path
) -> None:
    """Refused after the store's lock was taken (the model's layers or architecture): no lock, no store, no folder
    made; an --out that existed keeps exactly what it held."""
    base = tmp_path / "work"
    base.mkdir()
    out = base / "deep" / "out"
    if out_exists:
        out.mkdir(parents=True)
        (out / "mine.txt").write_text("the user's own file")
    before = listing(base)
    if refusal == "bad layers":
        args = ["--model", tiny_model, "--layers", "2,99"]
        expected = "99"
    else:
        args = ["--engine", "sglang", "--model", unsupported_model(tmp_path)]
        expected = "GPT2LMHeadModel"
    status, stderr = cli_refusal("extract", "--out", out, "--data", tiny_demo_data, *split, *args, "--no-progress")
    assert status == 2 and expected in stderr, stderr
    assert listing(base) == before


def test_an_engine_that_fails_to_start_leaves_no_empty_store(
    tiny_model: Path, tiny_demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer was started (it made index.jsonl) and the engine failed at start, as SGLang can: the store's
    files are removed with the folder; the error is the engine's."""
    from transformers import AutoTokenizer

    import hscapture.extract as extraction

    class FailingEngine:
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        meta: typing.ClassVar[dict[str, str]] = {}

        def start(self, *args: object) -> None:
            time.sleep(1.0)  # the consumer process is up and has opened the store meanwhile
            raise HSCaptureError("the engine did not start")

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(extraction, "open_engine", lambda options: FailingEngine())
    out = tmp_path / "store"
    with pytest.raises(HSCaptureError, match="the engine did not start"):
        extract(ExtractOptions(out, tiny_model, tiny_demo_data, limit=2, progress=False))
    assert not out.exists()


def test_sigterm_stops_extract_as_ctrl_c_does(tiny_model: Path, tmp_path: Path) -> None:
    """SIGTERM mid-capture (a scheduler stopping the job): the store is finished and verifies, the ring and sockets
    are gone at once (not left for the next run to reclaim), and the exit status says SIGTERM."""
    from hscapture.tiny import write_demo_jsonl

    data = write_demo_jsonl(tmp_path / "data.jsonl", n=400)
    out, log = tmp_path / "store", tmp_path / "stderr.txt"
    args = ["extract", "--model", tiny_model, "--data", data, "--out", out, "--no-progress", "--shard-bytes", "64K"]
    with log.open("wb") as stderr:
        job = subprocess.Popen([sys.executable, "-m", "hscapture", *map(str, args)], stderr=stderr)
    rings = f"hscapture-{os.getuid()}-{job.pid}-*"
    try:
        deadline = time.monotonic() + 240
        while not ((out / "index.jsonl").exists() and complete_ids(out)):  # capturing: samples stored
            assert job.poll() is None and time.monotonic() < deadline, "the extraction never began capturing"
            time.sleep(0.05)
        assert list(Path("/dev/shm").glob(rings))
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    said = log.read_text()
    assert job.returncode == 143, said
    assert "stopped (SIGTERM); run the same command again to resume" in said
    assert not list(Path("/dev/shm").glob(rings)), "the ring was left behind"
    assert not list(Path(f"/tmp/hscapture-{os.getuid()}").glob(f"extract-{job.pid}*")), "sockets were left behind"
    store = open_store(out)
    assert store.metadata()["runs"][-1]["end"] is not None, "the store's run was not finished"
    assert 0 < len(store.keys(complete_only=True)) < 400 and verify_store(out).ok


def test_a_record_past_the_models_context_is_cut_and_sizes_nothing(tiny_model: Path, tmp_path: Path) -> None:
    """One record of ~100k tokens on the tiny model (context 2048): it is cut to 2048 tokens, counted in a warning,
    and the ring is sized from --max-batch-tokens, not from the record (its rows go to the ring in several steps);
    the stored rows are the model's own for the cut tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_jsonl(
        tmp_path / "data.jsonl",
        json.dumps({"id": "huge", "text": "the same few words again " * 20_000}) + "\n"
        '{"id": "chat", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}\n',
    )
    out = tmp_path / "store"
    status, stderr = cli_refusal(
        "extract", "--model", tiny_model, "--data", data, "--out", out, "--max-batch-tokens", "512", "--no-progress"
    )
    assert status == 0, stderr
    assert "warning: 1 sample longer than the model's context (2048 tokens) cut to 2048 tokens" in stderr, stderr
    store = open_store(out)
    config = store.metadata()["runs"][-1]["meta"]["config"]
    assert config["max_step_rows"] == 512 and config["ring_bytes"] <= 64 << 20, config
    huge = store.get("huge")
    assert torch.equal(huge["positions"], torch.arange(2048))
    ids = AutoTokenizer.from_pretrained(tiny_model)("the same few words again " * 20_000)["input_ids"][:2048]
    assert huge["input_ids"].tolist() == ids
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.inference_mode():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(huge["layer_2"].float(), states[2][0].float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(huge["last"].float(), states[-1][0].float(), rtol=0.02, atol=0.02)
    assert store.record("chat")["status"] == "complete"


def test_steps_split_a_batch_into_ring_steps_of_bounded_rows() -> None:
    from hscapture.integrations.hf import steps

    assert steps([3, 2], 8) == [(0, 5, [0, 1], [3, 2])]
    assert steps([5, 6], 4) == [(0, 4, [0], [4]), (4, 8, [0, 1], [1, 3]), (8, 11, [1], [3])]
    assert steps([8], 4) == [(0, 4, [0], [4]), (4, 8, [0], [4])]
