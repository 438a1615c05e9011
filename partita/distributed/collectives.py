"""The collectives partita's strategies issue, in one place.

Every strategy calls these thin wrappers instead of ``torch.distributed`` directly, so one
module sees every collective: the communication logger (``comms_logger``,
:mod:`partita.monitor.comms_logger`) times each one here, and a failure is turned into an
error that names the operation (a dead peer otherwise surfaces as a bare backend message).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from partita.distributed.collective_errors import explain_collective_failure
from partita.monitor.comms_logger import COMMS_LOGGER

__all__ = ["all_gather_into_tensor", "all_reduce", "all_to_all_single", "broadcast", "reduce_scatter_tensor"]

# torch 2.13 deprecates dist.all_gather_into_tensor / dist.reduce_scatter_tensor (a FutureWarning,
# once per process) in favour of dist.all_gather_single / dist.reduce_scatter_single, which older
# torch releases partita supports (2.4 onwards) do not have. The old names still work (in 2.13
# they forward to the new ones), so partita keeps them and silences exactly these two messages:
# the message regexes match nothing else. torch attributes the warning to its own
# c10d_logger module whoever the caller is, so the filter cannot be narrowed to partita's calls.
for _old, _new in (("all_gather_into_tensor", "all_gather_single"), ("reduce_scatter_tensor", "reduce_scatter_single")):
    warnings.filterwarnings(
        "ignore",
        message=rf"`torch\.distributed\.{_old}` is deprecated\. Please use `torch\.distributed\.{_new}` instead\.",
        category=FutureWarning,
    )
del _old, _new


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    purpose: str,
    async_op: bool = False,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> dist.Work | None:
    """Reduce ``tensor`` over ``group`` in place (a sum unless ``op`` says otherwise)."""
    token = COMMS_LOGGER.start("all_reduce", _nbytes(tensor), tensor, group, purpose)
    with explain_collective_failure(purpose):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    COMMS_LOGGER.finish(token, work)
    return work


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None, purpose: str, async_op: bool = False
) -> dist.Work | None:
    """Sum ``input`` over ``group``; rank r keeps chunk r in ``output``."""
    token = COMMS_LOGGER.start("reduce_scatter_tensor", _nbytes(input), input, group, purpose)
    with explain_collective_failure(purpose):
        work = dist.reduce_scatter_tensor(output, input, group=group, async_op=async_op)
    COMMS_LOGGER.finish(token, work)
    return work


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None, purpose: str, async_op: bool = False
) -> dist.Work | None:
    """Concatenate every rank's ``input`` into ``output`` (rank order)."""
    token = COMMS_LOGGER.start("all_gather_into_tensor", _nbytes(output), output, group, purpose)
    with explain_collective_failure(purpose):
        work = dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
    COMMS_LOGGER.finish(token, work)
    return work


def all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None, purpose: str, async_op: bool = False
) -> dist.Work | None:
    """Rank r's chunk j of ``input`` lands as chunk r of rank j's ``output`` (equal chunks)."""
    token = COMMS_LOGGER.start("all_to_all_single", _nbytes(input), input, group, purpose)
    with explain_collective_failure(purpose):
        work = dist.all_to_all_single(output, input, group=group, async_op=async_op)
    COMMS_LOGGER.finish(token, work)
    return work


def broadcast(tensor: torch.Tensor, *, src: int, group: dist.ProcessGroup | None, purpose: str) -> None:
    """Copy global rank ``src``'s ``tensor`` to every rank of ``group``."""
    token = COMMS_LOGGER.start("broadcast", _nbytes(tensor), tensor, group, purpose)
    with explain_collective_failure(purpose):
        dist.broadcast(tensor, src=src, group=group)
    COMMS_LOGGER.finish(token, None)


def wait(work: dist.Work | None, *, purpose: str) -> None:
    """Wait for an asynchronous collective, naming it if it fails."""
    if work is None:
        return
    with explain_collective_failure(purpose):
        work.wait()
    COMMS_LOGGER.waited(work)


def _nbytes(tensor: torch.Tensor) -> int:
    # The message size nccl-tests reports for the op (see partita.monitor.comms_logger).
    return tensor.numel() * tensor.element_size()
