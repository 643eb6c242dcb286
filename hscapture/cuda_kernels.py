"""Kernels of ``csrc/`` compiled at run time with NVRTC (through cupy), once per process.

Every caller keeps a torch path that gives the same bytes, taken where a kernel cannot be
compiled (no NVRTC, no cupy): :func:`kernel` says so once in the log and returns None.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: The kernels' sources (a source checkout's ``csrc/``).
KERNELS = Path(__file__).resolve().parents[1] / "csrc"


@cache
def kernel(source: str, name: str, fallback: str) -> Any:
    """Function ``name`` of ``csrc/<source>`` (a ``cupy.RawKernel``); None where it cannot be compiled.

    ``fallback`` says what the caller does instead, for the log line (e.g. ``"quantizing with torch"``).
    """
    try:
        import cupy

        return cupy.RawModule(code=(KERNELS / source).read_text(), options=("-std=c++17",)).get_function(name)
    except Exception as exc:  # no NVRTC, or a compile error: the torch path is always there
        log.warning("%s kernel unavailable (%s); %s", name, exc, fallback)
        return None
