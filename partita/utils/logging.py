"""``deepspeed.utils.logger`` / ``log_dist``: partita's one logger, and logging on chosen ranks.

partita logs through ``logging.getLogger("partita")`` (``initialize`` gives it a handler that
prefixes the rank, at INFO on rank 0 and WARNING elsewhere); DeepSpeed scripts that log
through ``deepspeed.utils.logger`` therefore write into the same stream.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("partita")

__all__ = ["log_dist", "logger", "print_rank_0"]


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks in ``ranks`` (None or ``[-1]``: every rank), as DeepSpeed's ``log_dist``."""
    rank = _rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


def print_rank_0(message: str, debug: bool = False, force: bool = False) -> None:
    """Print on rank 0 when ``debug`` or ``force`` is set (DeepSpeed's helper of the same name)."""
    if _rank() == 0 and (debug or force):
        print(message, flush=True)
