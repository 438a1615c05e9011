"""ZeRO-3's units, shared by everything that works block by block.

A *unit* is a module handled as one piece: the children of every ``nn.ModuleList`` (a
transformer's repeated blocks), modules marked with :func:`set_z3_leaf_modules`, and the root
for everything else (see [Note: units] in partita/zero/param_gatherer.py). ZeRO-3 gathers them
(param_gatherer.py), one-rank ZeRO 0-2 frees their weights between forward and backward
(one_rank_weights.py), the offload overlap waits for them (offload/overlapped_step.py), and
compile and the estimator find blocks with them.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
from torch import nn


class BeforeBackward(Protocol):
    def on_pre_backward(self, unit: nn.Module) -> None: ...


_LEAF_TYPES_ATTR = "_partita_z3_leaf_types"


def set_z3_leaf_modules(model: nn.Module, module_types: Sequence[type[nn.Module]]) -> None:
    """Mark modules of these types as ZeRO-3 units gathered whole (as DeepSpeed's function of
    the same name). Call before ``partita.initialize``."""
    for t in module_types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise ValueError(f"set_z3_leaf_modules expects nn.Module subclasses, got {t!r}")
    # Recorded on the model object (not on parameters) so initialize() can find it.
    setattr(model, _LEAF_TYPES_ATTR, tuple(module_types))


def find_units(model: nn.Module) -> list[nn.Module]:
    """The modules gathered as one piece, outermost first (the root is always first)."""
    leaf_types = getattr(model, _LEAF_TYPES_ATTR, ())
    units: list[nn.Module] = [model]
    seen = {id(model)}
    # A model whose forward never runs as a whole (a pipeline stage, partita/pipe/module.py: torch's
    # PipelineStage calls its chunks) names its units itself; units inside those are found below.
    own = getattr(model, "zero3_units", None)
    if callable(own):
        for unit in own():
            if id(unit) not in seen and any(True for _ in unit.parameters()):
                units.append(unit)
                seen.add(id(unit))
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


class _UnitIdentity(torch.autograd.Function):
    """Identity on some of a unit's tensors whose backward (a subclass's) tells ``owner`` about
    ``unit``; autograd runs it once the gradients of those tensors exist."""

    @staticmethod
    def forward(ctx: Any, owner: Any, unit: nn.Module, *tensors: torch.Tensor):
        ctx.owner, ctx.unit = owner, unit
        # Outputs that backward never reaches (the logits beside a loss) get no gradient: by
        # default autograd would materialise zeros of their size at the start of backward,
        # the memory peak (1.5 GiB for GPT-1.3B's bf16 logits at micro-batch 8).
        ctx.set_materialize_grads(False)
        return tensors if len(tensors) != 1 else tensors[0]


class GatherBeforeBackward(_UnitIdentity):
    """On a unit's outputs: its backward gathers the unit's parameters (``owner``:
    :class:`BeforeBackward`), so they are back before autograd reaches the unit's own backward."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        ctx.owner.on_pre_backward(ctx.unit)
        return (None, None) + grads


class ReleaseAfterBackward(_UnitIdentity):
    """On a unit's inputs: its backward runs once autograd has the inputs' gradients, after the
    unit's own backward, and frees the unit's frozen parameters, which get no gradient hook (see
    [Note: frozen parameters at ZeRO-3] in partita/zero/frozen_params.py)."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        ctx.owner.on_post_backward(ctx.unit)
        return (None, None) + grads


def through_function(function: type[torch.autograd.Function], owner: Any, unit: nn.Module, value: Any) -> Any:
    """``value`` (a tensor or container, which keeps its types: partita/tensor_containers.py) with
    its tensors that require grad passed through one ``function.apply(owner, unit, *tensors)``;
    None when there are none."""
    from partita.tensor_containers import map_tensors, tensors_in

    tensors = [t for t in tensors_in(value) if t.requires_grad]
    if not tensors:
        return None
    wrapped = function.apply(owner, unit, *tensors)
    replacement = {id(t): w for t, w in zip(tensors, wrapped if len(tensors) > 1 else (wrapped,))}
    return map_tensors(value, lambda t: replacement.get(id(t), t))


def is_inside(inner: nn.Module, outer: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def unit_names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    """How error messages name each unit: its dotted path in the model, and its class."""
    paths = {id(module): name for name, module in model.named_modules()}
    return [
        f"'{paths[id(u)]}' ({type(u).__name__})" if paths.get(id(u)) else f"the model itself ({type(u).__name__})"
        for u in units
    ]


def in_backward_pass() -> bool:
    """True while autograd runs a backward on this thread (where activation checkpointing
    recomputes a unit's forward)."""
    return torch._C._current_graph_task_id() != -1
