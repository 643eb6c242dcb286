"""``hscapture`` command line: ``extract``, ``serve`` (SGLang or vLLM with capture), ``consume``, ``verify``,
``export``, ``inspect``, ``keys`` (CURVE keys for tcp:// endpoints), ``bench`` (the benchmark suites of a source
checkout)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import logging
import os
import re
import signal
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hscapture.config import ConsumerConfig, MiB, layer_spec
from hscapture.errors import HSCaptureError

if TYPE_CHECKING:
    from hscapture.export import ExportOptions
    from hscapture.extract import ExtractOptions, ExtractSummary

#: Each command's options dataclass (module, class), imported only for the command that runs: ``consume``
#: starts without importing extraction, export or serving.
OPTIONS = {
    "extract": ("hscapture.extract", "ExtractOptions"),
    "consume": ("hscapture.config", "ConsumerConfig"),
    "serve": ("hscapture.serve", "ServeOptions"),
    "export": ("hscapture.export", "ExportOptions"),
}


def options_class(command: str) -> type:
    """The options dataclass of ``command`` (see :data:`OPTIONS`)."""
    module, name = OPTIONS[command]
    return getattr(importlib.import_module(module), name)


#: Old spellings still accepted, per command: old flag -> the flag to use.
RENAMED = {"extract": {"--shard-size": "--shard-bytes"}}
#: Damaged samples an export names one line each; the rest are counted.
SHOW_DAMAGED = 10


def _layers(text: str) -> tuple[int, ...]:
    """Layer ids and ranges (``2,16,29``, ``0-32:4``), not ``all``."""
    spec = _parsed(layer_spec)(text)
    if isinstance(spec, str):
        raise argparse.ArgumentTypeError(f"{text!r}: name the layer ids here (e.g. 2,16,29 or 0-32:4), not all")
    return spec


def _parsed(parse: Any) -> Any:
    """``parse`` as an argparse type: its ValueError's message becomes the command line's error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:  # argparse names the flag itself
            raise argparse.ArgumentTypeError(re.sub(r"^--[\w-]+: ", "", str(exc))) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


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


def _size_text(value: int) -> str:
    """'256M' for 256 MiB: the inverse of ``_size`` for whole units."""
    for unit, scale in (("G", 1 << 30), ("M", MiB), ("K", 1 << 10)):
        if value and value % scale == 0:
            return f"{value // scale}{unit}"
    return str(value)


# ------------------------------------------------------------------- flags from options dataclasses


def field_docs(cls: type) -> dict[str, str]:
    """The ``#:`` comment lines right above each field of a dataclass, joined: the field's documentation."""
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        lines = inspect.getsourcelines(cls)[0]
    except (OSError, TypeError):  # no source shipped: flags without help text
        return {}
    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        text = line.strip()
        if text.startswith("#:"):
            pending.append(text[2:].strip())
            continue
        match = re.match(r"(\w+)\s*:", text)
        if match and match.group(1) in names and pending:
            docs[match.group(1)] = " ".join(pending)
        pending = []
    return docs


def _field_type(hint: Any) -> Any:
    """``X`` from ``X | None``."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 else hint


def _parse_type(cls: type, name: str, kind: Any) -> Any:
    """The argparse ``type`` of a field: sizes for ``*_bytes``, comma lists for ``tuple[int, ...]``."""
    if kind is int and name.endswith("_bytes"):
        return _size
    if kind in (int, float, str, Path):
        return kind
    if typing.get_origin(kind) is tuple and typing.get_args(kind) == (int, ...):
        return _layers
    raise TypeError(
        f"{cls.__name__}.{name}: no command-line form for {kind}; give the field metadata=flag(cli=False) "
        "or a type the command line parses (int, float, str, Path, bool, tuple[int, ...])"
    )


def _help(doc: str, default: Any, name: str) -> str:
    """The field's documentation as help text, with its default."""
    text = re.sub(r"``([^`]*)``", r"\1", doc).rstrip(".")
    text = text[:1].lower() + text[1:] if text[1:2].islower() else text
    if default is True:
        return f"{text} (default: on)"
    if default is None or default is False or default is dataclasses.MISSING or isinstance(default, list):
        return text
    if name.endswith("_bytes"):
        default = _size_text(default)
    elif isinstance(default, tuple):
        default = ",".join(map(str, default))
    return f"{text} (default: {default})".replace("%", "%%")


def add_option_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One command-line argument per field of an options dataclass.

    ``--field-name`` (or ``flag(name=...)``, ``flag(positional=...)``), its ``#:`` comment as the
    help text, parsed by its type; a boolean that defaults to true gets ``--name``/``--no-name``.
    A field without a default is required. List fields are argument lists handed on, not flags.
    Unset flags stay out of the namespace, so the dataclass's own defaults apply
    (:func:`options_from`).
    """
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("cli", {})
        kind = _field_type(hints[f.name])
        if not meta.get("cli", True) or typing.get_origin(kind) is list:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kwargs: dict[str, Any] = {"help": _help(docs.get(f.name, ""), default, f.name)}
        if meta.get("choices"):
            kwargs["choices"] = list(meta["choices"])
        if meta.get("positional"):
            parser.add_argument(f.name, metavar=meta["positional"], type=_parse_type(cls, f.name, kind), **kwargs)
            continue
        name = meta.get("name") or "--" + f.name.replace("_", "-")
        kwargs.update(dest=f.name, default=argparse.SUPPRESS, required=default is dataclasses.MISSING)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kwargs["type"] = _parsed(meta["parse"]) if meta.get("parse") else _parse_type(cls, f.name, kind)
            if "choices" not in kwargs:
                kwargs["metavar"] = name[2:].upper().replace("-", "_")
        parser.add_argument(name, **kwargs)


def options_from(cls: type, args: argparse.Namespace) -> Any:
    """The options dataclass from the parsed flags (fields not given keep their defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in vars(args).items() if name in names})


class _Renamed(argparse.Action):
    """An old spelling of a flag: still accepted, with a note naming the one to use."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        print(f"{parser.prog}: {option} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _add_renamed(parser: argparse.ArgumentParser, command: str) -> None:
    """The old spellings of a command's flags, hidden from --help."""
    actions = {option: action for action in parser._actions for option in action.option_strings}
    for old, new in RENAMED.get(command, {}).items():
        target = actions[new]
        parser.add_argument(
            old,
            dest=target.dest,
            type=target.type,
            action=_Renamed,
            new=new,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


KEYS_HELP = (
    "tcp://: key directory with this side's CURVE key pair (`hscapture keys` makes it) "
    "(default: $HSCAPTURE_KEYS or ~/.config/hscapture/keys)"
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line; with ``only``, the flags of that command alone (the others keep their names and help)."""

    def flags(sub: argparse.ArgumentParser, command: str) -> None:
        if only is None or only == command:
            add_option_flags(sub, options_class(command))
            _add_renamed(sub, command)

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
    flags(ext, "extract")
    ext.add_argument("sglang_args", nargs=argparse.REMAINDER, help="sglang, vllm: -- then more engine arguments")

    con = commands.add_parser(
        "consume",
        help="attach to a producer and write what it captures to a store",
        description="The consumer process: attaches to a producer (also one started later or restarted), copies "
        "ring slots out, releases them, and writes shards. Stops cleanly on Ctrl-C.",
    )
    flags(con, "consume")
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
        help="run an SGLang or vLLM server with capture on, and a consumer writing the store",
        description="Starts the engine's OpenAI-compatible server (`python -m sglang.launch_server ARGS`, or with "
        "--engine vllm `vllm serve ARGS`) with the hscapture plugin capturing the EAGLE-3 states of every request, "
        "and a consumer writing them to --out. Ctrl-C stops both; the store is finished and requests still in "
        "flight are marked incomplete.",
        usage="hscapture serve --out DIR [options] -- --model-path MODEL [sglang server args]\n"
        "       hscapture serve --engine vllm --out DIR [options] -- MODEL [vllm serve args]",
    )
    flags(srv, "serve")
    srv.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then the engine's server arguments")

    ver = commands.add_parser(
        "verify",
        help="check every index line and every shard of a store against its checksums",
        description="Checks meta.json and every index line (its checksum, its fields), reads every shard the index "
        "lists and compares its bytes with the CRC-32 checksums of its index line (whole file and per tensor), "
        "checks that each request's spans name its own rows, and finds shard files no line lists (lost index "
        "lines). A directory of parts, or several DIRs, is verified part by part and as one dataset (no key in two "
        "parts, no part missing). Exit status: 0 everything verifies, 1 something is corrupted, missing or lost (or "
        "a key is in two parts), 2 DIR is not a store.",
    )
    ver.add_argument("dir", type=Path, nargs="+", metavar="DIR", help="store directory, or a directory of parts")
    ver.add_argument("--json", action="store_true", help="print the report as JSON")
    ver.add_argument("--jobs", type=int, default=4, help="shards checked in parallel (default 4)")
    ver.add_argument(
        "--repair",
        action="store_true",
        help="first rebuild the index from the shards' own metadata: drop damaged lines, list unlisted shards, "
        "record requests whose lines were lost as incomplete (the old index is kept beside it); then verify",
    )

    exp = commands.add_parser(
        "export",
        help="write a store as a drafter trainer's training files (SpecForge or speculators)",
        description="specforge: rows_*/data_{i}.ckpt as SpecForge's offline EAGLE-3 path reads them (three aux "
        "layers concatenated, post-norm last state). speculators: an Arrow table plus hidden_states/hs_{i}.safetensors "
        "as speculators' ArrowDataset reads them (aux layers then layer L, before the final norm). Samples with an "
        "empty loss mask are left out. Resumable: a rerun writes only what is missing.",
    )
    flags(exp, "export")

    ins = commands.add_parser(
        "inspect",
        help="summarize a store: requests, tokens, tensors, bytes, drops, incomplete samples, runs",
        description="Reads the index and meta.json only (no shard), so it is quick on any store. A directory of "
        "parts, or several DIRs, is summarized as one dataset and part by part. Exit status 2: DIR is not a store.",
    )
    ins.add_argument("dir", type=Path, nargs="+", metavar="DIR", help="store directory, or a directory of parts")
    ins.add_argument("--json", action="store_true", help="print the summary as JSON")
    ins.add_argument("--max-listed", type=int, default=10, help="incomplete samples and runs listed (default 10)")

    key = commands.add_parser(
        "keys",
        help="make or show this user's CURVE key pair for tcp:// endpoints; admit another user's consumer",
        description="tcp:// endpoints are authenticated with ZeroMQ's CURVE: a producer admits only consumers "
        "whose public key its key directory lists (its own id.key, and allowed/*.key). Without options: make the "
        "key pair if there is none, and print where the public key is. Give that file to the other side: a "
        "producer admits it with --allow; a consumer names it with --producer-key.",
    )
    key.add_argument("--keys", type=Path, help=KEYS_HELP)
    key.add_argument("--allow", type=Path, metavar="FILE", help="admit the consumer public key in FILE (its id.key)")

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
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command if command in OPTIONS else None).parse_args(argv)
    quiet = args.command in ("extract", "export", "inspect", "keys") or getattr(args, "quiet", False)
    level = logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command in ("export", "inspect", "verify"):  # they print a set's problems themselves
        logging.getLogger("hscapture.store.collection").setLevel(logging.ERROR)
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
        if args.command == "keys":
            return _keys(args)
        return _consume(args)
    except (ValueError, TypeError) as exc:
        print(f"hscapture {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except HSCaptureError as exc:
        print(f"hscapture {args.command}: failed: {exc}", file=sys.stderr)
        return 1


def _extract(args: argparse.Namespace) -> int:
    from hscapture.extract import extract

    args.sglang_args = _after_dashes(args.sglang_args)
    options: ExtractOptions = options_from(options_class("extract"), args)
    terminated = _sigterm_as_ctrl_c()
    try:
        summary = extract(options)
    except KeyboardInterrupt:
        if terminated:
            print(f"\nstopped (SIGTERM); run the same command again to resume into {options.out}", file=sys.stderr)
            return 143
        print(f"\ninterrupted; run the same command again to resume into {options.out}", file=sys.stderr)
        return 130
    store = summary.store
    if not store:
        split = f" in part {options.shard}" if options.shard is not None else ""
        print(f"nothing to capture: {options.data or 'the demo data'} has no samples{split}", file=sys.stderr)
        return 1
    print(extract_report(options, summary))
    if summary.cut:
        from hscapture.inspection import counted

        print(
            f"warning: {counted(summary.cut, 'sample')} longer than {summary.limit_from} cut to {summary.limit} tokens "
            f"(the longest had {summary.longest_cut}); their later tokens are not in the store"
            + ("" if summary.limit_from.startswith("--max-length") else "; --max-length sets a lower limit"),
            file=sys.stderr,
        )
    if summary.empty_loss_mask:
        print(
            f"warning: {summary.empty_loss_mask} of the {summary.samples} samples captured have an empty loss mask "
            "(no assistant turn: nothing in them is trained on); they are stored complete, and hscapture export "
            "leaves them out unless --keep-empty-loss-mask",
            file=sys.stderr,
        )
    return 0


def extract_report(options: ExtractOptions, summary: ExtractSummary) -> str:
    """What ``extract`` did, where its store is and how to read it (``--out``: every part there, as one)."""
    from hscapture.inspection import counted

    store = summary.store
    where = summary.out or options.out
    parts = f" ({store['parts']} parts)" if "parts" in store else ""
    return (
        f"captured {summary.samples} samples, {summary.tokens} tokens in {summary.seconds:.1f} s "
        f"({summary.tokens_per_s:.0f} tok/s); {summary.skipped} were already there\n"
        f"{_preparation(summary)}"
        f"store {where}{parts}: {store['complete']} complete samples, {store['incomplete']} incomplete, "
        f"{store['rows']} rows, {counted(store['shards'], 'shard')}, {store['bytes'] / MiB:.1f} MiB, "
        f"{store['rows_dropped']} rows dropped\n"
        f"read it: python -c \"from hscapture import open_store; s = open_store('{options.out}'); "
        'print(s.get(s.keys()[0]))"' + _export_hint(options.out)
    )


def _export_hint(out: Path) -> str:
    """The ``hscapture export`` commands for the trainers the store at ``out`` feeds ('' if it feeds none)."""
    from hscapture.inspection import export_formats
    from hscapture.store.collection import open_store

    try:
        formats = export_formats(open_store(out))
    except (ValueError, HSCaptureError):
        return ""
    return "".join(
        f"\nexport it: hscapture export {out} OUT --format {name}{' ' + v['flags'] if v['flags'] else ''}"
        for name, v in formats.items()
        if v["ok"]
    )


def _sigterm_as_ctrl_c() -> list[int]:
    """Make SIGTERM stop this command as Ctrl-C does (KeyboardInterrupt: the store finished, the ring and sockets
    removed), where it killed it and left them for the next run to reclaim. Returns a list that holds the signal
    once it came; a second SIGTERM while the command cleans up is ignored (a supervisor escalates to SIGKILL)."""
    came: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if came:
            return
        came.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    return came


def _preparation(summary: ExtractSummary) -> str:
    """What came before the capture (model load, data), per job when several ran side by side."""
    if not summary.jobs:
        return f"before it: {_before(summary)}\n" if summary.samples else "nothing left to capture: no model loaded\n"
    lines = []
    for job in summary.jobs:
        if job.samples:
            lines.append(
                f"job {job.out.name if job.out else '?'}: {job.tokens} tokens in {job.seconds:.1f} s from "
                f"+{job.started_at - summary.started_at:.1f} s ({job.tokens_per_s:.0f} tok/s); before it: "
                f"{_before(job)}\n"
            )
    return "".join(lines)


def _before(summary: ExtractSummary) -> str:
    return (
        f"model loaded in {summary.load_seconds:.1f} s, data read in {summary.data_seconds:.1f} s, then "
        f"{summary.startup_seconds:.1f} s waiting for the consumer to attach"
    )


def _serve(args: argparse.Namespace) -> int:
    from hscapture.serve import serve

    return serve(options_from(options_class("serve"), args), _after_dashes(args.engine_args))


def _keys(args: argparse.Namespace) -> int:
    from hscapture.keys import PUBLIC, allow_key, default_keys_dir, ensure_keys, fingerprint

    folder = args.keys or default_keys_dir()
    if args.allow is not None:
        target = allow_key(args.allow, folder)
        print(f"admitted the consumer key in {args.allow} as {target}; producers using {folder} accept it from now on")
        return 0
    pair = ensure_keys(folder)
    print(
        f"key directory {folder} (private)\n"
        f"public key    {folder / PUBLIC} (fingerprint {fingerprint(pair.public)}): {pair.public.decode()}\n"
        "A producer admits consumers holding this key pair, and those whose id.key you admit with "
        "`hscapture keys --allow FILE`.\nA consumer of another user or host needs a copy of this id.key: "
        "`hscapture consume --endpoint tcp://HOST:PORT --producer-key COPY`."
    )
    return 0


def _after_dashes(rest: list[str]) -> list[str]:
    """The engine's own arguments: what follows ``--`` on the command line."""
    return rest[1:] if rest[:1] == ["--"] else rest


def _bench(suite_args: list[str]) -> int:
    """Run ``benchmarks/run.py`` of the source checkout in its own process: the suites are not part of the package."""
    root = Path(__file__).resolve().parent.parent
    script = root / "benchmarks" / "run.py"
    if not script.is_file():
        raise ValueError(
            f"no benchmarks/run.py beside {root / 'hscapture'}: the suites ship with the source checkout, not the "
            "package; git clone the repository, pip install -e '.[bench]' there, and run hscapture bench from it"
        )
    environment = {**os.environ, "HSCAPTURE_BENCH_PROG": "hscapture bench"}  # its usage lines name this command
    return subprocess.call([sys.executable, str(script), *(suite_args or ["--help"])], env=environment)


def _consume(args: argparse.Namespace) -> int:
    from hscapture.cuda_runtime import NVIDIA_CONTROL, start_cuda

    if getattr(args, "store_dtype", None) is None and os.path.exists(NVIDIA_CONTROL):  # CUDA starts as the rest imports
        import threading

        threading.Thread(target=start_cuda, name="hscapture-cuda-start", daemon=True).start()
    # A waiting thread takes the GIL from a busy one after 1 ms, not 5: the main thread's copies and releases,
    # each a CUDA or socket call that lets go of it, wait less for writer threads working in Python.
    sys.setswitchinterval(0.001)
    from hscapture.consumer import Consumer
    from hscapture.consumer.metrics import MetricsReporter

    # No model here: the writer threads are the parallelism (fp8 quantization), torch's kernels get one thread.
    # torch is imported only for fp8 rows quantized by torch (on a CUDA ring's GPU, or on a host without numba):
    # then with OMP_NUM_THREADS as set here.
    torch = sys.modules.get("torch")
    if torch is not None:  # imported already (this command run in-process)
        torch.set_num_threads(1)
    else:
        os.environ["OMP_NUM_THREADS"] = "1"

    config: ConsumerConfig = options_from(ConsumerConfig, args)
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
        print(
            f"consuming {config.endpoint} into {config.out_dir}; Ctrl-C finishes the store and exits", file=sys.stderr
        )
    try:
        stats = consumer.run()
    finally:
        reporter.close()
    if not args.quiet:
        print(f"done: {stats.to_dict()}", file=sys.stderr)
        if config.out_dir is not None:
            print(
                f"store {config.out_dir}: read it with hscapture.open_store('{config.out_dir}'); "
                f"hscapture inspect {config.out_dir} summarizes it",
                file=sys.stderr,
            )
    return 1 if config.exit_on_eos and consumer.last_failure else 0  # its run ended in a capture failure (logged)


def _verify(args: argparse.Namespace) -> int:
    import json
    from collections.abc import Iterable

    from tqdm import tqdm

    from hscapture.errors import StoreError
    from hscapture.store.collection import SetReport, format_set_report, is_store, part_dirs, verify_set
    from hscapture.store.verify import ShardCheck, VerifyReport, format_report, verify_store

    def progress(checks: Iterable[ShardCheck], total: int) -> Iterable[ShardCheck]:
        show = sys.stdout.isatty() and total > 4 and not args.json  # a bar over more than a few shards
        return tqdm(checks, total=total, unit="shard", desc="verify", disable=not show, leave=False)

    report: VerifyReport | SetReport
    try:
        if args.repair:
            from hscapture.store.repair import format_repair, repair_store

            parts = (part for given in args.dir for part in ([given] if is_store(given) else part_dirs(given)))
            for path in (part for part in parts if is_store(part)):
                repaired = repair_store(path)
                print(format_repair(repaired), file=sys.stderr if args.json else sys.stdout, flush=True)
        if len(args.dir) == 1 and (is_store(args.dir[0]) or not part_dirs(args.dir[0])):  # else its own error
            report = verify_store(args.dir[0], jobs=args.jobs, progress=progress)
        else:
            report = verify_set(args.dir, jobs=args.jobs, progress=progress)
    except StoreError as exc:
        print(f"hscapture verify: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nhscapture verify: interrupted", file=sys.stderr)
        return 130
    try:
        text = format_report(report) if isinstance(report, VerifyReport) else format_set_report(report)
        print(json.dumps(report.to_dict(), indent=2) if args.json else text, flush=True)
    except BrokenPipeError:  # piped into head: the verdict is still the exit status
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if report.ok else 1


def _export(args: argparse.Namespace) -> int:
    from hscapture.export import export

    options: ExportOptions = options_from(options_class("export"), args)
    try:
        summary = export(options)
    except KeyboardInterrupt:
        print(f"\ninterrupted; run the same command again to finish {options.out}", file=sys.stderr)
        return 130
    lines = [
        f"{options.format}: wrote {summary.written} samples, {summary.kept} were already there; {options.out} holds "
        f"{summary.total} (aux {', '.join(summary.aux)}; final {summary.final})"
    ]
    if summary.skipped_incomplete:
        lines.append(
            f"{summary.skipped_incomplete} incomplete samples skipped "
            "(--include-incomplete exports their rows up to the first gap)"
        )
    if summary.skipped_empty_loss_mask:
        lines.append(
            f"{summary.skipped_empty_loss_mask} samples with an empty loss mask left out, nothing in them is trained "
            "on (--keep-empty-loss-mask exports them)"
        )
    if summary.empty_loss_mask:
        lines.append(
            f"warning: {summary.empty_loss_mask} samples have an empty loss mask (nothing in them is trained on)"
        )
    lines.extend(f"warning: {options.store}: {problem}" for problem in summary.problems)
    lines.append(TRAIN_ON[options.format].format(out=options.out))
    print("\n".join(lines))
    if not summary.damaged:
        return 0
    for key, why in summary.damaged[:SHOW_DAMAGED]:
        print(f"hscapture export: skipped {key!r}: {why}", file=sys.stderr)
    more = len(summary.damaged) - SHOW_DAMAGED
    print(
        f"hscapture export: {len(summary.damaged)} damaged samples skipped{f' ({more} not shown)' if more > 0 else ''}"
        f", the rest written; hscapture verify {options.store} lists what is damaged",
        file=sys.stderr,
    )
    return 1


#: How each trainer reads an export (the last line ``hscapture export`` prints).
TRAIN_ON = {
    "specforge": "train on it: SpecForge's offline EAGLE-3 training, data.hidden_states_path: {out}",
    "speculators": "train on it: speculators' train.py --data-path {out}",
}


def _inspect(args: argparse.Namespace) -> int:
    import json

    from hscapture.errors import StoreError
    from hscapture.inspection import format_inspection, inspect_store

    try:
        report = inspect_store(args.dir[0] if len(args.dir) == 1 else args.dir, max_listed=args.max_listed)
    except StoreError as exc:
        print(f"hscapture inspect: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_inspection(report))
    return 0
