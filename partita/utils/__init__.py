"""DeepSpeed's ``deepspeed.utils`` names that partita has: ``logger``, ``log_dist``,
``set_z3_leaf_modules``; the per-parameter ``safe_get_*`` helpers raise NotImplementedError
naming what to use instead."""

from __future__ import annotations

from typing import Any

from partita.utils.logging import log_dist, logger, print_rank_0

__all__ = ["log_dist", "logger", "print_rank_0", "set_z3_leaf_modules"]

_SAFE_GET = (
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_local_fp32_param",
)


def __getattr__(name: str) -> Any:
    if name == "set_z3_leaf_modules":  # imports the ZeRO-3 machinery (torch): only when asked for
        from partita.zero import set_z3_leaf_modules

        return set_z3_leaf_modules
    if name in _SAFE_GET:
        from partita.deepspeed_compat import MissingDeepSpeedFeature

        raise MissingDeepSpeedFeature(
            f"deepspeed.utils.{name} reads one parameter's fp32 master / gradient / optimizer state through "
            "DeepSpeed's per-parameter mapping; partita has no such mapping. Use engine.get_fp32_state_dict() for "
            "the fp32 weights, partita.zero.GatheredParameters(params) to read whole ZeRO-3 parameters, and "
            "engine.optimizer.state for the optimizer state of this rank's partition"
        )
    raise AttributeError(f"module 'partita.utils' has no attribute {name!r}")
