"""``deepspeed.runtime.activation_checkpointing.checkpointing`` (Megatron-DeepSpeed imports it by
this path): DeepSpeed's functional activation-checkpointing API, :mod:`partita.checkpointing`."""

from partita.checkpointing import *  # noqa: F401,F403 - the same API under DeepSpeed's path
from partita.checkpointing import __all__  # noqa: F401
from partita.checkpointing import __getattr__  # noqa: F401,E402 - the names partita lacks, with their message
