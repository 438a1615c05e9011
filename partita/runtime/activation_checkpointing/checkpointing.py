"""``deepspeed.runtime.activation_checkpointing.checkpointing`` (Megatron-DeepSpeed imports it by
this path): DeepSpeed's functional activation-checkpointing API, :mod:`partita.checkpointing`.

The names partita lacks (Megatron's tensor-parallel random-state tracker) raise
:mod:`partita.checkpointing`'s own message, from ``from ... import`` too.
"""

from partita.checkpointing import *  # noqa: F401,F403 - the same API under DeepSpeed's path
from partita.checkpointing import __all__  # noqa: F401
from partita.checkpointing import __getattr__ as _refusal
from partita.deepspeed_compat import MissingDeepSpeedFeature
from partita.runtime._missing import refuse


def _message(name: str) -> str:
    try:
        _refusal(name)
    except MissingDeepSpeedFeature as refused:
        return str(refused)
    raise AssertionError(f"partita.checkpointing no longer refuses {name!r}")  # a partita bug, not a user's


MISSING = {name: _message(name) for name in ("get_cuda_rng_tracker", "model_parallel_cuda_manual_seed")}

__getattr__ = refuse(__name__, MISSING)
