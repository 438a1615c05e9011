"""Where one ZeRO group's elements sit in the ``(world, chunk)`` rows of the 1-bit exchange.

- stages 1 and 2: row ``r`` is rank ``r``'s partition (``chunk`` = the partition), as ZeRO lays it out
  (each parameter's shard at the same offset in every row, padding at the ends of shards);
- stage 0: every rank holds the whole group; its flat elements, zero-padded to ``world * chunk``, are
  cut into ``world`` consecutive rows, and rank ``r`` is the server of row ``r``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from partita.distributed import collectives

from partita.zero.shard_group import ShardedParamGroup, pack_into_columns
from partita.zero.partition import ShardSpec

__all__ = ["RowLayout"]


class RowLayout:
    def __init__(self, group: ShardedParamGroup, world: int, rank: int) -> None:
        self.group, self.world, self.rank = group, world, rank
        self.sharded = group.layout.num_shards > 1
        numel = group.layout.partition_numel
        self.chunk = numel if self.sharded else math.ceil(numel / world)
        self.mask = torch.zeros((world, self.chunk), dtype=torch.bool, device=group.master.device)
        for spec in group.layout.specs:
            self.drop(self.mask, spec, value=True)

    @property
    def segments(self) -> torch.Tensor:
        """``(world, chunk)`` int64: each element's parameter index in the group (padding: 0, masked
        anyway), for one compression scale per parameter and row."""
        if getattr(self, "_segments", None) is None:
            self._segments = torch.zeros((self.world, self.chunk), dtype=torch.int64, device=self.mask.device)
            for j, spec in enumerate(self.group.layout.specs):
                self.drop(self._segments, spec, value=j)
        return self._segments

    def empty(self) -> torch.Tensor:
        return torch.zeros((self.world, self.chunk), dtype=torch.float32, device=self.group.master.device)

    def drop(self, mask: torch.Tensor, spec: ShardSpec, *, value: bool | int = False) -> None:
        """Set ``mask`` (or any ``(world, chunk)`` tensor) to ``value`` over the real elements of parameter ``spec``."""
        if self.sharded:
            for rank in range(self.world):
                start, end = spec.owned_range(rank)
                mask[rank, spec.partition_offset : spec.partition_offset + (end - start)] = value
        else:
            mask.view(-1)[spec.partition_offset : spec.partition_offset + spec.numel] = value

    def put(self, matrix: torch.Tensor, spec: ShardSpec, full: torch.Tensor | None) -> None:
        """Write a whole parameter's values (``None``: zeros) into its place in ``matrix``."""
        if self.sharded:
            pack_into_columns(matrix, spec.partition_offset, spec, full)
            return
        target = matrix.view(-1)[spec.partition_offset : spec.partition_offset + spec.numel]
        if full is None:
            target.zero_()
        else:
            target.copy_(full.detach().reshape(-1))

    def take(self, matrix: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        """A whole parameter's values out of ``matrix`` (flat, ``spec.numel`` elements)."""
        if self.sharded:
            columns = matrix[:, spec.partition_offset : spec.partition_offset + spec.shard_numel]
            return columns.reshape(-1)[: spec.numel]
        return matrix.reshape(-1)[spec.partition_offset : spec.partition_offset + spec.numel]

    def own(self, matrix: torch.Tensor) -> torch.Tensor:
        """What this rank's partition (the optimizer's master-shaped state) is in ``matrix``."""
        if self.sharded:
            return matrix[self.rank]
        return matrix.reshape(-1)[: self.group.layout.partition_numel]

    def from_partition(self, partition: torch.Tensor) -> torch.Tensor | None:
        """Stage 0: ``matrix`` from a whole-group (master-shaped) tensor; stages 1-2: None (it
        takes every rank's partition: an all-gather, which the caller runs)."""
        if self.sharded:
            return None
        matrix = self.empty()
        matrix.view(-1)[: partition.numel()].copy_(partition)
        return matrix


@dataclass
class LocalGradients:
    """This rank's gradients of a compressed step, packed per group, and what all ranks agree on."""

    matrices: list[torch.Tensor]  # per group, the rows of its parameters' gradients (loss-scaled)
    norm: float  # sqrt(mean over ranks of |g_r|^2) / loss_scale: an upper bound of the averaged norm
    multiplier: float  # 1 / loss_scale, times the clipping coefficient
    used: list[list[bool]]  # per group and parameter: whether any rank produced a gradient


def take_local_gradients(sharded, rows: list[RowLayout], *, loss_scale: float, clip: float,
                         purpose: str) -> LocalGradients:
    """Move every ``param.grad`` into its group's row matrix (the grads are dropped) and agree, in one
    fp32 all-reduce, on the squared local norms and on which parameters got a gradient anywhere."""
    grads, received = [], []
    for group, layout in zip(sharded.groups, rows):
        matrix = layout.empty()
        for param, spec in zip(group.params, group.layout.specs):
            received.append(param.grad is not None)
            layout.put(matrix, spec, param.grad)
            param.grad = None
        grads.append(matrix)
    packed = torch.tensor([0.0] + [float(r) for r in received], device=grads[0].device)
    packed[0] = sum(m.square().sum() for m in grads)
    collectives.all_reduce(packed, group=sharded.process_group, purpose=f"{purpose}: local gradient norms")
    values = packed.tolist()
    norm = math.sqrt(values[0] / sharded._world_size) / loss_scale
    multiplier = 1.0 / loss_scale
    if clip > 0 and math.isfinite(norm):
        multiplier *= min(1.0, clip / (norm + 1e-6))
    used, i = [], 1
    for group in sharded.groups:
        used.append([v > 0 for v in values[i : i + len(group.params)]])
        i += len(group.params)
    return LocalGradients(grads, norm, multiplier, used)
