"""ZeRO data parallelism: partition math, gradient reducer, sharded optimizer, stage policy,
ZeRO-3 parameter gathering, and whole-parameter access (``GatheredParameters``)."""

from partita.zero.gathered import GatheredParameters
from partita.zero.init_context import Init
from partita.zero.param_gatherer import set_z3_leaf_modules

__all__ = ["GatheredParameters", "Init", "set_z3_leaf_modules"]
