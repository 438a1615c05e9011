"""ZeRO-Inference: ZeRO-3 parameter sharding without an optimizer (``initialize`` with no optimizer).

[Note: inference-only ZeRO-3]
DeepSpeed's ZeRO-Inference is a ZeRO-3 config (typically ``offload_param`` to "cpu" or "nvme",
``pin_memory``) handed to ``initialize`` without an optimizer: the weights live sharded, in host
memory or on NVMe, and stream to the device unit by unit for each forward. partita builds the same
from the same config: :func:`apply_zero_inference` shards *every* parameter of the model
(trainable or not) exactly as training's stage 3 does, with the same gatherer
(partita/zero/param_gatherer.py: units, prefetch, offloaded shard storage), but:

- no fp32 master and no optimizer state: each group's "master" partition is this rank's shard
  in the model's dtype (``master_dtype``), and it *is* what the shard storage reads: on the device
  without ``offload_param``; in host memory (page-locked with ``pin_memory`` on CUDA) with "cpu",
  so the device holds only what is gathered; in swap files with "nvme" (the host copy is dropped
  once they are written). Per rank that is the model's bytes / world size, once;
- no gradient reducer: ``engine.backward`` and ``engine.step`` raise (partita/zero/inference_engine.py),
  naming the fix (an ``optimizer`` section or argument);
- eval forwards prefetch the next units (their host-to-device copies, NVMe reads and all-gathers)
  while the current one runs, from the unit order of the first eval forward
  (partita/zero/eval_prefetch.py), also at world size 1 when the shards are offloaded.

Expert parameters (partita/moe) are sharded over their expert-data group, as in training.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from partita.distributed.topology import Topology
from partita.offload.config import AioConfig
from partita.zero.api import ZeroState, _comm_split
from partita.zero.config import ZeroConfig
from partita.zero.gathered import register_owner
from partita.zero.init_context import forget_init_shards
from partita.zero.param_gatherer import ParameterGatherer
from partita.zero.policy import ZeroPolicy
from partita.zero.shard_group import ShardComm, ShardedParamGroup
from partita.zero.state_dict_guard import guard_state_dict

__all__ = ["InferenceParamGroup", "apply_zero_inference"]


class InferenceParamGroup(ShardedParamGroup):
    """A ZeRO group whose partition is this rank's model-dtype shard (no fp32 master, never stepped).

    ``offloaded`` (the partition lives in host memory) tells the shard storage to read the
    partition itself instead of keeping a second copy (partita/offload/param_offload.py).
    """

    def __init__(self, params: list[nn.Parameter], *, comm: ShardComm, on_host: bool, pin: bool) -> None:
        self._on_host = on_host
        super().__init__(
            params, options={}, num_shards=comm.size, shard_rank=comm.rank, may_alias_params=False, comm=comm,
            master_dtype=params[0].dtype, master_device=torch.device("cpu") if on_host else None,
        )
        if pin:  # host-to-device copies from page-locked memory run asynchronously, beside compute
            self.master = self.master.pin_memory()

    @property
    def offloaded(self) -> bool:
        return self._on_host


def apply_zero_inference(
    module: nn.Module,
    *,
    config: ZeroConfig,
    topology: Topology,
    aio: AioConfig | None = None,
    param_comms: Mapping[nn.Parameter, ShardComm] | None = None,
) -> ZeroState:
    """Shard every parameter of ``module`` (already on its device, in its dtype, equal on every
    rank) over the ZeRO group for inference: no optimizer, no reducer (see the note)."""
    offload = config.offload_param
    on_host = offload.enabled  # "cpu" reads the host partition; "nvme" builds its files from it
    device = next(module.parameters()).device
    pin = on_host and offload.pin_memory and device.type == "cuda"
    dense = ShardComm(topology.zero_group if topology.zero_size > 1 else None, topology.zero_size, topology.zero_rank)
    params = list(module.parameters())  # deduplicated: tied weights are sharded once
    groups: list[ShardedParamGroup] = []
    for comm, part in _comm_split(params, param_comms or {}, dense):
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in part:
            by_dtype.setdefault(param.dtype, []).append(param)
        for dtype_params in by_dtype.values():
            groups.append(InferenceParamGroup(dtype_params, comm=comm, on_host=on_host, pin=pin))
    # The host partition is the shard a "cpu" storage reads in place (gather_from_master); partita's
    # config only allows that key beside a host optimizer, which inference has none of.
    offload_param = offload.model_copy(update={"gather_from_master": True}) if offload.device == "cpu" else offload
    gatherer = ParameterGatherer(
        module, groups, process_group=topology.zero_group, world_size=topology.zero_size,
        persistence_threshold=config.stage3_param_persistence_threshold,
        prefetch_numel=config.stage3_prefetch_bucket_size, max_live_numel=config.stage3_max_live_parameters,
        max_reuse_distance=config.stage3_max_reuse_distance, offload_param=offload_param, aio=aio or AioConfig(),
    )
    if offload.device == "nvme":
        for group in groups:  # the swap files hold the shards now: no host copy stays behind
            group.master = torch.empty(0, dtype=group.master.dtype)
    guard_state_dict(module, gatherer.is_sharded_param)
    forget_init_shards(params)
    state = ZeroState(policy=ZeroPolicy.for_stage(3), optimizer=None, reducer=None, gatherer=gatherer)
    register_owner(params, state)
    return state
