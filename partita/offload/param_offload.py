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

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from partita.offload.config import AioConfig, OffloadParamConfig
from partita.offload.nvme_shards import NvmeShards
from partita.offload.page_locked import PageLockedHost
from partita.offload.shard_storage import (LOCATIONS, ShardPiece, ShardStorage, UnitPieces, copy_into_host,
                                           merged_runs)

if TYPE_CHECKING:
    from partita.zero.shard_group import ShardedParamGroup

__all__ = ["DeviceShards", "HostShards", "NvmeShards", "ShardPiece", "ShardStorage", "UnitPieces", "build_shard_storage"]

_CAST_CHUNK = 1 << 24  # fp32 elements per device temporary of a gather from a host master (64 MiB)


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
        for run in merged_runs(pieces):
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
            copy_into_host(host, group.master)
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
        for run in merged_runs(pieces):
            source = self.shards[run.group][run.offset : run.offset + run.numel]
            target = local[column : column + run.numel]
            if source.dtype != target.dtype and self.device.type == "cuda":
                _copy_up_then_cast(target, source)  # the fp32 master: cast on the accelerator
            else:
                target.copy_(source, non_blocking=self.stream is not None)
            column += run.numel
        self._mark_copies()
        return local

    def wait_reads(self) -> None:
        if any(s is g.master for s, g in zip(self.shards, self.groups)):  # never with a delayed update
            self._wait_copies()

    @torch.no_grad()
    def refresh(self) -> None:
        self._wait_copies()  # a copy still reading the old values must finish first
        for host, group in zip(self.shards, self.groups):
            if host is not group.master:  # gathers read the master itself
                copy_into_host(host, group.master)


def _copy_up_then_cast(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target[:] = source`` for an fp32 host ``source`` and a narrower ``target`` on the
    accelerator: fp32 chunks copied up (asynchronously from page-locked memory), cast there."""
    for lo in range(0, source.numel(), _CAST_CHUNK):
        hi = min(lo + _CAST_CHUNK, source.numel())
        wide = torch.empty(hi - lo, dtype=source.dtype, device=target.device)
        wide.copy_(source[lo:hi], non_blocking=True)
        target[lo:hi].copy_(wide)


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
