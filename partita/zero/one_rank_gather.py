"""ZeRO-3 with a ZeRO group of one rank: a gather is a local copy or a shared storage, never a collective.

[Note: one-rank gathers]
With one rank each parameter's "shard" is its whole value, read from the shard storage on the
device (partita/offload/param_offload.py ``DeviceShards``: the fp32 master itself when it lives on
the device, else a model-dtype shard refreshed from the host master after each step). The general
gather (param_gatherer.py) packs a unit's pieces into a send buffer (a cast from the fp32 master),
runs the "collective" of one rank (a view), and unpacks every parameter from it (a second copy):
two weight-sized copies and one buffer per unit, twice a step. :class:`LocalGather` fills each
parameter straight from its piece of the shard instead:

- a piece in the parameter's dtype (fp32 training, a model-dtype shard kept for a host master, a
  frozen parameter's shard) becomes the parameter's data where that is allowed (see below): no
  copy, no allocation (freed.share_values; freeing moves the parameter back onto its empty husk);
- otherwise the parameter's storage is refilled and the piece cast into it, one copy, no buffer:
  the same ``copy_`` rounding as the send buffer's cast, so the values are bitwise the general
  gather's.

Trainable parameters share their piece only with ``stage3_one_rank_resident`` (below). Without
it they are copied like before: a ``state_dict()`` entry taken while a unit is whole keeps the
values it had when the unit was freed (state_dict_guard.py), and an edit inside a read-only
``GatheredParameters`` block is dropped; with a shared master both would follow the training.

[Note: resident parameters]
``zero_optimization.stage3_one_rank_resident`` (a partita key, off by default) keeps every
sharded parameter whole for good at one rank, as ZeRO-1 does: the gatherer registers no unit
hooks at all (no gather, free, autograd identity or gradient hook per unit and step), holds every
parameter from construction (holds.py: nothing releases a held parameter), and
``refresh_shards`` after each optimizer step writes the new master into the 16-bit parameters
with one ``torch._foreach_copy_`` (ZeRO-1's streamed write-back, the same cast). Parameters whose
piece has their dtype share it, so fp32 training holds no copy of the weights beside the master
(less memory than the transient copies of the default) and needs no write-back at all; 16-bit
parameters over a device fp32 master hold their own 16-bit storage, 2 bytes per parameter
beside the activations where the default frees them: that is why it is not the default. Over a
host master (``offload_optimizer``) the device keeps a 16-bit shard anyway, refreshed in place
after each step (delayed update included, between steps): the parameters share it and cost nothing.
Parameters under ``stage3_param_persistence_threshold`` stay the optimizer's to write back
(ShardedOptimizer._write_back_persistent), as at every ZeRO-3 world size: the checkpoint saves
them in its model file, so taking them over here would change the checkpoint's layout.
What a user sees: parameters are never freed, so reading one outside ``GatheredParameters``
gives its values instead of ``ParameterNotGatheredError``; ``state_dict()`` entries are the
live parameters' aliases (as in plain torch, they follow training).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from partita.zero.freed import allocate_param, share_values

if TYPE_CHECKING:
    from partita.offload.param_offload import ShardStorage
    from partita.zero.frozen_params import FrozenShards
    from partita.zero.partition import ShardSpec
    from partita.zero.shard_group import ShardedParamGroup

__all__ = ["LocalGather", "local_gathers", "resident_ignored"]

logger = logging.getLogger("partita")


def local_gathers(*, world_size: int, storage: ShardStorage, groups: list[ShardedParamGroup], hpz: object) -> bool:
    """Whether every gather of this gatherer is local: one rank, every group's shards whole on the
    device (no offload_param), no hpZ (it needs two ranks or more anyway)."""
    return (world_size == 1 and storage.location == "accelerator" and hpz is None
            and all(g.layout.num_shards == 1 for g in groups))


def resident_ignored(world_size: int, location: str) -> None:
    """``stage3_one_rank_resident`` asked for where gathers are not local: said once, at build."""
    logger.info("zero_optimization.stage3_one_rank_resident is ignored: it applies to a ZeRO group of one rank "
                "with the shards on the accelerator (here %d ranks, shards on %s); units are gathered and freed "
                "as usual", world_size, location)


class LocalGather:
    """Fills one-rank ZeRO-3 parameters straight from their shards (see [Note: one-rank gathers])."""

    def __init__(self, where: dict[nn.Parameter, tuple[int, ShardSpec]], storage: ShardStorage,
                 frozen: FrozenShards | None, *, share_trainable: bool) -> None:
        self._where = where
        self._storage = storage
        self._frozen = frozen
        self._share_trainable = share_trainable
        self._copied: list[nn.Parameter] = []  # resident, own storage: written back by refresh()
        self._shared: dict[nn.Parameter, int] = {}  # resident, sharing their piece: its data_ptr then
        # Whether each parameter shares its piece, decided at its first fill: a freed parameter's
        # dtype costs a __torch_function__ round trip (freed.py), and neither dtype ever changes.
        self._shares: dict[nn.Parameter, bool] = {}

    def source(self, param: nn.Parameter) -> torch.Tensor:
        """The parameter's whole value in its shard, viewed in its shape (no copy)."""
        where = self._where.get(param)
        if where is None:
            return self._frozen.whole(param)
        g, spec = where
        lo = spec.partition_offset
        return self._storage.shards[g][lo : lo + spec.numel].view(spec.shape)

    @torch.no_grad()
    def fill(self, param: nn.Parameter) -> torch.Tensor | None:
        """Make a freed ``param`` whole. Returns the husk to free it onto when it shares its shard
        (freed.share_values), None when it got its own storage and a copy."""
        source = self.source(param)
        shares = self._shares.get(param)
        if shares is None:
            shares = self._shares[param] = (source.dtype == param.dtype
                                            and (self._share_trainable or param not in self._where))
        if shares:
            return share_values(param, source)
        allocate_param(param)
        param.data.copy_(source)  # the cast the send buffer made, into the parameter itself
        return None

    def make_resident(self, params: Iterable[nn.Parameter]) -> dict[nn.Parameter, torch.Tensor]:
        """Fill ``params`` for good (see [Note: resident parameters]); the husks of those sharing."""
        husks = {}
        for param in params:
            husk = self.fill(param)
            if husk is not None:
                husks[param] = husk
                if param in self._where:
                    self._shared[param] = param.data_ptr()
            elif param in self._where:
                self._copied.append(param)
        return husks

    @torch.no_grad()
    def refresh(self) -> None:
        """After an optimizer step (or an edit adopted into the masters): resident parameters take
        the new values. Copied ones: one foreach copy (a cast) from their pieces; shared ones see
        them already, unless the shard moved (a checkpoint load replaced the master): then they
        share the new one."""
        if self._copied:
            torch._foreach_copy_([p.data for p in self._copied], [self.source(p) for p in self._copied])
        for param, pointer in self._shared.items():
            source = self.source(param)
            if source.data_ptr() != pointer:
                param.data = source
                self._shared[param] = source.data_ptr()
