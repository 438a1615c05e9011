"""A fixed pool of (pinned) CPU staging buffers shared by offload worker threads.

Why a pool: page-locked memory is expensive to allocate (a driver call that can take
milliseconds and fragments the host) and is a scarce resource — pinning too much starves the
OS. ZeRO-Offload / ZeRO-Infinity therefore stage every GPU<->CPU copy and every NVMe read and
write through ``buffer_count`` pre-allocated buffers (DeepSpeed's ``buffer_count`` key). The
pool allocates them once, at construction, hands them out with :meth:`PinnedBufferPool.acquire`
and takes them back with :meth:`PinnedBufferPool.release`; it never allocates more, so the
pinned memory partita adds is exactly ``total_bytes`` whatever the workers do. A worker that
finds every buffer taken waits (a ``threading.Condition``) instead of allocating.

Each buffer starts on a 4096-byte boundary (we over-allocate one page and slice), so NVMe
swaps through these buffers can use O_DIRECT (see ``partita/offload/nvme.py``). Buffers are
page-locked at their exact size (``partita/offload/page_locked.py``): torch's pinned allocator
would round a power-of-two buffer plus its alignment page up to twice its size.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from partita.offload.errors import BufferPoolError, PoolExhaustedError
from partita.offload.page_locked import PageLockedHost

# O_DIRECT needs the memory address to be aligned to the logical block size; 4096 covers every
# NVMe / ext4 / xfs setup and is what partita's swap layer checks for.
BUFFER_ALIGNMENT = 4096


def _aligned_empty(numel: int, dtype: torch.dtype, page_locked: PageLockedHost) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements whose first byte is 4096-byte aligned, page-locked
    when ``page_locked`` can."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    raw = torch.empty(nbytes + BUFFER_ALIGNMENT, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % BUFFER_ALIGNMENT
    # torch's CPU allocators return at least 64-byte aligned memory, so `shift` is a multiple of
    # every element size and the dtype view below is legal.
    buffer = raw[shift : shift + nbytes].view(dtype)
    page_locked.register(buffer)
    return buffer


class PinnedBufferPool:
    """A fixed set of ``count`` 1-D CPU buffers of ``numel`` elements of ``dtype``.

    Buffers are page-locked when ``pin=True`` and CUDA is available (``torch.cuda.is_available()``),
    plain CPU memory otherwise (``pinned`` tells which). Thread-safe: any thread may acquire and
    release. A buffer is returned by releasing it or any view of it (``buf[:n]``, ``buf.view(...)``).
    """

    def __init__(
        self, *, count: int, numel: int, dtype: torch.dtype, pin: bool, name: str = "staging"
    ) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(
                f"PinnedBufferPool {name!r}: count={count!r} must be an integer >= 1 "
                "(the config key is buffer_count)"
            )
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ValueError(
                f"PinnedBufferPool {name!r}: numel={numel!r} must be an integer >= 1 "
                "(elements per buffer, e.g. offload_param.buffer_size)"
            )
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"PinnedBufferPool {name!r}: dtype={dtype!r} must be a torch.dtype, e.g. torch.float32")
        self.name = name
        self.numel = numel
        self.dtype = dtype
        self._page_locked = PageLockedHost(pin)
        self._buffers: list[torch.Tensor] = [_aligned_empty(numel, dtype, self._page_locked) for _ in range(count)]
        self.pinned = self._page_locked.enabled and all(self._page_locked.holds(b) for b in self._buffers)
        # Identify a released tensor by its storage: views of a buffer share it, other tensors don't.
        self._index_by_storage = {
            buf.untyped_storage().data_ptr(): i for i, buf in enumerate(self._buffers)
        }
        self._capacity = count
        self._buffer_bytes = numel * self._buffers[0].element_size()
        self._free: list[int] = list(range(count - 1, -1, -1))  # pop() hands out buffer 0 first
        self._taken: set[int] = set()
        self._peak = 0
        self._closed = False
        self._cond = threading.Condition(threading.Lock())

    # ---- sizes and counters -------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Number of buffers; never grows."""
        return self._capacity

    @property
    def in_use(self) -> int:
        """Buffers currently acquired and not yet released."""
        with self._cond:
            return len(self._taken)

    @property
    def peak_in_use(self) -> int:
        """Most buffers ever acquired at the same time."""
        with self._cond:
            return self._peak

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one buffer (``numel`` × element size)."""
        return self._buffer_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of all buffers (the page of alignment slack per buffer is not counted)."""
        return self._buffer_bytes * self._capacity

    # ---- acquire / release --------------------------------------------------------------
    def acquire(self, timeout_s: float | None = None) -> torch.Tensor:
        """Take a free buffer, waiting until one is released; ``timeout_s=None`` waits forever.

        Raises :class:`PoolExhaustedError` (a ``TimeoutError``) when ``timeout_s`` passes with every
        buffer still in use. The buffer's contents are whatever its last user left there.
        """
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"acquire(timeout_s={timeout_s!r}): must be None (wait forever) or >= 0 seconds")
        with self._cond:
            ready = self._cond.wait_for(lambda: self._free or self._closed, timeout=timeout_s)
            if self._closed:
                raise BufferPoolError(f"buffer pool {self.name!r} is closed; no buffer can be acquired")
            if not ready:
                raise PoolExhaustedError(
                    f"buffer pool {self.name!r}: all {self._capacity} buffers "
                    f"({self._buffer_bytes} bytes each) are still in use after waiting {timeout_s} s. "
                    "Every acquire() needs a matching release(); if the workers legitimately need more "
                    "buffers at once, raise buffer_count in the offload config."
                )
            index = self._free.pop()
            self._taken.add(index)
            self._peak = max(self._peak, len(self._taken))
            return self._buffers[index]

    def release(self, buffer: torch.Tensor) -> None:
        """Give a buffer (or a view of it) back; wakes one waiting :meth:`acquire`."""
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
            raise BufferPoolError(
                f"buffer pool {self.name!r}: release() got {type(buffer).__name__}"
                f"{'' if not isinstance(buffer, torch.Tensor) else ' on ' + str(buffer.device)}, "
                "not a buffer acquired from this pool"
            )
        index = self._index_by_storage.get(buffer.untyped_storage().data_ptr())
        if index is None:
            raise BufferPoolError(
                f"buffer pool {self.name!r}: the tensor released is not one of this pool's "
                f"{self._capacity} buffers; release only tensors returned by this pool's acquire()"
            )
        with self._cond:
            if index not in self._taken:
                raise BufferPoolError(
                    f"buffer pool {self.name!r}: buffer {index} released twice (it is not in use); "
                    "each acquire() must be matched by exactly one release()"
                )
            self._taken.discard(index)
            if not self._closed:
                self._free.append(index)
                self._cond.notify()

    @contextlib.contextmanager
    def borrowed(self, timeout_s: float | None = None) -> Iterator[torch.Tensor]:
        """``with pool.borrowed() as buf:`` — acquire, and release even if the body raises."""
        buffer = self.acquire(timeout_s)
        try:
            yield buffer
        finally:
            self.release(buffer)

    def close(self) -> None:
        """Drop the buffers (their memory is freed once no caller holds one); safe to call twice.

        Waiting ``acquire`` calls fail; releasing a buffer still out is accepted and does nothing.
        """
        with self._cond:
            self._closed = True
            self._free.clear()
            self._buffers = []
            self._cond.notify_all()
        self._page_locked.close()

    def __enter__(self) -> PinnedBufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PinnedBufferPool(name={self.name!r}, count={self._capacity}, numel={self.numel}, "
            f"dtype={self.dtype}, pinned={self.pinned}, in_use={self.in_use})"
        )
