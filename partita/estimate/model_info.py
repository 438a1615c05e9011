"""The facts about a model the estimator needs, read the way partita reads them.

From an ``nn.Module`` (any device, including ``meta``): the trainable parameters per optimizer
group with their registration index (partita lays each group out in reverse registration
order and buckets gradients in that order), frozen parameters, buffers, and the ZeRO-3 unit
each parameter belongs to (the rule of ``partita.zero.param_gatherer``). A :class:`GPTShape`
is turned into partita's own GPT built on the meta device, so its parameter shapes are
exact without allocating anything. A bare parameter count becomes one flat parameter: the
padding (at most ``world_size - 1`` elements per parameter) is then only approximate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable

import torch
from torch import nn

from partita.estimate.inputs import EstimateError, GPTShape

__all__ = ["CHUNK_NUMEL", "FrozenInfo", "ModelInfo", "ParamInfo", "model_info"]

CHUNK_NUMEL = 2**24
"""Elements per stand-in parameter when only a parameter count is known (a 4096 x 4096 matrix)."""


@dataclass(frozen=True)
class ParamInfo:
    """One trainable parameter: its shape, its position in ``module.parameters()`` and its ZeRO-3 unit."""

    name: str
    shape: torch.Size
    numel: int
    order: int
    unit: int  # index into ModelInfo.units; 0 is the root


@dataclass(frozen=True)
class FrozenInfo:
    """One parameter no optimizer group holds: its size, its ZeRO-3 unit, and whether it was built
    under ``partita.zero.Init`` (then ZeRO-3 keeps it sharded: partita/zero/frozen_params.py)."""

    name: str
    shape: torch.Size
    numel: int
    unit: int
    zero_init: bool


@dataclass(frozen=True)
class ModelInfo:
    """What the estimator knows about a model.

    Attributes:
        description: one line for reports.
        groups: trainable parameters per optimizer group.
        frozen_numel: elements of parameters that do not train (kept whole, in the model dtype).
        float_buffer_numel: elements of floating-point buffers (cast to the model dtype).
        other_buffer_bytes: bytes of integer/bool buffers (never cast).
        num_units: ZeRO-3 units (root + each ModuleList child + leaf modules).
        unit_order: units in the order a forward runs them (the root first).
        gpt: the GPT shape when known (activations can then be counted).
        exact_layout: False for a bare parameter count (stand-in parameters).
        frozen: the frozen parameters one by one (their elements sum to ``frozen_numel``).
    """

    description: str
    groups: tuple[tuple[ParamInfo, ...], ...]
    frozen_numel: int
    float_buffer_numel: int
    other_buffer_bytes: int
    num_units: int
    gpt: GPTShape | None = None
    exact_layout: bool = True
    frozen: tuple[FrozenInfo, ...] = ()

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for g in self.groups for p in g)

    @property
    def total_numel(self) -> int:
        return self.trainable_numel + self.frozen_numel

    def params(self) -> Iterable[ParamInfo]:
        for group in self.groups:
            yield from group


def model_info(
    model: nn.Module | GPTShape | int,
    *,
    param_groups: list[Any] | None = None,
) -> ModelInfo:
    """Read ``model``: a module, a GPT shape or a number of parameters.

    ``param_groups``: for a module, the groups given to ``partita.initialize`` (lists of
    parameters or ``{"params": [...]}`` dicts); default one group of every trainable
    parameter. A GPT shape uses its ``optimizer_param_groups`` (decay / no decay), as the
    example training script does.
    """
    if isinstance(model, GPTShape):
        module = _meta_gpt(model)
        info = _from_module(module, module.optimizer_param_groups(0.0), description=_describe_gpt(model, module))
        return replace(info, gpt=model)
    if isinstance(model, nn.Module):
        return _from_module(model, param_groups, description=f"{type(model).__name__} module")
    if isinstance(model, bool) or not isinstance(model, int):
        raise EstimateError(
            f"model must be an nn.Module, a GPTShape or a parameter count (int), got {type(model).__name__}"
        )
    if model < 1:
        raise EstimateError(f"parameter count must be >= 1, got {model}")
    # Stand-in parameters of CHUNK_NUMEL elements: buckets and padding then behave as for a
    # real model's weight matrices (one giant parameter would be a bucket of its own).
    sizes = [CHUNK_NUMEL] * (model // CHUNK_NUMEL) + ([model % CHUNK_NUMEL] if model % CHUNK_NUMEL else [])
    chunks = tuple(ParamInfo(f"params[{i}]", torch.Size([n]), n, i, 0) for i, n in enumerate(sizes))
    return ModelInfo(
        description=f"{model:,} parameters (no shape: approximated by tensors of {CHUNK_NUMEL:,} elements)",
        groups=(chunks,), frozen_numel=0, float_buffer_numel=0, other_buffer_bytes=0, num_units=1,
        exact_layout=False,
    )


def _meta_gpt(shape: GPTShape) -> nn.Module:
    from partita.models.gpt import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=shape.vocab, block_size=shape.seq_len, n_layer=shape.n_layers, n_head=shape.n_heads,
        n_embd=shape.d_model, dropout=shape.dropout, bias=shape.bias,
    )
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        return GPT(config)


def _describe_gpt(shape: GPTShape, module: nn.Module) -> str:
    count = sum(p.numel() for p in module.parameters())
    return (
        f"GPT d_model={shape.d_model} n_layers={shape.n_layers} n_heads={shape.n_heads} vocab={shape.vocab} "
        f"seq_len={shape.seq_len} ({count:,} parameters)"
    )


def _from_module(module: nn.Module, param_groups: list[Any] | None, *, description: str) -> ModelInfo:
    names = {p: n for n, p in module.named_parameters()}
    order = {p: i for i, p in enumerate(module.parameters())}  # partita.param_groups.registration_index
    raw = _normalize_groups(param_groups, module)
    trained = {p for g in raw for p in g}
    frozen_params = [p for p in module.parameters() if p not in trained]
    unit_of, num_units = _units(module, trained | set(frozen_params))
    groups = []
    for g in raw:
        groups.append(tuple(
            ParamInfo(names[p], p.shape, p.numel(), order[p], unit_of[p]) for p in g
        ))
    from partita.zero.init_context import init_shard_of  # built under zero.Init: it holds this rank's shard

    frozen = tuple(FrozenInfo(names[p], p.shape, p.numel(), unit_of[p], init_shard_of(p) is not None)
                   for p in frozen_params)
    float_buffers = sum(b.numel() for b in module.buffers() if b.is_floating_point())
    other_buffers = sum(b.numel() * b.element_size() for b in module.buffers() if not b.is_floating_point())
    return ModelInfo(
        description=description, groups=tuple(groups), frozen_numel=sum(f.numel for f in frozen),
        float_buffer_numel=float_buffers, other_buffer_bytes=other_buffers, num_units=num_units, frozen=frozen,
    )


def _normalize_groups(param_groups: list[Any] | None, module: nn.Module) -> list[list[nn.Parameter]]:
    """partita.param_groups.normalize_param_groups, which also drops frozen parameters and
    checks membership; reused so the estimate sees the groups initialize() would build."""
    from partita.param_groups import normalize_param_groups

    source = module.parameters() if param_groups is None else param_groups
    try:
        return [list(g["params"]) for g in normalize_param_groups(source, module)]
    except ValueError as error:
        raise EstimateError(str(error)) from error


def _units(module: nn.Module, trainable: set[nn.Parameter]) -> tuple[dict[nn.Parameter, int], int]:
    """Each parameter's (of ``trainable``: trainable and frozen ones) ZeRO-3 unit, by
    ParameterGatherer._assign_units' rule: the innermost unit containing it, or the root when two
    units that do not nest share it.
    (Persistent parameters are simply left out of their unit later.)"""
    from partita.zero.units import find_units

    units = find_units(module)
    owner: dict[nn.Parameter, nn.Module] = {}
    for unit in units:  # outermost first: inner units overwrite
        for param in unit.parameters():
            if param in trainable:
                owner[param] = unit
    for unit in units[1:]:
        inside = {id(m) for m in unit.modules()}
        for param in unit.parameters():
            if param in owner and owner[param] is not unit and id(owner[param]) not in inside:
                owner[param] = module
    index = {id(u): i for i, u in enumerate(units)}
    return {p: index[id(u)] for p, u in owner.items()}, len(units)
