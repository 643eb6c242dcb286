"""Benchmark suites, one command each: ``python benchmarks/run.py SUITE [options]``.

Each suite writes ``benchmarks/results/<name>.json`` (command, commit, versions, device,
settings, results, goals met or missed), replaces its table in ``benchmarks/README.md`` between
``<!-- bench:<name>:begin -->`` and ``<!-- bench:<name>:end -->``, and draws
``results/<name>.png`` (tok/s per variant; needs ``pip install 'hscapture[bench]'``). A suite
that cannot run on this machine says why and exits 0 without writing anything.
``--from-json FILE`` redraws the table and chart from a record (e.g. one made on the GPU host).
A smoke run (``--tiny``) writes into a fresh temporary directory and leaves the README alone, unless
``--results-dir`` or ``--readme`` name where its record and table go.

A suite is a module exposing ``SUITE`` (a :class:`benchmarks.report.SuiteSpec`); adding one is
a module and a line in :data:`SUITES`. ``python -m hscapture bench SUITE`` is the same command.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/run.py` puts benchmarks/ first, not the repo
    sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from hscapture.config import ensure_writable_dir  # noqa: E402

#: Suite name -> module exposing ``SUITE``.
SUITES: dict[str, str] = {
    "consumer-start": "benchmarks.consumer_start",
    "extract": "benchmarks.extract_speed",
    "gpu": "benchmarks.gpu_serving",
    "parallel": "benchmarks.parallel_extract",
    "radix": "benchmarks.radix",
    "read": "benchmarks.read_verify",
    "sglang": "benchmarks.sglang_serving",
    "store": "benchmarks.store_rate",
    "vllm": "benchmarks.vllm_serving",
    "wide": "benchmarks.wide",
}


#: The command's name in usage lines: ``hscapture bench`` runs this script under its own name.
PROG_ENV = "HSCAPTURE_BENCH_PROG"


def build_parser() -> argparse.ArgumentParser:
    prog = os.environ.get(PROG_ENV) or "python benchmarks/run.py"
    parser = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").splitlines()[0])
    suites = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, module in SUITES.items():
        spec: report.SuiteSpec = importlib.import_module(module).SUITE
        sub = suites.add_parser(name, help=spec.description, description=spec.description)
        sub.add_argument(
            "--results-dir",
            type=Path,
            help="where the JSON and PNG go (default: benchmarks/results; --tiny: a new temp dir)",
        )
        sub.add_argument(
            "--readme", type=Path, help="README whose table is replaced (default: benchmarks/README.md; --tiny: none)"
        )
        sub.add_argument("--from-json", type=Path, help="redraw the table and chart of this record; measure nothing")
        spec.add_arguments(sub)
    return parser


def destinations(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """Where a run's record goes and which README's table it replaces (None: no README).

    A smoke run (``--tiny``) is offered as runnable anywhere: it must not rewrite the checkout's committed
    results and tables, so unless told otherwise it writes into a fresh temporary directory and no README.
    """
    smoke = bool(getattr(args, "tiny", False))
    results = args.results_dir
    if results is None:
        results = Path(tempfile.mkdtemp(prefix=f"hscapture-bench-{args.suite}-")) if smoke else report.RESULTS
    readme = args.readme if args.readme is not None or smoke else report.README
    return results, readme


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.results_dir, args.readme = destinations(args)
    spec: report.SuiteSpec = importlib.import_module(SUITES[args.suite]).SUITE
    if args.from_json:
        record = json.loads(args.from_json.read_text())
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the suite's cleanup on SIGTERM too
        started = time.monotonic()

        def checkpoint(outcome: report.Outcome) -> None:
            """After each section: a partial record, so a run cut short still leaves its figures."""
            partial = report.build_record(args.suite, outcome, argv, time.monotonic() - started, complete=False)
            report.write_json(args.results_dir / f"{outcome.name}.json", partial)

        work_dir = getattr(args, "work_dir", None)
        made = work_dir is not None and not work_dir.exists()
        try:
            if work_dir is not None:  # every suite's, made (private) or refused up front
                ensure_writable_dir(work_dir, "--work-dir")
            outcome = spec.run(args, checkpoint)
        except (report.SuiteSkipped, ValueError) as exc:
            if made:  # a refusal leaves nothing it created (the work dir, while nothing is in it)
                with contextlib.suppress(OSError):
                    work_dir.rmdir()
            if isinstance(exc, report.SuiteSkipped):
                print(f"{args.suite} suite skipped: {exc}", file=sys.stderr)
                return 0
            print(f"{args.suite} suite: error: {exc}", file=sys.stderr)
            return 2
        record = report.build_record(args.suite, outcome, argv, time.monotonic() - started, complete=True)
        report.write_json(args.results_dir / f"{outcome.name}.json", record)
        print(f"wrote {args.results_dir / (outcome.name + '.json')}")
    table = spec.table(record)
    print(table)
    title = f"{record['name']}: {record['device'].get('name', '?')}, commit {record['commit'][:12]}"
    chart = report.draw_chart(args.results_dir / f"{record['name']}.png", title, spec.tok_per_s(record))
    if chart is not None:
        print(f"wrote {chart}")
    if args.readme is None:
        print(f"a smoke run: {report.README} left as it is (--readme FILE writes its table there)")
    elif report.update_readme(args.readme, record["name"], report.readme_block(record, table, chart)):
        print(f"updated the {record['name']} table in {args.readme}")
    else:
        begin, end = report.markers(record["name"])
        print(f"{args.readme} has no {begin} ... {end} markers; add them where the table belongs", file=sys.stderr)
    failed = [name for name, data in record["results"].items() if isinstance(data, dict) and "error" in data]
    if failed:
        print(f"sections that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
