"""``deepspeed.runtime.zero.stage3``: DeepSpeed's ZeRO-3 optimizer class and its memory estimators,
refused with partita's equivalents (see :mod:`partita.runtime.zero.stage_1_and_2`: one sharded
optimizer for every stage; :func:`partita.estimate.estimate_memory` for the memory)."""

from partita.runtime._missing import refuse
from partita.runtime.zero.stage_1_and_2 import _ESTIMATE

__all__: list[str] = []

MISSING = {
    "DeepSpeedZeroOptimizer_Stage3": (
        "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3 is not in partita: one sharded optimizer serves "
        "every ZeRO stage (partita.zero.sharded_optimizer.ShardedOptimizer, engine.optimizer); test the stage with "
        "engine.zero_optimization_stage()"
    ),
    "estimate_zero3_model_states_mem_needs_all_live": (
        f"deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live is not in partita: {_ESTIMATE}"
    ),
    "estimate_zero3_model_states_mem_needs_all_cold": (
        f"deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold is not in partita: {_ESTIMATE}"
    ),
}

__getattr__ = refuse(__name__, MISSING)
