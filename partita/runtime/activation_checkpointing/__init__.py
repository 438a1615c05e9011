"""``deepspeed.runtime.activation_checkpointing``: its ``checkpointing`` module is :mod:`partita.checkpointing`."""

from partita.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
