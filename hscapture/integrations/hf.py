"""HF transformers integration: hooks that capture what SGLang captures for EAGLE-3.

Layer ``k`` is the residual stream entering decoder layer ``k`` (the decoder layer's input,
which in HF already is hidden + residual, before the layer's input norm): HF's
``output_hidden_states[k]``, and SGLang's ``layers_to_capture`` entry ``k``. ``last`` is the
output of the model's final norm: HF's ``output_hidden_states[-1]``, what the LM head reads.

The hooks only keep references during the forward; :meth:`HFCapture.collect` hands them
to the producer right after it, which copies the kept rows into the ring. HF's eager
forward never writes those tensors in place, so the references stay valid until then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

LAST = "last"


def decoder_parts(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layer list and the final norm of a transformers causal LM.

    Raises:
        TypeError: the model does not expose ``get_decoder().layers`` and ``.norm``.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    if not isinstance(layers, nn.ModuleList) or norm is None:
        raise TypeError(
            f"{type(model).__name__}: expected a decoder with `.layers` (ModuleList) and a final `.norm`, "
            "as Llama, Qwen, Mistral and DeepSeek models in transformers have"
        )
    return layers, norm


def eagle3_default_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default aux layers in hscapture's convention: ``[2, L // 2, L - 3]``.

    These are the tensors SGLang captures by default and SpecForge's ``[1, L//2-1, L-4]``
    names with ids one lower.
    """
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


def describe(layers: Sequence[int], capture_last: bool) -> list[str]:
    """One sentence per captured tensor saying exactly what it is (stored with the data)."""
    out = [
        f"residual stream entering decoder layer {k} (hidden + residual before its input norm); "
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
        layers: decoder layer ids, ``0 <= k < num_layers``.
        capture_last: also keep the final norm's output.

    Raises:
        ValueError: a layer id is out of range (the message gives the valid range).
    """

    def __init__(self, model: nn.Module, layers: Sequence[int], capture_last: bool = True) -> None:
        decoder_layers, norm = decoder_parts(model)
        self.num_layers = len(decoder_layers)
        bad = [k for k in layers if not 0 <= k < self.num_layers]
        if bad:
            raise ValueError(
                f"layers: {bad} out of range; the model has {self.num_layers} decoder layers, so ids must be in "
                f"0..{self.num_layers - 1} (id k = residual stream entering layer k); the final post-norm state "
                "is captured with capture_last"
            )
        self.layers = tuple(layers)
        self.capture_last = capture_last
        self.names = [f"layer_{k}" for k in self.layers] + ([LAST] if capture_last else [])
        self._kept: dict[str, torch.Tensor] = {}
        self._handles = [
            decoder_layers[k].register_forward_pre_hook(self._keep_input(f"layer_{k}"), with_kwargs=True)
            for k in self.layers
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
