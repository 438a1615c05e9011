"""The pieces one NVMe-swapped optimizer step works on (partita/offload/nvme_optimizer.py): the
sub-group ranges of a master partition, the buffers holding one range's states while it is read,
stepped and written, and the probe that finds which states an optimizer keeps per element."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Range", "Slot", "StateSpec", "cut", "probe_state"]


@dataclass(frozen=True)
class StateSpec:
    """The state one group's optimizer keeps per parameter, found by a probe step."""

    order: tuple[str, ...]  # every state key, in the order torch creates them
    swapped: dict[str, torch.dtype]  # keys shaped like the parameter -> dtype (these go to disk)


@dataclass
class Range:
    """One sub-group: elements ``[lo, hi)`` of group ``group``'s master partition."""

    group: int
    index: int
    lo: int
    hi: int
    view: torch.Tensor  # master[lo:hi]: the proxy's parameter
    proxy: torch.optim.Optimizer
    swap_keys: dict[str, str]  # state key -> swap-file key

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass
class Slot:
    """The pool buffers holding one range's states while it is read, stepped and written."""

    unit: Range
    buffers: list[torch.Tensor]  # pool buffers to release
    tensors: dict[str, torch.Tensor]  # state key -> a view of one buffer, ``unit.numel`` elements
    reads: list[cf.Future] = field(default_factory=list)
    writes: list[cf.Future] = field(default_factory=list)
    read_bytes: int = 0  # state bytes its reads bring in (0 before a group's first step)


def probe_state(cls: type[torch.optim.Optimizer], options: dict[str, Any]) -> StateSpec:
    """Step ``cls`` once on a 2-element tensor with ``options`` and see which state it keeps.

    Two elements, so a per-parameter tensor (shape ``(2,)``) is told apart from scalars
    (``step`` has shape ``()``). The keys depend on the options (``amsgrad``, SGD ``momentum``).
    """
    probe = torch.zeros(2, dtype=torch.float32)
    probe.grad = torch.zeros_like(probe)
    optimizer = cls([{**options, "params": [probe]}])
    optimizer.step()
    state = optimizer.state[probe]
    swapped = {k: v.dtype for k, v in state.items() if torch.is_tensor(v) and v.shape == probe.shape}
    return StateSpec(order=tuple(state), swapped=swapped)


def cut(numel: int, sub_group_size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + sub_group_size, numel)) for lo in range(0, numel, sub_group_size)]
