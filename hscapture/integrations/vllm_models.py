"""What vLLM's EAGLE-3 aux capture gives, per model architecture: which layer ids it takes, which tensor it keeps.

vLLM (0.32) calls the served model's ``set_aux_hidden_state_layers(ids)``; the decoder stack's
forward then returns, beside the post-norm final state, one tensor per listed id, in ascending
id order. Unlike SGLang there is no shift: vLLM's id ``k`` is hscapture's layer ``k``, the
residual stream entering decoder layer ``k`` (HF ``output_hidden_states[k]``). Id ``L`` (past the
last layer) is the residual stream leaving the last layer *before* the final norm, which HF's
``output_hidden_states[L]`` is not (HF's is after it); the post-norm state is ``last``.

The stacks differ in what they accept: Llama and Qwen (``EagleModelMixin._maybe_add_hidden_state``)
take id 0 (the embedding output) too; DeepSeek's own loop (``deepseek_v2.DeepseekV2Model.forward``)
adds ``hidden + residual`` before each layer, and at layer 0 the residual is None, so its ids
start at 1. Kimi-K2.5 forwards to its DeepSeek-V3 language model. An architecture not in the
table is refused before vLLM starts: hscapture would not know what the stored tensors are.

The launchers use :func:`launch_plan` before vLLM starts; the plugin checks vLLM's model against
the same row once it is loaded (:func:`captured_layers`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hscapture.config import eagle3_default_layers, num_layers_of, read_model_config, resolve_layers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Architecture:
    """How one vLLM model class captures aux layers."""

    #: The HF ``architectures[0]`` of config.json: the class vLLM builds.
    name: str
    #: ``module.Class`` (under ``vllm.model_executor.models.``) of the stack holding ``aux_hidden_state_layers``.
    stack: str
    #: Lowest layer id vLLM can capture: 0 (the embedding output) for Llama and Qwen, 1 for DeepSeek.
    first_layer: int
    #: ``cpu-test`` (run by tests/test_vllm.py on vLLM's CPU path) or ``source`` (read from vLLM 0.32's source only).
    checked: str

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The first and last hscapture layer ids this architecture can capture (``L``: the pre-norm output)."""
        return self.first_layer, num_layers

    def describe(self, layers: Sequence[int], num_layers: int, capture_last: bool) -> list[str]:
        """One sentence per stored tensor saying exactly what vLLM captured for this architecture."""
        out = []
        for k in layers:
            if k == 0:
                out.append(f"embedding output (vLLM {self.name} aux layer 0), HF output_hidden_states[0]")
            elif k == num_layers:
                out.append(
                    f"residual stream leaving the last decoder layer, before the final norm (vLLM {self.name} aux "
                    f"layer {k}); not HF output_hidden_states[{k}], which is after the norm"
                )
            else:
                out.append(
                    f"residual stream entering decoder layer {k} (hidden + residual before its input norm); "
                    f"vLLM {self.name} aux layer {k}, HF output_hidden_states[{k}]"
                )
        if capture_last:
            out.append("final hidden state after the model's last norm (vLLM's hidden_states, the LM head input)")
        return out


def _rows(names: Sequence[str], **fields: Any) -> dict[str, Architecture]:
    return {name: Architecture(name=name, **fields) for name in names}


#: Every architecture hscapture captures from with vLLM, by config.json ``architectures[0]``.
ARCHITECTURES: dict[str, Architecture] = {
    **_rows(["LlamaForCausalLM"], stack="llama.LlamaModel", first_layer=0, checked="cpu-test"),
    **_rows(["Qwen2ForCausalLM"], stack="qwen2.Qwen2Model", first_layer=0, checked="source"),
    **_rows(["Qwen3ForCausalLM"], stack="qwen3.Qwen3Model", first_layer=0, checked="cpu-test"),
    **_rows(["Qwen3MoeForCausalLM"], stack="qwen3_moe.Qwen3MoeModel", first_layer=0, checked="source"),
    **_rows(["DeepseekV3ForCausalLM"], stack="deepseek_v2.DeepseekV2Model", first_layer=1, checked="cpu-test"),
    # Kimi-K2.5 forwards to the DeepSeek-V3 stack above; vLLM's Kimi processor wants an image-processor config the
    # tiny test model lacks (even with --language-model-only), so its own run is still owed.
    **_rows(
        ["DeepseekV2ForCausalLM", "KimiK25ForConditionalGeneration"],
        stack="deepseek_v2.DeepseekV2Model",
        first_layer=1,
        checked="source",
    ),
}


def architecture(name: str) -> Architecture:
    """The table row of a vLLM model class, or a ValueError naming the ones hscapture knows."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(
            f"vLLM architecture {name!r}: hscapture does not know which tensor vLLM's aux capture keeps for it, "
            f"so it cannot describe what it would store; supported: {', '.join(sorted(ARCHITECTURES))} "
            "(hscapture/integrations/vllm_models.py lists what each one captures)"
        ) from None


def capture_layers(arch: Architecture, num_layers: int, layers: str | Sequence[int] | None) -> tuple[int, ...]:
    """hscapture layer ids to capture, ascending and distinct: ``layers`` resolved, or EAGLE-3's default
    ``[2, L//2, L-3]`` (vLLM's own default ids, the same tensors).

    Raises:
        ValueError: a layer this architecture cannot capture (DeepSeek's 0, anything past ``L``), or none.
    """
    if layers is None:
        return eagle3_default_layers(num_layers)
    chosen = tuple(sorted(set(resolve_layers(layers, num_layers, arch.layer_range(num_layers), f"vLLM's {arch.name}"))))
    if not chosen:
        raise ValueError("--layers: vLLM's aux capture needs at least one layer id (it always captures some)")
    return chosen


@dataclass(frozen=True)
class LaunchPlan:
    """What a launcher passes to the plugin for one model."""

    arch: Architecture
    num_layers: int
    #: hscapture layer ids, which are also vLLM's aux ids.
    layers: tuple[int, ...]


def launch_plan(model: Path | str, layers: str | Sequence[int] | None) -> LaunchPlan:
    """Check a model and the wanted layers before vLLM starts.

    Raises:
        ValueError: no config.json, an architecture hscapture does not know, a layer it cannot capture.
    """
    config = read_model_config(model)
    names = config.get("architectures") or []
    if not names:
        raise ValueError(f"{model}: config.json has no architectures entry; vLLM needs one to pick its model")
    arch = architecture(names[0])
    if arch.checked == "source":
        log.warning(
            "what vLLM captures for %s was read from its source; hscapture's tests have not run this architecture",
            arch.name,
        )
    num_layers = num_layers_of(config)
    return LaunchPlan(arch, num_layers, capture_layers(arch, num_layers, layers))


def find_stack(model: Any) -> Any:
    """The decoder stack holding ``aux_hidden_state_layers``: ``model.model``, or a multimodal wrapper's
    ``language_model.model`` (Kimi-K2.5)."""
    for path in (("model",), ("language_model", "model")):
        stack = model
        for name in path:
            stack = getattr(stack, name, None)
        if stack is not None and hasattr(stack, "aux_hidden_state_layers"):
            return stack
    raise RuntimeError(f"vLLM's {type(model).__name__} has no decoder stack with aux_hidden_state_layers")


def captured_layers(model: Any, num_layers: int, expected: Sequence[int]) -> tuple[Architecture, tuple[int, ...]]:
    """Check a loaded vLLM model (after ``set_aux_hidden_state_layers``) against its table row; the layers its aux
    output holds, in order.

    Raises:
        RuntimeError: an unknown architecture, a stack other than the one the table was read from, or layers
            other than ``expected``.
    """
    try:
        arch = architecture(type(model).__name__)
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    stack = find_stack(model)
    stack_name = f"{type(stack).__module__.removeprefix('vllm.model_executor.models.')}.{type(stack).__qualname__}"
    if stack_name != arch.stack:
        raise RuntimeError(
            f"vLLM's {arch.name} keeps its aux layers in {stack_name}, not {arch.stack} whose capture hscapture "
            "has checked; this vLLM version differs from the one hscapture's table was read from"
        )
    listed = list(stack.aux_hidden_state_layers)
    layers = tuple(sorted(set(listed)))
    if list(layers) != sorted(set(expected)) or len(layers) != len(listed):
        raise RuntimeError(
            f"vLLM's {arch.name} set aux_hidden_state_layers {listed}, not the layers {sorted(expected)} hscapture "
            "asked for"
        )
    lo, hi = arch.layer_range(num_layers)
    if any(not lo <= k <= hi for k in layers):
        raise RuntimeError(f"vLLM's {arch.name} aux layers {listed}: it only captures layers {lo}..{hi}")
    return arch, layers
