"""SGLang integration: a general plugin that captures from inside SGLang's scheduler process.

SGLang loads every entry point of the ``sglang.srt.plugins`` group in each of its processes
(``srt/plugins/__init__.py:load_plugins``). This one is inert unless :data:`ENV` holds capture
settings; then it registers four hooks through SGLang's ``HookRegistry`` (no source edits):

* AFTER ``TpModelWorker.init_attention_backends``: the model is loaded and SGLang has set its
  aux layers (before any CUDA graph is captured). The plugin checks the model against
  :mod:`hscapture.integrations.sglang_models` (which tensor this architecture captures, which
  layers) and starts the producer; anything wrong stops SGLang from starting, with the reason.
* AFTER ``TpModelWorker.forward_batch_generation``: the forward output and the batch's
  requests meet here. With ``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3``
  SGLang keeps, for every token of every batch, the concatenated aux states
  (``logits_output.hidden_states``) and the post-norm last layer (``.last_hidden_states``),
  inside CUDA graphs too; after a graph replay both are views the next replay overwrites, so
  the producer copies them into its ring at once (a device copy, no host sync).
* AFTER ``Scheduler.process_batch_result``: requests that finished, aborted or were retracted.
* AROUND ``Scheduler.handle_rpc_request``: ``Engine.collective_rpc(CLOSE_RPC)`` closes the
  producer cleanly (end of stream) before an offline engine shuts down.

Rows are attributed from the ``ScheduleBatch``: extend and mixed batches hold contiguous
blocks of ``extend_lens[i]`` rows at positions ``prefix_lens[i] + j``; decode batches one row
per request at ``seq_lens[i] - 1``. Token ids are the batch's own ``input_ids``. A position a
request already sent (re-prefill after a retraction) is not sent again.

A failure once serving runs never takes serving down: the plugin logs the cause, ends the
producer's run with it (the consumer records it in the store, logs it, shows it on its stats
line and counts it in ``hscapture_producer_failures_total``; ``hscapture consume --exit-on-eos``
then exits with status 1, which ends an ``hscapture extract`` at once) and serves on without capture.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hscapture.config import CaptureConfig, MiB, dtype_name

log = logging.getLogger(__name__)

#: Environment variable holding :class:`PluginSettings` as JSON; unset = the plugin is inert.
ENV = "HSCAPTURE_SGLANG"
#: ``Engine.collective_rpc`` method name that closes the producer (end of stream).
CLOSE_RPC = "hscapture_close"
#: ``sampling_params["custom_params"]`` key: flat ``[start, end, start, end, ...]`` loss mask.
LOSS_MASK_PARAM = "hscapture_loss_mask"

_MODEL_LOADED = "sglang.srt.managers.tp_worker.TpModelWorker.init_attention_backends"
_FORWARD = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
_BATCH_RESULT = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
_RPC = "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request"


def server_args(layer_ids: Sequence[int] | None = None) -> list[str]:
    """SGLang server flags that make the target model keep the states we capture.

    The overlap scheduler may stay on: it runs one step past a finished request's end before it
    learns of the end, and the store cuts that tail row from the request (``surplus_rows``).
    """
    args = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
    if layer_ids is not None:
        args += ["--return-aux-hidden-state-layer-ids", *map(str, layer_ids)]
    return args


def engine_kwargs(layer_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """The same as :func:`server_args`, as ``sglang.Engine`` keyword arguments."""
    kwargs: dict[str, Any] = {
        "enable_return_aux_hidden_states": True,
        "speculative_algorithm": "EAGLE3",
    }
    if layer_ids is not None:
        kwargs["return_aux_hidden_state_layer_ids"] = list(layer_ids)
    return kwargs


@dataclass
class PluginSettings:
    """What the plugin needs to know, passed to SGLang's processes through :data:`ENV`."""

    #: Base ZeroMQ endpoint; with attention data parallelism each DP group appends ``-dp<rank>``.
    endpoint: str
    #: Also capture the post-norm last layer beside the aux layers.
    capture_last: bool = True
    #: ``drop`` (serving never waits) or ``block`` (nothing lost: offline extraction).
    policy: str = "drop"
    slot_bytes: int = 4 * MiB
    #: Ring bytes; None sizes it for two of the engine's largest steps.
    ring_bytes: int | None = None
    block_timeout_s: float = 120.0
    #: Facts stored with the run (model path, launcher, ...).
    meta: dict[str, Any] = field(default_factory=dict)
    #: hscapture layer ids the launcher asked SGLang for; the plugin refuses a model that captures
    #: others. None: whatever SGLang's aux flags chose.
    layers: list[int] | None = None

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, raw: str) -> PluginSettings:
        try:
            values = json.loads(raw)
            return cls(**values)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{ENV}: not valid capture settings ({exc}); it must be PluginSettings JSON") from exc


#: SGLang arguments for a host without a GPU (what its CPU path supports).
CPU_SERVER_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
CPU_ENGINE_KWARGS: dict[str, Any] = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True}

_CUDA_STUB_C = """
/* SGLang's kernel package links libcuda.so.1; on a host without a GPU driver this stands in.
   Every call answers CUDA_ERROR_NO_DEVICE (100). */
int cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) { return 100; }
"""


def cpu_host_env(home: Path | None = None) -> dict[str, str]:
    """Environment for running SGLang on a host without an NVIDIA driver (tests, laptops).

    SGLang's CPU engine is selected by ``SGLANG_USE_CPU_ENGINE=1``; its kernel package still
    links ``libcuda.so.1``, so a one-function stub is compiled (gcc) once and put first on
    ``LD_LIBRARY_PATH``. On a host that has a driver this returns an empty dict.
    """
    if ctypes.util.find_library("cuda"):
        return {}
    from hscapture.tiny import DEFAULT_DIR

    folder = Path(home if home is not None else DEFAULT_DIR.parent) / "sglang-cpu"
    stub = folder / "libcuda.so.1"
    if not stub.exists():
        folder.mkdir(parents=True, exist_ok=True)
        source = folder / "cuda_stub.c"
        source.write_text(_CUDA_STUB_C)
        tmp = folder / f".libcuda.so.1.{os.getpid()}"
        try:
            subprocess.run(
                ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(source)],
                check=True,
                capture_output=True,
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            raise RuntimeError(f"SGLang on a CPU host needs gcc to build a libcuda stub in {folder}: {exc}") from exc
        os.replace(tmp, stub)
    paths = [str(folder), *filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":"))]
    return {"SGLANG_USE_CPU_ENGINE": "1", "LD_LIBRARY_PATH": ":".join(paths)}


def use_cpu_host_env() -> bool:
    """Apply :func:`cpu_host_env` to this process before ``import sglang``; True if it was needed.

    ``LD_LIBRARY_PATH`` is read when a process starts, so the stub is also loaded here by its
    soname; SGLang's processes started later inherit the variables.
    """
    env = cpu_host_env()
    if not env:
        return False
    os.environ.update(env)
    ctypes.CDLL(str(Path(env["LD_LIBRARY_PATH"].split(":")[0]) / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    return True


def endpoint_for(base: str, dp_rank: int, dp_size: int) -> str:
    """One stream per attention-DP group; plain TP has a single one."""
    return base if dp_size <= 1 else f"{base}-dp{dp_rank}"


def load_plugin() -> None:
    """Entry point (``sglang.srt.plugins``): register the hooks when capture is switched on."""
    raw = os.environ.get(ENV)
    if not raw:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    capture = SGLangCapture(PluginSettings.from_env(raw))
    HookRegistry.register(_MODEL_LOADED, capture.after_model_load, HookType.AFTER)
    HookRegistry.register(_FORWARD, capture.after_forward, HookType.AFTER)
    HookRegistry.register(_BATCH_RESULT, capture.after_batch_result, HookType.AFTER)
    HookRegistry.register(_RPC, capture.around_rpc, HookType.AROUND)


def _parallel() -> Any:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


class SGLangCapture:
    """Per scheduler process: turns SGLang batches into ``Producer`` calls."""

    def __init__(self, settings: PluginSettings) -> None:
        self.settings = settings
        self.producer: Any = None
        self.enabled = True
        #: Set at model load: the layers SGLang's aux output holds, in order, and their width.
        self.layers: tuple[int, ...] = ()
        self.hidden = 0
        #: Whether SGLang's first output matched what the model load promised.
        self.checked = False
        #: Next position each running request has not sent yet (skips re-prefilled rows).
        self.sent_upto: dict[str, int] = {}
        self.retractions: dict[str, int] = {}

    # --- hooks -------------------------------------------------------------------------

    def after_model_load(self, result: Any, worker: Any, *args: Any, **kwargs: Any) -> None:
        """Check the loaded model and start the producer; raising here stops SGLang before it serves."""
        if not getattr(worker, "is_draft_worker", False):
            self._start(worker)

    def after_forward(self, result: Any, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> None:
        if not self.enabled or batch is None or kwargs.get("is_verify") or not batch.reqs:
            return
        output = getattr(result, "logits_output", None)
        if output is None or batch.forward_mode.is_idle():
            return
        try:
            self._capture(worker, batch, output)
        except Exception as exc:  # capture must never take serving down: say why, stop capturing, serve on
            self._fail(exc)

    def after_batch_result(self, result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
        if self.producer is None or not self.enabled:
            return
        try:
            for req in batch.reqs:
                if req.rid not in self.sent_upto:
                    continue
                if req.is_retracted:
                    self.retractions[req.rid] = req.retraction_count
                elif req.finished():
                    self._finish(req)
            self.producer.poll()
        except Exception as exc:
            self._fail(exc)

    def around_rpc(self, original: Any, scheduler: Any, request: Any) -> Any:
        if getattr(request, "method", None) != CLOSE_RPC:
            return original(scheduler, request)
        from sglang.srt.managers.io_struct import RpcReqOutput

        self._shut("closed by the engine")
        return RpcReqOutput(success=True, message="")

    # --- work ---------------------------------------------------------------------------

    def _capture(self, worker: Any, batch: Any, output: Any) -> None:
        aux, last = output.hidden_states, output.last_hidden_states
        if aux is None:
            raise RuntimeError(
                "SGLang returned no aux hidden states: start it with " + " ".join(server_args()) + " (hscapture serve "
                "and hscapture extract --engine sglang add them)"
            )
        producer = self.producer if self.checked else self._check_first_output(aux, last)
        rids, counts, positions, keep = self._rows(batch)
        states = list(aux.view(aux.shape[0], -1, self.hidden).unbind(1))
        if self.settings.capture_last:
            states.append(last)
        rows = sum(counts)
        if aux.shape[0] != sum(len(p) for p in positions):
            raise RuntimeError(
                f"batch of {len(batch.reqs)} requests ({batch.forward_mode.name}) has "
                f"{sum(len(p) for p in positions)} tokens but SGLang returned {aux.shape[0]} hidden-state rows"
            )
        if rows == 0:
            return
        tokens = batch.input_ids
        flat_positions = torch.cat([torch.as_tensor(p, dtype=torch.int64) for p in positions])
        row_index = None
        if keep is not None:
            row_index = torch.as_tensor(keep, dtype=torch.int64)
            flat_positions, tokens = flat_positions[row_index], tokens[row_index.to(tokens.device)]
            row_index = row_index.to(aux.device, non_blocking=True)
        producer.capture_step(states, rids, counts, flat_positions, tokens, row_index=row_index)

    def _rows(self, batch: Any) -> tuple[list[str], list[int], list[list[int]], list[int] | None]:
        """Owners, kept-row counts, per-request positions and (if any row is skipped) kept indices."""
        if batch.forward_mode.is_decode():
            starts = [int(n) - 1 for n in batch.seq_lens_cpu.tolist()]
            lengths = [1] * len(batch.reqs)
        else:
            starts, lengths = list(batch.prefix_lens), list(batch.extend_lens)
        rids, counts, positions, keep = [], [], [], []
        skipped, at = False, 0
        for req, start, length in zip(batch.reqs, starts, lengths):
            span = list(range(start, start + length))
            upto = self.sent_upto.get(req.rid, 0)
            fresh = [i for i, p in enumerate(span) if p >= upto]
            positions.append(span)
            if len(fresh) != length:
                skipped = True
            if fresh:
                rids.append(req.rid)
                counts.append(len(fresh))
                keep.extend(at + i for i in fresh)
                self.sent_upto[req.rid] = start + length
            else:
                self.sent_upto.setdefault(req.rid, upto)
            at += length
        return rids, counts, positions, keep if skipped else None

    def _finish(self, req: Any) -> None:
        num_tokens = len(req.origin_input_ids) + len(req.output_ids) - 1
        reason = "aborted" if type(req.finished_reason).__name__ == "FINISH_ABORT" else "finished"
        params = getattr(req.sampling_params, "custom_params", None) or {}
        flat = params.get(LOSS_MASK_PARAM)
        if flat is not None:
            loss_mask = [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]
        elif len(req.output_ids) > 1:
            loss_mask = [(len(req.origin_input_ids), num_tokens)]
        else:
            loss_mask = []
        finish = req.finished_reason.to_json() if req.finished_reason is not None else None
        meta = {
            "prompt_tokens": len(req.origin_input_ids),
            "output_tokens": len(req.output_ids),
            "finish_reason": finish,
            "retractions": self.retractions.pop(req.rid, 0),
        }
        self.producer.finish_request(req.rid, reason, num_tokens=num_tokens, loss_mask=loss_mask, meta=meta)
        self.sent_upto.pop(req.rid, None)

    def _start(self, worker: Any) -> None:
        """At model load: check the architecture and its aux layers, then create the producer.

        Raises:
            RuntimeError: pipeline parallelism, or a model whose capture hscapture cannot describe
                (see :func:`hscapture.integrations.sglang_models.captured_layers`).
        """
        from hscapture.integrations.sglang_models import captured_layers
        from hscapture.producer import Producer

        parallel = _parallel()
        if int(getattr(parallel, "pp_size", 1)) > 1:
            raise RuntimeError("hscapture cannot capture with pipeline parallelism (--pp-size > 1); use TP or DP")
        runner = worker.model_runner
        model_config = runner.model_config
        num_layers = model_config.num_hidden_layers
        arch, self.layers = captured_layers(runner.model, num_layers, self.settings.layers)
        self.hidden = model_config.hidden_size
        if int(getattr(parallel, "attn_tp_rank", 0)) != 0:  # TP ranks hold identical states: rank 0 publishes
            self.enabled = False
            return
        # One stream per DP group: attention-DP ranks inside one TP group, or DP replicas.
        dp_size = int(getattr(parallel, "dp_size", 1) or 1)
        replica = getattr(parallel, "dp_rank", None)
        dp_rank = int(replica if replica is not None else getattr(parallel, "attn_dp_rank", 0))
        max_rows = int(getattr(worker, "max_num_tokens", 0) or 8192)
        device = "cpu" if str(runner.device) == "cpu" else f"cuda:{torch.cuda.current_device()}"
        config = CaptureConfig(
            layers=self.layers,
            hidden_size=self.hidden,
            num_layers=num_layers,
            capture_last=self.settings.capture_last,
            dtype=dtype_name(model_config.dtype),
            slot_bytes=self.settings.slot_bytes,
            ring_bytes=self.settings.ring_bytes,
            max_step_rows=max_rows,
            policy=self.settings.policy,  # type: ignore[arg-type]
            endpoint=endpoint_for(self.settings.endpoint, dp_rank, dp_size),
            device=device,
            block_timeout_s=self.settings.block_timeout_s,
        )
        import sglang

        meta = {
            "engine": "sglang",
            "sglang_version": sglang.__version__,
            "model": str(model_config.model_path),
            "architecture": arch.name,
            "sglang_layers_to_capture": list(self.layers),
            "dp_rank": dp_rank,
            "dp_size": dp_size,
            **self.settings.meta,
        }
        descriptions = arch.describe(self.layers, self.settings.capture_last)
        self.producer = Producer(config, tensor_descriptions=descriptions, meta=meta)
        log.info("hscapture: capturing layers %s (+last=%s) to %s", self.layers, config.capture_last, config.endpoint)

    def _check_first_output(self, aux: torch.Tensor, last: torch.Tensor | None) -> Any:
        """SGLang's first aux output must be what the model load promised; returns the producer."""
        if self.producer is None:
            raise RuntimeError(f"no producer: SGLang never called {_MODEL_LOADED}, where hscapture starts it")
        width = self.hidden * len(self.layers)
        if aux.shape[1] != width:
            raise RuntimeError(
                f"SGLang's aux states are {aux.shape[1]} wide, not {len(self.layers)} layers {list(self.layers)} "
                f"of hidden size {self.hidden}"
            )
        if dtype_name(aux.dtype) != self.producer.config.dtype:
            raise RuntimeError(f"SGLang's aux states are {aux.dtype}, not the model's {self.producer.config.dtype}")
        if self.settings.capture_last and last is None:
            raise RuntimeError("SGLang returned no last_hidden_states; set capture_last false or update SGLang")
        self.checked = True
        return self.producer

    def _fail(self, exc: BaseException) -> None:
        """Capture failed while serving: log the cause, end the producer's run with it, serve on."""
        cause = f"{type(exc).__name__}: {exc}"
        log.error("hscapture: capture failed, serving goes on without it: %s", cause, exc_info=exc)
        self._shut("capture failed", error=cause)

    def _shut(self, why: str, error: str = "") -> None:
        self.enabled = False
        producer, self.producer = self.producer, None
        if producer is not None:
            try:
                producer.close(error=error)
            except Exception:
                log.exception("hscapture: closing the producer (%s) failed", why)
