"""The order ZeRO-3 units run in, recorded on the first training step.

The trace serves three purposes once every rank has recorded the same one:
- prefetch: while unit ``k`` runs, the gatherer already fetches the units that come next;
- reuse (``stage3_max_reuse_distance``): a unit whose forward ends is kept whole if the
  trace says it runs again soon (a block called twice, the last blocks of the forward whose
  backward comes right after), instead of being freed and gathered again;
- divergence detection: a rank whose training forward leaves the trace knows exactly which
  collectives the ranks still on the trace will issue, so it can issue them too and meet
  the others at the end of the forward (see ``unit_sync`` [Note: rank divergence]).

[Note: events]
The first training forward is recorded as *events*: each unit's forward start and end, in
order (with nested units, a start may follow a start). Ends matter because a unit is freed
or kept at its end, which changes what the next prefetch may fetch. The first backward is
recorded as the units whose gradients arrive, in order, including units recomputed under
activation checkpointing. Every rank then checks that all ranks recorded the same trace
(one small all-reduce). If a later step runs units in another order on every rank (data-
dependent control flow), prefetching and reuse stop with a one-time warning and units are
fetched on demand: correct, only slower.
"""

from __future__ import annotations

import enum
import logging
from typing import Callable, NamedTuple, Sequence

from torch import nn

logger = logging.getLogger("partita")


class TraceState(enum.Enum):
    RECORDING = "recording"
    READY = "ready"
    DISABLED = "disabled"


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class Event(NamedTuple):
    """A unit's forward starts (``end=False``) or ends (``end=True``)."""

    end: bool
    unit: nn.Module

    def matches(self, end: bool, unit: nn.Module) -> bool:
        return self.end is end and self.unit is unit  # identity: modules do not define ==


class UnitTrace:
    def __init__(self) -> None:
        self.state = TraceState.RECORDING
        self.forward_events: list[Event] = []
        # Units in the order they start: forward (from the events) and backward.
        self.sequences: dict[Phase, list[nn.Module]] = {Phase.FORWARD: [], Phase.BACKWARD: []}
        # Per forward event: for an end, the elements other units gather before this unit is
        # needed again in the same micro-step (None: never); see finish_recording.
        self.reuse_distance: list[int | None] = []
        # Per forward event: True when that next use is in the backward (after the forward's end).
        self.reused_in_backward: list[bool] = []
        self._starts_through: list[int] = []  # per forward event: unit starts up to and including it
        self._backward_position = 0

    # ------------------------------------------------------------------ recording
    def begin_forward(self) -> None:
        """A training forward starts. While recording, only the latest forward and the
        backward after it are kept (a forward without backward does not count)."""
        if self.state is TraceState.RECORDING:
            self.forward_events.clear()
            for sequence in self.sequences.values():
                sequence.clear()

    def record_forward(self, end: bool, unit: nn.Module) -> None:
        self.forward_events.append(Event(end, unit))
        if not end:
            self.sequences[Phase.FORWARD].append(unit)

    def begin_backward(self) -> None:
        self._backward_position = 0

    def observe_backward(self, unit: nn.Module) -> int | None:
        """Note that ``unit``'s backward (or recomputation) starts now; return where the
        backward trace continues, or None if no prefetch should happen."""
        sequence = self.sequences[Phase.BACKWARD]
        if self.state is TraceState.RECORDING:
            sequence.append(unit)
            return None
        if self.state is TraceState.DISABLED:
            return None
        if self._backward_position < len(sequence) and sequence[self._backward_position] is unit:
            self._backward_position += 1
            return self._backward_position
        self.disable(
            f"the backward pass ran units in a different order than the first training step (at position "
            f"{self._backward_position}); ZeRO-3 prefetching and reuse are off from now on and parameters are "
            "gathered on demand (correct, but communication is no longer overlapped)"
        )
        return None

    # ------------------------------------------------------------------ queries
    def upcoming(self, phase: Phase, start: int) -> Sequence[nn.Module]:
        return self.sequences[phase][start:]

    def upcoming_after_event(self, index: int) -> Sequence[nn.Module]:
        """Units that start after forward event ``index``, in order."""
        return self.sequences[Phase.FORWARD][self._starts_through[index] :]

    def expected_event(self, index: int) -> Event | None:
        return self.forward_events[index] if index < len(self.forward_events) else None

    # ------------------------------------------------------------------ settle
    def finish_recording(
        self,
        ranks_agree: Callable[[list[int]], bool],
        unit_index: dict[nn.Module, int],
        unit_numel: Callable[[nn.Module], int],
        root: nn.Module,
    ) -> None:
        """End of the first training step: keep the trace if every rank saw the same order."""
        if self.state is not TraceState.RECORDING:
            return
        encoded = [2 * unit_index[e.unit] + e.end for e in self.forward_events] + [-1]
        encoded += [unit_index[u] for u in self.sequences[Phase.BACKWARD]]
        if not ranks_agree(encoded):
            self.disable("ranks ran ZeRO-3 units in different orders in the first step; prefetching is off")
            return
        starts = 0
        for event in self.forward_events:
            starts += not event.end
            self._starts_through.append(starts)
        self.reuse_distance, self.reused_in_backward = _reuse_distances(
            self.forward_events, self.sequences[Phase.BACKWARD], unit_numel, root)
        self.state = TraceState.READY

    def disable(self, reason: str) -> None:
        if self.state is not TraceState.DISABLED:
            logger.warning("partita: %s", reason)
        self.state = TraceState.DISABLED


def _reuse_distances(
    events: list[Event], backward: list[nn.Module], unit_numel: Callable[[nn.Module], int], root: nn.Module
) -> tuple[list[int | None], list[bool]]:
    """For each forward end event: how many elements of *other* units must be gathered
    before this unit runs again (its next forward start, else its backward), or None if it
    does not run again in this micro-step, and whether that next use is in the backward. Each
    unit in between counts once (a unit already whole is not gathered twice) and the root never
    counts (it stays whole through forward and backward). Quadratic in the number of events,
    computed once."""
    distances: list[int | None] = [None] * len(events)
    in_backward = [False] * len(events)
    for index, event in enumerate(events):
        if not event.end or event.unit is root:
            continue
        unit = event.unit
        between: dict[int, nn.Module] = {}
        found = False
        later_starts = [e.unit for e in events[index + 1 :] if not e.end]
        for position, other in enumerate((*later_starts, *backward)):
            if other is unit:
                found = True
                in_backward[index] = position >= len(later_starts)
                break
            between[id(other)] = other
        if found:
            distances[index] = sum(unit_numel(u) for u in between.values() if u is not root)
    return distances, in_backward
