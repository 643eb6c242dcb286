"""Stand-ins for SGLang's scheduler objects and its overlap loop, to drive the plugin's hooks without SGLang.

SGLang cannot be installed beside the lent GPU's torch (it pins its own), yet the hooks of
:class:`hscapture.integrations.sglang.SGLangCapture` must be checked for host-device syncs and
timed on a GPU. These classes carry the attributes the hooks read, with SGLang 0.5.23's names
and types (``schedule_batch.Req``, ``ScheduleBatch``, ``FINISH_LENGTH``, ``FINISH_ABORT``,
``forward_batch_info.ForwardMode``, ``logits_processor.LogitsProcessorOutput``): token lists
are ``array("q")``, ``seq_lens_cpu`` a CPU tensor, hidden states tensors on the device.
``tests/test_sglang_hooks.py`` checks them against SGLang's own classes where SGLang is installed.

:class:`OverlapScheduler` runs requests the way ``Scheduler.event_loop_overlap`` does: build
batch N from host state (chunked prefill, mixed batches, decode, retraction), launch its forward
on a forward stream and call ``after_forward`` there, then process batch N-1's result (wait for
its token copy, append outputs, finish requests) and call ``after_batch_result``. So when a
decode forward's hook runs, its input tokens exist only on the device (gathered from a device
buffer, as SGLang's FutureMap does), and a finished request runs one step past its end. With
``overlap=False`` it runs ``event_loop_normal``'s order instead (process batch N right after it).

The "model" writes ``token * 1024 + position + t / 4`` (:func:`benchmarks.standin.expected_row`) into every
column of captured tensor ``t`` (the aux layers, then the last layer), into static output buffers that the next
forward overwrites (as a CUDA graph's outputs are), so a float32 store can be checked exactly.
"""

from __future__ import annotations

import contextlib
import enum
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from benchmarks.standin import VOCAB, cycles_for
from hscapture.config import CaptureConfig
from hscapture.integrations.sglang import PluginSettings, SGLangCapture
from hscapture.integrations.sglang_models import architecture
from hscapture.producer import Producer


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE


class BaseFinishReason:
    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError


class FINISH_LENGTH(BaseFinishReason):
    def __init__(self, length: int) -> None:
        self.length = length

    def to_json(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


class FINISH_ABORT(BaseFinishReason):
    def __init__(self, message: str | None = None) -> None:
        self.message = message or "Aborted"

    def to_json(self) -> dict[str, Any]:
        return {"type": "abort", "message": self.message, "status_code": None, "err_type": None}


@dataclass
class SamplingParams:
    max_new_tokens: int
    custom_params: dict[str, Any] | None = None


class Req:
    """``schedule_batch.Req``: what the hooks read of a request."""

    def __init__(self, rid: str, origin_input_ids: Sequence[int], sampling_params: SamplingParams) -> None:
        self.rid = rid
        self.origin_input_ids = array("q", origin_input_ids)
        self.output_ids = array("q")
        self.sampling_params = sampling_params
        self.finished_reason: BaseFinishReason | None = None
        self.is_retracted = False
        self.retraction_count = 0

    def finished(self) -> bool:
        return self.finished_reason is not None


@dataclass
class ScheduleBatch:
    """``schedule_batch.ScheduleBatch``: what the hooks read of a batch."""

    reqs: list[Req]
    forward_mode: ForwardMode
    seq_lens_cpu: torch.Tensor
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: torch.Tensor | None = None

    def copy(self) -> ScheduleBatch:
        """What the overlap loop hands to ``process_batch_result``: a new batch, the same requests."""
        return ScheduleBatch(self.reqs[:], self.forward_mode, self.seq_lens_cpu, self.prefix_lens, self.extend_lens)


@dataclass
class LogitsProcessorOutput:
    hidden_states: torch.Tensor | None
    last_hidden_states: torch.Tensor | None


@dataclass
class GenerationBatchResult:
    logits_output: LogitsProcessorOutput
    #: Sampled token per request, on the host once ``copy_done`` has completed.
    next_token_ids: torch.Tensor
    copy_done: Any = None
    #: The forward replayed a CUDA graph.
    can_run_cuda_graph: bool = False
    #: Stand-in bookkeeping (SGLang keeps it on the request): whether each request's sample counts.
    commits: list[bool] = field(default_factory=list)


@dataclass
class Plan:
    """One request of a workload, and what happens to it."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    #: Batch index from which the request waits to be scheduled.
    arrive: int = 0
    #: Outputs committed before an abort reaches it (SGLang: ``to_finish = FINISH_ABORT``).
    abort_after: int | None = None
    #: Outputs committed before one is discarded and the request ends (SGLang: a failed
    #: sampling mask or KV load: finished without committing that step's token).
    discard_after: int | None = None
    #: Outputs committed when the scheduler retracts it (it is re-prefilled later).
    retract_after: int | None = None


@dataclass
class _State:
    plan: Plan
    req: Req
    pool: int
    fill_len: int = 0  # tokens to prefill (prompt + outputs at admission)
    done: int = 0  # of them prefilled
    seqlen: int = 0  # tokens in the KV cache after the last scheduled forward
    ready_at: int = 0


Hook = Callable[[str, Callable[[], None]], None]


@dataclass
class ForwardBatch:
    """``forward_batch_info.ForwardBatch``: what a capture tail hook reads of it."""

    forward_mode: ForwardMode


@dataclass
class ModelRunner:
    """``model_runner.ModelRunner``: its capture tail hooks, called as ``hook(graph_runner, out, forward_batch,
    num_tokens)`` inside every decode graph's capture, after the forward."""

    capture_tail_hooks: list[Callable[..., None]] = field(default_factory=list)


def _call(name: str, call: Callable[[], None]) -> None:
    call()


class OverlapScheduler:
    """SGLang's scheduler loop over stand-in requests, calling the plugin's hooks where SGLang does.

    Args:
        capture: the hooks' owner (``SGLangCapture``, its producer set).
        plans: the requests.
        device: where the "model" runs (``cuda`` or ``cpu``).
        hidden, num_aux, dtype: the captured states' width, aux layer count and dtype.
        chunk_size: prefill tokens per batch (longer prompts are chunked).
        mixed: put running requests' decode rows into prefill batches (``--enable-mixed-chunk``).
        overlap: ``event_loop_overlap``'s order (default) or ``event_loop_normal``'s.
        queued_gpu_s: GPU time queued in each forward before its outputs (``torch.cuda._sleep``).
        graphs: decode batch sizes whose forward is a CUDA graph (``DecodeCudaGraphRunner``'s role): captured
            at start, after ``capture.attach_graphs(self.model_runner)`` (the model-load hook's call), each
            decode batch padded up to the next of them and replayed; larger batches and the rest run eagerly.
        hook: calls each hook (``hook(name, call)``): tests wrap it in sync-debug mode,
            the benchmark times it.
    """

    def __init__(
        self,
        capture: Any,
        plans: Sequence[Plan],
        *,
        device: str = "cpu",
        hidden: int = 32,
        num_aux: int = 3,
        dtype: torch.dtype = torch.float32,
        chunk_size: int = 24,
        mixed: bool = True,
        overlap: bool = True,
        queued_gpu_s: float = 0.0,
        graphs: Sequence[int] = (),
        hook: Hook = _call,
    ) -> None:
        self.capture = capture
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.num_aux, self.chunk_size, self.mixed, self.overlap, self.hook = num_aux, chunk_size, mixed, overlap, hook
        self.states = {
            p.rid: _State(p, Req(p.rid, p.prompt, SamplingParams(p.max_new_tokens)), i) for i, p in enumerate(plans)
        }
        self.waiting: list[_State] = []
        self.running: list[_State] = []
        self.index = 0
        #: Forward mode of every batch launched, in order.
        self.modes: list[ForwardMode] = []
        self.last: tuple[ScheduleBatch, GenerationBatchResult] | None = None
        rows = max([max(chunk_size, 1) + len(plans), *graphs])
        # Static outputs, overwritten by every forward, like a CUDA graph's.
        self.aux_out = torch.zeros(rows, num_aux * hidden, device=self.device, dtype=dtype)
        self.last_out = torch.zeros(rows, hidden, device=self.device, dtype=dtype)
        self.offsets = torch.arange(num_aux + 1, device=self.device, dtype=torch.float32) / 4
        self.token_buf = torch.zeros(len(plans) + 1, dtype=torch.int64, device=self.device)  # FutureMap
        self.forward_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.sleep_cycles = cycles_for(queued_gpu_s) if self.cuda and queued_gpu_s > 0 else 0
        #: The graph runner's owner (``graph_runner.model_runner``), with the hooks its captures call.
        self.model_runner = ModelRunner()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if graphs:
            if not self.cuda:
                raise ValueError("graphs: CUDA graphs need device 'cuda'")
            capture.attach_graphs(self.model_runner)
            self._capture_graphs(sorted(graphs))

    @property
    def reqs(self) -> dict[str, Req]:
        return {rid: s.req for rid, s in self.states.items()}

    def run(self, max_batches: int = 10_000) -> None:
        """Run every request to its end."""
        while self.step():
            if self.index > max_batches:
                raise RuntimeError(f"stand-in scheduler: not done after {max_batches} batches")

    def step(self) -> bool:
        """One turn of the loop; False once nothing is left to do."""
        planned = self._next_batch()
        unfinished = any(s.req.finished_reason is None for s in self.states.values())
        if planned is None and self.last is None and not unfinished:
            return False
        launched = None if planned is None else (planned[0].copy(), self._launch(*planned))
        if self.overlap:  # launch N, then process N-1
            if self.last is not None:
                self._process(*self.last)
            self.last = launched
        elif launched is not None:
            self._process(*launched)
        self.index += 1
        return True

    # --- scheduling, on the host -------------------------------------------------------------

    def _next_batch(self) -> tuple[ScheduleBatch, list[tuple[_State, int, int]], list[_State]] | None:
        """The next batch, with its prefill blocks ``(request, start, rows)`` and decoding requests."""
        self.running = [s for s in self.running if s.req.finished_reason is None]
        for state in list(self.running):
            plan, req = state.plan, state.req
            if (
                plan.retract_after is not None
                and req.retraction_count == 0
                and len(req.output_ids) >= plan.retract_after
            ):
                req.is_retracted, req.retraction_count = True, req.retraction_count + 1
                self.running.remove(state)
                state.ready_at = self.index + 2  # not straight back: its step in flight is still unprocessed
                self.waiting.insert(0, state)
        for state in self.states.values():
            if state.plan.arrive == self.index:
                self.waiting.append(state)
        extend: list[tuple[_State, int, int]] = []
        budget = self.chunk_size
        for state in self.waiting:
            if budget <= 0 or state.ready_at > self.index:
                continue
            if not state.fill_len:  # admission (SGLang's prepare_for_extend): prompt + outputs so far
                state.fill_len, state.done, state.req.is_retracted = (
                    len(state.req.origin_input_ids) + len(state.req.output_ids),
                    0,
                    False,
                )
            take = min(state.fill_len - state.done, budget)
            extend.append((state, state.done, take))
            budget -= take
        decode = list(self.running) if (self.mixed or not extend) else []
        if not extend and not decode:
            return None
        for state, start, take in extend:
            state.done = start + take
            state.seqlen = state.done
            if state.done == state.fill_len:
                self.waiting.remove(state)
                state.fill_len = 0
                self.running.append(state)  # decodes from the next batch on
        for state in decode:
            state.seqlen += 1  # prepare_for_decode: seq_lens + 1 before the forward
        reqs = [s.req for s, _, _ in extend] + [s.req for s in decode]
        prefix = [start for _, start, _ in extend] + [s.seqlen - 1 for s in decode]
        lengths = [take for _, _, take in extend] + [1] * len(decode)
        seq_lens = [start + take for _, start, take in extend] + [s.seqlen for s in decode]
        mode = ForwardMode.DECODE if not extend else ForwardMode.MIXED if decode else ForwardMode.EXTEND
        batch = ScheduleBatch(reqs, mode, torch.tensor(seq_lens, dtype=torch.int64), prefix, lengths)
        return batch, extend, list(decode)

    # --- the forward, on the device ---------------------------------------------------------------

    def _launch(
        self, batch: ScheduleBatch, extend: list[tuple[_State, int, int]], decode: list[_State]
    ) -> GenerationBatchResult:
        fill = [tok for s, start, take in extend for tok in _fill(s.req)[start : start + take]]
        lengths = np.asarray(batch.extend_lens, dtype=np.int64)
        positions = np.arange(int(lengths.sum())) + np.repeat(
            np.asarray(batch.prefix_lens, dtype=np.int64) - (np.cumsum(lengths) - lengths), lengths
        )
        last_rows = np.cumsum(lengths) - 1
        pools = [s.pool for s, _, _ in extend] + [s.pool for s in decode]
        commits = [start + take == len(_fill(s.req)) for s, start, take in extend] + [True] * len(decode)
        self.modes.append(batch.forward_mode)
        stream = torch.cuda.stream(self.forward_stream) if self.forward_stream is not None else contextlib.nullcontext()
        with stream:
            prefill_ids = self._to_device(np.asarray(fill, dtype=np.int64))
            decode_ids = self.token_buf[self._to_device(np.asarray([s.pool for s in decode], dtype=np.int64))]
            input_ids = torch.cat([prefill_ids, decode_ids])  # decode tokens: only on the device
            batch.input_ids = input_ids
            pos = self._to_device(positions)
            total = len(positions)
            graph = None if extend else self._graph_for(total)
            if graph is None:
                self._model(input_ids, pos)
            else:  # the graph's static inputs, then its replay (padding rows keep what they held)
                self.graph_ids[:total].copy_(input_ids)
                self.graph_pos[:total].copy_(pos)
                self.graphs[graph].replay()
            rows = self._to_device(last_rows)
            sampled = (input_ids[rows] * 7 + pos[rows] * 13 + 5) % VOCAB
            self.token_buf[self._to_device(np.asarray(pools, dtype=np.int64))] = sampled  # FutureMap.stash
            output = LogitsProcessorOutput(self.aux_out[:total], self.last_out[:total])
            result = GenerationBatchResult(output, sampled, can_run_cuda_graph=graph is not None, commits=commits)
            self.hook("after_forward", lambda: self.capture.after_forward(result, None, batch))
            if self.cuda:  # SGLang's copy_to_cpu after the forward: non-blocking, then an event
                host = torch.empty(len(pools), dtype=torch.int64, pin_memory=True)
                host.copy_(sampled, non_blocking=True)
                result.next_token_ids, result.copy_done = host, torch.cuda.Event()
                result.copy_done.record()
        return result

    def _model(self, input_ids: torch.Tensor, pos: torch.Tensor) -> LogitsProcessorOutput:
        """The forward: queued GPU work, then every captured tensor's rows into the static outputs."""
        if self.sleep_cycles:
            torch.cuda._sleep(self.sleep_cycles)  # the model's work, queued ahead of its outputs
        total = input_ids.shape[0]
        base = (input_ids * 1024 + pos).to(torch.float32)[:, None] + self.offsets[None, :]
        aux, last = self.aux_out[:total], self.last_out[:total]
        width = aux.shape[1] // self.num_aux
        aux.view(total, self.num_aux, -1).copy_(base[:, : self.num_aux, None].expand(-1, -1, width))
        last.copy_(base[:, self.num_aux :].expand(-1, last.shape[1]))
        return LogitsProcessorOutput(aux, last)

    def _graph_for(self, rows: int) -> int | None:
        """The captured batch size a decode batch of ``rows`` replays (the next one up), if any."""
        return next((size for size in self.graphs if size >= rows), None)

    def _capture_graphs(self, sizes: list[int]) -> None:
        """Capture each decode graph as SGLang does: two eager warm-ups, then the capture; the tail hooks run in
        all three, after the forward (they act only while capturing)."""
        largest = sizes[-1]
        self.graph_ids = torch.zeros(largest, dtype=torch.int64, device=self.device)
        self.graph_pos = torch.zeros(largest, dtype=torch.int64, device=self.device)
        decode = ForwardBatch(ForwardMode.DECODE)

        def forward(size: int) -> None:
            out = self._model(self.graph_ids[:size], self.graph_pos[:size])
            for hook in self.model_runner.capture_tail_hooks:
                hook(self, out, decode, size)

        side = torch.cuda.Stream(self.device)
        for size in sizes:
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward(size)
            self.graphs[size] = graph

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(values)
        if not self.cuda:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    # --- processing a result, on the host --------------------------------------------------------

    def _process(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        if result.copy_done is not None:
            result.copy_done.synchronize()  # SGLang waits here too, outside the hooks
        for req, token, commit in zip(batch.reqs, result.next_token_ids.tolist(), result.commits):
            if req.finished_reason is not None or req.is_retracted or not commit:
                continue  # overlap: a step past the end, or a retracted request; a middle prefill chunk
            plan = self.states[req.rid].plan
            if plan.discard_after is not None and len(req.output_ids) >= plan.discard_after:
                req.finished_reason = FINISH_ABORT("output discarded")
                continue
            req.output_ids.append(token)
            if plan.abort_after is not None and len(req.output_ids) >= plan.abort_after:
                req.finished_reason = FINISH_ABORT()
            elif len(req.output_ids) >= plan.max_new_tokens:
                req.finished_reason = FINISH_LENGTH(len(req.output_ids))
        self.hook("after_batch_result", lambda: self.capture.after_batch_result(None, self, batch, result))


def _fill(req: Req) -> array:
    return req.origin_input_ids + req.output_ids


def capture_with_producer(config: CaptureConfig, **settings: Any) -> SGLangCapture:
    """The plugin's per-process capture object with its producer made here, not at model load.

    The model-load hook reads SGLang's model and parallel state, which the stand-ins do not
    have; it leaves the producer, the captured layers and their width, set here as it sets them
    (a Llama). The forward and batch-result hooks and everything they call are the plugin's own.
    ``settings``: more :class:`PluginSettings` fields (``positions``, ...).
    """
    capture = SGLangCapture(PluginSettings(endpoint=config.endpoint, policy=config.policy, **settings))
    descriptions = architecture("LlamaForCausalLM").describe(config.layers, config.capture_last)
    capture.producer = Producer(config, tensor_descriptions=descriptions, meta={"engine": "sglang stand-in"})
    capture.layers, capture.hidden = tuple(config.layers), config.hidden_size
    return capture
