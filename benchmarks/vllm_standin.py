"""Stand-ins for vLLM's V1 engine and its step loop, to drive the vLLM plugin's hooks without vLLM.

vLLM cannot be installed beside the lent GPU's torch (it pins its own), yet the hooks of
:class:`hscapture.integrations.vllm.VLLMCapture` must be checked for host-device syncs on a GPU. These classes carry
what the hooks read, with vLLM 0.32's names and types: here EngineCore's side (``Request``, ``RequestStatus``, the
``Scheduler`` and its ``SchedulerOutput`` with ``NewRequestData``, ``CachedRequestData`` and ``finished_req_ids``),
in :mod:`benchmarks.vllm_worker_standin` the worker's (the V1 model runner and its persistent batch).
``tests/test_vllm_hooks.py`` checks them against vLLM's own classes where vLLM is installed.

:class:`EngineLoop` runs requests the way ``EngineCore.step`` does with sync scheduling: the front end adds and aborts
requests; the scheduler schedules running requests first, then waiting ones, chunked to a token budget, and preempts
where told; the runner updates its batch and runs the forward, then samples (the host sync vLLM makes there, outside
the hooks); the scheduler appends the tokens and frees finished requests, and steps once more, with nothing
scheduled, to tell the workers of the last ones. The plugin's own ``patch_*`` methods wrap these classes (fresh
subclasses per loop) as they wrap vLLM's, so its hooks run where vLLM would run them, with vLLM's arguments.
"""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from benchmarks.vllm_worker_standin import GPUModelRunner, ModelRunnerOutput, Worker
from hscapture.config import CaptureConfig
from hscapture.integrations.vllm import PluginSettings, VLLMCapture
from hscapture.integrations.vllm_models import architecture
from hscapture.producer import Producer


# -- EngineCore's side: requests and the scheduler --------------------------------------------------------------------
class RequestStatus(enum.IntEnum):
    """``v1/request.RequestStatus``, up to the finished states the loop uses (vLLM's values)."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


@dataclass
class SamplingParams:
    """``sampling_params.SamplingParams``: what the plugin reads of it."""

    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    extra_args: dict[str, Any] | None = None


class Request:
    """``v1/request.Request``: a request as the scheduler holds it."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.output_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)


@dataclass
class NewRequestData:
    """``v1/core/sched/output.NewRequestData``: a request the workers see for the first time."""

    req_id: str
    prompt_token_ids: list[int] | None
    sampling_params: SamplingParams | None
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """``v1/core/sched/output.CachedRequestData``: the scheduled requests the workers know already (``resumed_req_ids``:
    those back from a preemption, whose KV cache was freed)."""

    req_ids: list[str]
    resumed_req_ids: set[str]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """``v1/core/sched/output.SchedulerOutput``: one step's plan, sent to every worker."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    #: Requests freed since the step before.
    finished_req_ids: set[str]
    preempted_req_ids: set[str] | None = None


class Scheduler:
    """``v1/core/sched/scheduler.Scheduler`` with chunked prefill: running requests first, then waiting ones (a
    preempted request first among them), each up to what is left of ``max_num_batched_tokens``.

    Two knobs stand for what the stand-in model cannot produce: ``preempt_next`` (requests whose KV blocks run out at
    the next ``schedule``: vLLM frees them and puts them back first in the queue, to be prefilled again, outputs
    included) and ``stop_at`` (a request's output count at which it samples a stop token).
    """

    def __init__(self, max_num_batched_tokens: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.preempt_next: set[str] = set()
        self.stop_at: dict[str, int] = {}

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_requests(self) -> bool:
        """Requests to run, or finished ones the workers have not been told of (vLLM steps once more for those)."""
        return bool(self.waiting or self.running or self.finished_req_ids)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        preempted = {r.request_id for r in self.running if r.request_id in self.preempt_next}
        for request in [r for r in self.running if r.request_id in preempted]:
            self.running.remove(request)
            self._preempt_request(request)
        self.preempt_next -= preempted
        running, resumed, new = [], [], []
        for request in self.running:
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if count > 0:
                num_scheduled[request.request_id], budget = count, budget - count
                running.append(request)
        while self.waiting and budget > 0 and not preempted:  # vLLM admits none in a step that preempted
            request = self.waiting.pop(0)
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            num_scheduled[request.request_id], budget = count, budget - count
            (resumed if request.status is RequestStatus.PREEMPTED else new).append(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        cached = running + resumed
        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(r.request_id, list(r.prompt_token_ids), r.sampling_params, r.num_computed_tokens)
                for r in new
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in cached],
                resumed_req_ids={r.request_id for r in resumed},
                num_computed_tokens=[r.num_computed_tokens for r in cached],
                num_output_tokens=[r.num_output_tokens for r in cached],
            ),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
        )
        self.finished_req_ids = set()
        for rid, count in num_scheduled.items():  # _update_after_schedule
            self.requests[rid].num_computed_tokens += count
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput) -> None:
        """Append each request's sampled token; free those that stopped or reached ``max_tokens``."""
        out = model_runner_output
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            for token in out.sampled_token_ids[out.req_id_to_index[rid]]:
                request.output_token_ids.append(token)
                if request.num_output_tokens == self.stop_at.get(rid):
                    request.status = RequestStatus.FINISHED_STOPPED
                elif request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            if request.is_finished():
                self.running.remove(request)
                self._free_request(request)

    def finish_requests(self, request_ids: str | Sequence[str], finished_status: RequestStatus) -> None:
        """What ``EngineCore.abort_requests`` calls (``FINISHED_ABORTED``)."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
            request.status = finished_status
            self._free_request(request)

    def _preempt_request(self, request: Request) -> None:
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.insert(0, request)

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> tuple[None, None]:
        """Every stop, length cap and abort frees its request here (the plugin notes its status)."""
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return None, None


# -- the loop ---------------------------------------------------------------------------------------------------------
T = TypeVar("T")


def _call(call: Callable[[], T]) -> T:
    return call()


@dataclass
class Plan:
    """One request of a workload, and what happens to it. Its vLLM request id is ``name`` plus ``-`` and 8 characters,
    as vLLM makes one from a client's id; the plugin stores it under ``name``."""

    name: str
    prompt: list[int]
    max_tokens: int
    #: Step from which it waits to be scheduled.
    arrive: int = 0
    #: Outputs before the front end aborts it.
    abort_after: int | None = None
    #: Outputs before the scheduler preempts it (once).
    preempt_after: int | None = None
    #: Outputs at which it samples a stop token.
    stop_after: int | None = None
    #: Still running when the loop ends (the worker's shutdown ends it).
    open: bool = False
    #: ``SamplingParams.stop`` and ``extra_args``.
    stop: list[str] | None = None
    extra_args: dict[str, Any] | None = None


class EngineLoop:
    """``EngineCore.step`` over stand-in requests with the plugin's hooks on the stand-in classes.

    Args:
        capture: the hooks' owner (``VLLMCapture``, its producer set: :func:`capture_with_producer`).
        plans: the requests.
        device: where the "model" runs (``cuda`` or ``cpu``).
        hidden, num_aux: the captured states' width and aux layer count.
        max_num_batched_tokens: the scheduler's token budget per step (longer prompts are chunked).
        queued_gpu_s: GPU time queued in each forward before its outputs (``torch.cuda._sleep``).
        call: runs each scheduler and runner call that carries a hook (``call(fn)`` returns ``fn()``): tests wrap it
            in sync-debug mode. Sampling, which syncs in vLLM too, runs outside it.
    """

    def __init__(
        self,
        capture: VLLMCapture,
        plans: Sequence[Plan],
        *,
        device: str = "cpu",
        hidden: int = 32,
        num_aux: int = 3,
        max_num_batched_tokens: int = 24,
        queued_gpu_s: float = 0.0,
        call: Callable[[Callable[[], Any]], Any] = _call,
    ) -> None:
        worker, runner, scheduler = plugged(capture)
        self.runner = runner(
            device=device, hidden=hidden, num_aux=num_aux, max_num_reqs=len(plans), queued_gpu_s=queued_gpu_s
        )
        self.scheduler = scheduler(max_num_batched_tokens)
        self.worker = worker(self.runner)
        self.plans = {plan.name: plan for plan in plans}
        #: Every request the front end made, by plan name; and the plan name of each request id.
        self.requests: dict[str, Request] = {}
        self.names: dict[str, str] = {}
        #: Of each step: ``empty``, ``prefill``, ``decode`` or ``mixed``; the rows scheduled per plan name (in the
        #: scheduler's order); the plan names in the forward's row order (the runner's batch order).
        self.modes: list[str] = []
        self.scheduled: list[dict[str, int]] = []
        self.row_order: list[list[str]] = []
        self.index = 0
        self.call = call

    def run(self, max_steps: int = 1000) -> None:
        """Step until every request but the open ones has ended and the workers were told."""
        while self.step():
            if self.index > max_steps:
                raise RuntimeError(f"stand-in engine: not done after {max_steps} steps")

    def step(self) -> bool:
        self._front_end()
        scheduler = self.scheduler
        ended = all(r.is_finished() for name, r in self.requests.items() if not self.plans[name].open)
        if len(self.requests) == len(self.plans) and ended and not scheduler.finished_req_ids:
            return False
        self.index += 1
        if not scheduler.has_requests():  # vLLM's engine idles until a request comes
            return True
        output = self.call(scheduler.schedule)
        self._note(output)
        result = self.call(lambda: self.runner.execute_model(output))
        self.row_order.append([self.names[rid] for rid in self.runner.input_batch.req_ids])
        if result is None:
            result = self.runner.sample_tokens(None)
        self.call(lambda: scheduler.update_from_output(output, result))
        return True

    def shutdown(self) -> None:
        """The worker's shutdown (the plugin closes its producer: the ring's free waits for the GPU, so not under
        ``call``)."""
        self.worker.shutdown()

    def _front_end(self) -> None:
        for plan in self.plans.values():
            if plan.arrive == self.index:
                params = SamplingParams(max_tokens=plan.max_tokens, stop=plan.stop, extra_args=plan.extra_args)
                request = Request(f"{plan.name}-{len(self.requests):08x}", plan.prompt, params)
                self.requests[plan.name], self.names[request.request_id] = request, plan.name
                if plan.stop_after is not None:
                    self.scheduler.stop_at[request.request_id] = plan.stop_after
                self.scheduler.add_request(request)
        for name, request in self.requests.items():
            plan, outputs = self.plans[name], request.num_output_tokens
            if request.is_finished():
                continue
            if plan.abort_after is not None and outputs >= plan.abort_after:
                self.call(
                    functools.partial(
                        self.scheduler.finish_requests, request.request_id, RequestStatus.FINISHED_ABORTED
                    )
                )
            elif plan.preempt_after is not None and outputs >= plan.preempt_after and not request.num_preemptions:
                self.scheduler.preempt_next.add(request.request_id)

    def _note(self, output: SchedulerOutput) -> None:
        scheduled = {self.names[rid]: count for rid, count in output.num_scheduled_tokens.items()}
        decode = {
            name
            for name, count in scheduled.items()
            if count == 1
            and self.requests[name].num_output_tokens
            and self.requests[name].num_computed_tokens == self.requests[name].num_tokens
        }
        self.scheduled.append(scheduled)
        self.modes.append(
            "empty" if not scheduled else "decode" if decode == set(scheduled) else "mixed" if decode else "prefill"
        )


def plugged(capture: VLLMCapture) -> tuple[type[Worker], type[GPUModelRunner], type[Scheduler]]:
    """Subclasses of the stand-ins wrapped by the plugin's own ``patch_*`` methods, as it wraps vLLM's classes at their
    import (fresh ones for each capture: the stand-ins themselves stay unwrapped)."""
    worker = type("Worker", (Worker,), {})
    runner = type("GPUModelRunner", (GPUModelRunner,), {})
    scheduler = type("Scheduler", (Scheduler,), {})
    capture.patch_worker(types.SimpleNamespace(Worker=worker))
    capture.patch_runner(types.SimpleNamespace(GPUModelRunner=runner))
    capture.patch_scheduler(types.SimpleNamespace(Scheduler=scheduler))
    return worker, runner, scheduler


def capture_with_producer(config: CaptureConfig, **settings: Any) -> VLLMCapture:
    """The plugin's per-process capture object with its producer made here, not at model load.

    The model-load hook reads vLLM's model, config and parallel state, which the stand-ins do not have; it leaves the
    captured layers and the producer, set here as it sets them (a Llama). The step, schedule and free hooks and
    everything they call are the plugin's own. ``settings``: more :class:`PluginSettings` fields.
    """
    capture = VLLMCapture(
        PluginSettings(
            endpoint=config.endpoint,
            layers=list(config.layers),
            capture_last=config.capture_last,
            policy=config.policy,
            **settings,
        )
    )
    descriptions = architecture("LlamaForCausalLM").describe(config.layers, config.num_layers, config.capture_last)
    capture.layers = tuple(config.layers)
    capture.producer = Producer(config, tensor_descriptions=descriptions, meta={"engine": "vllm stand-in"})
    return capture
