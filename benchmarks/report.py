"""What every benchmark suite leaves behind: a JSON record, its table in benchmarks/README.md, a PNG chart.

A suite (see ``benchmarks/run.py``) measures and returns an :class:`Outcome`; this module adds
what makes a figure checkable later (the command, the commit it measured, package versions),
writes ``results/<name>.json``, replaces the suite's table in the README between its markers,
and draws tok/s per variant. The table and the chart are made from the JSON alone, so
``run.py SUITE --from-json FILE`` redraws them for a record made on another machine.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
#: Distributions whose versions go into every record (those installed).
PACKAGES = ("hscapture", "torch", "numpy", "transformers", "cupy-cuda13x", "cupy-cuda12x", "pyzmq", "msgspec")


class SuiteSkipped(Exception):
    """The suite cannot run here (e.g. no GPU); the message says why and what to do instead."""


@dataclass
class Outcome:
    """What a suite measured. ``name`` names the result files and the README markers."""

    name: str
    device: dict[str, Any]
    settings: dict[str, Any]
    results: dict[str, Any]
    goals: dict[str, Any] = field(default_factory=dict)


@dataclass
class SuiteSpec:
    """A named suite: how to add its options, run it, and show a record of it."""

    name: str
    description: str
    add_arguments: Callable[[Any], None]
    run: Callable[[Any, Callable[[Outcome], None]], Outcome]
    table: Callable[[dict[str, Any]], str]
    #: ``{workload: {variant: tok/s}}`` from a record, for the chart.
    tok_per_s: Callable[[dict[str, Any]], dict[str, dict[str, float]]]


def device_of(device: Any) -> tuple[str, str]:
    """A torch device's name, and the short tag result names carry (``h200``, ``cpu``)."""
    if device.type != "cuda":
        return f"CPU ({os.cpu_count()} cores)", "cpu"
    import torch

    torch.cuda.init()
    name = torch.cuda.get_device_name(device)
    return name, re.sub(r"[^a-z0-9]", "", name.split()[-1].lower()) or "gpu"


def run_sections(
    suite: str,
    outcome: Outcome,
    sections: list[tuple[str, Callable[[], dict[str, Any]]]],
    after: Callable[[Outcome], None],
    checkpoint: Callable[[Outcome], None],
) -> None:
    """Measure each section in turn into ``outcome.results``; one that fails keeps its error, not the others' figures
    from being written. ``after`` (ratios, goals) and ``checkpoint`` (a partial record) run after each."""
    for section, measure in sections:
        print(f"[{suite} suite] {section} ...", flush=True)
        try:
            outcome.results[section] = measure()
        except Exception as exc:
            outcome.results[section] = {"error": str(exc)[-2000:]}
        after(outcome)
        checkpoint(outcome)


def extract_bars(results: dict[str, Any], off: float, title: str) -> dict[str, dict[str, float]]:
    """The chart of extraction sections (``extract-*``) against a baseline's tok/s (``off``)."""
    bars = {"off": off}
    bars.update({k[len("extract-") :]: v["tok_per_s"] for k, v in results.items() if k.startswith("extract-")
                 and "tok_per_s" in v})  # fmt: skip
    return {title: bars}


def commit() -> str:
    """The commit measured: ``HSCAPTURE_COMMIT`` (a copy without git, e.g. the GPU machine), else git's HEAD."""
    given = os.environ.get("HSCAPTURE_COMMIT", "").strip()
    if given:
        return given
    return _git("rev-parse", "HEAD") or "unknown"


def dirty() -> bool | None:
    """Whether the code differs from the commit (None where there is no git).

    The results directory and README are left out: a suite rewrites its own record there while it runs.
    """
    if os.environ.get("HSCAPTURE_COMMIT"):
        return None
    status = _git(
        "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results", ":!benchmarks/README.md"
    )
    return None if status is None else bool(status)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "platform": platform.platform()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def build_record(suite: str, outcome: Outcome, argv: list[str], seconds: float, complete: bool) -> dict[str, Any]:
    return {
        "suite": suite,
        "name": outcome.name,
        "command": shlex.join(["python", "benchmarks/run.py", *argv]),
        "commit": commit(),
        "dirty": dirty(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "complete": complete,
        "seconds": round(seconds, 1),
        "versions": versions(),
        "device": outcome.device,
        "settings": outcome.settings,
        "results": outcome.results,
        "goals": outcome.goals,
    }


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def readme_block(record: dict[str, Any], table: str, chart: Path | None) -> str:
    """The text between a suite's README markers: provenance line, table, chart link."""
    head = (
        f"Commit `{record['commit'][:12]}`, {record['date']}, {record['device'].get('name', '?')}; "
        f"command `{record['command']}`; result `results/{record['name']}.json`."
    )
    image = f"\n\n![tok/s per variant](results/{chart.name})" if chart is not None else ""
    return f"{head}\n\n{table.strip()}{image}\n"


def update_readme(readme: Path, name: str, block: str) -> bool:
    """Replace the text between ``name``'s markers; False (README untouched) when they are missing."""
    begin, end = markers(name)
    text = readme.read_text() if readme.exists() else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        return False
    readme.write_text(pattern.sub(lambda _: f"{begin}\n{block}{end}", text, count=1))
    return True


def draw_chart(path: Path, title: str, groups: dict[str, dict[str, float]]) -> Path | None:
    """One bar panel per workload: tok/s per variant, each bar labelled with its ratio to ``off``.

    Returns None (and says so) when matplotlib is not installed: ``pip install 'hscapture[bench]'``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chart skipped: matplotlib is not installed (pip install 'hscapture[bench]')", file=sys.stderr)
        return None
    panels = [(workload, bars) for workload, bars in groups.items() if bars]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, (workload, bars) in zip(axes[0], panels):
        names = list(bars)
        values = [bars[n] for n in names]
        ax.bar(range(len(names)), values, color=[colors[i % len(colors)] for i in range(len(names))])
        off = bars.get("off")
        for i, value in enumerate(values):
            label = f"{value / off:.3f}" if off else f"{value:.0f}"
            ax.annotate(label, (i, value), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(workload, fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    axes[0][0].set_ylabel("tok/s (label: ratio to off)", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
