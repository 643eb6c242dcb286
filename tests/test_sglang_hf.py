"""Real SGLang (CPU path) against HF ``output_hidden_states`` on the tiny DeepSeek-V2 (MLA + MoE).

The other SGLang tests compare the store with SGLang's own output, bit for bit; these compare
SGLang with HF, which is what the README's "SGLang and HF differ by ~1 %" claims. On this host
the DeepSeek family disagrees with HF by 3.5-10x (relative L2) on prefill rows, and the cause is SGLang's
torch_native attention backend, not the tiny config: a prefill without cached prefix takes
SGLang's MHA path, which torch_native computes over the MLA latent cache instead of the keys and
values it is given (``tests/sglang_driver.py:absorbed_mla_hook`` names the lines). Making that
prefill take SGLang's absorbed-MLA path, as SGLang itself does whenever a prefix is cached, brings
every stored layer within ~1 % of HF, like Llama. The tiny config's equal widths
(``kv_lora_rank + qk_rope_head_dim == qk_nope_head_dim + qk_rope_head_dim``, ``kv_lora_rank ==
v_head_dim``) are what let the wrong path run at all: other widths crash it (a shape error in
``scaled_dot_product_attention``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hscapture.integrations.sglang import ENV
from hscapture.store.reader import open_store
from tests.conftest import ConsumerFactory

pytest.importorskip("sglang", reason="SGLang is not installed (pip install -e '.[sglang]')")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: One prompt prefilled in one chunk (the driver's chunk is 32 tokens) and a short one; both then decode.
PROMPTS = [list(range(10, 42)), [5, 6, 7, 8, 9]]
#: Measured here: tiny Llama 0.4-0.9 %, tiny DeepSeek with absorbed-MLA prefill 0.3-1.3 %; the MHA prefill
#: path is 3.5x and more off.
HF_AGREEMENT = 0.03


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hscapture.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("sglang-hf") / "deepseek_v2", "deepseek_v2")


def _sglang(model: Path, tmp: Path, *options: str) -> list[dict]:
    """One engine run of ``tests.sglang_driver`` over PROMPTS (4 new tokens each)."""
    prompts, out = tmp / "prompts.json", tmp / "result.json"
    prompts.write_text(json.dumps(PROMPTS))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(ENV, None)
    command = [sys.executable, "-m", "tests.sglang_driver", "--model", str(model), "--prompts", str(prompts)]
    subprocess.run([*command, "--out", str(out), "--max-new-tokens", "4", *options], check=True, env=env, timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def hf_states(deepseek: Path) -> Callable[[list[int]], tuple[torch.Tensor, ...]]:
    """HF's ``output_hidden_states`` of one sequence, in the stored dtype (bf16), each ``[T, H]``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(deepseek, dtype=torch.bfloat16).eval()

    def states(token_ids: list[int]) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return tuple(h[0] for h in hf(torch.tensor([token_ids]), output_hidden_states=True).hidden_states)

    return states


def _relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_deepseek_store_agrees_with_hf_when_sglang_prefills_by_absorbed_mla(
    deepseek: Path, hf_states: Callable, tmp_path: Path, endpoint: str, start_consumer: ConsumerFactory
) -> None:
    """Everything but torch_native's MHA prefill (config, MoE, rope, norms, weights, capture) matches HF."""
    store_dir = tmp_path / "store"
    consumer = start_consumer(store_dir, endpoint, "--exit-on-eos")
    results = _sglang(deepseek, tmp_path, "--capture", endpoint, "--absorbed-mla")
    assert consumer.wait(60) == 0
    store = open_store(store_dir)
    assert store.summary()["complete"] == len(PROMPTS)
    layers = store.metadata()["runs"][0]["meta"]["config"]["layers"]
    errors: dict[str, float] = {}
    for result in results:
        tokens = (result["prompt"] + result["output_ids"])[:-1]
        rows = store.get(result["rid"])
        assert rows["input_ids"].tolist() == tokens
        hf = hf_states(tokens)
        for k in layers:
            errors[f"{result['rid'][:8]} layer_{k}"] = _relative_l2(rows[f"layer_{k}"], hf[k])
        errors[f"{result['rid'][:8]} last"] = _relative_l2(rows["last"], hf[-1])
    print("relative L2 vs HF:", {name: round(e, 4) for name, e in errors.items()})
    assert max(errors.values()) < HF_AGREEMENT, f"SGLang (absorbed MLA) vs HF relative L2: {errors}"


def test_deepseek_prefill_on_sglang_cpu_path_still_misses_hf(
    deepseek: Path, hf_states: Callable, tmp_path: Path
) -> None:
    """What the README says of SGLang's CPU path: DeepSeek prefill rows are far off HF (an SGLang bug).

    When this fails, SGLang's torch_native backend has been fixed: drop the README's DeepSeek note
    and this test, and let the test above run without ``--absorbed-mla``.
    """
    result = _sglang(deepseek, tmp_path, "--aux")[0]
    prompt, tokens = result["prompt"], (result["prompt"] + result["output_ids"])[:-1]
    aux = torch.tensor(result["hidden_states"])  # SGLang's default aux layers for 8 layers: [2, 4, 5]
    assert aux.shape[0] == len(tokens), "the prompt is prefilled in one chunk, so SGLang returns every row"
    width = aux.shape[1] // 3
    hf = hf_states(tokens)
    errors = [
        _relative_l2(aux[: len(prompt), j * width : (j + 1) * width], hf[k][: len(prompt)])
        for j, k in enumerate((2, 4, 5))
    ]
    print("prefill relative L2 vs HF, layers 2, 4, 5:", [round(e, 3) for e in errors])
    assert min(errors) > 1.0, (
        f"SGLang's DeepSeek prefill on the CPU path now agrees with HF ({errors}): update the README"
    )
