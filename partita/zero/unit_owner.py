"""Which ZeRO-3 unit gathers each sharded parameter (see [Note: units] in param_gatherer.py).

The rule, shared by the gatherer and restated by partita's estimator and external-parameter checks:
a parameter belongs to the innermost unit containing it; one reachable from two units that do not
nest (weights tied across blocks) belongs to the root, which stays gathered through forward and
backward, so any use of it anywhere is safe.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from partita.zero.units import find_units, is_inside


def assign_units(model: nn.Module, sharded: Callable[[nn.Parameter], bool]) -> dict[nn.Module, list[nn.Parameter]]:
    """Every unit of ``model`` (outermost first, the root first) with the parameters it gathers,
    among those ``sharded`` accepts (managed by ZeRO-3 and not persistent)."""
    units = find_units(model)
    owner: dict[nn.Parameter, nn.Module] = {}
    for unit in units:  # outermost first: inner units overwrite
        for param in unit.parameters():
            if sharded(param):
                owner[param] = unit
    # A parameter reachable from two different non-root units (tied across blocks) goes to the root.
    for unit in units[1:]:
        for param in unit.parameters():
            if owner.get(param) is not None and owner[param] is not unit and not is_inside(owner[param], unit):
                owner[param] = model
    result: dict[nn.Module, list[nn.Parameter]] = {unit: [] for unit in units}
    for param, unit in owner.items():
        result[unit].append(param)
    return result
