"""Exact-size page-locked host memory: CPU tensors registered where they are (``cudaHostRegister``).

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every request
up to a power of two and keeps freed blocks for reuse. For offload's large host tensors that is
a lot of locked memory nobody uses. With optimizer and parameters offloaded, a 6.26 B-parameter
GPT's 25 GB fp32 gradient buffer takes 32 GiB that way and its 12.5 GB of bf16 parameter shards
16 GiB; each 64 MiB staging buffer plus its alignment page takes 128 MiB. On one H200 host
(128 GiB) that is about 13 GiB, and the next size, 6.66 B, ran out of host memory
(benchmarks/largest_per_setting.py, 2026-12-01). Registering an ordinary tensor's memory locks
exactly its bytes, and the copy engine reads and writes it directly, as it would pinned memory.

A registered tensor is held here until :meth:`PageLockedHost.close` unregisters it (or, if close
is never called, until the object is collected). If it were freed while still registered, the
driver would keep a stale range. Where CUDA is absent, pinning
is off, or the driver refuses, tensors stay ordinary pageable memory (:meth:`PageLockedHost.holds`
says which), and copies are then synchronous but still correct.
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["PageLockedHost"]


class PageLockedHost:
    """Registers host tensors with the CUDA driver and unregisters them on :meth:`close`.

    Thread-safe; ``enabled`` is the user's ``pin_memory`` choice (ignored without CUDA).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = bool(enabled) and torch.cuda.is_available()
        self._tensors: dict[int, torch.Tensor] = {}  # data_ptr -> the registered tensor
        self._lock = threading.Lock()
        # Runs once: from close(), or when this object is collected without it (an engine dropped
        # unclosed), so no registered range outlives its tensor.
        self._finalizer = weakref.finalize(self, _unregister_all, self._tensors, self._lock)

    def register(self, tensor: torch.Tensor) -> bool:
        """Page-lock ``tensor``'s memory in place (no copy); False where that is not possible."""
        if not self.enabled or not self._finalizer.alive or tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous():
            return False
        if torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0) != 0:
            return False
        with self._lock:
            self._tensors[tensor.data_ptr()] = tensor
        return True

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised host tensor of exactly ``numel`` elements, page-locked when possible."""
        tensor = torch.empty(numel, dtype=dtype)
        self.register(tensor)
        return tensor

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or the view it is) lies inside a registered range."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        with self._lock:
            return any(base <= start and end <= base + t.numel() * t.element_size() for base, t in self._tensors.items())

    @property
    def nbytes(self) -> int:
        """Bytes page-locked by this object."""
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def close(self) -> None:
        """Unregister everything (after every queued copy has finished); safe to call twice."""
        self._finalizer()


def _unregister_all(tensors: dict[int, torch.Tensor], lock: threading.Lock) -> None:
    with lock:
        bases = list(tensors)
        if bases:
            torch.cuda.synchronize()  # no copy may still read or write a range being unregistered
            for base in bases:
                torch.cuda.cudart().cudaHostUnregister(base)
        tensors.clear()
