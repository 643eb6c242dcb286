"""Stand-ins for vLLM's worker side (V1 model runner, persistent batch), for :mod:`benchmarks.vllm_standin`.

With vLLM 0.32's names and types: ``GPUModelRunner`` (``requests``, ``input_batch``, the ``input_ids``
``CpuGpuBuffer``, ``execute_model_state``), ``InputBatch``, ``CachedRequestState``, ``ExecuteModelState``,
``ModelRunnerOutput`` and the ``Worker`` methods the plugin wraps. What vLLM keeps on the host is host memory here
(``num_computed_tokens_cpu`` and ``token_ids_cpu`` numpy views, ``input_ids.cpu`` pinned on a GPU host); what it keeps
on the device is only there: the positions (computed on the device from ``num_computed_tokens``, as vLLM does), the
hidden states, and the sampled tokens until ``sample_tokens``.

The runner's step: its persistent batch follows the scheduler (finished and unscheduled requests out, new and resumed
ones in at the lowest free index, ``condense``, the decode-first reorder of
``reorder_batch_to_split_decodes_and_prefills``); the forward, padded to a CUDA-graph size, writes
``token * 1024 + position + t / 4`` (:func:`benchmarks.standin.expected_row`) into every column of captured tensor
``t`` (the aux layers, then the final state), into static buffers that the next forward overwrites (as a CUDA graph's
outputs are); ``sample_tokens`` then waits for the sampled tokens on the host, as vLLM's sync scheduling does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from benchmarks.standin import VOCAB, cycles_for

if TYPE_CHECKING:
    from benchmarks.vllm_standin import SamplingParams, SchedulerOutput


class CpuGpuBuffer:
    """``v1/utils.CpuGpuBuffer``: a host tensor (pinned where the device is a GPU), its numpy view, its device twin."""

    def __init__(self, *size: int, dtype: torch.dtype, device: torch.device, pin_memory: bool) -> None:
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu", pin_memory=pin_memory)
        self.gpu = torch.zeros_like(self.cpu, device=device)
        self.np: np.ndarray = self.cpu.numpy()

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        cpu, gpu = (self.cpu, self.gpu) if n is None else (self.cpu[:n], self.gpu[:n])
        return gpu.copy_(cpu, non_blocking=True)


@dataclass
class CachedRequestState:
    """``v1/worker/gpu_input_batch.CachedRequestState``: a request as the runner holds it."""

    req_id: str
    prompt_token_ids: list[int] | None
    sampling_params: SamplingParams | None
    num_computed_tokens: int
    output_token_ids: list[int]

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids or [])

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)


class InputBatch:
    """``v1/worker/gpu_input_batch.InputBatch``: the runner's persistent batch. A request's index is its row block's
    place in the forward; a new request takes the lowest freed index, else the next; :meth:`condense` moves the last
    requests down into the holes left."""

    def __init__(self, max_num_reqs: int, max_model_len: int, pin_memory: bool) -> None:
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu_tensor = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32)
        self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()
        self.num_tokens_no_spec_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.int32, pin_memory=pin_memory)
        self.num_tokens_no_spec = self.num_tokens_no_spec_cpu_tensor.numpy()
        self.num_prompt_tokens_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.int32, pin_memory=pin_memory)
        self.num_prompt_tokens = self.num_prompt_tokens_cpu_tensor.numpy()
        self.num_computed_tokens_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.int32, pin_memory=pin_memory)
        self.num_computed_tokens_cpu = self.num_computed_tokens_cpu_tensor.numpy()
        #: Indices freed since the last :meth:`condense` (vLLM's ``batch_update_builder.removed``).
        self._removed: list[int] = []

    @property
    def req_ids(self) -> list[str]:
        return self._req_ids  # type: ignore[return-value]  # None only between a removal and condense()

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, request: CachedRequestState) -> int:
        self._removed.sort(reverse=True)
        index = self._removed.pop() if self._removed else self.num_reqs
        if index == len(self._req_ids):
            self._req_ids.append(request.req_id)
        else:
            self._req_ids[index] = request.req_id
        self.req_id_to_index[request.req_id] = index
        prompt = request.prompt_token_ids or []
        self.num_prompt_tokens[index] = len(prompt)
        self.token_ids_cpu[index, : len(prompt)] = prompt
        self.token_ids_cpu[index, len(prompt) : request.num_tokens] = request.output_token_ids
        self.num_tokens_no_spec[index] = request.num_tokens
        self.num_computed_tokens_cpu[index] = request.num_computed_tokens
        return index

    def remove_request(self, req_id: str) -> int | None:
        index = self.req_id_to_index.pop(req_id, None)
        if index is not None:
            self._removed.append(index)
            self._req_ids[index] = None
        return index

    def swap_states(self, i1: int, i2: int) -> None:
        ids = self._req_ids
        ids[i1], ids[i2] = ids[i2], ids[i1]
        self.req_id_to_index[ids[i1]], self.req_id_to_index[ids[i2]] = i1, i2  # type: ignore[index]
        for array in (
            self.token_ids_cpu,
            self.num_tokens_no_spec,
            self.num_prompt_tokens,
            self.num_computed_tokens_cpu,
        ):
            array[[i1, i2]] = array[[i2, i1]]

    def condense(self) -> None:
        num_reqs, empty = self.num_reqs, sorted(self._removed, reverse=True)
        self._removed = []
        if not empty:
            return
        if num_reqs == 0:
            self._req_ids.clear()
            return
        last = num_reqs + len(empty) - 1
        while empty:
            while last in empty:
                last -= 1
            if empty[-1] >= last:
                break
            hole = empty.pop()
            req_id = self._req_ids[last]
            self._req_ids[hole], self._req_ids[last] = req_id, None
            self.req_id_to_index[req_id] = hole  # type: ignore[index]
            end = self.num_tokens_no_spec[last]
            self.token_ids_cpu[hole, :end] = self.token_ids_cpu[last, :end]
            for array in (self.num_tokens_no_spec, self.num_prompt_tokens, self.num_computed_tokens_cpu):
                array[hole] = array[last]
            last -= 1
        del self._req_ids[num_reqs:]


def reorder_batch_to_split_decodes_and_prefills(
    input_batch: InputBatch, scheduler_output: SchedulerOutput, decode_threshold: int = 1
) -> bool:
    """``v1/attention/backends/utils.reorder_batch_to_split_decodes_and_prefills`` (what MLA and FlashInfer backends
    have the runner do): decodes first, then short and long extends, then first prefill chunks, by swaps."""
    n = len(input_batch.req_ids)
    scheduled = np.array([scheduler_output.num_scheduled_tokens[rid] for rid in input_batch.req_ids])
    computed = input_batch.num_computed_tokens_cpu[:n]
    has_context, small = computed > 0, scheduled <= decode_threshold
    done_prefilling = computed >= input_batch.num_prompt_tokens[:n]
    regions = np.zeros(n, dtype=np.int32)
    regions[has_context & small & ~done_prefilling] = 1
    regions[has_context & ~small] = 2
    regions[~has_context] = 3
    target = np.sort(regions, kind="stable")
    moved = np.flatnonzero(regions != target)
    if not len(moved):
        return False
    destination = {int(src): int(dst) for src, dst in zip(moved[np.argsort(regions[moved], kind="stable")], moved)}
    for src in destination:
        dst = destination[src]
        while src != dst:
            input_batch.swap_states(src, dst)
            destination[dst], dst = dst, destination.get(dst, dst)
    return True


class ExecuteModelState(NamedTuple):
    """``v1/worker/gpu_model_runner.ExecuteModelState``: the forward's outputs, held from ``execute_model`` (which then
    returns None) until ``sample_tokens``. Here ``logits`` holds the sampled token of each request (the stand-in's
    argmax); the states hold the forward's padded rows."""

    scheduler_output: SchedulerOutput
    logits: torch.Tensor
    spec_decode_metadata: Any
    spec_decode_common_attn_metadata: Any
    hidden_states: torch.Tensor
    sample_hidden_states: torch.Tensor
    aux_hidden_states: list[torch.Tensor] | None
    ec_connector_output: Any
    cudagraph_stats: Any
    slot_mappings: Any


@dataclass
class ModelRunnerOutput:
    """``v1/outputs.ModelRunnerOutput``: the sampled tokens of each request, in batch order (none for a partial
    prefill)."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]] = field(default_factory=list)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={})


class GPUModelRunner:
    """``v1/worker/gpu_model_runner.GPUModelRunner`` with the aux outputs on (what the plugin's load hook sets)."""

    def __init__(
        self,
        *,
        device: str | torch.device,
        hidden: int,
        num_aux: int,
        dtype: torch.dtype = torch.float32,
        max_num_reqs: int = 16,
        max_model_len: int = 512,
        max_num_tokens: int = 32,
        cudagraph_batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 24, 32),
        reorder_batch_threshold: int | None = 1,
        queued_gpu_s: float = 0.0,
    ) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.max_num_reqs, self.max_num_tokens = max_num_reqs, max_num_tokens

        def buffer(*size: int, dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(*size, dtype=dtype, device=self.device, pin_memory=cuda)

        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(max_num_reqs, max_model_len, pin_memory=cuda)
        self.input_ids = buffer(max_num_tokens, dtype=torch.int32)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        self.query_start_loc = buffer(max_num_reqs + 1, dtype=torch.int32)
        self.num_computed_tokens = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
        self.req_indices = buffer(max_num_tokens, dtype=torch.int64)
        self.query_pos = buffer(max_num_tokens, dtype=torch.int64)
        self.discard_request_mask = buffer(max_num_reqs, dtype=torch.bool)
        self.cudagraph_batch_sizes = sorted(cudagraph_batch_sizes)
        self.reorder_batch_threshold = reorder_batch_threshold
        self.use_aux_hidden_state_outputs = True
        self.execute_model_state: ExecuteModelState | None = None
        # The model's outputs: static buffers every forward overwrites, as a CUDA graph's are.
        self._aux_out = [torch.zeros(max_num_tokens, hidden, dtype=dtype, device=self.device) for _ in range(num_aux)]
        self._last_out = torch.zeros(max_num_tokens, hidden, dtype=dtype, device=self.device)
        self._sleep_cycles = cycles_for(queued_gpu_s) if cuda and queued_gpu_s > 0 else 0

    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate_tensors: Any = None
    ) -> ModelRunnerOutput | None:
        if self.execute_model_state is not None:
            raise RuntimeError("State error: sample_tokens() must be called after execute_model() returns None.")
        self._update_states(scheduler_output)
        total = scheduler_output.total_num_scheduled_tokens
        if not total:
            return EMPTY_MODEL_RUNNER_OUTPUT
        logits_indices = self._prepare_inputs(scheduler_output)
        padded = next((size for size in self.cudagraph_batch_sizes if size >= total), total)
        self.positions[total:padded].zero_()
        hidden_states, aux_hidden_states = self._forward(self.input_ids.gpu[:padded], self.positions[:padded])
        sampled = (
            self.input_ids.gpu[logits_indices].to(torch.int64) * 7 + self.positions[logits_indices] * 13 + 5
        ) % VOCAB
        self.execute_model_state = ExecuteModelState(
            scheduler_output,
            sampled,
            None,
            None,
            hidden_states,
            hidden_states[logits_indices],
            aux_hidden_states,
            None,
            None,
            None,
        )
        return None

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        """The sampled tokens to the host (the wait vLLM's sync scheduling makes here), appended where each request
        keeps its tokens; a partial prefill's sample is discarded."""
        state, self.execute_model_state = self.execute_model_state, None
        assert state is not None, "sample_tokens() without execute_model()"
        batch = self.input_batch
        sampled: list[list[int]] = []
        for index, (rid, token) in enumerate(zip(batch.req_ids, state.logits.tolist())):
            if self.discard_request_mask.np[index]:
                sampled.append([])
                continue
            end = int(batch.num_tokens_no_spec[index])
            batch.token_ids_cpu[index, end] = token
            batch.num_tokens_no_spec[index] = end + 1
            self.requests[rid].output_token_ids.append(token)
            sampled.append([token])
        return ModelRunnerOutput(list(batch.req_ids), dict(batch.req_id_to_index), sampled)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """The persistent batch after the scheduler's step: finished and unscheduled requests out, new and resumed
        ones in, then condensed and reordered."""
        batch, cached = self.input_batch, scheduler_output.scheduled_cached_reqs
        for rid in scheduler_output.finished_req_ids:
            self.requests.pop(rid, None)
            batch.remove_request(rid)
        scheduled = scheduler_output.num_scheduled_tokens.keys()
        for rid in batch.req_id_to_index.keys() - (scheduled - cached.resumed_req_ids):
            batch.remove_request(rid)
        to_add = []
        for new in scheduler_output.scheduled_new_reqs:
            state = CachedRequestState(
                new.req_id, new.prompt_token_ids, new.sampling_params, new.num_computed_tokens, []
            )
            self.requests[new.req_id] = state
            to_add.append(state)
        for rid, computed, outputs in zip(cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens):
            state = self.requests[rid]
            state.num_computed_tokens = computed
            del state.output_token_ids[outputs:]
            index = batch.req_id_to_index.get(rid)
            if index is None:  # resumed, or left out of the last step: back into the batch
                to_add.append(state)
            else:
                batch.num_computed_tokens_cpu[index] = computed
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        if self.reorder_batch_threshold is not None:
            reorder_batch_to_split_decodes_and_prefills(batch, scheduler_output, self.reorder_batch_threshold)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """The step's input ids on the host (gathered from ``token_ids_cpu``) and the device, its positions on the
        device only; returns ``[num_reqs]`` device indices of each request's last row."""
        batch, total = self.input_batch, scheduler_output.total_num_scheduled_tokens
        n = batch.num_reqs
        counts = np.array([scheduler_output.num_scheduled_tokens[rid] for rid in batch.req_ids], dtype=np.int64)
        ends = np.cumsum(counts)
        req_indices = np.repeat(np.arange(n), counts)
        query_pos = np.arange(total) - np.repeat(ends - counts, counts)
        positions = batch.num_computed_tokens_cpu[req_indices] + query_pos
        token_indices = torch.from_numpy(positions + req_indices * batch.token_ids_cpu.shape[1])
        torch.index_select(batch.token_ids_cpu_tensor.flatten(), 0, token_indices, out=self.input_ids.cpu[:total])
        self.input_ids.copy_to_gpu(total)
        self.discard_request_mask.np[:n] = batch.num_computed_tokens_cpu[:n] + counts < batch.num_tokens_no_spec[:n]
        self.num_computed_tokens[:n].copy_(batch.num_computed_tokens_cpu_tensor[:n], non_blocking=True)
        self.req_indices.np[:total] = req_indices
        self.query_pos.np[:total] = query_pos
        on_device = self.req_indices.copy_to_gpu(total)
        self.positions[:total] = self.num_computed_tokens[on_device].to(torch.int64) + self.query_pos.copy_to_gpu(total)
        self.query_start_loc.np[0], self.query_start_loc.np[1 : n + 1] = 0, ends
        return self.query_start_loc.copy_to_gpu(n + 1)[1:].to(torch.int64) - 1

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Queued GPU work (the model's), then every captured tensor's rows into the static outputs."""
        if self._sleep_cycles:
            torch.cuda._sleep(self._sleep_cycles)
        rows = input_ids.shape[0]
        base = (input_ids.to(torch.int64) * 1024 + positions).to(self._last_out.dtype)
        for t, out in enumerate([*self._aux_out, self._last_out]):
            out[:rows].copy_((base + t / 4)[:, None].expand(-1, out.shape[1]))
        return self._last_out[:rows], [aux[:rows] for aux in self._aux_out]


class Worker:
    """``v1/worker/gpu_worker.Worker``: the methods the plugin wraps. The loop never calls ``load_model``: the plugin's
    hook on it reads vLLM's config and model, so :func:`capture_with_producer` does its part."""

    def __init__(self, model_runner: GPUModelRunner) -> None:
        self.model_runner = model_runner

    def load_model(self, load_dummy_weights: bool = False) -> None:
        raise NotImplementedError("the stand-in's model is its runner's; see capture_with_producer")

    def shutdown(self) -> None:
        pass
