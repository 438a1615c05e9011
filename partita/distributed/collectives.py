"""The collectives partita's strategies issue, in one place.

Every strategy calls these thin wrappers instead of ``torch.distributed`` directly, so one
module sees every collective: the communication logger (``comms_logger``) hooks in here,
and a failure is turned into an error that names the operation (a dead peer otherwise
surfaces as a bare backend message).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.distributed.collective_errors import explain_collective_failure

__all__ = ["all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter_tensor"]


def all_reduce(
    tensor: torch.Tensor, *, group: dist.ProcessGroup | None, purpose: str, async_op: bool = False
) -> dist.Work | None:
    """Sum ``tensor`` over ``group`` in place."""
    with explain_collective_failure(purpose):
        return dist.all_reduce(tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None, purpose: str, async_op: bool = False
) -> dist.Work | None:
    """Sum ``input`` over ``group``; rank r keeps chunk r in ``output``."""
    with explain_collective_failure(purpose):
        return dist.reduce_scatter_tensor(output, input, group=group, async_op=async_op)


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None, purpose: str, async_op: bool = False
) -> dist.Work | None:
    """Concatenate every rank's ``input`` into ``output`` (rank order)."""
    with explain_collective_failure(purpose):
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, *, src: int, group: dist.ProcessGroup | None, purpose: str) -> None:
    """Copy global rank ``src``'s ``tensor`` to every rank of ``group``."""
    with explain_collective_failure(purpose):
        dist.broadcast(tensor, src=src, group=group)


def wait(work: dist.Work | None, *, purpose: str) -> None:
    """Wait for an asynchronous collective, naming it if it fails."""
    if work is None:
        return
    with explain_collective_failure(purpose):
        work.wait()
