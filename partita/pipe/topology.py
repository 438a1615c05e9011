"""DeepSpeed's rank-grid classes (``deepspeed.runtime.pipe.topology``) and how a pipeline maps them
onto partita's mesh.

``ProcessTopology(axes, dims)`` numbers the cells of an ``axes``-named grid in row-major order:
the last axis varies fastest, so ``ProcessTopology(["x", "y"], [2, 3])`` puts ``(x=0, y=1)`` at
rank 1 and ``(x=1, y=0)`` at rank 3. Its queries (``get_rank``, ``get_coord``, ``filter_match``,
``get_axis_list``, ``get_axis_comm_lists``, ``get_dim``, ``get_rank_repr``, ``world_size``,
``str()``) answer as DeepSpeed 0.19.8's do; ``tests/fixtures/ds_topology_answers.json`` holds
DeepSpeed's own answers and the tests compare against them. Where DeepSpeed fails a bad query with
an ``assert`` or a stray ``AttributeError``, these raise ``ValueError`` naming the value.

The two specialisations are DeepSpeed's: ``PipeDataParallelTopology(num_pp, num_dp)`` has axes
``["pipe", "data"]``; ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` has axes
``["pipe", "data", "model"]`` (its constructor takes ``num_mp`` before ``num_dp`` but orders the
model axis last, so tensor-parallel ranks are adjacent).

These classes are a description of ranks, not process groups: partita's groups come from its
one mesh (:mod:`partita.distributed.topology`, axes pipe, data, sequence, tensor). A
:class:`partita.pipe.PipelineModule` given one of these is checked by :func:`mesh_sizes` to put
every rank where partita's mesh puts it (DeepSpeed's ``model`` axis is partita's ``tensor``).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology", "mesh_sizes"]


class ProcessTopology:
    """A named grid of ranks, numbered row-major (the last axis varies fastest)."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology needs one size per axis: axes={axes!r} has {len(axes)}, "
                             f"dims={dims!r} has {len(dims)}")
        if len(set(axes)) != len(axes) or not all(isinstance(a, str) and a.isidentifier() for a in axes):
            raise ValueError(f"ProcessTopology axes must be distinct identifiers, got {axes!r}")
        for axis, size in zip(axes, dims):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ProcessTopology axis {axis!r} has size {size!r}; every size must be an int >= 1")
        # Kept as given (DeepSpeed returns the caller's own list from get_axis_names()).
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        # Rank r's coordinate is the r-th cell of the row-major walk over the grid.
        self._coords = [self.ProcessCoord(*cell) for cell in itertools.product(*(range(d) for d in dims))]
        self.mapping = {coord: rank for rank, coord in enumerate(self._coords)}

    # ------------------------------------------------------------------ rank <-> coordinate
    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate: ``get_rank(pipe=1, data=0)``."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() does not support slices. Use filter_match())")
        unknown = sorted(set(coord_kwargs) - set(self.axes))
        if unknown:
            raise ValueError(f"get_rank(): unknown axes {unknown}; this topology's axes are {self.axes}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            grid = dict(zip(self.axes, self.dims))
            raise ValueError(f"get_rank(): coordinate {coord_kwargs} is outside the grid {grid}")
        return self.mapping[key]

    def get_coord(self, rank: int) -> Any:
        """The ``ProcessCoord`` namedtuple of ``rank`` (``coord.pipe``, ``coord.data``, ...)."""
        try:
            index = operator.index(rank)  # an int, or NumPy's / torch's integer scalars
        except TypeError:
            raise ValueError(f"rank {rank} not found in topology.") from None
        if not 0 <= index < len(self._coords):
            raise ValueError(f"rank {rank} not found in topology.")
        return self._coords[index]

    # ------------------------------------------------------------------ axes
    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_dim(self, axis: str) -> int:
        """Size of ``axis``; 0 for an axis this topology does not have (as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def world_size(self) -> int:
        return len(self._coords)

    # ------------------------------------------------------------------ rank lists
    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate along ``axis`` is ``idx``, in rank order."""
        position = self._axis_position(axis, "get_axis_list")
        return [rank for rank, coord in enumerate(self._coords) if coord[position] == idx]

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinate matches every given axis value, in rank order."""
        for axis in filter_kwargs:
            self._axis_position(axis, "filter_match")
        return [rank for rank, coord in enumerate(self._coords)
                if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """One rank list per combination of the other axes (in their order, row-major): the
        ranks that differ only along ``axis``, i.e. the members of one ``axis`` group.
        An axis the topology lacks gives ``[]`` (DeepSpeed's choice, so hybrid code can ask)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    # ------------------------------------------------------------------ text
    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """``"model_01"``-style name of ``rank``'s coordinate on the axes not omitted (DeepSpeed
        uses it in checkpoint file names)."""
        coord = self.get_coord(rank)
        omitted = frozenset(omit_axes)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes
                              if axis not in omitted)

    def __str__(self) -> str:
        return str(self.mapping)

    def _axis_position(self, axis: str, caller: str) -> int:
        if axis not in self.axes:
            raise ValueError(f"{caller}(): unknown axis {axis!r}; this topology's axes are {self.axes}")
        return self.axes.index(axis)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: axes ``["pipe", "data"]``, data ranks adjacent."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism: axes ``["pipe", "data", "model"]``."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


# DeepSpeed's axis names -> partita's mesh axes, outermost first (partita's order is pipe, data,
# sequence, tensor; a DeepSpeed data axis covers partita's data x sequence, the ZeRO group).
_PARTITA_AXIS = {"pipe": "pipe", "data": "data", "model": "tensor"}
_PARTITA_ORDER = ("pipe", "data", "model")
_FIX = ("build it as PipeModelDataParallelTopology(num_pp, num_mp, num_dp) (axes ['pipe', 'data', 'model']) "
        "or PipeDataParallelTopology(num_pp, num_dp), or pass num_stages=<int> instead of a topology")


def mesh_sizes(topology: Any, world_size: int) -> dict[str, int]:
    """``{"pipe": P, "data": D, "tensor": T}`` for a DeepSpeed-style topology (any object with
    ``get_axis_names()``, ``get_dim(axis)`` and ``get_coord(rank)``, DeepSpeed's own included).

    Raises ValueError, naming the problem and the fix, when the topology cannot be partita's mesh:
    an axis partita has no counterpart for, no ``pipe`` axis, sizes whose product is not the
    world size, or an axis order that puts some rank at another coordinate than partita's mesh
    (pipe outermost, then data, then tensor) does. Size-1 axes never move a rank, so
    ``ProcessTopology(["data", "pipe"], [1, 2])`` is accepted.
    """
    axes = list(topology.get_axis_names())
    unknown = [a for a in axes if a not in _PARTITA_AXIS]
    if unknown:
        raise ValueError(
            f"PipelineModule(topology=...): axes {unknown} have no partita counterpart (partita maps DeepSpeed's "
            f"'pipe', 'data' and 'model' onto its pipe, data and tensor axes); {_FIX}"
        )
    if "pipe" not in axes:
        raise ValueError(f"PipelineModule(topology=...): the topology has no 'pipe' axis (axes {axes}); {_FIX}")
    sizes = {a: topology.get_dim(a) for a in _PARTITA_ORDER}
    sizes = {a: (s if a in axes else 1) for a, s in sizes.items()}
    product = math.prod(topology.get_dim(a) for a in axes)
    if product != world_size:
        shape = " x ".join(f"{a}={topology.get_dim(a)}" for a in axes)
        raise ValueError(
            f"PipelineModule(topology=...): the topology's sizes {shape} = {product} ranks, but the job has "
            f"{world_size}: size the topology for {world_size} processes or launch {product}"
        )
    for rank in range(world_size):
        # partita's coordinate of `rank`: row-major over (pipe, data, tensor), tensor fastest.
        tensor = rank % sizes["model"]
        data = (rank // sizes["model"]) % sizes["data"]
        pipe = rank // (sizes["model"] * sizes["data"])
        ours = {"pipe": pipe, "data": data, "model": tensor}
        theirs = topology.get_coord(rank)
        if any(getattr(theirs, a) != ours[a] for a in axes):
            given = ", ".join(f"{a}={getattr(theirs, a)}" for a in axes)
            mesh = ", ".join(f"{a}={ours[a]}" for a in axes)
            raise ValueError(
                f"PipelineModule(topology=...): the axis order {axes} puts rank {rank} at ({given}) but partita's "
                f"mesh (pipe, data, tensor from outermost to innermost) puts it at ({mesh}); {_FIX}"
            )
    return {_PARTITA_AXIS[a]: s for a, s in sizes.items()}
