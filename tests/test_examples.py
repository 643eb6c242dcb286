"""The scripts in examples/ and the overhead benchmark, run as real subprocesses as their docstrings say.

Each runs with small sizes, ``--out`` under the test's tmp_path and ``HSCAPTURE_HOME`` pointing
at the session's private home (set by the autouse fixture in conftest), so the embedded tiny
model is built there, not in ~/.cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hscapture import open_store
from hscapture.config import torch_dtype
from hscapture.tiny import write_demo_jsonl

ROOT = Path(__file__).resolve().parents[1]
OFFLINE_SAMPLES = 12
EAGLE3_TENSORS = ["layer_2", "layer_4", "layer_5", "last"]  # the tiny Llama has 8 layers: [2, 8 // 2, 8 - 3]


def run_script(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python <script> <args>`` from the repository root; fails the test with its output if it fails."""
    command = [sys.executable, *map(str, args)]
    result = subprocess.run(command, cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(command)} exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
    return result


def check_complete_store(out: Path, keys: list[str], tensors: list[str]) -> None:
    """The store opens, holds exactly ``keys``, all complete, each with rows at positions 0..n-1."""
    store = open_store(out)
    assert sorted(store.keys()) == sorted(keys)
    assert sorted(store.keys(complete_only=True)) == sorted(keys)
    assert [t["name"] for t in store.metadata()["tensors"]] == tensors
    for key in keys:
        record = store.record(key)
        assert (record["status"], record["reason"], record["missing"]) == ("complete", "", [])
        sample = store.get(key)
        n = record["num_tokens"]
        assert n > 0 and record["rows"] == n
        assert torch.equal(sample["positions"], torch.arange(n))
        assert sample["input_ids"].shape == (n,)
        for name in tensors:
            assert sample[name].shape == (n, store.metadata()["hidden_size"]), name
            assert sample[name].dtype == torch_dtype(store.metadata()["dtype"]), name
            assert bool(sample[name].float().abs().sum() > 0), f"{key} {name}: all zeros"


@pytest.fixture
def demo_data(tmp_path: Path) -> Path:
    return write_demo_jsonl(tmp_path / "demo.jsonl", n=OFFLINE_SAMPLES)


def demo_keys(data: Path) -> list[str]:
    return [json.loads(line)["id"] for line in data.read_text().splitlines()]


def test_offline_extract_example(tmp_path: Path, demo_data: Path) -> None:
    """python examples/offline_extract.py --out DIR --data FILE.jsonl (the embedded tiny Llama)."""
    out = tmp_path / "hs-offline"
    result = run_script("examples/offline_extract.py", "--out", out, "--data", demo_data)
    assert f"captured {OFFLINE_SAMPLES} samples" in result.stdout
    assert f"{OFFLINE_SAMPLES} samples in {out}" in result.stdout
    check_complete_store(out, demo_keys(demo_data), EAGLE3_TENSORS)
    store = open_store(out)
    assert any(bool(store.get(key)["loss_mask"].any()) for key in store), "no assistant tokens masked in"


def test_offline_extract_example_rerun_does_nothing_promptly(tmp_path: Path, demo_data: Path) -> None:
    """The docstring: run it twice and the second run finds every sample captured and does nothing.

    "Promptly": with nothing to capture, extraction once started a consumer that never got an end
    of stream and waited out a 120 s timeout; the rerun must finish well inside 60 s.
    """
    out = tmp_path / "hs-offline"
    run_script("examples/offline_extract.py", "--out", out, "--data", demo_data)
    index = (out / "index.jsonl").read_bytes()
    shards = sorted(p.name for p in out.glob("shard-*"))
    rerun = run_script("examples/offline_extract.py", "--out", out, "--data", demo_data, timeout=60)
    assert "captured 0 samples" in rerun.stdout
    assert f"{OFFLINE_SAMPLES} samples already captured, 0 to go" in rerun.stderr
    assert sorted(p.name for p in out.glob("shard-*")) == shards, "no new shard"
    assert (out / "index.jsonl").read_bytes().startswith(index)
    check_complete_store(out, demo_keys(demo_data), EAGLE3_TENSORS)


def test_streaming_capture_example(tmp_path: Path) -> None:
    """python examples/streaming_capture.py --out DIR, with 2 waves of 4 requests and 8 new tokens."""
    out = tmp_path / "hs-stream"
    result = run_script(
        "examples/streaming_capture.py", "--out", out, "--waves", "2", "--batch", "4", "--new-tokens", "8"
    )
    assert "served 64 tokens" in result.stdout
    lines = result.stdout.splitlines()  # it says what it does as it goes, and ends saying where the store is
    assert lines[0].startswith("loading the embedded tiny Llama") and "wave 2/2: 64 tokens served" in result.stdout
    assert lines[-3].startswith(f"store {out}: 8 complete requests") and "{" not in result.stdout
    assert lines[-2].startswith(f"read it: python -c \"from hscapture import open_store; s = open_store('{out}')")
    assert lines[-1] == f"inspect it: hscapture inspect {out}"
    keys = [f"wave{w}-req{i}" for w in range(2) for i in range(4)]
    check_complete_store(out, keys, ["layer_2", "layer_4", "layer_5", "last"])  # layers = (2, 4, 5) in the script
    store = open_store(out)
    assert store.summary()["rows_dropped"] == 0
    for key in keys:
        # prompt rows at prefill, then one row per decode step; the last generated token is never fed
        assert store.record(key)["num_tokens"] > 8 - 1


def test_train_reader_example(tmp_path: Path) -> None:
    """python examples/train_reader.py --out DIR --store-dtype fp8 --samples 16 --steps 30."""
    out = tmp_path / "hs-train"
    result = run_script(
        "examples/train_reader.py", "--out", out, "--store-dtype", "fp8", "--samples", "16", "--steps", "30"
    )
    assert "captured 16 samples" in result.stdout
    assert f"store {out}: 16 samples, rows stored as float8_e4m3fn" in result.stdout
    store = open_store(out)
    assert store.quantized and len(store.keys(complete_only=True)) == 16
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("trained 30 steps on 16 samples")]
    first, last = (float(part.split()[-1]) for part in line.split(": mean loss of the first 5 steps ")[1].split(","))
    assert last < 0.8 * first, f"the head did not learn: {line}"


def test_export_specforge_example(tmp_path: Path) -> None:
    """python examples/export_specforge.py --out DIR --samples 6: capture, export, load as SpecForge does."""
    out = tmp_path / "hs-specforge"
    result = run_script("examples/export_specforge.py", "--out", out, "--samples", "6")
    assert "exported 6 samples" in result.stdout and "aux layer_2, layer_4, layer_5; final last" in result.stdout
    assert "loaded 6 files as SpecForge does; each equals the store, bit for bit" in result.stdout
    assert "aux_hidden_state  (1, " in result.stdout and ", 768) torch.bfloat16" in result.stdout
    assert len(list((out / "specforge").rglob("data_*.ckpt"))) == 6
    rerun = run_script("examples/export_specforge.py", "--out", out, "--samples", "6")
    assert "exported 6 samples" in rerun.stdout, "a rerun finds everything done and changes nothing"


def test_hf_overhead_benchmark(tmp_path: Path) -> None:
    """python benchmarks/hf_overhead.py, tiny: batch 2, 4 new tokens, one timed repeat."""
    out = tmp_path / "r.json"
    args = ["--batch", "2", "--new-tokens", "4", "--repeats", "1", "--out", str(out)]
    result = run_script("benchmarks/hf_overhead.py", *args)
    assert f"wrote {out}" in result.stdout
    record = json.loads(out.read_text())
    assert record["command"].split()[1:] == ["benchmarks/hf_overhead.py", *args]
    assert (record["batch"], record["new_tokens"], record["repeats"]) == (2, 4, 1)
    assert list(record["results"]) == ["off", "drop", "block", "dump", "tolist"]
    for variant, numbers in record["results"].items():
        assert numbers["tok_per_s"] > 0, variant
        assert len(numbers["seconds"]) == 1 and numbers["seconds"][0] > 0, variant
    assert record["results"]["off"]["ratio_to_off"] == 1.0
    for policy in ("drop", "block"):
        assert record["producer_counters"][policy]["rows_captured"] > 0, policy
    assert record["producer_counters"]["block"]["rows_dropped"] == 0
