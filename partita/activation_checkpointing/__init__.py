"""Activation checkpointing: recompute activations in backward instead of storing them.

- :func:`apply_activation_checkpointing` wraps a model's repeated blocks by policy
  (``"every"``, ``"every_k"``, ``"selective"``), optionally offloading to CPU; the config's
  ``activation_checkpointing.policy`` makes ``initialize`` call it.
- :mod:`partita.checkpointing` has DeepSpeed's functional API (``configure``,
  ``checkpoint``, ``is_configured``, ``reset``) for model code that checkpoints by hand.
"""

from partita.activation_checkpointing.apply import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    find_repeated_blocks,
    remove_activation_checkpointing,
)
from partita.activation_checkpointing.config import ActivationCheckpointingConfig
from partita.activation_checkpointing.core import checkpoint, configure, is_configured, reset
from partita.activation_checkpointing.selective import SAVED_OPS, selective_policy

__all__ = [
    "ActivationCheckpointingConfig",
    "apply_activation_checkpointing",
    "remove_activation_checkpointing",
    "checkpointed_blocks",
    "find_repeated_blocks",
    "configure",
    "checkpoint",
    "is_configured",
    "reset",
    "SAVED_OPS",
    "selective_policy",
]
