"""Kernels compiled at run time with numba, where it is installed: the host's hot loops in one pass.

torch and numpy run one pass over memory per operation; where a loop needs a dozen (quantizing
to fp8) or a CPU instruction neither exposes (carry-less multiplication for CRC-32), numba
compiles it once per process (~0.5-1 s, when a store run begins: never under the rows). Every
caller keeps a torch or zlib path that gives the same bits, taken when numba is not installed
(``pip install 'hscapture[host-fp8]'``) or the CPU lacks an instruction; readers never compile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_lock = threading.Lock()
_built: dict[Callable[..., Any], Any] = {}
_missing_said = False


def compiled(build: Callable[[Any], T | None], wait: bool = True) -> T | None:
    """``build(numba)``, once per process (threads wait for the first caller); None without numba.

    ``build`` may itself return None (e.g. the CPU lacks an instruction it needs). With ``wait=False``: what
    was built already, else None at once (neither compiling nor waiting for a compile under way), for a caller
    with a path that gives the same bits meanwhile.
    """
    global _missing_said
    if not wait:
        return _built.get(build)
    with _lock:
        if build not in _built:
            try:
                import numba
            except ImportError:
                if not _missing_said:
                    log.info("numba is not installed: the host's fp8 and CRC-32 loops run on torch and zlib")
                    _missing_said = True
                _built[build] = None
            else:  # NUMBA_DISABLE_JIT would leave the loops in Python: slower than torch, and no intrinsics
                _built[build] = None if numba.config.DISABLE_JIT else build(numba)
        return _built[build]


def has_cpu_feature(name: str) -> bool:
    """Whether the CPU numba compiles for has ``name`` (an LLVM feature name, e.g. ``pclmul``)."""
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get(name))
