"""The package's layout keeps the README's architecture: every module has a tier and is listed under it there, a module
imports only from tiers below its own or from its own group, and the named boundaries hold (readers import no writer,
ring or wire; the consumer knows no model; the store no ring or wire). Read from the source, no import runs."""

from __future__ import annotations

import ast
import fnmatch
import graphlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hscapture"

#: Tier (top to bottom) -> group -> module patterns. A module may import any module of a lower tier, and modules of
#: its own group; nothing else.
TIERS: list[tuple[str, dict[str, list[str]]]] = [
    ("commands", {"cli": ["hscapture.cli", "hscapture.__main__"]}),
    (
        "jobs",
        {
            "extract": ["hscapture.extract", "hscapture.parallel", "hscapture.preflight", "hscapture.leftovers"],
            "serve": ["hscapture.serve"],
        },
    ),
    (
        "engines",
        {
            "integrations": ["hscapture.integrations"],
            "hf": ["hscapture.integrations.hf"],
            "sglang": ["hscapture.integrations.sglang*"],
            "vllm": ["hscapture.integrations.vllm*"],
        },
    ),
    ("common", {"common": ["hscapture.integrations.engines"]}),
    (
        "sides",
        {
            "producer": ["hscapture.producer*"],
            "consumer": ["hscapture.consumer*"],
            "readers": [
                "hscapture.store.reader",
                "hscapture.store.collection",
                "hscapture.store.verify",
                "hscapture.export",
                "hscapture.dataset",
                "hscapture.inspection",
            ],
        },
    ),
    (
        "parts",
        {
            "ring": ["hscapture.ring*"],
            "store": ["hscapture.store*"],
            "wire": ["hscapture.protocol", "hscapture.transport", "hscapture.keys"],
        },
    ),
    (
        "base",
        {
            "base": [
                "hscapture",
                "hscapture.config",
                "hscapture.errors",
                "hscapture.ownership",
                "hscapture.fp8",
                "hscapture.fp8_kernel",
                "hscapture.jit",
                "hscapture.cuda_kernels",
                "hscapture.cuda_runtime",
                "hscapture.data",
                "hscapture.partition",
                "hscapture.selection",
                "hscapture.tiny",
            ]
        },
    ),
]
#: Boundaries the tiers alone do not say: group -> module patterns it never imports.
NEVER = {
    "readers": [
        "hscapture.store.writer",
        "hscapture.store.shards",
        "hscapture.store.index",
        "hscapture.store.recovery",
        "hscapture.store.repair",
        "hscapture.store.prefixes",
        "hscapture.ring*",
        "hscapture.protocol",
        "hscapture.transport",
    ],
    "consumer": ["hscapture.data", "hscapture.tiny"],
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: set[str], packages: bool = False) -> set[str]:
    """The package's modules ``name`` imports (``from a import b`` counts ``a.b`` when it is a module, else ``a``;
    with ``packages``, ``a`` too: it runs first)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            ] + ([node.module] if packages else [])
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def place(name: str) -> tuple[int, str]:
    """(tier index from the bottom, group) of a module: the most specific pattern that matches it."""
    best: tuple[int, int, str] | None = None
    for index, (_, groups) in enumerate(reversed(TIERS)):
        for group, patterns in groups.items():
            for pattern in patterns:
                if fnmatch.fnmatchcase(name, pattern) and (best is None or len(pattern) > best[0]):
                    best = (len(pattern), index, group)
    assert best is not None, f"{name} has no tier: add it to TIERS here and to the README's architecture"
    return best[1], best[2]


def test_every_module_has_a_tier_and_imports_only_downwards_or_within_its_group() -> None:
    found = modules()
    wrong = []
    for name, path in sorted(found.items()):
        tier, group = place(name)
        for target in sorted(imports(name, path, set(found))):
            target_tier, target_group = place(target)
            if target_tier > tier or (target_tier == tier and target_group != group):
                wrong.append(f"{name} ({group}) imports {target} ({target_group})")
            if any(fnmatch.fnmatchcase(target, p) for p in NEVER.get(group, [])):
                wrong.append(f"{name} ({group}) imports {target}, which {group} never may")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_not_even_through_a_package() -> None:
    """``from hscapture.producer import announcer`` inside ``hscapture.producer.producer`` runs the package, which
    imports that module back: a cycle the tiers allow (one group) and ``import_layers`` counts."""
    found = modules()
    graph = {name: imports(name, path, set(found), packages=True) for name, path in found.items()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None


def test_the_readme_architecture_lists_every_module_under_its_tier() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"### Architecture\n.*?```\n(.*?)```", readme, flags=re.S)
    assert block, "README: no code block under ### Architecture"
    by_tier: dict[str, str] = {}
    current = ""
    for line in block.group(1).splitlines():
        first = line.split()[0] if line.split() else ""
        if first in {tier for tier, _ in TIERS}:
            current = first
        if current:
            by_tier[current] = by_tier.get(current, "") + " " + line
    missing = []
    for name in modules():
        if name == "hscapture":
            continue
        tier = TIERS[len(TIERS) - 1 - place(name)[0]][0]
        short = name.removeprefix("hscapture.").replace(".", "/")
        words = {word.strip("/") for word in re.findall(r"[\w/]+", by_tier.get(tier, ""))}
        if short not in words and short.rpartition("/")[2] not in words:
            missing.append(f"{short} (tier {tier})")
    assert not missing, f"README's architecture misses: {missing}"


def test_test_files_share_helpers_only_through_helper_modules() -> None:
    """A test file imports helpers from ``conftest`` or a helper module (``tests/*.py`` not named ``test_*``), never
    from another test file: running one file alone must not collect or depend on another's tests."""
    wrong = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.test_"):
                wrong.append(f"{path.name} imports {node.module}")
            if isinstance(node, ast.Import):
                wrong += [f"{path.name} imports {a.name}" for a in node.names if a.name.startswith("tests.test_")]
    assert not wrong, "\n".join(wrong)
