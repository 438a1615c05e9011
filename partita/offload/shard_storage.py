"""The interface between ZeRO-3's gatherer and where parameter shards live between uses.

:class:`ShardStorage` is what ``partita/zero/param_gatherer.py`` calls; the storages themselves
are in ``partita/offload/param_offload.py`` (device, host memory) and
``partita/offload/nvme_shards.py`` (swap files), which the module docstring of the former
describes.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from partita.zero.shard_group import ShardedParamGroup

# Elements per device->host copy when a device master is cast into host shards: bounds the
# low-precision temporary the cast makes on the device.
_HOST_COPY_CHUNK = 1 << 24

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
        """Before the optimizer rewrites the masters: no gather's copy may still read one. A
        no-op for storages that never read a master (HostShards with ``gather_from_master``
        overrides it). It must stay one: a delayed update calls it on its background thread
        while the next forward's gathers record their copies."""

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


def copy_into_host(host: torch.Tensor, master: torch.Tensor) -> None:
    """``host[:] = master`` cast to ``host``'s dtype: on the host for a host master (no device
    round trip), in bounded chunks from a device master."""
    if master.device.type == "cpu":
        host.copy_(master)
        return
    for lo in range(0, master.numel(), _HOST_COPY_CHUNK):
        hi = min(lo + _HOST_COPY_CHUNK, master.numel())
        host[lo:hi].copy_(master[lo:hi])


def merged_runs(pieces: Sequence[ShardPiece]) -> Iterator[ShardPiece]:
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


