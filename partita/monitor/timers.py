"""Phase timers for ``wall_clock_breakdown``: forward, backward, gradient reduction, step.

On a GPU each phase is bracketed by two CUDA events on the current stream and read only
when the step log prints (where the device is synchronised anyway), so timing costs no
synchronisation and does not break the overlap of communication with compute. On a CPU
the work is synchronous and ``time.perf_counter`` measures it directly.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch


class PhaseTimers:
    """Accumulates the time of named phases between two :meth:`take` calls."""

    def __init__(self, *, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self._cuda = device.type == "cuda"
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (nested phases are timed independently)."""
        if not self.enabled:
            yield
            return
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events[name].append((start, end))
            return
        begin = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - begin

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last call, and reset. Waits for recorded GPU events."""
        totals = dict(self._seconds)
        for name, pairs in self._events.items():
            if pairs:
                pairs[-1][1].synchronize()  # events of one stream complete in order
            totals[name] = totals.get(name, 0.0) + sum(start.elapsed_time(end) for start, end in pairs) / 1000.0
        self._seconds.clear()
        self._events.clear()
        return totals
