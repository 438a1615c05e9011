"""The ZeRO groups partita builds for a setup: which parameters, their shard layout, on which side.

``partita.zero.api.apply_zero`` turns each optimizer group into one ``ShardedParamGroup`` (one
fp32 master each) -- or one per tier (``offload_optimizer.ratio < 1``, or tiered placement):
``partita.offload.tiers.split_by_tier`` (the same function ZeRO calls) takes whole parameters,
earliest-registered first, for NVMe, then host memory; the rest stay on the accelerator. Each group's parameters are
laid out in reverse registration order by ``ShardLayout`` (reused here, not re-derived).
"""

from __future__ import annotations

from dataclasses import dataclass

from partita.estimate.inputs import Setup
from partita.estimate.model_info import ModelInfo, ParamInfo
from partita.offload.tiers import tier_parts
from partita.optim.eight_bit import BLOCK_SIZE, EIGHT_BIT_CLASSES
from partita.zero.partition import ShardLayout

__all__ = ["ZeroGroup", "alignment_of", "zero_groups"]


@dataclass(frozen=True)
class ZeroGroup:
    """One ``ShardedParamGroup``: parameters in layout order, their layout, whether offloaded,
    and whether its fp32 parameters are views of its master (one copy)."""

    params: tuple[ParamInfo, ...]
    layout: ShardLayout
    offloaded: bool
    aliases_params: bool
    tier: str = "accelerator"  # "cpu" / "nvme" for offloaded groups (partita/offload/tiers.py)

    @property
    def partition_numel(self) -> int:
        return self.layout.partition_numel


def alignment_of(setup: Setup) -> int:
    """``partita.optim.factory.required_alignment`` for the setup's optimizer type."""
    return BLOCK_SIZE if setup.optimizer in EIGHT_BIT_CLASSES else 1


def zero_groups(info: ModelInfo, setup: Setup) -> list[ZeroGroup]:
    """The groups ``apply_zero`` builds for ``info`` under ``setup``, in its order."""
    groups = []
    for group in info.groups:
        for tier, part, padding in tier_parts(
            group, order=lambda p: p.order, numel=lambda p: p.numel, shape=lambda p: p.shape,
            fractions=setup.tier_fractions(), num_shards=setup.num_shards, alignment=alignment_of(setup),
        ):
            offloaded = tier != "accelerator"
            ordered = tuple(part)  # layout order: reverse registration
            layout = ShardLayout.build([p.shape for p in ordered], num_shards=setup.num_shards,
                                       alignment=alignment_of(setup), lead_padding=padding[0], tail_padding=padding[1])
            # ShardedParamGroup aliases fp32 parameters with a one-shard master, never at stage 3
            # (which frees parameter storage) nor for a host master.
            aliases = setup.dtype == "fp32" and setup.num_shards == 1 and setup.stage != 3 and not offloaded
            groups.append(ZeroGroup(ordered, layout, offloaded, aliases, tier))
    return groups
