"""DeepSpeed's ``deepspeed.checkpointing`` API under partita's name: ``configure``,
``checkpoint``, ``is_configured``, ``reset`` (activation checkpointing, not saving models).

    import partita.checkpointing as checkpointing
    checkpointing.configure(None, deepspeed_config="ds_config.json")
    hidden = checkpointing.checkpoint(block, hidden)

The implementation lives in :mod:`partita.activation_checkpointing`. DeepSpeed's
``non_reentrant_checkpoint`` is the same function: partita's ``checkpoint`` is non-reentrant.
``get_cuda_rng_tracker`` / ``model_parallel_cuda_manual_seed`` (Megatron's tensor-parallel random
streams) raise MissingDeepSpeedFeature (a NotImplementedError) naming what partita does instead:
the ``MISSING`` table below.
"""

from partita.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpoint,
    configure,
    is_configured,
    remove_activation_checkpointing,
    reset,
)
from partita.runtime._missing import refuse

non_reentrant_checkpoint = checkpoint  # DeepSpeed's name for its non-reentrant variant


# DeepSpeed names partita refuses, each with what to use instead; partita/runtime/_missing.py's
# convention, so docs/reference/deepspeed-paths.md (generated) lists them and ``from ... import``
# keeps the message.
_RNG_TRACKER = (
    "(Megatron's tensor-parallel random-state tracker) is not in partita: seed with the config's \"seed\" key; "
    "a recomputed block replays its own random state (torch's preserve_rng_state)"
)
MISSING = {name: f"deepspeed.checkpointing.{name} {_RNG_TRACKER}"
           for name in ("get_cuda_rng_tracker", "model_parallel_cuda_manual_seed")}

__getattr__ = refuse(__name__, MISSING)


__all__ = [
    "non_reentrant_checkpoint",
    "configure",
    "checkpoint",
    "is_configured",
    "reset",
    "apply_activation_checkpointing",
    "remove_activation_checkpointing",
]
