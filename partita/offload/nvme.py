"""NVMe swap files for ZeRO-Infinity: tensors written to and read from files with overlapped block I/O.

Why our own code and no library: torch has no asynchronous file I/O, and DeepSpeed's ``aio`` is a
C++ extension that must be compiled against libaio. What the swap layer needs — many large block
reads/writes in flight at once so the NVMe device's queues stay full — is reachable from the
standard library: ``os.pread``/``os.pwrite`` release the GIL, so a pool of threads each blocked in
one syscall keeps that many requests in flight in the kernel, and ``O_DIRECT`` skips the page
cache when the memory and offsets are aligned.

Layout: every store owns a private directory ``<nvme_path>/partita-<tag>-rank<R>-pid<PID>/`` with
one pre-allocated file per key (:meth:`NvmeSwapStore.allocate`), sized to the key's tensor bytes
rounded up to ``aio.block_size``. :meth:`~NvmeSwapStore.close` (also run at interpreter exit)
removes the files and the directory.

What each ``aio`` key does here (DeepSpeed names, partita's thread-based meaning):

- ``block_size``: bytes per read/write request; a tensor is split into requests of this size
  (the last one shorter).
- ``intra_op_parallelism`` (``thread_count``): I/O threads; one tensor's requests are split into
  that many contiguous stripes, one per thread, so a single large tensor uses every thread.
- ``queue_depth``: requests each I/O thread keeps in flight at once (a thread hands requests to
  helper threads that each block in one ``pread``/``pwrite``, bounded by a semaphore), so at most
  ``intra_op_parallelism × queue_depth`` requests are in the kernel at any time. The requests of
  all outstanding tensors share those places, so small tensors still fill the queue.
- ``single_submit``: true makes each I/O thread issue its requests one at a time, waiting for
  each to finish before the next (queue depth 1 per thread); false keeps ``queue_depth`` in flight.
- ``overlap_events``: true lets a new tensor's requests be submitted while earlier tensors'
  requests are still completing (``read``/``write`` return at once); false makes ``read``/``write``
  first wait until the operations already submitted have completed, so one tensor is on the wire
  at a time (the returned future still completes asynchronously).
- ``use_gds``: refused by the config (no GPUDirect Storage).

The store's ``buffer_count`` bounds how many tensor operations may be outstanding: a further
``read``/``write`` blocks until one completes, so pending I/O never pins more caller memory than
the staging buffers the engine holds. Outstanding operations are not ordered against each other:
wait for a key's write before reading that key back (partita's callers always do).

O_DIRECT is probed once per store (tmpfs and some network filesystems refuse it; ``direct_io``
records the outcome). A request then goes direct only when its memory address and length are
4096-byte aligned (offsets always are: ``block_size`` is a multiple of 4096); buffers from
:class:`~partita.offload.buffer_pool.PinnedBufferPool` are aligned, arbitrary tensors and the
short last request of a tensor fall back to buffered I/O on a second descriptor.

:meth:`NvmeSwapStore.io_counters` returns the bytes read and written and the seconds the disk was
busy (:class:`~partita.offload.nvme_io.IoCounters`); the difference of two snapshots is the
traffic between them.

Files: this one is the store's interface (keys, tensor checks, lifetime); the directory, space
and pre-allocation work is in :mod:`partita.offload.nvme_space`, the threads and block requests in
:mod:`partita.offload.nvme_io`.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import os
import re
import threading
from collections.abc import Mapping

import torch

from partita.offload import nvme_space
from partita.offload.config import AioConfig
from partita.offload.errors import NvmeSwapError
from partita.offload.nvme_io import BlockIO, IoCounters
from partita.offload.nvme_space import DIRECT_ALIGNMENT, SwapFile

__all__ = ["DIRECT_ALIGNMENT", "PROGRESS_MIN_BYTES", "IoCounters", "NvmeSwapStore"]

# Allocations at least this large show progress (rank 0); read at each allocate(), so tests and
# callers may change it here.
PROGRESS_MIN_BYTES = nvme_space.PROGRESS_MIN_BYTES

_TAG_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class NvmeSwapStore:
    """Swap files for tensors under ``directory``, read and written asynchronously.

    ``config_key`` is the config key the directory came from (``offload_optimizer.nvme_path`` or
    ``offload_param.nvme_path``); it is named in every error about the directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        aio: AioConfig,
        buffer_count: int,
        tag: str,
        config_key: str = "offload_optimizer.nvme_path",
    ) -> None:
        if aio.use_gds:
            raise NotImplementedError("aio.use_gds: GPUDirect Storage is not available in partita; set it to false")
        if aio.block_size <= 0 or aio.block_size % DIRECT_ALIGNMENT:
            raise ValueError(f"aio.block_size={aio.block_size} must be a positive multiple of 4096, e.g. 1048576")
        if isinstance(buffer_count, bool) or not isinstance(buffer_count, int) or buffer_count < 1:
            raise ValueError(f"buffer_count={buffer_count!r} must be an integer >= 1 (offload buffer_count)")
        if not isinstance(tag, str) or not _TAG_RE.match(tag):
            raise ValueError(
                f"NvmeSwapStore tag={tag!r}: use letters, digits, '_', '-' or '.' only "
                "(it becomes part of the swap directory's name), e.g. 'optimizer' or 'param'"
            )
        self.config_key = config_key
        self.block_size = int(aio.block_size)
        self.queue_depth = int(aio.queue_depth)
        self.threads = int(aio.intra_op_parallelism)
        self.single_submit = bool(aio.single_submit)
        self.overlap_events = bool(aio.overlap_events)
        self.buffer_count = buffer_count
        self.tag = tag

        self.root = nvme_space.check_directory(directory, config_key)
        self.swap_dir = os.path.join(self.root, f"partita-{tag}-rank{_rank()}-pid{os.getpid()}")
        nvme_space.make_private_dir(self.swap_dir, tag=tag, root=self.root, config_key=config_key)
        self.direct_io: bool = nvme_space.probe_direct_io(self.swap_dir)

        self._files: dict[str, SwapFile] = {}
        self._next_index = 0
        self._files_lock = threading.Lock()
        self._io = BlockIO(
            block_size=self.block_size, queue_depth=self.queue_depth, threads=self.threads,
            single_submit=self.single_submit, overlap_events=self.overlap_events, buffer_count=buffer_count,
            direct_io=self.direct_io, tag=tag, swap_dir=self.swap_dir, config_key=config_key,
        )
        atexit.register(self.close)

    # ---- counters --------------------------------------------------------------------------
    def io_counters(self) -> IoCounters:
        """Bytes read/written, operations, requests and busy seconds since the store opened."""
        return self._io.counters()

    @property
    def bytes_written(self) -> int:
        """Tensor bytes written (padding excluded), counted as each write completes."""
        return self._io.counters().bytes_written

    @property
    def bytes_read(self) -> int:
        return self._io.counters().bytes_read

    @property
    def direct_requests(self) -> int:
        return self._io.counters().direct_requests

    @property
    def buffered_requests(self) -> int:
        return self._io.counters().buffered_requests

    @property
    def peak_requests_in_flight(self) -> int:
        return self._io.peak_requests_in_flight

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, sizes: Mapping[str, tuple[int, torch.dtype]]) -> None:
        """Create and pre-allocate one file per key: ``{key: (numel, dtype)}``.

        Pass all keys at once at start: the free space for all of them (each file rounded up to
        ``block_size``) is checked before anything is written, and the files are then reserved on
        disk (``posix_fallocate``) so a full disk fails here, not hours into training. May be
        called again for new keys. From :data:`PROGRESS_MIN_BYTES` on, rank 0 shows progress (a
        bar in a terminal, a plain line every 10 s otherwise).
        """
        self._check_open()
        plan = nvme_space.plan_files(sizes, block_size=self.block_size, existing=self._files, swap_dir=self.swap_dir)
        files = nvme_space.create_files(
            plan, swap_dir=self.swap_dir, root=self.root, config_key=self.config_key, block_size=self.block_size,
            first_index=self._next_index, progress_min_bytes=PROGRESS_MIN_BYTES,
        )
        self._next_index += len(plan)
        with self._files_lock:
            self._files.update(files)

    # ---- lookups ---------------------------------------------------------------------------
    def keys(self) -> list[str]:
        with self._files_lock:
            return list(self._files)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def file_path(self, key: str) -> str:
        """Path of ``key``'s swap file (for diagnostics)."""
        return self._swap(key).path

    def _swap(self, key: str) -> SwapFile:
        swap = self._files.get(key)
        if swap is None:
            known = list(self._files)
            raise ValueError(
                f"swap key {key!r} was not allocated in {self.swap_dir}; call allocate() with it first "
                f"(allocated: {', '.join(map(repr, known[:5]))}{' ...' if len(known) > 5 else ''}"
                f"{'none' if not known else ''})"
            )
        return swap

    # ---- I/O -------------------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor) -> cf.Future:
        """Start writing ``tensor`` to ``key``'s file; the future's result is ``tensor``.

        ``tensor`` must be a contiguous CPU tensor of the key's numel and dtype; do not modify it
        until the future completes (the store holds a reference, so dropping it is safe).
        """
        return self._submit("write", key, tensor)

    def read(self, key: str, out: torch.Tensor) -> cf.Future:
        """Start reading ``key``'s file into ``out``; the future's result is ``out``.

        Raises :class:`NvmeSwapError` when the file was removed or changed size since allocation.
        """
        return self._submit("read", key, out)

    def write_sync(self, key: str, tensor: torch.Tensor) -> None:
        self.write(key, tensor).result()

    def read_sync(self, key: str, out: torch.Tensor) -> torch.Tensor:
        return self.read(key, out).result()

    def _submit(self, kind: str, key: str, tensor: torch.Tensor) -> cf.Future:
        self._check_open()
        swap = self._swap(key)
        self._check_tensor(kind, swap, tensor)
        return self._io.submit(kind, swap, tensor)

    def _check_open(self) -> None:
        if self._io.closed:
            raise NvmeSwapError(f"the swap store {self.swap_dir} is closed; no more reads or writes")

    @staticmethod
    def _check_tensor(kind: str, swap: SwapFile, tensor: torch.Tensor) -> None:
        what = "tensor to write" if kind == "write" else "output tensor"
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"swap {kind} of {swap.key!r}: the {what} must be a torch.Tensor, got {type(tensor).__name__}")
        problems = []
        if tensor.device.type != "cpu":
            problems.append(f"device {tensor.device} (must be cpu: stage through a pinned buffer)")
        if tensor.dtype != swap.dtype:
            problems.append(f"dtype {tensor.dtype} (allocated as {swap.dtype})")
        if tensor.numel() != swap.numel:
            problems.append(f"{tensor.numel()} elements (allocated as {swap.numel})")
        if not tensor.is_contiguous():
            problems.append("not contiguous (call .contiguous() or use a staging buffer)")
        if problems:
            raise ValueError(f"swap {kind} of {swap.key!r}: the {what} has " + "; ".join(problems))

    # ---- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for outstanding I/O, then remove the swap files and the private directory.

        Safe to call twice; also runs at interpreter exit.
        """
        if not self._io.close():
            return
        nvme_space.remove_private_dir(self.swap_dir)
        atexit.unregister(self.close)

    def __enter__(self) -> NvmeSwapStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NvmeSwapStore({self.swap_dir!r}, keys={len(self._files)}, direct_io={self.direct_io}, "
            f"block_size={self.block_size}, threads={self.threads}, queue_depth={self.queue_depth})"
        )
