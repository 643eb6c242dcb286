"""The GPU ring: one raw cudaMalloc exported over CUDA IPC, one interprocess event per slot.

Rules this module follows (DESIGN.md, each learned the hard way):

* The ring is one ``cudaMalloc`` (through cupy), rounded up to 2 MiB, outside torch's caching
  allocator, viewed as torch tensors without a copy. Its IPC handle and the slots' event
  handles are exported once, in the handshake; chunks carry offsets only.
* The producer records slot ``i``'s event after writing it (after graph replay, never inside
  stream capture) and never synchronizes. It re-records a slot only after its release.
* The consumer opens the handle and events once per run, waits on a slot's event on its own
  non-blocking stream, copies by DMA into pinned host memory, and closes the handle before the
  producer frees the ring (the producer waits for every release at close).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from hscapture.errors import HSCaptureError, ProtocolError
from hscapture.ring.base import Ring, RingReader

log = logging.getLogger(__name__)

ALIGN = 2 << 20  # cudaMalloc granularity for IPC-friendly allocations
#: Free device memory left untouched when sizing checks run.
HEADROOM = 256 << 20


def _current_stream(device: torch.device) -> int:
    """The raw handle of ``device``'s current stream, read every step: skip building a Stream object."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


#: torch's own fast path to the current stream's handle (what its compiled kernels use).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise HSCaptureError(
            f"the CUDA ring needs cupy ({exc}); install it with `pip install 'hscapture[cuda]'`"
        ) from None
    return cupy


def device_uuid(index: int) -> str:
    """The device's UUID: the same GPU under any CUDA_VISIBLE_DEVICES numbering."""
    return str(torch.cuda.get_device_properties(index).uuid)


def check_device(device: torch.device, nbytes: int) -> None:
    """Start-up checks with clear errors: a GPU exists and has room for the ring."""
    if not torch.cuda.is_available():
        raise HSCaptureError(
            "device: no CUDA GPU is visible to this process; capture on a CPU engine uses the host ring "
            "(CaptureConfig(device='cpu'))"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise HSCaptureError(f"device: {device} does not exist; {torch.cuda.device_count()} GPUs are visible")
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes + HEADROOM > free:
        raise HSCaptureError(
            f"ring_bytes: the ring needs {nbytes / 2**20:.0f} MiB but {device} has {free / 2**20:.0f} MiB free "
            f"(keeping {HEADROOM >> 20} MiB headroom); lower ring_bytes or max_step_rows"
        )


class CudaRing(Ring):
    """Producer side of the GPU ring.

    Args:
        num_slots: slots in the ring.
        slot_bytes: bytes per slot.
        device: the engine's CUDA device.

    Raises:
        HSCaptureError: no GPU, not enough free memory, or cupy missing.
    """

    def __init__(self, num_slots: int, slot_bytes: int, device: torch.device) -> None:
        self.nbytes = -(-num_slots * slot_bytes // ALIGN) * ALIGN
        check_device(device, self.nbytes)
        cupy = _cupy()
        runtime = cupy.cuda.runtime
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self._runtime = runtime
        with cupy.cuda.Device(self.device.index):
            self._ptr = runtime.malloc(self.nbytes)
            flags = runtime.eventDisableTiming | runtime.eventInterprocess
            self._events = [runtime.eventCreateWithFlags(flags) for _ in range(num_slots)]
            self._handle = bytes(runtime.ipcGetMemHandle(self._ptr))
            self._event_handles = [bytes(runtime.ipcGetEventHandle(e)) for e in self._events]
        memory = cupy.cuda.UnownedMemory(self._ptr, self.nbytes, self, self.device.index)
        array = cupy.ndarray((self.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        self._bytes: torch.Tensor | None = torch.as_tensor(array, device=self.device)
        self._closed = False

    def slot(self, index: int) -> torch.Tensor:
        if self._bytes is None:
            raise ValueError("ring is closed")
        start = index * self.slot_bytes
        return self._bytes[start : start + self.slot_bytes]

    def mark_written(self, index: int, stream: int | None = None) -> None:
        """Record slot ``index``'s IPC event on ``stream`` (default: the current one), after the writes queued there."""
        if torch.cuda.is_current_stream_capturing():
            raise HSCaptureError(
                "mark_written: called inside CUDA graph capture; record the slot's event after the replay "
                "(the producer's capture_step and announce_step do)"
            )
        self._runtime.eventRecord(self._events[index], _current_stream(self.device) if stream is None else stream)

    def current_stream(self) -> int:
        return _current_stream(self.device)

    def stream_reader(self) -> Callable[[], int]:
        if _RAW_STREAM is not None:  # torch's own C call, no Python frame in between
            return partial(_RAW_STREAM, self.device.index)
        return self.current_stream

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "cuda",
            "device_uuid": device_uuid(self.device.index),
            "handle": self._handle,
            "events": self._event_handles,
            "nbytes": self.nbytes,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._bytes = None
        torch.cuda.synchronize(self.device)  # no queued write may touch memory about to be freed
        for event in self._events:
            self._runtime.eventDestroy(event)
        self._runtime.free(self._ptr)


class CudaRingReader(RingReader):
    """Consumer side: opens the IPC handle and events once; copies on its own stream."""

    def __init__(self, description: dict[str, Any]) -> None:
        cupy = _cupy()
        runtime = cupy.cuda.runtime
        self._runtime = runtime
        handle, events, nbytes = description.get("handle"), description.get("events"), description.get("nbytes")
        if not isinstance(handle, bytes) or not isinstance(events, list) or not isinstance(nbytes, int):
            raise ProtocolError(f"Layout.ring: not a CUDA ring description: {sorted(description)}")
        self.nbytes = nbytes
        self.device = self._find_device(str(description.get("device_uuid")))
        self._device = cupy.cuda.Device(self.device)
        with self._device:
            try:
                self._ptr = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
                self._events = [runtime.ipcOpenEventHandle(h) for h in events]
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise HSCaptureError(
                    f"CUDA IPC: cannot open the producer's ring ({exc}); CUDA IPC may not be permitted in this "
                    "container (it needs the same IPC namespace and no --ipc=private), or the producer exited"
                ) from None
            self._stream = cupy.cuda.Stream(non_blocking=True)
            memory = cupy.cuda.UnownedMemory(self._ptr, nbytes, None, self.device)  # closed by close()
            array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
            self._bytes = torch.as_tensor(array, device=torch.device("cuda", self.device))
            self._warm_up()
        self._wait_on_host = os.environ.get("HSCAPTURE_IPC_WAIT", "host") != "stream"
        self._closed = False

    def _warm_up(self) -> None:
        """One small copy before the consumer confirms: first-touch costs of the mapping land here."""
        probe = self.allocate(min(self.nbytes, 4096))
        self._runtime.memcpyAsync(
            probe.ctypes.data, self._ptr, probe.nbytes, self._runtime.memcpyDeviceToHost, self._stream.ptr
        )
        self._stream.synchronize()

    @staticmethod
    def _find_device(uuid: str) -> int:
        if not torch.cuda.is_available():
            raise HSCaptureError("the producer uses a CUDA ring but this consumer sees no GPU; run it on the same host")
        visible = [device_uuid(i) for i in range(torch.cuda.device_count())]
        if uuid not in visible:
            raise HSCaptureError(
                f"the producer's GPU {uuid} is not visible to this consumer (it sees {visible}); "
                "give the consumer the same GPU (CUDA_VISIBLE_DEVICES)"
            )
        return visible.index(uuid)

    def begin(self, slot: int) -> None:
        """Order the following copies after the producer's writes to ``slot``.

        ``host`` (default) waits for the slot's IPC event on this thread, so our copies carry no
        GPU-side dependency on the engine's context; ``stream`` makes our stream wait on it.
        """
        if self._wait_on_host:
            self._runtime.eventSynchronize(self._events[slot])
        else:
            self._runtime.streamWaitEvent(self._stream.ptr, self._events[slot], 0)

    def copy_into(self, offset: int, dst: np.ndarray) -> None:
        self._check_range(offset, dst.nbytes)
        self._to_host(self._ptr + offset, dst)

    # The ring's memory on the GPU, for work on rows before they are copied out (fp8 quantization):
    # torch kernels queued on :meth:`torch_stream` run after :meth:`begin` and before :meth:`mark`.

    def device_bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the ring at ``offset`` as a uint8 tensor on its GPU (a view, no copy)."""
        self._check_range(offset, nbytes)
        return self._bytes[offset : offset + nbytes]

    def torch_stream(self) -> torch.cuda.ExternalStream:
        """This reader's copy stream, as torch sees it."""
        return torch.cuda.ExternalStream(self._stream.ptr, device=torch.device("cuda", self.device))

    def launch(self, kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...]) -> None:
        """Queue a cupy kernel on this reader's stream (ordered like :meth:`torch_stream`'s work)."""
        with self._device, self._stream:
            kernel(grid, block, args)

    def copy_from_device(self, src: torch.Tensor, dst: np.ndarray) -> None:
        """Copy the contiguous device tensor ``src`` (e.g. rows worked on) into ``dst`` on this reader's stream."""
        if not src.is_contiguous() or src.nbytes != dst.nbytes or src.device != self._bytes.device:
            raise ValueError(
                f"copy_from_device: {src.nbytes} bytes of {src.device} into {dst.nbytes}; want contiguous "
                f"bytes on {self._bytes.device}, as many as dst holds"
            )
        self._to_host(src.data_ptr(), dst)

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ProtocolError(f"Chunk: bytes {offset}..{offset + nbytes} fall outside the ring of {self.nbytes}")

    def _to_host(self, src: int, dst: np.ndarray) -> None:
        self._runtime.memcpyAsync(dst.ctypes.data, src, dst.nbytes, self._runtime.memcpyDeviceToHost, self._stream.ptr)

    def mark(self) -> Any:
        """An event after the copies issued so far; the slot may be released once it completes."""
        # Blocking sync: a consumer waiting for its oldest copy sleeps instead of spinning a core.
        event = self._runtime.eventCreateWithFlags(self._runtime.eventDisableTiming | self._runtime.eventBlockingSync)
        self._runtime.eventRecord(event, self._stream.ptr)
        return event

    def done(self, token: Any) -> bool:
        if self._runtime.eventQuery(token) != 0:  # cudaErrorNotReady
            return False
        self._runtime.eventDestroy(token)
        return True

    def wait(self, token: Any) -> None:
        self._runtime.eventSynchronize(token)

    def complete(self) -> None:
        self._stream.synchronize()

    def allocate(self, nbytes: int) -> np.ndarray:
        """Pinned host memory, so the DMA engine copies straight into it."""
        memory = _cupy().cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, dtype=np.uint8, count=nbytes)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with self._device:
                self._stream.synchronize()
                del self._bytes
                for event in self._events:
                    self._runtime.eventDestroy(event)
                self._runtime.ipcCloseMemHandle(self._ptr)
        except Exception as exc:  # teardown: log, never raise
            log.warning("closing the CUDA ring: %s", exc)
