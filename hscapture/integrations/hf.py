"""HF transformers integration: hooks that capture what SGLang captures for EAGLE-3.

Layer ``k`` is the residual stream entering decoder layer ``k`` (the decoder layer's input,
which in HF already is hidden + residual, before the layer's input norm): HF's
``output_hidden_states[k]``, and SGLang's ``layers_to_capture`` entry ``k``. Layer ``L`` (the
number of decoder layers) is the final norm's input, the residual stream leaving the last layer:
vLLM's aux layer id ``L``, which HF's ``output_hidden_states`` lacks. ``last`` is the output of
the model's final norm: HF's ``output_hidden_states[-1]``, what the LM head reads.

The hooks only keep references during the forward; :meth:`HFCapture.collect` hands them
to the producer right after it, which copies the kept rows into the ring. HF's eager
forward never writes those tensors in place, so the references stay valid until then.
:class:`HFExtraction` is the ``hf`` engine of ``hscapture extract``: it loads the model and
runs the forward passes that :func:`hscapture.extract.extract` schedules.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hscapture.config import (
    DTYPES,
    CaptureConfig,
    check_layer_ids,
    default_ring_bytes,
    default_slot_bytes,
    dtype_name,
    layer_spec,
    resolve_layers,
    torch_dtype,
)
from hscapture.config import eagle3_default_layers as eagle3_default_layers  # extract and tests import it here
from hscapture.data import Sample, check_batching, loss_mask_ranges, pad_batch, padded_length
from hscapture.errors import HSCaptureError
from hscapture.producer import Producer, device_index
from hscapture.selection import Positions

LAST = "last"
#: Rows a ring slot holds in extraction: no decode runs to join, so fewer than a serving slot; enough that the
#: per-slot host work is paid once per hundreds of rows however wide a row is.
EXTRACT_SLOT_ROWS = 512


def decoder(model: nn.Module) -> nn.Module:
    """A causal LM's decoder stack (embeddings, decoder layers, final norm): the model without its LM head."""
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)


def decoder_parts(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layer list and the final norm of a transformers causal LM.

    Raises:
        TypeError: the model does not expose ``get_decoder().layers`` and ``.norm``.
    """
    stack = decoder(model)
    layers = getattr(stack, "layers", None)
    norm = getattr(stack, "norm", None)
    if not isinstance(layers, nn.ModuleList) or norm is None:
        raise TypeError(
            f"{type(model).__name__}: expected a decoder with `.layers` (ModuleList) and a final `.norm`, "
            "as Llama, Qwen, Mistral and DeepSeek models in transformers have"
        )
    return layers, norm


def describe(layers: Sequence[int], capture_last: bool, num_layers: int | None = None) -> list[str]:
    """One sentence per captured tensor saying exactly what it is (stored with the data)."""
    out = [
        f"residual stream leaving the last decoder layer {k - 1} (hidden + residual, the final norm's input); "
        f"vLLM aux layer id {k}, speculators' verifier last hidden state; not in HF output_hidden_states"
        if k == num_layers
        else f"residual stream entering decoder layer {k} (hidden + residual before its input norm); "
        f"HF output_hidden_states[{k}], SGLang layers_to_capture {k}"
        for k in layers
    ]
    if capture_last:
        out.append("final hidden state after the model's last norm; HF output_hidden_states[-1] (LM head input)")
    return out


class HFCapture:
    """Forward hooks on a transformers causal LM that keep the chosen hidden states of a forward.

    Args:
        model: a transformers causal LM (Llama family layout).
        layers: layer ids, ``0 <= k <= num_layers`` (``num_layers``: the final norm's input).
        capture_last: also keep the final norm's output.

    Raises:
        ValueError: a layer id is out of range (the message gives the valid range).
    """

    def __init__(self, model: nn.Module, layers: Sequence[int], capture_last: bool = True) -> None:
        decoder_layers, norm = decoder_parts(model)
        self.num_layers = len(decoder_layers)
        check_layer_ids(layers, self.num_layers)
        self.layers = tuple(layers)
        self.capture_last = capture_last
        self.names = [f"layer_{k}" for k in self.layers] + ([LAST] if capture_last else [])
        self._kept: dict[str, torch.Tensor] = {}
        entering = [*decoder_layers, norm]  # what layer id k enters: decoder layer k, or the final norm for k = L
        self._handles = [
            entering[k].register_forward_pre_hook(self._keep_input(f"layer_{k}"), with_kwargs=True) for k in self.layers
        ]
        if capture_last:
            self._handles.append(norm.register_forward_hook(self._keep_output(LAST)))

    def _keep_input(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._kept[name] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _keep_output(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            self._kept[name] = output

        return hook

    def collect(self) -> list[torch.Tensor]:
        """The kept tensors of the last forward, each ``[batch * seq, hidden]``, in ``names`` order.

        Raises:
            RuntimeError: no forward ran since the last ``collect``.
        """
        missing = [n for n in self.names if n not in self._kept]
        if missing:
            raise RuntimeError(f"HFCapture: no hidden states for {missing}; run a forward before collect()")
        kept, self._kept = self._kept, {}
        return [kept[n].reshape(-1, kept[n].shape[-1]) for n in self.names]

    def remove(self) -> None:
        """Detach the hooks. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._kept = {}

    def __enter__(self) -> HFCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def greedy_generate(
    model: nn.Module,
    capture: HFCapture | None,
    producer: Any,
    prompts: Sequence[Sequence[int]],
    request_ids: Sequence[str],
    max_new_tokens: int,
    pad_id: int = 0,
) -> list[list[int]]:
    """A minimal batched serving loop (left-padded prefill, then KV-cached decode) with capture.

    Each forward's real rows go to ``producer.capture_step`` right after it: prompt rows at
    prefill, one row per request at each decode step, attributed to the request, position and
    the token fed at that position. Requests are finished with ``finish_request`` at the end.
    With ``capture=None`` (and a :class:`~hscapture.producer.NullProducer`) it is the same loop
    without capture, which is what the overhead benchmark compares against.

    Returns:
        The generated token ids of each request.
    """
    device = next(model.parameters()).device
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.int64)
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kept = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
    generated: list[list[int]] = [[] for _ in prompts]
    # transformers renamed `past_key_values` to `cache` (5.2x); speak whichever this version does.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = None
    step_ids, step_mask, step_positions = input_ids, mask, positions
    with torch.inference_mode():
        for step in range(max_new_tokens):
            out = model(
                input_ids=step_ids.to(device),
                attention_mask=step_mask.to(device),
                position_ids=step_positions.to(device),
                use_cache=True,
                **({cache_arg: cache} if cache is not None else {}),
            )
            cache = getattr(out, cache_arg)
            if capture is not None:
                rows = lengths if step == 0 else [1] * len(prompts)
                producer.capture_step(
                    capture.collect(),
                    request_ids,
                    rows,
                    positions=positions.reshape(-1)[kept] if step == 0 else step_positions.reshape(-1),
                    token_ids=input_ids.reshape(-1)[kept] if step == 0 else step_ids.reshape(-1),
                    row_index=kept.to(device) if step == 0 else None,
                )
            # The loop's own greedy sampling, capture on or off: a serving loop needs its tokens on the host. The
            # capture hook above reads token ids from these host tensors and adds no sync of its own.
            next_ids = out.logits[:, -1].argmax(-1).cpu()
            for row, token in enumerate(next_ids.tolist()):
                generated[row].append(token)
            step_positions = (step_positions[:, -1:] + 1) if step else (positions[:, -1:] + 1)
            step_ids = next_ids[:, None]
            mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=torch.int64)], dim=1)
            step_mask = mask
    for row, request_id in enumerate(request_ids):
        # The last generated token was never fed back, so it has no hidden state.
        producer.finish_request(request_id, num_tokens=lengths[row] + max_new_tokens - 1)
    return generated


def load_model(model_dir: Path | None, dtype: str | None, device: str) -> tuple[Any, Any, Path]:
    """Tokenizer and eval-mode causal LM; with no directory, the embedded tiny Llama."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from hscapture.tiny import ensure_tiny_model

    path = Path(model_dir) if model_dir is not None else ensure_tiny_model()
    if not (path / "config.json").exists():
        raise ValueError(f"--model: {str(path)!r} has no config.json; give a local HF model directory")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path)
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype) if dtype else "auto"}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
    return tokenizer, model, path


def steps(lengths: Sequence[int], max_rows: int) -> list[tuple[int, int, list[int], list[int]]]:
    """A batch's kept rows (requests' rows in order, ``lengths`` each) in ring steps of at most ``max_rows`` rows.

    Returns:
        Per step: its first and past-last kept row, the requests (indices into ``lengths``) whose rows it holds,
        and how many of each; a request longer than ``max_rows`` spans several steps.
    """
    out: list[tuple[int, int, list[int], list[int]]] = []
    begin, owners, counts = 0, [], []
    for request, length in enumerate(lengths):
        left = length
        while left:
            take = min(left, max_rows - sum(counts))
            owners.append(request)
            counts.append(take)
            left -= take
            if sum(counts) == max_rows:
                out.append((begin, begin + max_rows, owners, counts))
                begin, owners, counts = begin + max_rows, [], []
    if counts:
        out.append((begin, begin + sum(counts), owners, counts))
    return out


class AttentionKernels:
    """Which attention kernels a batch of a given shape may run on a GPU: cuDNN's only once the shape earned its plan.

    Measured on an H200 (causal bf16, 32 heads of 128, unmasked): cuDNN's SDPA is the fastest per call but
    plans each new shape once, ~65 ms (the whole one-time cost of a new shape in an extraction); flash
    plans nothing and is slower per call by about ``SAVED_MS`` per batch x tokens² and layer (0.03 ms at 1024
    tokens, 0.2 ms at 4096, 11 ms at 32768). Ski rental: a shape runs flash until the time cuDNN would
    have saved it reaches the plan's cost, then cuDNN's; never more than twice the better of the two
    chosen in hindsight. A long-context shape earns its plan in a batch or two; a short one, which meets
    many shapes, seldom does.
    """

    #: cuDNN's plan of one new shape, ms.
    PLAN_MS = 65.0
    #: What cuDNN saves against flash per call of one layer, ms per batch x tokens² at 4096 (heads x head dim).
    SAVED_MS = 1e-8

    def __init__(self, model: nn.Module) -> None:
        config = decoder(model).config
        heads, head_dim = getattr(config, "num_attention_heads", None), getattr(config, "head_dim", None)
        width = heads * head_dim if heads and head_dim else config.hidden_size  # query heads x head dim
        self._scale = self.SAVED_MS * len(decoder_parts(model)[0]) * width / 4096
        self._saved: dict[tuple[int, int], float] = {}  # per shape: what cuDNN would have saved it so far

    def __call__(self, batch: int, tokens: int) -> contextlib.AbstractContextManager[None]:
        """The kernels for the next forward of ``batch`` sequences of ``tokens`` (a context to run it in)."""
        shape = (batch, tokens)
        saved = self._saved.get(shape, 0.0)
        if saved >= self.PLAN_MS:
            return contextlib.nullcontext()  # planned (or about to be): PyTorch's own order, cuDNN first on Hopper
        self._saved[shape] = saved + self._scale * batch * tokens * tokens
        return _unplanned()


def _unplanned() -> contextlib.AbstractContextManager[None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def forward_batch(
    model: nn.Module,
    batch: Sequence[Sample],
    pad_id: int,
    pad_to_multiple: int,
    max_batch_tokens: int,
    kernels: AttentionKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Extraction's forward call over one batch, right-padded as :func:`~hscapture.data.padded_length` says.

    It runs what extraction needs and nothing else:

    * the decoder alone (:func:`decoder`): hidden states, no logits; the LM head is ~5 % of an 8B
      Llama's forward and far more of a small model's with a large vocabulary;
    * no attention mask: padding sits right of every real token, and in a causal decoder row ``i``
      reads rows ``<= i`` only, so padding never reaches a real row (the real rows are a masked
      forward's, up to the attention kernel's rounding). Unmasked, PyTorch's SDPA runs its flash
      kernel; a masked call takes cuDNN's, which plans each new shape once (~65 ms on an H200), or
      the memory-efficient one, 5-15 % slower per call (``benchmarks/README.md``, suite ``extract``);
    * on a GPU, cuDNN's kernel only for shapes that earned its plan (``kernels``, :class:`AttentionKernels`).

    Also the extract benchmark's forward without capture, so that their ratio is the capture's cost alone.
    The inputs are built on the host and copied with ``non_blocking=True``: a pageable source is
    staged by the driver, with no device synchronization.

    Returns:
        The host ``(input_ids, attention_mask)`` of the padded batch, both ``[B, T]`` (the mask says
        which rows are real).
    """
    device = next(model.parameters()).device
    input_ids, attention_mask = pad_batch(batch, pad_id, padded_length(batch, pad_to_multiple, max_batch_tokens))
    chosen = kernels(*input_ids.shape) if kernels is not None else contextlib.nullcontext()
    with torch.inference_mode(), chosen:
        decoder(model)(input_ids=input_ids.to(device, non_blocking=True), use_cache=False)
    return input_ids, attention_mask


class HFExtraction:
    """``hscapture extract --engine hf``: right-padded teacher-forced batches through a transformers model.

    Each batch is one forward call; its real rows go to a block-policy producer (padding rows are
    never announced) and each sample is finished with its loss mask. Batches are padded to a
    multiple of ``pad_to_multiple`` tokens, so a run meets few distinct shapes, and run through the decoder
    alone, unmasked (:func:`forward_batch`).
    The host never waits for the device inside a batch: inputs and the kept-row index go over with
    non-blocking copies built from host values, so the host queues batch N+1 while the device runs
    batch N. It does wait, before writing a batch's rows, until the device has finished the batch
    before the previous one (a CUDA event): the host stays at most one batch ahead, and a wait for
    ring credit then means the consumer (the disk) is behind, never that the device is.

    Args:
        model: HF model directory (None: the embedded tiny Llama).
        layers: layer ids (None: EAGLE-3's default for the model).
        capture_last: also capture the post-norm final state.
        dtype: activation dtype name (None: the model's own).
        device: where the model runs; ``cuda`` models get the CUDA ring.
        max_batch_tokens: padded tokens per forward call.
        max_batch_size: samples per forward call.
        pad_to_multiple: pad each batch's length up to a multiple of this (1: to its longest sample).
        positions: the positions of each sample to keep (``--positions``, :class:`~hscapture.selection.Positions`);
            the rows of the others never reach the ring.

    Raises:
        ValueError: a batch limit is not a positive integer, no model there, a bad dtype, a layer
            id out of range or a bad position selection.
    """

    def __init__(
        self,
        model: Path | None,
        layers: str | Sequence[int] | None,
        capture_last: bool,
        dtype: str | None,
        device: str,
        max_batch_tokens: int,
        max_batch_size: int,
        pad_to_multiple: int = 1,
        positions: str = "all",
    ) -> None:
        check_batching(max_batch_tokens, max_batch_size, pad_to_multiple, as_flags=True)  # before the model loads
        self.positions = Positions.parse(positions)
        if layers is not None:
            layer_spec(layers)
        self.tokenizer, self.model, path = load_model(model, dtype, device)
        num_layers = len(decoder_parts(self.model)[0])
        self.layers = resolve_layers(layers, num_layers) if layers is not None else eagle3_default_layers(num_layers)
        self.capture = HFCapture(self.model, self.layers, capture_last)
        self.dtype = dtype or dtype_name(next(self.model.parameters()).dtype)
        self.device = next(self.model.parameters()).device
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.pad_to_multiple = pad_to_multiple
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.meta: dict[str, Any] = {"engine": "hf", "model": str(path), "dtype": self.dtype}
        if not self.positions.everything:
            self.meta["positions"] = str(self.positions)
        self.producer: Producer | None = None
        # The device's progress: one event per batch, recorded after its rows were written (CUDA only).
        self._batch_done: deque[torch.cuda.Event] = deque()
        self.kernels = AttentionKernels(self.model) if self.device.type == "cuda" else None

    def start(self, endpoint: str, meta: dict[str, Any], watchdog: Callable[[], None]) -> None:
        """Start the producer, its ring sized for steps of ``max_batch_tokens`` rows (a batch of a longer sample,
        which runs alone, goes to the ring in several steps: :func:`steps`), and wait until the consumer on
        ``endpoint`` attached."""
        capture = self.capture
        config = self.capture_config(endpoint, self.max_batch_tokens)
        descriptions = describe(capture.layers, capture.capture_last, capture.num_layers)
        run_meta = {**self.meta, **meta}
        self.producer = Producer(config, tensor_descriptions=descriptions, meta=run_meta, watchdog=watchdog)
        deadline = time.monotonic() + config.block_timeout_s
        while not self.producer.attached:  # attach first, so that later credit waits are the disk's alone
            watchdog()
            if time.monotonic() > deadline:
                raise HSCaptureError(f"no consumer attached to {endpoint} within {config.block_timeout_s:.0f} s")
            self.producer.poll()
            time.sleep(0.005)

    def capture_config(self, endpoint: str, max_rows: int) -> CaptureConfig:
        """A block-policy capture of ``max_rows`` rows per step, the ring holding two such steps.

        Slots of :data:`EXTRACT_SLOT_ROWS` rows (a prefill batch is thousands of rows): every slot costs an
        announcement and a copy per tensor out of the ring, and 4 MiB slots held only 15 rows of every layer
        of an 8B model (270 KB a row).
        """
        hidden = self.model.config.hidden_size
        row_bytes = len(self.capture.names) * hidden * DTYPES[self.dtype]
        slot_bytes = default_slot_bytes(row_bytes, EXTRACT_SLOT_ROWS)
        return CaptureConfig(
            layers=self.layers,
            hidden_size=hidden,
            num_layers=self.capture.num_layers,
            capture_last=self.capture.capture_last,
            dtype=self.dtype,
            slot_bytes=slot_bytes,
            ring_bytes=default_ring_bytes(slot_bytes, row_bytes, max_rows),
            max_step_rows=max_rows,
            policy="block",
            endpoint=endpoint,
            device="cuda" if self.device.type == "cuda" else "cpu",  # GPU models get the CUDA ring
        )

    def run(self, batch: list[Sample]) -> int:
        """One forward call over a right-padded batch; announce the real rows; finish each request.

        Nothing here reads a device tensor: positions, token ids and the kept-row index are built
        on the host from the samples, and host-to-device copies are non-blocking (see
        :func:`forward_batch`).
        """
        assert self.producer is not None, "start first"
        lengths = [len(s.input_ids) for s in batch]
        input_ids, _ = forward_batch(
            self.model, batch, self.pad_id, self.pad_to_multiple, self.max_batch_tokens, self.kernels
        )
        masks = [loss_mask_ranges(s.loss_mask) for s in batch]
        # Per sample, the positions kept (all of them, or the selection's): on the host, no device read.
        kept = [self.positions.asked(n, mask) for n, mask in zip(lengths, masks)]
        positions = np.concatenate(kept)
        rows = np.concatenate([i * input_ids.shape[1] + p for i, p in enumerate(kept)])
        states = self.capture.collect()
        self._wait_for_device()
        keys, token_ids = [s.key for s in batch], input_ids.reshape(-1)[torch.from_numpy(rows)]
        for begin, end, owners, counts in steps([len(p) for p in kept], self.max_batch_tokens):
            self.producer.capture_step(
                states,
                request_ids=[keys[i] for i in owners],
                request_rows=counts,
                positions=positions[begin:end],
                token_ids=token_ids[begin:end],
                row_index=device_index(rows[begin:end], self.device),
            )
        if self.device.type == "cuda":
            self._batch_done.append(torch.cuda.Event())
            self._batch_done[-1].record()
        selection = "" if self.positions.everything else str(self.positions)
        for sample, mask in zip(batch, masks):
            self.producer.finish_request(
                sample.key, num_tokens=len(sample.input_ids), loss_mask=mask, positions=selection
            )
        return sum(lengths)

    def _wait_for_device(self) -> None:
        """Let the host run at most one batch ahead: wait until the device has finished the batch before last.

        The forward just queued keeps the device busy meanwhile, so this never idles it.
        """
        while len(self._batch_done) > 1:
            self._batch_done.popleft().synchronize()

    def waited_s(self) -> float | None:
        return None if self.producer is None else self.producer.counters.credit_wait_us / 1e6

    def end(self) -> None:
        """Close the producer (end of stream); block policy drops nothing, so any drop is a bug."""
        if self.producer is not None:
            counters = self.producer.close()
            if counters.rows_dropped:
                raise HSCaptureError(f"{counters.rows_dropped} rows dropped under block policy: this is a bug")

    def shutdown(self) -> None:
        if self.producer is not None:
            self.producer.close()
        self.capture.remove()

    def check(self, store: Any) -> None:
        return None
