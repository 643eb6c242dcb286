"""A lean serving forward over HF Llama weights: a static KV cache written one position at a time.

Why not HF's own forward: with ``StaticCache`` under a CUDA graph, HF transformers 5.17 takes ~52 ms
per batch-64 decode step of an 8B Llama on an H200, ~70 % of it in a cache update that rewrites
whole cache tensors, against ~4.4 ms to read the weights once. Measured against such a slow step,
any capture overhead looks small. This forward reuses ``LlamaForCausalLM``'s modules and weights
(norms, projections, MLPs, rotary tables, LM head) and does what a serving engine does instead:

* decode writes only the new position's K/V into a preallocated ``[batch, kv_heads, capacity,
  head_dim]`` cache (one ``index_copy_``) and attends over the cache with a length mask (two
  batched matmuls, GQA by grouping query heads, no K/V expansion); every shape is fixed, no
  host sync, so a step can be captured in a CUDA graph;
* prefill runs equal-length sequences through causal SDPA and fills the cache.

It returns the EAGLE-3 capture set with every step: the residual stream entering each aux layer
(HF ``output_hidden_states[k]``) and the post-norm last hidden state (``output_hidden_states[-1]``).
``tests/test_bench.py`` checks both, and the logits, against HF's own forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

#: Llama-3.1-8B's dimensions.
LLAMA_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
}
#: The same architecture, small enough for a CPU smoke run (8 layers, so EAGLE-3's ids stay distinct).
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}


def random_llama(dims: dict[str, int], device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` built directly on ``device``; nothing is downloaded."""
    config = LlamaConfig(
        **dims,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
    )
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def save_random_llama(path: Path, dims: dict[str, int], tokenizer_dir: Path, device: torch.device) -> Path:
    """A random-init Llama of ``dims`` with the tokenizer of ``tokenizer_dir`` (vocabulary grown to fit it),
    saved as an HF model directory at ``path`` for an extraction to load; nothing is downloaded."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = random_llama({**dims, "vocab_size": max(dims["vocab_size"], len(tokenizer))}, device, torch.bfloat16)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return path


@dataclass
class KVCache:
    """Per layer, K and V as ``[batch, kv_heads, capacity, head_dim]``; allocated once."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, config: LlamaConfig, batch: int, capacity: int, device: torch.device, dtype: torch.dtype):
        head_dim = config.hidden_size // config.num_attention_heads
        shape = (batch, config.num_key_value_heads, capacity, head_dim)
        layers = config.num_hidden_layers
        return cls(
            k=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)],
            v=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)],
        )

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def randomize(self, scale: float = 0.5) -> None:
        """Random K/V everywhere: a decode benchmark attends over a prefix nobody prefilled."""
        for tensor in (*self.k, *self.v):
            tensor.normal_(0.0, scale)


class LeanLlama:
    """Decode and prefill steps over a ``LlamaForCausalLM``'s modules, returning the capture set.

    Args:
        model: the HF model whose modules and weights are used as they are.
        aux_layers: decoder layers whose entering residual stream is returned (EAGLE-3's aux set); ``L`` (the layer
            count) is the final norm's input.
    """

    def __init__(self, model: LlamaForCausalLM, aux_layers: Sequence[int]) -> None:
        config = model.config
        self.model = model
        self.config = config
        self.layers = model.model.layers
        self.aux_layers = tuple(aux_layers)
        if list(self.aux_layers) != sorted(set(self.aux_layers)) or not all(
            0 <= k <= config.num_hidden_layers for k in self.aux_layers
        ):
            raise ValueError(
                f"aux_layers: {list(self.aux_layers)} must be distinct ascending ids in 0..{config.num_hidden_layers}"
            )
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.group = self.heads // self.kv_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        if (
            config.hidden_act != "silu"
            or getattr(config, "attention_bias", False)
            or getattr(config, "mlp_bias", False)
        ):
            raise ValueError("LeanLlama: Llama with SiLU and no projection biases expected")
        # One GEMM for q|k|v and one for gate|up, as engines do; HF's modules keep working on views.
        self.qkv = [
            _fuse(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in self.layers
        ]
        self.gate_up = [_fuse(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in self.layers]

    @property
    def num_states(self) -> int:
        """Tensors in the capture set: the aux layers plus the post-norm last state."""
        return len(self.aux_layers) + 1

    def weight_bytes_per_decode(self) -> int:
        """Bytes of weights one decode step reads: every decoder layer, the final norm and the LM head."""
        params = [*self.layers.parameters(), *self.model.model.norm.parameters(), *self.model.lm_head.parameters()]
        return sum(p.numel() * p.element_size() for p in params)

    # ------------------------------------------------------------------ steps

    def decode(
        self, cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One token for each of ``bs`` sequences; sequence ``b`` writes cache position ``positions[b]``.

        Args:
            cache: the first ``bs`` rows are used.
            input_ids: ``[bs]`` int64 tokens.
            positions: ``[bs]`` int64 positions (< ``cache.capacity``; not checked, that would sync).

        Returns:
            the capture set (each ``[bs, hidden]``) and the greedy next tokens ``[bs]``.
        """
        bs, capacity = input_ids.shape[0], cache.capacity
        device = input_ids.device
        # Flat row of (sequence b, kv head h, position p) in a [bs * kv_heads * capacity, head_dim] view.
        heads = torch.arange(self.kv_heads, device=device)
        rows = (torch.arange(bs, device=device)[:, None] * self.kv_heads + heads[None, :]) * capacity
        rows = (rows + positions[:, None]).reshape(-1)
        valid = torch.arange(capacity, device=device)[None, :] <= positions[:, None]
        bias = torch.zeros(valid.shape, device=device, dtype=torch.float32).masked_fill_(~valid, float("-inf"))
        bias = bias[:, None, None, :]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = cache.k[layer][:bs], cache.v[layer][:bs]
            k_cache.view(-1, self.head_dim).index_copy_(0, rows, k.reshape(-1, self.head_dim))
            v_cache.view(-1, self.head_dim).index_copy_(0, rows, v.reshape(-1, self.head_dim))
            q = q.view(bs, self.kv_heads, self.group, self.head_dim)
            scores = torch.add(bias, torch.matmul(q, k_cache.transpose(-1, -2)), alpha=self.scale)  # fp32
            weights = scores.softmax(-1).to(q.dtype)
            return torch.matmul(weights, v_cache).reshape(bs, self.heads * self.head_dim)

        last, states = self._layers(self.model.model.embed_tokens(input_ids), positions, attend)
        return states, self.model.lm_head(last).argmax(-1)

    def prefill(self, cache: KVCache, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``[batch, seq]`` equal-length prompts from position 0; fills cache positions ``0..seq-1``.

        Returns:
            the capture set (each ``[batch * seq, hidden]``, sequence-major) and the next token
            of every sequence ``[batch]``.
        """
        batch, seq = input_ids.shape
        if batch > cache.batch or seq > cache.capacity:
            raise ValueError(f"prefill: [{batch}, {seq}] does not fit a cache of [{cache.batch}, {cache.capacity}]")
        positions = torch.arange(seq, device=input_ids.device).repeat(batch)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q = q.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
            cache.k[layer][:batch, :, :seq].copy_(k)
            cache.v[layer][:batch, :, :seq].copy_(v)
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.transpose(1, 2).reshape(batch * seq, self.heads * self.head_dim)

        last, states = self._layers(self.model.model.embed_tokens(input_ids.reshape(-1)), positions, attend)
        return states, self.model.lm_head(last.view(batch, seq, -1)[:, -1]).argmax(-1)

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor, attend) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder stack over ``[tokens, hidden]`` rows; ``attend`` does the cache and attention."""
        cos, sin = self.model.model.rotary_emb(hidden, positions[None])
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * sin_signed: one roll instead of a negation and a concat
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [tokens, 1, head_dim]: broadcast over heads
        tokens, heads, kv_heads, head_dim = hidden.shape[0], self.heads, self.kv_heads, self.head_dim
        states: list[torch.Tensor] = []
        for index, layer in enumerate(self.layers):
            if index in self.aux_layers:
                states.append(hidden)  # never written in place below, so the reference stays valid
            qkv = F.linear(_rms_norm(hidden, layer.input_layernorm), self.qkv[index])
            qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)  # rotary on q and k at once
            v = qkv[:, (heads + kv_heads) * head_dim :].reshape(tokens, kv_heads, head_dim)
            out = attend(index, qk[:, :heads], qk[:, heads:].contiguous(), v)
            hidden = hidden + layer.self_attn.o_proj(out)
            gate, up = F.linear(_rms_norm(hidden, layer.post_attention_layernorm), self.gate_up[index]).chunk(2, dim=-1)
            hidden = hidden + layer.mlp.down_proj(F.silu(gate) * up)
        if len(self.layers) in self.aux_layers:  # layer L: the residual stream leaving the last layer
            states.append(hidden)
        last = _rms_norm(hidden, self.model.model.norm)
        return last, [*states, last]


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """HF's LlamaRMSNorm as one fused op (F.rms_norm: fp32 inside, one rounding at the end)."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _fuse(*linears: torch.nn.Linear) -> torch.Tensor:
    """Concatenate the weights of ``linears`` into one matrix and re-point each module at its rows.

    The HF modules then hold views of the fused weight, so memory is not doubled and the model
    stays an ordinary ``LlamaForCausalLM``.
    """
    fused = torch.cat([linear.weight for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused
