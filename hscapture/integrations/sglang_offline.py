"""Offline extraction with ``sglang.Engine``: the states of the engine users serve with.

:class:`SGLangExtraction` is the ``sglang`` engine of ``hscapture extract``. The engine's
scheduler process runs the hscapture plugin (block policy: nothing is lost) and a consumer
process writes the store, as in live serving. Two modes:

* ``teacher``: each sample's full token ids are prefilled as given (one generated token is
  discarded), so the store holds one row per dataset token, with the dataset's loss mask.
* ``regenerate``: the target model writes the last assistant turn itself; the prompt (every
  token before that turn's first trained token) and the generated tokens are both captured,
  and the loss mask covers the generated ones.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hscapture.data import Sample, loss_mask_ranges
from hscapture.errors import HSCaptureError
from hscapture.integrations.sglang import (
    CLOSE_RPC,
    CPU_ENGINE_KWARGS,
    ENV,
    LOSS_MASK_PARAM,
    PluginSettings,
    engine_kwargs,
    use_cpu_host_env,
)

MODES = ("teacher", "regenerate")


def sglang_layer_ids(layers: Sequence[int], model_type: str) -> list[int]:
    """SGLang's ``--return-aux-hidden-state-layer-ids`` that capture hscapture layers ``layers``.

    SGLang's Llama-style setters capture ``id + 1``; DeepSeek's take ids as given unless the
    first one is 1 (then ``id + 1`` as well).
    """
    if model_type.startswith("deepseek"):
        if layers and layers[0] == 1:
            raise ValueError("--layers: SGLang's DeepSeek setter cannot capture layer 1 first; list another first")
        return list(layers)
    if any(k < 1 for k in layers):
        raise ValueError(f"--layers: SGLang captures layer inputs from layer 1 on; got {list(layers)}")
    return [k - 1 for k in layers]


def regenerate_prompt(sample: Sample) -> list[int]:
    """The tokens before the last run of trained tokens (the final assistant turn)."""
    ranges = loss_mask_ranges(sample.loss_mask)
    return sample.input_ids[: ranges[-1][0]] if ranges else list(sample.input_ids)


class SGLangExtraction:
    """``hscapture extract --engine sglang``: same store layout and resume rules as the HF engine.

    Args:
        model: HF model directory (None: the embedded tiny Llama).
        layers: hscapture layer ids (None: SGLang's EAGLE-3 default).
        capture_last: also capture the post-norm final state.
        dtype: the engine's dtype (None: the model's).
        device: ``cpu`` (SGLang's CPU path) or a GPU device.
        mode: ``teacher`` or ``regenerate``.
        max_batch_size: samples per ``generate`` call.
        max_new_tokens, temperature: regenerate mode's sampling.

    Raises:
        ValueError: an unknown mode, no model there, or layers SGLang cannot capture.
    """

    def __init__(
        self,
        model: Path | None,
        layers: Sequence[int] | None,
        capture_last: bool,
        dtype: str | None,
        device: str,
        mode: str,
        max_batch_size: int,
        max_new_tokens: int,
        temperature: float,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"--mode: {mode!r} is unknown; use one of {MODES}")
        from transformers import AutoConfig, AutoTokenizer

        from hscapture.tiny import ensure_tiny_model

        model_path = Path(model) if model is not None else ensure_tiny_model()
        if not (model_path / "config.json").exists():
            raise ValueError(f"--model: {str(model_path)!r} has no config.json; give a local HF model directory")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model_type = AutoConfig.from_pretrained(model_path).model_type
        self.layers = layers
        self.layer_ids = sglang_layer_ids(layers, model_type) if layers is not None else None
        self.model_path, self.capture_last, self.dtype, self.device = model_path, capture_last, dtype, device
        self.mode, self.max_batch_size = mode, max_batch_size
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.meta: dict[str, Any] = {"model": str(model_path), "mode": mode, "launcher": "hscapture extract"}
        self.engine: Any = None

    def plan(self, samples: Sequence[Sample]) -> list[list[Sample]]:
        return [list(samples[i : i + self.max_batch_size]) for i in range(0, len(samples), self.max_batch_size)]

    def start(self, endpoint: str, meta: dict[str, Any], watchdog: Callable[[], None]) -> None:
        on_cpu = self.device == "cpu"
        if on_cpu:
            use_cpu_host_env()
        settings = PluginSettings(
            endpoint=endpoint, capture_last=self.capture_last, policy="block", meta={**self.meta, **meta}
        )
        os.environ[ENV] = settings.to_env()  # read by the plugin in SGLang's scheduler process
        try:
            import sglang

            self.engine = sglang.Engine(
                model_path=str(self.model_path),
                log_level="error",
                disable_radix_cache=True,  # a prefix-cache hit would leave its positions uncaptured
                dtype=self.dtype or "auto",
                **(CPU_ENGINE_KWARGS if on_cpu else {"device": self.device}),
                **engine_kwargs(self.layer_ids),
            )
        finally:
            os.environ.pop(ENV, None)

    def run(self, batch: list[Sample]) -> int:
        return _generate(self.engine, batch, self.mode, self.max_new_tokens, self.temperature)

    def waited_s(self) -> float | None:
        return None  # the producer lives in SGLang's scheduler process

    def end(self) -> None:
        self.engine.collective_rpc(CLOSE_RPC)  # end of stream: the consumer finishes the store and exits

    def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    def check(self, store: Any) -> None:
        got = store.metadata()["runs"][-1]["meta"]["config"]["layers"]
        if self.layers is not None and list(got) != list(self.layers):
            raise HSCaptureError(f"SGLang captured layers {got}, not the {list(self.layers)} asked for")


def _generate(engine: Any, batch: list[Sample], mode: str, max_new_tokens: int, temperature: float) -> int:
    """One ``generate`` call over a batch; returns the tokens captured."""
    if mode == "teacher":
        prompts = [s.input_ids for s in batch]
        params = [
            {
                "max_new_tokens": 1,
                "temperature": 0.0,
                "custom_params": {LOSS_MASK_PARAM: [i for r in loss_mask_ranges(s.loss_mask) for i in r]},
            }
            for s in batch
        ]
    else:
        prompts = [regenerate_prompt(s) for s in batch]
        params = [{"max_new_tokens": max_new_tokens, "temperature": temperature} for _ in batch]
    outputs = engine.generate(input_ids=prompts, sampling_params=params, rid=[s.key for s in batch])
    return sum(len(p) + len(o["output_ids"]) - 1 for p, o in zip(prompts, outputs))
