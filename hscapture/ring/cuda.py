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

torch is imported where a tensor is made: by the producer (the engine has it) and by the reader's
views for the GPU fp8 path (:meth:`CudaRingReader.device_bytes`). A consumer keeping rows as captured
reads the ring with cupy's CUDA runtime bindings alone (``cupy_backends.cuda.api.runtime``, ~15 ms to
import, where ``import cupy`` took ~0.7 s and ``import torch`` ~3 s of a cold consumer's start on the H200).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import cache, partial
from typing import TYPE_CHECKING, Any

import numpy as np

from hscapture.cuda_runtime import runtime as _runtime
from hscapture.errors import HSCaptureError, ProtocolError
from hscapture.ring.base import Ring, RingReader

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ALIGN = 2 << 20  # cudaMalloc granularity for IPC-friendly allocations
#: Free device memory left untouched when sizing checks run.
HEADROOM = 256 << 20


@contextlib.contextmanager
def _on_device(runtime: Any, index: int) -> Iterator[None]:
    """CUDA device ``index`` current on this thread for the block, the one before restored after (a context of its
    own per use: threads may share a reader)."""
    before = runtime.getDevice()
    if before != index:
        runtime.setDevice(index)
    try:
        yield
    finally:
        if before != index:
            runtime.setDevice(before)


def _spacing(planes: Sequence[np.ndarray]) -> tuple[int, int] | None:
    """``(nbytes, stride)`` of contiguous host arrays of one size whose starts are ``stride >= nbytes`` bytes apart
    (a shard buffer's planes, or one array); None otherwise."""
    if not planes:
        return None
    first, nbytes = planes[0], planes[0].nbytes
    if not first.flags.c_contiguous:
        return None
    start = first.ctypes.data
    stride = planes[1].ctypes.data - start if len(planes) > 1 else nbytes
    if stride < nbytes:
        return None
    for t, plane in enumerate(planes):
        if plane.nbytes != nbytes or not plane.flags.c_contiguous or plane.ctypes.data != start + t * stride:
            return None
    return nbytes, stride


class _Pinned:
    """Page-locked host memory (``cudaHostAlloc``), freed when the last array viewing it goes."""

    def __init__(self, runtime: Any, nbytes: int) -> None:
        self._runtime = runtime
        self.ptr = runtime.hostAlloc(nbytes, runtime.hostAllocPortable)
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the runtime may be gone with the process
            self._runtime.freeHost(self.ptr)


class _DeviceBytes:
    """``nbytes`` of device memory at ``ptr`` as ``__cuda_array_interface__``, for ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "stream": None,
        }  # fmt: skip


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise HSCaptureError(
            f"the CUDA ring needs cupy ({exc}); install it with `pip install 'hscapture[cuda]'`"
        ) from None
    return cupy


@cache
def _driver() -> ctypes.CDLL:
    """The CUDA driver's library (the runtime has loaded it already in a process that uses CUDA)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise HSCaptureError(f"the CUDA ring needs the NVIDIA driver's libcuda.so.1: {exc}") from None


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` (this process's numbering) as torch spells it,
    ``e13e4eb8-d46f-2c0a-6cc8-0a0bfad03dec``: the same GPU under any CUDA_VISIBLE_DEVICES numbering.

    The producer describes its ring's device with it and the consumer finds that device with it, so both
    spell it alike. Read from the driver: cupy's ``getDeviceProperties(i)["uuid"]`` is the ``char[16]``
    converted as a C string, cut at the UUID's first zero byte.

    Raises:
        HSCaptureError: no driver, or it cannot name device ``index``.
    """
    driver = _driver()
    get_uuid = getattr(driver, "cuDeviceGetUuid_v2", None) or driver.cuDeviceGetUuid  # v2: CUDA >= 11.4
    device, raw = ctypes.c_int(), (ctypes.c_ubyte * 16)()
    _check_driver(driver.cuInit(0), "cuInit", index)  # idempotent: done already where the runtime ran
    _check_driver(driver.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet", index)
    _check_driver(get_uuid(raw, device), "cuDeviceGetUuid", index)
    return str(uuid.UUID(bytes=bytes(raw)))


def _check_driver(status: int, call: str, index: int) -> None:
    if status != 0:
        raise HSCaptureError(f"device {index}: the CUDA driver's {call} failed with error {status}")


def check_device(device: torch.device, nbytes: int) -> None:
    """Start-up checks with clear errors: a GPU exists and has room for the ring."""
    import torch

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
        import torch

        self.nbytes = -(-num_slots * slot_bytes // ALIGN) * ALIGN
        check_device(device, self.nbytes)
        cupy = _cupy()
        runtime = cupy.cuda.runtime
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self._runtime = runtime
        self._capturing = torch.cuda.is_current_stream_capturing
        #: torch's own fast path to the current stream's handle (what its compiled kernels use).
        self._raw_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._uuid = device_uuid(self.device.index)  # before the allocations: a failure here leaves none behind
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
        if self._capturing():
            raise HSCaptureError(
                "mark_written: called inside CUDA graph capture; record the slot's event after the replay "
                "(the producer's capture_step and announce_step do)"
            )
        self._runtime.eventRecord(self._events[index], self.current_stream() if stream is None else stream)

    def current_stream(self) -> int:
        """The raw handle of the device's current stream, read every step: no Stream object is built."""
        if self._raw_stream is not None:
            return self._raw_stream(self.device.index)
        import torch

        return torch.cuda.current_stream(self.device).cuda_stream

    def stream_reader(self) -> Callable[[], int]:
        if self._raw_stream is not None:  # torch's own C call, no Python frame in between
            return partial(self._raw_stream, self.device.index)
        return self.current_stream

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "cuda",
            "device_uuid": self._uuid,
            "handle": self._handle,
            "events": self._event_handles,
            "nbytes": self.nbytes,
        }

    def close(self) -> None:
        if self._closed:
            return
        import torch

        self._closed = True
        self._bytes = None
        torch.cuda.synchronize(self.device)  # no queued write may touch memory about to be freed
        for event in self._events:
            self._runtime.eventDestroy(event)
        self._runtime.free(self._ptr)


class CudaRingReader(RingReader):
    """Consumer side: opens the IPC handle and events once; copies on its own stream.

    Copies, events, its stream and pinned memory go through cupy's runtime bindings alone; torch and cupy are
    imported only for the GPU fp8 path (:meth:`device_bytes`, :meth:`torch_stream`, :meth:`copy_from_device`,
    :meth:`launch`).
    """

    def __init__(self, description: dict[str, Any]) -> None:
        runtime = _runtime()
        self._runtime = runtime
        handle, events, nbytes = description.get("handle"), description.get("events"), description.get("nbytes")
        if not isinstance(handle, bytes) or not isinstance(events, list) or not isinstance(nbytes, int):
            raise ProtocolError(f"Layout.ring: not a CUDA ring description: {sorted(description)}")
        self.nbytes = nbytes
        self.device = self._find_device(str(description.get("device_uuid")))
        self._device = partial(_on_device, runtime, self.device)
        with self._device():
            try:
                self._ptr = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
                self._events = [runtime.ipcOpenEventHandle(h) for h in events]
            except runtime.CUDARuntimeError as exc:
                raise HSCaptureError(
                    f"CUDA IPC: cannot open the producer's ring ({exc}); CUDA IPC may not be permitted in this "
                    "container (it needs the same IPC namespace and no --ipc=private), or the producer exited"
                ) from None
            self._stream: int = runtime.streamCreateWithFlags(runtime.streamNonBlocking)
            self._warm_up()
        self._kernel_stream: Any = None  # cupy's view of the stream, made by the first launch
        #: The ring as a uint8 torch tensor, made by the first :meth:`device_bytes` (the GPU fp8 path).
        self._tensor: torch.Tensor | None = None
        self._wait_on_host = os.environ.get("HSCAPTURE_IPC_WAIT", "host") != "stream"
        self._closed = False

    def _warm_up(self) -> None:
        """One small copy before the consumer confirms: first-touch costs of the mapping land here."""
        probe = self.allocate(min(self.nbytes, 4096))
        self._runtime.memcpyAsync(
            probe.ctypes.data, self._ptr, probe.nbytes, self._runtime.memcpyDeviceToHost, self._stream
        )
        self._runtime.streamSynchronize(self._stream)

    def _find_device(self, wanted: str) -> int:
        """This process's number of the GPU whose :func:`device_uuid` is ``wanted``."""
        runtime = self._runtime
        try:
            count = runtime.getDeviceCount()
        except runtime.CUDARuntimeError:  # cudaErrorNoDevice, cudaErrorInsufficientDriver, ...
            count = 0
        if count == 0:
            raise HSCaptureError("the producer uses a CUDA ring but this consumer sees no GPU; run it on the same host")
        visible = [device_uuid(i) for i in range(count)]
        if wanted not in visible:
            raise HSCaptureError(
                f"the producer's GPU {wanted} is not visible to this consumer (it sees {visible}); "
                "give the consumer the same GPU (CUDA_VISIBLE_DEVICES)"
            )
        return visible.index(wanted)

    def begin(self, slot: int) -> None:
        """Order the following copies after the producer's writes to ``slot``.

        ``host`` (default) waits for the slot's IPC event on this thread, so our copies carry no
        GPU-side dependency on the engine's context; ``stream`` makes our stream wait on it.
        """
        if self._wait_on_host:
            self._runtime.eventSynchronize(self._events[slot])
        else:
            self._runtime.streamWaitEvent(self._stream, self._events[slot], 0)

    def copy_into(self, offset: int, dst: np.ndarray) -> None:
        self._check_range(offset, dst.nbytes)
        self._to_host(self._ptr + offset, dst)

    def copy_planes_into(self, offset: int, pitch: int, planes: Sequence[np.ndarray]) -> None:
        """One 2D copy where the planes lie evenly spaced in host memory (a shard buffer's do), else one a plane."""
        spaced = _spacing(planes)
        if spaced is None or (len(planes) > 1 and pitch < spaced[0]):
            super().copy_planes_into(offset, pitch, planes)
            return
        width, dpitch = spaced
        self._check_range(offset, pitch * (len(planes) - 1) + width)
        self._to_host_2d(planes[0].ctypes.data, dpitch, self._ptr + offset, pitch, width, len(planes))

    # The ring's memory on the GPU, for work on rows before they are copied out (fp8 quantization):
    # torch kernels queued on :meth:`torch_stream` run after :meth:`begin` and before :meth:`mark`.

    def device_bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the ring at ``offset`` as a uint8 tensor on its GPU (a view, no copy)."""
        self._check_range(offset, nbytes)
        return self._ring_tensor()[offset : offset + nbytes]

    def torch_stream(self) -> torch.cuda.ExternalStream:
        """This reader's copy stream, as torch sees it."""
        import torch

        return torch.cuda.ExternalStream(self._stream, device=torch.device("cuda", self.device))

    def launch(self, kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...]) -> None:
        """Queue a cupy kernel on this reader's stream (ordered like :meth:`torch_stream`'s work)."""
        cupy = _cupy()
        if self._kernel_stream is None:
            self._kernel_stream = cupy.cuda.ExternalStream(self._stream, self.device)
        with cupy.cuda.Device(self.device), self._kernel_stream:
            kernel(grid, block, args)

    def copy_from_device(self, src: torch.Tensor, dst: np.ndarray) -> None:
        """Copy the contiguous device tensor ``src`` (e.g. rows worked on) into ``dst`` on this reader's stream."""
        ring = self._ring_tensor()
        if not src.is_contiguous() or src.nbytes != dst.nbytes or src.device != ring.device:
            raise ValueError(
                f"copy_from_device: {src.nbytes} bytes of {src.device} into {dst.nbytes}; want contiguous "
                f"bytes on {ring.device}, as many as dst holds"
            )
        self._to_host(src.data_ptr(), dst)

    def copy_planes_from_device(self, src: torch.Tensor, planes: Sequence[np.ndarray]) -> None:
        """Copy each ``src[t]`` (contiguous, e.g. one tensor's rows worked on) into ``planes[t]``: one 2D copy where
        the planes lie evenly spaced in host memory, else one a plane."""
        spaced = _spacing(planes)
        first = src[0] if len(src) else src
        if spaced is None or len(src) != len(planes) or not first.is_contiguous() or first.nbytes != spaced[0]:
            for part, plane in zip(src, planes, strict=True):
                self.copy_from_device(part, plane)
            return
        if src.device != self._ring_tensor().device:
            raise ValueError(f"copy_planes_from_device: rows on {src.device}, the ring on GPU {self.device}")
        pitch = src.stride(0) * src.element_size() if len(src) > 1 else first.nbytes
        self._to_host_2d(planes[0].ctypes.data, spaced[1], src.data_ptr(), pitch, first.nbytes, len(src))

    def _ring_tensor(self) -> torch.Tensor:
        """The whole ring as a uint8 torch tensor (made once, on first use: it imports torch)."""
        if self._tensor is None:
            import torch

            ring = _DeviceBytes(self._ptr, self.nbytes)  # the mapping is closed by close()
            self._tensor = torch.as_tensor(ring, device=torch.device("cuda", self.device))
        return self._tensor

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ProtocolError(f"Chunk: bytes {offset}..{offset + nbytes} fall outside the ring of {self.nbytes}")

    def _to_host(self, src: int, dst: np.ndarray) -> None:
        self._runtime.memcpyAsync(dst.ctypes.data, src, dst.nbytes, self._runtime.memcpyDeviceToHost, self._stream)

    def _to_host_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        """``height`` rows of ``width`` bytes, ``spitch`` apart on the GPU, to ``dpitch`` apart on the host: one call,
        so one release and retake of the GIL, where a call a plane (33 of them a slot with every layer captured)
        waited for writer threads holding it (on the H200 host, ~100 µs a call)."""
        if width and height:
            kind = self._runtime.memcpyDeviceToHost
            self._runtime.memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, self._stream)

    def mark(self) -> Any:
        """An event after the copies issued so far; the slot may be released once it completes."""
        # Blocking sync: a consumer waiting for its oldest copy sleeps instead of spinning a core.
        flags = self._runtime.eventDisableTiming | self._runtime.eventBlockingSync
        with self._device():  # an event records only on a stream of its own device, and may not be current here
            event = self._runtime.eventCreateWithFlags(flags)
            self._runtime.eventRecord(event, self._stream)
        return event

    def done(self, token: Any) -> bool:
        if self._runtime.eventQuery(token) != 0:  # cudaErrorNotReady
            return False
        self._runtime.eventDestroy(token)
        return True

    def wait(self, token: Any) -> None:
        self._runtime.eventSynchronize(token)

    def complete(self) -> None:
        self._runtime.streamSynchronize(self._stream)

    def allocate(self, nbytes: int) -> np.ndarray:
        """Pinned host memory, so the DMA engine copies straight into it; from any thread (the ring's device is
        made current for the call: a thread with none would start a context on device 0)."""
        with self._device():
            return np.asarray(_Pinned(self._runtime, nbytes))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with self._device():
                self._runtime.streamSynchronize(self._stream)
                self._tensor = self._kernel_stream = None
                for event in self._events:
                    self._runtime.eventDestroy(event)
                self._runtime.ipcCloseMemHandle(self._ptr)
                self._runtime.streamDestroy(self._stream)
        except Exception as exc:  # teardown: log, never raise
            log.warning("closing the CUDA ring: %s", exc)
