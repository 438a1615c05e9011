"""``zero.register_external_parameter``: a module's forward uses a parameter it does not own.

DeepSpeed's ZeRO-3 gathers each module's own parameters around that module's forward, so a
parameter read by another module's forward (``layer2(x, layer1.weight)``, or Hugging Face's
weight-normed position convolution in wav2vec2-style models) must be registered with the
module that reads it, or it is partitioned when that module runs.

partita's ZeRO-3 gathers per *unit* (see [Note: units] in :mod:`partita.zero.param_gatherer`):
a parameter is whole while its unit's forward runs, the root unit's parameters (everything not
inside a repeated block, and anything shared between blocks) for the whole forward and
backward. So a registered use is already covered, with nothing to do, when the parameter

- is not sharded (persistent: at most ``stage3_param_persistence_threshold`` elements), or
- belongs to the root unit, or
- belongs to a unit that contains the reading module (both in one block).

These are the cases DeepSpeed's examples and Hugging Face's models register. Any other
registration (a block's parameter read from outside that block) would find the parameter
sharded, so :func:`check_external_parameters` refuses it when ``initialize`` builds ZeRO-3,
naming the module, the parameter and the fix, instead of failing or computing garbage mid-step.

The registry is keyed by module (weakly) and holds the parameters, so no attribute is added
to either. At ZeRO stages 0-2 every parameter is whole and registrations have no effect, as
in DeepSpeed.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

__all__ = ["check_external_parameters", "external_parameters", "register_external_parameter", "unregister_external_parameter"]

_registry: weakref.WeakKeyDictionary[nn.Module, dict[int, nn.Parameter]] = weakref.WeakKeyDictionary()


def _check_pair(call: str, module: Any, parameter: Any) -> None:
    if not isinstance(module, nn.Module):
        raise ValueError(f"zero.{call}(module, parameter): module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise ValueError(
            f"zero.{call}(module, parameter): parameter must be a torch.nn.Parameter, got {type(parameter).__name__}"
        )


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another module owns (DeepSpeed's call).

    Call it before ``partita.initialize`` (typically in the module's ``__init__``). Under
    ZeRO-3 partita checks at ``initialize`` that the parameter is whole whenever ``module``
    runs (see the module docstring) and raises NotImplementedError when it would not be.
    """
    _check_pair("register_external_parameter", module, parameter)
    _registry.setdefault(module, {})[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`; an unregistered pair is an error, as in DeepSpeed."""
    _check_pair("unregister_external_parameter", module, parameter)
    registered = _registry.get(module, {})
    if id(parameter) not in registered or registered[id(parameter)] is not parameter:
        raise ValueError(
            f"zero.unregister_external_parameter: this parameter (shape {tuple(parameter.shape)}) is not registered "
            f"as an external parameter of {type(module).__name__}"
        )
    del registered[id(parameter)]


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered for ``module`` (its own parameters are not listed)."""
    return list(_registry.get(module, {}).values())


def _owner_unit(param: nn.Parameter, units: list[nn.Module], root: nn.Module) -> nn.Module:
    """The unit ZeRO-3 gathers ``param`` with: the rule of ParameterGatherer._assign_units."""
    holders = [unit for unit in units if any(p is param for p in unit.parameters())]
    if not holders:
        return root
    owner = holders[-1]  # units are listed outermost first: the last holder is the innermost
    for unit in holders[1:]:
        if unit is not owner and not _contains(unit, owner):
            return root  # reachable from two separate blocks: the root keeps it whole
    return owner


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def check_external_parameters(model: nn.Module, gatherer: Any) -> None:
    """Refuse registrations ZeRO-3's units would not honour (``gatherer``: the stage-3 ParameterGatherer)."""
    if gatherer is None or not len(_registry):
        return
    from partita.zero.units import find_units

    units = find_units(model)
    module_names = {id(m): name or "the model" for name, m in model.named_modules()}
    param_names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    for module in model.modules():
        for param in external_parameters(module):
            if not gatherer.is_sharded_param(param):
                continue  # whole on every rank
            owner = _owner_unit(param, units, model)
            if owner is model or _contains(owner, module):
                continue
            where, owner_name = module_names.get(id(module), type(module).__name__), module_names.get(id(owner), "?")
            raise NotImplementedError(
                f"zero.register_external_parameter({where!r}, {param_names.get(id(param), 'a parameter')!r}): "
                f"partita's ZeRO-3 gathers this parameter with the block {owner_name!r} "
                f"({type(owner).__name__}) only while that block runs, and {where!r} is outside it, so the parameter "
                "would still be sharded when it is used. Make them one unit: partita.zero.set_z3_leaf_modules(model, "
                "[<type of a module containing both>]) before initialize(); or keep the parameter whole on every rank "
                f"by raising zero_optimization.stage3_param_persistence_threshold to at least {param.numel()}"
            )
