"""The per-architecture table of SGLang's aux capture, and the launchers' refusals before SGLang starts.

No engine runs here (tests/test_sglang.py runs SGLang itself on each architecture); these are
the numbering rules read from SGLang 0.5.23's setters, and what a user sees for a model or a
layer hscapture cannot capture.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hscapture.cli import main
from hscapture.integrations.sglang_models import ARCHITECTURES, architecture, capture_layers, sglang_layer_ids


def _sglang_setter(arch: str, ids: list[int]) -> list[int]:
    """What SGLang 0.5.23's set_eagle3_layers_to_capture stores for explicit ids (llama.py, deepseek_v2.py)."""
    if ARCHITECTURES[arch].ids == "plus_one":
        return [k + 1 for k in ids]
    return [k + 1 for k in ids] if ids and ids[0] == 1 else list(ids)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_ids_passed_to_sglang_make_its_setter_capture_exactly_the_layers_asked(arch: str) -> None:
    row = ARCHITECTURES[arch]
    lo, hi = row.layer_range(8)
    for layers in ([lo, 4, hi], [1, 3, 6], [2, 4, 5], [hi], [3, 7]):
        if layers == [1] or not all(lo <= k <= hi for k in layers):
            continue
        chosen = capture_layers(row, 8, layers)
        ids = sglang_layer_ids(row, chosen)
        assert sorted(set(_sglang_setter(arch, ids))) == list(chosen) == sorted(layers), (arch, layers, ids)
        assert min(ids) >= 0 and max(ids) < 8, "SGLang accepts ids 0..L-1 only"


def test_layer_ranges_and_numbering_per_family() -> None:
    llama, deepseek, kimi, gemma = (
        ARCHITECTURES[n]
        for n in ("LlamaForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "Gemma3ForCausalLM")
    )
    assert sglang_layer_ids(llama, [2, 4, 5]) == [1, 3, 4]  # "layer i takes the output of layer i-1"
    assert sglang_layer_ids(deepseek, [2, 4, 5]) == [2, 4, 5]  # as given
    assert sglang_layer_ids(kimi, [1, 3, 6]) == [3, 6, 1]  # a first id 1 would become 2: put it last
    with pytest.raises(ValueError, match=r"turns a first id 1 into layer 2; add another layer"):
        sglang_layer_ids(kimi, [1])
    assert llama.layer_range(8) == (1, 7) and deepseek.layer_range(8) == (0, 7) and gemma.layer_range(8) == (1, 8)
    with pytest.raises(
        ValueError, match=r"--layers: SGLang's LlamaForCausalLM captures layers 1\.\.7 of the model's 8, got \[0\]"
    ):
        capture_layers(llama, 8, [0, 4])
    with pytest.raises(
        ValueError, match=r"--layers: SGLang's DeepseekV3ForCausalLM captures layers 0\.\.7 of the model's 8, got \[8\]"
    ):
        capture_layers(deepseek, 8, "2,8")
    with pytest.raises(ValueError, match=r"--layers: layers \[2\] named twice in \[2, 2, 4\]; name each layer once"):
        capture_layers(llama, 8, [2, 2, 4])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_all_layers_is_what_each_architecture_captures_from_layer_1(arch: str) -> None:
    """``--layers all`` gives every layer the architecture's capture reaches (not the embedding output, layer 0), and
    the ids passed to SGLang make its setter capture exactly those; ranges resolve the same way."""
    row = ARCHITECTURES[arch]
    lo, hi = row.layer_range(8)
    chosen = capture_layers(row, 8, "all")
    assert chosen == tuple(range(max(1, lo), hi + 1)), arch
    assert sorted(set(_sglang_setter(arch, sglang_layer_ids(row, chosen)))) == list(chosen), arch
    assert capture_layers(row, 8, "1-7:3") == (1, 4, 7) if hi >= 7 else True
    assert capture_layers(row, 8, "5,1-3") == (1, 2, 3, 5)  # SGLang captures in layer order


def test_default_layers_are_eagle3s_without_the_repeat_of_shallow_models(caplog: pytest.LogCaptureFixture) -> None:
    qwen3 = ARCHITECTURES["Qwen3ForCausalLM"]
    assert capture_layers(qwen3, 32, None) == (2, 16, 29) and not caplog.records
    assert capture_layers(qwen3, 6, None) == (2, 3)
    assert "EAGLE-3's default layers [2, 3, 3] repeat a layer at 6 decoder layers; capturing [2, 3]" in caplog.text


def test_descriptions_say_which_tensor_each_architecture_keeps() -> None:
    residual = ARCHITECTURES["KimiK25ForConditionalGeneration"].describe([3], True)
    assert residual == [
        "residual stream entering decoder layer 3 (hidden + residual before its input norm); "
        "SGLang KimiK25ForConditionalGeneration layers_to_capture 3, HF output_hidden_states[3]",
        "final hidden state after the model's last norm (SGLang last_hidden_states, LM head input)",
    ]
    (gemma,) = ARCHITECTURES["Gemma3ForConditionalGeneration"].describe([8], False)
    assert gemma.startswith(
        "output of decoder layer 7's MLP branch after its post-feedforward norm, before it is added"
    )
    assert "not HF output_hidden_states[8]" in gemma
    with pytest.raises(ValueError, match=r"'GptOssForCausalLM': hscapture does not know which tensor .* supported: "):
        architecture("GptOssForCausalLM")


def _model_dir(path: Path, config: dict) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("command", ["extract", "serve"])
def test_launchers_refuse_what_sglang_cannot_capture_before_it_starts(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    gpt_oss = _model_dir(tmp_path / "gpt-oss", {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 24})
    kimi = _model_dir(
        tmp_path / "kimi",
        {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {"num_hidden_layers": 61}},
    )
    cases = [
        (gpt_oss, [], "SGLang architecture 'GptOssForCausalLM': hscapture does not know which tensor"),
        (
            kimi,
            ["--layers", "1,30,61"],
            "--layers: SGLang's KimiK25ForConditionalGeneration captures layers 0..60 of the model's 61, got [61]",
        ),
        (kimi, ["--layers", "1"], "turns a first id 1 into layer 2; add another layer"),
        (kimi, ["--layers", "0-64:8"], "--layers: [64] out of range; the model has 61 decoder layers"),
    ]
    for model, options, message in cases:
        out = tmp_path / f"out-{model.name}"
        if command == "extract":
            argv = ["extract", "--engine", "sglang", "--model", str(model), "--out", str(out), *options]
        else:
            argv = ["serve", "--out", str(out), *options, "--", "--model-path", str(model)]
        code = main(argv)
        stderr = capsys.readouterr().err
        assert code == 2 and message in stderr, stderr[-2000:]


def test_arguments_after_dashes_need_the_sglang_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["extract", "--out", str(tmp_path / "o"), "--", "--json-model-override-args", "{}"]) == 2
    message = "--json-model-override-args {}: arguments after -- are SGLang's; they need --engine sglang"
    assert message in capsys.readouterr().err
