"""Partition math and bucket packing: pure functions, no processes."""

from __future__ import annotations

import pytest
import torch

from partita.zero.partition import ShardLayout
from partita.zero.shard_group import pack_into_columns, unpack_from_columns


def test_layout_offsets_and_padding() -> None:
    layout = ShardLayout.build([torch.Size([3, 5]), torch.Size([7]), torch.Size([4])], num_shards=4)
    assert [s.shard_numel for s in layout.specs] == [4, 2, 1]
    assert [s.partition_offset for s in layout.specs] == [0, 4, 6]
    assert layout.partition_numel == 7
    # 15 elements over 4 ranks of 4: the last rank owns 3 real elements and 1 pad.
    assert [layout.specs[0].owned_range(r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 15)]
    # 7 elements over 4 ranks of 2: the last rank owns only padding.
    assert [layout.specs[1].owned_range(r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert layout.specs[2].owned_range(3) == (3, 4)


def test_single_shard_layout_is_the_whole_group() -> None:
    layout = ShardLayout.build([torch.Size([3, 5]), torch.Size([7])], num_shards=1)
    assert layout.partition_numel == 22
    assert layout.specs[1].owned_range(0) == (0, 7)


def test_buckets_cover_every_parameter_once_and_respect_size() -> None:
    shapes = [torch.Size([n]) for n in (10, 30, 5, 100, 1, 1)]
    layout = ShardLayout.build(shapes, num_shards=2)
    buckets = layout.buckets(40)
    assert [(b.first, b.last) for b in buckets] == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert buckets[0].partition_start == 0 and buckets[-1].partition_end == layout.partition_numel
    assert sum(b.shard_numel for b in buckets) == layout.partition_numel
    with pytest.raises(ValueError, match="bucket size"):
        layout.buckets(0)


def test_pack_then_unpack_round_trips_with_padding() -> None:
    layout = ShardLayout.build([torch.Size([3, 5]), torch.Size([7])], num_shards=4)
    (bucket,) = layout.buckets(10**6)
    tensors = [torch.arange(15.0).view(3, 5), torch.arange(100.0, 107.0)]
    packed = torch.full((4, bucket.shard_numel), float("nan"))
    for spec, t in zip(layout.specs, tensors):
        pack_into_columns(packed, spec.partition_offset, spec, t)
    # Row r is exactly what rank r owns, padding zero-filled.
    assert packed[3].tolist() == [12.0, 13.0, 14.0, 0.0, 106.0, 0.0]
    assert packed[0].tolist() == [0.0, 1.0, 2.0, 3.0, 100.0, 101.0]
    restored = [torch.zeros(3, 5), torch.zeros(7)]
    for spec, t in zip(layout.specs, restored):
        unpack_from_columns(packed, spec.partition_offset, spec, t)
    assert all(torch.equal(a, b) for a, b in zip(tensors, restored))


def test_missing_gradient_packs_zeros() -> None:
    layout = ShardLayout.build([torch.Size([5])], num_shards=2)
    packed = torch.ones(2, 3)
    pack_into_columns(packed, 0, layout.specs[0], None)
    assert torch.count_nonzero(packed) == 0


def test_alignment_keeps_block_boundaries_independent_of_world_size() -> None:
    for world in (1, 2, 4):
        layout = ShardLayout.build([torch.Size([1000]), torch.Size([3])], num_shards=world, alignment=64)
        for spec in layout.specs:
            assert spec.shard_numel % 64 == 0 and spec.partition_offset % 64 == 0
            # Shard starts are block boundaries of the parameter itself for every world size.
            assert all(spec.owned_range(r)[0] % 64 == 0 for r in range(world) if spec.owned_range(r)[0] < spec.numel)
    with pytest.raises(ValueError, match="alignment"):
        ShardLayout.build([torch.Size([4])], num_shards=2, alignment=0)
