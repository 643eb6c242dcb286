"""Offline extraction with ``sglang.Engine``: the states of the engine users serve with.

:class:`SGLangExtraction` is the ``sglang`` engine of ``hscapture extract``. The engine's
scheduler process runs the hscapture plugin (block policy: nothing is lost) and a consumer
process writes the store, as in live serving. Two modes:

* ``teacher``: each sample's full token ids are prefilled as given (one generated token is
  discarded), so the store holds one row per dataset token, with the dataset's loss mask.
* ``regenerate``: the target model writes the last assistant turn itself; the prompt (every
  token before that turn's first trained token) and the generated tokens are both captured,
  and the loss mask covers the generated ones.

A capture failure inside SGLang ends the producer's run with the original error; the consumer
exits, and the watchdog stops SGLang's generation at once instead of serving every sample
without capture.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from hscapture.data import Sample, loss_mask_ranges
from hscapture.data import regenerate_prompt as regenerate_prompt  # moved to data: vLLM's engine uses it too
from hscapture.errors import HSCaptureError
from hscapture.integrations.sglang import (
    CLOSE_RPC,
    ENV,
    LOSS_MASK_PARAM,
    PluginSettings,
    cpu_server_args,
    server_args,
    use_cpu_host_env,
)
from hscapture.integrations.sglang_models import launch_plan
from hscapture.selection import Positions

MODES = ("teacher", "regenerate")
#: How often a running ``generate`` call checks that the consumer still lives.
_WATCH_S = 0.2


class SGLangExtraction:
    """``hscapture extract --engine sglang``: same store layout and resume rules as the HF engine.

    Args:
        model: HF model directory (None: the embedded tiny Llama).
        layers: hscapture layer ids (None: EAGLE-3's default for the architecture).
        capture_last: also capture the post-norm final state.
        dtype: the engine's dtype (None: the model's).
        device: ``cpu`` (SGLang's CPU path) or a GPU device.
        mode: ``teacher`` or ``regenerate``.
        max_batch_size: samples per ``generate`` call.
        max_new_tokens, temperature: regenerate mode's sampling.
        sglang_args: more SGLang server arguments (``hscapture extract ... -- ARGS``).
        graph_copy: on a GPU, copy decode rows from inside SGLang's decode CUDA graphs (``PluginSettings``).
        positions: the positions of each sample to keep (``--positions``); other than ``all``, SGLang's radix cache
            is turned off: a cached prefix's rows are taken by reference only from a request holding all of them.

    Raises:
        ValueError: an unknown mode, no model there, an architecture SGLang's capture cannot
            describe, or layers it cannot capture (all before SGLang starts).
    """

    def __init__(
        self,
        model: Path | None,
        layers: str | Sequence[int] | None,
        capture_last: bool,
        dtype: str | None,
        device: str,
        mode: str,
        max_batch_size: int,
        max_new_tokens: int,
        temperature: float,
        sglang_args: Sequence[str] = (),
        graph_copy: bool = True,
        positions: str = "all",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"--mode: {mode!r} is unknown; use one of {MODES}")
        self.positions = Positions.parse(positions)
        from transformers import AutoTokenizer

        from hscapture.tiny import ensure_tiny_model

        self.positions.check_mode(mode)
        model_path = Path(model) if model is not None else ensure_tiny_model()
        if not (model_path / "config.json").exists():
            raise ValueError(f"--model: {str(model_path)!r} has no config.json; give a local HF model directory")
        self.capture_plan = launch_plan(
            model_path, layers
        )  # refuses what SGLang's capture cannot give, before it starts
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model_path, self.capture_last, self.dtype, self.device = model_path, capture_last, dtype, device
        self.mode, self.max_batch_size = mode, max_batch_size
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.sglang_args, self.graph_copy = list(sglang_args), graph_copy
        if not self.positions.everything and "--disable-radix-cache" not in self.sglang_args:
            self.sglang_args.append("--disable-radix-cache")  # a selection's samples hold no whole prefix to share
        self.meta: dict[str, Any] = {
            "model": str(model_path),
            "mode": mode,
            "launcher": "hscapture extract",
            "server_args": self.sglang_args,
            **({} if self.positions.everything else {"positions": str(self.positions)}),
        }
        self.engine: Any = None
        self._watchdog: Callable[[], None] = lambda: None

    def start(self, endpoint: str, meta: dict[str, Any], watchdog: Callable[[], None]) -> None:
        """Start ``sglang.Engine`` with the plugin capturing to ``endpoint`` (SGLang sizes its own batches)."""
        if self.device == "cpu":
            use_cpu_host_env()
        self._watchdog = watchdog
        settings = PluginSettings(
            endpoint=endpoint,
            capture_last=self.capture_last,
            policy="block",
            meta={**self.meta, **meta},
            layers=list(self.capture_plan.layers),
            graph_copy=self.graph_copy,
            positions=str(self.positions),
        )
        os.environ[ENV] = settings.to_env()  # read by the plugin in SGLang's scheduler process
        try:
            import sglang

            self.engine = sglang.Engine(server_args=self._server_args())
        finally:
            os.environ.pop(ENV, None)

    def _server_args(self) -> Any:
        """SGLang's arguments, parsed by SGLang: ours, then the user's ``-- <sglang args>``, then the capture flags."""
        from sglang.srt.server_args import prepare_server_args

        argv = ["--model-path", str(self.model_path), "--log-level", "error", "--dtype", self.dtype or "auto"]
        argv += cpu_server_args(self.sglang_args) if self.device == "cpu" else ["--device", self.device]
        return prepare_server_args([*argv, *self.sglang_args, *server_args(self.capture_plan.sglang_ids)])

    def run(self, batch: list[Sample]) -> int:
        """One ``generate`` call over a batch, stopped at once if the watchdog raises; returns the tokens captured."""
        if self.mode == "teacher":
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
            params = [{"max_new_tokens": self.max_new_tokens, "temperature": self.temperature} for _ in batch]
        generation = self.engine.async_generate(input_ids=prompts, sampling_params=params, rid=[s.key for s in batch])
        outputs = self.engine.loop.run_until_complete(_watched(generation, self._watchdog))
        return sum(len(p) + len(o["output_ids"]) - 1 for p, o in zip(prompts, outputs))

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
        if list(got) != list(self.capture_plan.layers):
            raise HSCaptureError(f"SGLang captured layers {got}, not the {list(self.capture_plan.layers)} asked for")


async def _watched(generation: Awaitable[Any], watchdog: Callable[[], None]) -> Any:
    """Await SGLang's answer, calling ``watchdog`` meanwhile: it raises when the consumer exited
    (capture failed inside SGLang), and then SGLang's generation is cancelled."""
    task = asyncio.ensure_future(generation)
    while not task.done():
        await asyncio.wait({task}, timeout=_WATCH_S)
        if not task.done():
            try:
                watchdog()
            except BaseException:
                task.cancel()
                raise
    return task.result()
