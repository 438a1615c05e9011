"""DeepSpeed's ``deepspeed.checkpointing`` API under partita's name: ``configure``,
``checkpoint``, ``is_configured``, ``reset`` (activation checkpointing, not saving models).

    import partita.checkpointing as checkpointing
    checkpointing.configure(None, deepspeed_config="ds_config.json")
    hidden = checkpointing.checkpoint(block, hidden)

The implementation lives in :mod:`partita.activation_checkpointing`.
"""

from partita.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpoint,
    configure,
    is_configured,
    remove_activation_checkpointing,
    reset,
)

__all__ = [
    "configure",
    "checkpoint",
    "is_configured",
    "reset",
    "apply_activation_checkpointing",
    "remove_activation_checkpointing",
]
