"""Tests of the embedded tiny model (hscapture.tiny) and of dataset loading (hscapture.data)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hscapture import tiny
from hscapture.data import (
    Sample,
    check_batching,
    load_samples,
    pad_batch,
    padded_length,
    plan_batches,
    read_records,
    record_key,
    tokenize_record,
    tokenize_workers,
)
from hscapture.tiny import demo_conversations, ensure_tiny_model, write_demo_jsonl

transformers = pytest.importorskip("transformers")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


CHAT = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "How do I build the garden?"},
    {"role": "assistant", "content": "Start with water, then plant seeds."},
    {"role": "user", "content": "Why would anyone test a bread recipe slowly?"},
    {"role": "assistant", "content": "Because the yeast needs time.\n\n1. Mix.\n2. Wait."},
]


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    """Write records (dicts are JSON-encoded, strings are written verbatim) one per line."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def masked_spans(sample: Sample) -> list[list[int]]:
    """The runs of consecutive token ids whose loss mask is 1."""
    spans: list[list[int]] = []
    previous = 0
    for token, m in zip(sample.input_ids, sample.loss_mask, strict=True):
        if m and not previous:
            spans.append([])
        if m:
            spans[-1].append(token)
        previous = m
    return spans


# --------------------------------------------------------------------------- tiny model


def test_tiny_model_loads_and_runs(tiny_dir: Path, tokenizer: Any) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    cfg = model.config
    assert model.dtype == torch.bfloat16
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (256, 512, 8)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.vocab_size == len(tokenizer) == 2048
    assert cfg.tie_word_embeddings is False
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert tokenizer.convert_ids_to_tokens([cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id]) == [
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
    ]
    ids = tokenizer.apply_chat_template(CHAT, return_dict=False)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    assert out.logits.shape == (1, len(ids), len(tokenizer))
    assert len(out.hidden_states) == 9
    assert all(torch.isfinite(h).all() for h in out.hidden_states)


def test_chat_template_format(tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|system|>You are a careful assistant.<|end|><|user|>How do I build the garden?<|end|><|assistant|>"
    )
    # Role markers are single special tokens and never merge with the text around them.
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.apply_chat_template(CHAT[:2], return_dict=False))
    assert tokens[:2] == ["<|bos|>", "<|system|>"]
    assert tokens.count("<|end|>") == 2
    # Plain text gets BOS, like Llama tokenizers.
    assert tokenizer("hello world").input_ids[0] == tokenizer.bos_token_id


def test_ensure_twice_is_a_noop(tiny_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    assert ensure_tiny_model(tiny_dir) == tiny_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before
    assert sorted(p.name for p in tiny_dir.parent.iterdir()) == ["tiny-llama"]  # no temp folder left


def test_build_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    other = ensure_tiny_model(tmp_path / "second")
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(p.name for p in other.iterdir())
    for name in names:
        assert (tiny_dir / name).read_bytes() == (other / name).read_bytes(), name


def test_losing_a_build_race_uses_the_winner(tiny_dir: Path, tmp_path: Path, monkeypatch: Any) -> None:
    target = tmp_path / "raced"

    def fake_tokenizer(out_dir: Path) -> None:
        (out_dir / "partial.txt").write_text("loser's build")

    def winner_finishes_first(out_dir: Path, tok: Any, architecture: str) -> None:
        # Another process renames its finished build into place while this one is still building.
        target.mkdir()
        for p in tiny_dir.iterdir():
            (target / p.name).write_bytes(p.read_bytes())

    monkeypatch.setattr(tiny, "_build_tokenizer", fake_tokenizer)
    monkeypatch.setattr(tiny, "_build_model", winner_finishes_first)
    assert ensure_tiny_model(target) == target
    assert not (target / "partial.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raced"]


def test_crashed_build_leaves_nothing(tmp_path: Path, monkeypatch: Any) -> None:
    def crash(out_dir: Path, tok: Any, architecture: str) -> None:
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(tiny, "_build_tokenizer", lambda out_dir: None)
    monkeypatch.setattr(tiny, "_build_model", crash)
    with pytest.raises(RuntimeError, match="killed mid-build"):
        ensure_tiny_model(tmp_path / "crashed")
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_build_into_a_foreign_folder(tmp_path: Path) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"not a complete tiny model.*delete it"):
        ensure_tiny_model(target)
    assert (target / "notes.txt").read_text() == "keep me"


def test_default_dir_honours_hscapture_home(tmp_path: Path) -> None:
    code = "from hscapture import tiny; print(tiny.DEFAULT_DIR)"
    env = {**os.environ, "HSCAPTURE_HOME": str(tmp_path)}
    printed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert Path(printed.stdout.strip()) == tmp_path / "tiny-llama"


def test_demo_conversations(tokenizer: Any, tmp_path: Path) -> None:
    records = demo_conversations(200)
    assert records == demo_conversations(200)
    assert records != demo_conversations(200, seed=1)
    assert [r["id"] for r in records[:2]] == ["demo-00000", "demo-00001"]
    n_turns = set()
    for r in records:
        roles = [m["role"] for m in r["messages"]]
        if roles[0] == "system":
            roles = roles[1:]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
        n_turns.add(len(roles) // 2)
        assert all(isinstance(m["content"], str) and m["content"] for m in r["messages"])
    assert n_turns == {1, 2, 3}
    assert any(r["messages"][0]["role"] == "system" for r in records)
    lengths = [len(s.input_ids) for s in load_samples(write_demo_jsonl(tmp_path / "demo.jsonl"), tokenizer)]
    assert len(lengths) == 200
    assert min(lengths) >= 15 and max(lengths) <= 400
    assert sum(20 <= n <= 300 for n in lengths) >= 190


# --------------------------------------------------------------------------- tokenize_record


def test_openai_chat_mask_covers_exactly_the_assistant(tokenizer: Any) -> None:
    sample = tokenize_record({"id": "c1", "messages": CHAT}, tokenizer, index=0, max_length=None)
    assert sample.key == "c1"
    assert sample.input_ids == tokenizer.apply_chat_template(CHAT, return_dict=False)
    assistant = [m["content"] for m in CHAT if m["role"] == "assistant"]
    spans = [tokenizer.decode(span) for span in masked_spans(sample)]
    assert spans == [text + "<|end|>" for text in assistant]
    unmasked = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m])
    for message in CHAT:
        assert (message["content"] in unmasked) == (message["role"] != "assistant")
    assert "<|assistant|>" in unmasked  # the generation prompt is the template's, not the assistant's


def test_sharegpt_equals_openai(tokenizer: Any) -> None:
    role_to_from = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {
        "conversations": [{"from": role_to_from[m["role"]], "value": m["content"]} for m in CHAT],
    }
    openai = {"messages": [{**m, "name": "ignored"} for m in CHAT]}  # extra keys are dropped
    a = tokenize_record(openai, tokenizer, 3, None)
    b = tokenize_record(sharegpt, tokenizer, 4, None)
    assert (a.key, b.key) == ("sample-00000003", "sample-00000004")
    assert dataclasses.replace(b, key=a.key) == a
    also_user = {"conversations": [{"from": m["role"], "value": m["content"]} for m in CHAT]}
    assert dataclasses.replace(tokenize_record(also_user, tokenizer, 3, None), key=a.key) == a


def test_prompt_and_text_records(tokenizer: Any) -> None:
    prompt = tokenize_record({"prompt": "How do I build the garden?"}, tokenizer, 0, None)
    assert tokenizer.decode(prompt.input_ids) == "<|bos|><|user|>How do I build the garden?<|end|><|assistant|>"
    assert prompt.loss_mask == [0] * len(prompt.input_ids)

    text = tokenize_record({"id": 7, "text": "The river is warm today."}, tokenizer, 0, None)
    assert text.key == "7"
    assert text.input_ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(text.input_ids, skip_special_tokens=True) == "The river is warm today."
    assert text.loss_mask == [1] * len(text.input_ids)


def test_max_length_truncates(tokenizer: Any) -> None:
    full = tokenize_record({"messages": CHAT}, tokenizer, 0, None)
    cut = tokenize_record({"messages": CHAT}, tokenizer, 0, max_length=20)
    assert cut.input_ids == full.input_ids[:20] and cut.loss_mask == full.loss_mask[:20]
    assert tokenize_record({"messages": CHAT}, tokenizer, 0, max_length=10_000) == full
    with pytest.raises(ValueError, match="max_length must be a positive integer"):
        tokenize_record({"messages": CHAT}, tokenizer, 0, max_length=0)


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (
            {"id": "r1", "messages": [{"role": "robot", "content": "hi"}]},
            ["'r1'", "messages[0].role", "'robot'", "use one of"],
        ),
        ({"id": "r2", "messages": []}, ["'r2'", "'messages'", "non-empty list"]),
        (
            {"id": "r3", "messages": [{"role": "user"}]},
            ["'r3'", "messages[0].content is missing"],
        ),
        (
            {"id": "r4", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
            ["'r4'", "messages[0].content must be a string", "list"],
        ),
        (
            {"id": "r5", "conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]},
            ["'r5'", "conversations[1].from", "'bot'"],
        ),
        (
            {"id": "r6", "conversations": [{"from": "human", "text": "hi"}]},
            ["'r6'", "conversations[0].value is missing"],
        ),
        (
            {"id": "r7", "messages": [{"role": "assistant", "content": "Hello!"}]},
            ["'r7'", "messages[0] is an assistant message", "start the conversation"],
        ),
        ({"id": "r8", "question": "hi"}, ["'r8'", "no 'messages'", "['id', 'question']"]),
        ({"id": "r9", "prompt": ["hi"]}, ["'r9'", "field 'prompt' must be a string"]),
        ({"id": ["x"], "text": "hi"}, ["field 'id'", "['x']"]),
    ],
)
def test_bad_records_name_key_and_field(tokenizer: Any, record: dict[str, Any], expected: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        tokenize_record(record, tokenizer, 0, None)
    for fragment in expected:
        assert fragment in str(info.value)


def test_template_that_rewrites_history_is_rejected(tiny_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    # Like reasoning models that drop earlier thoughts: past assistant turns render shorter.
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ '<|assistant|>...<|end|>' }}"
        "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    with pytest.raises(ValueError, match=r"record 'h1': the chat template is not prefix-stable"):
        tokenize_record({"id": "h1", "messages": CHAT}, tok, 0, None)


def test_template_errors_and_missing_template(tiny_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(ValueError, match=r"record 't1': the tokenizer's chat template rejected.*must alternate"):
        tokenize_record({"id": "t1", "messages": CHAT}, tok, 0, None)
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"record 't2': the tokenizer has no chat_template"):
        tokenize_record({"id": "t2", "prompt": "hi"}, tok, 0, None)
    assert tokenize_record({"id": "t3", "text": "hi"}, tok, 0, None).key == "t3"


def test_record_key() -> None:
    assert record_key({}, 12) == "sample-00000012"
    assert record_key({"id": None}, 1) == "sample-00000001"
    assert record_key({"id": "abc"}, 1) == "abc"
    assert record_key({"id": 5}, 1) == "5"
    for bad in ("", True, 1.5):
        with pytest.raises(ValueError, match="field 'id'"):
            record_key({"id": bad}, 1)


# --------------------------------------------------------------------------- files


def test_read_records_skips_blank_lines(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}, "", "   ", {"text": "b"}])
    assert list(read_records(path)) == [(1, {"text": "a"}), (4, {"text": "b"})]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n')
    assert list(read_records(bom)) == [(1, {"text": "a"})]


def test_read_records_errors_name_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, '{"text": "b",', {"text": "c"}])
    records = read_records(path)
    assert next(records) == (1, {"text": "a"})  # lazy: the good line comes out before the bad one is read
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON: .* at column \d+"):
        next(records)
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object, got list"):
        list(read_records(write_jsonl(tmp_path / "list.jsonl", [[1, 2]])))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin\.jsonl:2: not valid UTF-8"):
        list(read_records(latin))


def test_load_samples(tokenizer: Any, tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "mix.jsonl",
        [{"id": "a", "messages": CHAT}, "", {"prompt": "hi there"}, {"text": "the end"}],
    )
    samples = list(load_samples(path, tokenizer))
    assert [s.key for s in samples] == ["a", "sample-00000001", "sample-00000002"]
    assert samples[0] == tokenize_record({"id": "a", "messages": CHAT}, tokenizer, 0, None)
    skipped = list(load_samples(path, tokenizer, skip_keys={"a", "sample-00000002"}))
    assert [s.key for s in skipped] == ["sample-00000001"]
    cut = list(load_samples(path, tokenizer, max_length=5))
    assert [s.input_ids for s in cut] == [s.input_ids[:5] for s in samples]
    assert [s.loss_mask for s in cut] == [s.loss_mask[:5] for s in samples]


def test_load_samples_errors_name_line_and_key(tokenizer: Any, tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "roles.jsonl",
        [{"text": "fine"}, {"id": "x9", "messages": [{"role": "user", "content": "hi"}, {"role": "bot"}]}],
    )
    with pytest.raises(ValueError, match=r"roles\.jsonl:2: record 'x9': messages\[1\]\.role is 'bot'"):
        list(load_samples(path, tokenizer))


def test_tokenizing_processes_give_the_same_samples_in_order_and_the_same_errors(
    tokenizer: Any, tmp_path: Path
) -> None:
    """``workers=2``: real spawned processes, each sent the tokenizer once; chunks come back in file order."""
    data = write_demo_jsonl(tmp_path / "demo.jsonl", n=150)  # three chunks of 64 records, the last short
    skip = {"demo-00003", "demo-00100"}
    one = list(load_samples(data, tokenizer, skip_keys=skip, limit=140, max_length=40))
    assert list(load_samples(data, tokenizer, skip_keys=skip, limit=140, max_length=40, workers=2)) == one
    assert len(one) == 138
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}] * 70 + [{"id": "x9", "messages": [{"role": "bot"}]}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:71: record 'x9': messages\[0\]\.role is 'bot'"):
        list(load_samples(bad, tokenizer, workers=2))


def test_tokenizing_processes_start_only_where_they_repay_their_start(tmp_path: Path) -> None:
    small = write_jsonl(tmp_path / "small.jsonl", [{"text": "a"}])
    assert tokenize_workers(small) == 1
    big = tmp_path / "big.jsonl"
    big.write_text('{"text": "%s"}\n' % ("x" * (1 << 20)))
    cores = len(os.sched_getaffinity(0))
    expected = min(16, cores) if cores >= 4 else 1
    assert tokenize_workers(big) == expected
    assert tokenize_workers(big, jobs=cores) == 1  # a core each: none started


def test_duplicate_keys_name_both_lines(tokenizer: Any, tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "dup.jsonl",
        [{"id": "k", "text": "a"}, {"id": "j", "text": "b"}, "", {"id": "k", "text": "c"}],
    )
    with pytest.raises(ValueError, match=r"dup\.jsonl: duplicate key 'k' on lines 1 and 4"):
        list(load_samples(path, tokenizer))
    # A skipped record still counts: its key is taken.
    with pytest.raises(ValueError, match="duplicate key 'k'"):
        list(load_samples(path, tokenizer, skip_keys={"k"}))
    clash = write_jsonl(tmp_path / "clash.jsonl", [{"text": "a"}, {"id": "sample-00000000", "text": "b"}])
    with pytest.raises(ValueError, match="duplicate key 'sample-00000000' on lines 1 and 2"):
        list(load_samples(clash, tokenizer))


# --------------------------------------------------------------------------- batching


def make(lengths: list[int]) -> list[Sample]:
    return [Sample(f"s{i}", list(range(1, n + 1)), [1] * n) for i, n in enumerate(lengths)]


def test_plan_batches_example() -> None:
    samples = make([10, 10, 30, 5, 100, 5, 5, 5, 5])
    plan = plan_batches(samples, max_batch_tokens=60, max_batch_size=3)
    assert [[s.key for s in b] for b in plan] == [
        ["s0", "s1"],  # adding s2 would pad 3 x 30 = 90 > 60
        ["s2", "s3"],
        ["s4"],  # longer than the whole budget: alone
        ["s5", "s6", "s7"],  # max_batch_size
        ["s8"],
    ]
    assert plan == plan_batches(samples, max_batch_tokens=60, max_batch_size=3)
    assert plan_batches([], 10, 2) == []


def test_plan_batches_rejects_bad_limits() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens must be a positive integer, got 0"):
        plan_batches(make([1]), 0, 1)
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer, got -1"):
        plan_batches(make([1]), 10, -1)
    with pytest.raises(ValueError, match="plan_batches: pad_to_multiple must be a positive integer, got 0"):
        plan_batches(make([1]), 10, 1, 0)
    with pytest.raises(ValueError, match="--pad-to-multiple must be a positive integer, got True"):
        check_batching(10, 1, True, as_flags=True)


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 80), max_size=40),
    max_batch_tokens=st.integers(1, 200),
    max_batch_size=st.integers(1, 8),
    pad_to_multiple=st.sampled_from([1, 1, 3, 8, 64]),
)
def test_plan_batches_properties(
    lengths: list[int], max_batch_tokens: int, max_batch_size: int, pad_to_multiple: int
) -> None:
    samples = make(lengths)
    plan = plan_batches(samples, max_batch_tokens, max_batch_size, pad_to_multiple)
    assert [s for b in plan for s in b] == samples  # order kept, nothing lost
    assert plan == plan_batches(samples, max_batch_tokens, max_batch_size, pad_to_multiple)

    def rounded(batch: list[Sample]) -> int:
        return -(-max(len(s.input_ids) for s in batch) // pad_to_multiple) * pad_to_multiple

    for i, batch in enumerate(plan):
        widest = max(len(s.input_ids) for s in batch)
        width = padded_length(batch, pad_to_multiple, max_batch_tokens)
        assert 1 <= len(batch) <= max_batch_size
        assert len(batch) * widest <= max_batch_tokens or len(batch) == 1
        # --max-batch-tokens bounds the padded batch, rounding included; only a sample longer than it exceeds it
        assert len(batch) * width <= max(max_batch_tokens, widest)
        assert width >= widest and (width % pad_to_multiple == 0 or width in (widest, max_batch_tokens))
        if len(batch) > 1:
            assert width == rounded(batch)
        if i + 1 < len(plan):  # greedy: the next sample did not fit
            grown = [*batch, plan[i + 1][0]]
            assert len(grown) > max_batch_size or len(grown) * rounded(grown) > max_batch_tokens


def test_padded_length_rounds_up_within_the_budget() -> None:
    assert padded_length(make([3, 1, 4])) == 4
    assert padded_length(make([3, 1, 4]), 64) == 64
    assert padded_length(make([65, 2]), 64, 4096) == 128
    assert padded_length(make([990]), 64, 1000) == 1000  # a lone sample: rounded, but never past the budget
    assert padded_length(make([1200]), 64, 1000) == 1200  # longer than the budget: not padded at all
    # the same samples planned with rounding: two of 600 tokens no longer fit 1200 once rounded to 640
    assert [len(b) for b in plan_batches(make([600, 600]), 1200, 8, 64)] == [1, 1]
    assert [len(b) for b in plan_batches(make([600, 600]), 1200, 8)] == [2]


def test_pad_batch() -> None:
    batch = make([3, 1, 4])
    input_ids, attention_mask = pad_batch(batch, pad_id=99)
    assert input_ids.dtype == attention_mask.dtype == torch.int64
    assert input_ids.shape == attention_mask.shape == (3, 4)
    assert input_ids.tolist() == [[1, 2, 3, 99], [1, 99, 99, 99], [1, 2, 3, 4]]
    assert attention_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    with pytest.raises(ValueError, match="batch is empty"):
        pad_batch([], 0)
    input_ids, attention_mask = pad_batch(batch, pad_id=99, length=6)
    assert input_ids.tolist() == [[1, 2, 3, 99, 99, 99], [1, 99, 99, 99, 99, 99], [1, 2, 3, 4, 99, 99]]
    assert attention_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    with pytest.raises(ValueError, match="length 3 is shorter than the longest sample"):
        pad_batch(batch, 0, length=3)


def test_sample_rejects_misaligned_mask() -> None:
    with pytest.raises(ValueError, match=r"Sample 'z': loss_mask has 1 entries but input_ids has 2"):
        Sample("z", [1, 2], [1])
