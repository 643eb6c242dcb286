"""The command line: flags made from the options dataclasses, old spellings, and `hscapture bench` as a subprocess."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hscapture.cli import add_option_flags, build_parser, field_docs, options_from
from hscapture.config import ConsumerConfig, flag
from hscapture.export import ExportOptions
from hscapture.extract import ExtractOptions
from hscapture.serve import ServeOptions

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"extract": ExtractOptions, "serve": ServeOptions, "consume": ConsumerConfig, "export": ExportOptions}


def subparser(command: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_options_field_is_a_documented_flag(command: str) -> None:
    """Each field of the command's dataclass is one of its arguments, with the field's ``#:`` comment as help."""
    cls = COMMANDS[command]
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    arguments = {a.dest: a for a in subparser(command)._actions if a.help != argparse.SUPPRESS}
    for f in dataclasses.fields(cls):
        assert docs.get(f.name), f"{cls.__name__}.{f.name} has no #: comment to document its flag"
        if typing.get_origin(hints[f.name]) is list:  # argument lists handed on: none, or all after `--`
            assert f.name not in arguments or arguments[f.name].nargs == argparse.REMAINDER
            continue
        argument = arguments[f.name]
        first_words = docs[f.name].replace("``", "").rstrip(".").split()[1:4]
        assert " ".join(first_words) in " ".join(argument.help.split()), (f.name, argument.help)
        assert argument.required == (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def test_unset_flags_keep_the_dataclass_defaults_and_set_ones_reach_their_field() -> None:
    parser = build_parser()
    args = parser.parse_args(["extract", "--out", "store"])
    assert options_from(ExtractOptions, args) == ExtractOptions(out=Path("store"))
    args = parser.parse_args(
        ["extract", "--out", "s", "--layers", "2,4,5", "--no-last", "--shard-bytes", "32K", "--store-dtype", "fp8"]
    )
    options = options_from(ExtractOptions, args)
    assert (options.layers, options.capture_last, options.shard_bytes, options.store_dtype) == (
        (2, 4, 5),
        False,
        32 << 10,
        "fp8",
    )
    args = parser.parse_args(["export", "store", "out", "--format", "specforge", "--any-aux-count", "--no-progress"])
    assert options_from(ExportOptions, args) == ExportOptions(
        Path("store"), Path("out"), "specforge", any_aux_count=True, progress=False
    )
    args = parser.parse_args(["consume", "--discard", "--stats-s", "2"])
    assert options_from(ConsumerConfig, args) == ConsumerConfig(out_dir=None, discard=True) and args.stats_s == 2
    args = parser.parse_args(["serve", "--out", "s", "--policy", "block", "--", "--model-path", "m"])
    assert options_from(ServeOptions, args) == ServeOptions(Path("s"), policy="block")
    assert args.engine_args == ["--", "--model-path", "m"]
    args = parser.parse_args(["serve", "--engine", "vllm", "--out", "s", "--", "m", "--port", "1"])
    assert options_from(ServeOptions, args) == ServeOptions(Path("s"), engine="vllm")


def test_a_new_field_becomes_a_flag_without_touching_the_cli() -> None:
    """What another module adds to its options dataclass: parsed by type, documented by its comment."""

    @dataclass
    class Options:
        #: Where it goes.
        out: Path = field(metadata=flag(positional="OUT"))
        #: Bytes per thing.
        thing_bytes: int = 1 << 20
        #: Some ids.
        ids: tuple[int, ...] | None = None
        #: Use the fast path.
        fast: bool = True
        #: How loud.
        level: str = field(default="low", metadata=flag(choices=("low", "high")))
        #: Never on the command line.
        internal: int = field(default=0, metadata=flag(cli=False))
        #: Arguments handed on.
        extra: list[str] = field(default_factory=list)

    parser = argparse.ArgumentParser(prog="t")
    add_option_flags(parser, Options)
    assert options_from(Options, parser.parse_args(["o"])) == Options(Path("o"))
    args = parser.parse_args(["o", "--thing-bytes", "2M", "--ids", "3,1", "--no-fast", "--level", "high"])
    assert options_from(Options, args) == Options(Path("o"), 2 << 20, (3, 1), False, "high")
    text = parser.format_help()
    assert "bytes per thing (default: 1M)" in text and "use the fast path (default: on)" in text
    assert "--internal" not in text and "--extra" not in text
    with pytest.raises(SystemExit):
        parser.parse_args(["o", "--level", "medium"])

    @dataclass
    class Unparsable:
        #: A mapping.
        table: dict[str, int] = field(default_factory=dict)

    with pytest.raises(TypeError, match=r"Unparsable.table: no command-line form .*metadata=flag\(cli=False\)"):
        add_option_flags(argparse.ArgumentParser(), Unparsable)


def test_one_shard_size_flag_everywhere_and_the_old_spelling_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("extract", "consume", "serve"):
        text = subparser(command).format_help()
        assert "--shard-bytes SHARD_BYTES" in text and "--shard-size" not in text, command
    args = build_parser().parse_args(["extract", "--out", "s", "--shard-size", "64K"])
    assert options_from(ExtractOptions, args).shard_bytes == 64 << 10
    assert "--shard-size is deprecated; use --shard-bytes" in capsys.readouterr().err


def test_bench_runs_the_checkouts_run_py_in_its_own_process() -> None:
    """In its own process, and its usage lines name the command the user typed (not benchmarks/run.py)."""
    probe = (
        "import sys; from hscapture.cli import main; code = main(['bench', 'gpu', '--help']); "
        "print(code, sorted(m for m in sys.modules if m.split('.')[0] == 'benchmarks'))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage: hscapture bench gpu" in done.stdout and done.stdout.strip().endswith("0 []")


def test_bench_without_a_source_checkout_says_where_the_suites_are(tmp_path: Path) -> None:
    """An installed package (no benchmarks/ beside it): a one-line error, exit 2."""
    shutil.copytree(ROOT / "hscapture", tmp_path / "hscapture")
    done = subprocess.run(
        [sys.executable, "-m", "hscapture", "bench", "gpu"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert f"no benchmarks/run.py beside {tmp_path / 'hscapture'}" in done.stderr
    assert "ship with the source checkout" in done.stderr and "git clone" in done.stderr


def test_extract_report_counts_shards_and_reads_the_out_folder() -> None:
    """``1 shard``, not ``1 shards``; after ``--shard 0/2`` the read-it line opens --out (every part there, as
    one dataset), not the part's own folder."""
    from hscapture.cli import extract_report
    from hscapture.extract import ExtractSummary

    store = {"complete": 3, "incomplete": 0, "rows": 40, "shards": 1, "bytes": 1 << 20, "rows_dropped": 0}
    summary = ExtractSummary(3, 40, 1.0, 0, store, out=Path("/data/hs/part-0-of-2"))
    text = extract_report(ExtractOptions(out=Path("/data/hs"), shard="0/2"), summary)
    assert "store /data/hs/part-0-of-2: 3 complete samples" in text and "40 rows, 1 shard, 1.0 MiB" in text
    assert "open_store('/data/hs')" in text and "open_store('/data/hs/part-0-of-2')" not in text
    assert ", 2 shards," in extract_report(
        ExtractOptions(out=Path("/s")), ExtractSummary(3, 40, 1.0, 0, {**store, "shards": 2})
    )
