"""Where one ZeRO group's elements sit in the ``(world, chunk)`` rows of the 1-bit exchange.

- stages 1 and 2: row ``r`` is rank ``r``'s partition (``chunk`` = the partition), as ZeRO lays it out
  (each parameter's shard at the same offset in every row, padding at the ends of shards);
- stage 0: every rank holds the whole group; its flat elements, zero-padded to ``world * chunk``, are
  cut into ``world`` consecutive rows, and rank ``r`` is the server of row ``r``.
"""

from __future__ import annotations

import math

import torch

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
