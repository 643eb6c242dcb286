"""Graph-safe capture: a ring write that lives inside a CUDA graph (flashinfer's plan/run habit).

Serving engines replay decode steps from CUDA graphs, where Python does not run. The write
into the ring therefore takes its slot from a device tensor:

* :meth:`GraphRingWriter.plan` (before replay, outside the graph): take a free slot (under
  ``drop`` with no credit, a reserved scratch slot that is never announced) and store its
  number in :attr:`GraphRingWriter.slot_index` on the device.
* :meth:`GraphRingWriter.write` (inside the captured forward): one fixed-shape copy of every
  captured tensor's ``[batch_rows, hidden]`` into that slot.
* :meth:`GraphRingWriter.commit` (after replay): record the slot's event and announce the
  first ``rows`` rows; padding rows of the graph batch are never announced.

The copy is the fused NVRTC kernel of ``csrc/ring_write.cu`` or, with ``use_kernel=False``
(or where it cannot compile), one ``index_copy_`` per tensor. ``benchmarks/gpu_ring.py``
measures both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hscapture.cuda_kernels import kernel
from hscapture.producer import Producer

MAX_KERNEL_TENSORS = 8


class GraphRingWriter:
    """Writes a fixed batch of captured rows into the ring from inside a CUDA graph.

    Args:
        producer: a producer whose ring is on the GPU.
        batch_rows: the graph's (padded) batch size; every replay writes this many rows.
        use_kernel: use the fused NVRTC kernel (default: when it compiles).

    Raises:
        ValueError: the batch does not fit a slot, or the producer's ring is not on a GPU.
    """

    def __init__(self, producer: Producer, batch_rows: int, use_kernel: bool | None = None) -> None:
        config = producer.config
        if torch.device(config.device).type != "cuda":
            raise ValueError(f"GraphRingWriter: the producer's ring is on {config.device!r}; graphs need 'cuda'")
        if batch_rows > config.rows_per_slot:
            raise ValueError(
                f"batch_rows: planned at most {config.rows_per_slot} rows per slot (slot_bytes={config.slot_bytes}), "
                f"got {batch_rows}; raise slot_bytes"
            )
        self.producer = producer
        self.batch_rows = batch_rows
        self.device = producer.ring.slot(0).device
        self.slot_index = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._scratch = producer.reserve_slot()
        self._planned: int | None = None
        elements = config.slot_bytes // config.itemsize
        ring = producer.ring.slot(0).view(config.torch_dtype)
        full = torch.as_strided(ring, (config.num_slots * elements,), (1,))
        shape = (config.num_slots, config.num_tensors, batch_rows, config.hidden_size)
        strides = (elements, batch_rows * config.hidden_size, config.hidden_size, 1)
        self._slots = torch.as_strided(full, shape, strides)
        self._streams: dict[int, Any] = {}
        self._kernel = self._compile() if use_kernel is not False else None
        if use_kernel and self._kernel is None:
            raise ValueError("use_kernel=True but the ring-write kernel did not compile; see the log")

    @property
    def uses_kernel(self) -> bool:
        return self._kernel is not None

    def _compile(self) -> Any:
        config = self.producer.config
        plane = self.batch_rows * config.hidden_size * config.itemsize
        if config.num_tensors > MAX_KERNEL_TENSORS or plane % 16 or config.slot_bytes % 16:
            return None
        return kernel("ring_write.cu", "ring_write", "using index_copy_")

    def plan(self) -> int:
        """Before replay: choose the slot the next replay writes (outside the graph)."""
        slot = self.producer.acquire_slot()
        self._planned = slot
        self.slot_index.fill_(self._scratch if slot is None else slot)
        return self._scratch if slot is None else slot

    def write(self, states: Sequence[torch.Tensor]) -> None:
        """Inside the captured forward: copy every ``[batch_rows, hidden]`` state into the planned slot."""
        config = self.producer.config
        for state in states:
            if state.shape != (self.batch_rows, config.hidden_size) or state.dtype != config.torch_dtype:
                raise ValueError(
                    f"GraphRingWriter.write: planned [{self.batch_rows}, {config.hidden_size}] {config.dtype}, "
                    f"got {list(state.shape)} {state.dtype}"
                )
        if self._kernel is None:
            for t, state in enumerate(states):
                self._slots[:, t].index_copy_(0, self.slot_index, state.unsqueeze(0))
            return
        self._launch(states)

    def _launch(self, states: Sequence[torch.Tensor]) -> None:
        config = self.producer.config
        plane_vec = self.batch_rows * config.hidden_size * config.itemsize // 16
        sources = [np.uint64(s.contiguous().data_ptr()) for s in states]
        sources += [sources[0]] * (MAX_KERNEL_TENSORS - len(sources))
        total = config.num_tensors * plane_vec
        block = 256
        grid = min(-(-total // block), 1024)
        stream = self._cupy_stream(torch.cuda.current_stream(self.device).cuda_stream)
        args = (
            *sources,
            np.int32(config.num_tensors),
            np.int64(plane_vec),
            np.uint64(self._slots.data_ptr()),
            np.int64(config.slot_bytes // 16),
            np.uint64(self.slot_index.data_ptr()),
        )
        with stream:
            self._kernel((grid,), (block,), args)

    def _cupy_stream(self, handle: int) -> Any:
        """cupy's view of a torch stream, made once per stream (launches go where torch queues work)."""
        stream = self._streams.get(handle)
        if stream is None:
            import cupy

            from_external = getattr(cupy.cuda.Stream, "from_external", None)
            stream = from_external(_StreamHandle(handle)) if from_external else cupy.cuda.ExternalStream(handle)
            self._streams[handle] = stream
        return stream

    def commit(
        self,
        rows: int,
        request_ids: Sequence[str],
        request_rows: Sequence[int],
        positions: np.ndarray | Sequence[int],
        token_ids: np.ndarray | Sequence[int],
    ) -> bool:
        """After replay: announce the first ``rows`` rows of the planned slot (host metadata only).

        Returns False when the step was dropped (no credit under ``drop``). The announcement may be
        sent with later ones; a send that ``drop`` cannot make then counts its rows dropped.
        """
        if self._planned is None:
            self.producer.count_dropped(request_ids, request_rows)
            return False
        slot, self._planned = self._planned, None
        if rows > self.batch_rows or sum(request_rows) != rows:
            raise ValueError(f"commit: {rows} rows ({sum(request_rows)} by request) for a batch of {self.batch_rows}")
        self.producer.counters.steps += 1
        self.producer.announce_written(
            slot,
            rows,
            self.batch_rows,
            request_ids,
            request_rows,
            np.asarray(positions, dtype=np.int64),
            np.asarray(token_ids, dtype=np.int64),
        )
        return True


class _StreamHandle:
    """The CUDA stream protocol (``__cuda_stream__``) around a raw stream handle."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)
