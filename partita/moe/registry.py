"""Which parameters are expert parameters, owned by partita.moe (never an attribute on the
parameter): a weak map from parameter to the MoE layer that owns it (and, for an MoE expert's
parameter, which local expert it belongs to).

DeepSpeed marks expert parameters with ``param.allreduce = False`` and ``param.group_name``;
here the layer registers its experts' parameters at construction, and everything that must
treat them differently asks this module:

- :func:`is_moe_param` (DeepSpeed's function of the same name);
- :func:`bind_experts` (called by ``partita.initialize``): gives every MoE layer its expert
  and expert-data groups from the topology and returns the ZeRO comm of each expert parameter
  (its expert-data group), so ZeRO reduces and shards them there;
- checkpoints key experts by *global* expert index: :func:`checkpoint_name` renames local
  expert ``j``'s parameter ``...deepspeed_experts.<j>.<leaf>`` to
  ``...deepspeed_experts.<first + j>.<leaf>`` (``first`` = expert rank x local experts), the
  name it has at ``ep_size`` 1, so a checkpoint saved at one ``ep_size`` loads at any other;
  :func:`expert_names_elsewhere` names the experts other expert ranks hold;
- exports (partita/zero/export.py): :func:`gather_expert_copies` brings every expert rank's copy
  of a local expert slot under its global name, :func:`expert_export_order` puts them in the
  order of the same model at ``ep_size`` 1.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from partita.zero.shard_group import ShardComm

if TYPE_CHECKING:
    from partita.distributed.topology import Topology
    from partita.moe.layer import MoE

__all__ = ["bind_experts", "checkpoint_name", "checkpoint_renames", "expert_index", "expert_names_elsewhere",
           "expert_export_order", "gather_expert_copies",
           "expert_piece_ranks", "expert_shard_of", "global_expert_names", "is_moe_param", "moe_layers",
           "register_expert_params"]

_EXPERTS_KEY = "deepspeed_moe.experts.deepspeed_experts."


@dataclass(frozen=True)
class _Entry:
    # The MoE layer or ShardedEmbedding, held weakly: the layer holds the parameter (the map's
    # key), so a strong reference here would keep every layer ever built alive.
    layer_ref: weakref.ref
    local_index: int | None  # the local expert of an MoE expert parameter

    @property
    def layer(self) -> nn.Module | None:
        return self.layer_ref()


_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Every layer that registered expert parameters -> "MoE layer" or "ShardedEmbedding" (so this
# module finds the layers without importing their modules, which import it).
_LAYERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _entry(param: torch.Tensor) -> _Entry | None:
    """``param``'s registration, None for a dense parameter or one whose layer is gone."""
    entry = _OWNER.get(param)
    return entry if entry is not None and entry.layer is not None else None


def register_expert_params(layer: nn.Module, params: list[nn.Parameter], *, local_index: int | None = None) -> None:
    """Record ``params`` as expert parameters of ``layer`` (called by the layer itself), those
    of its local expert ``local_index`` for an MoE layer."""
    for param in params:
        _OWNER[param] = _Entry(weakref.ref(layer), local_index)
    _LAYERS[layer] = "ShardedEmbedding" if local_index is None else "MoE layer"


def owner_layer(param: torch.Tensor) -> MoE | None:
    """The layer (MoE or ShardedEmbedding) whose experts hold ``param``, or None for a dense parameter."""
    entry = _entry(param)
    return None if entry is None else entry.layer


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter of an MoE layer's routed experts (DeepSpeed's ``is_moe_param``);
    False for a row-sharded embedding table, which shares only the expert-parallel machinery."""
    entry = _entry(param)
    return entry is not None and entry.local_index is not None


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE layer in ``model``, in module order (the order groups are built in on every rank)."""
    return [(name, module) for name, module in model.named_modules() if _LAYERS.get(module) == "MoE layer"]


def expert_index(param: torch.Tensor) -> int | None:
    """The global expert index of an MoE expert parameter (None for any other): local expert
    ``j`` of expert rank ``r`` is global expert ``r * num_local_experts + j``."""
    entry = _entry(param)
    if entry is None or entry.local_index is None:
        return None
    return entry.layer.expert_rank * entry.layer.num_local_experts + entry.local_index


def _renamed(name: str, local_index: int, global_index: int) -> str:
    head, sep, tail = name.rpartition(f"{_EXPERTS_KEY}{local_index}.")
    if not sep:  # an expert module registered elsewhere too (tied into the model): keep its name
        return name
    return f"{head}{_EXPERTS_KEY}{global_index}.{tail}"


def checkpoint_name(name: str, param: torch.Tensor) -> str:
    """The name ``param`` (named ``name`` in its model) has in checkpoints: an MoE expert
    parameter's local expert index replaced by its global one; any other name unchanged."""
    entry = _entry(param)
    if entry is None or entry.local_index is None:
        return name
    return _renamed(name, entry.local_index, expert_index(param))


def global_expert_names(name: str, param: torch.Tensor) -> list[str]:
    """The checkpoint names of this local expert slot on every expert rank, in expert-rank order
    (``[name]`` for a parameter that is not an expert-parallel MoE expert's)."""
    entry = _entry(param)
    if entry is None or entry.local_index is None or entry.layer.ep_size == 1:
        return [checkpoint_name(name, param)]
    n = entry.layer.num_local_experts
    return [_renamed(name, entry.local_index, r * n + entry.local_index) for r in range(entry.layer.ep_size)]


def checkpoint_renames(module: nn.Module) -> dict[str, str]:
    """``{model name: checkpoint name}`` for every parameter of ``module`` whose names differ."""
    out = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        renamed = checkpoint_name(name, param)
        if renamed != name:
            out[name] = renamed
    return out


def expert_names_elsewhere(module: nn.Module) -> set[str]:
    """Checkpoint names of the MoE experts that other expert ranks hold (a checkpoint records
    every expert; this rank's model has its own only)."""
    out: set[str] = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        names = global_expert_names(name, param)
        if len(names) > 1:
            out.update(names)
            out.discard(checkpoint_name(name, param))
    return out


def expert_parallel_keys(module: nn.Module) -> set[str]:
    """Model names of MoE expert parameters spread over several expert ranks (ep_size > 1):
    no rank holds every expert, so checkpoints store them through the fp32 master shards."""
    return {name for name, param in module.named_parameters(remove_duplicate=False)
            if len(global_expert_names(name, param)) > 1}


def bind_experts(model: nn.Module, topology: Topology) -> dict[nn.Parameter, ShardComm]:
    """Give every MoE layer of ``model`` its expert groups; return each expert parameter's ZeRO comm.

    Collective (process groups are created): every rank calls it with the same model
    structure. Raises ValueError naming the layer when its ep_size does not divide the
    data-parallel size (data x sequence).
    """
    comms: dict[nn.Parameter, ShardComm] = {}
    by_size: dict[int, ShardComm] = {}
    sharded = [(n, m) for n, m in model.named_modules() if m in _LAYERS]
    for name, layer in sharded:
        try:
            groups = topology.expert_groups(layer.ep_size)
        except ValueError as error:
            kind = _LAYERS[layer]
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
    """A row-sharded embedding table (``ShardedEmbedding``) as a dim-0 split of the whole
    ``(num_embeddings, dim)`` table (a :class:`~partita.tensor_parallel.layers.TensorShard` of
    ``size = num_shards``), so checkpoints
    record and reshard it exactly like a row-split tensor-parallel weight
    (partita/checkpoint/tensor_layout.py, case 2: every piece is a contiguous run of rows). None
    for a dense parameter and for ``ep_size == 1`` (the local tensor is then the global one)."""
    entry = _entry(param)
    if entry is None or entry.local_index is not None or entry.layer.ep_size == 1:
        return None  # MoE experts are whole per-expert parameters, renamed instead (checkpoint_name)
    layer = entry.layer
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


def gather_expert_copies(name: str, param: torch.Tensor, whole: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``[(checkpoint name, tensor)]`` of this local expert slot on every expert rank, for exports.

    ``whole`` is this rank's whole value of ``param`` (model name ``name``). For an
    expert-parallel MoE expert it is all-gathered over the expert group (a collective: every rank
    of the group calls it for the same parameter) and each expert rank's copy comes back under its
    global name; any other parameter comes back as ``[(name, whole)]``."""
    names = global_expert_names(name, param)
    if len(names) == 1:
        return [(names[0], whole)]
    import torch.distributed as dist

    layer = owner_layer(param)
    if layer._groups is None:
        raise RuntimeError(f"{name}: an expert-parallel MoE layer that was never bound has no expert group to gather over")
    pieces = [torch.empty_like(whole) for _ in names]
    dist.all_gather(pieces, whole.contiguous(), group=layer._groups.expert_group)
    return list(zip(names, pieces))


def expert_export_order(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The export names of ``named`` (a model's ``(name, tensor)`` pairs in its own order) in
    the order the same model built at ``ep_size`` 1 lists them.

    An expert-parallel layer's local expert ``j`` stands for global experts ``r * n + j`` of
    every expert rank ``r``; at ``ep_size`` 1 a layer's experts come one after another, each
    with its parameters in their own order, where the layer's first local expert parameter sits.
    Every other name keeps its place."""
    block_start: dict[int, int] = {}  # layer id -> position of its first expert parameter
    keyed = []
    for pos, (name, tensor) in enumerate(named):
        names = global_expert_names(name, tensor)
        if len(names) == 1:
            keyed.append(((pos, -1, 0), names[0]))
            continue
        layer = _entry(tensor).layer
        start = block_start.setdefault(id(layer), pos)
        n = layer.num_local_experts
        local = _entry(tensor).local_index
        keyed += [((start, r * n + local, pos), global_name) for r, global_name in enumerate(names)]
    seen: set[str] = set()
    out = []
    for _, name in sorted(keyed, key=lambda item: item[0]):
        if name not in seen:  # a name repeated (tied aliases) keeps its first place
            seen.add(name)
            out.append(name)
    return out
