"""The step log's one-time note when compressed communication is on but would not pay.

Read once, at the first logged step on rank 0 (partita/step_log.py). It models this job's step
with :mod:`partita.monitor.comm_model` at ``ASSUMED_GBPS`` between nodes, the slowest link of the
sweep, where compression is worth the most: if it does not pay there, it pays at no faster link.
Ranks per node come from torchrun's ``LOCAL_WORLD_SIZE`` (``LOCAL_SIZE``); without either, one
host is assumed, which is what a launch without a multi-node launcher is.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from partita.monitor.comm_model import Collective, compression_verdict, data_parallel_collectives, zero3_collectives
from partita.zero.hierarchical_reduce import ranks_per_node  # the reader two-hop qgZ itself uses

ASSUMED_GBPS = 100.0
# Achieved memory bandwidth of the quantize passes, by device type (GB/s): a GPU at well under its
# peak (H200: 4.8 TB/s) for chains of small torch ops; a CPU's few cores.
MEMORY_GBYTES_PER_S = {"cuda": 3000.0, "cpu": 20.0}


def _plans(engine: Any, numel: int, world: int, per_node: int) -> tuple[str, list[Collective], list[Collective]] | None:
    """(what is on, plain collectives, compressed collectives), or None when nothing is compressed."""
    config = engine.config
    zero = config.zero_optimization
    optimizer = config.optimizer.type if config.optimizer is not None else ""
    if zero.stage == 3 and (zero.zero_quantized_weights or zero.zero_quantized_gradients):
        on = [k for k in ("zero_quantized_weights", "zero_quantized_gradients") if getattr(zero, k)]
        compressed = zero3_collectives(numel, world, weight_bits=8 if zero.zero_quantized_weights else None,
                                       grad_bits=zero.zero_quantized_gradients_bits if zero.zero_quantized_gradients else None,
                                       ranks_per_node=per_node)  # qgZ's two hops across nodes, as the reducer runs it
        return " and ".join(on), zero3_collectives(numel, world), compressed
    if str(optimizer).lower() == "onebitadam" and zero.stage in (0, 1, 2):
        return ("OneBitAdam", data_parallel_collectives(numel, world, stage=zero.stage),
                data_parallel_collectives(numel, world, stage=zero.stage, onebit=True))
    return None


def compression_note(engine: Any) -> str | None:
    """The step-log line saying that this job's compression would not pay, or None."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world < 2 or engine.config is None:
        return None  # one process: nothing travels and nothing is quantized
    if engine.topology.is_model_parallel():
        return None  # the plans model data parallelism only: tensor/pipeline traffic is not in them
    numel = sum(p.numel() for p in engine.module.parameters())
    per_node = ranks_per_node(world)
    plans = _plans(engine, numel, world, per_node)
    if plans is None:
        return None
    what, plain, compressed = plans
    bandwidth = MEMORY_GBYTES_PER_S.get(engine.device.type, MEMORY_GBYTES_PER_S["cuda"])
    why = compression_verdict(plain, compressed, world=world, ranks_per_node=per_node, gbps=ASSUMED_GBPS,
                              memory_gbytes_per_s=bandwidth)
    return None if why is None else f"compressed communication ({what}) would not pay: {why}"
