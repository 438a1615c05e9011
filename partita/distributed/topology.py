"""The job's layout of ranks: one object over torch's DeviceMesh with named axes.

Every strategy asks this object for its group ("give me the tensor-parallel group") instead of
building process groups itself, so adding a parallelism changes this file and not its callers.

Axes, outermost to innermost: ``pipe``, ``data``, ``sequence``, ``tensor``. The innermost axis
gets adjacent ranks, which share a node, so the chattiest parallelism (tensor: collectives inside
every layer) comes last and pipeline (point-to-point between stages) first, as in Megatron's
``tp-cp-dp-pp`` order and torchtitan's meshes. Only ``data`` may be left unsized: it takes the
ranks the others leave.

Groups that are not one mesh axis are *views* of the same ranks, never new factors:

- the ZeRO group, ``data x sequence``: sequence ranks hold the same weights and see different
  tokens of the same samples, so their gradients are reduced (and ZeRO partitions sharded)
  together with the data ranks';
- the expert groups (:meth:`Topology.expert_groups`): experts borrow their ranks from
  ``data x sequence`` (Megatron's "MoE parallel folding"); ``ep_size`` consecutive ranks of the
  ZeRO group form an expert group, and ranks at the same position in each expert group form an
  expert-data group that reduces the gradients of the same experts.

These views are built with ``dist.new_subgroups_by_enumeration`` over rank lists read from the
mesh (public API); DeviceMesh's ``_flatten`` / ``_unflatten`` are private, so nothing here uses them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["AXIS_ORDER", "Axis", "ExpertGroups", "Topology", "build_topology", "resolve_mesh_shape"]


class Axis(str, Enum):
    """Names of the mesh axes; the string values are DeviceMesh's ``mesh_dim_names``."""

    PIPE = "pipe"
    DATA = "data"
    SEQUENCE = "sequence"
    TENSOR = "tensor"


# Outermost first (see the module docstring for why this order).
AXIS_ORDER: tuple[Axis, ...] = (Axis.PIPE, Axis.DATA, Axis.SEQUENCE, Axis.TENSOR)

# Which config key sets each axis, for errors that tell the user what to change.
_AXIS_SOURCES: dict[Axis, str] = {
    Axis.PIPE: "pipeline.stages",
    Axis.DATA: "inferred: world size / the others",
    Axis.SEQUENCE: "sequence_parallel_size",
    Axis.TENSOR: "tensor_parallel.autotp_size",
}


def resolve_mesh_shape(*, world_size: int, sizes: Mapping[Axis, int | None]) -> dict[Axis, int]:
    """Sizes of every axis, in :data:`AXIS_ORDER`; an axis not given has size 1, except that at
    most one axis may be ``None`` and is inferred.

    The inferred axis (normally ``data``) takes ``world_size / product(others)``. Raises
    ValueError naming every factor (and the config key behind it) when the product cannot equal
    ``world_size``, so a user sees which setting to change rather than a bare "mesh mismatch".
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    unknown = [axis for axis in sizes if axis not in AXIS_ORDER]
    if unknown:
        raise ValueError(f"unknown mesh axes {unknown}; known axes: {[a.value for a in AXIS_ORDER]}")
    given = {axis: sizes.get(axis, 1) for axis in AXIS_ORDER}
    inferred = [axis for axis, size in given.items() if size is None]
    if len(inferred) > 1:
        raise ValueError(
            f"only one mesh axis size can be inferred, but {[a.value for a in inferred]} are unset; "
            "give all but one a size"
        )
    for axis, size in given.items():
        if size is not None and size < 1:
            raise ValueError(f"mesh axis {axis.value!r} has size {size}; every axis size must be >= 1")

    fixed = math.prod(size for size in given.values() if size is not None)
    factors = " x ".join(
        f"{axis.value}={'?' if size is None else size} ({_AXIS_SOURCES[axis]})" for axis, size in given.items()
    )
    if inferred:
        if world_size % fixed != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by {fixed} = {factors}; choose axis sizes "
                f"whose product divides {world_size}, or launch a multiple of {fixed} processes"
            )
        given[inferred[0]] = world_size // fixed
    elif fixed != world_size:
        raise ValueError(
            f"mesh axes {factors} = {fixed} do not multiply to the world size {world_size}; "
            "change the axis sizes or the number of processes"
        )
    return {axis: int(size) for axis, size in given.items()}  # type: ignore[arg-type]


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel views of the ZeRO group (``data x sequence``).

    ``expert_group``: the ``ep_size`` ranks whose experts together make the layer's experts
    (tokens travel between them by all-to-all); ``expert_rank`` is this rank's index there, so it
    holds experts ``expert_rank * n_local .. (expert_rank + 1) * n_local - 1``.
    ``expert_data_group``: the ranks holding the same experts, which reduce (and ZeRO-shard)
    those experts' gradients; ``zero size / ep_size`` ranks.
    """

    ep_size: int
    expert_group: dist.ProcessGroup
    expert_rank: int
    expert_data_group: dist.ProcessGroup
    expert_data_size: int
    expert_data_rank: int


class Topology:
    """Named axes over one DeviceMesh; the only place strategies get process groups from."""

    def __init__(self, mesh: DeviceMesh) -> None:
        names = mesh.mesh_dim_names or ()
        if tuple(names) != tuple(axis.value for axis in AXIS_ORDER):
            raise ValueError(
                f"mesh dims {names} do not match partita's axes {[a.value for a in AXIS_ORDER]}; "
                "build the mesh with build_topology()"
            )
        self._mesh = mesh
        self._expert_groups: dict[int, ExpertGroups] = {}
        # Built now, while every rank is here: creating a group is collective over the world.
        self._zero_group = (
            _enumerate_groups(self._ranks_across((Axis.DATA, Axis.SEQUENCE))) if self.sequence_size > 1 else None
        )

    # ------------------------------------------------------------------ the mesh
    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

    def submesh(self, *axes: Axis | str) -> DeviceMesh:
        """The sub-mesh over ``axes`` (a 1-D mesh for one axis, as ``parallelize_module`` wants)."""
        names = tuple(Axis(axis).value for axis in axes)
        return self._mesh[names[0]] if len(names) == 1 else self._mesh[names]

    @property
    def world_size(self) -> int:
        return self._mesh.size()

    @property
    def rank(self) -> int:
        """Global rank in the default process group."""
        return self._mesh.get_rank()

    def axis_size(self, axis: Axis | str) -> int:
        return self._mesh.size(AXIS_ORDER.index(Axis(axis)))

    def axis_rank(self, axis: Axis | str) -> int:
        return self._mesh.get_local_rank(Axis(axis).value)

    def axis_group(self, axis: Axis | str) -> dist.ProcessGroup:
        return self._mesh.get_group(Axis(axis).value)

    def coordinate(self) -> dict[Axis, int]:
        """This rank's index along every axis."""
        return {axis: self.axis_rank(axis) for axis in AXIS_ORDER}

    def is_model_parallel(self) -> bool:
        """True when some axis other than data splits the model or its inputs."""
        return any(self.axis_size(axis) > 1 for axis in AXIS_ORDER if axis is not Axis.DATA)

    # ------------------------------------------------------------------ one property per axis
    @property
    def data_size(self) -> int:
        return self.axis_size(Axis.DATA)

    @property
    def data_rank(self) -> int:
        return self.axis_rank(Axis.DATA)

    @property
    def data_group(self) -> dist.ProcessGroup:
        return self.axis_group(Axis.DATA)

    @property
    def tensor_size(self) -> int:
        return self.axis_size(Axis.TENSOR)

    @property
    def tensor_rank(self) -> int:
        return self.axis_rank(Axis.TENSOR)

    @property
    def tensor_group(self) -> dist.ProcessGroup:
        return self.axis_group(Axis.TENSOR)

    @property
    def sequence_size(self) -> int:
        return self.axis_size(Axis.SEQUENCE)

    @property
    def sequence_rank(self) -> int:
        return self.axis_rank(Axis.SEQUENCE)

    @property
    def sequence_group(self) -> dist.ProcessGroup:
        return self.axis_group(Axis.SEQUENCE)

    @property
    def pipe_size(self) -> int:
        return self.axis_size(Axis.PIPE)

    @property
    def pipe_rank(self) -> int:
        return self.axis_rank(Axis.PIPE)

    @property
    def pipe_group(self) -> dist.ProcessGroup:
        return self.axis_group(Axis.PIPE)

    # ------------------------------------------------------------------ views over several axes
    @property
    def zero_size(self) -> int:
        """Ranks that hold the same weights and split the samples or tokens: data x sequence."""
        return self.data_size * self.sequence_size

    @property
    def zero_rank(self) -> int:
        """Index in the ZeRO group; data-major, so it equals ``data_rank`` without a sequence axis."""
        return self.data_rank * self.sequence_size + self.sequence_rank

    @property
    def zero_group(self) -> dist.ProcessGroup:
        """The group ZeRO reduces gradients over and shards its partitions across (data x sequence)."""
        return self.data_group if self._zero_group is None else self._zero_group

    def zero_group_ranks(self) -> list[int]:
        """Global ranks of this rank's ZeRO group, in ZeRO-rank order."""
        grid = self._mesh.mesh.permute(*self._keep_last((Axis.DATA, Axis.SEQUENCE)))
        coordinate = self.coordinate()
        index = tuple(coordinate[a] for a in AXIS_ORDER if a not in (Axis.DATA, Axis.SEQUENCE))
        return [int(r) for r in grid[index].reshape(-1).tolist()]

    def expert_groups(self, ep_size: int) -> ExpertGroups:
        """The expert and expert-data groups for ``ep_size`` (built once per size, on every rank).

        Every rank must call this with the same ``ep_size`` in the same order (it creates process
        groups). ``ep_size`` must divide the ZeRO group's size (data x sequence).
        """
        if ep_size < 1 or self.zero_size % ep_size != 0:
            raise ValueError(
                f"ep_size={ep_size} must be >= 1 and divide the data-parallel size {self.zero_size} "
                f"(data {self.data_size} x sequence {self.sequence_size}); choose a divisor of {self.zero_size}"
            )
        if ep_size not in self._expert_groups:
            lists = self._ranks_across((Axis.DATA, Axis.SEQUENCE))  # one list per (pipe, tensor) position
            # Inside each ZeRO group: consecutive blocks of ep_size are expert groups, strided
            # positions are expert-data groups.
            expert_lists = [ranks[i : i + ep_size] for ranks in lists for i in range(0, len(ranks), ep_size)]
            expert_data_lists = [ranks[j::ep_size] for ranks in lists for j in range(ep_size)]
            expert_group = _enumerate_groups(expert_lists)
            expert_data_group = _enumerate_groups(expert_data_lists)
            zero_rank = self.zero_rank
            self._expert_groups[ep_size] = ExpertGroups(
                ep_size=ep_size,
                expert_group=expert_group,
                expert_rank=zero_rank % ep_size,
                expert_data_group=expert_data_group,
                expert_data_size=self.zero_size // ep_size,
                expert_data_rank=zero_rank // ep_size,
            )
        return self._expert_groups[ep_size]

    def _keep_last(self, axes: tuple[Axis, ...]) -> list[int]:
        """A permutation of the mesh dims that moves ``axes`` (in order) to the end."""
        rest = [AXIS_ORDER.index(a) for a in AXIS_ORDER if a not in axes]
        return rest + [AXIS_ORDER.index(a) for a in axes]

    def _ranks_across(self, axes: tuple[Axis, ...]) -> list[list[int]]:
        """Every group of ranks that differ only along ``axes`` (row-major over ``axes``)."""
        grid = self._mesh.mesh.permute(*self._keep_last(axes))
        width = math.prod(self.axis_size(a) for a in axes)
        return [[int(r) for r in row] for row in grid.reshape(-1, width).tolist()]

    def describe(self) -> str:
        """``pipe=1 data=2 sequence=1 tensor=2``: the layout, for logs and monitors."""
        return " ".join(f"{a.value}={self.axis_size(a)}" for a in AXIS_ORDER)

    def __repr__(self) -> str:
        axes = ", ".join(f"{a.value}={self.axis_size(a)}" for a in AXIS_ORDER)
        return f"Topology(rank={self.rank}/{self.world_size}, {axes}, device_type={self._mesh.device_type!r})"


def _enumerate_groups(rank_lists: list[list[int]]) -> dist.ProcessGroup:
    """This rank's group among ``rank_lists`` (a partition of the world); every rank calls it."""
    group, _ = dist.new_subgroups_by_enumeration(rank_lists)
    return group


def build_topology(*, device_type: str, sizes: Mapping[Axis, int | None] | None = None) -> Topology:
    """The job's topology over the already-initialized default process group.

    ``sizes`` gives the model-parallel axes (pipe, sequence, tensor; default 1 each); the data
    axis takes the rest. Requires :func:`partita.distributed.init.init_distributed` first:
    DeviceMesh would otherwise start a process group itself with default backend and timeout,
    bypassing the user's ``distributed`` config.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call partita.distributed.init_distributed() "
            "before build_topology()"
        )
    requested = {Axis.DATA: None, **{Axis(k): v for k, v in (sizes or {}).items()}}
    shape = resolve_mesh_shape(world_size=dist.get_world_size(), sizes=requested)
    mesh = init_device_mesh(
        device_type,
        tuple(shape[axis] for axis in AXIS_ORDER),
        mesh_dim_names=tuple(axis.value for axis in AXIS_ORDER),
    )
    return Topology(mesh)

