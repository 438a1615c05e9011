"""The layer list of a pipeline checkpoint, and its keys in a plain ``nn.Sequential`` of the layers.

A pipeline checkpoint (partita/pipe/checkpoint.py) keys everything by the PipelineModule's
state_dict names: ``"<i>.<name>"`` for layer ``i`` of the layer list (its global index, the same
at every stage count) and ``"tied_modules.<key>.<name>"`` for the module a ``TiedLayerSpec`` key
shares between its positions. meta.json's ``pipeline`` section records the list:

    {"num_layers": L, "num_stages": p, "virtual_stages": v, "parts": [...],
     "layers": [{"type": "Block", "tie": null | "<key>", "module": true | false}, ...]}

``module`` says whether the position runs a module of its own in ``nn.Sequential(*layers)``:
true for a LayerSpec or a built nn.Module, and for a TiedLayerSpec without ``forward_fn`` (the
shared module itself at that position); false for a TiedLayerSpec with ``forward_fn`` and for a
plain callable, whose Sequential stand-in must be a module without parameters of its own.

[Note: pipeline keys in a plain nn.Sequential]
``nn.Sequential`` of the same layers (tied modules passed as the same object at every position
without ``forward_fn``) names layer ``i``'s state ``"<i>.<name>"``, as the pipeline does. A tied
module's state ``"tied_modules.<key>.<name>"`` becomes ``"<f>.<name>"``, ``f`` the key's first
position with ``module`` true (its first position if it has none); every other position ``j``
with ``module`` true is an alias ``"<j>.<name>"`` of it
(listed under ``metadata.tied_weights`` of the consolidated index, stored once). Other keys
(a loss_fn module's, say) keep their names.
"""

from __future__ import annotations

from typing import Any

__all__ = ["layer_position", "sequential_names"]

_TIED_PREFIX = "tied_modules."


def _first_positions(layout: dict[str, Any]) -> dict[str, int]:
    first: dict[str, int] = {}
    for i, layer in enumerate(layout["layers"]):
        if layer["tie"] is not None:
            first.setdefault(layer["tie"], i)
    return first


def layer_position(key: str, layout: dict[str, Any]) -> int:
    """The layer-list position ``key`` belongs to (a tie key's first position); ``num_layers`` for
    keys of no layer. Orders keys as the layers run."""
    head, _, rest = key.partition(".")
    if head.isdigit():
        return int(head)
    if key.startswith(_TIED_PREFIX):
        tie = rest.partition(".")[0]
        return _first_positions(layout).get(tie, layout["num_layers"])
    return layout["num_layers"]


def sequential_names(keys: list[str], layout: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """``({pipeline key: Sequential key}, {Sequential alias: Sequential key})`` for ``keys``
    (see the note above)."""
    first = _first_positions(layout)
    for i, layer in reversed(list(enumerate(layout["layers"]))):
        if layer["tie"] is not None and layer["module"]:
            first[layer["tie"]] = i  # the first position running the module itself, where there is one
    renamed: dict[str, str] = {}
    aliases: dict[str, str] = {}
    for key in keys:
        if not key.startswith(_TIED_PREFIX):
            renamed[key] = key
            continue
        tie, _, name = key[len(_TIED_PREFIX):].partition(".")
        if tie not in first:
            renamed[key] = key
            continue
        target = f"{first[tie]}.{name}"
        renamed[key] = target
        for j, layer in enumerate(layout["layers"]):
            if layer["tie"] == tie and layer["module"] and j != first[tie]:
                aliases[f"{j}.{name}"] = target
    return renamed, aliases
