"""``hscapture`` command line: ``extract``, ``serve`` (SGLang with capture), ``consume``, ``verify``, ``export``,
``inspect``, ``bench`` (the benchmark suites of a source checkout)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from hscapture.config import STORE_DTYPES, MiB, default_endpoint
from hscapture.errors import HSCaptureError
from hscapture.export import FORMATS


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give layer ids as integers, e.g. --layers 2,16,29") from None


def _size(text: str) -> int:
    """Bytes from '256M', '1G', '4096'."""
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size like 256M, 1G or 4096") from None


STORE_DTYPE_HELP = (
    "fp8: store rows as float8_e4m3fn with one float32 scale per row, half the bytes of bf16, quantized by "
    "the consumer (default: as captured, or as the existing store does)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hscapture", description="Capture per-layer hidden states from an LLM engine at almost no cost."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    commands = parser.add_subparsers(dest="command", required=True)

    ext = commands.add_parser(
        "extract",
        help="run a model over a dataset and store its hidden states",
        description="Offline bulk extraction. With no --model and no --data it uses an embedded tiny Llama "
        "and 200 demo conversations, so it runs anywhere without downloads.",
    )
    ext.add_argument("--out", type=Path, required=True, help="store directory (resumed if it exists)")
    ext.add_argument("--model", type=Path, help="local HF model directory (default: embedded tiny Llama)")
    ext.add_argument("--data", type=Path, help="JSONL: OpenAI messages, ShareGPT conversations, prompt or text")
    ext.add_argument(
        "--layers", type=_layers, help="layer ids k = residual stream entering layer k (default: EAGLE-3's 2,L/2,L-3)"
    )
    ext.add_argument("--no-last", action="store_true", help="do not capture the post-norm final hidden state")
    ext.add_argument("--dtype", help="bfloat16, float16 or float32 (default: the model's dtype)")
    ext.add_argument("--device", default="cpu", help="torch device for the model (default: cpu)")
    ext.add_argument("--max-length", type=int, help="truncate samples to this many tokens")
    ext.add_argument("--max-batch-tokens", type=int, default=4096, help="padded tokens per forward (default 4096)")
    ext.add_argument("--max-batch-size", type=int, default=64, help="samples per forward (default 64)")
    ext.add_argument("--limit", type=int, help="stop after this many samples")
    ext.add_argument("--shard-size", type=_size, default=256 * MiB, help="bytes per shard (default 256M)")
    ext.add_argument("--store-dtype", choices=sorted(STORE_DTYPES), help=STORE_DTYPE_HELP)
    ext.add_argument("--no-progress", action="store_true", help="no progress bar")
    ext.add_argument(
        "--engine", choices=("hf", "sglang"), default="hf", help="hf (transformers) or sglang (sglang.Engine)"
    )
    ext.add_argument(
        "--mode",
        choices=("teacher", "regenerate"),
        default="teacher",
        help="sglang: teacher = the data's tokens; regenerate = the model writes the last assistant turn",
    )
    ext.add_argument("--max-new-tokens", type=int, default=512, help="regenerate: tokens per answer (default 512)")
    ext.add_argument("--temperature", type=float, default=0.0, help="regenerate: sampling temperature (default 0)")

    con = commands.add_parser(
        "consume",
        help="attach to a producer and write what it captures to a store",
        description="The consumer process: attaches to a producer (also one started later or restarted), copies "
        "ring slots out, releases them, and writes shards. Stops cleanly on Ctrl-C.",
    )
    con.add_argument("--out", type=Path, help="store directory (appended to if it exists)")
    con.add_argument("--endpoint", default=default_endpoint(), help="producer endpoint (default: %(default)s)")
    con.add_argument("--shard-bytes", type=_size, default=256 * MiB, help="bytes per shard (default 256M)")
    con.add_argument(
        "--writer-threads", type=int, help="threads writing shards (default: 2, 4 with --store-dtype fp8; < cores)"
    )
    con.add_argument("--shard-buffers", type=int, help="shard buffers in memory (default: writer threads + 2)")
    con.add_argument("--flush-s", type=float, default=30.0, help="write an open shard after this many seconds")
    con.add_argument("--heartbeat-ms", type=int, default=200, help="hello/heartbeat period (default 200)")
    con.add_argument("--exit-on-eos", action="store_true", help="exit at the producer's end of stream")
    con.add_argument("--delay-ms", type=float, default=0.0, help="sleep per chunk (simulate a slow consumer)")
    con.add_argument("--watch-pid", type=int, help="finish and exit when this process is gone")
    con.add_argument("--token", help="the producer's token (default: read beside an ipc:// endpoint)")
    con.add_argument("--store-dtype", choices=sorted(STORE_DTYPES), help=STORE_DTYPE_HELP)
    con.add_argument("--discard", action="store_true", help="copy out and release but write nothing (benchmarks)")
    con.add_argument("--quiet", action="store_true", help="print nothing but warnings (no stats lines)")
    con.add_argument("--stats-s", type=float, default=10.0, help="seconds between stats lines on stderr (default 10)")
    con.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port)"
    )
    con.add_argument(
        "--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds (default: %(default)s)"
    )

    srv = commands.add_parser(
        "serve",
        help="run an SGLang server with capture on, and a consumer writing the store",
        description="Starts `python -m sglang.launch_server ARGS` with the hscapture plugin capturing the EAGLE-3 "
        "states of every request, and a consumer writing them to --out. Ctrl-C stops both; the store is finished "
        "and requests still in flight are marked incomplete.",
        usage="hscapture serve --out DIR [options] -- --model-path MODEL [sglang server args]",
    )
    srv.add_argument("--out", type=Path, required=True, help="store directory (appended to if it exists)")
    srv.add_argument("--layers", type=_layers, help="layer ids k = residual stream entering layer k (default: EAGLE-3)")
    srv.add_argument("--no-last", action="store_true", help="do not capture the post-norm final hidden state")
    srv.add_argument(
        "--policy", choices=("drop", "block"), default="drop", help="drop: serving never waits (default); block"
    )
    srv.add_argument("--endpoint", help="base ZeroMQ endpoint (default: a private ipc:// path)")
    srv.add_argument("--shard-bytes", type=_size, default=256 * MiB, help="bytes per shard (default 256M)")
    srv.add_argument("--slot-bytes", type=_size, default=4 * MiB, help="bytes per ring slot (default 4M)")
    srv.add_argument("sglang_args", nargs=argparse.REMAINDER, help="-- then SGLang server arguments")

    ver = commands.add_parser(
        "verify",
        help="check every shard of a store against its checksums",
        description="Reads every shard the index lists and compares its bytes with the CRC-32 checksums of its "
        "index line (whole file and per tensor). Exit status: 0 everything verifies, 1 something is corrupted "
        "or missing, 2 DIR is not a store.",
    )
    ver.add_argument("dir", type=Path, metavar="DIR", help="store directory")
    ver.add_argument("--json", action="store_true", help="print the report as JSON")
    ver.add_argument("--jobs", type=int, default=4, help="shards checked in parallel (default 4)")

    exp = commands.add_parser(
        "export",
        help="write a store as a drafter trainer's training files (SpecForge or speculators)",
        description="specforge: rows_*/data_{i}.ckpt as SpecForge's offline EAGLE-3 dataset reads them (aux layers "
        "concatenated, post-norm last state). speculators: an Arrow table plus hidden_states/hs_{i}.safetensors as "
        "speculators' ArrowDataset reads them (aux layers then layer L, before the final norm). Resumable: a rerun "
        "writes only what is missing.",
    )
    exp.add_argument("dir", type=Path, metavar="DIR", help="store directory")
    exp.add_argument("out", type=Path, metavar="OUT", help="output directory (resumed if it holds this export)")
    exp.add_argument("--format", required=True, choices=FORMATS, help="the trainer's layout")
    exp.add_argument("--aux-layers", type=_layers, help="aux layer ids (default: every captured layer below L)")
    exp.add_argument("--num-layers", type=int, help="the model's decoder layers L, if the store does not record it")
    exp.add_argument(
        "--include-incomplete", action="store_true", help="also export incomplete samples (rows up to the first gap)"
    )
    exp.add_argument("--limit", type=int, help="export only the first N eligible samples")
    exp.add_argument("--no-progress", action="store_true", help="no progress bar")

    ins = commands.add_parser(
        "inspect",
        help="summarize a store: requests, tokens, tensors, bytes, drops, incomplete samples, runs",
        description="Reads the index and meta.json only (no shard), so it is quick on any store. Exit status 2: "
        "DIR is not a store.",
    )
    ins.add_argument("dir", type=Path, metavar="DIR", help="store directory")
    ins.add_argument("--json", action="store_true", help="print the summary as JSON")
    ins.add_argument("--max-listed", type=int, default=10, help="incomplete samples and runs listed (default 10)")

    ben = commands.add_parser(
        "bench",
        help="run a benchmark suite (same as python benchmarks/run.py SUITE)",
        description="Runs benchmarks/run.py of the source checkout this hscapture is imported from; "
        "`hscapture bench gpu --help` lists a suite's options.",
    )
    ben.add_argument("suite", metavar="SUITE [OPTIONS]", help="a suite name and its options")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every later argument is the suite's, --help included
        try:
            return _bench(argv[1:])
        except ValueError as exc:
            print(f"hscapture bench: error: {exc}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    quiet = args.command in ("extract", "export", "inspect") or getattr(args, "quiet", False)
    level = logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "extract":
            return _extract(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "export":
            return _export(args)
        if args.command == "inspect":
            return _inspect(args)
        return _consume(args)
    except (ValueError, TypeError) as exc:
        print(f"hscapture {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except HSCaptureError as exc:
        print(f"hscapture {args.command}: failed: {exc}", file=sys.stderr)
        return 1


def _extract(args: argparse.Namespace) -> int:
    from hscapture.extract import ExtractOptions, extract

    options = ExtractOptions(
        out=args.out,
        model=args.model,
        data=args.data,
        layers=args.layers,
        capture_last=not args.no_last,
        dtype=args.dtype,
        device=args.device,
        max_length=args.max_length,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_size=args.max_batch_size,
        limit=args.limit,
        shard_bytes=args.shard_size,
        store_dtype=args.store_dtype,
        progress=not args.no_progress,
        engine=args.engine,
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
    )
    try:
        summary = extract(options)
    except KeyboardInterrupt:
        print(f"\ninterrupted; run the same command again to resume into {args.out}", file=sys.stderr)
        return 130
    store = summary.store
    if not store:
        print(f"nothing to capture: {args.data or 'the demo data'} has no samples", file=sys.stderr)
        return 1
    print(
        f"captured {summary.samples} samples, {summary.tokens} tokens in {summary.seconds:.1f} s "
        f"({summary.tokens_per_s:.0f} tok/s); {summary.skipped} were already there\n"
        f"store {args.out}: {store['complete']} complete samples, {store['incomplete']} incomplete, "
        f"{store['rows']} rows, {store['shards']} shards, {store['bytes'] / MiB:.1f} MiB, "
        f"{store['rows_dropped']} rows dropped\n"
        f"read it: python -c \"from hscapture import open_store; s = open_store('{args.out}'); "
        'print(s.get(s.keys()[0]))"'
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from hscapture.serve import ServeOptions, serve

    sglang_args = args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args
    options = ServeOptions(
        out=args.out,
        layers=args.layers,
        capture_last=not args.no_last,
        policy=args.policy,
        endpoint=args.endpoint,
        shard_bytes=args.shard_bytes,
        slot_bytes=args.slot_bytes,
    )
    return serve(options, sglang_args)


def _bench(suite_args: list[str]) -> int:
    """Hand over to ``benchmarks/run.py``: the suites live beside the package, not inside it."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "run.py").is_file():
        raise ValueError(
            f"no benchmarks/run.py beside {root / 'hscapture'}; the suites ship with the source checkout "
            "(git clone, then pip install -e '.[bench]')"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks.run import main as run_suite

    return run_suite(suite_args or ["--help"])


def _consume(args: argparse.Namespace) -> int:
    import torch

    from hscapture.config import ConsumerConfig
    from hscapture.consumer import Consumer
    from hscapture.consumer.metrics import MetricsReporter

    torch.set_num_threads(1)  # no model here: the writer threads are the parallelism (fp8 quantization)

    config = ConsumerConfig(
        out_dir=args.out,
        endpoint=args.endpoint,
        shard_bytes=args.shard_bytes,
        writer_threads=args.writer_threads,
        shard_buffers=args.shard_buffers,
        flush_s=args.flush_s,
        heartbeat_ms=args.heartbeat_ms,
        exit_on_eos=args.exit_on_eos,
        delay_ms=args.delay_ms,
        watch_pid=args.watch_pid,
        discard=args.discard,
        token=args.token,
        store_dtype=args.store_dtype,
    )
    consumer = Consumer(config)
    try:
        reporter = MetricsReporter(
            consumer.snapshot,
            stats_s=None if args.quiet else args.stats_s,
            port=args.metrics_port,
            host=args.metrics_host,
        )
    except ValueError:
        consumer.close()
        raise
    consumer.on_tick = reporter.tick
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: consumer.stop())
    if reporter.address is not None:
        print(f"hscapture consume: metrics at {reporter.address}", file=sys.stderr, flush=True)
    if not args.quiet:
        print(f"consuming {args.endpoint} into {args.out}; Ctrl-C finishes the store and exits", file=sys.stderr)
    try:
        stats = consumer.run()
    finally:
        reporter.close()
    if not args.quiet:
        print(f"done: {stats.to_dict()}", file=sys.stderr)
    return 0


def _verify(args: argparse.Namespace) -> int:
    import json
    from collections.abc import Iterable

    from tqdm import tqdm

    from hscapture.errors import StoreError
    from hscapture.store.verify import ShardCheck, format_report, verify_store

    def progress(checks: Iterable[ShardCheck], total: int) -> Iterable[ShardCheck]:
        show = sys.stdout.isatty() and total > 4 and not args.json  # a bar over more than a few shards
        return tqdm(checks, total=total, unit="shard", desc="verify", disable=not show, leave=False)

    try:
        report = verify_store(args.dir, jobs=args.jobs, progress=progress)
    except StoreError as exc:
        print(f"hscapture verify: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nhscapture verify: interrupted", file=sys.stderr)
        return 130
    try:
        print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report), flush=True)
    except BrokenPipeError:  # piped into head: the verdict is still the exit status
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if report.ok else 1


def _export(args: argparse.Namespace) -> int:
    from hscapture.export import ExportOptions, export

    options = ExportOptions(
        store=args.dir,
        out=args.out,
        format=args.format,
        aux_layers=args.aux_layers,
        num_layers=args.num_layers,
        include_incomplete=args.include_incomplete,
        limit=args.limit,
        progress=not args.no_progress,
    )
    try:
        summary = export(options)
    except KeyboardInterrupt:
        print(f"\ninterrupted; run the same command again to finish {args.out}", file=sys.stderr)
        return 130
    lines = [
        f"{args.format}: wrote {summary.written} samples, {summary.kept} were already there; {args.out} holds "
        f"{summary.total} (aux {', '.join(summary.aux)}; final {summary.final})"
    ]
    if summary.skipped_incomplete:
        lines.append(
            f"{summary.skipped_incomplete} incomplete samples skipped "
            "(--include-incomplete exports their rows up to the first gap)"
        )
    if summary.empty_loss_mask:
        lines.append(
            f"warning: {summary.empty_loss_mask} samples have an empty loss mask (nothing in them is trained on)"
        )
    print("\n".join(lines))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import json

    from hscapture.errors import StoreError
    from hscapture.inspection import format_inspection, inspect_store

    try:
        report = inspect_store(args.dir, max_listed=args.max_listed)
    except StoreError as exc:
        print(f"hscapture inspect: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_inspection(report))
    return 0
