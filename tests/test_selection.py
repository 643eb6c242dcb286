"""Layer ranges and ``all``, ``--positions``: what HF extraction stores, bit for bit, and how readers serve the gaps.

Each store is captured by the HF engine adapter with a consumer on a thread (no process start), over the tiny
model's demo conversations, and compared with an independent HF forward over the same padded batches:
``output_hidden_states[k]`` at exactly the positions the store records, and for layer ``L`` (the final norm's
input, which ``output_hidden_states`` lacks) the same forward with the final norm taken out.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hscapture import open_store
from hscapture.consumer import consume_command
from hscapture.data import load_samples, loss_mask_ranges, pad_batch, padded_length, plan_batches
from hscapture.dataset import CaptureDataset, pad_collate
from hscapture.errors import ProtocolError
from hscapture.export import ExportOptions, export
from hscapture.extract import ExtractOptions, check_store_positions, extract
from hscapture.inspection import format_inspection, inspect_store
from hscapture.integrations.hf import HFExtraction
from hscapture.protocol import RequestFinished, checked_positions
from hscapture.selection import Positions
from hscapture.store.format import SELECTION_VERSION, STORE_VERSION
from hscapture.store.records import Finish, Request, request_record
from hscapture.store.verify import format_report, verify_store
from tests.conftest import ThreadConsumer, cli_refusal, short_endpoint

BATCH_TOKENS = 1024
PAD_TO = 64
SAMPLES = 12
L = 8  # the tiny Llama's decoder layers
#: (layers, positions) captured, each into a store of its own.
CASES = {
    "all-layers": ("all", "all"),
    "all-layers-loss": ("all", "loss"),
    "strided-every3": ("0-8:3", "every:3"),
    "mixed-last": ("1-2,5,8", "last"),
}


def capture(model: Path, data: Path, out: Path, layers: str, positions: str) -> list[Any]:
    """The HF engine adapter over the first SAMPLES records, into ``out``; the samples, in order."""
    engine = HFExtraction(model, layers, True, None, "cpu", BATCH_TOKENS, 64, PAD_TO, positions)
    samples = list(load_samples(data, engine.tokenizer, limit=SAMPLES))
    with short_endpoint() as endpoint:
        consumer = ThreadConsumer(consume_command(endpoint, out, "--quiet", "--exit-on-eos", "--heartbeat-ms", "50"))
        try:
            engine.start(endpoint, {"data": str(data)}, lambda: None)
            for batch in plan_batches(samples, BATCH_TOKENS, 64, PAD_TO):
                engine.run(batch)
            engine.end()
        finally:
            engine.shutdown()
        assert consumer.wait(120) == 0
    return samples


@pytest.fixture(scope="module")
def stores(tiny_model: Path, tiny_demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    made = {}
    for name, (layers, positions) in CASES.items():
        out = tmp_path_factory.mktemp(name)
        made[name] = (out, capture(tiny_model, tiny_demo_data, out, layers, positions))
    return made


@pytest.fixture(scope="module")
def reference(tiny_model: Path, stores: dict[str, Any]) -> dict[str, tuple[list[torch.Tensor], int]]:
    """Per sample key: HF's output_hidden_states over the batch extract ran, with layer L (the final norm's input)
    in place of index L, and the sample's row in the batch."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    _, samples = next(iter(stores.values()))
    found = {}
    for batch in plan_batches(samples, BATCH_TOKENS, 64, PAD_TO):
        input_ids, mask = pad_batch(batch, 0, padded_length(batch, PAD_TO, BATCH_TOKENS))
        with torch.inference_mode():
            hidden = list(model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states)
            norm, model.model.norm = model.model.norm, torch.nn.Identity()
            try:  # the same forward without the final norm: its last hidden state is the norm's input
                unnormed = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
            finally:
                model.model.norm = norm
        assert len(hidden) == L + 1 and torch.equal(hidden[L - 1], unnormed[L - 1])
        states = [*hidden[:L], unnormed[L], hidden[L]]  # index k: layer_k (0..L), then last
        for i, sample in enumerate(batch):
            found[sample.key] = (states, i)
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_stored_rows_are_hf_output_hidden_states_at_exactly_the_positions_recorded(
    case: str, stores: dict[str, Any], reference: dict[str, tuple[list[torch.Tensor], int]]
) -> None:
    out, samples = stores[case]
    layers, positions = CASES[case]
    ids = {"all": list(range(1, L + 1)), "0-8:3": [0, 3, 6], "1-2,5,8": [1, 2, 5, 8]}[layers]
    store = open_store(out)
    assert store.tensor_names == [*(f"layer_{k}" for k in ids), "last"]
    assert store.metadata()["runs"][-1]["meta"]["config"]["layers"] == ids
    selection = Positions.parse(positions)
    assert store.metadata()["version"] == (STORE_VERSION if selection.everything else SELECTION_VERSION)
    assert sorted(store.keys(complete_only=True)) == sorted(s.key for s in samples)
    for sample in samples:
        record = store.record(sample.key)
        assert record.get("positions") == (None if selection.everything else positions), record
        asked = selection.asked(len(sample.input_ids), loss_mask_ranges(sample.loss_mask))
        got = store.get(sample.key)
        assert got["positions"].tolist() == asked.tolist() and record["rows"] == len(asked), sample.key
        assert got["input_ids"].tolist() == [sample.input_ids[p] for p in asked]
        assert got["loss_mask"].tolist() == [sample.loss_mask[p] for p in asked]
        states, row = reference[sample.key]
        index = torch.from_numpy(asked)
        for k in ids:
            assert torch.equal(got[f"layer_{k}"], states[k][row, index]), (case, sample.key, k)
        assert torch.equal(got["last"], states[-1][row, index]), (case, sample.key)
    if positions == "loss":
        assert all(got["loss_mask"].all() for got in map(store.get, store.keys()))
    if positions == "last":
        assert store.summary()["rows"] == len(samples)


def test_readers_serve_a_store_with_gaps_as_what_it_is(stores: dict[str, Any], tmp_path: Path) -> None:
    """inspect says which positions were asked and counts against them; verify passes and says so; export refuses
    in one line with the fix; the dataset yields the rows held with their position ids."""
    out, samples = stores["strided-every3"]
    report = inspect_store(out)
    total = sum(len(s.input_ids) for s in samples)
    assert report["positions"] == {"every:3": SAMPLES} and report["expected_tokens"] == total
    assert report["tokens"] == report["asked_tokens"] == sum(-(-len(s.input_ids) // 3) for s in samples)
    text = format_inspection(report)
    assert f"stored of {report['asked_tokens']:,} asked (of {total:,} positions)" in text
    assert f"positions  rows at some positions only: every:3 (positions 0, 3, ...): {SAMPLES} samples" in text

    verified = verify_store(out)
    assert verified.ok and verified.selections == {"every:3": SAMPLES}
    assert "(--positions every:3: 12), complete when holding those asked" in format_report(verified)

    wide, _ = stores["all-layers-loss"]  # what both trainers read: aux layers 2, 4, 5, layer L and last
    for kind in ("specforge", "speculators"):
        with pytest.raises(ValueError) as refused:
            export(ExportOptions(wide, tmp_path / kind, kind, aux_layers=(2, 4, 5), progress=False))
        assert str(refused.value) == (
            f"--format {kind}: {wide} holds samples captured with --positions loss ({SAMPLES} samples), rows at "
            f"some positions only, and {kind} reads a row for every position; extract them again with --positions "
            "all (the default) into another --out, or train on the rows held with hscapture.dataset.CaptureDataset"
        )
        assert not (tmp_path / kind).exists()  # refused before anything was written

    dataset = CaptureDataset(out, tensors=["layer_3"])
    item = dataset[0]
    n = len(samples[0].input_ids)
    assert item["positions"].tolist() == list(range(0, n, 3)) and item["layer_3"].shape == (len(item["positions"]), 256)
    batch = pad_collate([dataset[0], dataset[1]])
    assert batch["positions"].shape == batch["attention_mask"].shape


def test_completeness_is_judged_against_the_positions_asked() -> None:
    """A selection's request is complete when it holds every asked position; one it lacks is missing, a row at a
    position not asked makes it incomplete; a loss selection of an empty mask asks nothing."""

    def line(selection: str, positions: list[int], num_tokens: int = 10, mask: tuple = ((3, 6),)) -> dict[str, Any]:
        request = Request("run")
        request.add(0, 0, np.asarray(positions, dtype=np.int64))
        request.finished = Finish(num_tokens=num_tokens, loss_mask=mask, positions=selection)
        return request_record("r", request)

    assert line("every:4", [0, 4, 8])["status"] == "complete"
    short = line("every:4", [0, 8])
    assert short["status"] == "incomplete" and short["missing"] == [[4, 5]] and short["reason"] == "1 positions missing"
    extra = line("loss", [3, 4, 5, 9])
    assert extra["status"] == "incomplete" and extra["reason"] == "1 rows at positions --positions loss did not ask for"
    assert line("loss", [3, 4, 5])["status"] == "complete" and line("loss", [3, 4, 5])["positions"] == "loss"
    assert line("last", [9])["missing"] == [] and line("last", [8])["missing"] == [[9, 10]]
    empty = Request("run")
    empty.finished = Finish(num_tokens=7, loss_mask=(), positions="loss")
    assert request_record("e", empty)["status"] == "complete"
    everything = line("", list(range(10)))
    assert everything["status"] == "complete" and "positions" not in everything


def test_position_selections_refused_with_what_they_take() -> None:
    for bad in ("some", "every:0", "every:x", "every3"):
        with pytest.raises(ValueError, match=r"--positions: .* is not a position selection; give all, loss \(the"):
            Positions.parse(bad)
    assert str(Positions.parse("every:1")) == "all" and str(Positions.parse(" Every:4 ")) == "every:4"
    hostile = RequestFinished(v=3, request_id="r", reason="finished", positions="every:-1")
    with pytest.raises(ProtocolError, match=r"RequestFinished.positions: 'every:-1' is not a position selection"):
        checked_positions(hostile)


def test_extract_takes_layer_ranges_and_positions_and_resumes_only_the_same(
    tiny_model: Path, tiny_demo_data: Path, tmp_path: Path
) -> None:
    """The command's options reach the engine; bad specs are refused before the model loads, with what they take;
    a store is resumed only with the positions it was captured with."""
    out = tmp_path / "store"
    options = ExtractOptions(out, tiny_model, tiny_demo_data, layers="all", positions="last", limit=4, progress=False)
    summary = extract(options)
    store = open_store(out)
    assert summary.store["complete"] == 4 and store.summary()["rows"] == 4
    assert store.tensor_names == [*(f"layer_{k}" for k in range(1, L + 1)), "last"]
    assert store.metadata()["runs"][-1]["meta"]["positions"] == "last"
    with pytest.raises(ValueError, match=r"--positions loss: the store at .* holds samples captured with --positions "
                       r"last; give --positions last to resume it, or write to another --out"):  # fmt: skip
        check_store_positions(out, "loss")
    with pytest.raises(ValueError, match="--layers: \\[9\\] out of range; the model has 8 decoder layers, so ids"):
        extract(ExtractOptions(tmp_path / "b", tiny_model, tiny_demo_data, layers="0-9:3", limit=1, progress=False))
    for args, message in (
        (["--positions", "every:0"], "--positions: 'every:0' is not a position selection"),
        (["--layers", "4-2"], "argument --layers: '4-2' is an empty range; give START-END[:STEP] with START <= END"),
        (["--layers", "2,2-3"], "argument --layers: layer 2 named twice (2 and 2-3); name each layer once"),
        (["--engine", "sglang", "--mode", "regenerate", "--positions", "last"], "--positions last with --mode "
         "regenerate: a generated answer's last token is known only once generation ends"),
        (["--engine", "vllm", "--mode", "regenerate", "--positions", "last"], "--positions last with --mode "
         "regenerate: a generated answer's last token is known only once generation ends"),
    ):  # fmt: skip
        code, err = cli_refusal("extract", "--model", tiny_model, "--out", tmp_path / "c", *args)
        assert code == 2 and message in err, err


def test_old_readers_cannot_take_a_selection_for_every_position(stores: dict[str, Any]) -> None:
    """The first line with a selection raised meta.json to version 4; a store without one keeps version 2."""
    out, _ = stores["all-layers-loss"]
    assert json.loads((out / "meta.json").read_text())["version"] == SELECTION_VERSION == 4
    with contextlib.suppress(StopIteration):
        first = next(r for r in map(json.loads, (out / "index.jsonl").open()) if r["type"] == "request")
        assert first["positions"] == "loss" and list(first)[-2:] == ["positions", "line_crc32"]
    plain, _ = stores["all-layers"]
    assert json.loads((plain / "meta.json").read_text())["version"] == STORE_VERSION
