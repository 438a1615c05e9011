"""Moving ZeRO-Offload traffic between the accelerator and host memory without stalling either.

Two directions, both through a bounded pool of pinned staging buffers
(:class:`partita.offload.buffer_pool.PinnedBufferPool`), so the pinned memory partita adds
is ``buffer_count x STAGING_BYTES`` whatever the model size:

- gradients down (:meth:`HostTransfer.add_to_host`): a reduced gradient slice is copied into
  a staging buffer on a side CUDA stream, and a worker thread adds it into the fp32 host
  gradient partition once the copy's event has fired. Backward keeps launching kernels
  meanwhile; the host add of one bucket overlaps the reduction of the next.
- parameters up (:meth:`HostTransfer.upload`): an fp32 master slice goes to the device
  asynchronously on the current stream, so the all-gather that follows is ordered after it
  with no host synchronisation. A master page-locked in place (:meth:`HostTransfer.pin_in_place`)
  is copied as it is, in fp32, and cast on the device: the host does no work for the upload
  (on one H200 host the fp32 -> bf16 cast of GPT-1.3B's master cost 131 ms of a host that is
  the step's bottleneck, against ~55 ms more of PCIe that overlaps the next bucket's step).
  Any other source is cast into a staging buffer on the host, halving the bytes sent.

Why our own code: torch has the pieces (pinned memory, streams, events, non-blocking
copies) but no component that pipelines them; DeepSpeed's is inside its ZeRO optimizer.

On a CPU-only machine the same path runs (the "device" is the host), so the CPU tests
exercise the pool, the worker and the chunking that GPU runs use.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from partita.offload.buffer_pool import PinnedBufferPool
from partita.offload.page_locked import PageLockedHost

# Bytes per staging buffer: large enough for full PCIe bandwidth (transfers of tens of MB
# run at the link's rate), small enough that the pool stays a few hundred MB at most.
STAGING_BYTES = 64 * 2**20
# How long a producer waits for a free staging buffer before concluding the worker is stuck.
_ACQUIRE_TIMEOUT_S = 600.0


class OffloadTransferError(RuntimeError):
    """A host-side copy or add of ZeRO-Offload failed (raised on the training thread)."""


class HostTransfer:
    """The device <-> host copies of one engine's offloaded optimizer partitions.

    Args:
        device: the accelerator the model runs on (``cpu`` on a CPU-only machine).
        buffer_count: staging buffers in the pool (``offload_optimizer.buffer_count``).
        pin_memory: page-lock the staging buffers (only meaningful with CUDA).
        staging_bytes: bytes per staging buffer (default :data:`STAGING_BYTES`).
    """

    def __init__(
        self, device: torch.device, *, buffer_count: int, pin_memory: bool, staging_bytes: int | None = None
    ) -> None:
        self.device = device
        staging_bytes = staging_bytes or STAGING_BYTES
        self._cuda = device.type == "cuda"
        self.pool = PinnedBufferPool(
            count=buffer_count, numel=staging_bytes, dtype=torch.uint8, pin=pin_memory and self._cuda, name="offload staging"
        )
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name="partita-offload", daemon=True)
        self._worker.start()
        self.bytes_down = 0
        self.bytes_up = 0
        # Host tensors page-locked at their exact size (the master in place, the gradient and
        # upload buffers), held until close() (partita/offload/page_locked.py says why).
        self.page_locked = PageLockedHost(self.pool.pinned)

    # ------------------------------------------------------------------ worker

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            try:
                if task is None:
                    return
                if self._error is None:
                    task()
            except BaseException as error:  # noqa: BLE001 - handed to the training thread by drain()
                self._error = error
            finally:
                self._tasks.task_done()

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise OffloadTransferError(f"offload worker failed: {type(error).__name__}: {error}") from error

    def _acquire(self) -> torch.Tensor:
        self._raise_worker_error()
        return self.pool.acquire(timeout_s=_ACQUIRE_TIMEOUT_S)

    def _event(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    # ------------------------------------------------------------------ gradients down

    def add_to_host(self, target: torch.Tensor, source: torch.Tensor, *, scale: float) -> None:
        """Asynchronously do ``target += scale * source`` with ``target`` in host memory.

        ``source`` (on the device) may be freed by the caller right away: the copy holds
        it through ``record_stream``. Call :meth:`drain` before reading ``target``.
        """
        if target.numel() != source.numel():
            raise ValueError(f"add_to_host: target has {target.numel()} elements, source {source.numel()}")
        step = self.pool.buffer_bytes // source.element_size()
        for lo in range(0, source.numel(), step):
            hi = min(lo + step, source.numel())
            buffer = self._acquire()
            staging = buffer[: (hi - lo) * source.element_size()].view(source.dtype)
            chunk = source[lo:hi]
            if self._cuda:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    staging.copy_(chunk, non_blocking=True)
                chunk.record_stream(self._stream)  # the caller may drop its reference now
                event = self._event(self._stream)
            else:
                staging.copy_(chunk)
                event = None
            self.bytes_down += staging.numel() * staging.element_size()
            self._tasks.put(self._host_add(event, target[lo:hi], staging, scale, buffer))

    def write_to_host(
        self, target: torch.Tensor, source: torch.Tensor, *, scale: float, sum_of_squares: torch.Tensor | None = None
    ) -> None:
        """Asynchronously do ``target = scale * source`` with ``target`` in host memory.

        The first gradient of a step into an offloaded partition needs no host work at all:
        the accelerator casts ``source`` to fp32 and scales it, chunk by chunk on the side
        stream, and the copy engine writes it straight into ``target`` (pinned, when the
        partition is). That replaces a zero fill plus a mixed-precision add on the host,
        which on one H200 host cost ~0.9 s per step for a 1.3 B model.

        ``sum_of_squares`` (a scalar on the accelerator): the squared L2 norm of what is
        written is added to it on the side stream, so the optimizer step needs no pass over
        the host partition to find the gradient norm. :meth:`drain` orders the current
        stream after these kernels. On a CPU-only machine this is a plain scaled copy.
        """
        if target.numel() != source.numel():
            raise ValueError(f"write_to_host: target has {target.numel()} elements, source {source.numel()}")
        if not self._cuda:
            target.copy_(source)
            if scale != 1.0:
                target.mul_(scale)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        step = self.pool.buffer_bytes // 4  # fp32 temporaries of one staging buffer's size
        with torch.cuda.stream(self._stream):
            for lo in range(0, source.numel(), step):
                hi = min(lo + step, source.numel())
                # A 16-bit target (the host step reads 16-bit gradients) takes the source as it is.
                narrow = target.dtype == source.dtype and scale == 1.0
                wide = None
                if not narrow or sum_of_squares is not None:
                    wide = source[lo:hi].to(torch.float32)  # allocated on (and reused by) the side stream
                    if scale != 1.0:
                        wide.mul_(scale)
                    if sum_of_squares is not None:
                        sum_of_squares.add_(torch.dot(wide, wide))
                sent = source[lo:hi] if narrow else wide
                target[lo:hi].copy_(sent, non_blocking=True)
                self.bytes_down += (hi - lo) * sent.element_size()
        source.record_stream(self._stream)  # the caller may drop its reference now
        if sum_of_squares is not None:
            sum_of_squares.record_stream(self._stream)
        # drain() must not return before the copies have landed in host memory.
        self._tasks.put(self._release_after(self._event(self._stream), None))

    def _host_add(self, event, target, staging, scale, buffer) -> Callable[[], None]:
        def task() -> None:
            try:
                if event is not None:
                    event.synchronize()
                target.add_(staging, alpha=scale)
            finally:
                self.pool.release(buffer)

        return task

    # ------------------------------------------------------------------ parameters up

    def pin_in_place(self, tensor: torch.Tensor) -> bool:
        """Page-lock ``tensor``'s memory where it is (no copy, no rounding of its size), so the
        copy engine reads it directly; False where that is not possible (no CUDA, pinning off,
        the driver refused). The tensor is kept alive until :meth:`close` unregisters it."""
        return self.page_locked.register(tensor)

    def upload(self, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``source`` (host, fp32) cast to ``dtype`` on the device; returns before the copy ends.

        Work queued on the current stream afterwards (the parameter all-gather) sees the
        data; staging buffers go back to the pool when their copy has finished.
        """
        out = torch.empty(source.numel(), dtype=dtype, device=self.device)
        if source.dtype == dtype and (not self._cuda or self.page_locked.holds(source) or source.is_pinned()):
            # Already cast (the delayed update's upload copy): no staging, one asynchronous copy.
            out.copy_(source, non_blocking=self._cuda)
            self.bytes_up += source.numel() * out.element_size()
            return out
        if self._cuda and source.dtype == torch.float32 and self.page_locked.holds(source):
            # Page-locked fp32 master: copy it as it is and cast on the device, a staging
            # buffer's worth at a time (the fp32 temporaries are reused by the allocator).
            step = self.pool.buffer_bytes // 4
            for lo in range(0, source.numel(), step):
                hi = min(lo + step, source.numel())
                wide = torch.empty(hi - lo, dtype=torch.float32, device=self.device)
                wide.copy_(source[lo:hi], non_blocking=True)
                out[lo:hi].copy_(wide)
                self.bytes_up += (hi - lo) * 4
            return out
        element = out.element_size()
        step = self.pool.buffer_bytes // element
        for lo in range(0, source.numel(), step):
            hi = min(lo + step, source.numel())
            buffer = self._acquire()
            staging = buffer[: (hi - lo) * element].view(dtype)
            staging.copy_(source[lo:hi])  # the cast runs on the host, halving the bytes sent
            out[lo:hi].copy_(staging, non_blocking=self._cuda)
            self.bytes_up += (hi - lo) * element
            event = self._event()
            self._tasks.put(self._release_after(event, buffer))
        return out

    def _release_after(self, event, buffer) -> Callable[[], None]:
        def task() -> None:
            try:
                if event is not None:
                    event.synchronize()
            finally:
                if buffer is not None:
                    self.pool.release(buffer)

        return task

    # ------------------------------------------------------------------ lifecycle

    def drain(self) -> None:
        """Wait until every queued copy and host add has finished; raise what failed.

        Also orders the current stream after the side stream, where :meth:`write_to_host`
        accumulates the gradient's sum of squares."""
        self._tasks.join()
        self._raise_worker_error()
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def empty_host(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A host tensor the copy engine can read or write directly (pinned when the staging
        pool is), of exactly ``numel`` elements: the offloaded gradient partition, the delayed
        update's upload copy."""
        return self.page_locked.empty(numel, dtype)

    def event(self) -> torch.cuda.Event | None:
        """An event recorded on the current stream (None without CUDA)."""
        return self._event()

    def close(self) -> None:
        if self._worker.is_alive():
            self._tasks.put(None)
            self._worker.join()
        self.page_locked.close()
        self.pool.close()
