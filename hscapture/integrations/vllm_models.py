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

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from hscapture.integrations import engines
from hscapture.integrations.engines import EngineArchitecture


@dataclass(frozen=True)
class Architecture(EngineArchitecture):
    """How one vLLM model class captures aux layers: :attr:`stack` is under ``vllm.model_executor.models.``, it holds
    ``aux_hidden_state_layers``; :attr:`first_layer` is 0 (the embedding output) for Llama and Qwen, 1 for DeepSeek;
    ``cpu-test`` rows run in tests/test_vllm.py on vLLM's CPU path, ``source`` rows were read from vLLM 0.32's source.
    Layer ``L`` is the pre-norm output of the last layer."""

    FINAL_STATE: ClassVar[str] = (
        "final hidden state after the model's last norm (vLLM's hidden_states, the LM head input)"
    )

    def describe(self, layers: Sequence[int], num_layers: int, capture_last: bool) -> list[str]:
        """One sentence per stored tensor saying exactly what vLLM captured for this architecture."""
        return self.descriptions(layers, capture_last, num_layers)

    def layer_description(self, k: int, num_layers: int | None) -> str:
        if k == 0:
            return f"embedding output (vLLM {self.name} aux layer 0), HF output_hidden_states[0]"
        if k == num_layers:
            return (
                f"residual stream leaving the last decoder layer, before the final norm (vLLM {self.name} aux "
                f"layer {k}); not HF output_hidden_states[{k}], which is after the norm"
            )
        return self.residual_stream(k, f"vLLM {self.name} aux layer {k}")


_rows = Architecture.rows

#: Every architecture hscapture captures from with vLLM, by config.json ``architectures[0]``.
ARCHITECTURES: dict[str, Architecture] = {
    **_rows(["LlamaForCausalLM"], stack="llama.LlamaModel", first_layer=0, checked="cpu-test"),
    **_rows(["Qwen2ForCausalLM"], stack="qwen2.Qwen2Model", first_layer=0, checked="source"),
    **_rows(["Qwen3ForCausalLM"], stack="qwen3.Qwen3Model", first_layer=0, checked="cpu-test"),
    **_rows(["Qwen3MoeForCausalLM"], stack="qwen3_moe.Qwen3MoeModel", first_layer=0, checked="source"),
    # Kimi-K2.5 forwards to its DeepSeek-V3 language model; tested text-only (--language-model-only), vLLM still
    # building its image processor from the checkpoint's preprocessor_config.json (the tiny model ships one).
    **_rows(
        ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"],
        stack="deepseek_v2.DeepseekV2Model",
        first_layer=1,
        checked="cpu-test",
    ),
    **_rows(["DeepseekV2ForCausalLM"], stack="deepseek_v2.DeepseekV2Model", first_layer=1, checked="source"),
}


def architecture(name: str) -> Architecture:
    """The table row of a vLLM model class, or a ValueError naming the ones hscapture knows."""
    return engines.table_row(ARCHITECTURES, name, "vLLM")


def capture_layers(arch: Architecture, num_layers: int, layers: str | Sequence[int] | None) -> tuple[int, ...]:
    """hscapture layer ids to capture, ascending and distinct: ``layers`` resolved, or EAGLE-3's default
    ``[2, L//2, L-3]`` (vLLM's own default ids, the same tensors).

    Raises:
        ValueError: a layer this architecture cannot capture (DeepSeek's 0, anything past ``L``), or none.
    """
    return engines.capture_layers(arch, num_layers, layers, "vLLM")


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
    arch, num_layers = engines.model_architecture(model, ARCHITECTURES, "vLLM")
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
    arch = engines.loaded_architecture(model, ARCHITECTURES, "vLLM")
    stack = find_stack(model)
    engines.check_stack(arch, stack, "vllm.model_executor.models.", "vLLM", "aux layers")
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
