"""DeepSpeed's ``deepspeed.checkpointing`` API under partita's name: ``configure``,
``checkpoint``, ``is_configured``, ``reset`` (activation checkpointing, not saving models).

    import partita.checkpointing as checkpointing
    checkpointing.configure(None, deepspeed_config="ds_config.json")
    hidden = checkpointing.checkpoint(block, hidden)

The implementation lives in :mod:`partita.activation_checkpointing`. DeepSpeed's
``non_reentrant_checkpoint`` is the same function: partita's ``checkpoint`` is non-reentrant.
``get_cuda_rng_tracker`` / ``model_parallel_cuda_manual_seed`` (Megatron's tensor-parallel random
streams) raise NotImplementedError naming what partita does instead.
"""

from typing import Any

from partita.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpoint,
    configure,
    is_configured,
    remove_activation_checkpointing,
    reset,
)

non_reentrant_checkpoint = checkpoint  # DeepSpeed's name for its non-reentrant variant


def __getattr__(name: str) -> Any:
    if name in ("get_cuda_rng_tracker", "model_parallel_cuda_manual_seed"):
        from partita.deepspeed_compat import MissingDeepSpeedFeature

        raise MissingDeepSpeedFeature(
            f"deepspeed.checkpointing.{name} (Megatron's tensor-parallel random-state tracker) is not in partita: "
            "seed with the config's \"seed\" key; a recomputed block replays its own random state (torch's "
            "preserve_rng_state)"
        )
    raise AttributeError(f"module 'partita.checkpointing' has no attribute {name!r}")


__all__ = [
    "non_reentrant_checkpoint",
    "configure",
    "checkpoint",
    "is_configured",
    "reset",
    "apply_activation_checkpointing",
    "remove_activation_checkpointing",
]
