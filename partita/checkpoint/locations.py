"""Where a parameter is in a checkpoint: its checkpoint name, and the rank files that hold its shards.

The writers (:mod:`partita.checkpoint.snapshot`, :mod:`partita.checkpoint.frozen`) and the
readers (:mod:`partita.checkpoint.load`, partita/pipe/checkpoint.py) all need these answers, so
they live below all of them: nothing here imports another checkpoint module but the format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import partita.checkpoint.format as fmt
from partita.distributed.topology import Axis
from partita.moe.registry import checkpoint_name, expert_ep_size, expert_piece_ranks
from partita.tensor_parallel.layers import tensor_shard_of

if TYPE_CHECKING:
    from partita.engine import Engine

__all__ = ["checkpoint_state_dict", "param_names", "piece_files", "shard_file_of", "tensor_rank_files"]


def param_names(module: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    """Each parameter's checkpoint name: its state_dict name (the first one, for a tied
    parameter), with an MoE expert's local index replaced by its global one (partita/moe/registry.py)."""
    return {p: checkpoint_name(name, p) for name, p in module.named_parameters()}


def checkpoint_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` under checkpoint names (MoE experts by global index)."""
    renamed = {name: checkpoint_name(name, p) for name, p in module.named_parameters(remove_duplicate=False)}
    return {renamed.get(k, k): v for k, v in module.state_dict().items()}


def tensor_rank_files(engine: Engine, tensor_rank: int) -> list[str]:
    """Rank files of the ZeRO group of tensor rank ``tensor_rank`` (this rank's pipeline stage),
    in ZeRO-rank order: where that tensor rank's pieces are written."""
    grid = engine.topology.mesh.mesh  # (pipe, data, sequence, tensor), tensor innermost
    pipe = engine.topology.coordinate()[Axis.PIPE]
    return [fmt.rank_file(int(r)) for r in grid[pipe, :, :, tensor_rank].reshape(-1).tolist()]


def shard_file_of(engine: Engine, shard_rank: int) -> str:
    """The file holding shard ``shard_rank``: the rank file of the data rank that owns it."""
    group = engine.topology.zero_group
    if engine.topology.zero_size > 1:
        return fmt.rank_file(dist.get_global_rank(group, shard_rank))
    # One shard: the first rank of this rank's ZeRO group wrote it (rank 0, except on later
    # pipeline stages, whose first rank writes its own stage's shards).
    return fmt.rank_file(engine.topology.zero_group_ranks()[0])


def piece_files(engine: Engine, param: torch.Tensor, piece: int) -> list[str]:
    """Rank files of ``piece``'s ZeRO shards, in shard order: a tensor rank's ZeRO group, or the
    expert-data group of expert rank ``piece``."""
    if tensor_shard_of(param) is not None:
        return tensor_rank_files(engine, piece)
    return [fmt.rank_file(r) for r in expert_piece_ranks(engine.topology, expert_ep_size(param), piece)]
