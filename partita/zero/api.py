"""``apply_zero``: put a model's trainable parameters under ZeRO data parallelism (at stage 3,
with the frozen ones built under zero.Init: partita/zero/frozen_params.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from partita.config.base import ConfigError
from partita.distributed.topology import Topology
from partita.offload.config import AioConfig
from partita.offload.tiers import tier_parts
from partita.offload.transfer import HostTransfer
from partita.param_groups import registration_index
from partita.zero.config import ZeroConfig
from partita.zero.frozen_params import build_frozen_shards
from partita.zero.gathered import register_owner
from partita.zero.hpz import build_secondary_partition
from partita.zero.init_context import forget_init_shards
from partita.zero.one_rank_weights import OneRankWeights, build_one_rank_weights
from partita.zero.param_gatherer import ParameterGatherer
from partita.zero.policy import ZeroPolicy
from partita.zero.reducer import GradientReducer
from partita.zero.shard_group import ShardComm, ShardedParamGroup
from partita.zero.sharded_optimizer import ShardedOptimizer
from partita.zero.state_dict_guard import guard_state_dict
from partita.zero.streamed_step import StreamedStep, streamable_optimizer
from partita.tensor_parallel.layers import replicated_elsewhere

InnerOptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass(frozen=True)  # no slots: partita.zero.gathered records it by weak reference
class ZeroState:
    """The pieces ``apply_zero`` built; the engine drives them."""

    policy: ZeroPolicy
    optimizer: ShardedOptimizer
    reducer: GradientReducer
    gatherer: ParameterGatherer | None = None  # stage 3 only
    one_rank_weights: OneRankWeights | None = None  # stages 0-2 on one process (partita/zero/one_rank_weights.py)


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
    aio: AioConfig | None = None,
    param_comms: Mapping[nn.Parameter, ShardComm] | None = None,
) -> ZeroState:
    """Shard optimizer state (and gradients, by stage) of ``param_groups`` across data ranks.

    Args:
        module: the model, already on its device and in its compute dtype; its
            parameters must be identical on every rank (the engine broadcasts them).
        param_groups: normalised groups (see :func:`partita.param_groups.normalize_param_groups`).
        config: the ``zero_optimization`` section.
        topology: process topology; ZeRO shards over its zero group (data x sequence).
        gradient_clipping: max global gradient norm, 0 for none.
        build_inner_optimizer: called with ``[{"params": [master], **options}, ...]`` (one
            flat fp32 master tensor per group) and returns the torch optimizer that steps them.
        alignment: every shard is a multiple of this many elements (block-wise optimizers
            need their block size, see ``partita.optim.factory.required_alignment``).
        comm_dtype: dtype gradients are reduced in (None: the model's).
        predivide_factor: divide gradients by this before the cross-rank sum, by world/factor after.
        accumulate_in_fp32: at stages 0/1, sum micro-batch gradients in fp32 (stages 2/3 always do).
        aio: the root config's ``aio`` section (NVMe swap I/O); None: its defaults.
        param_comms: parameters reduced and sharded over a group other than the ZeRO group
            (expert parameters over their expert-data group, see partita/moe); each user
            param group is split into one ZeRO group per comm, the ZeRO group's part first.
            Gradients are still averaged over the whole ZeRO world (see reducer.py).
    """
    offload = config.offload_optimizer
    policy = ZeroPolicy.for_stage(config.stage)
    dense = ShardComm(topology.zero_group if topology.zero_size > 1 else None, topology.zero_size, topology.zero_rank)
    order = registration_index(module)
    device = next(p.device for raw in param_groups for p in raw["params"])
    transfer = (
        HostTransfer(device, buffer_count=offload.buffer_count, pin_memory=offload.pin_memory)
        if offload.enabled
        else None
    )
    groups, swapped = [], []
    for source_index, raw in enumerate(param_groups):
        options = {k: v for k, v in raw.items() if k != "params"}
        for comm, by_comm in _comm_split(raw["params"], param_comms or {}, dense):
            num_shards = policy.num_shards(comm.size)
            shard_rank = comm.rank if num_shards > 1 else 0  # stage 0: every rank owns everything
            for tier, part, padding in tier_parts(
                by_comm, order=order.__getitem__, numel=nn.Parameter.numel, shape=lambda p: p.shape,
                fractions=offload.tier_fractions(), num_shards=num_shards, alignment=alignment,
            ):
                part_transfer = None if tier == "accelerator" else transfer
                if tier == "nvme":
                    swapped.append(len(groups))  # its moments go to swap files (below)
                groups.append(
                    ShardedParamGroup(
                        # Layout order = reverse registration order, the order backward produces
                        # gradients in, so reduce buckets fill front to back (see reducer.py).
                        sorted(part, key=lambda p: -order[p]),
                        options=options,
                        num_shards=num_shards,
                        shard_rank=shard_rank,
                        alignment=alignment,
                        # ZeRO-3 frees parameter storage between uses: it must not be the master's.
                        may_alias_params=not policy.shard_parameters,
                        host_transfer=part_transfer,
                        source_index=source_index,
                        comm=comm,
                        padding=padding,  # tier parts keep the uncut group's SIMD lanes (offload/tiers.py)
                    )
                )
    inner = build_inner_optimizer([{**g.options, "params": [g.master]} for g in groups])
    optimizer = ShardedOptimizer(
        groups,
        inner,
        process_group=topology.zero_group,
        world_size=topology.zero_size,
        gradient_clipping=gradient_clipping,
        allgather_bucket_numel=config.allgather_bucket_size,
        delayed_update=offload.enabled and offload.delayed_param_update,
        host_step_16bit_grads=offload.enabled and offload.host_step_16bit_grads,
        # Tensor parallelism: the norm also sums over the tensor axis, each replicated parameter once.
        model_parallel_group=topology.tensor_group if topology.tensor_size > 1 else None,
        uncounted_params=replicated_elsewhere(topology),
    )
    if offload.overlap_step_with_forward and policy.shard_parameters:
        raise ConfigError(
            "zero_optimization.offload_optimizer.overlap_step_with_forward needs ZeRO stage 1 or 2: stage 3 "
            "gathers each parameter from its shard at use, so there is no written-back bucket to wait for; "
            "use stage 2, or remove overlap_step_with_forward"
        )
    if offload.overlap_step_with_forward and type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ConfigError(
            "zero_optimization.offload_optimizer.overlap_step_with_forward steps the offloaded partition range by "
            f"range with torch's Adam/AdamW kernels; this run's optimizer is {type(inner).__qualname__}. Use Adam or "
            "AdamW, or remove overlap_step_with_forward"
        )
    unsharded = all(g.layout.num_shards == 1 for g in groups if g.offloaded)
    if offload.overlap_step_with_forward and not policy.shard_parameters and unsharded:
        # The exact step overlapped with the next forward, or (delayed_param_update) a delayed
        # update landing beside it.
        # Only where the write-back is a copy: with shards it is an all-gather per bucket, and
        # collectives from the worker would race the training thread's own (the norm's
        # all-reduce, a forward's all-to-all) for the same process group.
        from partita.offload.overlapped_step import OverlappedStep

        optimizer.overlapped = OverlappedStep(optimizer, module, groups[0].params[0].device)
    if swapped:
        # NVMe-tier groups: everything of "cpu" offload, plus the optimizer states in swap files (ZeRO-Infinity).
        from partita.offload.nvme_optimizer import SwappedOptimizerStates

        optimizer.swapper = SwappedOptimizerStates(
            groups, inner, offload=offload, sub_group_size=config.sub_group_size, aio=aio or AioConfig(),
            swapped=swapped,
        )
    reducer = GradientReducer(
        groups,
        order,
        process_group=topology.zero_group,
        world_size=topology.zero_size,
        bucket_numel=config.reduce_bucket_size,
        reduce_every_micro_batch=policy.shard_gradients,
        use_reduce_scatter=config.reduce_scatter,
        overlap_comm=config.overlap_comm is not False,
        comm_dtype=comm_dtype,
        predivide_factor=predivide_factor,
        accumulate_in_fp32=accumulate_in_fp32,
        download_during_backward=offload.enabled,
        fold_at_end=config.one_rank_gradient_fold == "end",
        streamed=config.one_rank_gradient_fold == "stream",
        # ZeRO++ qgZ: reduce-scatters become quantized all-to-alls (partita/zero/quantized_comm.py).
        quantized_gradient_bits=config.zero_quantized_gradients_bits if config.zero_quantized_gradients else None,
    )
    gatherer = None
    if policy.shard_parameters:
        # Frozen parameters built under zero.Init stay sharded too (gathered with their units).
        frozen = build_frozen_shards(module, groups, dense=dense, param_comms=param_comms or {},
                                     persistence_threshold=config.stage3_param_persistence_threshold)
        # Built after the reducer: its hooks must run after the reducer's on each parameter.
        gatherer = ParameterGatherer(
            module,
            groups,
            process_group=topology.zero_group,
            world_size=topology.zero_size,
            persistence_threshold=config.stage3_param_persistence_threshold,
            prefetch_numel=config.stage3_prefetch_bucket_size,
            max_live_numel=config.stage3_max_live_parameters,
            max_reuse_distance=config.stage3_max_reuse_distance,
            # ZeRO-Infinity parameter offload: shards in host memory or swap files between uses.
            offload_param=config.offload_param,
            aio=aio or AioConfig(),
            frozen=frozen,
            # ZeRO++ qwZ: which parameters' unit gathers go as int8 blocks (partita/zero/quantized_comm.py).
            quantize_weights="all" if config.zero_quantized_weights else (
                "frozen" if config.zero_quantized_nontrainable_weights else "none"),
            hpz=build_secondary_partition(config.zero_hpz_partition_size, topology),  # ZeRO++ hpZ (zero/hpz.py)
            one_rank_resident=config.stage3_one_rank_resident,  # one rank: whole for good (zero/one_rank_gather.py)
        )
        optimizer.param_store = gatherer
        # state_dict() of a module whose parameters are freed: placeholders instead of entries that
        # crash on reading; load_state_dict raises instead of writing into no storage (state_dict_guard.py).
        guard_state_dict(module, gatherer.is_sharded_param)
    one_rank = None
    if gatherer is None:
        # One process: each block's 16-bit weights are freed between its forward and its backward.
        one_rank = build_one_rank_weights(module, groups, enabled=config.one_rank_free_weights,
                                          world_size=topology.world_size,
                                          delayed_update=offload.enabled and offload.delayed_param_update,
                                          free_after_backward=config.one_rank_gradient_fold == "end")
        if one_rank is not None:
            optimizer.after_write_back.append(one_rank.synced)
    if config.one_rank_gradient_fold == "stream":
        optimizer.streamed = _streamed_step(groups, inner)
    # The masters and the gatherer (its FrozenShards) own them now.
    frozen_shards = gatherer.frozen if gatherer is not None else None
    forget_init_shards([p for g in groups for p in g.params] + (frozen_shards.params if frozen_shards else []))
    state = ZeroState(policy=policy, optimizer=optimizer, reducer=reducer, gatherer=gatherer, one_rank_weights=one_rank)
    # Frozen parameters too: GatheredParameters gathers the sharded ones and, with a modifier_rank,
    # broadcasts edits of whole ones over the ZeRO group (not frozen experts: they differ across it).
    trained = {p for g in groups for p in g.params}
    register_owner((p for p in module.parameters() if p in trained or p not in (param_comms or {})), state)
    return state


def _streamed_step(groups: list[ShardedParamGroup], inner: torch.optim.Optimizer) -> StreamedStep:
    """``one_rank_gradient_fold "stream"`` (streamed_step.py), refused for an inner optimizer it
    cannot step range by range: torch's fused Adam/AdamW and bitsandbytes' block-wise 8-bit
    optimizers (not the paged ones) it can."""
    if not streamable_optimizer(inner):
        name = f"{type(inner).__module__}.{type(inner).__name__}"
        unfused = " without fused=True" if type(inner) in (torch.optim.Adam, torch.optim.AdamW) else ""
        raise ConfigError(
            f'zero_optimization.one_rank_gradient_fold "stream" steps with torch\'s fused Adam/AdamW kernel or '
            f"bitsandbytes' block-wise 8-bit optimizers; the optimizer here is {name}{unfused}. Use optimizer type "
            'Adam or AdamW (with params.fused true, or unset where torch has the kernel), AdamW8bit, Adam8bit or '
            'Lion8bit, or one_rank_gradient_fold "auto"'
        )
    return StreamedStep(groups, inner)


def _comm_split(
    params: list[nn.Parameter], param_comms: Mapping[nn.Parameter, ShardComm], dense: ShardComm
) -> list[tuple[ShardComm, list[nn.Parameter]]]:
    """Cut one optimizer group by the comm its parameters reduce over: the ZeRO group's part
    first, then one part per other comm in order of first appearance (the same on every rank:
    parameter order and comm assignment are identical everywhere)."""
    parts: dict[int, tuple[ShardComm, list[nn.Parameter]]] = {id(dense): (dense, [])}
    for param in params:
        comm = param_comms.get(param, dense)
        parts.setdefault(id(comm), (comm, []))[1].append(param)
    return [(comm, part) for comm, part in parts.values() if part]

