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
from typing import Any, ClassVar, Literal

from hscapture.integrations import engines
from hscapture.integrations.engines import EngineArchitecture

log = logging.getLogger(__name__)

#: :attr:`Architecture.captures`: the residual stream entering layer k (HF ``output_hidden_states[k]``).
RESIDUAL_STREAM = "residual-stream"
#: :attr:`Architecture.captures`: Gemma3's layer k-1 MLP-branch output after its post-feedforward norm.
GEMMA3_MLP_BRANCH = "gemma3-mlp-branch"


@dataclass(frozen=True)
class Architecture(EngineArchitecture):
    """How one SGLang model class numbers aux layer ids and what it captures: :attr:`stack` is under
    ``sglang.srt.models.``, it owns ``layers_to_capture``; :attr:`first_layer` is the lowest id its setter's
    non-negative ids reach; ``cpu-test`` rows run in tests/test_sglang.py, ``source`` rows were read from SGLang's
    source."""

    #: What its ``set_eagle3_layers_to_capture`` does with the ids it is given: ``plus_one`` stores
    #: ``k + 1`` ("layer i takes the output of layer i-1": Llama, Qwen, Gemma3); ``deepseek``
    #: stores them as given unless the first one is 1 (then ``k + 1``: DeepSeek, and Kimi-K2.5,
    #: whose setter forwards to its DeepSeek-V3 text model's).
    ids: Literal["plus_one", "deepseek"]
    #: What ``layers_to_capture`` entry ``k`` holds (see :meth:`describe`).
    captures: str
    #: Whether layer ``L`` (the last decoder layer's output) is captured; most stacks only look
    #: at ``layers_to_capture`` inside their loop over layers ``0..L-1``.
    captures_final_layer: bool

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The first and last hscapture layer ids this architecture can capture."""
        return self.first_layer, num_layers if self.captures_final_layer else num_layers - 1

    FINAL_STATE: ClassVar[str] = (
        "final hidden state after the model's last norm (SGLang last_hidden_states, LM head input)"
    )

    def describe(self, layers: Sequence[int], capture_last: bool) -> list[str]:
        """One sentence per stored tensor saying exactly what SGLang captured for this architecture."""
        return self.descriptions(layers, capture_last)

    def layer_description(self, k: int, num_layers: int | None) -> str:
        if self.captures == GEMMA3_MLP_BRANCH:
            return (
                f"output of decoder layer {k - 1}'s MLP branch after its post-feedforward norm, before it is added "
                f"to the residual stream (SGLang {self.name} layers_to_capture {k}); not the residual stream, "
                f"so not HF output_hidden_states[{k}]"
            )
        return self.residual_stream(k, f"SGLang {self.name} layers_to_capture {k}")


_rows = Architecture.rows

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
    return engines.table_row(ARCHITECTURES, name, "SGLang")


def capture_layers(arch: Architecture, num_layers: int, layers: str | Sequence[int] | None) -> tuple[int, ...]:
    """hscapture layer ids to capture, ascending: ``layers`` resolved (:func:`~hscapture.config.resolve_layers`:
    ``all`` is every layer this architecture captures, from 1), or EAGLE-3's default ``[2, L//2, L-3]`` without
    repeats.

    Raises:
        ValueError: a layer this architecture cannot capture, a repeated one, or none.
    """
    chosen = engines.capture_layers(arch, num_layers, layers, "SGLang")
    wanted = [2, num_layers // 2, num_layers - 3]
    if layers is None and len(chosen) < len(wanted):
        log.warning(
            "EAGLE-3's default layers %s repeat a layer at %d decoder layers; capturing %s",
            wanted,
            num_layers,
            list(chosen),
        )
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
    arch, num_layers = engines.model_architecture(model, ARCHITECTURES, "SGLang")
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
    arch = engines.loaded_architecture(model, ARCHITECTURES, "SGLang")
    stack = find_stack(model)
    engines.check_stack(arch, stack, "sglang.srt.models.", "SGLang", "capture list")
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
