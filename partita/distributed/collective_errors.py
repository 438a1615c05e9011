"""Name the collective that failed.

When a rank dies or stalls, the others fail inside a collective with a backend message
("Connection closed by peer", "Timed out waiting ...") that says nothing about what the
training step was doing. Wrapping each collective here turns that into an error naming
the operation, this rank, and the likely cause, so a user knows where to look.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed on this rank (a peer died, stalled past the timeout, or diverged)."""


@contextlib.contextmanager
def explain_collective_failure(operation: str) -> Iterator[None]:
    """Re-raise any failure inside the block as :class:`CollectiveError` naming ``operation``."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:  # torch's DistBackendError / DistError derive from RuntimeError
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"partita rank {rank}: {operation} failed: another rank probably died, stalled longer than "
            f"the collective timeout (config 'distributed.timeout_seconds'), or issued a different "
            f"collective. Check the other ranks' logs. Backend error: {error}"
        ) from error
