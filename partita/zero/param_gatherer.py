"""ZeRO stage 3: parameters live as 1/N shards and are gathered just in time, unit by unit.

[Note: units]
A *unit* is a module whose parameters are gathered together by one all-gather before its
forward (and again before its backward) and freed after. Units are the children of every
``nn.ModuleList`` (a transformer's repeated blocks), modules marked with
:func:`set_z3_leaf_modules` (MoE-style blocks gathered whole), and the root module for every
parameter not inside another unit. A parameter belongs to the innermost unit containing
it; a parameter shared by two units (tied weights) belongs to the root, which stays
gathered across the whole forward, so any use of it anywhere is safe. Gathering whole
subtrees (as FSDP2 does per block) rather than every module separately (as DeepSpeed
does) means fewer, larger collectives, and a forward that reads a child's parameter
directly still finds it gathered.

[Note: freeing storage in place]
Autograd saves parameter tensors for backward by reference. To free a parameter without
invalidating those references, its storage is resized to 0 bytes and resized back before
it is needed again; the ``nn.Parameter`` object, its shape and the model's state_dict keys
never change. Each parameter's state (SHARDED or GATHERED) is kept here, keyed by the
parameter, and every transition is checked.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from partita.distributed import collectives
from partita.zero.partition import ShardSpec
from partita.zero.shard_group import ShardedParamGroup, unpack_from_columns

logger = logging.getLogger("partita")

_LEAF_TYPES_ATTR = "_partita_z3_leaf_types"


def set_z3_leaf_modules(model: nn.Module, module_types: Sequence[type[nn.Module]]) -> None:
    """Mark modules of these types as ZeRO-3 units gathered whole (as DeepSpeed's function of
    the same name). Call before ``partita.initialize``."""
    for t in module_types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise ValueError(f"set_z3_leaf_modules expects nn.Module subclasses, got {t!r}")
    # Recorded on the model object (not on parameters) so initialize() can find it.
    setattr(model, _LEAF_TYPES_ATTR, tuple(module_types))


class ParamState(enum.Enum):
    SHARDED = "sharded"
    GATHERED = "gathered"


def find_units(model: nn.Module) -> list[nn.Module]:
    """The modules gathered as one piece, outermost first (the root is always first)."""
    leaf_types = getattr(model, _LEAF_TYPES_ATTR, ())
    units: list[nn.Module] = [model]
    seen = {id(model)}
    for module in model.modules():
        candidates: list[nn.Module] = []
        if isinstance(module, nn.ModuleList):
            candidates = list(module)
        elif leaf_types and isinstance(module, leaf_types):
            candidates = [module]
        for child in candidates:
            if id(child) not in seen and any(True for _ in child.parameters()):
                units.append(child)
                seen.add(id(child))
    return units


class _GatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward gathers the unit's parameters, so they are
    back before autograd reaches the unit's own backward."""

    @staticmethod
    def forward(ctx: Any, gatherer: ParameterGatherer, unit: nn.Module, *tensors: torch.Tensor):
        ctx.gatherer, ctx.unit = gatherer, unit
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        ctx.gatherer.gather_unit(ctx.unit)
        return (None, None) + grads


def _map_tensors(value: Any, fn) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


class ParameterGatherer:
    """Owns the sharded parameters of stage 3: their low-precision shards, gathering, freeing."""

    def __init__(
        self,
        model: nn.Module,
        groups: list[ShardedParamGroup],
        *,
        process_group,
        world_size: int,
        persistence_threshold: int,
    ) -> None:
        self._groups = groups
        self._process_group = process_group
        self._world_size = world_size
        self._where: dict[nn.Parameter, tuple[int, ShardSpec]] = {}
        for g, group in enumerate(groups):
            for param, spec in zip(group.params, group.layout.specs):
                self._where[param] = (g, spec)
        # Small parameters stay whole on every rank (DeepSpeed's persistence threshold):
        # gathering them costs more in latency than it saves in memory.
        self.persistent = {p for p in self._where if p.numel() <= persistence_threshold}
        # Each rank's low-precision shard of every parameter, what all-gathers read from.
        self.shards = [group.master.to(group.model_dtype) for group in groups]
        self._state: dict[nn.Parameter, ParamState] = {}
        self._unit_params = self._assign_units(model)
        for param in self._where:
            if param in self.persistent:
                continue
            self._own_storage(param)
            self._free(param)
            self._state[param] = ParamState.SHARDED
        self._hooks = []
        for unit, params in self._unit_params.items():
            if params:
                self._hooks.append(unit.register_forward_pre_hook(self._pre_forward))
                self._hooks.append(unit.register_forward_hook(self._post_forward))
        for param in self._state:
            # Registered after the reducer's hook on the same parameter, so the gradient is
            # already packed into its bucket when the full parameter is freed.
            self._hooks.append(param.register_post_accumulate_grad_hook(self._release_one))

    # ------------------------------------------------------------------ setup
    def _assign_units(self, model: nn.Module) -> dict[nn.Module, list[nn.Parameter]]:
        units = find_units(model)
        owner: dict[nn.Parameter, nn.Module] = {}
        for unit in units:  # outermost first: inner units overwrite
            for param in unit.parameters():
                if param in self._where and param not in self.persistent:
                    owner[param] = unit
        # A parameter reachable from two different non-root units (tied across blocks)
        # goes to the root, which stays gathered through forward and backward.
        for unit in units[1:]:
            for param in unit.parameters():
                if owner.get(param) is not None and owner[param] is not unit and not _is_inside(owner[param], unit):
                    owner[param] = model
        result: dict[nn.Module, list[nn.Parameter]] = {unit: [] for unit in units}
        for param, unit in owner.items():
            result[unit].append(param)
        return result

    @staticmethod
    def _own_storage(param: nn.Parameter) -> None:
        """Give the parameter a storage of its own, so freeing it frees nothing else."""
        data = param.data
        if data.storage_offset() != 0 or data.untyped_storage().nbytes() != data.numel() * data.element_size():
            param.data = data.clone()

    @staticmethod
    def _free(param: nn.Parameter) -> None:
        param.data.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, unit: nn.Module, args: Any) -> None:
        self.gather_unit(unit)

    def _post_forward(self, unit: nn.Module, args: Any, output: Any) -> Any:
        is_root = unit is next(iter(self._unit_params))
        if not torch.is_grad_enabled():
            self.release_unit(unit)  # no backward will follow (eval, no_grad)
            return output
        if not is_root:  # the root stays gathered until its gradients are produced
            self.release_unit(unit)
        tensors = []
        _map_tensors(output, lambda t: tensors.append(t) if t.requires_grad else None)
        if not tensors:
            return output
        wrapped = iter(_GatherBeforeBackward.apply(self, unit, *tensors) if len(tensors) > 1 else
                       (_GatherBeforeBackward.apply(self, unit, tensors[0]),))
        return _map_tensors(output, lambda t: next(wrapped) if t.requires_grad else t)

    def _release_one(self, param: nn.Parameter) -> None:
        if self._state.get(param) is ParamState.GATHERED:
            self._free(param)
            self._state[param] = ParamState.SHARDED

    # ------------------------------------------------------------------ gather / release
    def gather_unit(self, unit: nn.Module) -> None:
        self.gather(self._unit_params[unit])

    def release_unit(self, unit: nn.Module) -> None:
        self.release(self._unit_params[unit])

    @torch.no_grad()
    def gather(self, params: Iterable[nn.Parameter]) -> None:
        """All-gather every SHARDED parameter among ``params`` with one collective."""
        todo = [p for p in params if self._state.get(p) is ParamState.SHARDED]
        if not todo:
            return
        pieces, columns, column = [], [], 0
        for param in todo:
            g, spec = self._where[param]
            pieces.append(self.shards[g][spec.partition_offset : spec.partition_offset + spec.shard_numel])
            columns.append(column)
            column += spec.shard_numel
        local = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if self._world_size == 1:
            gathered = local.view(1, -1)
        else:
            gathered = torch.empty((self._world_size, column), dtype=local.dtype, device=local.device)
            collectives.all_gather_into_tensor(
                gathered.view(-1), local, group=self._process_group, purpose="ZeRO-3 parameter all-gather"
            )
        for param, col in zip(todo, columns):
            _, spec = self._where[param]
            param.data.untyped_storage().resize_(param.numel() * param.element_size())
            unpack_from_columns(gathered, col, spec, param)
            self._state[param] = ParamState.GATHERED

    def release(self, params: Iterable[nn.Parameter]) -> None:
        for param in params:
            state = self._state.get(param)
            if state is None:
                continue  # persistent: always whole
            if state is ParamState.GATHERED:
                self._free(param)
                self._state[param] = ParamState.SHARDED

    def release_all(self) -> None:
        """Free every gathered parameter (end of backward, end of an eval forward)."""
        self.release(list(self._state))

    def num_gathered(self) -> int:
        """Elements of non-persistent parameters currently held whole on this rank."""
        return sum(p.numel() for p, s in self._state.items() if s is ParamState.GATHERED)

    def state_of(self, param: nn.Parameter) -> ParamState | None:
        return self._state.get(param)

    def is_sharded_param(self, param: nn.Parameter) -> bool:
        """True for parameters that live as shards (not persistent)."""
        return param in self._state

    @torch.no_grad()
    def refresh_shards(self) -> None:
        """After an optimizer step: the low-precision shards follow the fp32 master."""
        for shard, group in zip(self.shards, self._groups):
            shard.copy_(group.master)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _is_inside(inner: nn.Module, outer: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())
