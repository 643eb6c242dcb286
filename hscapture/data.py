"""Reading chat datasets and turning them into token ids, loss masks and padded batches.

Offline extraction runs a model over a JSONL file and stores hidden states per record, so this
module has to be exact about three things: which tokens a record becomes (the model's own chat
template, not a re-implementation of it), which of those tokens the assistant wrote (the loss
mask), and how records are grouped into forward calls (deterministic, so a run can be
reproduced call for call).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hscapture.config import usable_cores

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: A JSON escape of a UTF-16 surrogate (``\\ud800``-``\\udfff``): only then can a parsed string hold a lone one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
#: Roles a chat message may have.
ROLES = ("system", "user", "assistant")
#: ShareGPT ``from`` values and the role each one means.
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user",
    "gpt": "assistant",
    "system": "system",
    "user": "user",
    "assistant": "assistant",
}


@dataclass(frozen=True)
class Sample:
    """One tokenized record, ready to batch.

    Attributes:
        key: The record's id; outputs are stored under it, so it is unique within a file.
        input_ids: Token ids, exactly what the model is run on.
        loss_mask: 1 for each token the assistant wrote (its end-of-turn token included, as the
            template emits it), 0 otherwise; same length as ``input_ids``.
        cut: Tokens cut off its end to keep it within ``max_length`` (0: the whole record).
    """

    key: str
    input_ids: list[int]
    loss_mask: list[int]
    cut: int = 0

    def __post_init__(self) -> None:
        """Catch a mask that does not line up with the ids, which would misalign every stored row."""
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(
                f"Sample {self.key!r}: loss_mask has {len(self.loss_mask)} entries but input_ids has "
                f"{len(self.input_ids)}; they must have the same length"
            )


def read_records(path: Path | str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield the records of a JSONL file one at a time, so files larger than memory work.

    Args:
        path: JSONL file, one JSON object per line (UTF-8, an optional BOM is accepted).

    Returns:
        An iterator of ``(line_number, record)``, line numbers counted from 1; blank lines are skipped.

    Raises:
        ValueError: If a line is not valid UTF-8, not valid JSON (or nested too deep to decode), not a
            JSON object, or holds a lone UTF-16 surrogate (``"\\ud800"``, which no tokenizer can encode);
            the message names the file and line.
        FileNotFoundError: If ``path`` does not exist.
    """
    path = Path(path)
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{line_number}: not valid UTF-8 ({e.reason} at byte {e.start}); re-encode the file as UTF-8"
                ) from e
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{line_number}: invalid JSON: {e.msg} at column {e.colno}; "
                    "each line must hold exactly one JSON object"
                ) from e
            except RecursionError:  # the C decoder recurses per level of nesting
                raise ValueError(
                    f"{path}:{line_number}: invalid JSON: nested too deep for Python's decoder; "
                    "flatten the record (a chat record nests a few levels)"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}; "
                    'each line must be an object such as {"messages": [...]}'
                )
            if _SURROGATE_ESCAPE.search(line):  # a pair is fine (an emoji), half of one is not text
                _check_text(record, f"{path}:{line_number}")
            yield line_number, record


def _check_text(record: dict[str, Any], where: str) -> None:
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: a string holds a lone surrogate {e.object[e.start : e.end]!a} (half of a UTF-16 pair, "
            "not a character, so no tokenizer can encode it); fix the text or drop the record"
        ) from None


def record_key(record: Mapping[str, Any], index: int) -> str:
    """The key a record is stored under: its ``id`` when it has one, else ``sample-{index:08d}``.

    Args:
        record: A parsed record.
        index: 0-based position of the record among the file's records (blank lines not counted).

    Returns:
        The key.

    Raises:
        ValueError: If ``id`` is present but is not a non-empty string or an integer.
    """
    if "id" not in record or record["id"] is None:
        return f"sample-{index:08d}"
    value = record["id"]
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value:
        return value
    raise ValueError(
        f"record {index}: field 'id' must be a non-empty string or an integer, got {value!r}; "
        "fix the id or remove it to use the default key"
    )


def _normalize_messages(record: Mapping[str, Any], key: str) -> list[dict[str, str]]:
    """Validate ``messages`` or ``conversations`` and return plain ``{"role", "content"}`` dicts.

    Extra keys are dropped so the OpenAI and ShareGPT forms of one chat render identically.
    """
    if "messages" in record:
        field, role_key, content_key, role_map = "messages", "role", "content", {r: r for r in ROLES}
    else:
        field, role_key, content_key, role_map = "conversations", "from", "value", SHAREGPT_ROLES
    turns = record[field]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"record {key!r}: field '{field}' must be a non-empty list of messages, got {turns!r:.80}")
    messages: list[dict[str, str]] = []
    for i, turn in enumerate(turns):
        where = f"record {key!r}: {field}[{i}]"
        if not isinstance(turn, Mapping):
            raise ValueError(f"{where} must be an object with '{role_key}' and '{content_key}', got {turn!r:.80}")
        if role_key not in turn:
            raise ValueError(f"{where}.{role_key} is missing; use one of {sorted(role_map)}")
        role = turn[role_key]
        if role not in role_map:
            raise ValueError(
                f"{where}.{role_key} is {role!r}, which is not a known role; use one of {sorted(role_map)}"
            )
        if content_key not in turn:
            raise ValueError(f"{where}.{content_key} is missing; every message needs its text")
        content = turn[content_key]
        if not isinstance(content, str):
            raise ValueError(
                f"{where}.{content_key} must be a string, got {type(content).__name__} ({content!r:.80}); "
                "flatten multi-part content into one string"
            )
        messages.append({"role": role_map[role], "content": content})
    return messages


def _chat_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool, key: str
) -> list[int]:
    """Token ids of a rendered conversation, whatever container this transformers version returns.

    transformers 5 returns a ``BatchEncoding`` from ``apply_chat_template(tokenize=True)`` by default
    (``return_dict=True``); ``return_dict=False`` gives the plain list, and a mapping is unwrapped in
    case a tokenizer ignores the flag.
    """
    from jinja2 import TemplateError

    try:
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    except TemplateError as e:
        raise ValueError(f"record {key!r}: the tokenizer's chat template rejected the conversation: {e}") from e
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    ids = list(out)
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


def _check_prefix(full: list[int], part: list[int], key: str, what: str) -> None:
    """Raise unless ``part`` is a prefix of ``full``: the incremental loss mask depends on it."""
    if full[: len(part)] == part:
        return
    at = next((j for j, (a, b) in enumerate(zip(full, part, strict=False)) if a != b), min(len(full), len(part)))
    raise ValueError(
        f"record {key!r}: the chat template is not prefix-stable: the tokens of {what} are not a prefix of "
        f"the tokens of the whole conversation (they differ from token {at} on), so the assistant's tokens "
        "cannot be located. Templates that rewrite earlier turns (for example dropping past reasoning) do "
        "this; use a template that renders earlier turns unchanged, or give the record as plain 'text'"
    )


def _tokenize_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], key: str
) -> tuple[list[int], list[int]]:
    """Tokenize a chat and mark the assistant's tokens by rendering growing prefixes of it.

    For assistant message ``i``: tokens up to the end of ``messages[:i]`` plus the generation prompt
    are not the assistant's, tokens up to the end of ``messages[:i+1]`` are; the difference is
    exactly what the assistant wrote, as the template renders it, end-of-turn token included.
    """
    full = _chat_ids(tokenizer, messages, add_generation_prompt=False, key=key)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError(
                f"record {key!r}: messages[0] is an assistant message; the loss mask needs the text the "
                "template writes before it, so start the conversation with a system or user message"
            )
        before = _chat_ids(tokenizer, messages[:i], add_generation_prompt=True, key=key)
        after = _chat_ids(tokenizer, messages[: i + 1], add_generation_prompt=False, key=key)
        _check_prefix(full, before, key, f"messages[:{i}] with the generation prompt")
        _check_prefix(full, after, key, f"messages[:{i + 1}]")
        for j in range(len(before), len(after)):
            mask[j] = 1
    return full, mask


def tokenize_record(
    record: Mapping[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    index: int,
    max_length: int | None = None,
) -> Sample:
    """Turn one record into token ids and a loss mask, using the tokenizer's own chat template.

    Accepted shapes, tried in this order:

    * OpenAI: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``.
    * ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system"|"user"|"assistant",
      "value": str}, ...]}``; ``human`` means user and ``gpt`` means assistant.
    * ``{"prompt": str}``: one user message, rendered with the generation prompt (what a server
      sees before it answers); the loss mask is all zeros, since nothing was written by the assistant.
    * ``{"text": str}``: plain pretraining-style text, tokenized without any template (with the
      tokenizer's usual special tokens, such as BOS); the loss mask is all ones.

    Args:
        record: A parsed record; an optional ``id`` (string or integer) becomes the key.
        tokenizer: A Hugging Face tokenizer; chat shapes need its ``chat_template``.
        index: 0-based position of the record in its file, for the default key ``sample-{index:08d}``.
        max_length: If given, ids and mask are cut to the first ``max_length`` tokens (the
            assistant's later tokens are then simply absent; ``Sample.cut`` says how many); None keeps
            everything.

    Returns:
        The Sample.

    Raises:
        ValueError: If the record has none of the shapes, a role is unknown, a conversation is empty,
            content is missing or not a string, the template is not prefix-stable, or the result is
            empty; the message names the record key and the field.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"record {index}: expected a JSON object, got {type(record).__name__}")
    key = record_key(record, index)
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")

    is_chat = "messages" in record or "conversations" in record or "prompt" in record
    if is_chat and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"record {key!r}: the tokenizer has no chat_template, so chat records cannot be rendered; "
            "use a chat model's tokenizer or give records as plain 'text'"
        )
    if "messages" in record or "conversations" in record:
        input_ids, loss_mask = _tokenize_chat(tokenizer, _normalize_messages(record, key), key)
    elif "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"record {key!r}: field 'prompt' must be a string, got {type(prompt).__name__}")
        input_ids = _chat_ids(tokenizer, [{"role": "user", "content": prompt}], True, key)
        loss_mask = [0] * len(input_ids)
    elif "text" in record:
        text = record["text"]
        if not isinstance(text, str):
            raise ValueError(f"record {key!r}: field 'text' must be a string, got {type(text).__name__}")
        input_ids = [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]
        loss_mask = [1] * len(input_ids)
    else:
        raise ValueError(
            f"record {key!r}: no 'messages', 'conversations', 'prompt' or 'text' field "
            f"(fields present: {sorted(record)}); give the record one of these"
        )

    if not input_ids:
        raise ValueError(f"record {key!r}: tokenizes to zero tokens; drop the record or give it some text")
    cut = max(0, len(input_ids) - max_length) if max_length is not None else 0
    if cut:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return Sample(key=key, input_ids=input_ids, loss_mask=loss_mask, cut=cut)


def keyed_records(path: Path | str) -> Iterator[tuple[int, int, str, dict[str, Any]]]:
    """Yield ``(index, line_number, key, record)`` for each record of a JSONL file, keys checked unique.

    Raises:
        ValueError: On a malformed line or record, or a bad or repeated key (the message names the
            file and line, both lines for a repeated key).
    """
    path = Path(path)
    seen: dict[str, int] = {}
    for index, (line_number, record) in enumerate(read_records(path)):
        try:
            key = record_key(record, index)
        except ValueError as e:
            raise ValueError(f"{path}:{line_number}: {e}") from e
        if key in seen:
            raise ValueError(
                f"{path}: duplicate key {key!r} on lines {seen[key]} and {line_number}; "
                "record ids must be unique within a file because outputs are stored by key"
            )
        seen[key] = line_number
        yield index, line_number, key, record


def load_samples(
    path: Path | str,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
    skip_keys: AbstractSet[str] = frozenset(),
    limit: int | None = None,
    keep: Callable[[str], bool] | None = None,
    workers: int = 1,
) -> Iterator[Sample]:
    """Yield the Samples of a JSONL file lazily, in file order.

    Args:
        path: JSONL file of records (see ``tokenize_record`` for the shapes).
        tokenizer: A Hugging Face tokenizer.
        max_length: Truncate each sample to this many tokens; None keeps everything.
        skip_keys: Keys not to tokenize or yield (for example those already extracted by an
            interrupted run); they still count for duplicate detection and default keys.
        limit: Only the first this many records of the file (skipped ones included, so a resumed
            run with the same limit finishes the same records); None reads them all.
        keep: Whether a key is this job's (e.g. ``Part.owns`` of ``extract --shard``); other keys
            are skipped like ``skip_keys``.
        workers: Processes that tokenize side by side (the chat template renders a conversation once
            per assistant turn, in Python: one process takes ~40 ms for a 1,000-token chat); the
            same Samples, in the same order. 1 tokenizes here.

    Returns:
        An iterator of Samples. Default keys use the record's 0-based position among the file's
        records, so they are stable across runs over the same file.

    Raises:
        ValueError: On a malformed line or record (the message names the file and line), or if two
            records share a key (the message names both lines).
    """
    path = Path(path)
    records = (
        (index, line_number, record)
        for index, line_number, key, record in itertools.takewhile(
            lambda item: limit is None or item[0] < limit, keyed_records(path)
        )
        if key not in skip_keys and (keep is None or keep(key))
    )
    if workers <= 1:
        yield from _tokenize_records(path, records, tokenizer, max_length)
        return
    # spawn: the caller may hold CUDA state, which a forked child must not inherit.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_hold, initargs=(tokenizer,)) as pool:
        chunks = iter(lambda: list(itertools.islice(records, _CHUNK)), [])
        for samples in pool.map(_tokenize_chunk, itertools.repeat(path), chunks, itertools.repeat(max_length)):
            yield from samples


#: Records per task of a tokenizing process: large enough that the hand-over costs little.
_CHUNK = 64
#: The tokenizer of a tokenizing process (sent once, when the process starts).
_held: Any = None


def _hold(tokenizer: PreTrainedTokenizerBase) -> None:
    global _held
    _held = tokenizer


def _tokenize_chunk(path: Path, chunk: list[tuple[int, int, dict[str, Any]]], max_length: int | None) -> list[Sample]:
    return list(_tokenize_records(path, chunk, _held, max_length))


def _tokenize_records(
    path: Path,
    records: Iterable[tuple[int, int, dict[str, Any]]],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None,
) -> Iterator[Sample]:
    for index, line_number, record in records:
        try:
            yield tokenize_record(record, tokenizer, index, max_length)
        except ValueError as e:
            raise ValueError(f"{path}:{line_number}: {e}") from e


def tokenize_workers(path: Path | str, jobs: int = 1) -> int:
    """Tokenizing processes worth starting for a data file: one per core this job may use (its share
    when ``jobs`` run on the host, at most 16); 1 (none started) for a file under 1 MiB or a share
    under 4 cores, where starting them (each imports torch and transformers) costs what they save."""
    cores = usable_cores()
    workers = min(16, cores // max(1, jobs))
    return workers if workers >= 4 and Path(path).stat().st_size >= 1 << 20 else 1


def loss_mask_ranges(mask: Sequence[int]) -> list[tuple[int, int]]:
    """0/1 per token -> half-open ``[start, end)`` ranges of ones."""
    ranges: list[tuple[int, int]] = []
    start = None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            ranges.append((start, i))
            start = None
    return ranges


def check_batching(max_batch_tokens: int, max_batch_size: int, pad_to_multiple: int, as_flags: bool = False) -> None:
    """Raise ValueError unless the batching limits are positive integers, naming them as flags or as arguments."""
    for name, value in (
        ("max_batch_tokens", max_batch_tokens),
        ("max_batch_size", max_batch_size),
        ("pad_to_multiple", pad_to_multiple),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            shown = "--" + name.replace("_", "-") if as_flags else f"plan_batches: {name}"
            raise ValueError(f"{shown} must be a positive integer, got {value!r}")


def padded_length(batch: Sequence[Sample], pad_to_multiple: int = 1, max_batch_tokens: int | None = None) -> int:
    """The length a batch is padded to: its longest sample rounded up to a multiple of ``pad_to_multiple``.

    Each new padded length is a new shape for the model, and some kernels pay a one-time cost per
    shape (cuDNN attention builds an execution plan for each ``[batch, heads, length]`` it meets);
    rounding lengths up makes a run meet far fewer shapes for a little more padding. The rounding
    never takes a batch past ``max_batch_tokens`` padded tokens: a lone sample whose rounded
    length would exceed it is padded to ``max_batch_tokens`` (or not at all, when it is longer).

    Args:
        batch: Samples of one forward call (not empty).
        pad_to_multiple: Round the length up to a multiple of this (1: pad to the longest sample).
        max_batch_tokens: The padded-token budget the batch was planned with (None: no cap).

    Returns:
        The padded length ``T``, at least the longest sample's length.
    """
    longest = max(len(s.input_ids) for s in batch)
    rounded = -(-longest // pad_to_multiple) * pad_to_multiple
    if max_batch_tokens is not None:
        rounded = min(rounded, max(longest, max_batch_tokens // len(batch)))
    return rounded


def plan_batches(
    samples: Sequence[Sample], max_batch_tokens: int, max_batch_size: int, pad_to_multiple: int = 1
) -> list[list[Sample]]:
    """Group samples into forward calls, bounding the padded size of each.

    Greedy and order-preserving: a batch grows while ``len(batch) * padded_length(batch) <=
    max_batch_tokens`` (the longest sample rounded up to ``pad_to_multiple``, see
    :func:`padded_length`) and ``len(batch) <= max_batch_size``; a sample longer than
    ``max_batch_tokens`` goes alone in its own batch. The plan depends only on the inputs, so the
    same samples and limits always give the same batches (tests rely on this to replay the exact
    forward calls).

    Args:
        samples: Samples in the order to run them.
        max_batch_tokens: Budget of padded tokens (batch size x padded length) per batch.
        max_batch_size: Most samples in one batch.
        pad_to_multiple: Batches are padded to a multiple of this many tokens (1: to the longest sample).

    Returns:
        Batches whose concatenation is ``samples`` in order.

    Raises:
        ValueError: If a limit or the multiple is not a positive integer.
    """
    check_batching(max_batch_tokens, max_batch_size, pad_to_multiple)
    batches: list[list[Sample]] = []
    batch: list[Sample] = []
    longest = 0
    for sample in samples:
        n = len(sample.input_ids)
        grown = max(longest, n)
        rounded = -(-grown // pad_to_multiple) * pad_to_multiple
        if batch and ((len(batch) + 1) * rounded > max_batch_tokens or len(batch) + 1 > max_batch_size):
            batches.append(batch)
            batch, grown = [], n
        batch.append(sample)
        longest = grown
    if batch:
        batches.append(batch)
    return batches


def pad_batch(batch: Sequence[Sample], pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a batch into the tensors a Hugging Face model takes.

    Args:
        batch: Samples of one forward call.
        pad_id: Token id written into padding positions (masked out by ``attention_mask``).
        length: Padded length ``T`` (see :func:`padded_length`); None: the longest sample's.

    Returns:
        ``(input_ids, attention_mask)``, both int64 of shape ``[B, T]``; ``attention_mask`` is 1 on
        real tokens and 0 on padding.

    Raises:
        ValueError: If ``batch`` is empty, or ``length`` is shorter than its longest sample.
    """
    if not batch:
        raise ValueError("pad_batch: batch is empty; pass at least one Sample")
    longest = max(len(s.input_ids) for s in batch)
    width = longest if length is None else length
    if width < longest:
        raise ValueError(f"pad_batch: length {length} is shorter than the longest sample ({longest} tokens)")
    input_ids = torch.full((len(batch), width), int(pad_id), dtype=torch.int64)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, sample in enumerate(batch):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids, dtype=torch.int64)
        attention_mask[row, :n] = 1
    return input_ids, attention_mask


def regenerate_prompt(sample: Sample) -> list[int]:
    """The tokens before the last run of trained tokens (the final assistant turn): what an engine's regenerate mode
    prompts with."""
    ranges = loss_mask_ranges(sample.loss_mask)
    return sample.input_ids[: ranges[-1][0]] if ranges else list(sample.input_ids)
