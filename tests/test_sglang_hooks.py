"""The SGLang plugin's hooks over SGLang-shaped batches, without SGLang: rows, positions, token ids, no sync.

``benchmarks/sglang_standin.py`` runs requests the way SGLang's scheduler loop does (overlap
and normal order; chunked prefill, mixed and decode batches, a retraction, an abort, a
discarded output) and calls the plugin's real hooks; a real consumer process writes the store.
On a GPU every hook call runs under ``torch.cuda.set_sync_debug_mode("error")``. Where SGLang is
installed, the stand-ins are checked against SGLang's own classes.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from benchmarks.sglang_standin import (
    FINISH_ABORT,
    FINISH_LENGTH,
    ForwardBatch,
    ForwardMode,
    GenerationBatchResult,
    LogitsProcessorOutput,
    OverlapScheduler,
    Plan,
    Req,
    SamplingParams,
    ScheduleBatch,
    capture_with_producer,
)
from benchmarks.standin import capture_config, expected_row, prompts
from hscapture import CaptureConfig, open_store
from hscapture.integrations.sglang import (
    LOSS_MASK_PARAM,
    MAX_PENDING,
    OWN_CACHE_SALT,
    OWN_PARAM,
    PluginSettings,
    SGLangCapture,
)
from hscapture.producer import RUN_STEPS
from hscapture.selection import Positions, check_rate, sampled
from hscapture.store.format import SELECTION_VERSION
from tests.conftest import ConsumerFactory, wait_attached

HIDDEN = 32
LAYERS = (2, 4, 5)
#: Where the stand-in model runs; "cuda-graphs": its decode forwards are CUDA graphs holding the plugin's copy.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu]), pytest.param("cuda-graphs", marks=[pytest.mark.gpu])]
#: Decode batch sizes captured as graphs (the plans decode at most 8 requests at once).
GRAPHS = (1, 2, 4, 8)
#: A request SGLang makes for itself (its warm-up, a health check), batched with the others for a few steps.
OWN = "sglang-own"


def plans() -> list[Plan]:
    prompt = prompts(7)
    return [
        Plan("short", prompt(5), max_new_tokens=6),
        Plan("chunked", prompt(50), max_new_tokens=4),  # 50 prompt tokens > 24 per batch: three chunks
        Plan("late", prompt(9), max_new_tokens=7, arrive=4),  # joins while others decode: mixed batches
        Plan("retracted", prompt(12), max_new_tokens=9, retract_after=3),
        Plan("aborted", prompt(4), max_new_tokens=50, abort_after=2),
        Plan("discarded", prompt(6), max_new_tokens=50, discard_after=3),
        Plan("one-token", prompt(1), max_new_tokens=1),
        Plan("later", prompt(30), max_new_tokens=5, arrive=9),
        Plan(OWN, prompt(3), max_new_tokens=4, arrive=2),
    ]


def config_for(endpoint: str, device: str) -> CaptureConfig:
    return capture_config(endpoint, device, LAYERS, HIDDEN)


def strict_hooks(device: str) -> Callable[[str, Callable[[], None]], None]:
    """Every hook call on the GPU under sync-debug mode "error": a host-device sync raises."""

    def call(name: str, hook: Callable[[], None]) -> None:
        if device != "cuda":
            hook()
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            hook()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return call


@contextmanager
def no_capture_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The plugin logs and switches capture off on any error; here that must never happen."""
    with caplog.at_level(logging.ERROR, logger="hscapture.integrations.sglang"):
        yield
    assert not caplog.records, caplog.text


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
@pytest.mark.parametrize("device", DEVICES)
def test_hooks_store_every_row_with_its_position_and_token(
    tmp_path: Path,
    endpoint: str,
    start_consumer: ConsumerFactory,
    caplog: pytest.LogCaptureFixture,
    device: str,
    overlap: bool,
) -> None:
    device, graphs = device.removesuffix("-graphs"), GRAPHS if device.endswith("-graphs") else ()
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos")
    capture = capture_with_producer(config_for(endpoint, device))
    wait_attached(capture.producer)
    # On the GPU each forward queues 2 ms of work before its outputs: a slot's event recorded before the copy of
    # its last rows (or on another stream than theirs) lets the consumer copy rows not written yet.
    scheduler = OverlapScheduler(
        capture,
        plans(),
        device=device,
        hidden=HIDDEN,
        num_aux=len(LAYERS),
        overlap=overlap,
        hook=strict_hooks(device),
        queued_gpu_s=0.002 if device == "cuda" else 0.0,
        graphs=graphs,
    )
    scheduler.reqs[OWN].sampling_params.custom_params = {OWN_PARAM: "health check"}  # as the tokenizer hook marks it
    with no_capture_errors(caplog):
        scheduler.run()
    assert capture.enabled and not capture.pending
    if graphs:  # decode steps replayed a graph, whose copy wrote their rows
        assert capture.graph is not None and capture.graph.captured and not capture.graph.failed
        assert capture.graph.entries == sum(1 for mode in scheduler.modes if mode is ForwardMode.DECODE) > 0
    modes = set(scheduler.modes)
    assert modes == {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE}, modes
    counters = capture.producer.close()
    assert consumer.wait(60) == 0
    assert counters.rows_dropped == 0

    store = open_store(tmp_path)
    names = [*(f"layer_{k}" for k in LAYERS), "last"]
    assert OWN not in store  # SGLang's own request: no row of it, no record
    for rid, req in scheduler.reqs.items():
        if rid == OWN:
            continue
        record = store.record(rid)
        prompt, output = list(req.origin_input_ids), list(req.output_ids)
        total = len(prompt) + len(output) - 1
        rows = store.get(rid)
        positions, tokens = rows["positions"][:total], rows["input_ids"][:total]
        assert positions.tolist() == list(range(total)), rid
        assert tokens.tolist() == (prompt + output)[:total], rid
        for t, name in enumerate(names):
            want = torch.tensor([expected_row(k, p, t) for k, p in zip(tokens.tolist(), positions.tolist())])
            assert torch.equal(rows[name][:total], want[:, None].expand(-1, HIDDEN)), (rid, name)
        if isinstance(req.finished_reason, FINISH_ABORT):
            assert record["status"] == "incomplete" and "aborted" in record["reason"], record
            continue
        assert record["status"] == "complete", record
        assert len(rows["positions"]) == total
        # The overlap loop runs each request one step past its end; the store cuts that row.
        assert record.get("surplus_rows", 0) == (1 if overlap else 0), record
    assert store.record("retracted")["meta"]["retractions"] == 1


def test_rows_wait_for_their_tokens_and_a_stuck_forward_stops_capture(
    tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A decode forward whose input token the host does not hold yet is announced once it does."""
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos")
    capture = capture_with_producer(config_for(endpoint, "cpu"))
    wait_attached(capture.producer)
    nothing = ScheduleBatch([], ForwardMode.DECODE, torch.tensor([]), [], [])

    def forward(req: Req, mode: ForwardMode, positions: list[int]) -> ScheduleBatch:
        rows = len(positions)
        states = torch.zeros(rows, len(LAYERS) + 1, HIDDEN)
        output = LogitsProcessorOutput(states[:, :-1].reshape(rows, -1), states[:, -1])
        batch = ScheduleBatch([req], mode, torch.tensor([positions[-1] + 1]), [positions[0]], [rows])
        capture.after_forward(GenerationBatchResult(output, torch.zeros(1)), None, batch)
        return batch

    req = Req("r", [11, 12, 13], SamplingParams(max_new_tokens=3))
    capture.after_batch_result(None, None, forward(req, ForwardMode.EXTEND, [0, 1, 2]))
    assert not capture.pending  # prompt tokens are on the host at once
    req.output_ids.append(21)
    capture.after_batch_result(None, None, forward(req, ForwardMode.DECODE, [3]))
    assert len(capture.pending) == 1  # a decode run: later steps of the same requests join its slot
    decode = forward(req, ForwardMode.DECODE, [4])  # joins it; its token, the next output, is not on the host yet
    capture.after_batch_result(None, None, nothing)
    assert len(capture.pending) == 1
    req.output_ids.extend([22, 23])
    req.finished_reason = FINISH_LENGTH(3)
    capture.after_batch_result(None, None, decode)  # the run is announced, then the request finished
    assert not capture.pending and capture.enabled

    # Forwards whose tokens never reach the host: capture stops, loudly; serving goes on. A run takes at most
    # RUN_STEPS of them (fewer when its slot fills).
    stuck = Req("s", [1], SamplingParams(max_new_tokens=9))
    with caplog.at_level(logging.ERROR, logger="hscapture.integrations.sglang"):
        for position in range(1, (MAX_PENDING + 1) * RUN_STEPS + 1):
            assert len(capture.pending) <= MAX_PENDING
            forward(stuck, ForwardMode.DECODE, [position])
            if not capture.enabled:
                break
            capture.after_batch_result(None, None, nothing)
    assert not capture.enabled and "forwards wait to be announced" in caplog.text
    assert consumer.wait(60) == 1  # the run ended in a capture failure: --exit-on-eos says so
    store = open_store(tmp_path)
    assert store.record("r")["status"] == "complete"
    rows = store.get("r")
    assert rows["positions"].tolist() == [0, 1, 2, 3, 4]
    assert rows["input_ids"].tolist() == [11, 12, 13, 21, 22]


@pytest.mark.slow
def test_standins_match_sglangs_own_classes() -> None:
    """Every attribute the hooks read exists on SGLang's classes, with the same types and answers."""
    from hscapture.integrations.sglang import use_cpu_host_env

    use_cpu_host_env()
    pytest.importorskip("sglang", reason="SGLang is not installed")
    from sglang.srt.layers import logits_processor
    from sglang.srt.managers import schedule_batch
    from sglang.srt.model_executor import forward_batch_info
    from sglang.srt.sampling.sampling_params import SamplingParams as RealSamplingParams

    real = schedule_batch.Req("r", "", array("q", [1, 2, 3]), RealSamplingParams(max_new_tokens=4))
    mine = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=4))
    for name in ("rid", "origin_input_ids", "output_ids", "finished_reason", "is_retracted", "retraction_count"):
        assert type(getattr(real, name)) is type(getattr(mine, name)), name
        assert getattr(real, name) == getattr(mine, name), name
    assert real.finished() is mine.finished() is False
    assert real.sampling_params.custom_params == mine.sampling_params.custom_params
    fields = {f.name for f in dataclasses.fields(schedule_batch.ScheduleBatch)}
    assert {f.name for f in dataclasses.fields(ScheduleBatch)} <= fields
    outputs = {f.name for f in dataclasses.fields(logits_processor.LogitsProcessorOutput)}
    assert {f.name for f in dataclasses.fields(LogitsProcessorOutput)} <= outputs
    for mode in ForwardMode:
        theirs = forward_batch_info.ForwardMode[mode.name]
        assert (theirs.is_decode(), theirs.is_extend(), theirs.is_idle()) == (
            mode.is_decode(),
            mode.is_extend(),
            mode.is_idle(),
        ), mode
    assert schedule_batch.FINISH_ABORT().to_json() == FINISH_ABORT().to_json()
    assert schedule_batch.FINISH_LENGTH(3).to_json() == FINISH_LENGTH(3).to_json()
    from sglang.srt.managers import utils as manager_utils

    results = {f.name for f in dataclasses.fields(manager_utils.GenerationBatchResult)}
    assert {f.name for f in dataclasses.fields(GenerationBatchResult)} - {"commits"} <= results
    assert {f.name for f in dataclasses.fields(ForwardBatch)} <= {
        f.name for f in dataclasses.fields(forward_batch_info.ForwardBatch)
    }


@pytest.mark.slow
def test_sglang_calls_capture_tail_hooks_as_the_plugin_expects() -> None:
    """The graph copy rides on SGLang's capture tail hooks: ``ModelRunner.capture_tail_hooks``, called inside every
    decode graph's capture as ``hook(graph_runner, out, forward_batch, num_tokens)``, with ``graph_runner.model_runner``
    the runner whose list it is; and a replayed forward says so in ``can_run_cuda_graph``. A change there must fail
    here, on the CPU, not silently on a GPU."""
    from hscapture.integrations.sglang import use_cpu_host_env

    use_cpu_host_env()
    pytest.importorskip("sglang", reason="SGLang is not installed")
    import inspect

    from sglang.srt.model_executor import model_runner
    from sglang.srt.model_executor.runner import base_runner, decode_cuda_graph_runner

    assert "self.capture_tail_hooks = []" in inspect.getsource(model_runner.ModelRunner.__init__)
    capture = inspect.getsource(decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_one_shape)
    assert "for capture_hook in self.model_runner.capture_tail_hooks:" in capture
    assert "capture_hook(self, out, forward_batch, num_tokens)" in capture
    assert "self.model_runner = model_runner" in inspect.getsource(base_runner.BaseRunner.__init__)
    forward = inspect.getsource(model_runner.ModelRunner)
    assert "self.decode_cuda_graph_runner.execute(" in forward and "can_run_graph=can_run_graph" in forward


@pytest.mark.slow
def test_sglang_marks_its_own_requests_and_stops_as_the_plugin_expects() -> None:
    """Every hook target exists. SGLang's graceful stop reaches each scheduler's ``handle_shutdown``; its warm-up is
    the request it sends while its HTTP server says ``Starting`` (``/health`` answers 503 then, and makes no request);
    its health checks carry the rid SGLang's own test knows; a request's ``cache_salt`` and ``custom_params`` reach the
    scheduler. A change there must fail here, not as warm-ups stored or runs that end as crashes."""
    from hscapture.integrations.sglang import use_cpu_host_env

    use_cpu_host_env()
    pytest.importorskip("sglang", reason="SGLang is not installed")
    import inspect
    import pkgutil

    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers import io_struct, scheduler, tokenizer_manager
    from sglang.srt.managers.utils import is_health_check_generate_req

    import hscapture.integrations.sglang as plugin

    batches = (plugin._MODEL_LOADED, plugin._FORWARD, plugin._BATCH_RESULT)
    for target in (*batches, plugin._RPC, plugin._SHUTDOWN, plugin._TOKENIZED):
        assert callable(pkgutil.resolve_name(target)), target
    assert "(ShutdownReq, self.handle_shutdown)" in inspect.getsource(scheduler.Scheduler.init_request_dispatcher)
    assert "self._dispatch_to_scheduler(ShutdownReq())" in inspect.getsource(
        tokenizer_manager.TokenizerManager.sigterm_watchdog
    )
    warmup = inspect.getsource(http_server._execute_server_warmup)
    assert warmup.index("requests.post(") < warmup.index("server_status = ServerStatus.Up")
    health = inspect.getsource(http_server.health_generate)
    assert "server_status == ServerStatus.Starting" in health and "HEALTH_CHECK_RID_PREFIX" in health
    assert is_health_check_generate_req(io_struct.GenerateReqInput(rid=f"{http_server.HEALTH_CHECK_RID_PREFIX}_x"))
    tokenized = inspect.getsource(tokenizer_manager.TokenizerManager._create_tokenized_object)
    assert "cache_salt=obj.cache_salt" in tokenized and "sampling_params=sampling_params" in tokenized
    handle = inspect.getsource(scheduler.Scheduler._handle_generate_request)
    assert "cache_salt=recv_req.cache_salt" in handle and "recv_req.sampling_params" in handle


#: A trained span per request sent with a loss mask, as ``extract --engine sglang --mode teacher`` sends it.
LOSS_MASKS = {"chunked": [10, 30, 45, 50], "late": [2, 9], "later": [0, 5, 20, 30]}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
@pytest.mark.parametrize("spec", ["every:3", "loss", "last"])
def test_hooks_keep_only_the_positions_asked(
    tmp_path: Path,
    endpoint: str,
    start_consumer: ConsumerFactory,
    caplog: pytest.LogCaptureFixture,
    spec: str,
    overlap: bool,
) -> None:
    """``--positions``: the plugin copies only the rows asked into the ring (the trained tokens of a request sent with a
    loss mask, or what it generates; its last prompt token under teacher forcing; every K-th position), across chunked
    prefill, mixed and decode batches and a retraction; each request is stored complete against what it asked."""
    consumer = start_consumer(tmp_path, endpoint, "--exit-on-eos", in_process=True)
    capture = capture_with_producer(config_for(endpoint, "cpu"), positions=spec)
    wait_attached(capture.producer)
    workload = plans()
    if spec == "last":  # teacher forcing: one token generated (and discarded), the last position is the prompt's
        workload = [dataclasses.replace(plan, max_new_tokens=1, abort_after=None) for plan in workload]
    scheduler = OverlapScheduler(
        capture, workload, device="cpu", hidden=HIDDEN, num_aux=len(LAYERS), overlap=overlap, hook=strict_hooks("cpu")
    )
    scheduler.reqs[OWN].sampling_params.custom_params = {OWN_PARAM: "health check"}
    for rid, flat in LOSS_MASKS.items():
        scheduler.reqs[rid].sampling_params.custom_params = {LOSS_MASK_PARAM: flat}
    with no_capture_errors(caplog):
        scheduler.run()
    capture.producer.close()
    assert consumer.wait(60) == 0
    store = open_store(tmp_path)
    assert store.metadata()["version"] == SELECTION_VERSION
    selection = Positions.parse(spec)
    held = 0
    for rid, req in scheduler.reqs.items():
        if rid == OWN or isinstance(req.finished_reason, FINISH_ABORT):
            continue
        record = store.record(rid)
        prompt, output = list(req.origin_input_ids), list(req.output_ids)
        total = len(prompt) + len(output) - 1
        assert record["status"] == "complete" and record["positions"] == spec, record
        rows = store.get(rid)
        asked = selection.asked(total, record["loss_mask"])
        assert rows["positions"].tolist() == asked.tolist() and record["rows"] == len(asked), (rid, record)
        assert rows["input_ids"].tolist() == [(prompt + output)[p] for p in asked], rid
        for t, name in enumerate([*(f"layer_{k}" for k in LAYERS), "last"]):
            want = torch.tensor([expected_row(k, p, t) for k, p in zip(rows["input_ids"].tolist(), asked.tolist())])
            assert torch.equal(rows[name], want[:, None].expand(-1, HIDDEN)), (rid, name)
        held += len(asked)
    assert held
    if spec == "loss":  # sent with a mask: its spans; without (regenerated): what it generated
        assert store.record("chunked")["loss_mask"] == [[10, 30], [45, 50]]
        short = store.record("short")
        assert short["loss_mask"] == [[5, short["num_tokens"]]] and short["rows"] == short["num_tokens"] - 5


@pytest.mark.slow
def test_sample_rate_picks_the_same_requests_by_id_and_marks_the_others_at_tokenization() -> None:
    """``serve --sample-rate``: a request is captured when a hash of its id falls below the rate (the same ids every
    run, about the rate's share of them); the tokenizer hook marks the others as SGLang's own requests are marked,
    with a cache namespace of their own, so that the scheduler's hooks skip them and no sampled request takes their
    prefix."""
    ids = [f"chat-{i}" for i in range(4000)]
    chosen = [rid for rid in ids if sampled(rid, 0.1)]
    assert chosen == [rid for rid in ids if sampled(rid, 0.1)]  # deterministic
    assert 0.08 < len(chosen) / len(ids) < 0.12
    assert set(chosen) <= {rid for rid in ids if sampled(rid, 0.5)}  # a larger rate keeps these and more
    assert all(sampled(rid, None) and sampled(rid, 1.0) for rid in ids[:50])
    with pytest.raises(ValueError, match=r"--sample-rate: 0 is not a rate; give the share of requests to capture"):
        check_rate(0)

    from hscapture.integrations.sglang import use_cpu_host_env

    use_cpu_host_env()
    pytest.importorskip("sglang", reason="SGLang is not installed")
    from sglang.srt.managers.tokenizer_manager import ServerStatus

    capture = SGLangCapture(PluginSettings(endpoint="ipc:///unused", http_server=True, sample_rate=0.1))
    manager = types.SimpleNamespace(server_status=ServerStatus.Up)
    for rid in ids[:200]:
        tokenized = types.SimpleNamespace(rid=rid, sampling_params=SamplingParams(8), cache_salt=None)
        capture.after_tokenize(tokenized, manager)
        marked = (tokenized.sampling_params.custom_params or {}).get(OWN_PARAM)
        assert (marked is None) == sampled(rid, 0.1), rid
        assert tokenized.cache_salt == (None if marked is None else OWN_CACHE_SALT), rid
