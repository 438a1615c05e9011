"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed's ZeRO-1/2 optimizer class and its memory
estimators, refused with partita's equivalents.

partita runs every stage with one sharded optimizer (:class:`partita.zero.sharded_optimizer.ShardedOptimizer`,
``engine.optimizer``; the stage is a policy, ``engine.zero_optimization_stage()``), so there is no stage-1/2 class
to test with ``isinstance``. Memory is predicted by :func:`partita.estimate.estimate_memory`
(``partita estimate`` from a shell), for the model you have, at any stage and offload setting.
"""

from partita.runtime._missing import refuse

__all__: list[str] = []

_ESTIMATE = ("partita.estimate.estimate_memory(model, Setup(stage=..., world_size=...)) predicts the per-rank "
             "bytes of parameters, gradients, optimizer states and activations at any stage (`partita estimate` "
             "from a shell)")

MISSING = {
    "DeepSpeedZeroOptimizer": (
        "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer is not in partita: one sharded optimizer serves "
        "every ZeRO stage (partita.zero.sharded_optimizer.ShardedOptimizer, engine.optimizer); test the stage with "
        "engine.zero_optimization_stage()"
    ),
    "estimate_zero2_model_states_mem_needs_all_live": (
        f"deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live is not in partita: "
        f"{_ESTIMATE}"
    ),
    "estimate_zero2_model_states_mem_needs_all_cold": (
        f"deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold is not in partita: "
        f"{_ESTIMATE}"
    ),
}

__getattr__ = refuse(__name__, MISSING)
