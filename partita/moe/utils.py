"""DeepSpeed's MoE parameter-group helpers (``deepspeed.moe.utils``), over partita's registry.

Under partita, ZeRO already splits every optimizer group by the process group its
parameters reduce over (expert parameters over their expert-data group), so calling
:func:`split_params_into_different_moe_groups_for_optimizer` is optional; it exists so code
written for DeepSpeed runs unchanged, and to give expert groups options of their own.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from partita.moe.registry import is_moe_param, owner_layer

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict | list | tuple, max_group_size: int | None = None
) -> list[dict[str, Any]]:
    """Move expert parameters out of each group into groups of their own, as DeepSpeed does.

    Each input group keeps its dense parameters; its expert parameters go to new groups
    (appended after all the input groups) with the same options plus ``"moe": True`` and
    ``"name": "ep_size_<n>"``, one per expert-parallel size. ``max_group_size`` (elements)
    further cuts each expert group, as in DeepSpeed. Accepts one group dict or a list of them.
    """
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    if max_group_size is not None and max_group_size < 1:
        raise ValueError(f"max_group_size={max_group_size} must be >= 1 element (or None)")
    dense_groups: list[dict[str, Any]] = []
    moe_groups: list[dict[str, Any]] = []
    for g, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"param_groups[{g}] must be a dict with a 'params' key, got {type(group).__name__}")
        params = list(group["params"]) if not isinstance(group["params"], nn.Parameter) else [group["params"]]
        options = {key: value for key, value in group.items() if key != "params"}
        dense_groups.append({**options, "params": [p for p in params if not is_moe_param(p)]})
        by_name: dict[str, list[nn.Parameter]] = {}
        for param in params:
            layer = owner_layer(param)
            if is_moe_param(param):
                by_name.setdefault(f"ep_size_{layer.ep_size}", []).append(param)
        for name, expert_params in by_name.items():
            for chunk in _cut(expert_params, max_group_size):
                moe_groups.append({**options, "params": chunk, "name": name, "moe": True})
    return [g for g in dense_groups if g["params"]] + moe_groups


def _cut(params: list[nn.Parameter], max_numel: int | None) -> list[list[nn.Parameter]]:
    if max_numel is None:
        return [params]
    chunks: list[list[nn.Parameter]] = [[]]
    size = 0
    for param in params:
        if chunks[-1] and size + param.numel() > max_numel:
            chunks.append([])
            size = 0
        chunks[-1].append(param)
        size += param.numel()
    return chunks
