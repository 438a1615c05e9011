"""``deepspeed.runtime.utils``: the helpers training scripts import from it."""

from __future__ import annotations

import gc
import logging


from partita.utils.logging import logger

__all__ = ["noop_context", "see_memory_usage"]


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
