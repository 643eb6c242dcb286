"""SGLang integration: a general plugin that captures from inside SGLang's scheduler process.

SGLang loads every entry point of the ``sglang.srt.plugins`` group in each of its processes
(``srt/plugins/__init__.py:load_plugins``). This one is inert unless :data:`ENV` holds capture
settings; then it registers six hooks through SGLang's ``HookRegistry`` (no source edits):

* AFTER ``TpModelWorker.init_attention_backends``: the model is loaded and SGLang has set its
  aux layers (before any CUDA graph is captured). The plugin checks the model against
  :mod:`hscapture.integrations.sglang_models` (which tensor this architecture captures, which
  layers) and starts the producer; anything wrong stops SGLang from starting, with the reason.
* AFTER ``TpModelWorker.forward_batch_generation``: the forward output and the batch's
  requests meet here. With ``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3``
  SGLang keeps, for every token of every batch, the concatenated aux states
  (``logits_output.hidden_states``) and the post-norm last layer (``.last_hidden_states``),
  inside CUDA graphs too; after a graph replay both are views the next replay overwrites, so
  the producer copies them into its ring at once (a device copy, no host sync). On a GPU the
  copy of a decode step that replays one of SGLang's decode graphs is in the graph itself: the
  plugin adds it at capture through ``ModelRunner.capture_tail_hooks``
  (:meth:`SGLangCapture.attach_graphs`), and the hook only writes where the rows go into the
  copy's plan table in mapped host memory (``GraphRows``), with no launch of its own; other
  forwards (extend, mixed, batches past the largest graph) are copied by one launch. Decode steps
  of the same requests go into one slot, one after another (a *decode run*: up to
  :data:`hscapture.producer.RUN_STEPS` steps, or a full slot), announced as one chunk: the announcement's work
  (token ids, the chunk, the sockets) is paid once per run, not per step.
* AFTER ``Scheduler.process_batch_result``: announces the rows whose token ids the host now
  holds, then ends the requests that finished or were aborted (with their retraction count).
* AROUND ``Scheduler.handle_rpc_request``: ``Engine.collective_rpc(CLOSE_RPC)`` closes the
  producer cleanly (end of stream) before an offline engine shuts down.
* AFTER ``Scheduler.handle_shutdown``: SGLang's graceful stop (SIGTERM to the server: it drains its
  requests, then sends each scheduler a ``ShutdownReq``) closes the producer the same way, so the
  store records a clean end, not a producer that died.
* AFTER ``TokenizerManager._create_tokenized_object`` (in the server's process): marks the requests
  SGLang makes for itself, which are no samples and are never captured (:data:`OWN_PARAM`).

SGLang's own requests: its health checks (``/health``, ``/health_generate``: SGLang's
``is_health_check_generate_req``), and, with ``PluginSettings.http_server``, what the tokenizer
takes while the server says it is starting (``ServerStatus.Starting``, ``/health`` answers 503):
SGLang's warm-up request. The mark travels to the scheduler in the request's
``sampling_params.custom_params`` (SGLang's own channel from tokenizer to scheduler); the
forward hook keeps none of their rows and no record of them is sent. They also get a radix-cache
namespace of their own (``cache_salt``): a request must never take a prefix from one of them (a
health check's ``input_ids=[0]`` is many tokenizers' BOS), since the store has no rows to serve it.

Fewer rows where the user wants fewer (:mod:`hscapture.selection`): with ``PluginSettings.positions``
(``extract --engine sglang --positions``) each forward's rows are filtered per request before the copy
(:class:`~hscapture.integrations.sglang_select.RowFilter`; decode steps then go by index, as batches
holding SGLang's own requests do); with ``PluginSettings.sample_rate`` (``serve --sample-rate``) the
tokenizer hook marks the requests not sampled as it marks SGLang's own, so the scheduler's hooks skip them.

Rows are attributed from the ``ScheduleBatch``'s host-side lengths: extend and mixed batches
hold contiguous blocks of ``extend_lens[i]`` rows at positions ``prefix_lens[i] + j``; decode
batches one row per request at ``seq_lens_cpu[i] - 1``. A position a request already sent
(re-prefill after a retraction) is not sent again.

No hook reads a device tensor on the host. Under SGLang's overlap scheduler (on by default on
GPUs) a decode step's input tokens are still on the device when its forward is launched, so
the forward hook copies the rows into the ring at once (``Producer.write_step``, or
``Producer.extend_step`` for the next step of a decode run, on the forward stream) and the rows
are announced (``Producer.announce_step``) from a later ``process_batch_result`` hook, once their
run is closed and each request's host copy (``origin_input_ids`` + ``output_ids``) holds their
token ids: under overlap that is the result of the step before, processed right after this
forward was launched. A decode run closes when the batch's requests change, when a forward
other than decode comes, when it is full, and before any of its requests is finished: a
request is finished only after every row of it is announced.

A failure once serving runs never takes serving down: the plugin logs the cause, ends the
producer's run with it (the consumer records it in the store, logs it, shows it on its stats
line and counts it in ``hscapture_producer_failures_total``; ``hscapture consume --exit-on-eos``
then exits with status 1, which ends an ``hscapture extract`` at once) and serves on without capture.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import subprocess
import sys
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np
import torch

from hscapture.config import dtype_name
from hscapture.integrations.engines import (
    EngineCapture,
    EngineSettings,
    LoadedModel,
    ServeCapture,
    ServerLaunch,
    option_value,
)
from hscapture.integrations.engines import endpoint_for as endpoint_for  # the launchers import it here
from hscapture.integrations.sglang_select import LOSS_MASK_PARAM as LOSS_MASK_PARAM  # the launchers import it here
from hscapture.integrations.sglang_select import RowFilter, loss_mask
from hscapture.selection import Positions, sampled

if TYPE_CHECKING:
    from hscapture.producer import WrittenStep
    from hscapture.producer.row_kernel import GraphRows

log = logging.getLogger(__name__)

#: Environment variable holding :class:`PluginSettings` as JSON; unset = the plugin is inert.
ENV = "HSCAPTURE_SGLANG"
#: ``Engine.collective_rpc`` method name that closes the producer (end of stream).
CLOSE_RPC = "hscapture_close"
#: ``sampling_params["custom_params"]`` key set on the requests SGLang makes for itself ("warm-up",
#: "health check"): never captured.
OWN_PARAM = "hscapture_sglang_own"
#: Radix-cache namespace (``cache_salt``) of those requests: nothing they computed is taken as another's prefix.
OWN_CACHE_SALT = "hscapture-sglang-own"

_MODEL_LOADED = "sglang.srt.managers.tp_worker.TpModelWorker.init_attention_backends"
_FORWARD = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
_BATCH_RESULT = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
_RPC = "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request"
_SHUTDOWN = "sglang.srt.managers.scheduler.Scheduler.handle_shutdown"
_TOKENIZED = "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"


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
class PluginSettings(EngineSettings):
    """What the plugin needs to know, passed to SGLang's processes through :data:`ENV`; the fields every engine shares
    are :class:`~hscapture.integrations.engines.EngineSettings`' (with attention data parallelism each DP group has
    its own endpoint)."""

    ENV: ClassVar[str] = ENV

    #: hscapture layer ids the launcher asked SGLang for; the plugin refuses a model that captures
    #: others. None: whatever SGLang's aux flags chose.
    layers: list[int] | None = None
    #: On a GPU, copy decode rows from inside SGLang's decode CUDA graphs (no launch per step); False: one
    #: launch per step from the forward hook, as for every forward SGLang runs without a graph.
    graph_copy: bool = True
    #: SGLang runs its HTTP server (``hscapture serve``): requests its tokenizer takes while the server says it is
    #: starting are its own warm-up, not captured. False for ``sglang.Engine``, which never says it is up.
    http_server: bool = False
    #: The positions of each request to keep (:class:`~hscapture.selection.Positions`: ``all``, ``loss``, ``last``,
    #: ``every:K``); rows at the others never reach the ring.
    positions: str = "all"


#: SGLang arguments for a host without a GPU (what its CPU path supports).
CPU_SERVER_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
CPU_ENGINE_KWARGS: dict[str, Any] = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True}
#: KV pool on SGLang's CPU path, in tokens, where the user's arguments do not size it. Left to SGLang, that path
#: sizes the pool from the host's free memory (a --mem-fraction-static share of it, gigabytes) and zero-fills all
#: of it at each start: ~30 s of a 2-core host's start, before the first token.
CPU_POOL_TOKENS = 1 << 16


def cpu_server_args(args: Sequence[str]) -> list[str]:
    """:data:`CPU_SERVER_ARGS` for a run given ``args``, with a pool of :data:`CPU_POOL_TOKENS` unless they size it."""
    if option_value(args, "--max-total-tokens", "--mem-fraction-static") is not None:
        return list(CPU_SERVER_ARGS)
    return [*CPU_SERVER_ARGS, "--max-total-tokens", str(CPU_POOL_TOKENS)]


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


def server_launch(args: list[str], capture: ServeCapture) -> ServerLaunch:
    """``python -m sglang.launch_server ARGS`` with the aux flags and the plugin's settings; one capture stream per
    attention-DP group.

    Raises:
        ValueError: no ``--model-path``, pipeline parallelism, an architecture or layers SGLang's capture cannot give.
    """
    from hscapture.integrations.sglang_models import launch_plan

    model = option_value(args, "--model-path", "--model")
    if model is None:
        raise ValueError("give SGLang's --model-path after --, e.g. hscapture serve --out DIR -- --model-path M")
    if int(option_value(args, "--pp-size", "--pipeline-parallel-size") or 1) > 1:
        raise ValueError("hscapture cannot capture with pipeline parallelism (--pp-size > 1); use TP or DP")
    streams = int(option_value(args, "--dp-size", "--data-parallel-size") or 1)
    plan = launch_plan(model, capture.layers)  # refuses what SGLang's capture cannot give, before it starts
    settings = PluginSettings(
        endpoint=capture.endpoint,
        capture_last=capture.capture_last,
        policy=capture.policy,
        slot_bytes=capture.slot_bytes,
        ring_bytes=capture.ring_bytes,
        meta=capture.meta,
        graph_copy=capture.graph_copy,
        layers=list(plan.layers),
        http_server=True,
        sample_rate=capture.sample_rate,
    )
    extra = server_args(plan.sglang_ids)
    env = {ENV: settings.to_env()}
    cpu_env = cpu_host_env()
    if cpu_env:  # no NVIDIA driver here: SGLang's CPU path
        env.update(cpu_env)
        if option_value(args, "--device") is None:
            extra += cpu_server_args(args)
    return ServerLaunch(
        name="SGLang",
        command=[sys.executable, "-m", "sglang.launch_server", *args, *extra],
        env=env,
        streams=streams,
        on_stop="SGLang finishes the requests it serves, then capture ends",
    )


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
    HookRegistry.register(_SHUTDOWN, capture.after_shutdown, HookType.AFTER)
    HookRegistry.register(_TOKENIZED, capture.after_tokenize, HookType.AFTER)


def _parallel() -> Any:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


#: Forwards whose rows may wait for their token ids at once (SGLang's loops leave at most one);
#: a forward beyond that stops capture: the host never got the ids, or results are not processed.
MAX_PENDING = 4


class _Rows(NamedTuple):
    """A batch's rows as the host sees them: per kept block of rows, then per kept row."""

    rids: Sequence[str]
    reqs: list[Any]
    #: First position of each block (None for decode: ``positions``), and its rows.
    firsts: list[int] | None
    counts: Sequence[int]
    #: ``[R]`` int64 position of each kept row.
    positions: np.ndarray
    #: ``[R]`` int64 index of each kept row among the batch's rows; None when all are kept.
    keep: np.ndarray | None
    #: Rows in the batch (kept or not).
    total: int
    #: Under ``--positions``: the kept rows' runs of consecutive positions (their requests, first positions and
    #: rows), where they differ from one block per request.
    runs: tuple[list[Any], list[int], list[int]] | None = None


class _DecodePlan(NamedTuple):
    """What a decode batch's rows owe to its requests alone, worked out once while SGLang decodes the
    same requests step after step (flashinfer's habit: plan on a change, then only run)."""

    #: The batch's requests (a copy: SGLang edits its list in place), compared by identity each step.
    reqs: list[Any]
    #: Of the requests captured, in batch order. Tuples: the producer checks and encodes the same tuples once
    #: (``Producer.write_step``).
    rids: tuple[str, ...]
    ones: tuple[int, ...]
    prompt_lens: np.ndarray
    #: ``[K]`` int64 row of each captured request in the batch; None when every request is captured (SGLang's own
    #: are not: :func:`_sglangs_own`).
    keep: np.ndarray | None = None

    @classmethod
    def of(cls, reqs: list[Any]) -> _DecodePlan:
        reqs = list(reqs)
        captured = [not _sglangs_own(req) for req in reqs]
        keep = None if all(captured) else np.flatnonzero(captured)
        kept = reqs if keep is None else [reqs[i] for i in keep]
        prompts = np.fromiter((len(req.origin_input_ids) for req in kept), np.int64, len(kept))
        return cls(reqs, tuple(req.rid for req in kept), (1,) * len(kept), prompts, keep)

    def rows(self, seq_lens: torch.Tensor) -> _Rows:
        """A step's rows of the captured requests of a batch that holds SGLang's own (``keep``): one each, at
        ``seq_lens_cpu[i] - 1``."""
        keep = self.keep if self.keep is not None else np.arange(len(self.reqs))
        positions = np.subtract(seq_lens.numpy()[keep], 1, dtype=np.int64)
        reqs = [self.reqs[i] for i in keep]
        return _Rows(self.rids, reqs, positions.tolist(), self.ones, positions, keep, len(self.reqs))


class _Pending(NamedTuple):
    """An extend or mixed forward's rows, copied into the ring already, waiting for the host to hold their
    token ids."""

    step: WrittenStep
    #: The request owning each block of kept rows, in row order.
    reqs: list[Any]
    #: First position of each block, and its rows.
    firsts: list[int]
    counts: Sequence[int]
    #: ``[R]`` int64 position of every kept row.
    positions: np.ndarray

    def tokens(self) -> np.ndarray | None:
        return _tokens(self.reqs, self.firsts, self.counts)


class _DecodeRun:
    """Decode steps of the same requests in one slot (``Producer.extend_step``), announced together: row
    ``s * N + i`` is request ``i``'s row of step ``s``, at ``seq_lens_cpu[i] - 1`` of that step.

    Each step keeps the batch's ``seq_lens_cpu`` as it is (SGLang makes a new tensor for every
    batch and clones before it edits one); positions and token ids are worked out once for all
    the steps, when they are announced.
    """

    __slots__ = ("plan", "seq_lens", "step")

    def __init__(self, step: WrittenStep, plan: _DecodePlan, seq_lens: torch.Tensor) -> None:
        self.step = step
        self.plan = plan
        self.seq_lens = [seq_lens]

    @property
    def reqs(self) -> list[Any]:
        return self.plan.reqs

    def positions(self) -> np.ndarray:
        """``[steps * N]`` int64 position of every row, step after step."""
        lens = self.seq_lens
        if len(lens) == 1:
            return np.subtract(lens[0].numpy(), 1, dtype=np.int64)
        return np.subtract(torch.stack(lens).numpy(), 1, dtype=np.int64).reshape(-1)

    def tokens(self, positions: np.ndarray) -> np.ndarray | None:
        """``[steps * N]`` token ids of the rows (see :func:`_tokens`): each request's are its output ids from
        its first row's on, one slice per request when every step moved each request on by one position."""
        plan, steps = self.plan, len(self.seq_lens)
        n = len(plan.reqs)
        by_step = positions.reshape(steps, n)
        offsets = by_step[0] - plan.prompt_lens
        if offsets.min() >= 0 and (steps == 1 or (by_step[1:] - by_step[:-1] == 1).all()):
            tokens = array("q")
            for req, first in zip(plan.reqs, offsets.tolist()):
                part = req.output_ids[first : first + steps]
                if len(part) < steps:  # not on the host yet, or past a request's end: the general path says which
                    break
                tokens.extend(part)
            else:
                return np.frombuffer(tokens, np.int64).reshape(n, steps).T.reshape(-1)
        return _tokens(plan.reqs * steps, positions.tolist(), (1,) * (steps * n))


class SGLangCapture(EngineCapture, engine="sglang", layers_key="sglang_layers_to_capture", logger=log):
    """Per scheduler process: turns SGLang batches into ``Producer`` calls."""

    def __init__(self, settings: PluginSettings) -> None:
        super().__init__(settings)
        #: Set at model load: the width of each layer SGLang's aux output holds.
        self.hidden = 0
        #: Whether SGLang's first output matched what the model load promised.
        self.checked = False
        #: Next position each running request has not sent yet (skips re-prefilled rows); the last
        #: decode step's ``seq_lens_cpu`` is kept aside in ``_decoded`` until something reads it (``_fold``).
        self.sent_upto: dict[str, int] = {}
        self._plan: _DecodePlan | None = None
        self._decoded: torch.Tensor | None = None
        #: The decode run later steps of the same requests may still join (the newest of ``pending``), and
        #: how many steps a run takes at most.
        self._run: _DecodeRun | None = None
        from hscapture.producer import RUN_STEPS

        self.run_steps = RUN_STEPS
        #: Prefix length at first schedule of each running request that hit the radix cache (never forwarded).
        self.cached_prefix: dict[str, int] = {}
        #: Forwards written to the ring, oldest first, not announced yet.
        self.pending: deque[_Pending | _DecodeRun] = deque()
        #: The producer served its control socket (releases, attaches) since the last batch result.
        self.served = False
        #: The ring's writer inside SGLang's decode graphs, and the model runner whose graphs hold it
        #: (:meth:`attach_graphs`); kept for the process's life: the graphs read its plan table.
        self.graph: GraphRows | None = None
        self._graph_runner_owner: Any = None
        #: The positions kept of each request (``--positions``); None: every one.
        selection = Positions.parse(settings.positions, "positions")
        self.filter = None if selection.everything else RowFilter(selection)

    # --- hooks -------------------------------------------------------------------------

    def after_model_load(self, result: Any, worker: Any, *args: Any, **kwargs: Any) -> None:
        """Check the loaded model and start the producer; raising here stops SGLang before it serves."""
        if not getattr(worker, "is_draft_worker", False):
            self._start(worker)

    def after_forward(self, result: Any, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> None:
        if batch is None:
            return
        # The hot path (a decode step, on a GPU a graph replay) asks each question once, in this one frame.
        mode = batch.forward_mode
        decode = mode.is_decode()
        graph = self.graph
        replay = graph is not None and getattr(result, "can_run_cuda_graph", False) and (decode or mode.is_idle())
        if replay:  # a replay of a decode graph: its copy waits for an entry
            graph.launched()  # type: ignore[union-attr]
        try:
            if not self.enabled or not batch.reqs or kwargs.get("is_verify"):
                return
            output = getattr(result, "logits_output", None)
            if output is None or (not decode and mode.is_idle()):
                return
            self.served = True
            try:
                if decode:
                    self._decode(batch, output)
                else:
                    self._extend(batch, output)
            except Exception as exc:  # capture must never take serving down: say why, stop capturing, serve on
                self._fail(exc)
        finally:
            if replay and graph.pending:  # type: ignore[union-attr]  (planned: no call)
                graph.settle()  # type: ignore[union-attr]

    def after_batch_result(self, result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
        if self.producer is None or not self.enabled:
            return
        try:
            if self.graph is not None and self.graph.failed:
                raise RuntimeError(
                    f"a decode graph's ring copy found no plan entry within {self.graph.wait_s:g} s (a replay the "
                    "plugin never saw); set graph_copy false to copy with a launch per step"
                )
            # finished_reason is what Req.finished() reads; the attribute saves a call per request.
            finished = [r for r in batch.reqs if r.finished_reason is not None]
            if finished:
                self._run = None  # its rows go out before these requests end
            pending = self.pending
            if pending and pending[0] is not self._run:  # (the open run alone: nothing to announce, no call)
                self._announce_ready()
            if finished:
                self._fold()
                for req in finished:
                    if req.rid in self.sent_upto:  # ours, and not finished yet (the overlap loop shows it twice)
                        self._finish(req)
            if not self.served:  # no forward wrote since the last result: the engine may be idle
                self.producer.poll()
            self.served = False
        except Exception as exc:
            self._fail(exc)

    def attach_graphs(self, model_runner: Any) -> None:
        """Put the ring write into the decode CUDA graphs ``model_runner`` captures from now on.

        SGLang calls each of ``model_runner.capture_tail_hooks`` inside every decode graph's capture, after
        the forward; there :meth:`_graph_tail` adds the copy of the graph's aux and last outputs. A decode
        step that replays such a graph then writes its rows by a plan entry, not a launch
        (:class:`~hscapture.producer.row_kernel.GraphRows`). Nothing changes where graphs are off (a CPU,
        ``--disable-cuda-graph``), for batches past the largest graph, or with ``graph_copy`` false.
        """
        hooks = getattr(model_runner, "capture_tail_hooks", None)
        if hooks is None or not self.settings.graph_copy or self.producer is None:
            return
        graph = self.producer.graph_rows()
        if graph is None:
            return
        self.graph, self._graph_runner_owner = graph, model_runner
        hooks.append(self._graph_tail)

    def _graph_tail(self, graph_runner: Any, out: Any, forward_batch: Any, num_tokens: int) -> None:
        """SGLang's capture tail hook: inside a decode graph's capture, queue the copy of its outputs."""
        graph = self.graph
        if (
            graph is None
            or getattr(graph_runner, "model_runner", None) is not self._graph_runner_owner
            or not forward_batch.forward_mode.is_decode()
            or not torch.cuda.is_current_stream_capturing()
        ):
            return
        try:
            aux = out.hidden_states
            if aux is None:
                raise ValueError("the graph's output has no aux hidden states")
            graph.capture((aux, out.last_hidden_states) if self.settings.capture_last else (aux,))
        except ValueError as exc:  # the graphs captured so far copy nothing from now on; every step launches
            log.warning("hscapture: decode rows go by a launch per step, not from the graph: %s", exc)
            graph.off()

    def around_rpc(self, original: Any, scheduler: Any, request: Any) -> Any:
        if getattr(request, "method", None) != CLOSE_RPC:
            return original(scheduler, request)
        from sglang.srt.managers.io_struct import RpcReqOutput

        self._shut("closed by the engine")
        return RpcReqOutput(success=True, message="")

    def after_shutdown(self, result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        """SGLang stops gracefully (it drained its requests; the scheduler's loop ends next): end the stream."""
        self._shut("SGLang shut down")

    def after_tokenize(self, result: Any, manager: Any, *args: Any, **kwargs: Any) -> None:
        """In the tokenizer's process: mark a request SGLang made for itself (:data:`OWN_PARAM`) so that the
        scheduler's hooks keep none of it, and keep its prefix out of the others' reach (:data:`OWN_CACHE_SALT`).
        Never raises: a request must not fail for capture's sake."""
        try:
            from sglang.srt.managers.tokenizer_manager import ServerStatus
            from sglang.srt.managers.utils import is_health_check_generate_req

            if is_health_check_generate_req(result):
                why = "health check"
            elif self.settings.http_server and manager.server_status == ServerStatus.Starting:
                why = "warm-up"
                log.info("hscapture: not capturing request %s: SGLang is starting (its warm-up)", result.rid)
            elif not sampled(str(result.rid), self.settings.sample_rate):
                why = "not sampled"  # its own cache namespace too: no sampled request takes a prefix it computed
            else:
                return
            params = result.sampling_params
            params.custom_params = {**(params.custom_params or {}), OWN_PARAM: why}
            result.cache_salt = f"{result.cache_salt}|{OWN_CACHE_SALT}" if result.cache_salt else OWN_CACHE_SALT
        except Exception:
            log.exception("hscapture: could not tell whether a request is SGLang's own; it is captured")

    # --- work ---------------------------------------------------------------------------

    def _states(self, output: Any) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """The producer (checked against SGLang's first output) and the forward's states: the aux layers side by
        side (``[N, layers * hidden]``) and the last layer; one write puts both into the slot."""
        aux = output.hidden_states
        if aux is None:
            raise RuntimeError(
                "SGLang returned no aux hidden states: start it with " + " ".join(server_args()) + " (hscapture serve "
                "and hscapture extract --engine sglang add them)"
            )
        producer = self.producer if self.checked else self._check_first_output(aux, output.last_hidden_states)
        return producer, (aux, output.last_hidden_states) if self.settings.capture_last else (aux,)

    def _decode(self, batch: Any, output: Any) -> None:
        """A decode step's rows into the ring now (the hot path: nothing per step beyond what the producer
        keeps); the same requests as the step before join its decode run."""
        producer, states = self._states(output)
        seq_lens, plan = batch.seq_lens_cpu, self._plan
        if seq_lens is None or plan is None or batch.reqs != plan.reqs:  # (the same requests: no call)
            plan = self._decode_plan(batch)  # it folds the last step's lengths first
        self._decoded = seq_lens
        if plan.keep is not None or self.filter is not None:  # SGLang's own requests decode here too, or a selection
            self._extend(batch, output, plan.rows(seq_lens))
            return
        run = self._run
        # The producer checks a step that joins the run (a graph replay's by its owners alone: the graph's copy
        # takes its own outputs); the rest here, with the batch in the message.
        if (
            run is not None
            and run.plan is plan
            and len(run.seq_lens) < self.run_steps
            and producer.extend_step(run.step, states, plan.rids, plan.ones)
        ):
            run.seq_lens.append(seq_lens)
            return
        if states[0].shape[0] != len(plan.reqs):
            raise self._mismatch(batch, len(plan.reqs), states[0])
        if len(self.pending) >= MAX_PENDING:
            raise self._backlog()
        step = producer.write_step(states, plan.rids, plan.ones, extendable=True)
        self._run = _DecodeRun(step, plan, seq_lens) if step.written else None
        if self._run is not None:
            self.pending.append(self._run)

    def _extend(self, batch: Any, output: Any, rows: _Rows | None = None) -> None:
        """An extend or mixed forward's rows into the ring now (host metadata only); announced later. ``rows``: a
        decode step's rows when the batch holds SGLang's own requests (:meth:`_DecodePlan.rows`)."""
        producer, states = self._states(output)
        self._run = None  # decode steps after this forward start a run of their own
        rows = self._rows(batch) if rows is None else rows
        if states[0].shape[0] != rows.total:
            raise self._mismatch(batch, rows.total, states[0])
        if self.filter is not None and rows.rids:
            rows = self._selected(rows)
        if not rows.rids:
            return
        if len(self.pending) >= MAX_PENDING:
            raise self._backlog()
        from hscapture.producer import device_index  # the plugin's module loads in every SGLang process: lazily

        row_index = None if rows.keep is None else device_index(rows.keep, states[0].device)
        step = producer.write_step(states, rows.rids, rows.counts, row_index)
        if step.written:
            runs = rows.runs or (rows.reqs, rows.firsts, rows.counts)
            self.pending.append(_Pending(step, *runs, rows.positions))  # type: ignore[arg-type]

    def _selected(self, rows: _Rows) -> _Rows:
        """Of a forward's kept rows, those at the positions ``--positions`` asks for (:class:`RowFilter`)."""
        assert self.filter is not None
        kept = self.filter.select(rows.reqs, rows.counts, rows.positions)
        if kept is None:
            return rows
        keep = kept.local if rows.keep is None else rows.keep[kept.local]
        runs = (kept.reqs, kept.firsts, kept.runs)
        return _Rows(kept.rids, kept.reqs, None, kept.counts, rows.positions[kept.local], keep, rows.total, runs)

    @staticmethod
    def _mismatch(batch: Any, total: int, aux: torch.Tensor) -> RuntimeError:
        return RuntimeError(
            f"batch of {len(batch.reqs)} requests ({batch.forward_mode.name}) has "
            f"{total} tokens but SGLang returned {aux.shape[0]} hidden-state rows"
        )

    def _backlog(self) -> RuntimeError:
        oldest = self.pending[0]
        return RuntimeError(
            f"{len(self.pending)} forwards wait to be announced: the host never got their token ids, or no "
            f"batch result was processed since (oldest: step {oldest.step.step}, requests "
            f"{[r.rid for r in oldest.reqs][:8]})"
        )

    def _decode_plan(self, batch: Any) -> _DecodePlan:
        """A decode batch's requests: one fresh row per request at ``seq_lens_cpu - 1``, nothing ever skipped."""
        if batch.seq_lens_cpu is None:
            raise RuntimeError("SGLang gave a decode batch without seq_lens_cpu; cannot place its rows")
        plan = self._plan
        if plan is None or batch.reqs != plan.reqs:  # same requests: an identity check of each, in C
            self._fold()
            plan = self._plan = _DecodePlan.of(batch.reqs)
        return plan

    def _fold(self) -> None:
        """Record the last decode step's positions in ``sent_upto`` before anything reads it."""
        plan = self._plan
        if self._decoded is not None and plan is not None:
            lens = self._decoded if plan.keep is None else self._decoded.numpy()[plan.keep]
            self.sent_upto.update(zip(plan.rids, lens.tolist()))
        self._decoded = None

    def _rows(self, batch: Any) -> _Rows:
        """Which rows of an extend or mixed batch to keep and whose they are, from host-side lengths only."""
        self._fold()
        reqs = list(batch.reqs)
        sent = self.sent_upto
        starts = np.asarray(batch.prefix_lens, dtype=np.int64)
        lengths = np.asarray(batch.extend_lens, dtype=np.int64)
        total = int(lengths.sum())
        ends = starts + lengths
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
        all_rids = [req.rid for req in reqs]
        upto = np.fromiter((sent.get(rid, 0) for rid in all_rids), np.int64, len(all_rids))
        own = [i for i, req in enumerate(reqs) if _sglangs_own(req)]
        upto[own] = ends[own]  # SGLang's own requests: none of their rows is kept
        for i in np.flatnonzero(starts).tolist():  # first scheduled past position 0: a radix-cache hit
            if all_rids[i] not in sent:
                self.cached_prefix[all_rids[i]] = int(starts[i])
        sent.update(zip(all_rids, np.maximum(ends, upto).tolist()))
        for i in own:  # and no record of them: never in sent_upto, never finished
            del sent[all_rids[i]]
            self.cached_prefix.pop(all_rids[i], None)
        firsts = np.maximum(starts, upto)
        counts = np.maximum(ends - firsts, 0)
        kept = np.flatnonzero(counts)
        keep = None
        if len(kept) != len(reqs) or (counts[kept] != lengths[kept]).any():
            keep = np.flatnonzero(positions >= np.repeat(upto, lengths))
            positions = positions[keep]
        rids = [all_rids[i] for i in kept] if keep is not None else all_rids
        reqs = [reqs[i] for i in kept] if keep is not None else reqs
        return _Rows(rids, reqs, firsts[kept].tolist(), counts[kept].tolist(), positions, keep, total)

    def _announce_ready(self) -> None:
        """Announce, oldest first, every written forward whose token ids the host now holds; the open decode
        run (``_run``) stays, for the steps that may join it."""
        while self.pending and self.pending[0] is not self._run:
            pending = self.pending[0]
            if isinstance(pending, _DecodeRun):
                positions = pending.positions()
                tokens = pending.tokens(positions)
            else:
                positions, tokens = pending.positions, pending.tokens()
            if tokens is None:
                return
            self.pending.popleft()
            self.producer.announce_step(pending.step, positions, tokens)

    def _finish(self, req: Any) -> None:
        if any(r is req for pending in self.pending for r in pending.reqs):
            raise RuntimeError(
                f"request {req.rid} ended while rows of it wait for token ids the host does not hold; "
                "they cannot be announced before its end"
            )
        num_tokens = len(req.origin_input_ids) + len(req.output_ids) - 1
        reason = "aborted" if type(req.finished_reason).__name__ == "FINISH_ABORT" else "finished"
        finish = req.finished_reason.to_json() if req.finished_reason is not None else None
        meta = {
            "prompt_tokens": len(req.origin_input_ids),
            "output_tokens": len(req.output_ids),
            "finish_reason": finish,
            "retractions": req.retraction_count,
        }
        prefix = req.origin_input_ids[: self.cached_prefix.pop(req.rid, 0)]
        self.producer.finish_request(
            req.rid,
            reason,
            num_tokens=num_tokens,
            loss_mask=loss_mask(req, num_tokens),
            meta=meta,
            prefix_token_ids=prefix,
            positions="" if self.filter is None else str(self.filter.selection),
        )
        self.sent_upto.pop(req.rid, None)

    def _start(self, worker: Any) -> None:
        """At model load: check the architecture and its aux layers, then create the producer.

        Raises:
            RuntimeError: pipeline parallelism, or a model whose capture hscapture cannot describe
                (see :func:`hscapture.integrations.sglang_models.captured_layers`).
        """
        from hscapture.integrations.sglang_models import captured_layers

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
        import sglang

        # One stream per DP group: attention-DP ranks inside one TP group, or DP replicas.
        replica = getattr(parallel, "dp_rank", None)
        loaded = LoadedModel(
            version=sglang.__version__,
            model=str(model_config.model_path),
            hidden_size=self.hidden,
            num_layers=num_layers,
            dtype=model_config.dtype,
            max_rows=int(getattr(worker, "max_num_tokens", 0) or 8192),
            dp_rank=int(replica if replica is not None else getattr(parallel, "attn_dp_rank", 0)),
            dp_size=int(getattr(parallel, "dp_size", 1) or 1),
            device="cpu" if str(runner.device) == "cpu" else f"cuda:{torch.cuda.current_device()}",
        )
        config = self._open(arch.name, arch.describe(self.layers, self.settings.capture_last), loaded)
        self.attach_graphs(runner)
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


def _sglangs_own(req: Any) -> bool:
    """Whether SGLang made ``req`` for itself (warm-up, health check): marked at tokenization
    (:meth:`SGLangCapture.after_tokenize`), never captured."""
    params = getattr(req.sampling_params, "custom_params", None)
    return isinstance(params, dict) and OWN_PARAM in params


def _tokens(reqs: Sequence[Any], firsts: Sequence[int], counts: Sequence[int]) -> np.ndarray | None:
    """``[R]`` token ids of blocks of rows: ``counts[i]`` rows of ``reqs[i]`` from position ``firsts[i]``, from
    each request's host copy.

    A request's token at position ``p`` is ``(origin_input_ids + output_ids)[p]``. Returns None
    while some row's token is not on the host yet (its step's result is not processed). A row
    past the end of a request that ended (the overlap scheduler's step after a finish, or an
    output SGLang discarded) gets -1; the store cuts such rows (``surplus_rows``).
    """
    tokens = array("q")
    for req, first, count in zip(reqs, firsts, counts):
        prompt = req.origin_input_ids
        n = len(prompt)
        if first >= n:
            part = req.output_ids[first - n : first - n + count]
        elif first + count <= n:
            part = prompt[first : first + count]
        else:
            part = [*prompt[first:], *req.output_ids[: first + count - n]]
        if len(part) < count:
            if req.finished_reason is None and not req.is_retracted:
                return None
            part = [*part, *[-1] * (count - len(part))]
        tokens.extend(part)
    return np.frombuffer(tokens, dtype=np.int64)
