"""Which parameters are expert parameters, owned by partita.moe (never an attribute on the
parameter): a weak map from parameter to the MoE layer that owns it.

DeepSpeed marks expert parameters with ``param.allreduce = False`` and ``param.group_name``;
here the layer registers its stacked expert parameters at construction, and everything that
must treat them differently asks this module:

- :func:`is_moe_param` (DeepSpeed's function of the same name);
- :func:`bind_experts` (called by ``partita.initialize``): gives every MoE layer its expert
  and expert-data groups from the topology and returns the ZeRO comm of each expert parameter
  (its expert-data group), so ZeRO reduces and shards them there;
- checkpoints: :func:`expert_layout` says where a rank's local rows sit in the global
  ``(num_experts, ...)`` tensor, so they are stored by global expert index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from partita.zero.shard_group import ShardComm

if TYPE_CHECKING:
    from partita.distributed.topology import Topology
    from partita.moe.layer import MoE

__all__ = ["ExpertLayout", "bind_experts", "expert_layout", "expert_piece_ranks", "expert_shard_of", "is_moe_param",
           "moe_layers", "register_expert_params"]

_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_expert_params(layer: MoE, params: list[nn.Parameter]) -> None:
    """Record ``params`` as expert parameters of ``layer`` (called by the layer itself)."""
    for param in params:
        _OWNER[param] = layer


def owner_layer(param: torch.Tensor) -> MoE | None:
    """The MoE layer whose experts hold ``param``, or None for a dense parameter."""
    return _OWNER.get(param)


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter of an MoE layer's routed experts (DeepSpeed's ``is_moe_param``);
    False for a row-sharded embedding table, which shares only the expert-parallel machinery."""
    from partita.moe.layer import MoE

    return isinstance(_OWNER.get(param), MoE)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE layer in ``model``, in module order (the order groups are built in on every rank)."""
    from partita.moe.layer import MoE

    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


@dataclass(frozen=True)
class ExpertLayout:
    """Where a rank's stacked expert parameter sits in the global one.

    The local parameter holds experts ``first_expert .. first_expert + num_local - 1``: rows
    of the global ``global_shape = (num_experts, *row_shape)`` tensor, i.e. the flat element
    range ``[offset, offset + local numel)`` of it (rows are contiguous in row-major order).
    """

    global_shape: torch.Size
    offset: int
    num_experts: int
    first_expert: int


def expert_layout(param: torch.Tensor) -> ExpertLayout | None:
    """The global layout of an expert parameter, None for a dense one (or a layer not bound
    to a topology yet: then it holds every expert, ep_size 1)."""
    layer = owner_layer(param)
    if layer is None:
        return None
    first = layer.expert_rank * layer.num_local_experts
    row = param.numel() // layer.num_local_experts
    return ExpertLayout(torch.Size((layer.num_experts, *param.shape[1:])), first * row, layer.num_experts, first)


def bind_experts(model: nn.Module, topology: Topology) -> dict[nn.Parameter, ShardComm]:
    """Give every MoE layer of ``model`` its expert groups; return each expert parameter's ZeRO comm.

    Collective (process groups are created): every rank calls it with the same model
    structure. Raises ValueError naming the layer when its ep_size does not divide the
    data-parallel size (data x sequence).
    """
    from partita.moe.embedding import ShardedEmbedding
    from partita.moe.layer import MoE

    comms: dict[nn.Parameter, ShardComm] = {}
    by_size: dict[int, ShardComm] = {}
    sharded = [(n, m) for n, m in model.named_modules() if isinstance(m, (MoE, ShardedEmbedding))]
    for name, layer in sharded:
        try:
            groups = topology.expert_groups(layer.ep_size)
        except ValueError as error:
            kind = "MoE layer" if isinstance(layer, MoE) else "ShardedEmbedding"
            raise ValueError(f"{kind} {name!r} (num_experts={layer.num_experts}): {error}") from None
        layer.bind(groups)
        comm = by_size.get(layer.ep_size)
        if comm is None:  # one ShardComm object per ep_size: ZeRO buckets its parameters together
            comm = ShardComm(groups.expert_data_group if groups.expert_data_size > 1 else None,
                             groups.expert_data_size, groups.expert_data_rank)
            by_size[layer.ep_size] = comm
        for param in layer.expert_parameters():
            comms[param] = comm
    return comms


def expert_shard_of(param: torch.Tensor):
    """An expert-parallel parameter as a dim-0 split of the global ``(num_experts, ...)`` tensor
    (a :class:`~partita.tensor_parallel.layers.TensorShard` of ``size = ep_size``), so checkpoints
    record and reshard it exactly like a row-split tensor-parallel weight
    (partita/checkpoint/tensor_layout.py, case 2: every piece is a contiguous run of rows). None
    for a dense parameter and for ``ep_size == 1`` (the local tensor is then the global one)."""
    layer = owner_layer(param)
    if layer is None or layer.ep_size == 1:
        return None
    from partita.tensor_parallel.layers import TensorShard

    group = layer._groups.expert_group if layer._groups is not None else None  # None before initialize binds it
    return TensorShard(dim=0, rank=layer.expert_rank, size=layer.ep_size,
                       full_shape=(layer.num_experts, *param.shape[1:]), chunks=1, group=group)


def expert_ep_size(param: torch.Tensor) -> int:
    """The expert-parallel size of an expert parameter (1 for a dense one)."""
    layer = owner_layer(param)
    return 1 if layer is None else layer.ep_size


def expert_piece_ranks(topology: Topology, ep_size: int, expert_rank: int) -> list[int]:
    """Global ranks holding expert rank ``expert_rank``'s experts, in expert-data-rank order
    (the ZeRO shard order of those experts): ZeRO positions ``expert_rank + ep_size * j``."""
    zero_ranks = topology.zero_group_ranks()
    return zero_ranks[expert_rank::ep_size]
