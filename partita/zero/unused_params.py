"""Parameters no rank produced a gradient for keep their weights and optimizer state.

torch's optimizers skip a parameter whose ``grad`` is None. A flat master partition has no such
per-parameter switch: the step would apply weight decay and moment decay to it. So every step
saves the master and state ranges of the unused parameters before the update and puts them
back after it (or, for a step that writes back range by range, before each range goes up).
"""

from __future__ import annotations

import torch

from partita.zero.shard_group import ShardedParamGroup

__all__ = ["restore_unused", "save_unused"]

# Optimizer-state keys of block-wise (8-bit) optimizers; see partita/optim/eight_bit.py.
_BLOCK_WISE_KEYS = ("state1", "state2")


def _state_views(inner: torch.optim.Optimizer, group: ShardedParamGroup, lo: int, hi: int) -> list[torch.Tensor]:
    """Views of the master partition and of every optimizer-state tensor covering partition
    elements ``[lo, hi)`` (one parameter's shard)."""
    state = inner.state.get(group.master, {})
    if any(key in state for key in _BLOCK_WISE_KEYS):
        # 8-bit states: per-element codes plus per-block scales (layout is block-aligned).
        from partita.optim.eight_bit import range_views

        return [group.master[lo:hi]] + range_views(state, lo, hi)
    shaped = [t for t in state.values() if torch.is_tensor(t) and t.shape == group.master.shape]
    return [t[lo:hi] for t in [group.master] + shaped]


def save_unused(groups: list[ShardedParamGroup], inner: torch.optim.Optimizer, used: list[list[bool]]) -> list[list]:
    """Copies of the weights and states of parameters no rank produced a gradient for:
    entries ``[group index, partition start, partition end, view, saved copy]``."""
    kept = []
    for g, (group, group_used) in enumerate(zip(groups, used)):
        for spec, was_used in zip(group.layout.specs, group_used):
            if not was_used:
                lo, hi = spec.partition_offset, spec.partition_offset + spec.shard_numel
                kept.extend([g, lo, hi, view, view.clone()] for view in _state_views(inner, group, lo, hi))
    return kept


@torch.no_grad()
def restore_unused(kept: list[list], *, group: int | None = None, start: int = 0, end: int | None = None) -> None:
    """Put the saved copies back (only group ``group``'s entries lying within partition
    elements ``[start, end)``, if given); each entry is restored once."""
    for entry in kept:
        g, lo, hi, view, saved = entry
        if saved is None or (group is not None and (g != group or lo < start or hi > end)):
            continue
        view.copy_(saved)
        entry[4] = None
