"""What SGLang's EAGLE-3 aux capture gives, per model architecture: how it numbers layers, which tensor it keeps.

SGLang (``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3``) calls the served
model's ``set_eagle3_layers_to_capture(ids)``; each architecture's setter turns the ids into
the ``layers_to_capture`` list of its decoder stack, whose forward copies out one tensor per
listed layer, in layer order. Both steps differ between model files, so hscapture keeps one
row per architecture below, read from SGLang 0.5.23's ``srt/models/`` and, where
:attr:`Architecture.checked` says so, checked on SGLang's CPU path by ``tests/test_sglang.py``
(stored rows equal to SGLang's own ``return_hidden_states``, and to the HF tensor the
description names). An architecture not in the table is refused: hscapture would not know
what the stored tensors are.

hscapture's layer id ``k`` is always ``layers_to_capture`` entry ``k``: for the residual-stream
architectures, the stream entering decoder layer ``k`` (HF ``output_hidden_states[k]``).

The launchers (``hscapture serve``, ``extract --engine sglang``) use :func:`launch_plan`
before SGLang starts; the plugin checks SGLang's model against the same row when it is loaded
(:func:`find_stack`, :func:`captured_layers`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hscapture.config import eagle3_default_layers, resolve_layers
from hscapture.config import num_layers_of as num_layers_of  # moved to config: vLLM's table reads them too
from hscapture.config import read_model_config as read_model_config

log = logging.getLogger(__name__)

#: :attr:`Architecture.captures`: the residual stream entering layer k (HF ``output_hidden_states[k]``).
RESIDUAL_STREAM = "residual-stream"
#: :attr:`Architecture.captures`: Gemma3's layer k-1 MLP-branch output after its post-feedforward norm.
GEMMA3_MLP_BRANCH = "gemma3-mlp-branch"


@dataclass(frozen=True)
class Architecture:
    """How one SGLang model class numbers aux layer ids and what it captures."""

    #: The HF ``architectures[0]`` of config.json: the class SGLang builds.
    name: str
    #: What its ``set_eagle3_layers_to_capture`` does with the ids it is given: ``plus_one`` stores
    #: ``k + 1`` ("layer i takes the output of layer i-1": Llama, Qwen, Gemma3); ``deepseek``
    #: stores them as given unless the first one is 1 (then ``k + 1``: DeepSeek, and Kimi-K2.5,
    #: whose setter forwards to its DeepSeek-V3 text model's).
    ids: Literal["plus_one", "deepseek"]
    #: What ``layers_to_capture`` entry ``k`` holds (see :meth:`describe`).
    captures: str
    #: ``module.Class`` (under ``sglang.srt.models.``) of the decoder stack owning ``layers_to_capture``.
    stack: str
    #: Lowest layer id SGLang can capture (the setter's ids are non-negative).
    first_layer: int
    #: Whether layer ``L`` (the last decoder layer's output) is captured; most stacks only look
    #: at ``layers_to_capture`` inside their loop over layers ``0..L-1``.
    captures_final_layer: bool
    #: ``cpu-test`` (run by tests/test_sglang.py) or ``source`` (read from SGLang's source only).
    checked: str

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The first and last hscapture layer ids this architecture can capture."""
        return self.first_layer, num_layers if self.captures_final_layer else num_layers - 1

    def describe(self, layers: Sequence[int], capture_last: bool) -> list[str]:
        """One sentence per stored tensor saying exactly what SGLang captured for this architecture."""
        out = []
        for k in layers:
            if self.captures == GEMMA3_MLP_BRANCH:
                out.append(
                    f"output of decoder layer {k - 1}'s MLP branch after its post-feedforward norm, before it is added "
                    f"to the residual stream (SGLang {self.name} layers_to_capture {k}); not the residual stream, "
                    f"so not HF output_hidden_states[{k}]"
                )
            else:
                out.append(
                    f"residual stream entering decoder layer {k} (hidden + residual before its input norm); "
                    f"SGLang {self.name} layers_to_capture {k}, HF output_hidden_states[{k}]"
                )
        if capture_last:
            out.append("final hidden state after the model's last norm (SGLang last_hidden_states, LM head input)")
        return out


def _rows(names: Sequence[str], **fields: Any) -> dict[str, Architecture]:
    return {name: Architecture(name=name, **fields) for name in names}


_LLAMA_LIKE = dict(ids="plus_one", captures=RESIDUAL_STREAM, first_layer=1, captures_final_layer=False)
_DEEPSEEK = dict(
    ids="deepseek",
    captures=RESIDUAL_STREAM,
    stack="deepseek_v2.DeepseekV2Model",
    first_layer=0,
    captures_final_layer=False,
)
#: Every architecture hscapture captures from with SGLang, by config.json ``architectures[0]``.
ARCHITECTURES: dict[str, Architecture] = {
    **_rows(["LlamaForCausalLM"], stack="llama.LlamaModel", checked="cpu-test", **_LLAMA_LIKE),
    **_rows(["MistralForCausalLM"], stack="llama.LlamaModel", checked="source", **_LLAMA_LIKE),
    **_rows(["Qwen2ForCausalLM"], stack="qwen2.Qwen2Model", checked="source", **_LLAMA_LIKE),
    **_rows(["Qwen3ForCausalLM"], stack="qwen3.Qwen3Model", checked="cpu-test", **_LLAMA_LIKE),
    **_rows(["Qwen2MoeForCausalLM"], stack="qwen2_moe.Qwen2MoeModel", checked="source", **_LLAMA_LIKE),
    **_rows(["Qwen3MoeForCausalLM"], stack="qwen3_moe.Qwen3MoeModel", checked="source", **_LLAMA_LIKE),
    **_rows(
        ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"],
        checked="cpu-test",
        **_DEEPSEEK,
    ),
    **{
        name: Architecture(
            name=name,
            ids="plus_one",
            captures=GEMMA3_MLP_BRANCH,
            stack="gemma3_causal.Gemma3TextModel",
            first_layer=1,
            captures_final_layer=True,  # Gemma3TextModel also looks at layers_to_capture after its loop
            checked=checked,
        )
        for name, checked in (("Gemma3ForConditionalGeneration", "cpu-test"), ("Gemma3ForCausalLM", "source"))
    },
}


def architecture(name: str) -> Architecture:
    """The table row of an SGLang model class, or a ValueError naming the ones hscapture knows."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(
            f"SGLang architecture {name!r}: hscapture does not know which tensor SGLang's aux capture keeps for it, "
            f"so it cannot describe what it would store; supported: {', '.join(sorted(ARCHITECTURES))} "
            "(hscapture/integrations/sglang_models.py lists what each one captures)"
        ) from None


def capture_layers(arch: Architecture, num_layers: int, layers: str | Sequence[int] | None) -> tuple[int, ...]:
    """hscapture layer ids to capture, ascending: ``layers`` resolved (:func:`~hscapture.config.resolve_layers`:
    ``all`` is every layer this architecture captures, from 1), or EAGLE-3's default ``[2, L//2, L-3]`` without
    repeats.

    Raises:
        ValueError: a layer this architecture cannot capture, a repeated one, or none.
    """
    if layers is None:
        chosen = eagle3_default_layers(num_layers)
        wanted = [2, num_layers // 2, num_layers - 3]
        if len(chosen) < len(wanted):
            log.warning(
                "EAGLE-3's default layers %s repeat a layer at %d decoder layers; capturing %s",
                wanted,
                num_layers,
                list(chosen),
            )
        return chosen
    chosen = tuple(sorted(resolve_layers(layers, num_layers, arch.layer_range(num_layers), f"SGLang's {arch.name}")))
    if not chosen:
        raise ValueError("--layers: SGLang's aux capture needs at least one layer id (it always captures some)")
    return chosen


def sglang_layer_ids(arch: Architecture, layers: Sequence[int]) -> list[int]:
    """SGLang's ``--return-aux-hidden-state-layer-ids`` for which ``arch``'s setter captures exactly ``layers``.

    ``layers`` are sorted and distinct (see :func:`capture_layers`).

    Raises:
        ValueError: a DeepSeek-family model asked for layer 1 alone (its setter turns a first id 1 into 2).
    """
    if arch.ids == "plus_one":
        return [k - 1 for k in layers]
    ids = list(layers)
    if ids[:1] == [1]:
        if len(ids) == 1:
            raise ValueError(
                f"--layers [1]: SGLang's {arch.name} setter turns a first id 1 into layer 2; add another layer"
            )
        ids = [*ids[1:], 1]  # any other id first: the setter then takes the ids as given
    return ids


@dataclass(frozen=True)
class LaunchPlan:
    """What a launcher passes to SGLang and to the plugin for one model."""

    arch: Architecture
    num_layers: int
    #: hscapture layer ids the plugin must find in ``layers_to_capture``.
    layers: tuple[int, ...]
    #: SGLang's ``--return-aux-hidden-state-layer-ids`` for them.
    sglang_ids: list[int]


def launch_plan(model: Path | str, layers: str | Sequence[int] | None) -> LaunchPlan:
    """Check a model and the wanted layers before SGLang starts.

    Raises:
        ValueError: no config.json, an architecture hscapture does not know, a layer it cannot capture.
    """
    config = read_model_config(model)
    names = config.get("architectures") or []
    if not names:
        raise ValueError(f"{model}: config.json has no architectures entry; SGLang needs one to pick its model")
    arch = architecture(names[0])
    if arch.checked == "source":
        log.warning(
            "what SGLang captures for %s was read from its source; hscapture's tests have not run this architecture",
            arch.name,
        )
    num_layers = num_layers_of(config)
    chosen = capture_layers(arch, num_layers, layers)
    return LaunchPlan(arch, num_layers, chosen, sglang_layer_ids(arch, chosen))


def find_stack(model: Any) -> Any:
    """The decoder stack whose ``layers_to_capture`` SGLang's setter filled, found in the module tree.

    Wrappers differ (Kimi-K2.5 keeps it three levels down, Gemma3's multimodal model has no
    ``.model``), so this looks for the one module with a non-empty ``layers_to_capture`` list.

    Raises:
        RuntimeError: none (aux capture is off), or more than one.
    """
    owners = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "layers_to_capture", None), list) and module.layers_to_capture
    ]
    if not owners:
        raise RuntimeError(
            f"SGLang's {type(model).__name__} captures no aux layers: start SGLang with "
            "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 (hscapture serve and "
            "hscapture extract --engine sglang add them)"
        )
    if len(owners) > 1:
        raise RuntimeError(
            f"SGLang's {type(model).__name__} has several modules with layers to capture "
            f"({', '.join(name or '<root>' for name, _ in owners)}); hscapture cannot tell which output is which"
        )
    return owners[0][1]


def captured_layers(
    model: Any, num_layers: int, expected: Sequence[int] | None
) -> tuple[Architecture, tuple[int, ...]]:
    """Check a loaded SGLang model against its table row; the layers its aux output holds, in order.

    Raises:
        RuntimeError: an unknown architecture, a decoder stack other than the one the table was
            read from, a repeated or uncapturable layer, or layers other than ``expected``.
    """
    try:
        arch = architecture(type(model).__name__)
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    stack = find_stack(model)
    stack_name = f"{type(stack).__module__.removeprefix('sglang.srt.models.')}.{type(stack).__qualname__}"
    if stack_name != arch.stack:
        raise RuntimeError(
            f"SGLang's {arch.name} keeps its capture list in {stack_name}, not {arch.stack} whose capture hscapture "
            "has checked; this SGLang version differs from the one hscapture's table was read from"
        )
    listed = list(stack.layers_to_capture)
    layers = tuple(sorted(set(listed)))
    if len(layers) != len(listed):
        raise RuntimeError(
            f"SGLang's {arch.name} layers_to_capture {listed} repeats a layer (EAGLE-3's default [2, L//2, L-3] "
            "collides in shallow models): pass distinct --return-aux-hidden-state-layer-ids, or let hscapture pick them"
        )
    lo, hi = arch.layer_range(num_layers)
    if any(not lo <= k <= hi for k in layers):
        raise RuntimeError(
            f"SGLang's {arch.name} layers_to_capture {listed}: it only captures layers {lo}..{hi} of its {num_layers}"
        )
    if expected is not None and list(layers) != sorted(expected):
        raise RuntimeError(
            f"SGLang's {arch.name} set layers_to_capture {listed}, not the layers {sorted(expected)} hscapture asked "
            "for: its setter numbers ids differently from hscapture's table (sglang_models.py)"
        )
    return arch, layers
