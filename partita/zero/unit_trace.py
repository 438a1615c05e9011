"""The order ZeRO-3 units run in, recorded on the first training step, used to prefetch.

The first forward and backward of training record which units run, in order. Every rank
then checks that all ranks recorded the same order (one small all-reduce); from the next
step on, while unit ``k`` runs, the gatherer already fetches the units the trace says come
next. If a later step runs units in another order (data-dependent control flow, a
different eval path), prefetching stops with a one-time warning and units are fetched on
demand: correct, only slower. (As with DeepSpeed's ZeRO-3, every rank must still run the
same units in the same order within a step, since each gather is a collective.)
"""

from __future__ import annotations

import enum
import logging
from typing import Callable, Sequence

from torch import nn

logger = logging.getLogger("partita")


class TraceState(enum.Enum):
    RECORDING = "recording"
    READY = "ready"
    DISABLED = "disabled"


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class UnitTrace:
    def __init__(self) -> None:
        self.state = TraceState.RECORDING
        self.sequences: dict[Phase, list[nn.Module]] = {Phase.FORWARD: [], Phase.BACKWARD: []}
        self._phase: Phase | None = None
        self._position = 0

    def begin_forward(self) -> None:
        """A training forward starts (the root unit's pre-forward)."""
        self._phase, self._position = Phase.FORWARD, 0

    def observe(self, unit: nn.Module, phase: Phase) -> int | None:
        """Note that ``unit`` runs now; return where the trace continues, or None if no
        prefetch should happen (recording, disabled, or the order just changed)."""
        if phase is not self._phase:
            self._phase, self._position = phase, 0
        sequence = self.sequences[phase]
        if self.state is TraceState.RECORDING:
            sequence.append(unit)
            return None
        if self.state is TraceState.DISABLED:
            return None
        if self._position < len(sequence) and sequence[self._position] is unit:
            self._position += 1
            return self._position
        self.disable(
            f"the {phase.value} pass ran units in a different order than the first training step "
            f"(at position {self._position}); ZeRO-3 prefetching is off from now on and parameters "
            "are gathered on demand (correct, but communication is no longer overlapped)"
        )
        return None

    def upcoming(self, phase: Phase, start: int) -> Sequence[nn.Module]:
        return self.sequences[phase][start:]

    def finish_recording(self, ranks_agree: Callable[[list[int]], bool], unit_index: dict[nn.Module, int]) -> None:
        """End of the first training step: keep the trace if every rank saw the same order."""
        if self.state is not TraceState.RECORDING:
            return
        encoded = [unit_index[u] for u in self.sequences[Phase.FORWARD]] + [-1]
        encoded += [unit_index[u] for u in self.sequences[Phase.BACKWARD]]
        if ranks_agree(encoded):
            self.state = TraceState.READY
        else:
            self.disable("ranks ran ZeRO-3 units in different orders in the first step; prefetching is off")

    def disable(self, reason: str) -> None:
        if self.state is not TraceState.DISABLED:
            logger.warning("partita: %s", reason)
        self.state = TraceState.DISABLED
