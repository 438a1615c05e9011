"""The estimator's answer: per-rank byte counts, one line per kind of tensor, and their peak.

Each :class:`Line` says where its tensors live (accelerator, CPU memory, NVMe) and in which
*phases* of a training step they exist, because not everything is alive at once:
activations are all alive at the start of backward and freed block by block while
gradients are reduced; the fp32 gradient partition exists from its first reduced bucket
(world size 1: the end of backward) through the optimizer step; the buffers that all-gather
the updated weights exist only after the step, when the gradient partition is freed. The peak
is the largest phase total; summing every line would overstate it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from partita.estimate.inputs import Setup
# The vocabulary (categories, devices, phases) lives below both this module and the report that
# formats it; re-exported here, its historical path.
from partita.estimate.phases import (ALWAYS, BACKWARD, CATEGORIES, DEVICES, END_BACKWARD, PHASES, START_BACKWARD,
                                     STEP, WRITE_BACK)
from partita.estimate.report import format_estimate

__all__ = [
    "ALWAYS", "BACKWARD", "CATEGORIES", "DEVICES", "END_BACKWARD", "PHASES", "START_BACKWARD", "STEP", "WRITE_BACK",
    "Line", "MemoryEstimate",
]

@dataclass(frozen=True)
class Line:
    """``nbytes`` of one kind of tensor on one device, per rank.

    ``exact``: derived from partita's layouts byte for byte (model states); False for
    estimates (activations, transient buffers). ``kind`` tags the lines whose amount changes
    during backward (see :mod:`partita.estimate.timeline`); "" for the others.
    """

    category: str
    item: str
    device: str
    nbytes: int
    phases: frozenset[str] = ALWAYS
    note: str = ""
    exact: bool = True
    kind: str = ""

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES or self.device not in DEVICES or not self.phases <= ALWAYS:
            raise ValueError(f"bad estimate line {self!r}")  # internal: every caller is in this package
        if self.nbytes < 0:
            raise ValueError(f"negative byte count in estimate line {self!r}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank memory of one training setup.

    Attributes:
        model: one-line description of the model.
        setup: the setup estimated.
        lines: every byte count, by category, item and device.
        activations_known: False when the model has no shape and no ``activation_bytes``
            was given: activations are then left out of every total (the table says so).
        notes: assumptions worth reading next to the numbers.
        backward_walk: accelerator bytes at the worst point of backward, from
            :mod:`partita.estimate.timeline` (None: the lines' sum is used).
    """

    model: str
    setup: Setup
    lines: tuple[Line, ...]
    activations_known: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)
    backward_walk: int | None = None
    reserved: Any = None  # partita.estimate.allocator.ReservedEstimate (None: not predicted)

    def total(self, device: str = "accelerator", *, category: str | None = None, phase: str | None = None) -> int:
        """Bytes on ``device``, optionally of one category and/or alive in one phase.

        The accelerator total during backward of a model with a known shape comes from the
        block-by-block walk (``backward_walk``), not from the lines: their amounts shrink
        and grow within that phase.
        """
        if self.backward_walk is not None and device == "accelerator" and phase == BACKWARD and category is None:
            return self.backward_walk
        return sum(
            line.nbytes
            for line in self.lines
            if line.device == device
            and (category is None or line.category == category)
            and (phase is None or phase in line.phases)
        )

    def by_category(self, device: str = "accelerator") -> dict[str, int]:
        """Bytes per category on ``device`` (each line counted whatever its phase)."""
        return {c: self.total(device, category=c) for c in CATEGORIES}

    def peak(self, device: str = "accelerator") -> tuple[int, str]:
        """The largest total over the phases of a step, and that phase."""
        return max(((self.total(device, phase=p), p) for p in PHASES), key=lambda bp: bp[0])

    @property
    def peak_accelerator(self) -> int:
        return self.peak("accelerator")[0]

    @property
    def peak_cpu(self) -> int:
        return self.peak("cpu")[0]

    @property
    def reserved_accelerator(self) -> int:
        """Predicted ``torch.cuda.max_memory_reserved``: the peak with the caching allocator's rounding
        and fragmentation (partita/estimate/allocator.py); what a fit decision compares with memory."""
        return self.peak_accelerator if self.reserved is None else self.reserved.reserved

    @property
    def nvme(self) -> int:
        return self.total("nvme")

    def model_states(self, device: str = "accelerator") -> int:
        """Parameters, gradients and optimizer states: the part that matches partita exactly."""
        return sum(self.total(device, category=c) for c in ("parameters", "gradients", "optimizer states"))

    def table(self) -> str:
        return format_estimate(self)

    def to_dict(self) -> dict[str, Any]:
        setup = dataclasses.asdict(self.setup)
        setup["checkpointing"] = str(self.setup.checkpointing)
        peak, phase = self.peak("accelerator")
        cpu_peak, cpu_phase = self.peak("cpu")
        return {
            "model": self.model,
            "setup": setup,
            "lines": [
                {**dataclasses.asdict(line), "phases": sorted(line.phases)} for line in self.lines
            ],
            "by_category": {d: self.by_category(d) for d in DEVICES},
            "peak_accelerator_bytes": peak,
            "peak_accelerator_phase": phase,
            "peak_cpu_bytes": cpu_peak,
            "peak_cpu_phase": cpu_phase,
            "nvme_bytes": self.nvme,
            "reserved_accelerator_bytes": self.reserved_accelerator,
            "reserved_accelerator": None if self.reserved is None else self.reserved.to_dict(),
            "activations_known": self.activations_known,
            "phase_totals_accelerator": {p: self.total("accelerator", phase=p) for p in PHASES},
            "notes": list(self.notes),
        }
