"""Rebuilding whole fp32 master weights and optimizer states from DeepSpeed's partitions.

What DeepSpeed 0.19.8 stores (learned from its checkpoints and runtime/zero/*.py), per stage:

- **ZeRO 0**: ``optimizer`` in the model file is the torch optimizer's own ``state_dict``:
  whole tensors, keyed by the position of each parameter in the param groups the user
  passed. The parameters' names are not recorded; :func:`stage0_names` recovers them.
- **ZeRO 1-2**: per param group ``g``, the group's parameters are laid out one after the other
  in the order of ``param_shapes[g]`` (each followed by ``param_alignment_paddings[g][i]``
  elements), then the whole is padded and cut into equal partitions, one per rank. Rank ``r``'s
  file holds its partition of the fp32 masters (``single_partition_of_fp32_groups[g]``, with
  its padding already removed: ``group_paddings[g]`` elements) and, in
  ``base_optimizer_state``, the inner torch optimizer's state of that partition (padding
  kept). (With ``elastic_checkpoint`` it is a list of per-group states and the param groups'
  hyperparameters are not saved; such checkpoints are refused.)
  Concatenating the ranks' unpadded partitions gives the group's flat vector.
- **ZeRO 3**: every parameter is partitioned on its own: each rank holds
  ``ceil(numel / world)`` elements of it (the last ranks padded), and a rank's flat group
  (``fp32_flat_groups[i]``, one per sub-group ``i``, whose parameters are ``param_shapes[i]``)
  is its pieces of the sub-group's parameters one after the other. Parameter ``p``'s whole
  tensor is the concatenation over ranks of its piece, truncated to ``numel``. Sub-groups map
  to the user's param groups through the inner optimizer's ``param_groups[g]["params"]``.

Optimizer state tensors (Adam's ``exp_avg``/``exp_avg_sq``) have exactly the layout of the
fp32 partition they belong to, so the same cuts rebuild them; scalar state (``step``) is the
same on every rank and taken from rank 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from partita.checkpoint.import_deepspeed_read import DeepSpeedImportError

__all__ = ["ImportedGroup", "groups_from_stage0", "groups_from_stage12", "groups_from_stage3", "stage0_names"]


@dataclass
class ImportedGroup:
    """One param group, whole: its parameters' fp32 masters and per-element optimizer state."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    masters: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> fp32, whole shape
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # key -> name -> flat fp32
    scalars: dict[str, Any] = field(default_factory=dict)  # replicated state, e.g. step
    hyperparameters: dict[str, Any] = field(default_factory=dict)


def _numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


def _split_state(state: dict[str, Any], numel: int | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(per-element tensors, scalars) of one flat partition's optimizer state."""
    element, scalars = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and (numel is None or value.numel() >= numel):
            element[key] = value.reshape(-1)
        elif torch.is_tensor(value) and value.dim() > 0:
            raise DeepSpeedImportError(
                f"optimizer state {key!r} has {value.numel()} elements for a partition of {numel}; this optimizer's "
                "state is not per element (partita imports Adam/AdamW-style state: exp_avg, exp_avg_sq, step)"
            )
        else:
            scalars[key] = value
    return element, scalars


def _scalars(scalars: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
    """torch's Adam keeps ``step`` as a float32 0-dim tensor; DeepSpeed's own optimizers keep an
    int, in the state or in the param group (``group["step"]``). Normalise to torch's form."""
    out = dict(scalars)
    if "step" not in out and "step" in group:
        out["step"] = group["step"]
    if "step" in out and not torch.is_tensor(out["step"]):
        out["step"] = torch.tensor(float(out["step"]), dtype=torch.float32)
    return out


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters; DeepSpeed's FusedAdam keeps ``betas`` as a list (torch: a tuple)."""
    out = {k: v for k, v in group.items() if k not in ("params", "step")}
    if isinstance(out.get("betas"), list):
        out["betas"] = tuple(out["betas"])
    return out


def _cut(flat: torch.Tensor, names: list[str], shapes: list[tuple[int, ...]], gaps: list[int]) -> dict[str, torch.Tensor]:
    """Parameters laid out one after another in ``flat``, each followed by its alignment gap."""
    out, offset = {}, 0
    for name, shape, gap in zip(names, shapes, gaps):
        n = _numel(shape)
        if offset + n > flat.numel():
            raise DeepSpeedImportError(
                f"the flat partitions hold {flat.numel()} elements but parameter {name!r} needs elements "
                f"[{offset}, {offset + n}); the optimizer files do not belong to this model file (param_shapes)"
            )
        out[name] = flat[offset : offset + n]  # a view: the whole vector is exactly these plus small gaps
        offset += n + gap
    return out


def _take(owners: list[tuple[Any, Any]], stop: list[int]) -> torch.Tensor:
    """Concatenate ``owner[key][:stop[r]]`` over the ranks, dropping each rank's tensor from its
    container as soon as it is copied: the peak holds DeepSpeed's partitions and the whole
    tensors of one state kind at a time, not two copies of everything."""
    pieces = []
    for (container, key), n in zip(owners, stop):
        pieces.append(container[key].reshape(-1)[:n])
        container[key] = None
    whole = torch.cat(pieces).float()
    del pieces
    return whole


def groups_from_stage12(model_states: dict[str, Any], optim: list[dict[str, Any]]) -> list[ImportedGroup]:
    """ZeRO 1-2: rebuild each group from every rank's ``optimizer_state_dict`` (consumed: its
    tensors are released as they are copied)."""
    shapes_per_group = model_states["param_shapes"]
    param_groups = optim[0]["base_optimizer_state"]["param_groups"]
    groups = []
    for g, shapes in enumerate(shapes_per_group):
        names = list(shapes.keys())
        shape_list = [tuple(int(d) for d in s) for s in shapes.values()]
        gaps = list(optim[0].get("param_alignment_paddings", [[0] * len(names)] * len(shapes_per_group))[g])
        lean = [int(rank["single_partition_of_fp32_groups"][g].numel()) for rank in optim]
        flat = _take([(rank["single_partition_of_fp32_groups"], g) for rank in optim], lean)
        group = ImportedGroup(names=names, shapes=shape_list, masters={
            n: t.view(s) for (n, t), s in zip(_cut(flat, names, shape_list, gaps).items(), shape_list)})
        del flat
        # The torch optimizer's state_dict: group g's one flat tensor is state[g] (padding kept).
        states = [rank["base_optimizer_state"]["state"].get(g, {}) for rank in optim]
        for state, n in zip(states, lean):
            _split_state(state, n)  # refuses state that is not per element
        element, scalars = _split_state(states[0], lean[0])
        group.scalars = _scalars(scalars, param_groups[g])
        group.hyperparameters = _hyper(param_groups[g])
        for key in element:
            whole = _take([(state, key) for state in states], lean)
            group.state[key] = {n: t.reshape(-1) for n, t in _cut(whole, names, shape_list, gaps).items()}
            del whole
        groups.append(group)
    return groups


def groups_from_stage3(model_states: dict[str, Any], optim: list[dict[str, Any]]) -> list[ImportedGroup]:
    """ZeRO 3: rebuild each parameter from its per-rank pieces; merge sub-groups into param groups."""
    world = len(optim)
    shapes_per_sub = model_states["param_shapes"]
    inner0 = optim[0]["optimizer_state_dict"]
    param_groups = inner0["param_groups"]
    sub_to_group = {}
    for g, group in enumerate(param_groups):
        for index in group["params"]:
            sub_to_group[index] = g
    if sorted(sub_to_group) != list(range(len(shapes_per_sub))):
        raise DeepSpeedImportError(
            f"the ZeRO-3 optimizer files list sub-groups {sorted(sub_to_group)} in their param groups but the model "
            f"file has {len(shapes_per_sub)} sub-groups of parameters; the files are from different saves"
        )
    groups = [ImportedGroup(names=[], shapes=[], hyperparameters=_hyper(pg)) for pg in param_groups]
    for sub, shapes in enumerate(shapes_per_sub):
        target = groups[sub_to_group[sub]]
        numel = int(optim[0]["fp32_flat_groups"][sub].numel())
        states = [rank["optimizer_state_dict"]["state"].get(sub, {}) for rank in optim]
        for state in states:
            _split_state(state, numel)  # refuses state that is not per element
        element, scalars = _split_state(states[0], numel)
        if not target.scalars:
            target.scalars = _scalars(scalars, param_groups[sub_to_group[sub]])
        layout, offset = [], 0  # (name, shape, numel, offset of its piece, piece size)
        for name, shape in shapes.items():
            shape = tuple(int(d) for d in shape)
            n = _numel(shape)
            piece = math.ceil(n / world)
            if offset + piece > numel:
                raise DeepSpeedImportError(
                    f"rank 0's ZeRO-3 partition of sub-group {sub} holds {numel} elements but parameter "
                    f"{name!r} needs [{offset}, {offset + piece}); the optimizer files do not belong to this model file"
                )
            layout.append((name, shape, n, offset, piece))
            offset += piece
        target.names += [entry[0] for entry in layout]
        target.shapes += [entry[1] for entry in layout]
        masters = _gather_pieces([(rank["fp32_flat_groups"], sub) for rank in optim], layout)
        target.masters.update({name: masters[name].view(shape) for name, shape, *_ in layout})
        for key in element:
            target.state.setdefault(key, {}).update(_gather_pieces([(state, key) for state in states], layout))
    return groups


def _gather_pieces(owners: list[tuple[Any, Any]], layout: list[tuple[str, tuple[int, ...], int, int, int]]) -> dict[str, torch.Tensor]:
    """ZeRO 3: each parameter whole from its piece in every rank's flat tensor ``owner[key]``
    (released from its container once read, as :func:`_take` does)."""
    flats = []
    for container, key in owners:
        flats.append(container[key].reshape(-1))
        container[key] = None
    out = {name: torch.cat([f[offset : offset + piece] for f in flats])[:n].float().clone()
           for name, _, n, offset, piece in layout}
    del flats
    return out


def stage0_names(module_state: dict[str, Any], buffer_names: list[str], groups: list[dict[str, Any]],
                 state: dict[Any, Any]) -> list[list[str]]:
    """The names of a ZeRO-0 optimizer's parameters, which DeepSpeed does not record.

    The optimizer lists each group's parameters by position in the order the user passed them.
    Those are taken to follow the module's order within each group (``model.parameters()``, or
    groups filtered from it, as usual); the assignment must be the only one whose shapes agree
    with the saved state (parameters the optimizer does not hold are frozen). Otherwise refused.
    """
    params = [(k, tuple(v.shape)) for k, v in module_state.items() if k not in set(buffer_names) and torch.is_tensor(v)]
    wanted = []
    for group in groups:
        shapes = []
        for index in group["params"]:
            entry = state.get(index, {})
            t = entry.get("exp_avg", next((v for v in entry.values() if torch.is_tensor(v) and v.dim() > 0), None))
            shapes.append(None if t is None else tuple(t.shape))
        wanted.append(shapes)
    solutions: list[list[list[str]]] = []
    budget = [200_000]

    def search(i: int, taken: list[list[str]]) -> None:
        if len(solutions) > 1 or budget[0] <= 0:
            return
        budget[0] -= 1
        if i == len(params):
            if all(len(t) == len(w) for t, w in zip(taken, wanted)):
                solutions.append([list(t) for t in taken])
            return
        name, shape = params[i]
        for g, shapes in enumerate(wanted):
            k = len(taken[g])
            if k < len(shapes) and shapes[k] in (shape, None):
                taken[g].append(name)
                search(i + 1, taken)
                taken[g].pop()
        search(i + 1, taken)  # not in the optimizer: frozen

    search(0, [[] for _ in groups])
    if len(solutions) != 1:
        why = "no assignment matches the saved shapes" if not solutions else "several assignments match the saved shapes"
        raise DeepSpeedImportError(
            f"a ZeRO-0 DeepSpeed checkpoint does not record which parameter each optimizer entry belongs to, and {why} "
            f"({len(groups)} param groups of {[len(w) for w in wanted]} parameters over the module's {len(params)}); "
            "pass the names with import_deepspeed(..., stage0_param_names=[[names of group 0], ...]) or "
            "--param-names FILE (a JSON list of lists), in the order given to the optimizer"
        )
    return solutions[0]


def groups_from_stage0(optimizer: dict[str, Any], names: list[list[str]]) -> list[ImportedGroup]:
    """ZeRO 0: the torch optimizer's own state_dict, whole tensors by position."""
    state = optimizer["state"]
    groups = []
    for group, group_names in zip(optimizer["param_groups"], names):
        imported = ImportedGroup(names=list(group_names), shapes=[], hyperparameters=_hyper(group))
        for index, name in zip(group["params"], group_names):
            element, scalars = _split_state(state.get(index, {}), None)
            for key, value in element.items():
                imported.state.setdefault(key, {})[name] = value.reshape(-1).float().clone()
            if not imported.scalars:
                imported.scalars = _scalars(scalars, group)
        groups.append(imported)
    return groups
