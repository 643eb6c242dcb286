"""A tiny Llama model built locally, so tests, examples and the CLI demo never touch a model hub.

The model is random-init (its outputs are noise) but it has the real Llama architecture, a real
byte-level BPE tokenizer and a chat template, which is all that hidden-state capture needs to
exercise every code path. Everything is derived from fixed seeds, so two builds on any machine
give byte-identical files and captured tensors can be compared across runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Where ``ensure_tiny_model()`` puts the model when no path is given. ``$HSCAPTURE_HOME`` is read
#: once, at import time; pass an explicit path to ``ensure_tiny_model`` to use another place.
DEFAULT_DIR: Path = (
    Path(os.environ.get("HSCAPTURE_HOME", str(Path.home() / ".cache" / "hscapture"))).expanduser() / "tiny-llama"
)

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
#: Special tokens, in id order (they take ids 0..6).
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END)

#: ``{{ bos }}`` then ``<|role|>content<|end|>`` per message, then ``<|assistant|>`` when asked to.
#: Every message ends on a special token, so the tokenization of a prefix of the conversation is
#: always a prefix of the tokenization of the whole conversation (what loss masks rely on).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

VOCAB_SIZE = 2048
#: Architecture of the tiny model; small enough to run a forward pass on a laptop CPU in milliseconds.
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}

#: Files whose presence means a finished build (the build only ever appears by an atomic rename).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

_WORD_TEXT = """
the of and to in is was for on that with as by at from it this be are an or which not have has had
but all were they their one can more when there been also who other its into new some time would
people first two after years only may these over such most many made about then so any up out
between world state work like used him well through where year three before because both under
water city each being part day way life long place small found great last three while house light
system group school number point still same every hand line real name power high world music court
world book story family night young old good best right game river road south north east west king
model data value layer token hidden state batch memory cache engine server client request answer
question reason simple quick careful clear short small large green blue red black white bright dark
warm cold fast slow early late happy calm busy open close write read learn teach build test check
make take give keep find send move turn start stop run walk talk think know want need help show try
call ask tell feel seem leave put mean become begin hold bring stand sit lose pay meet include set
continue change lead understand watch follow create speak allow add spend grow offer remember love
consider appear buy wait serve die expect stay fall cut reach kill remain suggest raise pass sell
require report decide pull explain hope develop carry break receive agree support hit produce eat
cover catch draw choose cause point listen plan sort count sum compute store load save copy merge
split join sample train measure compare capture record stream shard ring buffer queue thread process
kernel tensor vector matrix row column shape size type format file folder path disk network socket
garden kitchen window table chair door street market village forest mountain ocean island desert
morning evening winter summer autumn spring weather rain snow wind cloud sun moon star sky field
apple bread cheese coffee tea milk rice soup salt sugar honey lemon orange grape carrot potato onion
doctor teacher farmer artist writer driver pilot nurse student friend mother father sister brother
letter paper pencil picture photo camera phone clock watch key lock box bag shoe coat hat ring
animal bird fish horse dog cat cow sheep lion tiger bear wolf fox rabbit mouse snake frog bee
because although however therefore perhaps usually often never always sometimes maybe quite very
really almost already again soon later today tomorrow yesterday here there everywhere nowhere
"""
#: The vocabulary of the generated text, first occurrence kept (the order matters for determinism).
_WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))

_NAMES = (
    "Ada",
    "Ben",
    "Cleo",
    "Dan",
    "Eve",
    "Finn",
    "Gia",
    "Hugo",
    "Iris",
    "Jon",
    "Kai",
    "Lena",
    "Milo",
    "Nora",
    "Otto",
    "Pia",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
)
_TOPICS = (
    "the garden",
    "a small kitchen",
    "the river trip",
    "a school project",
    "the market",
    "a mountain walk",
    "the music class",
    "a new server",
    "the data model",
    "a memory cache",
    "the winter plan",
    "a bread recipe",
)
_QUESTION_FORMS = (
    "How do I {verb} {topic}?",
    "Can you explain why {name} wants to {verb} {topic}?",
    "What is the best way to {verb} {topic} before {time}?",
    "Please help me {verb} {topic}.",
    "Why would anyone {verb} {topic} {adverb}?",
    "Write a short note about {topic}.",
    "Is it true that {name} can {verb} {topic} in {count} days?",
)
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant who answers in short, clear sentences.",
    "You are a friendly teacher. Explain things simply and give one example.",
    "Answer as briefly as possible.",
)
_VERBS = (
    "build",
    "test",
    "check",
    "plan",
    "write",
    "read",
    "learn",
    "compare",
    "measure",
    "capture",
    "store",
    "move",
    "explain",
    "change",
)
_ADVERBS = ("quickly", "slowly", "carefully", "often", "never", "always", "early", "late", "again")
_TIMES = ("tomorrow", "today", "the evening", "the weekend", "winter", "the next meeting")


def _sentence(rng: random.Random, min_words: int = 4, max_words: int = 16) -> str:
    """One capitalised pseudo-English sentence of random words, with occasional commas and numbers."""
    words: list[str] = []
    for i in range(rng.randint(min_words, max_words)):
        roll = rng.random()
        if roll < 0.04:
            word = str(rng.randint(0, 2025))
        elif roll < 0.08:
            word = rng.choice(_NAMES)
        else:
            word = rng.choice(_WORDS)
        if i > 1 and rng.random() < 0.08:
            words[-1] += ","
        words.append(word)
    words[0] = words[0][:1].upper() + words[0][1:]
    return " ".join(words) + rng.choice(".....?!")


def _paragraph(rng: random.Random, min_sentences: int, max_sentences: int) -> str:
    """Several sentences; sometimes split over lines or as a short list, like real chat answers."""
    sentences = [_sentence(rng) for _ in range(rng.randint(min_sentences, max_sentences))]
    style = rng.random()
    if style < 0.15 and len(sentences) > 1:
        return "\n".join(f"{i + 1}. {s}" for i, s in enumerate(sentences))
    if style < 0.3 and len(sentences) > 1:
        return "\n\n".join(sentences)
    return " ".join(sentences)


def _question(rng: random.Random) -> str:
    """A user turn: a templated question, sometimes followed by a sentence of context."""
    text = rng.choice(_QUESTION_FORMS).format(
        verb=rng.choice(_VERBS),
        topic=rng.choice(_TOPICS),
        name=rng.choice(_NAMES),
        time=rng.choice(_TIMES),
        adverb=rng.choice(_ADVERBS),
        count=rng.randint(2, 30),
    )
    if rng.random() < 0.5:
        text += " " + _paragraph(rng, 1, 3)
    return text


def _corpus(n_lines: int = 6000) -> Iterator[str]:
    """The tokenizer's training text: the chat-like text the demo uses, generated, never shipped."""
    rng = random.Random(0)
    for _ in range(n_lines):
        roll = rng.random()
        if roll < 0.2:
            yield _question(rng)
        elif roll < 0.25:
            yield rng.choice(_SYSTEM_PROMPTS)
        else:
            yield _paragraph(rng, 1, 4)


def demo_conversations(n: int = 200, seed: int = 0, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Deterministic synthetic chats in OpenAI form, for demos and tests of offline extraction.

    Each record is ``{"id": "demo-00000", "messages": [...]}`` with an optional system message and
    1-3 user/assistant turns, roughly 20-300 tokens in all with the tiny tokenizer.

    Args:
        n: Number of conversations.
        seed: Seed of the generator; the same ``(n, seed)`` always gives the same records.
        system_prompt: If given, every conversation starts with this system message (samples sharing
            a prefix, as a prefix cache sees them); the turns are the same as without it.

    Returns:
        The records, ids ``demo-00000`` upward.

    Raises:
        ValueError: If ``n`` is negative.
    """
    if n < 0:
        raise ValueError(f"demo_conversations: n must be >= 0, got {n}")
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    for i in range(n):
        messages: list[dict[str, str]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
        if system_prompt is not None:
            messages = [{"role": "system", "content": system_prompt}]
        for _ in range(rng.choice((1, 1, 2, 3))):
            messages.append({"role": "user", "content": _question(rng)})
            long_answer = rng.random() < 0.25
            messages.append({"role": "assistant", "content": _paragraph(rng, 1, 5 if long_answer else 2)})
        records.append({"id": f"demo-{i:05d}", "messages": messages})
    return records


def long_system_prompt(tokenizer: Any, min_tokens: int, seed: int = 0) -> str:
    """A deterministic system prompt of demo sentences, at least ``min_tokens`` tokens long under ``tokenizer``
    (the text alone, without a chat template's markers).

    Args:
        tokenizer: An HF tokenizer (e.g. the tiny model's).
        min_tokens: The fewest tokens the text tokenizes to.
        seed: Seed of the sentence generator.
    """
    rng = random.Random(seed)
    sentences = [_sentence(rng, 8, 16)]
    while len(tokenizer(" ".join(sentences), add_special_tokens=False).input_ids) < min_tokens:
        sentences.append(_sentence(rng, 8, 16))
    return " ".join(sentences)


def write_demo_jsonl(path: Path | str, n: int = 200, system_prompt: str | None = None) -> Path:
    """Write ``demo_conversations(n)`` as JSONL (one record per line), for the CLI demo and tests.

    Args:
        path: File to write; its parent folders are created. An existing file is replaced.
        n: Number of conversations.
        system_prompt: If given, the system message every conversation starts with.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in demo_conversations(n, system_prompt=system_prompt):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def _is_complete(path: Path) -> bool:
    """True when every file of a finished build is present."""
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def _build_tokenizer(out_dir: Path) -> Any:
    """Train the byte-level BPE tokenizer on the generated corpus and save it with its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = backend.token_to_id(BOS)
    # Plain ``tokenizer(text)`` prepends <|bos|>, like Llama tokenizers; chat templates write it themselves
    # (``apply_chat_template`` tokenizes with add_special_tokens=False).
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[SYSTEM, USER, ASSISTANT, END],
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


#: Tiny DeepSeek-V2 (MLA attention + MoE), the family of the DeepSeek and Kimi models; shapes SGLang's CPU path accepts.
#: Keep ``kv_lora_rank + qk_rope_head_dim == qk_nope_head_dim + qk_rope_head_dim`` and ``kv_lora_rank ==
#: v_head_dim``: SGLang's torch_native backend computes a DeepSeek prefill over the MLA latent cache (an
#: SGLang bug; README, "SGLang vs HF"), which other widths turn into a shape error. These widths run it, and
#: give states 3.5-10x off HF on prefill rows; through SGLang's absorbed-MLA path they agree within ~1 %.
DEEPSEEK_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "qk_nope_head_dim": 32,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "max_position_embeddings": 2048,
}
#: config.json entries SGLang's CPU DeepSeek path needs that transformers does not write.
_DEEPSEEK_CONFIG_EXTRA: dict[str, Any] = {
    "rope_scaling": {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "rope_theta": 10000.0,
    },
    "moe_layer_freq": 1,
    "scoring_func": "softmax",
}
#: Tiny DeepSeek-V3 (MLA + MoE with sigmoid group-limited routing), also the text model of the tiny Kimi-K2.5.
DEEPSEEK_V3_SHAPE: dict[str, Any] = {
    **{k: v for k, v in DEEPSEEK_SHAPE.items() if k not in ("topk_method", "q_lora_rank")},
    "q_lora_rank": 64,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}
#: config.json entries of the tiny DeepSeek-V3 that SGLang's CPU path reads (YaRN rope, noaux_tc routing).
_DEEPSEEK_V3_CONFIG_EXTRA: dict[str, Any] = {
    "rope_scaling": _DEEPSEEK_CONFIG_EXTRA["rope_scaling"],
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}
#: Tiny Qwen3 with 6 decoder layers: EAGLE-3's default layers ``[2, L//2, L-3]`` collide there.
QWEN3_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
}
#: Tiny Gemma3 (``Gemma3ForConditionalGeneration``): text model plus a one-layer SigLIP tower.
GEMMA3_TEXT_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "sliding_window": 16,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
    "max_position_embeddings": 2048,
}
GEMMA3_VISION_SHAPE: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 16,
    "vision_use_head": False,
}
#: Kimi-K2.5's vision tower, as small as SGLang's ``KimiK25VisionConfig`` allows (served text-only here;
#: SGLang's tower reads the plain names, its projector the ``vt_`` ones).
KIMI_K25_VISION_SHAPE: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "vt_num_hidden_layers": 1,
    "vt_num_attention_heads": 2,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "text_hidden_size": DEEPSEEK_V3_SHAPE["hidden_size"],
}
#: Kimi-K2.5's ``preprocessor_config.json``, as a real checkpoint ships it, less its remote-code ``auto_map``: the
#: ``media_proc_cfg`` keys vLLM's ``KimiK25FusedVisionProcessor`` reads (patch and merge sizes the tower's defaults).
#: vLLM builds that processor with its ModelConfig even when serving text only (``--language-model-only``).
KIMI_K25_PREPROCESSOR: dict[str, Any] = {
    "media_proc_cfg": {
        "patch_size": 14,
        "merge_kernel_size": 2,
        "in_patch_limit": 16384,
        "patch_limit_on_one_side": 512,
        "fixed_output_tokens": None,
        "in_patch_limit_each_frame": 4096,
        "in_patch_limit_video": None,
        "temporal_merge_kernel_size": 4,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
}
ARCHITECTURES = ("llama", "deepseek_v2", "deepseek_v3", "kimi_k25", "qwen3", "gemma3")


def _build_model(out_dir: Path, tokenizer: Any, architecture: str = "llama") -> None:
    """Random-init the model from seed 0 and save it as bfloat16 safetensors."""
    import torch
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if architecture == "kimi_k25":
        _build_model(out_dir, tokenizer, "deepseek_v3")
        _wrap_as_kimi_k25(out_dir)
        return
    config_class, model_class, shape = {
        "llama": (LlamaConfig, LlamaForCausalLM, MODEL_SHAPE),
        "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM, DEEPSEEK_SHAPE),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, DEEPSEEK_V3_SHAPE),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, QWEN3_SHAPE),
        "gemma3": (Gemma3TextConfig, Gemma3ForConditionalGeneration, GEMMA3_TEXT_SHAPE),
    }[architecture]
    config = config_class(
        vocab_size=len(tokenizer),
        tie_word_embeddings=architecture == "gemma3",  # Gemma ties its LM head to the embeddings
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=torch.bfloat16,
        **shape,
    )
    if architecture == "gemma3":
        config = Gemma3Config(text_config=config, vision_config=GEMMA3_VISION_SHAPE, mm_tokens_per_image=4)
        config.dtype = torch.bfloat16
    # fork_rng: seed the init without changing the caller's global torch RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(config)
    model = model.to(torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    if architecture == "deepseek_v2":
        config_path = out_dir / "config.json"
        values = json.loads(config_path.read_text())
        values.update(_DEEPSEEK_CONFIG_EXTRA)
        values["rope_parameters"] = _DEEPSEEK_CONFIG_EXTRA["rope_scaling"]
        config_path.write_text(json.dumps(values, indent=2))
    if architecture == "gemma3":
        _rename_weights(out_dir, "vision_tower.", "vision_tower.vision_model.")  # the released checkpoints' names
    if architecture == "deepseek_v3":
        config_path = out_dir / "config.json"
        values = json.loads(config_path.read_text())
        values.update(_DEEPSEEK_V3_CONFIG_EXTRA)
        values["rope_parameters"] = _DEEPSEEK_V3_CONFIG_EXTRA["rope_scaling"]
        config_path.write_text(json.dumps(values, indent=2))


def _rename_weights(out_dir: Path, prefix: str, replacement: str) -> None:
    """Rename the saved tensors whose name starts with ``prefix`` to start with ``replacement``."""
    from safetensors.torch import load_file, save_file

    weights = out_dir / "model.safetensors"
    tensors = {
        replacement + name[len(prefix) :] if name.startswith(prefix) else name: tensor
        for name, tensor in load_file(weights).items()
    }
    save_file(tensors, weights, metadata={"format": "pt"})


def _wrap_as_kimi_k25(out_dir: Path) -> None:
    """Turn a saved DeepSeek-V3 into a Kimi-K2.5 checkpoint with the same text weights.

    Kimi-K2.5 (``KimiK25ForConditionalGeneration``) is a DeepSeek-V3 text model under
    ``language_model.`` plus a vision tower; the tower's weights are left out (SGLang keeps its
    random init, and the tests serve text only). The LM head is the text model's own, untied
    (``Kimi_K25Config`` ties by default), and the image processor's config is there for vLLM.
    """
    _rename_weights(out_dir, "", "language_model.")
    config_path = out_dir / "config.json"
    text = json.loads(config_path.read_text())
    kimi = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": KIMI_K25_VISION_SHAPE,
        "pad_token_id": text["pad_token_id"],
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "dtype": text.get("dtype", "bfloat16"),
        "tie_word_embeddings": False,
    }
    config_path.write_text(json.dumps(kimi, indent=2))
    (out_dir / "preprocessor_config.json").write_text(json.dumps(KIMI_K25_PREPROCESSOR, indent=2))


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' "Writing model shards" bar during the build, restoring the caller's setting."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _make_shareable(folder: Path) -> None:
    """Make the build world-readable like a normal download: mkdtemp (and safetensors) create it owner-only."""
    folder.chmod(0o755)
    for child in folder.iterdir():
        child.chmod(0o644)


def ensure_tiny_model(path: Path | str | None = None, architecture: str = "llama") -> Path:
    """Return a folder holding the tiny model and tokenizer, building it the first time (~2-10 s on CPU).

    The build happens in a temporary folder beside ``path`` that is then renamed into place, so a
    crash never leaves a half-built model, and two processes racing on the same path both end up
    using whichever build landed first.

    Args:
        path: Target folder; ``DEFAULT_DIR`` when None.
        architecture: ``llama`` (the default model) or ``deepseek_v2`` (MLA + MoE, for engine tests).

    Returns:
        ``path``, loadable with ``AutoTokenizer.from_pretrained`` and
        ``AutoModelForCausalLM.from_pretrained``.

    Raises:
        FileExistsError: If ``path`` exists, is not empty and is not a complete tiny model.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture: {architecture!r} is unknown; use one of {ARCHITECTURES}")
    path = Path(DEFAULT_DIR if path is None else path).expanduser()
    if _is_complete(path):
        return path
    _check_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    try:
        with _quiet_progress_bars():
            tokenizer = _build_tokenizer(tmp)
            _build_model(tmp, tokenizer, architecture)
        _make_shareable(tmp)
        try:
            # rename() of a folder is atomic and fails if the target is a non-empty folder,
            # which is exactly the case where another process won the race.
            os.rename(tmp, path)
        except OSError:
            if not _is_complete(path):
                _check_target(path)
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _check_target(path: Path) -> None:
    """Refuse to build over a folder with foreign content rather than mix files into it."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
        raise FileExistsError(
            f"ensure_tiny_model: {path} exists but is not a complete tiny model (missing {missing}); "
            "delete it to rebuild, or pass another path"
        )
