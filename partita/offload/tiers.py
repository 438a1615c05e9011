"""Which tier holds each parameter's optimizer state: the split shared by ZeRO and the estimator.

Three tiers (:data:`~partita.offload.tier_config.TIERS`): the accelerator (the master, its
gradient partition and the moments next to the model), host memory (ZeRO-Offload) and NVMe
(the moments in swap files, master and gradient partition in host memory; ZeRO-Infinity).

The split is by *whole parameters*, not flat ranges: each tier's part of a user's optimizer
group becomes its own ZeRO group with one master, so every group lives on one device and the
reducer, the write-back buckets, the NVMe swapper and the checkpoint code keep working on
groups unchanged. A range split would have to cut one parameter's shard between two masters
on two devices, which every one of those paths would then have to special-case. The cost is
granularity: a tier boundary falls between parameters, so a tier may get up to one parameter
more or less than its fraction; the estimator computes the real split (the same function), so
its figures are those of the run.

Order: parameters are taken earliest-registered first, farthest tier first (NVMe, then host);
what is left stays on the accelerator. With one offload tier this is exactly the historical
``offload_optimizer.ratio`` rule (the same float comparison), so ``device "cpu"`` / ``"nvme"``
with a ratio build the same groups as before.

Bit-identical steps (:func:`tier_parts`): torch's fused CPU Adam/AdamW steps a tensor in SIMD
vectors and its last ``numel % vector width`` elements in scalar code, whose rounding can
differ (fused multiply-adds). Each element's result thus depends on whether it is among the
last few of its tensor. Cutting a group per tier would move elements in and out of that tail,
so the parts are padded with zeros: the part holding the group's end (the earliest-registered
parameters, laid out last, on the farthest tier) gets *leading* zeros that give it the whole
group's length modulo :data:`SIMD_SPAN`, so the same elements end it; every other part gets
trailing zeros up to a multiple of :data:`SIMD_SPAN`, so none of its elements is in a tail.
Exact as long as the farthest part is longer than one vector (its first parameter, usually
an embedding, is). The cost is under 64 elements per part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from partita.offload.tier_config import TIERS

T = TypeVar("T")

__all__ = ["SIMD_SPAN", "TIERS", "split_by_tier", "tier_parts"]

SIMD_SPAN = 64
"""Elements: a multiple of every CPU vector width for fp32 (AVX-512: 16), and of the 16-element
work units torch's fused CPU Adam cuts a tensor into (see :func:`tier_parts`)."""


def split_by_tier(
    items: Sequence[T], *, order: Callable[[T], int], numel: Callable[[T], int],
    fractions: tuple[float, float, float],
) -> list[tuple[str, list[T]]]:
    """Cut one optimizer group into ``(tier, items)`` parts, farthest tier first, empty parts left out.

    Args:
        items: the group's parameters (or the estimator's stand-ins for them).
        order: registration index of an item (earlier = registered first).
        numel: elements of an item.
        fractions: ``(accelerator, cpu, nvme)`` shares of the group's elements, summing to 1.
    """
    accelerator, cpu, nvme = fractions
    total = sum(numel(x) for x in items)
    ordered = sorted(items, key=order)
    parts: dict[str, list[T]] = {tier: [] for tier in TIERS}
    moved, i = 0, 0
    # Cumulative thresholds: NVMe takes its share first, host memory up to NVMe + host.
    for tier, threshold in (("nvme", nvme), ("cpu", nvme + cpu)):
        while i < len(ordered) and not moved >= threshold * total:
            parts[tier].append(ordered[i])
            moved += numel(ordered[i])
            i += 1
    rest = ordered[i:]
    if rest:
        # Nothing is meant for the accelerator: the remainder (empty parameters, or the last
        # one past a share that rounding left just short) goes to the nearest offload tier.
        keep = "accelerator" if accelerator > 0 else ("cpu" if cpu > 0 else "nvme")
        parts[keep].extend(rest)
    return [(tier, parts[tier]) for tier in ("nvme", "cpu", "accelerator") if parts[tier]]


def tier_parts(
    items: Sequence[T], *, order: Callable[[T], int], numel: Callable[[T], int], shape: Callable[[T], Any],
    fractions: tuple[float, float, float], num_shards: int, alignment: int,
) -> list[tuple[str, list[T], tuple[int, int]]]:
    """:func:`split_by_tier`, each part in layout order (reverse registration) with its
    ``(lead, tail)`` zero padding (see the module docstring); one part: no padding."""
    from partita.zero.partition import ShardLayout

    parts = [(tier, sorted(part, key=lambda x: -order(x)))
             for tier, part in split_by_tier(items, order=order, numel=numel, fractions=fractions)]
    if len(parts) == 1:
        return [(parts[0][0], parts[0][1], (0, 0))]

    def length(part: list[T]) -> int:
        return ShardLayout.build([shape(x) for x in part], num_shards=num_shards, alignment=alignment).partition_numel

    whole = length(sorted(items, key=lambda x: -order(x)))
    out = []
    for i, (tier, part) in enumerate(parts):
        n = length(part)
        # Leading zeros stay whole alignment blocks, so block-wise (8-bit) layouts keep their blocks.
        padding = (((whole - n) % SIMD_SPAN), 0) if i == 0 else (0, (-n) % SIMD_SPAN)
        if alignment > 1 and padding[0] % alignment:
            padding = (0, 0)
        out.append((tier, part, padding))
    return out
