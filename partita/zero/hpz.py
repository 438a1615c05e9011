"""ZeRO++ hpZ (``zero_hpz_partition_size``): a secondary weight partition within groups of G ranks.

[Note: the secondary partition]
At ZeRO-3 every unit is all-gathered over the whole ZeRO group twice per micro-batch: before its
forward and again before its backward. With hpZ, G consecutive ranks of the ZeRO group (on a
cluster: one node) form an hpZ group. When a unit's forward all-gather over the world has landed,
each rank keeps a copy of its 1/G of what arrived: the world gather gives W rows (one per ZeRO
rank) of the unit's shards side by side, and group rank j keeps, for each parameter, rows
[j * W/G, (j + 1) * W/G) of that parameter's columns. The backward's re-gather of the unit (and
an activation-checkpointing recompute, which runs inside backward) all-gathers those copies
inside the group only: group rank j's rows come j-th, so the G pieces concatenate into exactly the
W rows the world gather gave, byte for byte, and the unit is unpacked from them as usual. No
byte of that gather leaves the group.

What the copy holds: the values the forward's gather produced, in the model's dtype. With
qwZ (zero_quantized_weights) that is the dequantized int8 gather, so the backward runs on the
very weights the forward used, as qwZ without hpZ does (it re-quantizes the same shards the same
way); the group gather is 16-bit, twice an int8 row's bytes, but it stays on the node's fast
links, and keeping int8 rows would tie each copy to the exact set of parameters its gather
carried (the blocks and scales span the parameters side by side).

When it is valid: from the forward that filled it to the end of the same micro-batch's
backward (``drop``, from the gatherer's ``release_all``, and again after every optimizer step).
Each micro-batch's forward refreshes it with its own world gather, so a copy never outlives the
weights it was taken from: the optimizer step, a checkpoint load or a GatheredParameters edit all
happen between backward and the next forward. Outside that window, or for a parameter whose
forward gather did not run (a unit called outside the model's forward), the backward gathers
over the world as without hpZ. Nothing of it is saved: checkpoints, exports and
GatheredParameters are the exact world gathers they are without hpZ.

Cost: each copy is 1/G of the gathered 16-bit parameters: ``numel * 2 / G`` bytes per rank for the
sharded (non-persistent) parameters, held between a forward and the end of its backward, on top of
ZeRO-3's own shards and outside ``stage3_max_live_parameters``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from partita.config.base import ConfigError
from partita.distributed import collectives
from partita.distributed.topology import AXIS_ORDER, Axis, Topology
from partita.zero.gather_state import InFlight
from partita.zero.partition import ShardSpec

logger = logging.getLogger("partita")

# A row name of its own in the comms logger (no trailing parentheses: the summary folds those).
PURPOSE = "ZeRO-3 parameter all-gather within the hpZ group"
SpecOf = Callable[[nn.Parameter], ShardSpec]  # where a parameter's shard lies in its group's partition
_KEY = "zero_optimization.zero_hpz_partition_size"
_warned: list[int] = []  # the partition sizes warned about (see build_secondary_partition)


class SecondaryPartition:
    """This rank's hpZ copies (see [Note: the secondary partition]) and its group's collective."""

    def __init__(self, *, group: dist.ProcessGroup, size: int, rank: int, world_size: int) -> None:
        self.group = group
        self.size = size  # G
        self.rank = rank  # this rank's index in its hpZ group
        self.world_size = world_size  # W, the ZeRO group's size
        self.rows = world_size // size  # rows of each world gather this rank keeps
        self._copies: dict[nn.Parameter, torch.Tensor] = {}
        self._fills: set[int] = set()  # tickets of world gathers whose result fills copies

    def holds(self, param: nn.Parameter) -> bool:
        return param in self._copies

    def fill_from(self, ticket: int) -> None:
        """The world gather ``ticket`` is a training forward's unit gather: keep its rows on landing."""
        self._fills.add(ticket)

    @torch.no_grad()
    def landed(self, ticket: int, flight: InFlight, gathered: torch.Tensor, spec_of: SpecOf) -> None:
        """World gather ``ticket`` landed as (W, columns) values: keep this rank's rows if it fills copies."""
        if ticket not in self._fills:
            return
        self._fills.discard(ticket)
        lo = self.rank * self.rows
        for param, column in zip(flight.params, flight.columns):
            # A clone, never a view: a view would keep the whole gathered buffer alive.
            numel = spec_of(param).shard_numel
            self._copies[param] = gathered[lo : lo + self.rows, column : column + numel].clone(
                memory_format=torch.contiguous_format)

    def start_gather(self, params: list[nn.Parameter], spec_of: SpecOf) -> InFlight:
        """All-gather ``params``' copies inside the group: the (W, columns) rows the world gather gave."""
        local = torch.cat([self._copies[p] for p in params], dim=1)  # (W/G, columns), contiguous
        columns = [0]
        for param in params[:-1]:
            columns.append(columns[-1] + spec_of(param).shard_numel)
        gathered = torch.empty((self.size * self.rows, local.shape[1]), dtype=local.dtype, device=local.device)
        work = collectives.all_gather_into_tensor(gathered.view(-1), local.view(-1), group=self.group,
                                                  purpose=PURPOSE, async_op=True)
        return InFlight(work, gathered, params, columns, None)

    def drop(self) -> None:
        """The copies are stale from here on (the end of a backward, an optimizer step)."""
        self._copies.clear()
        self._fills.clear()

    def nbytes(self) -> int:
        """Bytes of the copies held now."""
        return sum(c.numel() * c.element_size() for c in self._copies.values())


def zero_group_rank_lists(topology: Topology) -> list[list[int]]:
    """Every ZeRO group's global ranks in ZeRO-rank order (one per pipeline x tensor position)."""
    zero_axes = (Axis.DATA, Axis.SEQUENCE)
    order = [AXIS_ORDER.index(a) for a in AXIS_ORDER if a not in zero_axes] + [AXIS_ORDER.index(a) for a in zero_axes]
    return topology.mesh.mesh.permute(*order).reshape(-1, topology.zero_size).tolist()


def check_partition_size(size: int, world_size: int) -> None:
    """Refuse a G that does not split the ZeRO group into equal groups."""
    if size > 1 and world_size % size:
        raise ConfigError(
            f"{_KEY} is {size}, which does not divide the data-parallel size {world_size} (data x sequence "
            f"ranks): hpZ splits those ranks into groups of {size} consecutive ranks. Set it to a divisor of "
            f"{world_size}, normally the ranks per node (GPUs per node), or to 1 to turn hpZ off"
        )


def build_secondary_partition(size: int, topology: Topology) -> SecondaryPartition | None:
    """The hpZ partition of ``size`` (None for 1: off). Every rank calls it (it creates process groups)."""
    if size <= 1:
        return None
    world = topology.zero_size
    check_partition_size(size, world)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.isdigit() and int(local) != size and topology.rank == 0 and not _warned:
        _warned.append(size)  # once per process: a job that builds several engines says it once
        logger.warning(
            "%s is %d but this node runs %s ranks (LOCAL_WORLD_SIZE): hpZ's backward gathers stay inside "
            "groups of %d consecutive ranks, which only avoids the links between nodes when a group is one "
            "node; set it to the ranks per node", _KEY, size, local, size)
    lists = [ranks[i : i + size] for ranks in zero_group_rank_lists(topology) for i in range(0, world, size)]
    group, _ = dist.new_subgroups_by_enumeration(lists)
    rank = dist.get_rank(group)
    if rank != topology.zero_rank % size:  # torch orders a group by global rank; ZeRO ranks ascend with it
        raise RuntimeError(
            f"partita: hpZ group rank {rank} differs from ZeRO rank {topology.zero_rank} mod {size} (internal "
            "invariant broken: the ZeRO group's ranks are expected in ascending global order)"
        )
    return SecondaryPartition(group=group, size=size, rank=rank, world_size=world)
