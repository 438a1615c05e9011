"""The update the overlap worker runs (``offload_optimizer.overlap_step_with_forward``), for
every offloaded layout: host memory (``device "cpu"``), NVMe (``"nvme"``) and the tiered split
(``"auto"``: host-memory groups and NVMe-swapped groups side by side).

:func:`start_overlapped_update` runs on the training thread: the gradient multiplier, the
learning rates (snapshotted, so the LR scheduler may step at once) and the step of the groups
that stay on the accelerator; then the offloaded groups go to the worker
(:class:`~partita.offload.overlapped_step.OverlappedStep`), which steps them and writes each
write-back bucket as soon as it is whole, so that the next forward's modules can start on
their own buckets.

Order: the forward's. Every unit of work (one write-back bucket of a host-memory group, one
``sub_group_size`` range of an NVMe group) has a rank, the earliest registration index of the
parameters of the bucket it works on (:attr:`OverlappedStep.bucket_rank`), and the lowest rank
goes first, across all groups, so a model with two param groups (decay / no decay) or with
tiers gets its first blocks' weights first. One exception keeps the disk and the CPU both busy:
when the next NVMe range's reads have not landed yet, a host-memory bucket steps meanwhile
(its weights are needed later, and the disk paces the NVMe part anyway).

Bit-identical to the serial step: the same ranges with the same kernels and options (host
buckets: partita/offload/pipelined_step.py, 64-aligned; NVMe ranges: the swapper's own
sub-groups and proxies, partita/offload/nvme_optimizer.py); only the order of independent
element-wise ranges changes.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from partita.offload.pipelined_step import (
    can_pipeline,
    forward_bucket_steps,
    snapshot_options,
    step_accelerator_groups,
)
from partita.zero.unused_params import restore_unused, save_unused

if TYPE_CHECKING:
    from partita.offload.nvme_pass import SwapPass
    from partita.offload.nvme_ranges import Range
    from partita.zero.sharded_optimizer import ShardedOptimizer

__all__ = ["can_overlap", "start_overlapped_update"]

_OVERLAPPED_CLASSES = (torch.optim.Adam, torch.optim.AdamW)


def can_overlap(optimizer: ShardedOptimizer) -> bool:
    """Whether this step can run on the overlap worker: host-memory groups as for the pipelined
    step (Adam/AdamW with its state made), NVMe groups once their swap files hold state (the
    first step creates it unoverlapped, as torch initialises it)."""
    swapper = optimizer.swapper
    if swapper is None:
        return can_pipeline(optimizer)
    inner = optimizer.inner
    if type(inner) not in _OVERLAPPED_CLASSES or optimizer.param_store is not None:
        return False
    swapped = set(swapper.swapped_groups)
    for g, group in enumerate(optimizer.groups):
        if not group.offloaded:
            continue
        if g in swapped:
            if not swapper.has_state(g):
                return False
        elif "exp_avg" not in inner.state.get(group.master, {}):
            return False
    return True


@torch.no_grad()
def start_overlapped_update(optimizer: ShardedOptimizer, grads: list[torch.Tensor | None], multiplier: float,
                            used: list[list[bool]]) -> None:
    """The exact update with the offloaded groups stepped on the overlap worker; what reads
    shared state (the learning rates, the clip divisor, the on-accelerator groups' step)
    happens here, before ``step()`` returns and the LR scheduler steps."""
    overlapped = optimizer.overlapped
    in_kernel = optimizer._prepare_update(grads, multiplier, scale_offloaded=False)  # the worker scales those
    kept = save_unused(optimizer.groups, optimizer.inner, used)

    def restore(g: int, start: int, end: int) -> None:
        restore_unused(kept, group=g, start=start, end=end)

    try:
        held = step_accelerator_groups(optimizer, restore)
        options = snapshot_options(optimizer)
    finally:
        if in_kernel:
            del optimizer.inner.grad_scale

    def job(on_bucket) -> None:
        try:
            if multiplier != 1.0 and not in_kernel:
                for grad in held.values():
                    if grad is not None:
                        grad.mul_(multiplier)  # a host pass, off the training thread
            _step_in_forward_order(optimizer, held, used, restore, options, on_bucket, overlapped.bucket_rank)
            restore_unused(kept)
        finally:
            for group, grad in zip(optimizer.groups, grads):
                group.master.grad = None
                group.recycle_grad_buffer(grad)

    optimizer.grads_16bit = {}  # taken into ``held`` above
    overlapped.start(job)


Work = tuple[tuple[int, int], Callable[[], None]]  # ((rank, tie-break), run)


def _step_in_forward_order(optimizer: ShardedOptimizer, held: dict[int, torch.Tensor | None], used, restore,
                           options: list[dict], on_bucket, rank: dict[tuple[int, int], int]) -> None:
    swapper = optimizer.swapper
    swapped = set(swapper.swapped_groups) if swapper is not None else set()
    host: list[Work] = []
    finish: list[Callable[[], None]] = []
    for g, grad in held.items():
        buckets = optimizer.bucket_layout(g)
        if grad is None:  # no gradient anywhere in the group: torch would skip it; its weights go up as they are
            host.append(((min(rank[(g, b)] for b in range(len(buckets))), 0),
                         lambda g=g, n=len(buckets): _write_back_whole(optimizer, g, n, on_bucket)))
        elif g in swapped:
            optimizer.groups[g].master.grad = grad  # what the swapper's ranges read
        else:
            steps, done = forward_bucket_steps(optimizer, g, grad, restore, options[g], on_bucket)
            host.extend(((rank[(g, b)], -b), run) for b, run in steps)
            finish.append(done)
    host.sort(key=lambda work: work[0])  # stable: within a group the forward order (last bucket first)
    pending = deque(host)
    walk: SwapPass | None = None
    if swapper is not None:
        swapper.unit_order = lambda unit: _unit_rank(optimizer, rank, unit)
        walk = swapper.begin_step(optimizer.inner, used, options)
    try:
        if walk is not None:
            written = {g: len(optimizer.bucket_layout(g)) for g in swapped}  # buckets below this are not up yet
            for unit in walk.units:
                key = _unit_rank(optimizer, rank, unit)
                # Host buckets ranked before this range, and any while its reads are still on the disk.
                while pending and (pending[0][0] < key or not walk.next_ready()):
                    pending.popleft()[1]()
                walk.advance()
                restore(unit.group, unit.lo, optimizer.groups[unit.group].master.numel())
                written[unit.group] = _write_back_from(optimizer, unit.group, unit.lo, written[unit.group], on_bucket)
        while pending:
            pending.popleft()[1]()
        for done in finish:
            done()
    except BaseException:
        if walk is not None:
            walk.abort()
        raise
    if walk is not None:
        walk.end()


def _unit_rank(optimizer: ShardedOptimizer, rank: dict[tuple[int, int], int], unit: Range) -> tuple[int, int]:
    """An NVMe range's place in the forward: the rank of the bucket holding its last element."""
    starts = [bucket.partition_start for bucket in optimizer.bucket_layout(unit.group)]
    b = max(0, bisect.bisect_right(starts, unit.hi - 1) - 1)
    return rank[(unit.group, b)], -unit.lo


def _write_back_from(optimizer: ShardedOptimizer, g: int, lo: int, written: int, on_bucket) -> int:
    """Write back group ``g``'s buckets that are whole now that every element from ``lo`` on
    is stepped (ranges go last first), last first; returns the lowest bucket written so far."""
    buckets = optimizer.bucket_layout(g)
    while written > 0 and buckets[written - 1].partition_start >= lo:
        written -= 1
        optimizer.write_back_group(g, [buckets[written]])
        on_bucket(g, written)
    return written


def _write_back_whole(optimizer: ShardedOptimizer, g: int, num_buckets: int, on_bucket) -> None:
    optimizer.write_back_group(g)
    for b in range(num_buckets):
        on_bucket(g, b)
