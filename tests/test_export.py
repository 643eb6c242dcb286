"""hscapture export: stores made by real capture, exported, then loaded the way each trainer loads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hscapture import open_store
from hscapture.data import load_samples, pad_batch, plan_batches
from hscapture.export import MANIFEST, ExportOptions, export
from hscapture.extract import ExtractOptions, extract
from hscapture.tiny import write_demo_jsonl
from tests.trainer_readers import SpeculatorsDataset, specforge_item, specforge_list_files
from tests.workload import Workload

SAMPLES = 24
BATCH_TOKENS = 512
LAYERS = (2, 4, 5, 8)  # the tiny Llama has L = 8 layers: EAGLE-3's 2, L/2, L-3, and L for speculators
AUX = ["layer_2", "layer_4", "layer_5"]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_jsonl(tmp_path_factory.mktemp("data") / "demo.jsonl", n=SAMPLES)


@pytest.fixture(scope="module")
def store_dir(tiny_model: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real extraction on the tiny model, with the aux layers, layer L and the post-norm state."""
    out = tmp_path_factory.mktemp("store")
    options = ExtractOptions(
        out=out, model=tiny_model, data=demo_data, layers=LAYERS, max_batch_tokens=BATCH_TOKENS, progress=False
    )
    assert extract(options).store["complete"] == SAMPLES
    return out


def manifest_ids(out: Path) -> dict[int, str]:
    lines = [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]
    return {line["index"]: line["id"] for line in lines[1:]}


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hscapture", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_specforge_export_is_what_specforge_loads(store_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "specforge"
    result = run_cli("export", store_dir, out, "--format", "specforge", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert f"wrote {SAMPLES} samples" in result.stdout and "final last" in result.stdout
    store = open_store(store_dir)
    ids = manifest_ids(out)
    files = specforge_list_files(out)
    assert len(files) == SAMPLES and sorted(ids) == list(range(SAMPLES))
    hidden = store.metadata()["hidden_size"]
    for path in files:
        index = int(Path(path).name.removeprefix("data_").removesuffix(".ckpt"))
        assert Path(path).parent.name == "rows_0-2000"
        item = specforge_item(path)
        sample = store.get(ids[index])
        n = len(sample["input_ids"])
        assert item["hidden_state"].shape == (1, n, 3 * hidden) and item["target"].shape == (1, n, hidden)
        assert torch.equal(item["hidden_state"][0], torch.cat([sample[name] for name in AUX], dim=-1))
        assert torch.equal(item["target"][0], sample["last"])
        assert item["hidden_state"].dtype == item["target"].dtype == torch.bfloat16
        assert torch.equal(item["input_ids"][0], sample["input_ids"])
        expected_mask = sample["loss_mask"].clone()
        expected_mask[-1] = 0
        assert torch.equal(item["loss_mask"][0], expected_mask) and bool(expected_mask.any())
    assert all(store.record(key)["status"] == "complete" for key in ids.values())
    assert sorted(ids.values()) == sorted(store.keys())


def test_speculators_export_is_what_speculators_loads(store_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "speculators"
    result = run_cli("export", store_dir, out, "--format", "speculators", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "final layer_8" in result.stdout
    store = open_store(store_dir)
    ids = manifest_ids(out)
    dataset = SpeculatorsDataset(out)
    assert len(dataset) == SAMPLES == len(ids)
    for index in range(len(dataset)):
        item = dataset[index]
        assert item is not None, f"sample {index}: token ids differ from the table's, speculators would skip it"
        sample = store.get(ids[index])
        n = len(sample["input_ids"])
        assert dataset.approx_lengths[index] == n
        assert torch.equal(item["hidden_states"], torch.cat([sample[name] for name in AUX], dim=-1))
        assert torch.equal(item["verifier_last_hidden_states"], sample["layer_8"])
        assert torch.equal(item["input_ids"], sample["input_ids"]) and item["input_ids"].dtype == torch.int64
        assert torch.equal(item["loss_mask"], sample["loss_mask"])
        assert item["lengths"].tolist() == [n] and torch.equal(item["position_ids"], torch.arange(n))


def test_layer_L_is_the_final_norms_input(store_dir: Path, demo_data: Path, tiny_model: Path) -> None:
    """layer_8 is exactly what the final norm read in the extraction's batches, and the norm of it is ``last``."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    store = open_store(store_dir)
    norm_inputs: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_pre_hook(lambda _module, args: norm_inputs.append(args[0]))
    checked = 0
    try:
        for batch in plan_batches(list(load_samples(demo_data, tokenizer)), BATCH_TOKENS, 64):
            input_ids, attention_mask = pad_batch(batch, tokenizer.pad_token_id)
            with torch.inference_mode():
                model(input_ids=input_ids, attention_mask=attention_mask)
            entering_norm = norm_inputs.pop()
            for i, sample in enumerate(batch):
                got = store.get(sample.key)
                n = len(sample.input_ids)
                assert torch.equal(got["layer_8"], entering_norm[i, :n]), sample.key
                renormed = model.model.norm(got["layer_8"][None])[0]
                assert ((renormed.float() - got["last"].float()).norm() / got["last"].float().norm()) < 1e-2
                assert not torch.equal(got["layer_8"], got["last"])
                checked += 1
    finally:
        handle.remove()
    assert checked == SAMPLES
    descriptions = {t["name"]: t["description"] for t in store.metadata()["tensors"]}
    assert (
        "leaving the last decoder layer 7" in descriptions["layer_8"]
        and "vLLM aux layer id 8" in descriptions["layer_8"]
    )


def test_export_resumes_and_reruns_write_nothing(store_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    first = export(ExportOptions(store_dir, out, "speculators", limit=5, progress=False))
    assert (first.written, first.kept, first.total) == (5, 0, 5)
    assert len(SpeculatorsDataset(out)) == 5
    # A crash mid-export: the manifest's last line torn, one finished file never recorded, one file gone.
    manifest = out / MANIFEST
    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text("".join(lines[:-1]) + lines[-1][:10])
    lost = out / "hidden_states" / "hs_1.safetensors"
    lost.unlink()
    kept = out / "hidden_states" / "hs_0.safetensors"
    before = kept.stat()
    second = export(ExportOptions(store_dir, out, "speculators", progress=False))
    assert (second.written, second.kept, second.total) == (SAMPLES - 3, 3, SAMPLES)
    assert kept.stat().st_mtime_ns == before.st_mtime_ns and kept.stat().st_ino == before.st_ino, "rewritten"
    assert lost.exists()
    ids = manifest_ids(out)
    assert sorted(ids) == list(range(SAMPLES)) and sorted(ids.values()) == sorted(open_store(store_dir).keys())
    assert ids[0] == open_store(store_dir).keys()[0], "sample numbers follow the store's order"
    assert all(line.endswith("\n") for line in manifest.read_text().splitlines(keepends=True))
    dataset = SpeculatorsDataset(out)
    assert len(dataset) == SAMPLES and all(dataset[i] is not None for i in range(SAMPLES))
    third = export(ExportOptions(store_dir, out, "speculators", progress=False))
    assert (third.written, third.kept, third.total) == (0, SAMPLES, SAMPLES)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["data-00000-of-00001.arrow", "dataset_info.json", "state.json", "hidden_states", MANIFEST]
    )


def test_export_refuses_another_kind_of_export_in_the_same_out(store_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "mixed"
    export(ExportOptions(store_dir, out, "specforge", limit=2, progress=False))
    with pytest.raises(ValueError, match=r"--out: .* holds another export.*Export into another --out"):
        export(ExportOptions(store_dir, out, "specforge", aux_layers=(2, 4), progress=False))
    result = run_cli("export", store_dir, out, "--format", "speculators")
    assert result.returncode == 2 and "holds another export" in result.stderr
    assert len(specforge_list_files(out)) == 2


def test_missing_tensors_are_named_with_the_capture_option_that_makes_them(
    tiny_model: Path, demo_data: Path, streaming_store: tuple[Path, Workload], tmp_path: Path
) -> None:
    streaming, _ = streaming_store  # layers 1, 3 and last of a 4-layer model: no layer_4
    result = run_cli("export", streaming, tmp_path / "a", "--format", "speculators")
    assert result.returncode == 2
    assert "needs 'layer_4'" in result.stderr and "before the final norm" in result.stderr
    assert "--layers 1,3,4" in result.stderr and not (tmp_path / "a").exists()
    no_last = tmp_path / "no-last"
    extract(
        ExtractOptions(no_last, tiny_model, demo_data, layers=(2, 4, 5), capture_last=False, limit=2, progress=False)
    )
    result = run_cli("export", no_last, tmp_path / "b", "--format", "specforge")
    assert result.returncode == 2 and "needs 'last'" in result.stderr and "--no-last" in result.stderr
    result = run_cli("export", no_last, tmp_path / "c", "--format", "specforge", "--aux-layers", "2,3")
    assert result.returncode == 2 and "--aux-layers: [3] not captured" in result.stderr
    result = run_cli("export", tmp_path / "nothing", tmp_path / "d", "--format", "specforge")
    assert result.returncode == 1 and "not an hscapture store" in result.stderr


def test_incomplete_samples_are_skipped_or_exported_up_to_their_first_gap(
    streaming_store: tuple[Path, Workload], tmp_path: Path
) -> None:
    streaming, workload = streaming_store
    store = open_store(streaming)
    complete = store.keys(complete_only=True)
    incomplete = [key for key in store if key not in complete]
    assert complete and incomplete
    skipped = export(ExportOptions(streaming, tmp_path / "skip", "specforge", progress=False))
    assert (skipped.total, skipped.skipped_incomplete) == (len(complete), len(incomplete))
    assert sorted(manifest_ids(tmp_path / "skip").values()) == sorted(complete)
    out = tmp_path / "all"
    included = export(ExportOptions(streaming, out, "specforge", include_incomplete=True, progress=False))
    unstarted = [key for key in incomplete if store.get(key, tensors=[])["positions"][:1].tolist() != [0]]
    assert included.skipped_incomplete == len(unstarted)
    ids = {key: index for index, key in manifest_ids(out).items()}
    gapped = 0
    for key in store:
        positions = store.get(key, tensors=[])["positions"].tolist()
        prefix = next((i for i, p in enumerate(positions) if p != i), len(positions))
        if prefix == 0:
            assert key not in ids  # nothing from position 0 on: nothing to export
            continue
        files = [p for p in specforge_list_files(out) if Path(p).name == f"data_{ids[key]}.ckpt"]
        item = specforge_item(files[0])
        rows, tokens = workload.reference(key)
        assert item["input_ids"][0].tolist() == tokens[:prefix]
        assert torch.equal(item["hidden_state"][0], torch.cat([rows[:prefix, 0], rows[:prefix, 1]], dim=-1))
        assert torch.equal(item["target"][0], rows[:prefix, 2])
        gapped += prefix < len(tokens)
    assert gapped > 0, "no exported sample was cut at a gap"


def test_export_cli_limit_and_progress(store_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "limited"
    env = {**os.environ, "COLUMNS": "100"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hscapture",
            "export",
            str(store_dir),
            str(out),
            "--format",
            "specforge",
            "--limit",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "export specforge" in result.stderr and "3/3" in result.stderr  # the tqdm bar
    assert len(specforge_list_files(out)) == 3
    assert "wrote 3 samples, 0 were already there" in result.stdout
