"""Tiered placement from the estimator: the split of the optimizer state over accelerator, host and NVMe.

``plan_tiers(info, setup, capacities)`` decides ``offload_optimizer.device "auto"``'s split the
way the issue puts it: the optimizer state goes first on the accelerator as far as it fits
beside the working set, then in host memory, then on NVMe. Each candidate split is estimated
in full (:func:`~partita.estimate.core.estimate_for_info`, the same groups ZeRO builds), so the
peaks compared with the capacities are the estimator's exact model states plus its activation
and buffer estimates, not a bytes-per-parameter rule.

The search, two bisections over shares of every group's elements:

1. the accelerator's share ``a``: the largest whose accelerator peak fits (moving state off
   the accelerator never raises its peak; a split between host and NVMe does not change it).
   ``offload_optimizer.ratio`` < 1 fixes ``a = 1 - ratio`` instead.
2. host memory's share ``c`` of the rest: the largest whose host peak fits; the remainder goes
   to NVMe (an NVMe element keeps 8 bytes in host memory -- master and gradient -- instead of
   Adam's 16, plus the swapper's buffers), which must then fit the disk.

When no split fits, :class:`TierFitError` lists needed against available GiB per tier at the
closest split, and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from partita.estimate.core import estimate_for_info
from partita.estimate.inputs import EstimateError, Setup
from partita.estimate.model_info import ModelInfo
from partita.estimate.result import MemoryEstimate
from partita.offload.capacity import GIB, TierCapacities
from partita.offload.tier_config import TIERS

__all__ = ["TierFitError", "TierPlan", "describe_split", "plan_tiers", "tier_needs"]

_BISECTIONS = 40  # shares resolved to 1e-12: far below one parameter of any model


class TierFitError(EstimateError):
    """No split of the optimizer state over the tiers fits; the message has the numbers and the fix
    (``closest``: the estimate of the closest split)."""

    def __init__(self, message: str, closest: MemoryEstimate | None = None) -> None:
        super().__init__(message)
        self.closest = closest


def tier_needs(estimate: MemoryEstimate, *, reserved: bool = False) -> tuple[int, int, int]:
    """Peak bytes per tier of one estimate: accelerator peak (with ``reserved``, the predicted reserved
    memory: partita/estimate/allocator.py), host peak, NVMe files."""
    acc = estimate.reserved_accelerator if reserved else estimate.peak_accelerator
    return (acc, estimate.peak_cpu, estimate.nvme)


@dataclass(frozen=True)
class TierPlan:
    """A decided split and what it costs.

    Attributes:
        fractions: (accelerator, cpu, nvme) shares of every optimizer group's elements.
        estimate: the full estimate of the run with that split.
        capacities: usable bytes per tier (headroom taken off).
        elements: optimizer-partition elements per tier (this rank's).
    """

    fractions: tuple[float, float, float]
    estimate: MemoryEstimate
    capacities: TierCapacities
    elements: tuple[int, int, int]

    @property
    def needs(self) -> tuple[int, int, int]:
        return tier_needs(self.estimate)

    @property
    def bytes_per_param(self) -> float:
        """Model-state bytes (parameters, gradients, optimizer states, every tier) per trainable parameter
        (per rank, over this rank's share of the parameters: at one rank, per parameter)."""
        states = sum(self.estimate.model_states(d) for d in ("accelerator", "cpu", "nvme"))
        return states / max(1, sum(self.elements))  # per rank over this rank's partition elements

    @property
    def bound_params(self) -> int:
        """The machine's bound: the sum of the tiers' usable capacities / bytes per parameter.

        Per rank and before activations and buffers, so a model this large does not fit: it is
        the ceiling the placement is measured against."""
        return int(self.capacities.total / self.bytes_per_param)

    def table(self) -> str:
        rows = [f"{'tier':<12} {'share':>8} {'elements':>16} {'needed GiB':>11} {'usable GiB':>11}  source"]
        for i, tier in enumerate(TIERS):
            rows.append(
                f"{tier:<12} {self.fractions[i]:>8.4f} {self.elements[i]:>16,} {self.needs[i] / GIB:>11.2f} "
                f"{self.capacities.as_tuple()[i] / GIB:>11.2f}  {self.capacities.sources[i]}"
            )
        rows.append(
            f"bound: {self.capacities.total / GIB:.2f} GiB usable / {self.bytes_per_param:.2f} B per parameter = "
            f"{self.bound_params / 1e9:.2f} B parameters (headroom {self.capacities.headroom:.0%}; before "
            "activations and buffers)"
        )
        return "\n".join(rows)

    def to_dict(self) -> dict:
        return {
            "fractions": dict(zip(TIERS, self.fractions)),
            "elements": dict(zip(TIERS, self.elements)),
            "needed_bytes": dict(zip(TIERS, self.needs)),
            "usable_bytes": dict(zip(TIERS, self.capacities.as_tuple())),
            "sources": dict(zip(TIERS, self.capacities.sources)),
            "headroom": self.capacities.headroom,
            "bytes_per_param": self.bytes_per_param,
            "bound_params": self.bound_params,
        }


def _elements(estimate: MemoryEstimate, info: ModelInfo) -> tuple[int, int, int]:
    from partita.estimate.groups import zero_groups

    per = dict.fromkeys(TIERS, 0)
    for group in zero_groups(info, estimate.setup):
        per[group.tier] += group.partition_numel
    return tuple(per[t] for t in TIERS)


def _largest(fits, lo: float, hi: float, steps: int = _BISECTIONS) -> float:
    """The largest share in [lo, hi] for which ``fits`` holds, given that it holds at ``lo``."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_tiers(info: ModelInfo, setup: Setup, capacities: TierCapacities, *, reserved: bool = False,
               bisections: int = _BISECTIONS) -> TierPlan:
    """Decide the split of ``setup`` (device auto) for ``capacities``; raise :class:`TierFitError` if none fits.

    ``reserved``: compare the accelerator's predicted reserved memory (allocator rounding and
    fragmentation included) with its capacity instead of the allocated peak (``partita estimate``'s
    recommendation does; ``initialize`` keeps ``tiers.headroom`` for it). ``bisections``: steps of
    each search (shares resolved to ``2**-bisections``)."""
    if setup.offload_optimizer != "auto":
        raise EstimateError(f"plan_tiers decides offload_optimizer auto, not {setup.offload_optimizer!r}")
    cap_a, cap_c, cap_n = capacities.as_tuple()
    if "8bit" in setup.optimizer:
        cap_n = 0  # block-quantised states cannot be swapped (nvme_optimizer refuses them)
    cache: dict[tuple[float, float, float], MemoryEstimate] = {}

    def estimate(fractions: tuple[float, float, float]) -> MemoryEstimate:
        if fractions not in cache:
            cache[fractions] = estimate_for_info(info, setup.replace(offload_tiers=fractions))
        return cache[fractions]

    def split(a: float, c: float) -> tuple[float, float, float]:
        return (a, c, max(0.0, 1.0 - a - c))

    def acc_fits(a: float) -> bool:
        e = estimate(split(a, 1.0 - a))
        return (e.reserved_accelerator if reserved else e.peak_accelerator) <= cap_a

    if setup.offload_ratio < 1.0:
        a = 1.0 - setup.offload_ratio
        if not acc_fits(a):
            _refuse(estimate(split(a, 1.0 - a)), capacities, "accelerator", setup, reserved=reserved)
    elif acc_fits(1.0):
        a = 1.0
    elif acc_fits(0.0):
        a = _largest(acc_fits, 0.0, 1.0, bisections)
    else:
        _refuse(estimate(split(0.0, 1.0)), capacities, "accelerator", setup, reserved=reserved)
    rest = 1.0 - a

    def host_fits(c: float) -> bool:
        return estimate(split(a, c)).peak_cpu <= cap_c

    # Host use grows with its share (16 B per element for Adam against NVMe's 8), and NVMe use
    # shrinks: the largest share host memory holds is also the split the disk likes best.
    if rest == 0.0 or host_fits(rest):
        c = rest
    elif host_fits(0.0):
        c = _largest(host_fits, 0.0, rest, bisections)
    else:
        _refuse(estimate(split(a, 0.0)), capacities, "cpu", setup, nvme_usable=cap_n, reserved=reserved)
    if estimate(split(a, c)).nvme > cap_n:
        _refuse(estimate(split(a, c)), capacities, "nvme", setup, nvme_usable=cap_n, reserved=reserved)
    fractions = split(a, c)
    chosen = estimate(fractions)
    return TierPlan(fractions=fractions, estimate=chosen, capacities=capacities, elements=_elements(chosen, info))


def describe_split(info: ModelInfo, setup: Setup, capacities: TierCapacities) -> TierPlan:
    """The :class:`TierPlan` of ``setup``'s own split (``offload_tiers`` given): what it needs per
    tier against ``capacities``, without deciding anything (a split that does not fit is shown)."""
    fractions = setup.tier_fractions()
    estimate = estimate_for_info(info, setup)
    return TierPlan(fractions=fractions, estimate=estimate, capacities=capacities, elements=_elements(estimate, info))


_FIXES = {
    "accelerator": (
        "the working set alone (parameters, gradients, activations, buffers) does not fit beside any optimizer "
        "state: use ZeRO stage 3 with offload_param, activation checkpointing, a smaller micro-batch, more ranks, "
        "or raise tiers.capacity_gib.accelerator if the measured figure is wrong"
    ),
    "cpu": (
        "host memory cannot hold the offloaded masters and gradient partitions (8 B per NVMe-tier element, 16 B per "
        "host-tier element for Adam) with the swapper's buffers: lower zero_optimization.sub_group_size (NVMe "
        "buffers are buffer_count x sub_group_size x 4 B), add host memory or ranks, or set tiers.capacity_gib.cpu"
    ),
    "nvme": (
        "the disk at nvme_path cannot hold the swapped moments: point offload_optimizer.nvme_path at a larger disk, "
        "free space there, add ranks, or set tiers.capacity_gib.nvme"
    ),
}


def _gib(nbytes: int) -> str:
    """GiB with two decimals; three significant digits below 0.01 GiB (small test models)."""
    return f"{nbytes / GIB:.2f}" if nbytes >= GIB / 100 else f"{nbytes / GIB:.3g}"


def _refuse(closest: MemoryEstimate, capacities: TierCapacities, tier: str, setup: Setup, *,
            nvme_usable: int | None = None, reserved: bool = False) -> None:
    usable = list(capacities.as_tuple())
    if nvme_usable is not None:
        usable[2] = nvme_usable
    needs = tier_needs(closest, reserved=reserved)
    split = closest.setup.offload_tiers or (0.0, 0.0, 0.0)
    lines = "; ".join(
        f"{t} needs {_gib(needs[i])} GiB, {_gib(usable[i])} GiB usable"
        + (" (short)" if needs[i] > usable[i] else "")
        for i, t in enumerate(TIERS)
    )
    raise TierFitError(
        f"offload_optimizer.device \"auto\": no split of the optimizer state over accelerator, host memory and "
        f"NVMe fits this rank (headroom {capacities.headroom:.0%} kept free). Closest split (accelerator "
        f"{split[0]:.3f} / cpu {split[1]:.3f} / nvme {split[2]:.3f}): {lines}. The {tier} tier is short: "
        f"{_FIXES[tier]}",
        closest,
    )
