"""hscapture export: stores made by real capture, exported, then read by the real trainers' own loaders.

SpecForge 0.2.0 and speculators 0.9.0 (with hs-connectors) are installed from their wheels in CI
(``.ci/run``); ``tests/trainer_readers.py`` wires their loaders as their training entry points
do, and the tests compare what they yield with the store, bit for bit. Without the packages those
tests skip (naming the install command); the rest check the files themselves.
"""

from __future__ import annotations

import grp
import json
import os
import stat
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hscapture import open_store
from hscapture.data import load_samples, pad_batch, padded_length, plan_batches
from hscapture.export import MANIFEST, ExportOptions, export
from hscapture.extract import ExtractOptions, extract
from hscapture.store.writer import StoreWriter
from hscapture.tiny import write_demo_jsonl
from tests.conftest import run_cli
from tests.storefeed import Feed, make_layout, make_request
from tests.trainer_readers import (
    require,
    specforge_batches,
    specforge_legacy_items,
    speculators_dataset,
    speculators_eagle3_loaders,
)
from tests.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
CONVERSATIONS = 24
PROMPT_ONLY = 2  # {"prompt": ...} records: nothing assistant-written, so an empty loss mask
SAMPLES = CONVERSATIONS + PROMPT_ONLY
BATCH_TOKENS = 512
LAYERS = (2, 4, 5, 8)  # the tiny Llama has L = 8 layers: EAGLE-3's 2, L/2, L-3, and L for speculators
AUX = ["layer_2", "layer_4", "layer_5"]
MAX_LEN = 2048  # the trainers' --max-length: longer than any demo sample, so nothing is cut


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_demo_jsonl(tmp_path_factory.mktemp("data") / "demo.jsonl", n=CONVERSATIONS)
    with path.open("a") as handle:
        for i in range(PROMPT_ONLY):
            handle.write(json.dumps({"id": f"prompt-only-{i}", "prompt": f"Say something about the number {i}."}))
            handle.write("\n")
    return path


@pytest.fixture(scope="module")
def store_dir(tiny_model: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real extraction on the tiny model, with the aux layers, layer L and the post-norm state."""
    out = tmp_path_factory.mktemp("store")
    options = ExtractOptions(
        out=out, model=tiny_model, data=demo_data, layers=LAYERS, max_batch_tokens=BATCH_TOKENS, progress=False
    )
    assert extract(options).store["complete"] == SAMPLES
    return out


@pytest.fixture(scope="module")
def parts_dir(tiny_model: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same extraction by two jobs at once (``--data-parallel 2``): a directory of two parts."""
    out = tmp_path_factory.mktemp("parts") / "set"
    options = ExtractOptions(
        out=out, model=tiny_model, data=demo_data, layers=LAYERS, max_batch_tokens=BATCH_TOKENS, data_parallel=2,
        progress=False,
    )  # fmt: skip
    assert extract(options).store["complete"] == SAMPLES
    return out


@pytest.fixture(scope="module", params=["one store", "two parts"])
def source(request: pytest.FixtureRequest) -> Path:
    """What the trainers' exports are made from: the store, or the same data as a set of two parts."""
    return request.getfixturevalue("store_dir" if request.param == "one store" else "parts_dir")


def trained_keys(store_dir: Path) -> list[str]:
    """The store's keys, in store order, whose loss mask marks at least one token."""
    store = open_store(store_dir)
    return [key for key in store if bool(store.get(key, tensors=[])["loss_mask"].any())]


def manifest_ids(out: Path) -> dict[int, str]:
    lines = [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]
    return {line["index"]: line["id"] for line in lines[1:]}


def specforge_files(out: Path) -> list[Path]:
    return sorted(out.rglob("*.ckpt"))


def speculators_table(out: Path) -> int:
    """Rows of an exported speculators table; each row's token ids are those of its hs_{i} file."""
    from datasets import load_from_disk

    table = load_from_disk(str(out))
    for i in range(len(table)):
        assert torch.equal(load_file(out / "hidden_states" / f"hs_{i}.safetensors")["token_ids"], table[i]["input_ids"])
    return len(table)


@pytest.fixture(scope="module")
def specforge_export(source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("exports") / "specforge"
    result = run_cli("export", source, out, "--format", "specforge", "--no-progress")
    assert result.returncode == 0, result.stderr
    return out, result.stdout


@pytest.fixture(scope="module")
def speculators_export(source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("exports") / "speculators"
    result = run_cli("export", source, out, "--format", "speculators", "--no-progress")
    assert result.returncode == 0, result.stderr
    return out, result.stdout


def test_specforge_export_leaves_out_samples_with_nothing_to_train(
    specforge_export: tuple[Path, str], source: Path
) -> None:
    out, stdout = specforge_export
    trained = trained_keys(source)
    assert len(trained) == CONVERSATIONS
    assert f"wrote {CONVERSATIONS} samples" in stdout and "final last" in stdout
    assert f"{PROMPT_ONLY} samples with an empty loss mask left out" in stdout and "--keep-empty-loss-mask" in stdout
    ids = manifest_ids(out)
    assert sorted(ids) == list(range(CONVERSATIONS)) and list(ids.values()) == trained
    files = specforge_files(out)
    assert [p.relative_to(out).as_posix() for p in files] == sorted(f"rows_0-2000/data_{i}.ckpt" for i in ids)


def test_specforge_offline_loader_yields_exactly_the_store(specforge_export: tuple[Path, str], source: Path) -> None:
    """SpecForge's reader -> feature store -> FeatureDataLoader -> normalizer -> collator, batch by batch."""
    require("specforge")
    out, _ = specforge_export
    store = open_store(source)
    ids = manifest_ids(out)
    seen = []
    for files, batch in specforge_batches(out, MAX_LEN, batch_size=4):
        width = batch["input_ids"].shape[1]
        assert batch["hidden_state"].dtype == batch["target"].dtype == torch.bfloat16
        for row, path in enumerate(files):
            sample = store.get(ids[int(path.stem.removeprefix("data_"))])
            n = len(sample["input_ids"])
            trained = sample["loss_mask"].clone()
            trained[-1] = 0  # SpecForge zeroes the last position (no next token to predict)
            padded = {
                "hidden_state": torch.cat([sample[name] for name in AUX], dim=-1),
                "target": sample["last"],
                "input_ids": sample["input_ids"],
                "loss_mask": trained,
                "attention_mask": torch.ones(n, dtype=torch.long),
            }
            for name, want in padded.items():
                got = batch[name][row]
                assert torch.equal(got[:n], want), (path, name)
                assert not got[n:].any(), (path, name, "padding")
            assert width >= n and bool(trained.any())
            seen.append(path)
    assert sorted(seen) == specforge_files(out), "every exported file read once"
    legacy = specforge_legacy_items(out, MAX_LEN)  # the older OfflineEagle3Dataset (sequence-parallel path)
    assert [path for path, _ in legacy] == specforge_files(out)
    for path, item in legacy:
        sample = store.get(ids[int(path.stem.removeprefix("data_"))])
        assert torch.equal(item["hidden_state"][0], torch.cat([sample[name] for name in AUX], dim=-1))
        assert torch.equal(item["target"][0], sample["last"]) and torch.equal(item["input_ids"][0], sample["input_ids"])


def test_speculators_export_leaves_out_samples_with_nothing_to_train(
    speculators_export: tuple[Path, str], source: Path
) -> None:
    out, stdout = speculators_export
    assert f"wrote {CONVERSATIONS} samples" in stdout and "final layer_8" in stdout
    assert f"{PROMPT_ONLY} samples with an empty loss mask left out" in stdout
    assert list(manifest_ids(out).values()) == trained_keys(source)
    assert speculators_table(out) == CONVERSATIONS


def test_speculators_arrow_dataset_yields_exactly_the_store(speculators_export: tuple[Path, str], source: Path) -> None:
    """speculators' ArrowDataset with the hs-connectors file transfer, sample by sample."""
    require("speculators", "hs_connectors")
    out, _ = speculators_export
    store = open_store(source)
    ids = manifest_ids(out)
    dataset = speculators_dataset(out, MAX_LEN)
    assert len(dataset) == CONVERSATIONS
    for index in range(len(dataset)):
        item = dataset[index]
        assert isinstance(item, dict), f"sample {index}: speculators could not use it ({item!r})"
        sample = store.get(ids[index])
        n = len(sample["input_ids"])
        assert dataset.approx_lengths[index] == n
        assert torch.equal(item["hidden_states"], torch.cat([sample[name] for name in AUX], dim=-1))
        assert torch.equal(item["verifier_last_hidden_states"], sample["layer_8"])
        assert torch.equal(item["input_ids"], sample["input_ids"]) and item["input_ids"].dtype == torch.int64
        assert torch.equal(item["loss_mask"], sample["loss_mask"]) and bool(item["loss_mask"].any())
        assert item["lengths"].tolist() == [n] and torch.equal(item["position_ids"], torch.arange(n))


def test_speculators_eagle3_loaders_pack_exactly_the_store(speculators_export: tuple[Path, str], source: Path) -> None:
    """The train/val loaders of `speculators train --speculator-type eagle3`: split, packing, shift, collation."""
    require("speculators", "hs_connectors")
    out, _ = speculators_export
    store = open_store(source)
    ids = manifest_ids(out)
    hidden = store.metadata()["hidden_size"]
    total = 2 * max(len(store.get(key, tensors=[])["input_ids"]) for key in ids.values())  # two or more per batch
    train, val = speculators_eagle3_loaders(out, total, hidden, num_target_layers=len(AUX), train_ratio=0.75)
    split = int(CONVERSATIONS * 0.75)
    for loader, first, count in ((train, 0, split), (val, split, CONVERSATIONS - split)):
        covered = []
        for indices, batch in zip(list(loader.batch_sampler), loader, strict=True):
            samples = [store.get(ids[first + int(i)]) for i in indices]
            # EAGLE-3's shift: aux states of token t beside token t+1, its verifier state and loss mask
            want = {
                "input_ids": torch.cat([s["input_ids"][1:] for s in samples]),
                "hidden_states": torch.cat([torch.cat([s[name] for name in AUX], dim=-1)[:-1] for s in samples]),
                "verifier_last_hidden_states": torch.cat([s["layer_8"][1:] for s in samples]),
                "loss_mask": torch.cat([s["loss_mask"][1:] for s in samples]),
                "position_ids": torch.cat([torch.arange(1, len(s["input_ids"])) for s in samples]),
            }
            rows = len(want["input_ids"])
            assert rows <= total
            for name, value in want.items():
                got = batch[name][0]
                assert got.shape[0] == total and torch.equal(got[:rows], value), name
                assert not got[rows:].any(), (name, "padding")
            lengths = [len(s["input_ids"]) - 1 for s in samples]
            documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            assert torch.equal(batch["document_ids"][0], torch.cat([documents, torch.full((total - rows,), -1)]))
            assert batch["error_records"] == 0
            covered += [int(i) for i in indices]
        assert sorted(covered) == list(range(count)), "every sample of the split in one batch"


def test_empty_loss_mask_samples_are_exported_on_request(store_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "kept"
    result = run_cli("export", store_dir, out, "--format", "speculators", "--keep-empty-loss-mask", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert f"wrote {SAMPLES} samples" in result.stdout
    assert f"warning: {PROMPT_ONLY} samples have an empty loss mask" in result.stdout
    assert speculators_table(out) == SAMPLES
    store = open_store(store_dir)
    empty = [key for key in manifest_ids(out).values() if not store.get(key, tensors=[])["loss_mask"].any()]
    assert sorted(empty) == [f"prompt-only-{i}" for i in range(PROMPT_ONLY)]
    summary = export(ExportOptions(store_dir, tmp_path / "api", "specforge", keep_empty_loss_mask=True, progress=False))
    assert (summary.written, summary.empty_loss_mask, summary.skipped_empty_loss_mask) == (SAMPLES, PROMPT_ONLY, 0)


def test_specforge_export_refuses_other_than_three_aux_layers(
    tiny_model: Path, demo_data: Path, tmp_path: Path
) -> None:
    """SpecForge's draft asserts 3 x hidden: four aux layers, or two, are refused with the three to pick."""
    store_dir = tmp_path / "five-layers"
    extract(ExtractOptions(store_dir, tiny_model, demo_data, layers=(1, 2, 4, 5, 8), limit=3, progress=False))
    out = tmp_path / "out"
    result = run_cli("export", store_dir, out, "--format", "specforge")
    assert result.returncode == 2
    assert "exactly 3 aux layers" in result.stderr and "project_hidden_states" in result.stderr
    assert "would have 4: [1, 2, 4, 5]" in result.stderr
    assert "--aux-layers 2,4,5" in result.stderr and "--any-aux-count" in result.stderr
    assert not out.exists(), "refused before writing anything"
    result = run_cli("export", store_dir, out, "--format", "specforge", "--aux-layers", "2,4")
    assert result.returncode == 2 and "would have 2: [2, 4]" in result.stderr and "--aux-layers 2,4,5" in result.stderr
    result = run_cli("export", store_dir, out, "--format", "specforge", "--aux-layers", "2,4,5", "--no-progress")
    assert result.returncode == 0 and "aux layer_2, layer_4, layer_5" in result.stdout
    other = tmp_path / "four"
    result = run_cli("export", store_dir, other, "--format", "specforge", "--any-aux-count", "--no-progress")
    assert result.returncode == 0, result.stderr
    hidden = open_store(store_dir).metadata()["hidden_size"]
    assert all(
        torch.load(p, weights_only=True)["aux_hidden_state"].shape[-1] == 4 * hidden for p in specforge_files(other)
    )


def test_layer_L_is_the_final_norms_input(store_dir: Path, demo_data: Path, tiny_model: Path) -> None:
    """layer_8 is exactly what the final norm read in the extraction's batches, and the norm of it is ``last``."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    store = open_store(store_dir)
    norm_inputs: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_pre_hook(lambda _module, args: norm_inputs.append(args[0]))
    checked = 0
    try:
        pad_to = ExtractOptions.pad_to_multiple  # the store holds the rows of the batches extract ran
        for batch in plan_batches(list(load_samples(demo_data, tokenizer)), BATCH_TOKENS, 64, pad_to):
            width = padded_length(batch, pad_to, BATCH_TOKENS)
            input_ids, attention_mask = pad_batch(batch, tokenizer.pad_token_id, width)
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
    trained = trained_keys(store_dir)
    first_five = trained[:5]  # --limit counts exported samples
    first = export(ExportOptions(store_dir, out, "speculators", limit=5, progress=False))
    assert (first.written, first.kept, first.total) == (len(first_five), 0, len(first_five))
    assert speculators_table(out) == len(first_five)
    # A crash mid-export: the manifest's last line torn, one finished file never recorded, one file gone.
    manifest = out / MANIFEST
    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text("".join(lines[:-1]) + lines[-1][:10])
    lost = out / "hidden_states" / "hs_1.safetensors"
    lost.unlink()
    kept = out / "hidden_states" / "hs_0.safetensors"
    before = kept.stat()
    second = export(ExportOptions(store_dir, out, "speculators", progress=False))
    survivors = len(first_five) - 2
    assert (second.written, second.kept, second.total) == (len(trained) - survivors, survivors, len(trained))
    assert kept.stat().st_mtime_ns == before.st_mtime_ns and kept.stat().st_ino == before.st_ino, "rewritten"
    assert lost.exists()
    ids = manifest_ids(out)
    assert sorted(ids) == list(range(len(trained))) and sorted(ids.values()) == sorted(trained)
    assert ids[0] == trained[0], "sample numbers follow the store's order"
    assert all(line.endswith("\n") for line in manifest.read_text().splitlines(keepends=True))
    assert speculators_table(out) == len(trained)
    third = export(ExportOptions(store_dir, out, "speculators", progress=False))
    assert (third.written, third.kept, third.total) == (0, len(trained), len(trained))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["data-00000-of-00001.arrow", "dataset_info.json", "state.json", "hidden_states", MANIFEST]
    )


def test_export_refuses_another_kind_of_export_in_the_same_out(store_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "mixed"
    first = export(ExportOptions(store_dir, out, "specforge", limit=2, progress=False))
    with pytest.raises(ValueError, match=r"OUT: .* holds another export.*Export into another OUT directory"):
        export(ExportOptions(store_dir, out, "specforge", aux_layers=(2, 4), any_aux_count=True, progress=False))
    result = run_cli("export", store_dir, out, "--format", "speculators")
    assert result.returncode == 2 and "holds another export" in result.stderr and "--out" not in result.stderr
    assert len(specforge_files(out)) == first.written


def test_missing_tensors_are_named_with_the_capture_option_that_makes_them(
    tiny_model: Path, demo_data: Path, streaming_store: tuple[Path, Workload], tmp_path: Path
) -> None:
    streaming, _ = streaming_store  # layers 1, 3 and last of a 4-layer model: no layer_4
    result = run_cli("export", streaming, tmp_path / "a", "--format", "speculators")
    assert result.returncode == 2
    assert "needs 'layer_4'" in result.stderr and "before the final norm" in result.stderr
    assert "--layers 1,3,4" in result.stderr and not (tmp_path / "a").exists()
    result = run_cli("export", streaming, tmp_path / "a", "--format", "specforge")
    assert result.returncode == 2 and "would have 2: [1, 3]" in result.stderr
    assert "4 decoder layers has no three distinct EAGLE-3 layers" in result.stderr
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
    # two aux layers of a 4-layer test model (a draft of one's own); incomplete requests were never
    # finished, so no loss mask was recorded for them
    options = {"any_aux_count": True, "keep_empty_loss_mask": True, "progress": False}
    skipped = export(ExportOptions(streaming, tmp_path / "skip", "specforge", **options))
    assert (skipped.total, skipped.skipped_incomplete) == (len(complete), len(incomplete))
    assert sorted(manifest_ids(tmp_path / "skip").values()) == sorted(complete)
    out = tmp_path / "all"
    included = export(ExportOptions(streaming, out, "specforge", include_incomplete=True, **options))
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
        data = torch.load(out / "rows_0-2000" / f"data_{ids[key]}.ckpt", weights_only=True)
        rows, tokens = workload.reference(key)
        assert data["input_ids"].tolist() == tokens[:prefix]
        assert torch.equal(data["aux_hidden_state"][0], torch.cat([rows[:prefix, 0], rows[:prefix, 1]], dim=-1))
        assert torch.equal(data["hidden_state"][0], rows[:prefix, 2])
        gapped += prefix < len(tokens)
    assert gapped > 0, "no exported sample was cut at a gap"


def test_export_cli_limit_and_progress(store_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "limited"
    result = run_cli("export", store_dir, out, "--format", "specforge", "--limit", "3", env={"COLUMNS": "100"})
    assert result.returncode == 0, result.stderr
    assert "export specforge" in result.stderr and "3/3" in result.stderr  # the tqdm bar
    assert len(specforge_files(out)) == 3
    assert "wrote 3 samples, 0 were already there" in result.stdout
    assert result.stdout.strip().endswith(
        f"train on it: SpecForge's offline EAGLE-3 training, data.hidden_states_path: {out}"
    )


def fed_store(root: Path, trained: list[bool]) -> list[str]:
    """A store fed directly (no model): EAGLE-3's aux layers of an 8-layer model and ``last``, one sample per
    entry of ``trained`` (False: an empty loss mask), in store order; returns the keys."""
    names = ["layer_2", "layer_4", "layer_5", "last"]
    writer = StoreWriter(root, shard_bytes=1 << 20)
    run_id, geometry, _ = make_layout(names=names, descriptions=names)
    writer.begin_run(run_id, geometry, {"config": {"num_layers": 8}})
    rng = np.random.default_rng(0)
    keys = [f"s{i}" for i in range(len(trained))]
    feed = Feed(writer, {key: make_request(6, "float32", rng, len(names)) for key in keys})
    for key, loss in zip(keys, trained):
        feed.chunk([(key, range(6))])
        feed.finish(key, num_tokens=6, loss_mask=[[3, 6]] if loss else [])
    writer.end_run("end of stream", {})
    writer.close()
    return keys


def test_export_limit_counts_exported_samples(tmp_path: Path) -> None:
    """Samples left out (empty loss mask) do not use up --limit; a rerun with the same limit adds nothing,
    a larger one the next samples."""
    keys = fed_store(tmp_path / "store", [True, False, False, True, True, True])
    out = tmp_path / "out"
    first = export(ExportOptions(tmp_path / "store", out, "specforge", limit=3, progress=False))
    assert (first.written, first.skipped_empty_loss_mask, first.total) == (3, 2, 3)
    assert sorted(manifest_ids(out).values()) == [keys[0], keys[3], keys[4]]
    again = export(ExportOptions(tmp_path / "store", out, "specforge", limit=3, progress=False))
    assert (again.written, again.kept, again.total) == (0, 3, 3)
    more = export(ExportOptions(tmp_path / "store", out, "specforge", limit=4, progress=False))
    assert (more.written, more.kept, more.total) == (1, 3, 4) and manifest_ids(out)[3] == keys[5]


def test_export_names_its_positional_out_and_shares_with_a_group(tmp_path: Path) -> None:
    """OUT is positional: no message names a --out flag; --share-group applies to exports as the README says."""
    fed_store(tmp_path / "store", [True, True])
    (tmp_path / "a-file").write_text("")
    result = run_cli("export", tmp_path / "store", tmp_path / "a-file", "--format", "specforge")
    assert result.returncode == 1 and "choose another OUT" in result.stderr and "--out" not in result.stderr
    group = grp.getgrgid(os.getgid()).gr_name
    result = run_cli("export", tmp_path / "store", tmp_path / "shared", "--format", "specforge", "--share-group", group)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o2750
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o640 for p in (tmp_path / "shared").rglob("*") if p.is_file())


# ------------------------------------------------------------------------------ dependency ranges


def _requirements(dist: metadata.Distribution, extras: set[str]) -> dict[str, SpecifierSet]:
    """Name -> version range of what installing ``dist[extras]`` requires (its own extras followed)."""
    ranges: dict[str, SpecifierSet] = {}
    pending, done = set(extras) | {""}, set()
    while pending:
        extra = pending.pop()
        done.add(extra)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
                continue
            if requirement.marker is None and extra:
                continue  # a core requirement, already taken with extra ""
            name = canonicalize_name(requirement.name)
            if name == canonicalize_name(dist.metadata["Name"]):
                pending |= set(requirement.extras) - done
                continue
            ranges[name] = ranges.get(name, SpecifierSet()) & requirement.specifier
    return ranges


def _satisfiable(specifiers: SpecifierSet) -> bool:
    """Whether some version satisfies every clause: tries each bound, and just above and below it."""
    candidates = {Version("0")}
    for clause in specifiers:
        if clause.operator == "===":
            return True  # arbitrary equality: no version ordering to reason with
        bound = Version(clause.version.removesuffix(".*"))
        release = list(bound.release)
        candidates |= {bound, Version(".".join(map(str, [*release, 0, 0, 1])))}
        if any(release):
            last = max(i for i, part in enumerate(release) if part)
            candidates.add(Version(".".join(map(str, [*release[:last], release[last] - 1, 999999]))))
    return any(specifiers.contains(v, prereleases=True) for v in candidates)


def test_satisfiable_finds_empty_and_nonempty_ranges() -> None:
    assert _satisfiable(SpecifierSet(">=2.19") & SpecifierSet(">=4.0.0,<=5.1.0"))
    assert _satisfiable(SpecifierSet(">5.1,<5.2"))
    assert _satisfiable(SpecifierSet("<1.0,>0.9"))
    assert not _satisfiable(SpecifierSet(">=5.2") & SpecifierSet("<=5.1.0"))
    assert not _satisfiable(SpecifierSet("==2.11.0") & SpecifierSet(">=2.12"))


def test_export_extra_installs_beside_speculators(tmp_path: Path) -> None:
    """hscapture[export,hf] and speculators 0.9.0 (with hs-connectors) declare ranges one environment can meet.

    hscapture's metadata is built from this checkout's pyproject.toml by its build backend (the
    installed hscapture may be another checkout's); speculators' and hs-connectors' are read from
    the installed distributions.
    """
    require("speculators", "hs_connectors")
    hook = (
        "import sys; from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    build = subprocess.run(
        [sys.executable, "-c", hook, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr
    ours = _requirements(metadata.PathDistribution(tmp_path / build.stdout.split()[-1]), {"export", "hf"})
    theirs = _requirements(metadata.distribution("speculators"), set())
    for name, specifier in _requirements(metadata.distribution("hs-connectors"), set()).items():
        theirs[name] = theirs.get(name, SpecifierSet()) & specifier
    assert {"datasets", "transformers", "torch"} <= set(ours) & set(theirs)
    clashes = {
        name: (str(ours[name]), str(theirs[name]))
        for name in set(ours) & set(theirs)
        if not _satisfiable(ours[name] & theirs[name])
    }
    assert not clashes, f"hscapture[export,hf] and speculators 0.9.0 want disjoint versions: {clashes}"
