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
  ``intra_op_parallelism × queue_depth`` requests are in the kernel at any time.
- ``single_submit``: true makes each I/O thread issue its requests one at a time, waiting for
  each to finish before the next (queue depth 1 per thread); false keeps ``queue_depth`` in flight.
- ``overlap_events``: true lets a new tensor's requests be submitted while earlier tensors'
  requests are still completing (``read``/``write`` return at once); false makes ``read``/``write``
  first wait until the operations already submitted have completed, so one tensor is on the wire
  at a time (the returned future still completes asynchronously).
- ``use_gds``: refused by the config (no GPUDirect Storage).

The store's ``buffer_count`` bounds how many tensor operations may be outstanding: a further
``read``/``write`` blocks until one completes, so pending I/O never pins more caller memory than
the staging buffers the engine holds.

O_DIRECT is probed once per store (tmpfs and some network filesystems refuse it; ``direct_io``
records the outcome). A request then goes direct only when its memory address and length are
4096-byte aligned (offsets always are: ``block_size`` is a multiple of 4096); buffers from
:class:`~partita.offload.buffer_pool.PinnedBufferPool` are aligned, arbitrary tensors and the
short last request of a tensor fall back to buffered I/O on a second descriptor.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import errno
import mmap
import os
import re
import shutil
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from partita.offload.config import AioConfig
from partita.offload.errors import NvmeConfigError, NvmeSpaceError, NvmeSwapError
from partita.progress import progress

DIRECT_ALIGNMENT = 4096  # address/length/offset alignment partita requires for O_DIRECT requests
# Allocations at least this large show progress (rank 0): reserving tens of GiB can take minutes
# (the zero-writing fallback, a slow or network disk); smaller ones finish before a bar is useful.
PROGRESS_MIN_BYTES = 2**30

# Private directories of the stores open in this process: two stores with the same tag would share one.
_ACTIVE_DIRS: set[str] = set()
_ACTIVE_LOCK = threading.Lock()
_TAG_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class _SwapFile:
    key: str
    path: str
    numel: int
    dtype: torch.dtype
    nbytes: int  # the tensor's bytes
    file_bytes: int  # nbytes rounded up to block_size: whole-block files keep O_DIRECT offsets legal


class _Op:
    """One tensor read or write in flight: its descriptors, its memory and its future."""

    def __init__(
        self, kind: str, swap: _SwapFile, tensor: torch.Tensor, fd: int, direct_fd: int | None, lanes: int
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


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _human(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


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

        self.root = self._check_directory(directory, config_key)
        self.swap_dir = os.path.join(self.root, f"partita-{tag}-rank{_rank()}-pid{os.getpid()}")
        self._make_private_dir()
        self.direct_io: bool = self._probe_direct_io()

        # Monitoring counters (tensor bytes, padding excluded) and request statistics.
        self.bytes_written = 0
        self.bytes_read = 0
        self.direct_requests = 0
        self.buffered_requests = 0
        self.peak_requests_in_flight = 0
        self._in_flight = 0

        self._files: dict[str, _SwapFile] = {}
        self._next_index = 0
        self._lock = threading.Lock()  # counters, _files and _pending
        self._state_lock = threading.Lock()  # _closed against submission
        self._pending: set[cf.Future] = set()
        self._slots = threading.BoundedSemaphore(buffer_count)
        self._closed = False
        self._lanes = cf.ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=f"partita-aio-{tag}")
        # With single_submit each I/O thread does its own requests; otherwise helpers hold up to
        # queue_depth requests per I/O thread in the kernel.
        self._requests: cf.ThreadPoolExecutor | None = None
        if not self.single_submit:
            self._requests = cf.ThreadPoolExecutor(
                max_workers=self.threads * self.queue_depth, thread_name_prefix=f"partita-aio-req-{tag}"
            )
        atexit.register(self.close)

    # ---- setup -----------------------------------------------------------------------------
    @staticmethod
    def _check_directory(directory: str | os.PathLike, config_key: str) -> str:
        given = os.fspath(directory)
        path = os.path.abspath(given)
        if not os.path.exists(path):
            raise NvmeConfigError(
                f"{config_key}={given!r}: the directory does not exist. Create it on a fast local disk "
                f"(mkdir -p {path}) or set {config_key} to an existing directory."
            )
        if not os.path.isdir(path):
            raise NvmeConfigError(
                f"{config_key}={given!r}: not a directory. Set {config_key} to a directory on a fast local "
                "disk; partita creates its swap files inside it."
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise NvmeConfigError(
                f"{config_key}={given!r}: the directory is not writable by this process (uid {os.getuid()}). "
                f"Make it writable (chmod/chown) or set {config_key} to a directory you can write."
            )
        return path

    def _make_private_dir(self) -> None:
        with _ACTIVE_LOCK:
            if self.swap_dir in _ACTIVE_DIRS:
                raise ValueError(
                    f"an NvmeSwapStore with tag {self.tag!r} is already open in this process at "
                    f"{self.swap_dir}; give each store a distinct tag"
                )
            if os.path.isdir(self.swap_dir):
                # Same tag, rank and pid but no open store: left by an earlier process that died
                # without cleanup and had our pid (common in containers). Its files are garbage.
                warnings.warn(
                    f"removing stale swap directory {self.swap_dir} left by an earlier process", stacklevel=3
                )
                shutil.rmtree(self.swap_dir, ignore_errors=True)
            try:
                os.mkdir(self.swap_dir, 0o700)
            except OSError as exc:
                raise NvmeConfigError(
                    f"{self.config_key}={self.root!r}: cannot create the swap directory {self.swap_dir}: "
                    f"{exc}. Set {self.config_key} to a writable directory on a fast local disk."
                ) from exc
            _ACTIVE_DIRS.add(self.swap_dir)

    def _probe_direct_io(self) -> bool:
        """Write and read one aligned page with O_DIRECT; False where the filesystem refuses it."""
        if not hasattr(os, "O_DIRECT"):
            return False
        probe = os.path.join(self.swap_dir, ".odirect-probe")
        page = mmap.mmap(-1, DIRECT_ALIGNMENT)  # anonymous mappings are page-aligned
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o600)
            try:
                if os.pwrite(fd, page, 0) != DIRECT_ALIGNMENT:
                    return False
            finally:
                os.close(fd)
            fd = os.open(probe, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            try:
                return os.preadv(fd, [page], 0) == DIRECT_ALIGNMENT
            finally:
                os.close(fd)
        except OSError:
            return False
        finally:
            page.close()
            try:
                os.unlink(probe)
            except OSError:
                pass

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
        plan: list[tuple[str, int, torch.dtype, int, int]] = []
        for key, spec in sizes.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"swap key {key!r} must be a non-empty string")
            if key in self._files:
                raise ValueError(f"swap key {key!r} is already allocated in {self.swap_dir}; keys must be unique")
            try:
                numel, dtype = spec
            except (TypeError, ValueError):
                raise ValueError(f"swap key {key!r}: expected (numel, dtype), got {spec!r}") from None
            if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
                raise ValueError(f"swap key {key!r}: numel={numel!r} must be an integer >= 0")
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"swap key {key!r}: dtype={dtype!r} must be a torch.dtype")
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            file_bytes = -(-nbytes // self.block_size) * self.block_size
            plan.append((key, numel, dtype, nbytes, file_bytes))
        needed = sum(p[4] for p in plan)
        free = shutil.disk_usage(self.swap_dir).free
        if needed > free:
            raise NvmeSpaceError(self._space_message(needed, free))

        created: list[str] = []
        files: dict[str, _SwapFile] = {}
        # Counted in MiB, rounded up, so the bar ends exactly at its total.
        mib = 2**20
        bar = progress(-(-needed // mib), desc=f"pre-allocating swap files in {self.swap_dir} (MiB)",
                       enabled=None if needed >= PROGRESS_MIN_BYTES else False)
        done = 0
        try:
            for key, numel, dtype, nbytes, file_bytes in plan:
                safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:80]
                path = os.path.join(self.swap_dir, f"{self._next_index:06d}-{safe}.swp")
                self._next_index += 1
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                created.append(path)
                try:
                    self._preallocate(fd, file_bytes)
                finally:
                    os.close(fd)
                files[key] = _SwapFile(key, path, numel, dtype, nbytes, file_bytes)
                done += file_bytes
                bar.update(-(-done // mib) - bar.n)
        except OSError as exc:
            for path in created:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
                raise NvmeSpaceError(
                    self._space_message(needed, shutil.disk_usage(self.swap_dir).free, cause=str(exc))
                ) from exc
            raise NvmeConfigError(
                f"{self.config_key}={self.root!r}: could not create swap files in {self.swap_dir}: {exc}"
            ) from exc
        finally:
            bar.close()
        with self._lock:
            self._files.update(files)

    def _preallocate(self, fd: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        if hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, nbytes)
                return
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
        # No fallocate: set the size, then write zeros so the blocks are really reserved
        # (ftruncate alone makes a sparse file that can still run out of space later).
        os.ftruncate(fd, nbytes)
        zeros = bytes(self.block_size)
        for offset in range(0, nbytes, self.block_size):
            length = min(self.block_size, nbytes - offset)
            if os.pwrite(fd, zeros[:length], offset) != length:
                raise OSError(errno.ENOSPC, "short write while pre-allocating", fd)

    def _space_message(self, needed: int, free: int, cause: str = "") -> str:
        stale = sorted(
            name
            for name in os.listdir(self.root)
            if name.startswith("partita-") and os.path.join(self.root, name) != self.swap_dir
        )
        stale_note = (
            f" Other partita swap directories there (from earlier or concurrent runs; delete them only if "
            f"no job uses them): {', '.join(stale[:5])}{' ...' if len(stale) > 5 else ''}."
            if stale
            else ""
        )
        return (
            f"{self.config_key}={self.root!r}: not enough free disk space for the swap files: need "
            f"{needed} bytes ({_human(needed)}), free {free} bytes ({_human(free)})"
            f"{' (' + cause + ')' if cause else ''}. Free space there, set {self.config_key} to a larger "
            f"disk, or offload less.{stale_note}"
        )

    # ---- lookups ---------------------------------------------------------------------------
    def keys(self) -> list[str]:
        with self._lock:
            return list(self._files)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def file_path(self, key: str) -> str:
        """Path of ``key``'s swap file (for diagnostics)."""
        return self._swap(key).path

    def _swap(self, key: str) -> _SwapFile:
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
                raise NvmeSwapError(f"the swap store {self.swap_dir} was closed while {kind} of {key!r} started")
            with self._lock:
                self._pending.add(op.future)
            if not stripes:  # an empty tensor: nothing to transfer
                self._lane_done(op, None)
            for stripe in stripes:
                lane = self._lanes.submit(self._run_lane, op, stripe)
                lane.add_done_callback(lambda f, op=op: self._lane_done(op, f.exception()))
        return op.future

    def _check_open(self) -> None:
        if self._closed:
            raise NvmeSwapError(f"the swap store {self.swap_dir} is closed; no more reads or writes")

    @staticmethod
    def _check_tensor(kind: str, swap: _SwapFile, tensor: torch.Tensor) -> None:
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

    def _open(self, kind: str, swap: _SwapFile, tensor: torch.Tensor) -> tuple[int, int | None]:
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
            self._in_flight += 1
            self.peak_requests_in_flight = max(self.peak_requests_in_flight, self._in_flight)
            if direct:
                self.direct_requests += 1
            else:
                self.buffered_requests += 1
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
                self._in_flight -= 1

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
                if op.kind == "write":
                    self.bytes_written += op.swap.nbytes
                else:
                    self.bytes_read += op.swap.nbytes
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
    def close(self) -> None:
        """Wait for outstanding I/O, then remove the swap files and the private directory.

        Safe to call twice; also runs at interpreter exit.
        """
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        # shutdown(wait=True) lets queued lanes run to the end, and lanes wait for their requests.
        self._lanes.shutdown(wait=True)
        if self._requests is not None:
            self._requests.shutdown(wait=True)
        shutil.rmtree(self.swap_dir, ignore_errors=True)
        with _ACTIVE_LOCK:
            _ACTIVE_DIRS.discard(self.swap_dir)
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
