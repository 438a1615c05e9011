"""What one NVMe-swapped optimizer step did: its traffic and where its time went.

:class:`~partita.offload.nvme_optimizer.SwappedOptimizerStates` fills one :class:`SwapStepStats`
per step (``swapper.last_step``) and adds it to a running total (``swapper.totals``). The bytes
are the state bytes the step itself read and wrote, counted by the swapper from its layout, so a
step's volume is exact even when some of its reads were started before it (the prefetch at the
end of the previous step). The timing splits the step's wall time into stepping the ranges,
waiting for reads, waiting for writes, and the rest (bookkeeping); ``io`` is the swap store's
counters over the step (:class:`~partita.offload.nvme_io.IoCounters`), whose ``busy_s`` is the
time the disk had a request of the step in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from partita.offload.nvme_io import IoCounters

_GIB = float(2**30)


@dataclass
class SwapStepStats:
    seconds: float = 0.0  # wall time of the swapped part of the optimizer step
    compute_s: float = 0.0  # the optimizer's arithmetic on the ranges
    read_wait_s: float = 0.0  # waiting for a range's states to arrive
    write_wait_s: float = 0.0  # waiting for writes to land (to free buffers, or at the end)
    bytes_read: int = 0  # state bytes read for this step (prefetched reads included)
    bytes_written: int = 0
    ranges: int = 0  # sub-groups stepped
    prefetched: int = 0  # of which the reads were started before the step began
    deferred: int = 0  # ranges whose writes were still in flight when the step returned
    steps: int = 1  # steps summed into this record (totals)
    io: IoCounters = field(default_factory=IoCounters)

    def add(self, other: SwapStepStats) -> None:
        for f in fields(self):
            if f.name == "io":
                self.io = IoCounters(**{k: getattr(self.io, k) + getattr(other.io, k) for k in self.io.as_dict()})
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def minus(self, other: SwapStepStats) -> SwapStepStats:
        out = SwapStepStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self) if f.name != "io"})
        out.io = self.io - other.io
        return out

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "io"}
        out.update({f"io_{k}": v for k, v in self.io.as_dict().items()})
        return out

    def log_metrics(self) -> dict[str, float]:
        """Per-step means for the step log (``nvme_*`` keys), over ``steps`` steps."""
        n = max(self.steps, 1)
        return {
            "nvme_read_gib": self.bytes_read / _GIB / n,
            "nvme_write_gib": self.bytes_written / _GIB / n,
            "nvme_swap_s": self.seconds / n,
            "nvme_busy_s": self.io.busy_s / n,
        }
