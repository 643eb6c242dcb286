"""Offline extraction end to end: the tiny HF model, a JSONL of conversations, a consumer process."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hscapture import open_store
from hscapture.data import Sample, load_samples, pad_batch, padded_length, plan_batches
from hscapture.extract import ExtractOptions, extract
from hscapture.integrations.hf import AttentionKernels, decoder, eagle3_default_layers, forward_batch
from hscapture.tiny import write_demo_jsonl
from tests.conftest import cli_refusal, run_cli, start_cli

BATCH_TOKENS = 1024
PAD_TO = ExtractOptions.pad_to_multiple  # the default: the store must hold the rows of the batches extract ran


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_jsonl(tmp_path_factory.mktemp("data") / "demo.jsonl", n=200)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model: Path) -> tuple:
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def extracted(tiny_model: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("store")
    summary = extract(
        ExtractOptions(out=out, model=tiny_model, data=demo_data, max_batch_tokens=BATCH_TOKENS, progress=False)
    )
    assert summary.samples == 200 and summary.store["complete"] == 200
    return out


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_store_equals_hf_output_hidden_states_bitwise(extracted: Path, demo_data: Path, model_and_tokenizer: tuple):
    """Same batches, same dtype: the stored rows are HF's own output_hidden_states, bit for bit."""
    model, tokenizer = model_and_tokenizer
    store = open_store(extracted)
    layers = eagle3_default_layers(model.config.num_hidden_layers)
    assert store.tensor_names == [f"layer_{k}" for k in layers] + ["last"]
    samples = list(load_samples(demo_data, tokenizer))
    assert sorted(store.keys(complete_only=True)) == sorted(s.key for s in samples)
    checked = 0
    widths = set()
    for batch in plan_batches(samples, BATCH_TOKENS, 64, PAD_TO):
        width = padded_length(batch, PAD_TO, BATCH_TOKENS)
        widths.add(width)
        input_ids, attention_mask = pad_batch(batch, tokenizer.pad_token_id, width)
        with torch.inference_mode():
            hidden = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
        for i, sample in enumerate(batch):
            n = len(sample.input_ids)
            got = store.get(sample.key)
            assert got["layer_2"].dtype == torch.bfloat16
            for k in layers:
                assert torch.equal(got[f"layer_{k}"], hidden[k][i, :n]), (sample.key, k)
            assert torch.equal(got["last"], hidden[-1][i, :n]), sample.key
            assert got["input_ids"].tolist() == sample.input_ids
            assert got["loss_mask"].tolist() == sample.loss_mask
            assert got["positions"].tolist() == list(range(n))
            checked += 1
    assert checked == 200
    assert PAD_TO > 1 and all(w % PAD_TO == 0 for w in widths), widths  # the batches were padded past their longest
    total = sum(len(s.input_ids) for s in samples)
    assert store.summary()["rows"] == total, "padding rows were stored"


def test_store_matches_one_sample_forward_within_bf16_tolerance(
    extracted: Path, demo_data: Path, model_and_tokenizer: tuple
):
    model, tokenizer = model_and_tokenizer
    store = open_store(extracted)
    worst = 0.0
    for sample in list(load_samples(demo_data, tokenizer))[::5]:
        with torch.inference_mode():
            hidden = model(input_ids=torch.tensor([sample.input_ids]), output_hidden_states=True).hidden_states
        got = store.get(sample.key)
        for k in eagle3_default_layers(model.config.num_hidden_layers):
            worst = max(worst, relative_l2(got[f"layer_{k}"], hidden[k][0]))
        worst = max(worst, relative_l2(got["last"], hidden[-1][0]))
    print(f"worst relative L2 batched vs single: {worst:.5f}")
    assert worst < 2e-2, f"relative L2 {worst:.4f} between batched and single-sample forward"


def test_extract_forward_is_the_masked_forward_on_every_real_row(model_and_tokenizer: tuple, demo_data: Path):
    """Extract runs the decoder alone, unmasked: right padding never reaches a real row of a causal decoder."""
    model, tokenizer = model_and_tokenizer
    batch = list(load_samples(demo_data, tokenizer))[:4]
    assert len({len(s.input_ids) for s in batch}) > 1  # really padded
    seen: list[tuple[torch.Tensor, ...]] = []
    handle = decoder(model).register_forward_hook(lambda _m, _a, out: seen.append(out.hidden_states))
    try:
        with torch.inference_mode():
            model.config.output_hidden_states = True
            input_ids, mask = forward_batch(model, batch, tokenizer.pad_token_id, PAD_TO, BATCH_TOKENS)
            masked = model(input_ids=input_ids, attention_mask=mask).hidden_states
    finally:
        model.config.output_hidden_states = False
        handle.remove()
    unmasked = seen[0]  # forward_batch's call (the masked model's own call to its decoder came second)
    assert len(seen) == 2 and not bool(mask.all())
    for i, sample in enumerate(batch):
        n = len(sample.input_ids)
        for k in range(len(masked)):
            assert relative_l2(unmasked[k][i, :n], masked[k][i, :n]) < 1e-3, (sample.key, k)


SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}
SMALL["vocab_size"] = 512
#: Decoder families extract meets, as random-init tiny transformers models: GQA, sliding windows, MoE, MLA.
ARCHITECTURES = {
    "qwen2": ("Qwen2", {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3", {"num_key_value_heads": 2, "head_dim": 16}),
    "mistral-sliding": ("Mistral", {"num_key_value_heads": 2, "sliding_window": 16}),
    "gemma3": ("Gemma3", {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 16}),
    "qwen3-moe": ("Qwen3Moe", {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 32}),
    "deepseek-v3": ("DeepseekV3", {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32,
                                   "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                                   "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_extract_forward_keeps_padding_from_real_rows_across_architectures(name: str) -> None:
    """The same on other decoders: windows, experts and latent attention see no padding either (lengths past the
    window, rows of three lengths in one padded batch)."""
    import transformers

    family, extra = ARCHITECTURES[name]
    config_class = getattr(transformers, f"{family}TextConfig", None) or getattr(transformers, f"{family}Config")
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config_class(**SMALL, **extra)).eval()
    batch = [Sample(f"s{i}", torch.randint(5, 500, (n,)).tolist(), [1] * n) for i, n in enumerate((70, 33, 51))]
    seen: list[tuple[torch.Tensor, ...]] = []
    handle = decoder(model).register_forward_hook(lambda _m, _a, out: seen.append(out.hidden_states))
    model.config.output_hidden_states = True
    try:
        with torch.inference_mode():
            input_ids, mask = forward_batch(model, batch, 0, PAD_TO, BATCH_TOKENS)
            masked = model(input_ids=input_ids, attention_mask=mask).hidden_states
    finally:
        handle.remove()
    for i, sample in enumerate(batch):
        n = len(sample.input_ids)
        for k in range(len(masked)):
            assert relative_l2(seen[0][k][i, :n], masked[k][i, :n]) < 1e-3, (name, sample.key, k)


def test_cudnn_attention_only_for_shapes_that_earn_its_plan() -> None:
    """Ski rental over each shape: flash until cuDNN's saving would have paid its one-time plan, then cuDNN."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):  # 8B dims, no weights
        model = LlamaForCausalLM(LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32))
    kernels = AttentionKernels(model)

    def planned(batch: int, tokens: int) -> bool:
        return isinstance(kernels(batch, tokens), contextlib.nullcontext)

    assert [planned(1, 32768) for _ in range(3)] == [False, True, True]  # 32k tokens: paid back in one batch
    short = [planned(4, 1024) for _ in range(60)]  # ~1.3 ms saved a batch: ~49 batches to pay 65 ms
    assert not any(short[:40]) and all(short[55:]) and short.index(True) == sum(not p for p in short)
    assert not planned(2, 1024)  # another shape starts over


def test_padding_to_a_multiple_stores_the_rows_of_an_unpadded_run(
    extracted: Path, tiny_model: Path, demo_data: Path, tmp_path: Path
):
    """``--pad-to-multiple`` changes only the padded width: the same samples, rows, tokens, positions and masks.

    The hidden states may differ from a run padded to each batch's longest sample only by the
    numerics of the wider (and differently grouped) batches; nothing of the padding is stored.
    """
    unpadded = extract(
        ExtractOptions(
            out=tmp_path / "unpadded",
            model=tiny_model,
            data=demo_data,
            max_batch_tokens=BATCH_TOKENS,
            pad_to_multiple=1,
            progress=False,
        )
    )
    padded, plain = open_store(extracted), open_store(tmp_path / "unpadded")
    assert unpadded.store["rows"] == padded.summary()["rows"]
    assert sorted(plain.keys(complete_only=True)) == sorted(padded.keys(complete_only=True))
    worst, exact, keys = 0.0, 0, plain.keys()
    for key in keys:
        want, got = plain.get(key), padded.get(key)
        assert set(got) == set(want), key
        for name in ("input_ids", "loss_mask", "positions"):
            assert torch.equal(got[name], want[name]), (key, name)
        hidden = [name for name in want if name.startswith("layer_") or name == "last"]
        assert all(got[name].shape == want[name].shape for name in hidden), key
        exact += all(torch.equal(got[name], want[name]) for name in hidden)
        worst = max(worst, *(relative_l2(got[name], want[name]) for name in hidden))
    print(f"padded to {PAD_TO} vs to the longest: {exact} of {len(keys)} samples bit-identical, worst L2 {worst}")
    assert worst < 1e-2, f"relative L2 {worst:.4f} between the padded and the unpadded extraction"


def test_loss_mask_covers_exactly_the_assistant_turns(extracted: Path, model_and_tokenizer: tuple):
    _, tokenizer = model_and_tokenizer
    store = open_store(extracted)
    sample = store.get(store.keys()[0])
    masked = tokenizer.decode(sample["input_ids"][sample["loss_mask"].bool()])
    unmasked = tokenizer.decode(sample["input_ids"][~sample["loss_mask"].bool()])
    assert "<|assistant|>" not in masked and "<|user|>" in unmasked
    assert 0 < int(sample["loss_mask"].sum()) < len(sample["loss_mask"])


def test_store_meta_says_what_was_captured(extracted: Path, tiny_model: Path):
    meta = open_store(extracted).metadata()
    descriptions = {t["name"]: t["description"] for t in meta["tensors"]}
    assert "residual stream entering decoder layer 2" in descriptions["layer_2"]
    assert "after the model's last norm" in descriptions["last"]
    assert meta["dtype"] == "bfloat16" and meta["hidden_size"] == 256
    run = meta["runs"][0]
    assert run["meta"]["engine"] == "hf" and run["meta"]["model"] == str(tiny_model)
    assert run["end"]["counters"]["rows_dropped"] == 0


def test_interrupted_extraction_resumes_with_each_sample_once(tiny_model: Path, demo_data: Path, tmp_path: Path):
    out = tmp_path / "store"
    args = ["extract", "--model", str(tiny_model), "--data", str(demo_data), "--out", str(out)]
    args += ["--max-batch-tokens", "128", "--shard-size", "32K", "--no-progress"]
    first = start_cli(*args)
    index = out / "index.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None:
        if index.exists() and index.read_text().count('"type":"request"') >= 20:
            break
        time.sleep(0.02)
    assert first.poll() is None, "extraction finished before it could be interrupted"
    first.send_signal(signal.SIGKILL)
    first.wait()
    partial = open_store(out) if (out / "meta.json").exists() else None
    assert partial is not None and 20 <= len(partial.keys(complete_only=True)) < 200
    second = run_cli(*args)  # the resume: no process boundary under test
    assert second.returncode == 0, second.stderr
    assert "resuming" in second.stderr and "already captured" in second.stderr
    store = open_store(out)
    assert len(store.keys(complete_only=True)) == 200
    complete = [
        r["id"]
        for r in map(json.loads, index.read_text().splitlines())
        if r["type"] == "request" and r["status"] == "complete"
    ]
    assert len(complete) == len(set(complete)) == 200, "a sample was captured twice"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for sample in load_samples(demo_data, tokenizer):
        got = store.get(sample.key)
        assert got["input_ids"].tolist() == sample.input_ids and got["loss_mask"].tolist() == sample.loss_mask


def test_cli_bad_configuration_fails_fast_with_clear_messages(tiny_model: Path, demo_data: Path, tmp_path: Path):
    base = ["extract", "--model", str(tiny_model), "--data", str(demo_data), "--no-progress"]
    cases = [
        ([*base, "--out", str(tmp_path / "a"), "--layers", "2,99"], "[99] out of range", "0..8"),
        ([*base, "--out", str(demo_data / "sub")], "--out", "not writable"),
        ([*base, "--out", str(tmp_path / "b"), "--dtype", "int8"], "--dtype", "not supported"),
        ([*base, "--out", str(tmp_path / "p"), "--pad-to-multiple", "0"], "--pad-to-multiple", "positive integer"),
        (["consume", "--out", str(demo_data / "sub")], "out_dir", "not writable"),
        (["consume", "--out", str(tmp_path / "c"), "--endpoint", "http://x"], "endpoint", "ipc://"),
    ]
    for argv, *expected in cases:
        started = time.monotonic()
        status, stderr = cli_refusal(*argv)
        assert status == 2, (argv, stderr)
        for text in expected:
            assert text in stderr, (argv, stderr)
        assert time.monotonic() - started < 30
