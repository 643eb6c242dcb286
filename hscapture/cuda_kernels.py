"""Kernels of ``hscapture/csrc/`` compiled at run time with NVRTC (through cupy), once per process.

The sources ship inside the package (package data), so an installed wheel finds them as a source
checkout does. Every caller keeps a torch path that gives the same bytes, taken where a kernel cannot
be compiled (no NVRTC, no cupy): :func:`kernel` says so once in the log and returns None.
"""

from __future__ import annotations

import logging
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.abc import Traversable

log = logging.getLogger(__name__)


def source(name: str) -> Traversable:
    """The kernel source file ``name`` in the installed package (``hscapture/csrc/<name>``)."""
    return resources.files("hscapture").joinpath("csrc", name)


@cache
def kernel(filename: str, name: str, fallback: str) -> Any:
    """Function ``name`` of ``hscapture/csrc/<filename>`` (a ``cupy.RawKernel``); None where it cannot be
    compiled.

    ``fallback`` says what the caller does instead, for the log line (e.g. ``"quantizing with torch"``).
    """
    try:
        import cupy

        code = source(filename).read_text()
        return cupy.RawModule(code=code, options=("-std=c++17",)).get_function(name)
    except Exception as exc:  # no NVRTC, or a compile error: the torch path is always there
        log.warning("%s kernel unavailable (%s); %s", name, exc, fallback)
        return None
