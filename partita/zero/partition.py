"""Partition math for ZeRO: where each parameter's shard lives. Pure functions, no processes.

[Note: the shard layout]
Every trainable parameter is flattened and padded to a multiple of the number of shards
``W``; rank ``r`` owns elements ``[r*s, (r+1)*s)`` of it, where ``s = ceil(numel / W)``.
A rank's *partition* of a parameter group is the concatenation of its shards of every
parameter of the group, in order, so shard ``i`` sits at ``partition_offset[i]`` in every
rank's partition and all partitions have the same length.

Sharding each parameter (rather than cutting one flat buffer into W pieces, as DeepSpeed's
stage 1/2 does) has three consequences we want:
- a bucket of consecutive parameters is a contiguous slice of every rank's partition, so
  one ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` per bucket moves exactly the
  bytes each rank owns, whatever the bucket boundaries are;
- every shard knows its parameter's full shape and its element offsets, so a checkpoint
  written under one world size can be re-cut for any other;
- ZeRO-3 can reuse the same layout to gather parameters module by module.
The cost is at most ``W - 1`` padding elements per parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Where one parameter's shards live.

    Attributes:
        index: position of the parameter in its group.
        shape: full shape of the parameter.
        numel: number of elements of the full parameter.
        shard_numel: elements each rank owns (padding included).
        partition_offset: offset of this parameter's shard inside every rank's partition.
    """

    index: int
    shape: torch.Size
    numel: int
    shard_numel: int
    partition_offset: int

    def owned_range(self, rank: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of the flattened parameter that ``rank`` owns (may be empty)."""
        start = min(rank * self.shard_numel, self.numel)
        end = min(start + self.shard_numel, self.numel)
        return start, end


@dataclass(frozen=True, slots=True)
class Bucket:
    """A run of consecutive parameters reduced (or gathered) by one collective."""

    first: int
    last: int  # exclusive
    partition_start: int
    partition_end: int

    @property
    def shard_numel(self) -> int:
        """Elements each rank receives for this bucket."""
        return self.partition_end - self.partition_start


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """The shard layout of one parameter group over ``num_shards`` ranks."""

    num_shards: int
    specs: tuple[ShardSpec, ...]
    partition_numel: int

    @classmethod
    def build(
        cls, shapes: Sequence[torch.Size], *, num_shards: int, alignment: int = 1, lead_padding: int = 0,
        tail_padding: int = 0,
    ) -> ShardLayout:
        """Lay out parameters of the given shapes over ``num_shards`` ranks.

        ``alignment``: every shard holds a multiple of this many elements. Block-wise
        optimizers (8-bit states quantised per block of B elements) use B here, so a block
        never spans two parameters and a parameter's blocks start at the same element
        offsets for every world size, which keeps results independent of the world size.

        ``lead_padding`` / ``tail_padding``: zero elements before the first / after the last
        shard of the partition (tiered placement, partita/offload/tiers.py: a group cut per tier
        keeps its elements in the same SIMD lanes as the uncut group, for bit-identical steps).
        """
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        if lead_padding < 0 or tail_padding < 0:
            raise ValueError(f"padding must be >= 0, got lead {lead_padding}, tail {tail_padding}")
        specs = []
        offset = lead_padding
        for index, shape in enumerate(shapes):
            numel = math.prod(shape)
            shard_numel = math.ceil(numel / (num_shards * alignment)) * alignment
            specs.append(ShardSpec(index, torch.Size(shape), numel, shard_numel, offset))
            offset += shard_numel
        return cls(num_shards=num_shards, specs=tuple(specs), partition_numel=offset + tail_padding)

    def buckets(self, max_numel: int) -> list[Bucket]:
        """Split the group into runs of consecutive parameters of at most ``max_numel``
        full-parameter elements each (a larger parameter gets a bucket of its own)."""
        if max_numel < 1:
            raise ValueError(f"bucket size must be >= 1 element, got {max_numel}")
        buckets: list[Bucket] = []
        first = 0
        running = 0
        for spec in self.specs:
            if spec.index > first and running + spec.numel > max_numel:
                buckets.append(self._bucket(first, spec.index))
                first, running = spec.index, 0
            running += spec.numel
        if self.specs:
            buckets.append(self._bucket(first, len(self.specs)))
        return buckets

    def _bucket(self, first: int, last: int) -> Bucket:
        start = self.specs[first].partition_offset
        end_spec = self.specs[last - 1]
        return Bucket(first, last, start, end_spec.partition_offset + end_spec.shard_numel)
