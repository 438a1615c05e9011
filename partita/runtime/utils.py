"""``deepspeed.runtime.utils``: the helpers training scripts import from it.

``see_memory_usage`` and ``noop_context`` are here; ``set_random_seed(seed)`` is the seeding
``partita.initialize`` does with the config's ``"seed"`` (Python's ``random``, NumPy and torch,
as DeepSpeed's). ``PartitionedTensor`` (activations split across tensor ranks between pipeline
stages) is refused with what partita does instead.
"""

from __future__ import annotations

import gc
import logging

from partita.runtime._missing import refuse
from partita.utils.logging import logger

__all__ = ["noop_context", "see_memory_usage", "set_random_seed"]

MISSING = {
    "PartitionedTensor": (
        "deepspeed.runtime.utils.PartitionedTensor (pipeline activations split across tensor ranks) is not in "
        "partita: pipeline stages send whole activations through torch."
        "distributed.pipelining; with tensor parallelism every tensor rank of a stage sends its own copy"
    ),
}

__getattr__ = refuse(__name__, MISSING, lazy={"set_random_seed": ("partita.bootstrap", "_seed_everything")})


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log this process's device memory (allocated, peak, reserved) on rank 0 when ``force`` is
    set, as DeepSpeed's helper of the same name (a CPU run reports its resident set size)."""
    if not force:
        return
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    from partita.accelerator import get_accelerator

    gc.collect()
    accel = get_accelerator()
    gib = float(2**30)
    logger.log(
        logging.INFO,
        "%s | allocated %.2f GiB, peak %.2f GiB, reserved %.2f GiB",
        message,
        accel.memory_allocated() / gib,
        accel.max_memory_allocated() / gib,
        accel.memory_reserved() / gib,
    )
    accel.reset_peak_memory_stats()


def noop_context():
    """A context manager that does nothing (DeepSpeed's ``noop_context``)."""
    import contextlib

    return contextlib.nullcontext()
