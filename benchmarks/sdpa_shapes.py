"""What a new shape costs each attention backend: the one-time setup an extraction pays per padded length.

    python -m benchmarks.sdpa_shapes --shapes '[[2, 1187], [3, 906], ...]' [--device cuda]
        [--heads 32 --kv-heads 8 --head-dim 128] [--dtype bfloat16]

Runs in a fresh process (nothing cached) and prints one JSON object. The call is the one
transformers' ``sdpa_attention_forward`` makes for a right-padded batch: query ``[B, H, S, D]``
as a transposed view of ``[B, S, H, D]``, keys and values repeated from the KV heads to ``H``
(HF does that itself whenever it passes a mask), and a boolean ``[B, 1, S, S]`` mask (causal and
key padding). It reports the backend PyTorch picks for that call, then for each backend (cuDNN,
memory-efficient, and PyTorch's own choice) the first call and the best of three repeats of each
shape, every backend on shapes of its own (a backend's cache must not have seen them), after one
warm-up call so that loading the backend's kernels is not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

#: Backends tried, with the ones allowed in each.
BACKENDS: dict[str, list[SDPBackend] | None] = {
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "default": None,
}


def hf_call(batch: int, length: int, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """Query, keys, values and mask shaped and laid out as HF passes them for a right-padded batch."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    query = torch.randn(batch, length, args.heads, args.head_dim, device=device, dtype=dtype).transpose(1, 2)
    kv = [torch.randn(batch, length, args.kv_heads, args.head_dim, device=device, dtype=dtype) for _ in range(2)]
    repeat = args.heads // args.kv_heads
    key, value = (t.transpose(1, 2).repeat_interleave(repeat, dim=1).contiguous() for t in kv)
    lengths = torch.tensor([length] + [max(1, length - length * i // (2 * batch)) for i in range(1, batch)])
    positions = torch.arange(length)
    mask = (positions[None, :] <= positions[:, None])[None, None] & (positions < lengths[:, None])[:, None, None, :]
    return query, key, value, mask.to(device)


def timed_ms(call: Any, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) * 1e3


def probe(name: str, allowed: list[SDPBackend] | None, shapes: list[list[int]], args: argparse.Namespace) -> dict:
    """First-call and repeat times of one backend over ``shapes``."""
    device = torch.device(args.device)
    firsts, repeats = [], []
    try:
        with sdpa_kernel(allowed) if allowed else contextlib.nullcontext():
            warm = hf_call(1, 72, args)
            F.scaled_dot_product_attention(*warm[:3], attn_mask=warm[3])
            for batch, length in shapes:
                q, k, v, mask = hf_call(batch, length, args)

                def call(q=q, k=k, v=v, mask=mask) -> None:
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

                firsts.append(timed_ms(call, device))
                repeats.append(min(timed_ms(call, device) for _ in range(3)))
    except RuntimeError as exc:  # the backend cannot run this call here
        return {"error": str(exc).splitlines()[0][:300]}
    extra = [f - r for f, r in zip(firsts, repeats)]
    return {
        "shapes": len(shapes),
        "first_call_ms_median": round(statistics.median(firsts), 3),
        "repeat_ms_median": round(statistics.median(repeats), 3),
        "one_time_ms_per_shape_median": round(statistics.median(extra), 3),
        "one_time_ms_total": round(sum(extra), 1),
        "repeat_ms_total": round(sum(repeats), 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", required=True, help="JSON list of [batch, padded length], distinct")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    shapes = [list(map(int, s)) for s in json.loads(args.shapes)]
    q, k, v, mask = hf_call(*shapes[0], args)
    choice = SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, False)).name
    cuda = torch.device(args.device).type == "cuda"
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "cudnn_version": torch.backends.cudnn.version() if cuda else None,
        "call": f"[B, {args.heads}, S, {args.head_dim}] {args.dtype}, keys/values repeated from {args.kv_heads} heads, "
        "bool mask [B, 1, S, S]",
        "backend_picked": choice,
        "enabled": {
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        },
    }
    for i, (name, allowed) in enumerate(BACKENDS.items()):
        result[name] = probe(name, allowed, shapes[i :: len(BACKENDS)], args)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
