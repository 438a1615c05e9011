"""``offload_param`` "nvme": ZeRO-3 parameter shards in swap files (see partita/offload/param_offload.py)."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from partita.config.base import ConfigError
from partita.offload.buffer_pool import BUFFER_ALIGNMENT, PinnedBufferPool
from partita.offload.config import AioConfig, OffloadParamConfig
from partita.offload.finalizers import Closer
from partita.offload.nvme import NvmeSwapStore
from partita.offload.page_locked import PageLockedHost
from partita.offload.shard_storage import LOCATIONS, ShardPiece, ShardStorage, UnitPieces

if TYPE_CHECKING:
    from partita.zero.shard_group import ShardedParamGroup

_STORE_IDS = itertools.count()  # one swap directory per gatherer in a process (tags must differ)


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
        # Collected on another thread: closed on a thread of its own (partita/offload/finalizers.py).
        self._finalizer = Closer(self, _close_nvme, self.store, self.pool)
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


