"""Give the C allocator's free host memory back to the operating system (glibc's ``malloc_trim``).

Why: ``partita.zero.Init`` creates each module's parameters whole, keeps this rank's 1/N shard and
frees the rest, and ``initialize`` frees the build's shards once the fp32 masters hold them. glibc
keeps freed heap memory for reuse instead of returning it, and the long-lived shards sit between
the freed blocks, so a process that built a model under ``zero.Init`` kept most of the whole
model resident: on 4 CPU ranks 1.7x a whole model's memory per rank after the build, where the
live tensors were exactly a quarter of it (``benchmarks/zero_init_host_memory.py``). Trimming
once at the end of the build and of ``initialize`` returns what no tensor holds. It is a no-op
where the C library has no ``malloc_trim`` (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

__all__ = ["release_free_host_memory"]


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


def release_free_host_memory() -> bool:
    """Return the heap's free pages to the OS; False where this C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
