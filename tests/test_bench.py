"""The benchmark runner and its GPU suite: the lean engine against HF, the suite end to end (tiny, CPU).

The suite runs as a real subprocess (`python benchmarks/run.py gpu --tiny --device cpu`) with real
consumer processes writing real stores; the test checks the record's shape, the README table
between its markers and the chart, never the figures (speed is measured, not asserted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from benchmarks import report
from benchmarks.gpu_serving import VARIANTS, ServingLoop, resolve
from benchmarks.lean_llama import TINY, KVCache, LeanLlama, random_llama
from hscapture import open_store
from hscapture.config import resolve_layers
from hscapture.integrations.hf import eagle3_default_layers
from tests.conftest import run_cli, run_main

ROOT = Path(__file__).resolve().parents[1]
GOALS = {
    "decode_tok_s",
    "prefill_tok_s",
    "host_us_per_decode_step",
    "faster_than_tolist",
    "drain_vs_pinned_d2h",
    "store_vs_raw_disk",
    "store_fp8_vs_raw_disk",
}
README_TEXT = """# Benchmarks

Text above the table stays.

<!-- bench:gpu-tiny-cpu:begin -->
an old table
<!-- bench:gpu-tiny-cpu:end -->

Text below the table stays.
"""


def run_bench(*args: str | Path, in_process: bool = False, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/run.py ARGS``: a process of its own (a suite's run, as its users start it), or its main in
    this process (``in_process``: a refusal or a skip, where no process boundary is under test)."""
    if in_process:
        from benchmarks import run

        return run_main(run.main, [str(a) for a in args], program="benchmarks/run.py")
    command = [sys.executable, "benchmarks/run.py", *map(str, args)]
    return subprocess.run(command, cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=timeout)


def test_lean_forward_matches_hf_prefill_and_decode() -> None:
    """Capture set, cache and next tokens of the lean forward are HF's own, through prefill and two decodes."""
    torch.manual_seed(0)
    model = random_llama(TINY, torch.device("cpu"), torch.float32)
    layers = eagle3_default_layers(TINY["num_hidden_layers"])
    engine = LeanLlama(model, layers)
    cache = KVCache.allocate(model.config, 3, 16, torch.device("cpu"), torch.float32)
    cache.randomize()  # stale values past the valid prefix must be masked out
    prompt = torch.randint(0, TINY["vocab_size"], (2, 7))
    states, next_ids = engine.prefill(cache, prompt)
    tokens = prompt
    for step in range(3):
        with torch.no_grad():
            hf = model(tokens, output_hidden_states=True)
        expected = [hf.hidden_states[k] for k in layers] + [hf.hidden_states[-1]]
        for got, want in zip(states, expected):
            want = want.reshape(-1, want.shape[-1]) if step == 0 else want[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert torch.equal(next_ids, hf.logits[:, -1].argmax(-1)), f"step {step}"
        tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
        positions = torch.full((2,), tokens.shape[1] - 1)
        states, next_ids = engine.decode(cache, next_ids, positions)


def test_lean_forward_returns_every_layer_with_layer_l() -> None:
    """``--layers all`` in the gpu suite: layers 1..L, where L (the final norm's input) is HF's last hidden state
    before its final norm."""
    torch.manual_seed(0)
    model = random_llama(TINY, torch.device("cpu"), torch.float32)
    count = TINY["num_hidden_layers"]
    engine = LeanLlama(model, resolve_layers("all", count))
    cache = KVCache.allocate(model.config, 2, 8, torch.device("cpu"), torch.float32)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 5))
    states, _ = engine.prefill(cache, prompt)
    with torch.no_grad():
        hf = model(prompt, output_hidden_states=True).hidden_states
        norm, model.model.norm = model.model.norm, torch.nn.Identity()
        unnormed = model(prompt, output_hidden_states=True).hidden_states
        model.model.norm = norm
    assert len(states) == count + 1 == engine.num_states
    for got, want in zip(states, [*hf[1:count], unnormed[count], hf[count]]):
        torch.testing.assert_close(got, want.reshape(-1, want.shape[-1]), rtol=1e-4, atol=1e-5)


def test_lean_llama_refuses_unordered_aux_layers() -> None:
    model = random_llama(TINY, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="aux_layers"):
        LeanLlama(model, (5, 2))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    """One tiny CPU run of the gpu suite into a private results dir and README."""
    base = tmp_path_factory.mktemp("bench")
    results, readme = base / "results", base / "README.md"
    readme.write_text(README_TEXT)
    done = run_bench(
        "gpu", "--tiny", "--device", "cpu", "--results-dir", results, "--readme", readme,
        "--work-dir", base / "work" / "new",  # created by the suite
    )  # fmt: skip
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert (base / "work" / "new").is_dir()
    return results, readme, done


def test_gpu_suite_tiny_cpu_writes_a_complete_record(tiny_run: tuple[Path, Path, subprocess.CompletedProcess]) -> None:
    results, _, _ = tiny_run
    record = json.loads((results / "gpu-tiny-cpu.json").read_text())
    assert record["suite"] == "gpu" and record["name"] == "gpu-tiny-cpu" and record["complete"]
    assert record["command"].startswith("python benchmarks/run.py gpu --tiny --device cpu")
    assert record["commit"] not in ("", "unknown") and record["versions"]["torch"] == metadata.version("torch")
    assert record["device"]["kind"] == "cpu" and record["settings"]["graphs"] is False
    workloads = {**record["results"]["decode"]["workloads"], **record["results"]["prefill"]["workloads"]}
    assert list(workloads) == ["decode bs1", "decode bs4", "prefill 64"]
    for name, entry in workloads.items():
        assert list(entry) == list(VARIANTS), name
        assert entry["off"]["ratio_to_off"] == 1.0 and entry["off"]["capture_us_per_step"] == 0.0
        repeats = record["settings"]["repeats" if name.startswith("decode") else "prefill_repeats"]
        for variant, figures in entry.items():
            assert figures["tok_per_s"] > 0 and len(figures["seconds"]) == repeats, (name, variant)
            spread = [figures[f"host_us_{q}"] for q in ("p50", "p90", "p99")]  # every timed step's hooks
            assert 0 <= spread[0] <= spread[1] <= spread[2] and figures["gc_runs"] >= 0, (name, variant, figures)
        assert entry["block"]["rows_dropped"] == 0, name
    stores = record["results"]["stores"]
    for policy in ("drop", "block"):  # what the producer announced is what the store holds
        assert stores[policy]["consumer_exit"] == 0
        assert stores[policy]["store"]["rows"] == stores[policy]["producer"]["rows_captured"] > 0, policy
    assert stores["block"]["producer"]["rows_dropped"] == 0
    assert "skipped" in record["results"]["drain"]
    for section in ("store", "store_fp8"):  # rows stored as captured, and as fp8 (half the bytes)
        store = record["results"][section]
        assert store["bytes_per_repeat"] > 0 and store["store_gbps"] > 0 and store["raw_write_gbps"] > 0
    assert record["results"]["store_fp8"]["bytes_per_repeat"] < record["results"]["store"]["bytes_per_repeat"]
    assert set(record["goals"]) == GOALS
    for goal in record["goals"].values():
        assert set(goal) == {"target", "value", "met", "note"}


def test_gpu_suite_tiny_cpu_updates_its_readme_table_and_draws_the_chart(
    tiny_run: tuple[Path, Path, subprocess.CompletedProcess],
) -> None:
    results, readme, done = tiny_run
    text = readme.read_text()
    assert text.startswith("# Benchmarks\n\nText above the table stays.\n") and text.endswith(
        "Text below the table stays.\n"
    )
    block = text.split("<!-- bench:gpu-tiny-cpu:begin -->\n")[1].split("<!-- bench:gpu-tiny-cpu:end -->")[0]
    assert "an old table" not in block
    assert "| workload | variant | tok/s | vs off |" in block and "| decode bs4 | block |" in block
    assert (
        "| goal | target | value | met | note |" in block and "![tok/s per variant](results/gpu-tiny-cpu.png)" in block
    )
    assert (results / "gpu-tiny-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"updated the gpu-tiny-cpu table in {readme}" in done.stdout


def test_hscapture_bench_redraws_a_record_into_another_readme(
    tmp_path: Path, tiny_run: tuple[Path, Path, subprocess.CompletedProcess]
) -> None:
    """`python -m hscapture bench` is run.py; --from-json measures nothing and redraws table and chart."""
    results, _, _ = tiny_run
    readme = tmp_path / "README.md"
    readme.write_text(README_TEXT)
    done = run_cli(  # in this process; the bench command starts run.py in its own
        "bench", "gpu", "--from-json", results / "gpu-tiny-cpu.json", "--results-dir", tmp_path, "--readme", readme,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| decode bs1 | off |" in readme.read_text()
    assert (tmp_path / "gpu-tiny-cpu.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without a GPU")
def test_gpu_suite_skips_without_a_gpu_and_writes_nothing(tmp_path: Path) -> None:
    done = run_bench("gpu", "--results-dir", tmp_path, "--readme", tmp_path / "README.md", in_process=True)
    assert done.returncode == 0
    assert "gpu suite skipped: no CUDA GPU visible" in done.stderr and "--tiny" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(find_spec("vllm") is not None, reason="checks the skip where vLLM is not installed")
def test_vllm_suite_skips_without_vllm_and_writes_nothing(tmp_path: Path) -> None:
    done = run_bench("vllm", "--results-dir", tmp_path, "--readme", tmp_path / "README.md", in_process=True)
    assert done.returncode == 0
    assert "vllm suite skipped: vLLM is not installed here" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpu_suite_refuses_bad_settings_naming_the_option(tmp_path: Path) -> None:
    done = run_bench(
        "gpu", "--tiny", "--device", "cpu", "--prefill-tokens", "65", "--prefill-seqs", "2",
        "--results-dir", tmp_path, in_process=True,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--prefill-tokens 65 is not a multiple of --prefill-seqs 2" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpu_suite_refuses_a_run_its_stores_could_not_fit(tmp_path: Path) -> None:
    """Every layer, a storing ring and long prefills: the rows it could store are counted against the work dir's
    free space before the model is built (every layer of an 8B model once filled the GPU host's disk)."""
    done = run_bench(
        "gpu", "--tiny", "--device", "cpu", "--layers", "all", "--variants", "drop,discard",
        "--prefill-tokens", "100000000", "--prefill-steps", "64", "--results-dir", tmp_path, "--work-dir",
        tmp_path / "work", in_process=True,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"into {tmp_path / 'work'} (" in done.stderr and "1 storing ring(s) (drop)" in done.stderr, done.stderr
    assert "--variants without drop/block/dump" in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suite", [("gpu", "--tiny", "--device", "cpu"), ("store",), ("extract",), ("read",)])
def test_a_suite_refuses_a_work_dir_it_cannot_create(tmp_path: Path, suite: tuple[str, ...]) -> None:
    """Before any work, in one line naming the option (a missing one is made: see tiny_run)."""
    (tmp_path / "a-file").write_text("")
    done = run_bench(
        *suite, "--results-dir", tmp_path / "results", "--work-dir", tmp_path / "a-file" / "work", in_process=True,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--work-dir: " in done.stderr and "a-file/work' is not writable" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "results").exists()


def test_a_smoke_run_leaves_the_checkouts_results_and_readme_alone(tmp_path: Path) -> None:
    """``--tiny`` is offered as runnable anywhere: by default it writes into a fresh temporary directory and no
    README; named destinations are honoured; a full run writes the checkout's results and README."""
    from benchmarks import run

    parser = run.build_parser()
    for suite in ("gpu", "extract", "parallel", "read", "vllm"):
        results, readme = run.destinations(parser.parse_args([suite, "--tiny"]))
        assert results.is_dir() and not list(results.iterdir()) and readme is None, suite
        assert not results.resolve().is_relative_to(ROOT), suite
        results.rmdir()
    named = parser.parse_args(["read", "--tiny", "--results-dir", str(tmp_path), "--readme", str(tmp_path / "R.md")])
    assert run.destinations(named) == (tmp_path, tmp_path / "R.md")
    assert run.destinations(parser.parse_args(["read"])) == (report.RESULTS, report.README)


def test_the_readmes_list_every_suite_run_py_has() -> None:
    """``run.py --help``, the README's list of suites and benchmarks/README.md's table name the same suites."""
    from benchmarks import run

    listed = (ROOT / "README.md").read_text().split("lists the suites:")[1].split(".")[0]
    assert sorted(re.findall(r"`([\w-]+)`", listed)) == sorted(run.SUITES)
    table = (ROOT / "benchmarks" / "README.md").read_text()
    assert sorted(re.findall(r"\*\*suite `([\w-]+)`\*\*", table)) == sorted(run.SUITES)
    usage = run.build_parser().format_help()
    assert all(name in usage for name in run.SUITES)


def test_update_readme_leaves_a_readme_without_markers_alone(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    assert report.update_readme(readme, "gpu-h200", "table\n") is False
    assert readme.read_text() == "no markers here\n"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_graph_replayed_decode_stores_exactly_the_eager_forward_states(tmp_path: Path) -> None:
    """The in-graph ring write of the suite's decode loop stores what an eager step computes, row by row."""
    parser = argparse.ArgumentParser()
    from benchmarks.gpu_serving import add_arguments

    add_arguments(parser)
    device, settings = resolve(parser.parse_args(["--tiny", "--device", "cuda", "--work-dir", str(tmp_path)]))
    loop = ServingLoop(settings, device, tmp_path)
    try:
        loop.setup()
        block = next(v for v in loop.variants if v.name == "block")
        bs, steps, context = 4, settings["decode_steps"], settings["context"]
        loop.time_decode(block, bs, repeat=0)
        ids, positions = loop.static[bs]
        loop.reset(bs)
        expected = []
        for _ in range(steps):
            states, next_ids = loop.engine.decode(loop.cache, ids, positions)
            expected.append([s.clone() for s in states])
            ids.copy_(next_ids)
            positions.add_(1)
        summaries = loop.close()
    finally:
        if loop.producers:
            loop.close()
    assert summaries["block"]["producer"]["rows_dropped"] == 0
    store = open_store(tmp_path / "store-block")
    names = [f"layer_{k}" for k in loop.aux_layers] + ["last"]
    for row in range(bs):
        sample = store.get(f"block-bs{bs}-r0-{row}")
        assert torch.equal(sample["positions"], torch.arange(context, context + steps))
        for t, name in enumerate(names):
            want = torch.stack([expected[step][t][row] for step in range(steps)]).cpu()
            # bf16 tolerance: cuBLAS may pick another algorithm on the capture stream; a row of another
            # request or position would differ entirely
            torch.testing.assert_close(sample[name], want)


@pytest.mark.slow
def test_parallel_suite_tiny_cpu_compares_two_jobs_with_one(tmp_path: Path) -> None:
    """`run.py parallel`: extract --data-parallel 1 then 2 over the same data, same keys, a ratio and its goal."""
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:parallel-tiny-cpu:begin -->\nold\n<!-- bench:parallel-tiny-cpu:end -->\n")
    done = run_bench(
        "parallel", "--tiny", "--device", "cpu", "--tokens", "3000", "--conversations", "6",
        "--results-dir", tmp_path / "results", "--readme", readme, "--work-dir", tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    record = json.loads((tmp_path / "results" / "parallel-tiny-cpu.json").read_text())
    assert record["complete"] and record["settings"]["jobs"] == 2
    assert record["settings"]["extract_options"].startswith("--layers 4 --no-last --store-dtype fp8")
    one, two = record["results"]["jobs_1"], record["results"]["jobs_2"]
    assert one["samples"] == two["samples"] == one["store"]["complete"] == two["store"]["complete"] == 6
    assert one["tokens"] == two["tokens"] and "--data-parallel 2" in two["command"]
    assert record["results"]["ratio"] == round(two["tok_per_s"] / one["tok_per_s"], 3)
    assert record["goals"]["jobs_2_vs_1"]["target"] == ">= 1.9"
    assert "| `--data-parallel 2` |" in readme.read_text() and "old" not in readme.read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("hscapture-parallel-")] == []  # work removed


def test_parallel_suite_without_enough_gpus_says_so_and_writes_nothing(tmp_path: Path) -> None:
    if torch.cuda.device_count() >= 64:
        pytest.skip("this host has 64 GPUs")
    done = run_bench("parallel", "--jobs", "64", "--results-dir", tmp_path, "--readme", tmp_path, in_process=True)
    assert done.returncode == 0 and "--jobs 64 needs 64 GPUs" in done.stderr, done.stderr


READ_README = """# Benchmarks

<!-- bench:read-tiny-cpu:begin -->
an old table
<!-- bench:read-tiny-cpu:end -->
"""


@pytest.mark.slow
def test_read_suite_tiny_writes_its_record_table_and_chart(tmp_path: Path) -> None:
    """The read suite reads every sample of the store it wrote through each path, checks on and off."""
    from benchmarks.read_verify import CHECKS, PATHS

    results, readme = tmp_path / "results", tmp_path / "README.md"
    readme.write_text(READ_README)
    done = run_bench(
        "read", "--tiny", "--repeats", "2", "--results-dir", results, "--readme", readme,
        "--work-dir", tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    record = json.loads((results / "read-tiny-cpu.json").read_text())
    assert record["suite"] == "read" and record["name"] == "read-tiny-cpu" and record["complete"]
    assert record["command"].startswith("python benchmarks/run.py read --tiny")
    assert record["commit"] not in ("", "unknown") and record["settings"]["repeats"] == 2
    store = record["results"]["store"]
    assert store["samples"] > 0 and store["shards"] > 1 and store["shard_bytes"] > store["captured_bytes"]
    assert store["captured_bytes"] == store["rows"] * store["row_bytes"]
    for path in PATHS:
        entry = record["results"][path]
        for check in CHECKS:
            figures = entry[check]
            assert figures["samples_per_s"] > 0 and figures["gbps"] > 0 and len(figures["seconds"]) == 2, (path, check)
        assert entry["verify_on_vs_off"] == round(entry["on"]["samples_per_s"] / entry["off"]["samples_per_s"], 4)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("hscapture-read-")] == []  # store removed
    block = readme.read_text().split("<!-- bench:read-tiny-cpu:begin -->\n")[1].split("<!-- bench:read-tiny-cpu:end")[0]
    assert "an old table" not in block and "| path | verify | samples/s | tok/s | GB/s | verify on / off |" in block
    assert "| loader-2 | on |" in block and "![tok/s per variant](results/read-tiny-cpu.png)" in block
    assert (results / "read-tiny-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_read_suite_refuses_bad_settings_before_writing_a_store(tmp_path: Path) -> None:
    done = run_bench("read", "--tiny", "--sample-tokens", "-3", "--results-dir", tmp_path, in_process=True)
    assert done.returncode == 2
    assert "read suite: error: --sample-tokens -3: must be > 0" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_host_time_goal_names_the_same_hosts_write_only_floor() -> None:
    """Host µs per decode step follow the host: the goal's note gives the in-graph copy's own hooks of the same run
    and batch beside it (here the committed H200 result's)."""
    from benchmarks.gpu_serving import compute_goals

    results = json.loads((ROOT / "benchmarks" / "results" / "gpu-h200.json").read_text())["results"]
    workloads = results["decode"]["workloads"]
    note = compute_goals(results, tiny=False)["host_us_per_decode_step"]["note"]
    worst = next(name for name in workloads if note.startswith(f"worst: {name} "))
    assert note.endswith(f"; write-only's hooks there {workloads[worst]['write-only']['host_us_p50']} µs median"), note
    without = {"decode": {"workloads": {worst: {p: workloads[worst][p] for p in ("off", "drop", "block")}}}}
    assert "write-only" not in compute_goals(without, tiny=False)["host_us_per_decode_step"]["note"]  # none measured
