"""The swap store's reads and writes: each tensor cut into block requests, many in the kernel at once.

Why threads: torch has no asynchronous file I/O, and ``os.pread``/``os.pwrite`` release the GIL,
so a pool of threads each blocked in one syscall keeps that many requests in flight in the
kernel — what an NVMe device needs to reach its sequential bandwidth. :class:`BlockIO` is that
machinery; :class:`~partita.offload.nvme.NvmeSwapStore` checks keys and tensors and hands it
(file, tensor) pairs. The meaning of each ``aio`` key is in :mod:`partita.offload.nvme`.

:meth:`BlockIO.counters` reports what went through: tensor bytes read and written (padding
excluded, counted when a tensor's operation completes without error), request counts, and the
seconds the store had at least one read, one write, or any request in the kernel ("busy"). Busy
time next to a step's wall time says whether the disk was kept busy: a step much longer than its
busy seconds waited on something else.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from dataclasses import dataclass, fields

import torch

from partita.offload.errors import NvmeSwapError
from partita.offload.nvme_space import DIRECT_ALIGNMENT, SwapFile


@dataclass(frozen=True)
class IoCounters:
    """A snapshot of a store's traffic since it opened; subtract two for the traffic between them."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0  # tensor reads completed without error
    writes: int = 0
    direct_requests: int = 0  # block requests that went through O_DIRECT
    buffered_requests: int = 0
    read_busy_s: float = 0.0  # seconds with at least one read request in the kernel
    write_busy_s: float = 0.0
    busy_s: float = 0.0  # seconds with at least one request of either kind in the kernel

    def __sub__(self, other: IoCounters) -> IoCounters:
        return IoCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Op:
    """One tensor read or write in flight: its descriptors, its memory and its future."""

    def __init__(
        self, kind: str, swap: SwapFile, tensor: torch.Tensor, fd: int, direct_fd: int | None, lanes: int
    ) -> None:
        self.kind = kind
        self.swap = swap
        self.tensor = tensor  # held so the memory outlives the I/O even if the caller drops it
        # A flat byte view: slicing a memoryview is zero-copy and os.pread/pwrite use it in place.
        self.view = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
        self.base_ptr = tensor.data_ptr()
        self.fd = fd
        self.direct_fd = direct_fd
        self.future: cf.Future = cf.Future()
        self.remaining = lanes
        self.error: BaseException | None = None
        self.failed = False  # set by the first failing request so the others stop submitting
        self.lock = threading.Lock()


class _Busy:
    """Seconds during which a count of requests in flight was above zero (under the caller's lock)."""

    def __init__(self) -> None:
        self.count = 0
        self.since = 0.0
        self.total = 0.0

    def up(self, now: float) -> None:
        if self.count == 0:
            self.since = now
        self.count += 1

    def down(self, now: float) -> None:
        self.count -= 1
        if self.count == 0:
            self.total += now - self.since

    def seconds(self, now: float) -> float:
        return self.total + (now - self.since if self.count else 0.0)


class BlockIO:
    """Runs tensor reads and writes as block requests on threads (see the module docstring).

    ``buffer_count`` bounds the tensor operations outstanding: a further submission blocks until
    one completes. ``swap_dir`` and ``config_key`` are named in errors.
    """

    def __init__(
        self,
        *,
        block_size: int,
        queue_depth: int,
        threads: int,
        single_submit: bool,
        overlap_events: bool,
        buffer_count: int,
        direct_io: bool,
        tag: str,
        swap_dir: str,
        config_key: str,
    ) -> None:
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.threads = threads
        self.overlap_events = overlap_events
        self.direct_io = direct_io
        self.swap_dir = swap_dir
        self.config_key = config_key
        self.peak_requests_in_flight = 0
        self._bytes = {"read": 0, "write": 0}
        self._ops = {"read": 0, "write": 0}
        self._requests_by_path = {"direct": 0, "buffered": 0}
        self._busy = {"read": _Busy(), "write": _Busy(), "any": _Busy()}
        self._lock = threading.Lock()  # counters and _pending
        self._state_lock = threading.Lock()  # _closed against submission
        self._pending: set[cf.Future] = set()
        self._slots = threading.BoundedSemaphore(buffer_count)
        self._closed = False
        # With single_submit each I/O thread does its own requests, one at a time; otherwise helpers
        # hold up to queue_depth requests per I/O thread in the kernel. There, every outstanding
        # operation gets its lanes at once (threads x buffer_count of them): the next tensor's
        # requests queue behind the current one's instead of waiting for its last request, so a
        # tensor smaller than block_size x queue_depth, or the tail of a large one, does not leave
        # the queue part-empty. The request pool still bounds what is in the kernel.
        lanes = threads if single_submit else threads * buffer_count
        self._lanes = cf.ThreadPoolExecutor(max_workers=lanes, thread_name_prefix=f"partita-aio-{tag}")
        self._requests: cf.ThreadPoolExecutor | None = None
        if not single_submit:
            self._requests = cf.ThreadPoolExecutor(
                max_workers=threads * queue_depth, thread_name_prefix=f"partita-aio-req-{tag}"
            )

    # ---- counters --------------------------------------------------------------------------
    def counters(self) -> IoCounters:
        now = time.perf_counter()
        with self._lock:
            return IoCounters(
                bytes_read=self._bytes["read"], bytes_written=self._bytes["write"],
                reads=self._ops["read"], writes=self._ops["write"],
                direct_requests=self._requests_by_path["direct"], buffered_requests=self._requests_by_path["buffered"],
                read_busy_s=self._busy["read"].seconds(now), write_busy_s=self._busy["write"].seconds(now),
                busy_s=self._busy["any"].seconds(now),
            )

    # ---- submission ------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, kind: str, swap: SwapFile, tensor: torch.Tensor) -> cf.Future:
        self._slots.acquire()  # at most buffer_count operations outstanding
        try:
            if not self.overlap_events:
                with self._lock:
                    earlier = list(self._pending)
                cf.wait(earlier)
            fd, direct_fd = self._open(kind, swap, tensor)
        except BaseException:
            self._slots.release()
            raise
        chunks = [
            (offset, min(self.block_size, swap.nbytes - offset)) for offset in range(0, swap.nbytes, self.block_size)
        ]
        stripes = [
            stripe
            for i in range(self.threads)
            if (stripe := chunks[i * len(chunks) // self.threads : (i + 1) * len(chunks) // self.threads])
        ]
        op = _Op(kind, swap, tensor, fd, direct_fd, lanes=max(1, len(stripes)))
        # _state_lock orders submission against close() (which shuts the pools down); it is not
        # self._lock, because a lane finishing at once runs _lane_done here, and that takes self._lock.
        with self._state_lock:
            if self._closed:
                self._close_fds(op)
                self._slots.release()
                raise NvmeSwapError(f"the swap store {self.swap_dir} was closed while {kind} of {swap.key!r} started")
            with self._lock:
                self._pending.add(op.future)
            if not stripes:  # an empty tensor: nothing to transfer
                self._lane_done(op, None)
            for stripe in stripes:
                lane = self._lanes.submit(self._run_lane, op, stripe)
                lane.add_done_callback(lambda f, op=op: self._lane_done(op, f.exception()))
        return op.future

    def _open(self, kind: str, swap: SwapFile, tensor: torch.Tensor) -> tuple[int, int | None]:
        """Open ``swap``'s file and check it is still the file allocate() made."""
        flags = (os.O_RDONLY if kind == "read" else os.O_WRONLY) | os.O_CLOEXEC  # never O_CREAT
        touch_note = (
            f"Something removed or changed files in the swap directory {self.swap_dir} while the job ran; "
            f"it must not be touched while training (point {self.config_key} at a directory no cleanup job "
            "or other process uses, and restart from the last checkpoint)."
        )
        try:
            fd = os.open(swap.path, flags)
        except FileNotFoundError:
            raise NvmeSwapError(
                f"swap file for key {swap.key!r} is missing: {swap.path} (expected {swap.file_bytes} bytes, "
                f"found no file). {touch_note}"
            ) from None
        except OSError as exc:
            raise NvmeSwapError(f"cannot open swap file {swap.path} for key {swap.key!r}: {exc}. {touch_note}") from exc
        size = os.fstat(fd).st_size
        if size != swap.file_bytes:
            os.close(fd)
            raise NvmeSwapError(
                f"swap file for key {swap.key!r} has the wrong size: {swap.path} is {size} bytes, expected "
                f"{swap.file_bytes} bytes. {touch_note}"
            )
        direct_fd = None
        if self.direct_io and swap.nbytes >= DIRECT_ALIGNMENT and tensor.data_ptr() % DIRECT_ALIGNMENT == 0:
            try:
                direct_fd = os.open(swap.path, flags | os.O_DIRECT)
            except OSError:
                direct_fd = None  # this file refuses O_DIRECT after all: buffered I/O still works
        return fd, direct_fd

    # ---- the threads -----------------------------------------------------------------------
    def _run_lane(self, op: _Op, stripe: list[tuple[int, int]]) -> None:
        """One I/O thread's share of a tensor: its requests, at most queue_depth in flight."""
        if self._requests is None:  # single_submit: one request at a time, each waits for the previous
            for offset, length in stripe:
                if op.failed:
                    return
                self._request(op, offset, length)
            return
        in_flight = threading.Semaphore(self.queue_depth)
        futures: list[cf.Future] = []
        try:
            for offset, length in stripe:
                in_flight.acquire()
                if op.failed:
                    in_flight.release()
                    break
                future = self._requests.submit(self._request, op, offset, length)
                future.add_done_callback(lambda _f: in_flight.release())
                futures.append(future)
        finally:
            cf.wait(futures)
        for future in futures:
            error = future.exception()
            if error is not None:
                raise error

    def _request(self, op: _Op, offset: int, length: int) -> None:
        """One block request: pread/pwrite ``length`` bytes at ``offset``, retrying short transfers."""
        direct = (
            op.direct_fd is not None
            and (op.base_ptr + offset) % DIRECT_ALIGNMENT == 0
            and length % DIRECT_ALIGNMENT == 0
        )
        fd = op.direct_fd if direct else op.fd
        with self._lock:
            now = time.perf_counter()
            self._busy[op.kind].up(now)
            self._busy["any"].up(now)
            self.peak_requests_in_flight = max(self.peak_requests_in_flight, self._busy["any"].count)
            self._requests_by_path["direct" if direct else "buffered"] += 1
        try:
            done = 0
            while done < length:
                part = op.view[offset + done : offset + length]
                if op.kind == "read":
                    n = os.preadv(fd, [part], offset + done)
                else:
                    n = os.pwrite(fd, part, offset + done)
                if n == 0:
                    raise NvmeSwapError(
                        f"swap {op.kind} of key {op.swap.key!r}: {op.swap.path} ended at byte {offset + done}, "
                        f"expected {op.swap.file_bytes} bytes; the file was truncated while training. The swap "
                        f"directory {self.swap_dir} must not be touched while training."
                    )
                done += n
                fd = op.fd  # an O_DIRECT remainder would be misaligned: finish buffered
        except OSError as exc:
            op.failed = True
            raise NvmeSwapError(
                f"swap {op.kind} of key {op.swap.key!r} failed at bytes [{offset}, {offset + length}) of "
                f"{op.swap.path}: {exc}"
            ) from exc
        except BaseException:
            op.failed = True
            raise
        finally:
            with self._lock:
                now = time.perf_counter()
                self._busy[op.kind].down(now)
                self._busy["any"].down(now)

    def _lane_done(self, op: _Op, error: BaseException | None) -> None:
        with op.lock:
            if error is not None and op.error is None:
                op.error = error
            op.remaining -= 1
            if op.remaining:
                return
        self._close_fds(op)
        with self._lock:
            if op.error is None:
                self._bytes[op.kind] += op.swap.nbytes
                self._ops[op.kind] += 1
        # Free the slot before completing the future, so a done-callback may submit the next op.
        self._slots.release()
        if op.error is not None:
            op.future.set_exception(op.error)
        else:
            op.future.set_result(op.tensor)
        # Only now: with overlap_events false a later op waits for every future still in _pending.
        with self._lock:
            self._pending.discard(op.future)
        del op.view, op.tensor

    @staticmethod
    def _close_fds(op: _Op) -> None:
        for fd in (op.fd, op.direct_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    # ---- teardown --------------------------------------------------------------------------
    def close(self) -> bool:
        """Wait for the operations submitted, then stop the threads; False if already closed."""
        with self._state_lock:
            if self._closed:
                return False
            self._closed = True
        # shutdown(wait=True) lets queued lanes run to the end, and lanes wait for their requests.
        self._lanes.shutdown(wait=True)
        if self._requests is not None:
            self._requests.shutdown(wait=True)
        return True
