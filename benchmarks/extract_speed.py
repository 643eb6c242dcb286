"""Offline extraction against a plain forward: ``hscapture extract`` tok/s over the same padded batches.

``python benchmarks/run.py extract --device cuda`` (GPU host; ``--tiny --device cpu`` anywhere).
One run, one model, one dataset, all made here (nothing downloaded):

* the model: a random-init Llama at 8B dims (hidden 4096, 32 layers, bf16), saved with the
  embedded tiny tokenizer (``--tiny``: the embedded tiny Llama itself);
* the data: ``--conversations`` chats of ~``--tokens`` tokens in all (lengths spread 0.25x to
  1.75x the mean), JSONL in OpenAI form.

Sections, in this order, each a fresh process (so each is cold, as an extraction is):

* ``plain-padP`` for each ``--pad-multiples`` P: the model loaded as ``hscapture extract``
  loads it, and the plain HF forward a user writes, ``model(input_ids=..., attention_mask=...,
  use_cache=False)``, over each padded batch ``hscapture extract --pad-to-multiple P`` plans;
  timed from the first batch to a synchronize after the last. A *cold* pass first (every
  shape new to the process, like an extraction) and a *warm* pass after it (every shape seen).
  Their difference over the distinct shapes is the one-time cost per shape.
* ``bare-padP`` for the first P: the same with extract's own forward call and no capture
  (:func:`hscapture.integrations.hf.forward_batch`: the decoder alone, unmasked), so that
  extract against it is the capture's cost alone.
* ``extract-padP-DTYPE`` for each ``--extractions`` entry ``P:DTYPE``: ``hscapture extract
  --device D --layers 2,16,29 --pad-to-multiple P`` (EAGLE-3's set + the post-norm last state)
  with a bf16 or fp8 store; its own tok/s line (timed from the consumer's attach to the store's
  last write; the consumer's start-up before it is reported beside it).
* ``sdpa``: :mod:`benchmarks.sdpa_shapes` on the distinct shapes of the ``--pad-multiples``
  first plan: which attention backend PyTorch picks for HF's masked call, and what a new shape
  costs each backend.
* ``plain-padP-no-cudnn-sdp`` (``--no-cudnn-sdp-plain``): the first plain section again with
  ``torch.backends.cuda.enable_cudnn_sdp(False)``, to tell the attention's share of the cold cost.

The goal (issue 11): extraction >= 0.9 of the plain forward, bf16 and fp8; the baseline is the
fastest plain HF pass measured (a warm one), the strictest there is. Reported beside it: against
extract's own forward without capture, warm and cold.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_ring
from benchmarks.lean_llama import LLAMA_8B, save_random_llama
from benchmarks.report import ROOT, Outcome, SuiteSpec, device_of, extract_bars, run_sections
from hscapture import open_store
from hscapture.data import load_samples, pad_batch, padded_length, plan_batches
from hscapture.extract import ExtractOptions
from hscapture.integrations.hf import AttentionKernels, forward_batch, load_model
from hscapture.tiny import demo_conversations, ensure_tiny_model

GOAL = 0.9
LAYERS = "2,16,29"
#: extract's tok/s line.
RATE_LINE = re.compile(r"captured (\d+) samples, (\d+) tokens in ([\d.]+) s \((\d+) tok/s\)")
#: extract's lines on what came before the capture: one, or one per job (``--data-parallel``).
PREPARATION_LINE = re.compile(
    r"^(?:job (\S+): (\d+) tokens in ([\d.]+) s from \+([\d.]+) s \(\d+ tok/s\); )?before it: "
    r"model loaded in ([\d.]+) s, data read in ([\d.]+) s, then ([\d.]+) s waiting for the consumer to attach$",
    re.M,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny Llama and ~20k tokens (CPU is fine)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tokens", type=int, help="tokens in all (default 508000; --tiny 20000)")
    parser.add_argument("--conversations", type=int, help="conversations (default 400; --tiny 40)")
    parser.add_argument("--max-batch-tokens", type=int, default=4096, help="as hscapture extract (default 4096)")
    parser.add_argument("--pad-multiples", default="1,64", help="plain forward passes at these multiples (1,64)")
    parser.add_argument(
        "--extractions", default="64:bf16,64:fp8,1:bf16", help="extractions as PAD:DTYPE (64:bf16,64:fp8,1:bf16)"
    )
    parser.add_argument("--no-sdpa-probe", action="store_true", help="skip the attention backends' per-shape probe")
    parser.add_argument("--no-cudnn-sdp-plain", action="store_true", help="also a plain run with cuDNN attention off")
    parser.add_argument("--work-dir", type=Path, help="where the model, data and stores go (default $TMPDIR)")


def make_model(work: Path, tiny: bool, device: torch.device) -> Path:
    """A local HF model directory: the tiny Llama, or a random-init 8B-dims Llama with the tiny tokenizer."""
    tiny_dir = ensure_tiny_model()
    return tiny_dir if tiny else save_random_llama(work / "llama-8b-dims", LLAMA_8B, tiny_dir, device)


def make_data(path: Path, tokenizer: Any, conversations: int, tokens: int) -> Path:
    """``conversations`` chats whose lengths spread evenly around ``tokens / conversations`` tokens.

    Each chat is made of consecutive turns of the demo conversations until its target length
    (counted on the raw text; the chat template adds a few tokens per message).
    """
    rng = random.Random(0)
    pool = [m for record in demo_conversations(4000) for m in record["messages"] if m["role"] != "system"]
    lengths = [len(tokenizer(m["content"]).input_ids) + 4 for m in pool]
    mean = tokens / conversations
    at = 0
    with path.open("w") as handle:
        for i in range(conversations):
            target = mean * rng.uniform(0.25, 1.75)
            messages: list[dict[str, str]] = []
            count = 0
            while count < target or not messages or messages[-1]["role"] != "assistant":
                message = pool[at % len(pool)]
                at += 1
                if not messages and message["role"] != "user":
                    continue
                messages.append(message)
                count += lengths[(at - 1) % len(pool)]
            handle.write(json.dumps({"id": f"conv-{i:05d}", "messages": messages}) + "\n")
    return path


def model_and_data(
    work: Path, tiny: bool, device: torch.device, conversations: int, tokens: int
) -> tuple[Path, Path, Any, float]:
    """The model directory (:func:`make_model`), the data file (:func:`make_data`) and the tokenizer, made in
    ``work``, and the seconds that took."""
    from transformers import AutoTokenizer

    started = time.perf_counter()
    model_dir = make_model(work, tiny, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = make_data(work / "data.jsonl", tokenizer, conversations, tokens)
    return model_dir, data, tokenizer, round(time.perf_counter() - started, 1)


def batch_shapes(batches: list[list[Any]], pad_to_multiple: int, max_batch_tokens: int) -> list[tuple[int, int]]:
    """``(batch size, padded length)`` of each batch, as ``hscapture extract`` pads it."""
    return [(len(b), padded_length(b, pad_to_multiple, max_batch_tokens)) for b in batches]


class PlainForward:
    """The model loaded as ``hscapture extract`` loads it, and extract's batches of the data, for timing.

    ``bare``: each batch through extract's own forward call (:func:`forward_batch`); otherwise the plain
    HF call a user writes for a padded batch (the causal LM, logits and attention mask included).
    """

    def __init__(
        self, model_dir: Path, data: Path, device: str, max_batch_tokens: int, pad_to_multiple: int, bare: bool
    ) -> None:
        self.bare = bare

        started = time.perf_counter()
        tokenizer, self.model, _ = load_model(model_dir, None, device)
        self.load_seconds = time.perf_counter() - started
        samples = list(load_samples(data, tokenizer))
        self.batches = plan_batches(samples, max_batch_tokens, ExtractOptions.max_batch_size, pad_to_multiple)
        self.shapes = batch_shapes(self.batches, pad_to_multiple, max_batch_tokens)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.pad_to_multiple, self.max_batch_tokens = pad_to_multiple, max_batch_tokens
        self.device = next(self.model.parameters()).device
        self.kernels = AttentionKernels(self.model) if bare and self.device.type == "cuda" else None  # as extract
        self.figures = {
            "pad_to_multiple": pad_to_multiple,
            "samples": len(samples),
            "tokens": sum(len(s.input_ids) for s in samples),
            "padded_tokens": sum(size * length for size, length in self.shapes),
            "batches": len(self.batches),
            "shapes": len(set(self.shapes)),
        }

    def seconds(self) -> float:
        """One pass over every batch (the plain HF call, or extract's own: ``bare``), to a synchronize after it."""
        self._sync()
        started = time.perf_counter()
        for batch in self.batches:
            if self.bare:
                forward_batch(self.model, batch, self.pad_id, self.pad_to_multiple, self.max_batch_tokens, self.kernels)
                continue
            input_ids, attention_mask = pad_batch(
                batch, self.pad_id, padded_length(batch, self.pad_to_multiple, self.max_batch_tokens)
            )
            with torch.inference_mode():
                self.model(
                    input_ids=input_ids.to(self.device, non_blocking=True),
                    attention_mask=attention_mask.to(self.device, non_blocking=True),
                    use_cache=False,
                )
        self._sync()
        return time.perf_counter() - started

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def plain_child(argv: list[str]) -> dict[str, Any]:
    """``python -m benchmarks.extract_speed plain ...``: a cold pass then a warm one, in this fresh process."""
    parser = argparse.ArgumentParser(prog="benchmarks.extract_speed plain")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--pad-to-multiple", type=int, default=1)
    parser.add_argument("--no-cudnn-sdp", action="store_true")
    parser.add_argument("--bare", action="store_true", help="extract's forward call (decoder alone, unmasked)")
    args = parser.parse_args(argv)
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    plain = PlainForward(args.model, args.data, args.device, args.max_batch_tokens, args.pad_to_multiple, args.bare)
    cold = plain.seconds()
    warm = plain.seconds()
    tokens = plain.figures["tokens"]
    return {
        **plain.figures,
        "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
        "forward": "extract" if args.bare else "hf",
        "load_seconds": round(plain.load_seconds, 1),
        "cold_seconds": round(cold, 3),
        "warm_seconds": round(warm, 3),
        "cold_tok_per_s": round(tokens / cold, 1),
        "warm_tok_per_s": round(tokens / warm, 1),
        "one_time_ms_per_shape": round((cold - warm) / plain.figures["shapes"] * 1e3, 2),
    }


def run_child(command: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=gpu_ring.child_env(), cwd=ROOT, timeout=1800)
    return done, time.perf_counter() - started


def run_plain(
    model_dir: Path, data: Path, device: str, max_batch_tokens: int, pad: int, no_cudnn: bool, bare: bool = False
) -> dict:
    command = [sys.executable, "-m", "benchmarks.extract_speed", "plain", "--model", str(model_dir)]
    command += ["--data", str(data), "--device", device, "--max-batch-tokens", str(max_batch_tokens)]
    command += ["--pad-to-multiple", str(pad), *(["--no-cudnn-sdp"] if no_cudnn else []), *(["--bare"] * bare)]
    done, wall = run_child(command)
    if done.returncode != 0:
        raise RuntimeError(f"plain forward failed ({done.returncode}): {done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_seconds": round(wall, 1)}


def run_extract(model_dir: Path, data: Path, out: Path, device: str, options: list[str]) -> dict[str, Any]:
    """``hscapture extract`` as its own process, with ``options``; its tok/s line and the store it left."""
    command = [sys.executable, "-m", "hscapture", "extract", "--model", str(model_dir), "--data", str(data)]
    command += ["--out", str(out), "--device", device, "--no-progress", *options]
    done, wall = run_child(command)
    match = RATE_LINE.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"hscapture extract failed ({done.returncode}): {done.stderr[-2000:]}")
    store = open_store(out)
    counters = (store.metadata()["runs"][-1].get("end") or {}).get("counters", {})
    samples, tokens, printed_seconds, rate = match.groups()
    # The printed seconds have one decimal (a 4.7 s run is +-1 %); the printed tok/s come from the exact time.
    seconds = int(tokens) / int(rate) if int(rate) else float(printed_seconds)
    preparation = [_preparation(found) for found in PREPARATION_LINE.finditer(done.stdout)]
    startup = max((p["consumer_wait_seconds"] for p in preparation), default=0.0)  # what the capture waited
    return {
        "command": shlex.join(["hscapture", *command[3:]]),
        "samples": int(samples),
        "tokens": int(tokens),
        "seconds": round(seconds, 3),
        "startup_seconds": float(startup),
        "tok_per_s": round(int(tokens) / max(seconds, 1e-9), 1),
        "tok_per_s_with_startup": round(int(tokens) / max(seconds + float(startup), 1e-9), 1),
        "printed_tok_per_s": int(rate),
        "process_seconds": round(wall, 1),
        "credit_waits": counters.get("credit_waits"),
        "credit_wait_s": round(counters.get("credit_wait_us", 0) / 1e6, 2),
        "store": store.summary(),
        "preparation": preparation,
    }


def _preparation(found: re.Match[str]) -> dict[str, Any]:
    """One job's times: model load and data before its capture; for several jobs also its start and span."""
    job, tokens, seconds, start, load, data, wait = found.groups()
    times = {"load_seconds": float(load), "data_seconds": float(data), "consumer_wait_seconds": float(wait)}
    if job is None:
        return times
    return {"job": job, "tokens": int(tokens), "seconds": float(seconds), "start_offset_s": float(start), **times}


def run_probe(shapes: list[tuple[int, int]], config: Any, device: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.sdpa_shapes", "--device", device, "--shapes", json.dumps(shapes)]
    heads = config.num_attention_heads
    command += ["--heads", str(heads), "--kv-heads", str(config.num_key_value_heads or heads)]
    command += ["--head-dim", str(getattr(config, "head_dim", None) or config.hidden_size // heads)]
    done, _ = run_child(command)
    if done.returncode != 0:
        raise RuntimeError(f"sdpa probe failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_extractions(text: str) -> list[tuple[int, str]]:
    found = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        pad, _, stored = item.partition(":")
        if not pad.isdigit() or int(pad) < 1 or stored not in ("bf16", "fp8"):
            raise ValueError(f"--extractions: {item!r}; give PAD:DTYPE with PAD a positive integer, DTYPE bf16 or fp8")
        found.append((int(pad), stored))
    return found


def summarize(outcome: Outcome) -> None:
    """Each extraction's ratios: against the fastest plain pass, and against the plain passes over its own batches.

    Two goals per extraction, both >= 0.9: ``vs_fastest_plain_forward`` (the fastest warm plain pass
    of any padding, with PyTorch's default attention: the strictest baseline, what a user could get
    from a bare forward over the same data) and ``vs_plain_same_batches`` (the warm plain pass over
    the very batches the extraction ran, same padding). Beside them, without a goal: against extract's own
    forward without capture over the same batches (``bare-padP``), warm and cold: the capture's cost alone.
    """
    results = outcome.results
    plains = {k: v for k, v in results.items() if k.startswith("plain-") and "warm_seconds" in v and v["cudnn_sdp"]}
    if not plains:
        return
    name, best = max(plains.items(), key=lambda item: item[1]["warm_tok_per_s"])
    results["baseline"] = {"section": name, "pass": "warm", "tok_per_s": best["warm_tok_per_s"]}
    for key, result in results.items():
        if not key.startswith("extract-") or "tok_per_s" not in result:
            continue
        result["ratio"] = round(result["tok_per_s"] / best["warm_tok_per_s"], 4)
        result["ratio_with_startup"] = round(result["tok_per_s_with_startup"] / best["warm_tok_per_s"], 4)
        goals = {"vs_fastest_plain_forward": result["ratio"]}
        same = plains.get(f"plain-pad{result['pad_to_multiple']}")
        if same is not None:
            result["ratio_vs_warm_same_pad"] = round(result["tok_per_s"] / same["warm_tok_per_s"], 4)
            result["ratio_vs_cold_same_pad"] = round(result["tok_per_s"] / same["cold_tok_per_s"], 4)
            goals["vs_plain_same_batches"] = result["ratio_vs_warm_same_pad"]
        bare = results.get(f"bare-pad{result['pad_to_multiple']}", {})
        if "warm_tok_per_s" in bare:
            result["ratio_vs_bare_warm"] = round(result["tok_per_s"] / bare["warm_tok_per_s"], 4)
            result["ratio_vs_bare_cold"] = round(result["tok_per_s"] / bare["cold_tok_per_s"], 4)
        for goal, value in goals.items():
            outcome.goals[f"{key}_{goal}"] = {"target": f">= {GOAL}", "value": value, "met": value >= GOAL}


def run(args: argparse.Namespace, checkpoint: Callable[[Outcome], None]) -> Outcome:
    device = torch.device(args.device)
    tokens = args.tokens or (20_000 if args.tiny else 508_000)
    conversations = args.conversations or (40 if args.tiny else 400)
    name, tag = device_of(device)
    multiples = [int(m) for m in args.pad_multiples.split(",") if m.strip()]
    if not multiples or min(multiples) < 1:
        raise ValueError(f"--pad-multiples: {args.pad_multiples!r}; give positive integers, e.g. 1,64")
    extractions = parse_extractions(args.extractions)
    settings = {
        "model": "tiny Llama (hidden 256, 8 layers)"
        if args.tiny
        else "random-init Llama, 8B dims (hidden 4096, 32 layers)",
        "tokens_asked": tokens,
        "conversations": conversations,
        "max_batch_tokens": args.max_batch_tokens,
        "layers": "default (EAGLE-3)" if args.tiny else LAYERS + " + last",
        "pad_multiples": multiples,
        "extractions": [f"{pad}:{stored}" for pad, stored in extractions],
    }
    outcome = Outcome(
        name=f"extract-tiny-{tag}" if args.tiny else f"extract-{tag}",
        device={"kind": device.type, "name": name},
        settings=settings,
        results={},
    )
    work = Path(tempfile.mkdtemp(prefix="hscapture-extract-speed-", dir=args.work_dir))
    try:
        model_dir, data, tokenizer, outcome.results["setup_seconds"] = model_and_data(
            work, args.tiny, device, conversations, tokens
        )
        layers = [] if args.tiny else ["--layers", LAYERS]
        sections: list[tuple[str, Callable[[], dict[str, Any]]]] = []
        for pad in multiples:
            plain = (model_dir, data, args.device, args.max_batch_tokens, pad, False)
            sections.append((f"plain-pad{pad}", lambda plain=plain: run_plain(*plain)))
        bare = (model_dir, data, args.device, args.max_batch_tokens, multiples[0], False, True)
        sections.append((f"bare-pad{multiples[0]}", lambda: run_plain(*bare)))
        for pad, stored in extractions:
            options = ["--max-batch-tokens", str(args.max_batch_tokens), "--pad-to-multiple", str(pad), *layers]
            options += ["--store-dtype", "fp8"] if stored == "fp8" else []
            out = work / f"store-{pad}-{stored}"

            def extraction(out: Path = out, options: list[str] = options, pad: int = pad) -> dict[str, Any]:
                try:
                    return {"pad_to_multiple": pad, **run_extract(model_dir, data, out, args.device, options)}
                finally:
                    shutil.rmtree(out, ignore_errors=True)

            sections.append((f"extract-pad{pad}-{stored}", extraction))
        if not args.no_sdpa_probe:
            samples = list(load_samples(data, tokenizer))
            batches = plan_batches(samples, args.max_batch_tokens, ExtractOptions.max_batch_size, multiples[0])
            shapes = sorted(set(batch_shapes(batches, multiples[0], args.max_batch_tokens)))
            random.Random(0).shuffle(shapes)
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_dir)
            sections.append(("sdpa", lambda: run_probe(shapes[:36], config, args.device)))
        if args.no_cudnn_sdp_plain:
            plain = (model_dir, data, args.device, args.max_batch_tokens, multiples[0], True)
            sections.append((f"plain-pad{multiples[0]}-no-cudnn-sdp", lambda: run_plain(*plain)))
        run_sections("extract", outcome, sections, summarize, checkpoint)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return outcome


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else ""


def table(record: dict[str, Any]) -> str:
    results = record["results"]
    baseline = results.get("baseline", {})
    best = baseline.get("tok_per_s")
    lines = [
        "| | pad to | seconds | tok/s | vs fastest plain (warm) | vs plain warm, same batches "
        "| vs plain cold, same batches | vs extract's forward, warm / cold |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, result in results.items():
        if not key.startswith(("plain-", "bare-")) or "cold_seconds" not in result:
            continue
        if result.get("forward") == "extract":
            label = "extract's forward, no capture (decoder alone, unmasked)"
        else:
            label = "plain HF forward `model(input_ids, attention_mask)`" + (
                "" if result["cudnn_sdp"] else ", cuDNN attention off"
            )
        pad = result["pad_to_multiple"]
        for kind, what in (("cold", "cold: fresh process, like extract"), ("warm", "warm: every shape seen")):
            rate = result[f"{kind}_tok_per_s"]
            ratio = _ratio(rate / best) if best else ""
            warm = _ratio(rate / result["warm_tok_per_s"])
            cold = _ratio(rate / result["cold_tok_per_s"])
            seconds = result[f"{kind}_seconds"]
            lines.append(f"| {label}, {what} | {pad} | {seconds:.1f} | {rate:,.0f} | {ratio} | {warm} | {cold} | |")
    for key, result in results.items():
        if not key.startswith("extract-") or "tok_per_s" not in result:
            continue
        stored = key.rsplit("-", 1)[-1]
        label = f"`hscapture extract`, {stored} store (its tok/s line)"
        seconds = f"{result['seconds']:.1f} (+{result['startup_seconds']:.1f} start-up)"
        lines.append(
            f"| {label} | {result['pad_to_multiple']} | {seconds} | {result['tok_per_s']:,.0f} | "
            f"**{_ratio(result.get('ratio'))}** ({_ratio(result.get('ratio_with_startup'))} with start-up) | "
            f"**{_ratio(result.get('ratio_vs_warm_same_pad'))}** | {_ratio(result.get('ratio_vs_cold_same_pad'))} | "
            f"{_ratio(result.get('ratio_vs_bare_warm'))} / {_ratio(result.get('ratio_vs_bare_cold'))} |"
        )
    notes = []
    for key, result in results.items():
        if key.startswith(("plain-", "bare-")) and "shapes" in result:
            notes.append(
                f"{key}: "
                f"{result['batches']} batches, {result['shapes']} distinct shapes, {result['padded_tokens']:,} padded "
                f"tokens, cold - warm = {result['one_time_ms_per_shape']:.0f} ms per distinct shape"
            )
    probe = results.get("sdpa", {})
    if "backend_picked" in probe:
        costs = ", ".join(
            f"{b} {probe[b]['one_time_ms_per_shape_median']:.1f} ms (repeat {probe[b]['repeat_ms_median']:.2f} ms)"
            for b in ("cudnn", "efficient", "default")
            if "one_time_ms_per_shape_median" in probe.get(b, {})
        )
        notes.append(
            f"attention: PyTorch picks {probe['backend_picked']} for HF's masked call "
            f"(cuDNN {probe['cudnn_version']}); one-time cost of a new shape, median: {costs}"
        )
    settings = record["settings"]
    plain = next((v for k, v in results.items() if k.startswith("plain-") and "tokens" in v), {})
    notes.append(
        f"{settings['model']}, layers {settings['layers']}, {plain.get('tokens', '?'):,} tokens in "
        f"{plain.get('samples', '?')} conversations, batches of at most {settings['max_batch_tokens']} padded tokens; "
        f"baseline: {baseline.get('section', '?')}, warm pass. Extraction seconds run from the consumer's attach to "
        "the store's last write; the consumer's start-up before it is shown beside them."
    )
    return "\n".join([*lines, "", *(f"- {note}" for note in notes)])


def chart(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    results = record["results"]
    return extract_bars(results, results.get("baseline", {}).get("tok_per_s", 0.0), "extract vs fastest plain forward")


SUITE = SuiteSpec(
    name="extract",
    description="hscapture extract's tok/s against a plain HF forward over the same batches (bf16 and fp8 stores)",
    add_arguments=add_arguments,
    run=run,
    table=table,
    tok_per_s=chart,
)


if __name__ == "__main__":
    if sys.argv[1:2] != ["plain"]:
        sys.exit("usage: python -m benchmarks.extract_speed plain --model DIR --data FILE [...] (a suite child)")
    print(json.dumps(plain_child(sys.argv[2:])))
