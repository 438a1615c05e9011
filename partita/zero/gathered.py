"""Whole-parameter access under ZeRO: ``GatheredParameters`` and streaming full-weight export.

Under ZeRO-3 a parameter holds no data outside its unit's forward and backward; under every
stage the optimizer's fp32 master copy, not the model tensor, is the truth that the next
step writes back. So reading a full parameter needs a gather, and *modifying* one must also
update the master shards, or the next optimizer step silently undoes the edit.

``GatheredParameters(params, modifier_rank=None)`` does both, with DeepSpeed's call shape:
on enter every listed parameter is whole on every rank; on exit, if ``modifier_rank`` is
given, that rank's values are broadcast, written into every rank's master shard (and ZeRO-3
low-precision shard), and the parameters are freed again.

Parameters find their ZeRO owner through a registry keyed by the parameter object (weak
keys: nothing is attached to ``nn.Parameter`` and nothing outlives the model).

[Note: GatheredParameters under tensor parallelism]
DeepSpeed's promise is "the whole parameter inside the block". A tensor-parallel parameter
cannot *become* whole in the live module: the layer's forward computes on its shard, and the
other tensor ranks hold the rest. So inside the block ``param`` stays this rank's (ZeRO-whole)
tensor shard, and the whole tensor is available through the context object::

    with GatheredParameters(model.head.weight, modifier_rank=0) as gathered:
        whole = gathered.whole(model.head.weight)   # whole shape, every rank, a copy
        if dist.get_rank() == 0:
            whole.normal_()                          # edit the whole tensor, or param.data (the shard)

``whole(p)`` of a parameter without a tensor split returns ``p.data`` itself, so the same code
runs with and without tensor parallelism. On exit with a ``modifier_rank``: where a rank
changed its whole copy, that copy wins (the lowest such tensor rank's, broadcast over its
tensor group) and each tensor rank takes its slice; otherwise each rank's edits to its shard
are kept; a parameter the tensor ranks replicate (a norm) takes tensor rank 0's value; then
the ``modifier_rank``'s values are broadcast over the ZeRO group as without tensor
parallelism. So the DeepSpeed idiom ``if dist.get_rank() == 0: <edit>`` reaches every rank. Without a ``modifier_rank`` changes are discarded as usual. The whole copies
cost two whole tensors per listed tensor-parallel parameter (the copy and the value on entry,
to tell an edit), for the duration of the block.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from partita.distributed import collectives
from partita.tensor_parallel.layers import gather_whole, is_tensor_replicated, tensor_shard_of
from partita.tensor_parallel.shard_ranges import local_slice
from partita.zero.holds import HeldParameters

# Keyed by identity (tensors compare elementwise, so a plain WeakKeyDictionary cannot hold them).
# The values are weak too: a ZeroState holds its parameters (through its groups), so a strong
# value would keep its own key alive, and every engine's fp32 masters and optimizer states with
# it, for the life of the process.
_OWNERS = WeakIdKeyDictionary()


def register_owner(params: Iterable[nn.Parameter], owner: object) -> None:
    """Record which ZeRO state (a :class:`partita.zero.api.ZeroState`) manages each parameter;
    the engine holding ``owner`` keeps it alive, this record does not."""
    ref = weakref.ref(owner)
    for param in params:
        _OWNERS[param] = ref


def owner_of(param: nn.Parameter):
    """The live ZeRO state managing ``param``, or None (none, or its engine is gone)."""
    ref = _OWNERS.get(param)
    return None if ref is None else ref()


class GatheredParameters:
    """Context manager: the given parameters are whole inside the block (all ranks must enter).

    Args:
        params: a parameter or an iterable of parameters (any mix of ZeRO-managed and plain).
        modifier_rank: data-parallel rank whose in-block modifications are kept and
            broadcast to all ranks; None means read-only (changes are discarded under ZeRO-3
            and overwritten by the next optimizer step otherwise).
        enabled: False makes the context a no-op.
    """

    def __init__(self, params, modifier_rank: int | None = None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        self._params = [p for p in params if owner_of(p) is not None] if enabled else []
        # Tensor-parallel parameters (ZeRO-managed or not): their whole copies, see the note above.
        self._tensor_params = [p for p in params if tensor_shard_of(p) is not None] if enabled else []
        self._whole: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (copy, value on entry)
        self._modifier_rank = modifier_rank
        # One hold per ZeRO-3 owner (partita/zero/holds.py): the units' hooks do not free what the
        # block gathered (TRL's ``with GatheredParameters(model.parameters()): model.generate()`` would
        # otherwise gather every unit again for every token); parameters already whole on entry (an
        # enclosing block, a generation session, a unit between its training forward and backward)
        # stay whole on exit, their users still need them.
        self._holds: list = []

    def __enter__(self) -> GatheredParameters:
        if self._modifier_rank is not None and any(zero.optimizer is None for zero, _ in self._by_owner()):
            from partita.config.base import ConfigError

            raise ConfigError(
                "GatheredParameters(modifier_rank=...) on an inference-only engine (ZeRO-3 without an optimizer): "
                "its shards are not written back from edits; load the edited weights into the model before "
                "partita.initialize, or use modifier_rank=None to read them"
            )
        for zero, params in self._by_owner():
            if zero.gatherer is not None:
                self._holds.append(HeldParameters(zero.gatherer, params).start())
            elif zero.one_rank_weights is not None:
                # One process, stages 0-2: a block's weights freed between its forward and backward
                # come back (bitwise the values kept, see one_rank_weights.py) and stay whole.
                zero.one_rank_weights.restore()
        with torch.no_grad():
            for param in self._tensor_params:  # the same order on every rank: one gather each
                whole = gather_whole(param.data.contiguous(), tensor_shard_of(param)).contiguous()
                self._whole[id(param)] = (whole, whole.clone())
        return self

    def whole(self, param: torch.Tensor) -> torch.Tensor:
        """The whole value of ``param`` inside the block: for a tensor-parallel shard a whole copy
        (edits to it are written back on exit with a ``modifier_rank``), else ``param.data``."""
        if tensor_shard_of(param) is None:
            return param.data
        if id(param) not in self._whole:
            raise ValueError(
                "GatheredParameters.whole: this tensor-parallel parameter was not given to the context (or the "
                "context is disabled / not entered); list it in GatheredParameters([...])"
            )
        return self._whole[id(param)][0]

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            self._release()
            return
        if self._modifier_rank is not None:
            for param in self._tensor_params:
                _adopt_whole(param, *self._whole[id(param)])
            for zero, params in self._by_owner():
                _adopt_replicated(zero, params)
                _adopt_modifications(zero, params, self._modifier_rank)
        self._release()

    def _release(self) -> None:
        self._whole.clear()
        for hold in self._holds:
            hold.end()
        self._holds = []

    def _by_owner(self) -> Iterator[tuple[object, list[nn.Parameter]]]:
        groups: dict[int, tuple[object, list[nn.Parameter]]] = {}
        for p in self._params:
            zero = owner_of(p)
            groups.setdefault(id(zero), (zero, []))[1].append(p)
        return iter(list(groups.values()))


@torch.no_grad()
def _adopt_whole(param: torch.Tensor, whole: torch.Tensor, entered: torch.Tensor) -> None:
    """Where a tensor rank edited its whole copy, the lowest such rank's copy becomes every tensor
    rank's shard (a collective over the tensor group; all ranks call it for the same parameters)."""
    import torch.distributed as dist

    shard = tensor_shard_of(param)
    edited = torch.tensor([0.0 if torch.equal(whole, entered) else 1.0], device=whole.device)
    flags = torch.empty(shard.size, dtype=edited.dtype, device=whole.device)
    collectives.all_gather_into_tensor(flags, edited, group=shard.group, purpose="GatheredParameters tensor edits")
    editors = [r for r, flag in enumerate(flags.tolist()) if flag > 0]
    if not editors:
        return
    src = dist.get_global_rank(shard.group, editors[0])
    collectives.broadcast(whole, src=src, group=shard.group, purpose="GatheredParameters tensor broadcast")
    param.data.copy_(local_slice(whole, dim=shard.dim, size=shard.size, rank=shard.rank, chunks=shard.chunks))


@torch.no_grad()
def _adopt_replicated(zero, params: list[nn.Parameter]) -> None:
    """Tensor-replicated parameters take tensor rank 0's values, so an edit made on one rank (the
    usual ``if dist.get_rank() == 0:``) reaches every tensor rank before the ZeRO broadcast."""
    import torch.distributed as dist

    # The tensor group the optimizer's norm already uses; None without tensor parallelism.
    group = getattr(zero.optimizer, "_model_parallel_group", None)
    if group is None:
        return
    src = dist.get_global_rank(group, 0)
    for param in params:
        if is_tensor_replicated(param):
            collectives.broadcast(param.data, src=src, group=group, purpose="GatheredParameters tensor broadcast")


@torch.no_grad()
def _adopt_modifications(zero, params: list[nn.Parameter], modifier_rank: int) -> None:
    import torch.distributed as dist

    topology_group = zero.optimizer.process_group

    src = dist.get_global_rank(topology_group, modifier_rank) if topology_group is not None else modifier_rank
    comms = {id(p): g.comm for g in zero.optimizer.groups for p in g.params}
    for param in params:
        comm = comms.get(id(param))
        if comm is not None and comm.process_group is not None and comm.process_group is not topology_group:
            # An expert parameter: only its expert-data group holds the same experts. ZeRO rank m sits
            # at position m // ep_size of its expert-data group; each group takes the member at that
            # position, so the modifier's edits reach its own experts' copies and nothing else.
            if comm.size > 1:
                position = modifier_rank // (dist.get_world_size(topology_group) // comm.size)
                collectives.broadcast(param.data, src=dist.get_global_rank(comm.process_group, position),
                                      group=comm.process_group, purpose="GatheredParameters broadcast (experts)")
        elif dist.is_initialized() and dist.get_world_size(topology_group) > 1:
            collectives.broadcast(param.data, src=src, group=topology_group, purpose="GatheredParameters broadcast")
        for group in zero.optimizer.groups:
            for p, spec, (start, end) in group.owned_slices():
                if p is param:
                    lo = spec.partition_offset
                    group.master[lo : lo + end - start].copy_(param.data.reshape(-1)[start:end])
    if zero.gatherer is not None:
        zero.gatherer.adopt_frozen(params)  # sharded frozen parameters: this rank's shard of the new values
        zero.gatherer.refresh_shards()


def iter_full_parameters(zero, named: Iterable[tuple[str, nn.Parameter]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` one parameter at a time, gathering and freeing as it goes,
    so no rank ever holds more than one extra whole parameter (all ranks must iterate)."""
    for name, param in named:
        gatherer = zero.gatherer if owner_of(param) is zero else None
        if gatherer is not None:
            gatherer.gather([param])
        try:
            yield name, param.detach()
        finally:
            if gatherer is not None:
                gatherer.release([param])


@torch.no_grad()
def iter_fp32_master(zero) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """Yield ``(param, full fp32 value)`` rebuilt from the master shards, one parameter at a
    time (one all-gather each; all ranks must iterate)."""
    optimizer = zero.optimizer
    for group in optimizer.groups:
        num_shards = group.layout.num_shards
        for param, spec in zip(group.params, group.layout.specs):
            mine = group.master[spec.partition_offset : spec.partition_offset + spec.shard_numel]
            if num_shards == 1:
                full = mine
            else:
                full = torch.empty(num_shards * spec.shard_numel, dtype=mine.dtype, device=mine.device)
                # The group's own comm: expert parameters are sharded over their expert-data group.
                process_group = optimizer.process_group if group.comm is None else group.comm.process_group
                collectives.all_gather_into_tensor(full, mine, group=process_group, purpose="fp32 state-dict export")
            yield param, full[: spec.numel].view(spec.shape)  # an expert parameter: this rank's experts only
