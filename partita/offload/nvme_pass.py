"""One NVMe-swapped optimizer step, range by range (:meth:`SwappedOptimizerStates.begin_step
<partita.offload.nvme_optimizer.SwappedOptimizerStates.begin_step>`).

A step object rather than one loop, so that a caller can do other work between two ranges: the
overlapped step (``offload_optimizer.overlap_step_with_forward``, partita/offload/tiered_overlap.py)
steps host-memory buckets and writes weights back while this step's next reads and last writes
are on the disk.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from partita.offload.nvme_ranges import Range, Slot
from partita.offload.swap_stats import SwapStepStats

if TYPE_CHECKING:
    from partita.offload.nvme_optimizer import SwappedOptimizerStates

__all__ = ["SwapPass"]


class SwapPass:
    """One step's walk over the swapped ranges (:meth:`SwappedOptimizerStates.begin_step`).

    Each :meth:`advance` steps one range: its states read (with ``pipeline_read`` the next range's
    reads are started first, so they run while this one steps and while the caller does other
    work between two calls), stepped, and their writes started (``pipeline_write``: left in
    flight until buffers are needed). :meth:`end` records the step and leaves the last writes and
    the next step's read-ahead to the swapper's tail thread. On an error every buffer is waited
    for and given back (:meth:`abort`)."""

    def __init__(self, swapper: SwappedOptimizerStates, inner: torch.optim.Optimizer, units: list[Range],
                 used: list[list[bool]], options: list[dict[str, Any]] | None) -> None:
        self._swapper, self._inner, self.units, self._used, self._options = swapper, inner, units, used, options
        self._started, self._io_before = time.perf_counter(), swapper.store.io_counters()
        self.stats = SwapStepStats()
        self._behind: deque[Slot] = deque()  # stepped ranges whose writes may still be in flight
        self._ready = swapper._take_prefetched(units)  # opened slots of units[i], units[i+1], ... (reads started)
        self.stats.prefetched = len(self._ready)
        self._next = 0

    def advance(self) -> Range | None:
        """Step the next range and return it; None once every range is stepped."""
        swapper, stats, i = self._swapper, self.stats, self._next
        if i == len(self.units):
            return None
        unit, current = self.units[i], None
        try:
            current = self._ready.popleft() if self._ready else swapper._open_slot(unit, self._behind, stats)
            if swapper.pipeline_read and i + 1 < len(self.units) and not self._ready:
                # Its reads overlap this range's step.
                self._ready.append(swapper._open_slot(self.units[i + 1], self._behind, stats))
            t0 = time.perf_counter()
            swapper._finish(current.reads)
            t1 = time.perf_counter()
            swapper._step_range(self._inner, current, self._used, self._options)
            stats.read_wait_s += t1 - t0
            stats.compute_s += time.perf_counter() - t1
            stats.bytes_read += current.read_bytes
            stats.ranges += 1
            for state_key, key in unit.swap_keys.items():
                current.writes.append(swapper.store.write(key, current.tensors[state_key]))
                stats.bytes_written += current.tensors[state_key].nbytes
            slot, current = current, None
            if swapper.pipeline_write:
                self._behind.append(slot)  # written while the next range steps
            else:
                swapper._retire(slot, stats)
        except BaseException:
            if current is not None:
                self._ready.appendleft(current)  # abort() waits for it and gives its buffers back
            self.abort()
            raise
        self._next = i + 1
        return unit

    def next_ready(self) -> bool:
        """Whether the next :meth:`advance` would not wait for the disk: its range's reads
        (started ahead) have landed, or none were started ahead (it reads them itself)."""
        if self._next == len(self.units) or not self._ready:
            return True
        return all(future.done() for future in self._ready[0].reads)

    def end(self) -> None:
        """After the last :meth:`advance`: count the step, hand its last writes (and then the next
        step's first reads) to the tail thread."""
        swapper, stats = self._swapper, self.stats
        swapper._clear_grads()
        for g in {u.group for u in self.units}:
            swapper._initialised[g] = True
        stats.deferred = len(self._behind)
        stats.seconds = time.perf_counter() - self._started
        stats.io = swapper.store.io_counters() - self._io_before
        swapper.last_step = stats
        swapper.totals.add(stats)
        if self._behind:
            # The last ranges' writes land, and then the next step's first ranges are read, on a
            # helper thread while the caller uploads the weights and runs the next forward/backward.
            swapper._tail_future = swapper._tail.submit(swapper._finish_tail, self._behind, self.units)
        else:
            swapper._prefetch(self.units)

    def abort(self) -> None:
        """Wait for every operation still using a buffer of this step, give the buffers back and
        drop the gradients (the step failed; its error is raised by the caller)."""
        slots = list(self._ready) + list(self._behind)
        self._ready, self._behind = deque(), deque()
        for slot in slots:
            cf.wait(slot.reads + slot.writes)
            self._swapper._release(slot)
        self._swapper._clear_grads()
