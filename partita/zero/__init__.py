"""ZeRO data parallelism: partition math, gradient reducer, sharded optimizer, stage policy,
ZeRO-3 parameter gathering, and whole-parameter access (``GatheredParameters``).

DeepSpeed's ``deepspeed.zero`` names: ``Init``, ``GatheredParameters``,
``register_external_parameter`` / ``unregister_external_parameter`` (:mod:`partita.zero.external`).
"""

from partita.zero.external import register_external_parameter, unregister_external_parameter
from partita.zero.gathered import GatheredParameters
from partita.zero.init_context import Init
from partita.zero.units import set_z3_leaf_modules

__all__ = [
    "GatheredParameters",
    "Init",
    "register_external_parameter",
    "set_z3_leaf_modules",
    "unregister_external_parameter",
]
