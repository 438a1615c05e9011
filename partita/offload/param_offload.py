"""Where ZeRO-3 keeps each rank's low-precision parameter shards between uses.

Stage 3 (``partita/zero/param_gatherer.py``) keeps, per ZeRO group, this rank's shard of every
parameter in the model dtype; a unit's gather reads its parameters' pieces of those shards and
all-gathers them. This module owns the shards, in one of three places:

- :class:`DeviceShards` (``offload_param.device`` "none"): on the parameters' device. A group
  whose fp32 master lives in host memory (``offload_optimizer``) still has its shards on the
  device: the all-gather (NCCL) reads them there. After each step they are refreshed through
  the group's :class:`~partita.offload.transfer.HostTransfer` (cast on the host into pinned
  staging, copied up asynchronously), never by a pageable synchronous copy. In fp32 training a
  device master *is* the shard (one copy); a host master never is (on a CPU-only machine it
  would be the same device, but the layout must be the one GPU runs have).
- :class:`HostShards` ("cpu"): whole partitions in host memory, page-locked once at build when
  ``pin_memory`` and the parameters are on CUDA (``pinned_bytes`` says how much: exactly the
  shards' bytes). A gather copies the unit's pieces (adjacent ones merged) into a device
  staging tensor and all-gathers from it. After a step the new values are cast straight into
  the host shards (from a host master: no device round trip).
- :class:`NvmeShards` ("nvme"): the shards of sharded (non-persistent) parameters, one swap
  file each in an :class:`~partita.offload.nvme.NvmeSwapStore`, except the first parameters
  (groups in order, layout order inside each) whose shards fit in ``max_in_cpu`` elements,
  which stay in host memory like "cpu". A gather reads the unit's files into a buffer of a
  :class:`~partita.offload.buffer_pool.PinnedBufferPool` (``buffer_count`` buffers of
  ``buffer_size`` elements) and copies from there. A unit's on-disk shards must fit one buffer
  (checked at start, with the fix in the error). After each step every file is rewritten.
  Persistent parameters (whole on every rank, never gathered) have no file.

Streams (CUDA): the host-to-device copies of a gather and its all-gather are issued on one
side stream (``stream``), so the copies are ordered before the collective without any host
synchronisation, and prefetched copies overlap the compute stream instead of queueing in it.
The compute stream waits for a gather only where it unpacks it (``arrived``). Host memory a
copy reads (pinned shards, pool buffers) is not rewritten before the copy's event fired.
On a CPU-only machine there is no stream: copies are synchronous and the same code runs.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import contextlib
import itertools
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from partita.config.base import ConfigError
from partita.offload.buffer_pool import BUFFER_ALIGNMENT, PinnedBufferPool
from partita.offload.page_locked import PageLockedHost
from partita.offload.config import AioConfig, OffloadParamConfig
from partita.offload.nvme import NvmeSwapStore

if TYPE_CHECKING:
    from partita.zero.shard_group import ShardedParamGroup

# Elements per device->host copy when a device master is cast into host shards: bounds the
# low-precision temporary the cast makes on the device.
_HOST_COPY_CHUNK = 1 << 24
_CAST_CHUNK = 1 << 24  # fp32 elements per device temporary of a gather from a host master (64 MiB)
_STORE_IDS = itertools.count()  # one swap directory per gatherer in a process (tags must differ)

LOCATIONS = ("accelerator", "cpu", "nvme")


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """One parameter's shard: ``numel`` elements at ``offset`` of group ``group``'s partition."""

    group: int
    offset: int
    numel: int


@dataclass(frozen=True, slots=True)
class UnitPieces:
    """A ZeRO-3 unit's name (for errors) and the shard pieces one gather of it reads."""

    name: str
    pieces: tuple[ShardPiece, ...]


class ShardStorage(abc.ABC):
    """The shards of every ZeRO group on this rank, and the copies a gather needs.

    The gatherer calls, for each gather: ``with storage.issue(): local = storage.fetch(...);
    <all-gather from local>; ready = storage.issued()``, then before unpacking
    ``storage.arrived(ready, gathered)``; after each optimizer step ``refresh()``.
    """

    location = "accelerator"

    def __init__(self, groups: Sequence[ShardedParamGroup], device: torch.device) -> None:
        self.groups = list(groups)
        self.device = device
        # Per group, what ``fetch`` reads (whole partitions; NVMe: only the shards kept in memory).
        self.shards: list[torch.Tensor] = []
        self.stream: torch.cuda.Stream | None = None
        self.pinned = False
        self._last_copy: torch.cuda.Event | None = None

    def issue(self) -> contextlib.AbstractContextManager:
        """The context a gather's copies and all-gather are issued in (the side stream)."""
        return contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    @abc.abstractmethod
    def fetch(self, pieces: Sequence[ShardPiece], numel: int) -> torch.Tensor:
        """A 1-D tensor on the device holding ``pieces`` back to back (``numel`` elements)."""

    def issued(self) -> torch.cuda.Event | None:
        """Mark the end of one gather's work on the side stream (None without one)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def arrived(self, ready: torch.cuda.Event | None, gathered: torch.Tensor) -> None:
        """The compute stream is about to read ``gathered``: order it after the copies, and
        tell the allocator (``gathered`` was allocated on the side stream)."""
        if ready is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        gathered.record_stream(current)

    @abc.abstractmethod
    def refresh(self) -> None:
        """After an optimizer step: the shards follow the fp32 masters."""

    def nbytes(self) -> dict[str, int]:
        """Bytes of shards by location ("accelerator", "cpu", "nvme": swap files as allocated)."""
        out = dict.fromkeys(LOCATIONS, 0)
        out[self.location] = sum(s.numel() * s.element_size() for s in self.shards)
        return out

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory this storage holds."""
        return 0

    def close(self) -> None:
        """Release files and buffers (a no-op for in-memory shards)."""

    def wait_reads(self) -> None:
        """Before the optimizer rewrites the masters: no gather's copy may still read one (a
        storage gathering from the masters, HostShards with ``gather_from_master``)."""
        self._wait_copies()

    # ---- helpers shared by the offloaded storages -------------------------------------------
    def _mark_copies(self) -> None:
        """Remember the last host-to-device copy, so host memory it reads is not rewritten early."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._last_copy = event

    def _wait_copies(self) -> None:
        if self._last_copy is not None:
            self._last_copy.synchronize()
            self._last_copy = None

    def _dtype(self) -> torch.dtype:
        dtypes = {g.model_dtype for g in self.groups}
        if len(dtypes) != 1:
            raise NotImplementedError(
                f"zero_optimization.offload_param needs every trained parameter in one dtype; this model has "
                f"{sorted(map(str, dtypes))}. Cast the model to one dtype, or set offload_param.device to \"none\""
            )
        return dtypes.pop()


def _copy_into_host(host: torch.Tensor, master: torch.Tensor) -> None:
    """``host[:] = master`` cast to ``host``'s dtype: on the host for a host master (no device
    round trip), in bounded chunks from a device master."""
    if master.device.type == "cpu":
        host.copy_(master)
        return
    for lo in range(0, master.numel(), _HOST_COPY_CHUNK):
        hi = min(lo + _HOST_COPY_CHUNK, master.numel())
        host[lo:hi].copy_(master[lo:hi])


def _runs(pieces: Sequence[ShardPiece]) -> Iterator[ShardPiece]:
    """Adjacent pieces of one group (a unit's parameters usually are) merged into one copy."""
    run: ShardPiece | None = None
    for piece in pieces:
        if run is not None and piece.group == run.group and piece.offset == run.offset + run.numel:
            run = ShardPiece(run.group, run.offset, run.numel + piece.numel)
            continue
        if run is not None:
            yield run
        run = piece
    if run is not None:
        yield run


class DeviceShards(ShardStorage):
    """``offload_param`` "none": the shards live on the parameters' device.

    A group whose fp32 master is on the device keeps no low-precision shard at all: a gather
    casts its pieces from the master as it copies them into the send buffer (FSDP2 likewise
    keeps only the fp32 shard). That saves 2 bytes per parameter / world size of device memory,
    and the values are the same as a shard refreshed from the master after each step. A group
    whose master is in host memory (``offload_optimizer``) keeps a device shard, refreshed
    through the offload staging pool.
    """

    location = "accelerator"

    def __init__(self, groups: Sequence[ShardedParamGroup], device: torch.device) -> None:
        super().__init__(groups, device)
        for group in self.groups:
            if not group.offloaded and group.master.device == device:
                self.shards.append(group.master)  # gathers read (and cast) the fp32 master
                continue
            shard = group.master.to(device=device, dtype=group.model_dtype)
            if shard is group.master:
                shard = shard.clone()  # a host master is never the shard (see the module docstring)
            self.shards.append(shard)

    def fetch(self, pieces: Sequence[ShardPiece], numel: int) -> torch.Tensor:
        dtype = self.groups[pieces[0].group].model_dtype
        if len(pieces) == 1 and self.shards[pieces[0].group].dtype == dtype:
            piece = pieces[0]
            return self.shards[piece.group][piece.offset : piece.offset + piece.numel]
        out = torch.empty(numel, dtype=dtype, device=self.device)
        position = 0
        for run in _runs(pieces):
            out[position : position + run.numel].copy_(self.shards[run.group][run.offset : run.offset + run.numel])
            position += run.numel
        return out

    @torch.no_grad()
    def refresh(self) -> None:
        for shard, group in zip(self.shards, self.groups):
            if shard is group.master:
                continue  # gathers read the master itself
            transfer = group.host_transfer
            if transfer is None:
                shard.copy_(group.master)
                continue
            # Host master: cast on the host into pinned staging, copied up asynchronously on the
            # current stream (the next gather is queued after it). One staging buffer per upload
            # keeps the device temporary at most STAGING_BYTES.
            step = max(1, transfer.pool.buffer_bytes // shard.element_size())
            for lo in range(0, shard.numel(), step):
                hi = min(lo + step, shard.numel())
                shard[lo:hi].copy_(transfer.upload(group.master[lo:hi], shard.dtype))

    def nbytes(self) -> dict[str, int]:
        out = dict.fromkeys(LOCATIONS, 0)
        out[self.location] = sum(
            s.numel() * s.element_size() for s, g in zip(self.shards, self.groups) if s is not g.master
        )
        return out


class HostShards(ShardStorage):
    """``offload_param`` "cpu": whole low-precision partitions in (pinned) host memory.

    With ``gather_from_master``, a group whose fp32 master is itself in host memory keeps no
    copy: its "shard" is the master (``shards[g] is group.master``), a gather copies the fp32
    pieces up and casts them on the accelerator, and the optimizer waits for those copies
    (:meth:`wait_reads`) before it rewrites the master.
    """

    location = "cpu"

    def __init__(self, groups: Sequence[ShardedParamGroup], device: torch.device, *, pin_memory: bool,
                 gather_from_master: bool = False) -> None:
        super().__init__(groups, device)
        self.model_dtype = self._dtype()  # one dtype: a gather's staging tensor holds pieces of several groups
        cuda = device.type == "cuda"
        # Exact-size page-locked shards (partita/offload/page_locked.py: torch's pinned allocator
        # would round each up to a power of two).
        self.page_locked = PageLockedHost(bool(pin_memory) and cuda)
        self.stream = torch.cuda.Stream(device) if cuda else None
        for group in self.groups:
            if gather_from_master and group.offloaded:  # its master lives in host memory
                self.shards.append(group.master)
                continue
            host = self.page_locked.empty(group.master.numel(), group.model_dtype)
            _copy_into_host(host, group.master)
            self.shards.append(host)
        copies = [s for s, g in zip(self.shards, self.groups) if s is not g.master]
        self.pinned = self.page_locked.enabled and all(self.page_locked.holds(s) for s in copies)

    @property
    def pinned_bytes(self) -> int:
        return self.page_locked.nbytes

    def nbytes(self) -> dict[str, int]:
        out = dict.fromkeys(LOCATIONS, 0)
        out["cpu"] = sum(s.numel() * s.element_size() for s, g in zip(self.shards, self.groups) if s is not g.master)
        return out

    def close(self) -> None:
        self.page_locked.close()

    def fetch(self, pieces: Sequence[ShardPiece], numel: int) -> torch.Tensor:
        local = torch.empty(numel, dtype=self.model_dtype, device=self.device)
        column = 0
        for run in _runs(pieces):
            source = self.shards[run.group][run.offset : run.offset + run.numel]
            target = local[column : column + run.numel]
            if source.dtype != target.dtype and self.device.type == "cuda":
                _copy_up_then_cast(target, source)  # the fp32 master: cast on the accelerator
            else:
                target.copy_(source, non_blocking=self.stream is not None)
            column += run.numel
        self._mark_copies()
        return local

    @torch.no_grad()
    def refresh(self) -> None:
        self._wait_copies()  # a copy still reading the old values must finish first
        for host, group in zip(self.shards, self.groups):
            if host is not group.master:  # gathers read the master itself
                _copy_into_host(host, group.master)


def _copy_up_then_cast(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target[:] = source`` for an fp32 host ``source`` and a narrower ``target`` on the
    accelerator: fp32 chunks copied up (asynchronously from page-locked memory), cast there."""
    for lo in range(0, source.numel(), _CAST_CHUNK):
        hi = min(lo + _CAST_CHUNK, source.numel())
        wide = torch.empty(hi - lo, dtype=source.dtype, device=target.device)
        wide.copy_(source[lo:hi], non_blocking=True)
        target[lo:hi].copy_(wide)


def _close_nvme(store: NvmeSwapStore, pool: PinnedBufferPool | None) -> None:
    store.close()
    if pool is not None:
        pool.close()


class NvmeShards(ShardStorage):
    """``offload_param`` "nvme": shards in swap files, the first ``max_in_cpu`` elements in memory."""

    location = "nvme"

    def __init__(
        self,
        groups: Sequence[ShardedParamGroup],
        device: torch.device,
        *,
        offload: OffloadParamConfig,
        aio: AioConfig,
        units: Sequence[UnitPieces],
    ) -> None:
        super().__init__(groups, device)
        dtype = self._dtype()
        cuda = device.type == "cuda"
        self.page_locked = PageLockedHost(bool(offload.pin_memory) and cuda)  # for the resident shards
        self.pinned = self.page_locked.enabled
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.buffer_size = int(offload.buffer_size)
        self.max_in_cpu = int(offload.max_in_cpu)
        # Every sharded parameter's piece once, groups in order and layout order inside each.
        pieces = sorted({p for unit in units for p in unit.pieces}, key=lambda p: (p.group, p.offset))
        self._host_offset: dict[tuple[int, int], int] = {}  # (group, offset) -> offset in shards[group]
        self._keys: dict[tuple[int, int], str] = {}  # (group, offset) -> swap key
        resident = [0] * len(self.groups)
        kept = 0
        for piece in pieces:
            where = (piece.group, piece.offset)
            if not self._keys and kept + piece.numel <= self.max_in_cpu:  # a prefix stays in memory
                self._host_offset[where] = resident[piece.group]
                resident[piece.group] += piece.numel
                kept += piece.numel
            else:
                self._keys[where] = f"g{piece.group}.o{piece.offset}"
        self._disk = [p for p in pieces if (p.group, p.offset) in self._keys]
        self._check_buffer_size(units)
        for numel in resident:
            self.shards.append(self.page_locked.empty(numel, dtype))
        self._resident = [p for p in pieces if (p.group, p.offset) in self._host_offset]
        self.store = NvmeSwapStore(
            offload.nvme_path, aio=aio, buffer_count=offload.buffer_count, tag=f"param{next(_STORE_IDS)}",
            config_key="zero_optimization.offload_param.nvme_path",
        )
        self.dtype = dtype
        self.pool: PinnedBufferPool | None = None  # none when max_in_cpu keeps every shard in memory
        try:
            self.store.allocate({self._keys[(p.group, p.offset)]: (p.numel, dtype) for p in self._disk})
            if self._disk:
                self.pool = PinnedBufferPool(
                    count=offload.buffer_count, numel=self.buffer_size, dtype=dtype, pin=self.pinned,
                    name="offload_param nvme",
                )
        except BaseException:
            self.store.close()
            raise
        # Pool buffers whose host-to-device copy may still run: released once its event fired.
        self._pending: deque[tuple[Any, torch.Tensor]] = deque()
        self._finalizer = weakref.finalize(self, _close_nvme, self.store, self.pool)
        self.refresh()  # the initial values, in memory and on disk

    def _check_buffer_size(self, units: Sequence[UnitPieces]) -> None:
        """A unit's on-disk shards are read into one buffer: every unit must fit."""
        need = {u.name: sum(p.numel for p in u.pieces if (p.group, p.offset) in self._keys) for u in units}
        largest = max(need.values(), default=0)
        if largest <= self.buffer_size:
            return
        name = next(n for n, v in need.items() if v == largest)
        raise ConfigError(
            f"zero_optimization.offload_param.buffer_size={self.buffer_size} elements is too small: the ZeRO-3 unit "
            f"{name} has {largest} elements of parameter shards on this rank that are read from NVMe, and a unit is "
            f"read into one pinned buffer of buffer_size elements. Set offload_param.buffer_size to at least "
            f"{largest}, or raise offload_param.max_in_cpu (now {self.max_in_cpu}) to keep more shards in CPU memory"
        )

    # ---- gathers ---------------------------------------------------------------------------
    def fetch(self, pieces: Sequence[ShardPiece], numel: int) -> torch.Tensor:
        local = torch.empty(numel, dtype=self.dtype, device=self.device)
        batch: list[tuple[ShardPiece, int, int]] = []  # (piece, column in local, offset in the buffer)
        fill = column = 0
        for piece in pieces:
            host = self._host_offset.get((piece.group, piece.offset))
            if host is not None:
                source = self.shards[piece.group][host : host + piece.numel]
                local[column : column + piece.numel].copy_(source, non_blocking=self.pinned)
            else:
                if piece.numel > self.buffer_size:  # the start-up check makes this unreachable for units
                    raise ConfigError(
                        f"zero_optimization.offload_param.buffer_size={self.buffer_size} elements is smaller than one "
                        f"parameter shard of {piece.numel} elements; set buffer_size to at least {piece.numel}"
                    )
                if fill + piece.numel > self.buffer_size:
                    self._read_into(batch, local)
                    batch, fill = [], 0
                batch.append((piece, column, fill))
                fill += piece.numel
            column += piece.numel
        if batch:
            self._read_into(batch, local)
        self._mark_copies()
        return local

    def _read_into(self, batch: list[tuple[ShardPiece, int, int]], local: torch.Tensor) -> None:
        """Read ``batch``'s files into one pool buffer (synchronously), then copy them up."""
        buffer = self._acquire()
        reads: list[cf.Future] = []
        try:
            for piece, _, at in batch:
                reads.append(self.store.read(self._keys[(piece.group, piece.offset)], buffer[at : at + piece.numel]))
            for future in reads:
                future.result()  # NvmeSwapError names the file
            for piece, column, at in batch:
                local[column : column + piece.numel].copy_(buffer[at : at + piece.numel], non_blocking=self.pinned)
        except BaseException:
            cf.wait(reads)
            self.pool.release(buffer)
            raise
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._pending.append((event, buffer))
        else:
            self.pool.release(buffer)  # the copy was synchronous

    def _acquire(self) -> torch.Tensor:
        """A free pool buffer; when all are taken, wait for the oldest pending copy (it always
        finishes: it is queued on a stream, and nothing else holds buffers)."""
        while True:
            while self._pending and self._pending[0][0].query():
                self.pool.release(self._pending.popleft()[1])
            if self.pool.in_use < self.pool.capacity:
                return self.pool.acquire()
            if not self._pending:
                raise RuntimeError("offload_param nvme: every pool buffer is taken and none is pending (internal)")
            event, buffer = self._pending.popleft()
            event.synchronize()
            self.pool.release(buffer)

    def _drain(self) -> None:
        while self._pending:
            event, buffer = self._pending.popleft()
            event.synchronize()
            self.pool.release(buffer)
        self._wait_copies()

    # ---- after a step ----------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self) -> None:
        self._drain()  # no copy may still read what is rewritten here
        for piece in self._resident:
            host = self._host_offset[(piece.group, piece.offset)]
            master = self.groups[piece.group].master[piece.offset : piece.offset + piece.numel]
            self.shards[piece.group][host : host + piece.numel].copy_(master)
        if not self._disk:
            return
        buffer = self._acquire()
        writes: list[cf.Future] = []
        try:
            fill = 0
            for piece in self._disk:
                if fill + piece.numel > self.buffer_size:
                    self._finish(writes)
                    writes, fill = [], 0
                staged = buffer[fill : fill + piece.numel]
                staged.copy_(self.groups[piece.group].master[piece.offset : piece.offset + piece.numel])
                writes.append(self.store.write(self._keys[(piece.group, piece.offset)], staged))
                fill += piece.numel
            self._finish(writes)
        finally:
            cf.wait(writes)
            self.pool.release(buffer)

    @staticmethod
    def _finish(futures: list[cf.Future]) -> None:
        for future in futures:
            future.result()

    # ---- bookkeeping -----------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        block = self.store.block_size
        out = dict.fromkeys(LOCATIONS, 0)
        out["cpu"] = sum(s.numel() * s.element_size() for s in self.shards)
        itemsize = self.dtype.itemsize
        out["nvme"] = sum(-(-p.numel * itemsize // block) * block for p in self._disk)
        return out

    @property
    def pinned_bytes(self) -> int:
        if not self.pinned:
            return 0
        shards = sum(s.numel() * s.element_size() for s in self.shards)
        pool = 0 if self.pool is None else self.pool.total_bytes + self.pool.capacity * BUFFER_ALIGNMENT
        return shards + pool

    @property
    def swap_dir(self) -> str:
        return self.store.swap_dir

    def swap_files(self) -> dict[str, int]:
        """Swap key -> elements of the shard it holds (what the files hold, for tests and tools)."""
        return {self._keys[(p.group, p.offset)]: p.numel for p in self._disk}

    def close(self) -> None:
        self._drain()
        self._finalizer()
        self.page_locked.close()


def build_shard_storage(
    groups: Sequence[ShardedParamGroup],
    device: torch.device,
    *,
    offload: OffloadParamConfig | None,
    aio: AioConfig | None,
    units: Sequence[UnitPieces],
) -> ShardStorage:
    """The storage ``offload_param`` asks for (None or device "none": on the device)."""
    if offload is None or not offload.enabled:
        return DeviceShards(groups, device)
    if offload.device == "cpu":
        return HostShards(groups, device, pin_memory=offload.pin_memory, gather_from_master=offload.gather_from_master)
    return NvmeShards(groups, device, offload=offload, aio=aio or AioConfig(), units=units)
