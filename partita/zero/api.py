"""``apply_zero``: put a model's trainable parameters under ZeRO data parallelism."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from partita.distributed.topology import Topology
from partita.offload.transfer import HostTransfer
from partita.param_groups import registration_index
from partita.zero.config import ZeroConfig
from partita.zero.gathered import register_owner
from partita.zero.init_context import forget_init_shards
from partita.zero.param_gatherer import ParameterGatherer
from partita.zero.policy import ZeroPolicy
from partita.zero.reducer import GradientReducer
from partita.zero.shard_group import ShardedParamGroup
from partita.zero.sharded_optimizer import ShardedOptimizer

InnerOptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass(frozen=True, slots=True)
class ZeroState:
    """The pieces ``apply_zero`` built; the engine drives them."""

    policy: ZeroPolicy
    optimizer: ShardedOptimizer
    reducer: GradientReducer
    gatherer: ParameterGatherer | None = None  # stage 3 only


def apply_zero(
    module: nn.Module,
    param_groups: list[dict],
    *,
    config: ZeroConfig,
    topology: Topology,
    gradient_clipping: float,
    build_inner_optimizer: InnerOptimizerFactory,
    alignment: int = 1,
    comm_dtype: torch.dtype | None = None,
    predivide_factor: float = 1.0,
    accumulate_in_fp32: bool = False,
) -> ZeroState:
    """Shard optimizer state (and gradients, by stage) of ``param_groups`` across data ranks.

    Args:
        module: the model, already on its device and in its compute dtype; its
            parameters must be identical on every rank (the engine broadcasts them).
        param_groups: normalised groups (see :func:`partita.param_groups.normalize_param_groups`).
        config: the ``zero_optimization`` section.
        topology: process topology; only the data axis is used.
        gradient_clipping: max global gradient norm, 0 for none.
        build_inner_optimizer: called with ``[{"params": [master], **options}, ...]`` (one
            flat fp32 master tensor per group) and returns the torch optimizer that steps them.
        alignment: every shard is a multiple of this many elements (block-wise optimizers
            need their block size, see ``partita.optim.factory.required_alignment``).
        comm_dtype: dtype gradients are reduced in (None: the model's).
        predivide_factor: divide gradients by this before the cross-rank sum, by world/factor after.
        accumulate_in_fp32: at stages 0/1, sum micro-batch gradients in fp32 (stages 2/3 always do).
    """
    offload = config.offload_optimizer
    if offload.device == "nvme":
        raise NotImplementedError(
            "zero_optimization.offload_optimizer.device \"nvme\" is not implemented yet; use \"cpu\""
        )
    if config.offload_param.enabled:
        raise NotImplementedError(
            "zero_optimization.offload_param is not implemented yet; set offload_param.device to \"none\""
        )
    policy = ZeroPolicy.for_stage(config.stage)
    num_shards = policy.num_shards(topology.data_size)
    shard_rank = topology.data_rank if num_shards > 1 else 0  # stage 0: every rank owns everything
    order = registration_index(module)
    device = next(p.device for raw in param_groups for p in raw["params"])
    transfer = (
        HostTransfer(device, buffer_count=offload.buffer_count, pin_memory=offload.pin_memory)
        if offload.enabled
        else None
    )
    groups = []
    for raw in param_groups:
        # Layout order = reverse registration order, the order backward produces
        # gradients in, so reduce buckets fill front to back (see reducer.py).
        params = sorted(raw["params"], key=lambda p: -order[p])
        options = {k: v for k, v in raw.items() if k != "params"}
        groups.append(
            ShardedParamGroup(
                params,
                options=options,
                num_shards=num_shards,
                shard_rank=shard_rank,
                alignment=alignment,
                # ZeRO-3 frees parameter storage between uses: it must not be the master's.
                may_alias_params=not policy.shard_parameters,
                host_transfer=transfer,
            )
        )
    inner = build_inner_optimizer([{**g.options, "params": [g.master]} for g in groups])
    optimizer = ShardedOptimizer(
        groups,
        inner,
        process_group=topology.data_group,
        world_size=topology.data_size,
        gradient_clipping=gradient_clipping,
        allgather_bucket_numel=config.allgather_bucket_size,
        delayed_update=offload.enabled and offload.delayed_param_update,
    )
    reducer = GradientReducer(
        groups,
        order,
        process_group=topology.data_group,
        world_size=topology.data_size,
        bucket_numel=config.reduce_bucket_size,
        reduce_every_micro_batch=policy.shard_gradients,
        use_reduce_scatter=config.reduce_scatter,
        overlap_comm=config.overlap_comm is not False,
        comm_dtype=comm_dtype,
        predivide_factor=predivide_factor,
        accumulate_in_fp32=accumulate_in_fp32,
    )
    gatherer = None
    if policy.shard_parameters:
        # Built after the reducer: its hooks must run after the reducer's on each parameter.
        gatherer = ParameterGatherer(
            module,
            groups,
            process_group=topology.data_group,
            world_size=topology.data_size,
            persistence_threshold=config.stage3_param_persistence_threshold,
            prefetch_numel=config.stage3_prefetch_bucket_size,
            max_live_numel=config.stage3_max_live_parameters,
        )
        optimizer.param_store = gatherer
    forget_init_shards([p for g in groups for p in g.params])  # the masters and gatherer own them now
    state = ZeroState(policy=policy, optimizer=optimizer, reducer=reducer, gatherer=gatherer)
    register_owner((p for g in groups for p in g.params), state)
    return state
