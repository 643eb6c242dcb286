"""What ``hscapture extract`` knows from the model's ``config.json`` before the model loads.

The most tokens a sample may keep (the model's context, or ``--max-length``): longer samples are cut
to it before anything is allocated. And which trainers the store it is about to write will feed: the
default capture (EAGLE-3's three aux layers and ``last``) exports to SpecForge but not to
speculators, which also needs layer ``L``; the command says so, with the flags that would make the
other, before the model loads, so that nobody learns it at export time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

from hscapture.config import eagle3_default_layers, resolve_layers


def read_config(model: Path) -> dict:
    """The model's ``config.json`` ({} if it cannot be read: the engine's own load says why)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _text_field(config: dict, name: str) -> int | None:
    """A positive int field of the (text) model's config: top level, else a wrapper's ``text_config``."""
    for part in (config, config.get("text_config"), config.get("language_config")):
        if isinstance(part, dict) and isinstance(part.get(name), int) and part[name] > 0:
            return int(part[name])
    return None


def model_context(model: Path, engine_args: Sequence[str] = ()) -> int | None:
    """The most tokens the model takes in one sequence: SGLang's ``--context-length`` if given, else its
    ``config.json``'s ``max_position_embeddings`` (of the text model, for a wrapper such as Kimi-K2.5); None if
    neither says."""
    for i, arg in enumerate(engine_args):
        value = arg.split("=", 1)[1] if arg.startswith("--context-length=") else None
        if arg == "--context-length" and i + 1 < len(engine_args):
            value = engine_args[i + 1]
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    return _text_field(read_config(model), "max_position_embeddings")


def sample_limit(max_length: int | None, model: Path, engine_args: Sequence[str] = ()) -> tuple[int | None, str]:
    """The most tokens a sample keeps (longer ones are cut to it), and what sets it: the model's context or
    ``--max-length``, whichever is lower (None: neither is known)."""
    context = model_context(model, engine_args)
    if max_length is not None and (context is None or max_length <= context):
        return max_length, f"--max-length {max_length}"
    if context is None:
        return None, ""
    return context, f"the model's context ({context} tokens)"


def _suggested(fmt: str, layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The layers that would make a store export to ``fmt``: these plus ``L`` for speculators; for SpecForge,
    EAGLE-3's three aux layers (and any at ``L``) unless exactly three below ``L`` are there."""
    if fmt == "speculators":
        return tuple(sorted({*layers, num_layers}))
    if len([k for k in layers if k < num_layers]) == 3:
        return layers
    return tuple(sorted({*eagle3_default_layers(num_layers), *(k for k in layers if k >= num_layers)}))


def capture_note(model: Path, layers: str | Sequence[int] | None, capture_last: bool, engine: str, out: Path) -> str:
    """One line: what this capture stores, and which ``hscapture export`` formats it feeds, with the flags that
    would feed the others ('' when the model's layer count is unknown or ``layers`` does not fit it: the engine's
    own checks say what is wrong)."""
    from hscapture.inspection import export_formats

    num_layers = _text_field(read_config(model), "num_hidden_layers")
    if num_layers is None:
        return ""
    try:
        chosen = tuple(sorted(set(resolve_layers(layers, num_layers)))) if layers is not None else None
    except ValueError:
        return ""
    chosen = chosen if chosen is not None else eagle3_default_layers(num_layers)
    names = [f"layer_{k}" for k in chosen] + (["last"] if capture_last else [])
    formats = export_formats(SimpleNamespace(tensor_names=names, root=out), num_layers)
    feeds = [name for name, verdict in formats.items() if verdict["ok"]]
    missing = []
    for name, verdict in formats.items():
        if verdict["ok"]:
            continue
        wanted = _suggested(name, chosen, num_layers)
        flags = f"--layers {','.join(map(str, wanted))}" + ("" if capture_last or name != "specforge" else " --last")
        if engine == "sglang" and not _sglang_captures(model, wanted):
            missing.append(f"not {name}: SGLang's capture of this model cannot give what it needs ({verdict['why']})")
        else:
            missing.append(f"for {name} too, capture with {flags}")
    what = ", ".join(names) + f" of a model of {num_layers} decoder layers"
    exports = f"exports to {' and '.join(feeds)}" if feeds else "exports to no trainer's format"
    return f"capturing {what}; the store {exports}" + "".join(f"; {text}" for text in missing)


def _sglang_captures(model: Path, layers: tuple[int, ...]) -> bool:
    """Whether SGLang's aux capture of this architecture can give ``layers``."""
    from hscapture.integrations.sglang_models import launch_plan

    try:
        launch_plan(model, layers)
    except ValueError:
        return False
    return True
