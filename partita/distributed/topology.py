"""The job's layout of ranks: one object over torch's DeviceMesh with named axes.

Every strategy asks this object for its group ("give me the data-parallel group") instead of
building process groups itself, so adding a parallelism dimension changes this file and
not its callers. Today the only axis is ``data``; pipe, tensor, sequence and expert axes
join :class:`Axis` and :data:`AXIS_ORDER` when they are implemented, each with a size, and
:func:`resolve_mesh_shape` already checks that the sizes multiply to the world size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import Enum

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["AXIS_ORDER", "Axis", "Topology", "build_topology", "resolve_mesh_shape"]


class Axis(str, Enum):
    """Names of the mesh axes; the string values are DeviceMesh's ``mesh_dim_names``."""

    DATA = "data"


# Outermost first. Order matters for locality: the innermost axis gets adjacent ranks,
# which share a node, so the chattiest parallelism (tensor, later) must come last.
AXIS_ORDER: tuple[Axis, ...] = (Axis.DATA,)


def resolve_mesh_shape(*, world_size: int, sizes: Mapping[Axis, int | None]) -> dict[Axis, int]:
    """Sizes of every axis, in :data:`AXIS_ORDER`, with at most one ``None`` inferred.

    The inferred axis (normally ``data``) takes ``world_size / product(others)``. Raises
    ValueError naming every factor when the product cannot equal ``world_size``, so a user
    sees which setting to change rather than a bare "mesh mismatch".
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
    factors = " x ".join(f"{axis.value}={'?' if size is None else size}" for axis, size in given.items())
    if inferred:
        if world_size % fixed != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by {fixed} ({factors}); choose axis sizes "
                f"whose product divides {world_size}"
            )
        given[inferred[0]] = world_size // fixed
    elif fixed != world_size:
        raise ValueError(
            f"mesh axes {factors} = {fixed} do not multiply to the world size {world_size}; "
            "change the axis sizes or the number of processes"
        )
    return {axis: int(size) for axis, size in given.items()}  # type: ignore[arg-type]


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

    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

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

    @property
    def data_size(self) -> int:
        return self.axis_size(Axis.DATA)

    @property
    def data_rank(self) -> int:
        return self.axis_rank(Axis.DATA)

    @property
    def data_group(self) -> dist.ProcessGroup:
        return self.axis_group(Axis.DATA)

    def __repr__(self) -> str:
        axes = ", ".join(f"{a.value}={self.axis_size(a)}" for a in AXIS_ORDER)
        return f"Topology(rank={self.rank}/{self.world_size}, {axes}, device_type={self._mesh.device_type!r})"


def build_topology(*, device_type: str) -> Topology:
    """The job's topology over the already-initialized default process group.

    Requires :func:`partita.distributed.init.init_distributed` first: DeviceMesh would
    otherwise start a process group itself with default backend and timeout, bypassing the
    user's ``distributed`` config.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call partita.distributed.init_distributed() "
            "before build_topology()"
        )
    shape = resolve_mesh_shape(world_size=dist.get_world_size(), sizes={Axis.DATA: None})
    mesh = init_device_mesh(
        device_type,
        tuple(shape[axis] for axis in AXIS_ORDER),
        mesh_dim_names=tuple(axis.value for axis in AXIS_ORDER),
    )
    return Topology(mesh)
