"""Normalise what users pass as ``model_parameters`` / an optimizer into checked param groups.

Accepted, as in DeepSpeed and torch: an iterable of parameters, an iterable of
param-group dicts (``{"params": [...], "lr": ..., "weight_decay": ...}``), or the
``param_groups`` of an optimizer instance. Frozen parameters (``requires_grad=False``)
are dropped: they take no part in the optimizer or in gradient reduction.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn


def normalize_param_groups(source: Iterable[Any], module: nn.Module) -> list[dict]:
    """Return ``[{"params": [trainable params...], **options}, ...]``, validated.

    Raises:
        ValueError: a parameter is not part of ``module``, appears in two groups, a group
            is malformed, or no trainable parameter remains.
    """
    items = list(source)
    if items and isinstance(items[0], dict):
        raw_groups = items
    else:
        raw_groups = [{"params": items}]
    in_module = {id(p): name for name, p in module.named_parameters(remove_duplicate=True)}
    seen: dict[int, int] = {}
    groups: list[dict] = []
    for g, raw in enumerate(raw_groups):
        if not isinstance(raw, dict) or "params" not in raw:
            raise ValueError(
                f"model_parameters[{g}] must be a dict with a 'params' key (a param group) or every item "
                f"must be a parameter; got {type(raw).__name__}"
            )
        params = raw["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        kept = []
        for p in params:
            if not isinstance(p, nn.Parameter):
                raise ValueError(f"param group {g} holds a {type(p).__name__}, not an nn.Parameter of the model")
            if id(p) not in in_module:
                raise ValueError(
                    f"param group {g} holds a parameter of shape {tuple(p.shape)} that is not part of the model "
                    "passed to initialize(); pass parameters from model.parameters()"
                )
            if id(p) in seen:
                if seen[id(p)] == g:
                    continue  # listed twice in one group (tied weights): keep once
                raise ValueError(
                    f"parameter '{in_module[id(p)]}' appears in param groups {seen[id(p)]} and {g}; "
                    "each parameter may belong to one group only"
                )
            seen[id(p)] = g
            if p.requires_grad:
                kept.append(p)
        if kept:
            groups.append({**{k: v for k, v in raw.items() if k != "params"}, "params": kept})
    if not groups:
        raise ValueError(
            "the model has no trainable parameters (every parameter given has requires_grad=False); "
            "unfreeze some parameters or pass the ones to train as model_parameters"
        )
    return groups


def registration_index(module: nn.Module) -> dict[nn.Parameter, int]:
    """Position of each parameter in ``module.parameters()`` (the order modules registered them)."""
    return {p: i for i, p in enumerate(module.parameters())}
