"""What the engine stand-ins (``sglang_standin``, ``vllm_standin``) share: the values their "model" writes, and GPU
time queued ahead of its outputs.

The stand-in model writes ``token * 1024 + position + t / 4`` into every column of captured tensor ``t`` (the aux
layers, then the final state), so a float32 store can be checked exactly against :func:`expected_row`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from hscapture.config import CaptureConfig

#: Token ids stay below this, so ``token * 1024 + position`` is exact in float32.
VOCAB = 1000


def expected_row(token: int, position: int, tensor: int) -> float:
    """The value the stand-in model writes into every column of captured tensor ``tensor``."""
    return token * 1024 + position + tensor / 4


def prompts(seed: int) -> Callable[[int], list[int]]:
    """``prompt(n)``: ``n`` random token ids below :data:`VOCAB`, the same ones for the same ``seed``."""
    rng = np.random.default_rng(seed)
    return lambda n: rng.integers(1, VOCAB, n).tolist()


def cycles_for(seconds: float) -> int:
    """``torch.cuda._sleep`` cycles that keep the GPU busy about ``seconds``."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe // 10)  # warm-up
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return max(1, int(probe * seconds * 1e3 / start.elapsed_time(end)))


def capture_config(endpoint: str, device: str, layers: Sequence[int], hidden: int) -> CaptureConfig:
    """What the stand-in tests capture: ``layers`` and the last layer, ``hidden`` wide, in float32 (where the model's
    values are exact), ``block`` (nothing dropped), 8 rows a slot (a prefill step spans several), 8 slots."""
    row_bytes = (len(layers) + 1) * hidden * 4
    return CaptureConfig(
        layers=tuple(layers),
        hidden_size=hidden,
        num_layers=8,
        dtype="float32",
        device=device,
        policy="block",
        endpoint=endpoint,
        slot_bytes=8 * row_bytes,
        ring_bytes=8 * 8 * row_bytes,
        max_step_rows=64,
        block_timeout_s=60,
    )
