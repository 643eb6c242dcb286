"""The ring of preallocated slots the producer writes into and the consumer copies out of.

Two backends behind one interface per side (:mod:`hscapture.ring.base`), so the producer and
the consumer never ask which one they hold to move rows: host shared memory
(:mod:`hscapture.ring.host`) for CPU engines, and one ``cudaMalloc`` exported over CUDA IPC
(:mod:`hscapture.ring.cuda`) for GPU engines. Only the consumer of an fp8 store asks, to quantize
rows on the GPU before they leave it (the CUDA reader lends its memory and stream for that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hscapture.errors import ProtocolError
from hscapture.ring.base import Ring, RingReader
from hscapture.ring.host import SHM_DIR, HostRing, HostRingReader, reclaim_host_rings

if TYPE_CHECKING:
    import torch

    from hscapture.ring.cuda import CudaRing, CudaRingReader

__all__ = [
    "SHM_DIR",
    "CudaRing",
    "CudaRingReader",
    "HostRing",
    "HostRingReader",
    "Ring",
    "RingReader",
    "create_ring",
    "open_ring",
    "reclaim_host_rings",
]


def __getattr__(name: str) -> Any:
    """The CUDA ring's classes, imported on first use (they need cupy, the producer's torch too): a host ring's
    reader needs neither."""
    if name in ("CudaRing", "CudaRingReader"):
        from hscapture.ring import cuda

        return getattr(cuda, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def create_ring(device: torch.device, num_slots: int, slot_bytes: int, name: str) -> Ring:
    """The ring for an engine on ``device``: host shared memory for CPU, CUDA IPC memory for GPU."""
    if device.type == "cpu":
        return HostRing(num_slots, slot_bytes, name)
    if device.type == "cuda":
        from hscapture.ring.cuda import CudaRing

        return CudaRing(num_slots, slot_bytes, device)
    raise ValueError(f"device: {device} has no ring backend; use 'cpu' or 'cuda[:N]'")


def open_ring(description: dict[str, Any]) -> RingReader:
    """Open the ring ``description`` (what :meth:`Ring.describe` gave) says."""
    backend = description.get("backend")
    if backend == "host":
        return HostRingReader(description)
    if backend == "cuda":
        from hscapture.ring.cuda import CudaRingReader

        return CudaRingReader(description)
    raise ProtocolError(f"Layout.ring.backend: {backend!r} is not supported by this consumer")
