"""cupy's bindings of the CUDA runtime alone, and CUDA's start for a consumer: no torch, no cupy proper, no numpy.

Light enough to import first thing in a consumer's process, so the driver's start (~0.2 s on the H200) and its
GPU's primary context (~0.1 s) run on a thread of their own while the process imports the rest (the driver's
calls let go of the GIL); see ``hscapture consume``.
"""

from __future__ import annotations

import logging
from typing import Any

from hscapture.errors import HSCaptureError

log = logging.getLogger(__name__)

#: The NVIDIA driver's control device: where it exists, a consumer starts CUDA before its ring comes.
NVIDIA_CONTROL = "/dev/nvidiactl"


def runtime() -> Any:
    """cupy's bindings of the CUDA runtime, without the rest of cupy (they import in ~15 ms)."""
    try:
        from cupy_backends.cuda.api import runtime as bindings
    except ImportError as exc:
        raise HSCaptureError(
            f"the CUDA ring needs cupy ({exc}); install it with `pip install 'hscapture[cuda]'`"
        ) from None
    return bindings


def start_cuda() -> None:
    """Start CUDA for a consumer that may open a CUDA ring, without torch: load cupy's runtime bindings, start the
    driver and, where one GPU is visible (a CUDA ring can only be on it), make its primary context (a consumer
    that then gets a host ring holds it too). From any thread, any number of times: a later call waits for a start
    under way on another thread and then costs microseconds.

    Not beside the store's writer threads' first compiles: beside a thread busy in Python (numba compiling), a
    thread importing cupy waits for the GIL after each file it reads, seconds in all.
    A failure is left for the ring's open to report.
    """
    try:
        bindings = runtime()
        if bindings.getDeviceCount() == 1:
            bindings.free(0)  # cudaFree(NULL) makes the current device's (device 0's) primary context
    except Exception as exc:  # no driver, no GPU, no cupy: the ring's open says so, if a CUDA ring comes
        log.debug("CUDA not started before the hello: %s", exc)
