"""What ``hscapture extract`` says while it runs: each phase of a long command, which trainers its store will feed
(before the model loads), and where its output is; and what it does not do on a rerun with nothing left."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import hscapture.extract as extraction
from hscapture.extract import ExtractOptions, extract
from hscapture.preflight import capture_note
from tests.conftest import TINY_SAMPLES, run_cli


def test_extract_says_each_phase_and_which_trainers_its_store_feeds(
    tiny_model: Path, tiny_demo_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "store"
    done = run_cli("extract", "--model", tiny_model, "--data", tiny_demo_data, "--out", out, "--limit", "2")
    assert done.returncode == 0, done.stderr
    said = done.stderr.replace("\r", "\n")
    phases = [
        "hscapture extract: capturing layer_2, layer_4, layer_5, last of a model of 8 decoder layers; the store "
        "exports to specforge; for speculators too, capture with --layers 2,4,5,8",
        f"hscapture extract: loading the model {tiny_model} (hf engine, cpu) ...",
        f"hscapture extract: reading and tokenizing {tiny_demo_data} ...",
        "waiting for the consumer to attach]",
        "capturing]",
        "finishing the store]",
    ]
    at = [said.find(phase) for phase in phases]
    assert -1 not in at and at == sorted(at), (at, said[:3000])
    printed = done.stdout
    assert f"read it: python -c \"from hscapture import open_store; s = open_store('{out}')" in printed
    assert f"export it: hscapture export {out} OUT --format specforge\n" in printed + "\n"


def test_a_rerun_with_nothing_left_loads_no_model_and_starts_no_consumer(
    tiny_store: Path, tiny_model: Path, tiny_demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "store"
    shutil.copytree(tiny_store, out)

    def never(*args: object) -> None:
        raise AssertionError("a rerun with nothing left loaded the model or started a consumer")

    monkeypatch.setattr(extraction, "open_engine", never)
    monkeypatch.setattr(extraction, "start_consumer", never)
    options = ExtractOptions(out=out, model=tiny_model, data=tiny_demo_data, max_batch_tokens=1024, progress=False)
    summary = extract(options)
    assert (summary.samples, summary.skipped, summary.store["complete"]) == (0, TINY_SAMPLES, TINY_SAMPLES)


def test_the_note_says_when_sglang_cannot_feed_a_trainer(tiny_model: Path, tmp_path: Path) -> None:
    """SGLang's Llama capture stops at layer L-1: no capture makes layer L, which speculators needs."""
    note = capture_note(tiny_model, None, True, "sglang", tmp_path)
    assert note.startswith("capturing layer_2, layer_4, layer_5, last of a model of 8 decoder layers")
    assert "exports to specforge; not speculators: SGLang's capture of this model cannot give what it needs" in note
    assert capture_note(tiny_model, (2, 4, 5, 8), False, "hf", tmp_path).endswith(
        "the store exports to speculators; for specforge too, capture with --layers 2,4,5,8 --last"
    )
