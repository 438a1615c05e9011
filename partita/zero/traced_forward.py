"""The training forward of ZeRO-3's gatherer: each unit's start and end, on the first step's trace.

A mixin of :class:`partita.zero.param_gatherer.ParameterGatherer` (its state and its
gather/release are the gatherer's): what a unit's forward start and end do inside a training
forward, on the trace of the first step (gather, prefetch, keep for reuse or free, see
param_gatherer.py [Note: reuse]) or, off the trace, on demand after a rank-agreement check
(unit_sync.py [Note: rank divergence]).
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from partita.zero.gather_state import ParamState
from partita.zero.unit_sync import DEVIATED, END, GATHER
from partita.zero.unit_trace import Phase, TraceState

__all__ = ["TracedForward"]


class TracedForward:
    """The training-forward half of the gatherer's hooks (see the module docstring)."""
    def _begin_forward(self) -> None:
        self._in_forward = True
        self._event_pos = 0
        self._open = []
        self.trace.begin_forward()

    def _forward_event(self, unit: nn.Module, *, end: bool) -> None:
        """A unit's forward starts or ends inside a training forward."""
        if end:
            self._open.pop()  # hooks nest: the unit ending is the innermost one open
        else:
            self._open.append(unit)
        trace = self.trace
        if trace.state is TraceState.READY:
            index = self._event_pos
            expected = trace.expected_event(index)
            if expected is not None and expected.matches(end, unit):
                self._event_pos = index + 1
                self._traced_event(index)
                return
            self._left_trace(index, unit, end)  # raises, or disables the trace on every rank
        elif trace.state is TraceState.RECORDING:
            trace.record_forward(end, unit)
        # On demand: the first step, or after the unit order changed.
        if not end:
            self._gather_checked(unit, Phase.FORWARD)
        elif unit is self._root:
            self._end_forward(END, 0)
        else:
            self.release_unit(unit)

    def _traced_event(self, index: int) -> None:
        """What every rank on the trace does at forward event ``index`` (also replayed)."""
        trace = self.trace
        end, unit = trace.forward_events[index]
        if not end:
            self.gather_unit(unit)
            self._prefetch(trace.upcoming_after_event(index))
        elif unit is self._root:
            self._end_forward(END, len(trace.forward_events))
        else:
            self._end_unit(unit, index)

    def _end_unit(self, unit: nn.Module, index: int) -> None:
        """Keep the unit whole if the trace reuses it soon (see [Note: reuse]), else free it."""
        distance = self.trace.reuse_distance[index]
        local = self._world_size == 1 and self.storage.location == "accelerator"
        if (
            distance is not None
            and not (local and self.trace.reused_in_backward[index])  # see [Note: reuse]
            and distance < self._max_reuse_distance
            and self._live_numel + distance <= self._max_live_numel
        ):
            self.kept_count += 1
            return
        self.release_unit(unit)

    def _end_forward(self, kind: int, *row: int) -> None:
        self._in_forward = False
        self.trace.begin_backward()
        if self._sync is not None:
            self._sync.exchange(kind, *row)

    def _left_trace(self, index: int, unit: nn.Module, end: bool) -> None:
        """This rank's forward differs from the trace at event ``index`` (see [Note: rank
        divergence]): issue the collectives the ranks on the trace issue until their forward
        ends, compare at the end-of-forward check, then raise or go on on demand."""
        trace = self.trace
        events = trace.forward_events
        for replayed in range(index, len(events) - 1):  # the last event is the root's end: the check
            self._traced_event(replayed)
        expected = trace.expected_event(index)
        code = 2 * self._unit_index[unit] + end
        expected_code = -1 if expected is None else 2 * self._unit_index[expected.unit] + expected.end
        if self._sync is not None:
            self._sync.exchange(DEVIATED, index, code, expected_code)  # raises unless every rank did this
        trace.disable(
            f"the forward pass ran units in a different order than the first training step (at unit event "
            f"{index}); ZeRO-3 prefetching and reuse are off from now on and parameters are gathered on demand, "
            "each gather preceded by a small rank-agreement check (correct, but slower)"
        )
        # The replay freed units whose forward is still running here: make them whole again.
        for running in self._open:
            if running is not self._root and running is not unit:
                self._gather_checked(running, Phase.FORWARD)

    def _gather_checked(self, unit: nn.Module, phase: Phase) -> None:
        """Gather a unit on demand; off the trace, first check that every rank gathers the
        same unit now (one small all-gather), so a divergence raises instead of hanging."""
        params = self._unit_params[unit]
        if (
            self._sync is not None
            and self.trace.state is not TraceState.READY
            and any(self._state[p] is ParamState.SHARDED for p in params)
        ):
            self._sync.exchange(GATHER, self._unit_index[unit], int(phase is Phase.BACKWARD))
        self.gather(params, quantize=True)

    def _prefetch(self, upcoming: Sequence[nn.Module]) -> None:
        """Start all-gathers for the next units, up to ``prefetch_numel`` elements ahead and
        never past ``max_live_numel`` elements held whole or in flight."""
        if self._world_size == 1 and self.storage.location == "accelerator":
            return  # nothing to overlap: a gather is a local copy (offloaded: a host-to-device copy)
        live = self._live_numel
        ahead = 0
        for unit in upcoming:
            if ahead >= self.prefetch_numel:
                break
            todo = [p for p in self._unit_params[unit] if self._state[p] is ParamState.SHARDED]
            need = sum(self._numel[p] for p in todo)
            if live + need > self._max_live_numel:
                break
            if todo:
                self._start_gathers(todo, quantize=True)
                self.prefetch_count += 1
            live += need
            ahead += need
