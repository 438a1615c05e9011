"""The step log's one-time note when compressed communication is on but would not pay.

Read once, at the first logged step on rank 0 (partita/step_log.py). It models this job's step
with :mod:`partita.monitor.comm_model` at ``ASSUMED_GBPS`` between nodes, the slowest link of the
sweep, where compression is worth the most: if it does not pay there, it pays at no faster link.
Ranks per node come from torchrun's ``LOCAL_WORLD_SIZE`` (``LOCAL_SIZE``); without either, one
host is assumed, which is what a launch without a multi-node launcher is.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch.distributed as dist

from partita.monitor import comm_model as cm
from partita.zero.hierarchical_reduce import ranks_per_node  # the reader two-hop qgZ itself uses

ASSUMED_GBPS = 100.0
# Achieved memory bandwidth of the quantize passes, by device type (GB/s): a GPU at well under its
# peak (H200: 4.8 TB/s) for chains of small torch ops; a CPU's few cores.
MEMORY_GBYTES_PER_S = {"cuda": 3000.0, "cpu": 20.0}
_ZERO3_KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")


def zero_one_adam_horizon(params: Any) -> int:
    """0/1 Adam's updates until its schedule is steady: the variance phase, the local-step interval
    doubling up to ``local_step_clipper``, and one more ``local_step_scaler`` period at it. The note
    models the average step over them (DeepSpeed's defaults: 263,390 updates)."""
    doublings = max(0, math.ceil(math.log2(params.local_step_clipper)))
    return params.var_freeze_step + params.local_step_scaler * (doublings + 1)


class Plans(NamedTuple):
    what: str  # what is on, for the message
    plain: list[cm.Collective]
    compressed: list[cm.Collective]
    adds: str  # what it costs besides bytes


def plans(engine: Any, world: int, per_node: int) -> Plans | None:
    """This job's plain and compressed plans, or None when nothing is compressed (or not modelled)."""
    config = engine.config
    zero = config.zero_optimization
    optimizer = str(config.optimizer.type if config.optimizer is not None else "").lower()
    trained = [p for p in engine.module.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in engine.module.parameters())
    if zero.stage == 3:
        hpz = zero.zero_hpz_partition_size
        on = [k for k in _ZERO3_KEYS if (getattr(zero, k) > 1 if k == "zero_hpz_partition_size" else getattr(zero, k))]
        if not on:
            return None
        weight_bits = 8 if zero.zero_quantized_weights else None
        grad_bits = zero.zero_quantized_gradients_bits if zero.zero_quantized_gradients else None
        # qgZ in two hops across nodes, as the reducer runs it; hpZ's backward gathers inside its groups.
        compressed = cm.zero3_collectives(numel, world, weight_bits=weight_bits, grad_bits=grad_bits,
                                          ranks_per_node=per_node, hpz_partition_size=hpz)
        adds = [] if on == ["zero_hpz_partition_size"] else ["quantize work"]
        if hpz > 1:
            copies = cm.hpz_memory_bytes(numel, world, hpz) / 1e9
            adds.append(f"hpZ's secondary weight copies ({copies:.3g} GB per rank)")
        return Plans(" and ".join(on), cm.zero3_collectives(numel, world), compressed, " and ".join(adds))
    params = config.optimizer.params if config.optimizer is not None else None
    if optimizer in ("onebitadam", "onebitlamb") and zero.stage in (0, 1, 2):
        kind = "OneBitAdam" if optimizer == "onebitadam" else "OneBitLamb"
        compressed = cm.onebit_collectives(numel, world, optimizer=kind, stage=zero.stage, parameters=len(trained),
                                           weight_decay=params.weight_decay > 0)
        return Plans(f"{kind}, compressed phase", cm.data_parallel_collectives(numel, world, stage=zero.stage),
                     compressed, "1-bit coding work")
    if optimizer == "zerooneadam" and zero.stage == 0:
        horizon = zero_one_adam_horizon(params)
        compressed = cm.zero_one_adam_collectives(
            numel, world, steps=horizon, parameters=len(trained), var_freeze_step=params.var_freeze_step,
            var_update_scaler=params.var_update_scaler, local_step_scaler=params.local_step_scaler,
            local_step_clipper=params.local_step_clipper)
        return Plans(f"ZeroOneAdam, the average of its first {horizon:,} steps",
                     cm.data_parallel_collectives(numel, world, stage=0), compressed, "1-bit coding work")
    return None


def compression_note(engine: Any) -> str | None:
    """The step-log line saying that this job's compression would not pay, or None."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world < 2 or engine.config is None:
        return None  # one process: nothing travels and nothing is quantized
    if engine.topology.is_model_parallel():
        return None  # the plans model data parallelism only: tensor/pipeline traffic is not in them
    per_node = ranks_per_node(world)
    found = plans(engine, world, per_node)
    if found is None:
        return None
    bandwidth = MEMORY_GBYTES_PER_S.get(engine.device.type, MEMORY_GBYTES_PER_S["cuda"])
    why = cm.compression_verdict(found.plain, found.compressed, world=world, ranks_per_node=per_node,
                                 gbps=ASSUMED_GBPS, memory_gbytes_per_s=bandwidth, adds=found.adds)
    return None if why is None else f"compressed communication ({found.what}) would not pay: {why}"
