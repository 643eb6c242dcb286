"""The README's first-screen commands are the ones CI runs, word for word."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [block.strip() for block in blocks[:2]]


def test_readme_first_screen_has_install_run_and_test_commands() -> None:
    run, test = readme_commands()
    assert run.startswith("pip install") and "hscapture extract" in run
    assert test.startswith("pip install") and "pytest" in test
    head = (ROOT / "README.md").read_text().splitlines()[:25]
    assert run in "\n".join(head) and test in "\n".join(head), "the two commands must be on the first screen"


def test_ci_runs_the_readme_commands_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in readme_commands():
        assert command in ci, f"{command!r} is not a line of .ci/run"
