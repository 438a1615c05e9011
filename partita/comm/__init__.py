"""DeepSpeed's ``deepspeed.comm`` under partita's name: torch.distributed with DeepSpeed's calls.

    import partita.comm as dist
    dist.init_distributed()
    dist.all_reduce(t)            # sum over every rank, in place
    if dist.get_rank() == 0: ...

The functions are in :mod:`partita.comm.comm` (DeepSpeed's layout); ``partita.init_distributed``
is the same function.
"""

from partita.comm.comm import *  # noqa: F401,F403 - the facade is the module's whole point
from partita.comm.comm import __all__  # noqa: F401
