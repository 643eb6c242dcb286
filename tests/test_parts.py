"""One dataset from many jobs: ``extract --shard I/N``, ``--data-parallel K``, and stores read as one set.

The split jobs run as real ``hscapture extract`` processes (two at once, one of them SIGKILLed and
resumed; ``--data-parallel`` jobs sharing one queue of batches, one of them SIGKILLed and the set
resumed) and are compared with one unsharded extraction of the same data, row for row.

Why the rows can be compared bit for bit although the batches differ: on this CPU the tiny
Llama's rows for a sample depend on the padded length of its batch and on nothing else (neither
batch-mates nor batch size): measured on 40 demo conversations, a sample run alone differs from
its rows in a batch in 24 of 40 samples, and run alone but right-padded to its batch's length
matches them bit for bit in 40 of 40 (the softmax over padded keys sums in another order). So the
comparison uses samples of one length (conversations cut to the shortest's length): every batch,
sharded or not, is padded to that length, while batch-mates and batch sizes differ.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoTokenizer

from hscapture import StoreSet, open_store
from hscapture.data import load_samples, plan_batches
from hscapture.dataset import CaptureDataset
from hscapture.errors import StoreError
from hscapture.export import MANIFEST, ExportOptions, export
from hscapture.extract import ExtractOptions, extract, job_environments
from hscapture.partition import Part, coverage, key_hash
from hscapture.store.collection import verify_set
from hscapture.tiny import write_demo_jsonl
from tests.conftest import cli_refusal, run_cli, start_cli

ROOT = Path(__file__).resolve().parents[1]
RECORDS = 200
MAX_LENGTH = 16  # shorter than every demo conversation: every sample is exactly this long
BATCH_TOKENS = 64  # four samples per forward call


def request_lines(store: Path) -> list[dict]:
    index = store / "index.jsonl"
    lines = index.read_text().split("\n")[:-1] if index.exists() else []  # whole lines: one may be being written
    return [r for r in map(json.loads, lines) if r["type"] == "request"]


def assert_same_rows(got: StoreSet, want, keys: list[str]) -> None:
    """Every key's rows, tokens, positions and loss mask, bit for bit."""
    assert sorted(got.keys(complete_only=True)) == sorted(keys) == sorted(want.keys(complete_only=True))
    for key in keys:
        a, b = got.get(key), want.get(key)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (key, name)


# ------------------------------------------------------------------------------------- the split


def test_part_parse_names_the_mistake() -> None:
    assert Part.parse("1/4") == Part(1, 4) and Part.parse(" 0 / 1 ") == Part(0, 1)
    cases = {
        "4/4": "the part index must be 0..3",
        "1/0": "the part count must be at least 1",
        "x": "is not I/N",
        "1": "is not I/N",
        "-1/2": "is not I/N",
        "1/2/3": "is not I/N",
    }
    for text, expected in cases.items():
        with pytest.raises(ValueError, match=r"^--shard: ") as caught:
            Part.parse(text)
        assert expected in str(caught.value), (text, caught.value)


def test_key_hash_is_the_same_in_every_process() -> None:
    """Python's own string hash is salted per process; the split's is not (FORMAT.md pins one value)."""
    keys = [f"sample-{i:08d}" for i in range(50)] + ["demo-00000", "über", ""]
    script = "import sys; from hscapture.partition import key_hash; print([key_hash(k) for k in sys.argv[1:]])"
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", script, *keys], capture_output=True, text=True, env=env, check=True)
        assert json.loads(out.stdout) == [key_hash(k) for k in keys]
    assert key_hash("sample-00000000") == 0x39516C742CDC8B2E


def test_sub_parts_hold_exactly_their_part_and_coverage_finds_gaps_and_overlaps() -> None:
    keys = [f"k{i}" for i in range(3000)]
    assert all(Part(0, 1).owns(key) for key in keys)
    for count in (1, 2, 3):
        for k in (1, 2, 4):
            for part in (Part(i, count) for i in range(count)):
                mine = {key for key in keys if part.owns(key)}
                split = [Part(part.index + count * j, count * k) for j in range(k)]  # its sub-parts
                subs = [{key for key in keys if sub.owns(key)} for sub in split]
                assert set().union(*subs) == mine and sum(map(len, subs)) == len(mine), (part, k)
                assert not coverage([*split, *(Part(j, count) for j in range(count) if j != part.index)])[0]
    sizes = [sum(Part(i, 4).owns(key) for key in keys) for i in range(4)]
    assert min(sizes) > 0.8 * len(keys) / 4, sizes  # an even split
    missing, doubled = coverage([Part(0, 2), Part(1, 4)])
    assert missing == [Part(3, 4)] and doubled == []
    missing, doubled = coverage([Part(0, 2), Part(0, 4), Part(1, 2)])
    assert missing == [] and doubled == [(Part(0, 4), [Part(0, 2), Part(0, 4)])]
    for a in (Part(i, n) for n in (2, 3, 4, 6) for i in range(n)):
        for b in (Part(i, n) for n in (2, 3, 4, 6) for i in range(n)):
            brute = any(r % a.count == a.index and r % b.count == b.index for r in range(12))
            assert a.overlaps(b) == brute, (a, b)


# ------------------------------------------------------------------------------------- extraction


@pytest.fixture(scope="module")
def equal_data(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RECORDS demo conversations; with --max-length MAX_LENGTH each is exactly that long."""
    path = write_demo_jsonl(tmp_path_factory.mktemp("equal") / "demo.jsonl", n=RECORDS)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert min(len(s.input_ids) for s in load_samples(path, tokenizer)) > MAX_LENGTH
    return path


@pytest.fixture(scope="module")
def unsharded(tiny_model: Path, equal_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("unsharded") / "store"
    options = ExtractOptions(
        out=out, model=tiny_model, data=equal_data, max_length=MAX_LENGTH, max_batch_tokens=BATCH_TOKENS, progress=False
    )
    assert extract(options).store["complete"] == RECORDS
    return out


def extract_args(model: Path, data: Path, out: Path, *more: str) -> list[str | Path]:
    return [
        "extract", "--model", model, "--data", data, "--out", out, "--max-length", str(MAX_LENGTH),
        "--max-batch-tokens", str(BATCH_TOKENS), "--shard-bytes", "32K", *more,
    ]  # fmt: skip


def test_two_shard_jobs_at_once_one_killed_and_resumed_equal_one_unsharded_job(
    tiny_model: Path, equal_data: Path, unsharded: Path, tmp_path: Path
) -> None:
    out = tmp_path / "split"
    first = start_cli(*extract_args(tiny_model, equal_data, out, "--shard", "0/2", "--no-progress"))
    second = start_cli(
        *extract_args(tiny_model, equal_data, out, "--shard", "1/2", "--no-progress"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    part0 = out / "part-0-of-2"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and first.poll() is None and len(request_lines(part0)) < 8:
        time.sleep(0.02)
    assert first.poll() is None, "shard 0 finished before it could be killed"
    first.send_signal(signal.SIGKILL)
    first.wait()
    _, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr
    share = sum(Part(0, 2).owns(key) for key in open_store(unsharded))
    killed_with = len(open_store(part0).keys(complete_only=True))
    assert 8 <= killed_with < share

    resumed = run_cli(*extract_args(tiny_model, equal_data, out, "--shard", "0/2", "--no-progress"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {part0}: {killed_with} samples already captured, {share - killed_with} to go" in resumed.stderr
    assert f"store {part0}:" in resumed.stdout

    together = open_store(out)
    assert isinstance(together, StoreSet) and together.problems == [] and together.duplicates == {}
    assert_same_rows(together, open_store(unsharded), open_store(unsharded).keys())
    for index, part in enumerate(together.parts):
        assert all(Part(index, 2).owns(key) for key in part)
        assert {run["meta"]["part"] for run in part.metadata()["runs"]} == {f"{index}/2"}
        complete = [r["id"] for r in request_lines(part.root) if r["status"] == "complete"]
        assert len(complete) == len(set(complete)), "a sample was captured twice"
    # the comparison crosses batch boundaries: the shards' batches are not the unsharded run's
    samples = list(load_samples(equal_data, AutoTokenizer.from_pretrained(tiny_model), MAX_LENGTH))
    batches = {tuple(s.key for s in b) for b in plan_batches(samples, BATCH_TOKENS, 64)}
    mine = [s for s in samples if Part(0, 2).owns(s.key)]
    assert not {tuple(s.key for s in b) for b in plan_batches(mine, BATCH_TOKENS, 64)} & batches


def complete_ids(store: Path) -> list[str]:
    return [r["id"] for r in request_lines(store) if r["status"] == "complete"]


def test_data_parallel_jobs_of_an_engine_with_its_own_tp_share_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF runs on one GPU per job; SGLang and vLLM jobs each get an equal share, for their own tensor parallelism
    (``-- --tensor-parallel-size 2`` needs two GPUs in each job)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    shares = {
        engine: [
            env["CUDA_VISIBLE_DEVICES"]
            for env in job_environments(ExtractOptions(out=Path("unused"), engine=engine, device="cuda"), 2)
        ]
        for engine in ("hf", "sglang", "vllm")
    }
    assert shares == {"hf": ["4", "5"], "sglang": ["4,5", "6,7"], "vllm": ["4,5", "6,7"]}


def test_data_parallel_jobs_share_the_batches_under_one_bar(
    tiny_model: Path, equal_data: Path, unsharded: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Two jobs take batches from one queue: each store holds some, no key is in both, together they are the
    unsharded job's rows. The consumers are slowed (100 ms a slot) so that both jobs are loaded long before the
    batches run out, whichever loads first."""
    out = tmp_path / "parallel"
    options = ExtractOptions(
        out=out, model=tiny_model, data=equal_data, max_length=MAX_LENGTH, max_batch_tokens=BATCH_TOKENS,
        shard_bytes=32 * 1024, data_parallel=2, consumer_args=["--delay-ms", "100"],
    )  # fmt: skip
    summary = extract(options)
    updates = capfd.readouterr().err.replace("\n", "\r").split("\r")
    assert summary.samples == RECORDS and summary.store["complete"] == RECORDS and summary.store["parts"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["dp0", "dp1"]
    captured = [complete_ids(out / name) for name in ("dp0", "dp1")]
    assert all(captured), f"a job took no batch: {list(map(len, captured))}"
    assert not set(captured[0]) & set(captured[1]) and sum(map(len, captured)) == RECORDS, "each key by one job"
    assert [job.samples for job in summary.jobs] == list(map(len, captured))
    for j, name in enumerate(("dp0", "dp1")):
        assert [run["meta"]["job"] for run in open_store(out / name).metadata()["runs"]] == [j]
        assert "part" not in open_store(out / name).metadata()["runs"][0]["meta"]
    joint = [u for u in updates if "dp0: samples=" in u and "dp1: samples=" in u]
    assert joint and "100%" in joint[-1], updates[-3:]
    together = open_store(out)
    assert isinstance(together, StoreSet) and together.problems == [] and together.duplicates == {}
    assert_same_rows(together, open_store(unsharded), open_store(unsharded).keys())
    again = run_cli(*extract_args(tiny_model, equal_data, out, "--data-parallel", "3", "--no-progress"))
    assert again.returncode == 0 and "nothing to capture" not in again.stderr, again.stderr
    assert "captured 0 samples" in again.stdout and f"{RECORDS} were already there" in again.stdout
    assert f"store {out} (2 parts): {RECORDS} complete samples" in again.stdout
    assert sorted(p.name for p in out.iterdir()) == ["dp0", "dp1"], "a rerun with nothing left starts no job"


def test_shards_of_data_parallel_jobs_share_one_out(
    tiny_model: Path, equal_data: Path, unsharded: Path, tmp_path: Path
) -> None:
    """Two nodes' commands at once (--shard 0/2 and 1/2, two jobs each) into one OUT: flat stores, one set."""
    out = tmp_path / "nodes"
    argv = [extract_args(tiny_model, equal_data, out, "--shard", f"{i}/2", "--data-parallel", "2") for i in range(2)]
    nodes = [
        start_cli(*args, "--no-progress", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in argv
    ]
    for node in nodes:
        _, stderr = node.communicate(timeout=300)
        assert node.returncode == 0, stderr
    names = ["part-0-of-2-dp0", "part-0-of-2-dp1", "part-1-of-2-dp0", "part-1-of-2-dp1"]
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        part = Part.parse(name[5:11].replace("-of-", "/"))
        store = open_store(out / name)
        assert all(part.owns(key) for key in store)
        assert {(run["meta"]["part"], run["meta"]["job"]) for run in store.metadata()["runs"]} == {
            (str(part), int(name[-1]))
        }
    together = open_store(out)
    assert [p.root.name for p in together.parts] == names
    assert together.problems == [] and together.duplicates == {}
    assert_same_rows(together, open_store(unsharded), open_store(unsharded).keys())
    assert verify_set([out]).ok and run_cli("verify", out).returncode == 0
    report = json.loads(run_cli("inspect", out, "--json").stdout)
    assert report["requests"] == RECORDS and report["duplicates"] == 0 and len(report["parts"]) == 4


def job_of(out: Path, store: str, timeout_s: float = 180) -> psutil.Process:
    """The job process writing ``out/store``: the parent of the consumer process that writes it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in psutil.process_iter(["cmdline"]):
            if str(out / store) in (process.info["cmdline"] or []) and "consume" in process.info["cmdline"]:
                return process.parent()
        time.sleep(0.05)
    raise AssertionError(f"no consumer writes {out / store}")


def sigint_pending(pid: int) -> bool:
    """Whether SIGINT waits to be delivered to the (stopped) process ``pid`` (Linux: /proc's pending masks)."""
    masks = [line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines() if "Pnd:" in line]
    return any(int(mask, 16) >> (signal.SIGINT - 1) & 1 for mask in masks)


def test_a_killed_data_parallel_job_stops_the_others_and_a_rerun_completes_the_set(
    tiny_model: Path, equal_data: Path, unsharded: Path, tmp_path: Path
) -> None:
    out = tmp_path / "killed"
    running = start_cli(
        *extract_args(tiny_model, equal_data, out, "--data-parallel", "2", "--no-progress"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    job = job_of(out, "dp0")
    other = job_of(out, "dp1")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and running.poll() is None and not request_lines(out / "dp1"):
        time.sleep(0.02)
    other.send_signal(signal.SIGSTOP)  # with a sample in its store, dp1 stops taking work while dp0 reaches 8
    while time.monotonic() < deadline and running.poll() is None and len(request_lines(out / "dp0")) < 8:
        time.sleep(0.02)
    assert running.poll() is None, "the run finished before its job could be killed"
    job.send_signal(signal.SIGKILL)
    # dp1 goes on only once the parent has asked it to stop (its SIGINT pending): it finishes its store and takes
    # no more work. Let go sooner, on a busy host it could take all of the rest before the parent noticed dp0.
    while time.monotonic() < deadline and not sigint_pending(other.pid):
        time.sleep(0.02)
    other.send_signal(signal.SIGCONT)
    _, stderr = running.communicate(timeout=300)
    assert running.returncode == 1 and "hscapture extract: failed: dp0: its process exited with status -9" in stderr
    before = [complete_ids(out / name) for name in ("dp0", "dp1")]
    assert len(before[0]) >= 8 and sum(map(len, before)) < RECORDS
    assert open_store(out / "dp1").metadata()["runs"][-1]["end"] is not None, "dp1 was not let finish its store"

    resumed = run_cli(*extract_args(tiny_model, equal_data, out, "--data-parallel", "2", "--no-progress"))
    assert resumed.returncode == 0, resumed.stderr
    done = sum(map(len, before))
    assert f"resuming {out}: {done} samples already captured, {RECORDS - done} to go" in resumed.stderr
    after = [complete_ids(out / name) for name in ("dp0", "dp1")]
    assert sum(map(len, after)) == RECORDS and len(set(after[0] + after[1])) == RECORDS, "a sample captured twice"
    together = open_store(out)
    assert together.problems == [] and together.duplicates == {}
    assert_same_rows(together, open_store(unsharded), open_store(unsharded).keys())


def test_a_failing_job_stops_the_others_with_its_error(tiny_model: Path, tmp_path: Path, unsharded: Path) -> None:
    """Job 1's store was made for another model: its consumer refuses the run; job 0 stops, its store finished."""
    # Far more samples than job 0 takes while job 1 loads and fails, even on a busy host: job 0 is stopped mid-way.
    data = write_demo_jsonl(tmp_path / "long.jsonl", n=2000)
    out = tmp_path / "failing"
    foreign = out / "dp1"
    foreign.mkdir(parents=True)
    meta = json.loads((unsharded / "meta.json").read_text())
    (foreign / "meta.json").write_text(json.dumps({**meta, "hidden_size": 999}))
    done = run_cli("extract", "--model", tiny_model, "--data", data, "--out", out, "--data-parallel", "2")
    assert done.returncode == 1, done.stderr
    assert "hscapture extract: failed: dp1: " in done.stderr, done.stderr
    stopped = open_store(out / "dp0")
    assert len(stopped.keys(complete_only=True)) < 2000
    assert stopped.metadata()["runs"][-1]["end"] is not None, "job 0's store was not finished"


def test_bad_splits_and_layouts_fail_fast(tiny_model: Path, equal_data: Path, unsharded: Path, tmp_path: Path) -> None:
    base = ["extract", "--model", tiny_model, "--data", equal_data, "--no-progress"]
    parts = tmp_path / "parts"
    (parts / "part-0-of-2").mkdir(parents=True)
    shared = tmp_path / "shared"
    (shared / "part-0-of-2-dp1").mkdir(parents=True)
    static = "holds part 0/2 of the data, captured by one `--shard 0/2` job; this command (--data-parallel 2)"
    static_how = "`--shard 0/2` alone (one job writing OUT/part-0-of-2), and so for each such part"
    jobs = "holds part 0/2 of the data, captured by `--shard 0/2 --data-parallel` jobs; this command (--shard 0/2)"
    cases = [
        ([*base, "--out", tmp_path / "a", "--shard", "2/2"], "--shard: part 2/2: the part index must be 0..1"),
        ([*base, "--out", tmp_path / "a", "--shard", "one"], "--shard: 'one' is not I/N"),
        ([*base, "--out", tmp_path / "a", "--data-parallel", "0"], "--data-parallel: 0; give the number of jobs"),
        ([*base, "--out", tmp_path / "a", "--data-parallel", "2", "--device", "cuda:1"], "give --device cuda"),
        ([*base, "--out", tmp_path / "a", "--data-parallel", "2", "--device", "cuda"], "no CUDA device is visible"),
        ([*base, "--out", unsharded, "--shard", "0/2"], "is the store of an extraction without --shard"),
        ([*base, "--out", parts], "holds the parts of a split extraction (part-0-of-2)"),
        ([*base, "--out", parts, "--shard", "0/4"], "part-0-of-2 holds part 0/2 of the data, captured by one"),
        ([*base, "--out", parts, "--data-parallel", "2"], static),
        ([*base, "--out", parts, "--data-parallel", "2"], static_how),
        ([*base, "--out", parts, "--shard", "0/2", "--data-parallel", "2"], "(--shard 0/2 --data-parallel 2)"),
        ([*base, "--out", shared, "--shard", "0/2"], jobs),
        ([*base, "--out", shared, "--shard", "0/2"], "with `--shard 0/2 --data-parallel K` (any K)"),
        ([*base, "--out", shared, "--data-parallel", "2"], "this command (--data-parallel 2) would capture its keys"),
    ]
    if torch.cuda.is_available():  # on a GPU host: one GPU says "1 GPUs visible", two or more run
        cases = [case for case in cases if "no CUDA device" not in case[1]]
    for argv, expected in cases:
        status, stderr = cli_refusal(*argv)
        assert status == 2 and expected in stderr, (argv, stderr)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


# ------------------------------------------------------------------------------------- readers


@pytest.fixture(scope="module")
def parts_dir(tiny_model: Path, tiny_demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """conftest's tiny_store data, extracted by two --shard jobs: a directory of two static parts."""
    out = tmp_path_factory.mktemp("parts") / "set"
    for shard in ("0/2", "1/2"):
        options = ExtractOptions(
            out=out, model=tiny_model, data=tiny_demo_data, max_batch_tokens=1024, shard=shard, progress=False
        )
        assert extract(options).store["complete"] > 0
    assert StoreSet([out]).summary()["parts"] == 2
    return out


def test_capture_dataset_over_two_parts_yields_every_sample_once(parts_dir: Path, tiny_store: Path) -> None:
    whole = open_store(tiny_store)
    for source in (parts_dir, [parts_dir / "part-1-of-2", parts_dir / "part-0-of-2"]):
        dataset = CaptureDataset(source, tensors=["layer_2", "last"])
        assert sorted(dataset.keys) == sorted(whole.keys()) and len(dataset) == len(whole)
        loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn")
        seen = []
        for item in loader:
            key = next(k for k in dataset.keys if torch.equal(whole.get(k, tensors=[])["input_ids"], item["input_ids"]))
            want = whole.get(key)
            assert torch.equal(item["loss_mask"], want["loss_mask"]) and item["layer_2"].shape == want["layer_2"].shape
            seen.append(key)
        assert sorted(seen) == sorted(whole.keys()), "every sample once"
    first = CaptureDataset([parts_dir / "part-1-of-2", parts_dir / "part-0-of-2"])
    assert first.keys[: len(first.store.parts[0])] == first.store.parts[0].keys(), "part by part, in the order given"


def test_a_key_in_two_parts_is_reported_and_read_once(parts_dir: Path, tmp_path: Path) -> None:
    layout = tmp_path / "with-copy"
    for name in ("part-0-of-2", "part-1-of-2"):
        shutil.copytree(parts_dir / name, layout / name)
    shutil.copytree(parts_dir / "part-0-of-2", layout / "dp0")  # e.g. a part copied in twice
    doubled = open_store(parts_dir / "part-0-of-2").keys()
    both = open_store(layout)
    assert sorted(both.duplicates) == sorted(doubled)
    assert all(held == [str(layout / "part-0-of-2"), str(layout / "dp0")] for held in both.duplicates.values())
    assert len(both) == len(open_store(parts_dir)) and sorted(both.keys()) == sorted(open_store(parts_dir).keys())
    assert any(f"{len(doubled)} keys are in more than one part" in p for p in both.problems), both.problems
    assert len(CaptureDataset(layout)) == len(both)

    inspected = run_cli("inspect", layout, "--json")
    report = json.loads(inspected.stdout)
    assert report["duplicates"] == len(doubled) and report["requests"] == len(both)
    assert [p["requests"] for p in report["parts"]] == [len(doubled), len(both) - len(doubled), len(doubled)]
    text = run_cli("inspect", layout).stdout
    assert "a set of 3 parts" in text and f"{len(doubled)} keys in more than one part" in text and "duplicate '" in text
    verified = run_cli("verify", layout)
    assert verified.returncode == 1 and "set problem:" in verified.stdout and "FAILED" in verified.stdout
    exported = run_cli("export", layout, tmp_path / "export", "--format", "specforge", "--no-progress")
    assert exported.returncode == 0, exported.stderr
    assert f"wrote {len(both)} samples" in exported.stdout and "keys are in more than one part" in exported.stdout
    ids = [json.loads(line)["id"] for line in (tmp_path / "export" / MANIFEST).read_text().splitlines()[1:]]
    assert sorted(ids) == sorted(both.keys())


def test_set_layouts_gaps_and_mismatches(parts_dir: Path, tiny_model: Path, tiny_demo_data: Path, tmp_path: Path):
    groups = tmp_path / "serve-layout"  # hscapture serve's dp<rank> stores
    shutil.copytree(parts_dir / "part-0-of-2", groups / "dp0")
    shutil.copytree(parts_dir / "part-1-of-2", groups / "dp1")
    served = open_store(groups)
    assert [p.root.name for p in served.parts] == ["dp0", "dp1"] and served.problems == []
    assert sorted(served.keys()) == sorted(open_store(parts_dir).keys())
    assert verify_set([groups]).ok and run_cli("verify", groups).returncode == 0

    half = tmp_path / "half"
    shutil.copytree(parts_dir / "part-0-of-2", half / "part-0-of-2")
    assert any("no part holds the keys of part-1-of-2" in p for p in open_store(half).problems)
    assert run_cli("verify", half).returncode == 1
    (half / "part-1-of-2").mkdir()
    problems = open_store(half).problems
    assert problems == [f"{half / 'part-1-of-2'}: no store yet (nothing captured there)"], problems

    other = tmp_path / "other-capture"
    extract(ExtractOptions(tmp_path / "x", tiny_model, tiny_demo_data, layers=(1, 3), limit=2, progress=False))
    shutil.copytree(parts_dir / "part-0-of-2", other / "part-0-of-2")
    shutil.copytree(tmp_path / "x", other / "part-1-of-2")
    with pytest.raises(StoreError, match=r"meta.json differs from .*part-0-of-2's in 'tensors'"):
        open_store(other)
    with pytest.raises(StoreError, match=r"no meta\.json"):
        open_store(tmp_path / "empty-dir")


def test_export_numbers_samples_part_by_part_and_keeps_them_as_parts_arrive(parts_dir: Path, tmp_path: Path) -> None:
    growing, out = tmp_path / "growing", tmp_path / "export"
    shutil.copytree(parts_dir / "part-0-of-2", growing / "part-0-of-2")
    first = export(ExportOptions(growing, out, "specforge", progress=False))
    assert any("no part holds" in p for p in first.problems)
    before = (out / MANIFEST).read_text().splitlines()
    shutil.copytree(parts_dir / "part-1-of-2", growing / "part-1-of-2")
    second = export(ExportOptions(growing, out, "specforge", progress=False))
    assert second.problems == [] and second.kept == first.written and second.total == len(open_store(parts_dir))
    after = (out / MANIFEST).read_text().splitlines()
    assert after[: len(before)] == before, "numbers given before the second part arrived are kept"
    ids = [json.loads(line)["id"] for line in after[1:]]
    assert ids == open_store(growing).keys()
