"""``zero_optimization.offload_optimizer.tiers``: tiered placement of the optimizer state.

A partita extension (DeepSpeed has no such section). With ``offload_optimizer.device: "auto"``
each parameter's optimizer state (fp32 master, fp32 gradient partition, moments) is placed on
one of three tiers -- the accelerator, host memory, NVMe swap files under ``nvme_path`` -- so
the largest model is bounded by the sum of the tiers rather than by the smallest of them.
Without ``fractions`` partita decides the split from its memory estimator and the tiers'
measured capacities (``partita/offload/auto_placement.py``); with them the split is the user's.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from partita.config.base import StrictSection

TIERS = ("accelerator", "cpu", "nvme")
"""The tiers, nearest first; the placement fills them in this order."""

_SUM_TOLERANCE = 1e-9


class TierFractions(StrictSection):
    """Fractions of every optimizer group's elements per tier (whole parameters at a time)."""

    accelerator: float = Field(0.0, ge=0.0, le=1.0, description="Share whose optimizer state stays on the accelerator.")
    cpu: float = Field(0.0, ge=0.0, le=1.0, description="Share whose optimizer state lives in host memory.")
    nvme: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Share whose moments live in NVMe swap files (their fp32 master and gradient stay in host memory).",
    )

    @model_validator(mode="after")
    def _sum_to_one(self) -> TierFractions:
        total = self.accelerator + self.cpu + self.nvme
        if abs(total - 1.0) > _SUM_TOLERANCE:
            raise PydanticCustomError(
                "tier_fractions_sum",
                "tier fractions accelerator={a} + cpu={c} + nvme={n} add up to {total}, not 1; make them sum to 1 "
                "(e.g. {example})",
                {"a": self.accelerator, "c": self.cpu, "n": self.nvme, "total": round(total, 12),
                 "example": '{"accelerator": 0.5, "cpu": 0.3, "nvme": 0.2}'},
            )
        return self

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.accelerator, self.cpu, self.nvme)


class TierCapacities(StrictSection):
    """Capacities (GiB) that replace the measured ones; an absent tier is measured."""

    accelerator: Optional[float] = Field(
        None, gt=0.0, description="Accelerator memory this rank may use, GiB (default: free + reserved by torch)."
    )
    cpu: Optional[float] = Field(
        None, ge=0.0,
        description="Host memory this rank may use, GiB (default: MemAvailable / ranks on this node; 0 when the "
                    "accelerator is the CPU itself).",
    )
    nvme: Optional[float] = Field(
        None, ge=0.0, description="Disk space at nvme_path this rank may use, GiB (default: free space / ranks on this node)."
    )


class OffloadTiersConfig(StrictSection):
    """``offload_optimizer.tiers``: how ``device: "auto"`` places the optimizer state."""

    fractions: Optional[TierFractions] = Field(
        None,
        description="An explicit split per tier (sums to 1). Absent: partita chooses it from its estimator, filling "
                    "the accelerator first, then host memory, then NVMe.",
    )
    capacity_gib: TierCapacities = Field(
        default_factory=TierCapacities, description="Tier capacities that replace the measured ones, GiB."
    )
    headroom: float = Field(
        0.1, ge=0.0, lt=1.0,
        description="Fraction of every tier's capacity left free (CUDA context, fragmentation, the OS page cache).",
    )
    activation_gib: Optional[float] = Field(
        None, ge=0.0,
        description="Accelerator GiB reserved for activations when the estimator cannot count them (a model other "
                    "than partita's GPT); for partita's GPT they are estimated at its block size.",
    )
