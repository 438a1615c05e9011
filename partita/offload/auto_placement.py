"""``offload_optimizer.device "auto"`` at ``initialize``: decide the split, then hand ZeRO a plain config.

The decision is the estimator's (:func:`partita.estimate.tiers.plan_tiers`) for this model, these
param groups and this config, against the tiers' capacities (:mod:`partita.offload.capacity`,
the minimum over all ranks so every rank builds the same groups). The result is written back
into the config as the simplest device that describes it, so a split that needs one tier only
runs the path that has always run it:

- everything on the accelerator -> ``device "none"``;
- accelerator + host -> ``device "cpu"`` with ``ratio`` = host share (all host: ratio 1);
- accelerator + NVMe -> ``device "nvme"`` with ``ratio``;
- host and NVMe both used -> ``device "auto"`` with ``tiers.fractions`` set (apply_zero then
  builds one ZeRO group per tier and swaps only the NVMe tier's).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.config.base import ConfigError
from partita.offload.capacity import TierCapacities, measure_capacities
from partita.offload.config import OffloadOptimizerConfig

__all__ = ["client_optimizer_name", "min_over_ranks", "model_info_for", "normalized_offload", "resolve_tiered_placement"]

logger = logging.getLogger(__name__)

# Client optimizer classes -> the estimator's optimizer names (their per-element state).
_CLIENT_OPTIMIZERS = {torch.optim.Adam: "Adam", torch.optim.AdamW: "AdamW", torch.optim.SGD: "SGD"}


def normalized_offload(offload: OffloadOptimizerConfig, fractions: tuple[float, float, float]) -> OffloadOptimizerConfig:
    """The ``offload_optimizer`` section that places ``fractions`` (see the module docstring)."""
    accelerator, cpu, nvme = fractions
    raw = offload.model_dump(exclude={"tiers", "device", "ratio"})
    if cpu == 0.0 and nvme == 0.0:
        # delayed_param_update needs an offload device: keep it on the host path, all on the accelerator
        # otherwise.
        if raw.get("delayed_param_update"):
            raise ConfigError(
                "offload_optimizer.device \"auto\" put the whole optimizer state on the accelerator, where "
                "delayed_param_update has no host step to overlap; remove delayed_param_update, or fix a share "
                "off the accelerator with ratio or tiers.fractions"
            )
        if raw.get("overlap_step_with_forward"):
            # No host step to overlap: the flag has nothing to do, unlike the delayed update's math.
            logger.info("offload_optimizer.device \"auto\" put the whole optimizer state on the accelerator; "
                        "overlap_step_with_forward has no offloaded step to overlap and is off")
            raw["overlap_step_with_forward"] = False
        return OffloadOptimizerConfig.model_validate({**raw, "device": "none"})
    # ratio = the offload tier's own share, so split_by_tier compares against the same float
    # (0 + share) whichever way the split is written.
    if nvme == 0.0:
        return OffloadOptimizerConfig.model_validate({**raw, "device": "cpu", "ratio": cpu})
    if cpu == 0.0:
        return OffloadOptimizerConfig.model_validate({**raw, "device": "nvme", "ratio": nvme})
    tiers = offload.tiers.model_dump()
    tiers["fractions"] = {"accelerator": accelerator, "cpu": cpu, "nvme": nvme}
    return OffloadOptimizerConfig.model_validate({**raw, "device": "auto", "tiers": tiers})


def client_optimizer_name(optimizer: Any) -> str:
    """The estimator's name for the optimizer passed to ``initialize`` (its per-element state)."""
    return _CLIENT_OPTIMIZERS.get(type(optimizer), "AdamW")


def min_over_ranks(capacities: TierCapacities, device: torch.device) -> TierCapacities:
    """Every rank decides from the smallest capacity of each tier, so all build the same groups."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return capacities
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    values = torch.tensor(capacities.as_tuple(), dtype=torch.int64, device=on)
    dist.all_reduce(values, op=dist.ReduceOp.MIN)
    a, c, n = (int(v) for v in values.tolist())
    sources = tuple(f"{s} (minimum over ranks)" for s in capacities.sources)
    return TierCapacities(a, c, n, sources=sources, headroom=capacities.headroom)


def model_info_for(model: nn.Module, param_groups: list[dict], activation_gib: float | None):
    from partita.estimate.inputs import GPTShape
    from partita.estimate.model_info import model_info
    from partita.models.gpt import GPT

    info = model_info(model, param_groups=param_groups)
    config = getattr(model, "config", None)
    if isinstance(model, GPT) and activation_gib is None and not config.moe_every:
        # partita's GPT: activations by the estimator's formula, at its longest sequence.
        shape = GPTShape(config.n_embd, config.n_layer, config.n_head, config.vocab_size, config.block_size,
                         config.bias, config.dropout)
        from dataclasses import replace

        info = replace(info, gpt=shape)
    return info


def resolve_tiered_placement(
    cfg: Any, model: nn.Module, param_groups: list[dict], *, world_size: int, device: torch.device,
    batch_world_size: int | None = None, client_optimizer: Any = None, capacities: TierCapacities | None = None,
) -> Any:
    """``cfg`` with ``offload_optimizer.device "auto"`` decided (other configs come back unchanged).

    Args:
        cfg: the validated ``PartitaConfig``.
        model, param_groups: what ``apply_zero`` will place (normalised groups).
        world_size: ranks the optimizer state is sharded over (the ZeRO group).
        batch_world_size: data-parallel ranks the batch sizes resolve over (default ``world_size``).
        device: the accelerator (``cpu`` on a CPU-only run).
        client_optimizer: the optimizer passed to ``initialize`` (its class tells the state size).
        capacities: usable bytes per tier, instead of measuring them (tests).
    """
    zero = cfg.zero_optimization
    offload = zero.offload_optimizer
    if offload.device != "auto":
        return cfg
    tiers = offload.tiers
    plan = None
    if tiers.fractions is not None:
        fractions = tiers.fractions.as_tuple()
    else:
        from partita.estimate.inputs import Setup
        from partita.estimate.tiers import plan_tiers

        if capacities is None:
            given = tiers.capacity_gib
            capacities = measure_capacities(
                device, nvme_path=offload.nvme_path, headroom=tiers.headroom,
                overrides_gib=(given.accelerator, given.cpu, given.nvme),
            )
        capacities = min_over_ranks(capacities, device)
        extra: dict[str, Any] = {}
        if cfg.optimizer is None and client_optimizer is not None:
            extra["optimizer"] = client_optimizer_name(client_optimizer)
        info = model_info_for(model, param_groups, tiers.activation_gib)
        if info.gpt is None:
            extra["activation_bytes"] = int((tiers.activation_gib or 0.0) * 2**30)
            if tiers.activation_gib is None:
                logger.warning("offload_optimizer.device \"auto\": activations of a %s are unknown to the estimator "
                               "and not reserved; set offload_optimizer.tiers.activation_gib", type(model).__name__)
        setup = Setup.from_config(cfg, world_size=batch_world_size or world_size, **extra)
        if setup.world_size != world_size:
            setup = setup.replace(world_size=world_size)  # sequence parallelism: shards over data x sequence
        plan = plan_tiers(info, setup, capacities)
        fractions = plan.fractions
    decided = normalized_offload(offload, fractions)
    if plan is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.info("offload_optimizer.device \"auto\" placed the optimizer state as offload_optimizer=%s:\n%s",
                    decided.model_dump(include={"device", "ratio"}), plan.table())
    return cfg.model_copy(update={"zero_optimization": zero.model_copy(update={"offload_optimizer": decided})})
