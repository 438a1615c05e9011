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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from partita.offload.tier_config import TIERS

T = TypeVar("T")

__all__ = ["TIERS", "split_by_tier"]


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
