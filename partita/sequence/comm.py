"""Differentiable collectives over the sequence group, and the token-weighted loss.

``torch.distributed.all_to_all_single`` and ``all_reduce`` have no autograd. torch 2.11/2.12 keep a
differentiable all-to-all under the private ``_functional_collectives`` name and 2.13 makes the
functional one differentiable; ``torch.distributed.nn.functional`` is deprecated since 2.12. Rather
than switch on the torch version, the two autograd Functions below are written out: the backward of
an all-to-all is the all-to-all with scatter and gather swapped, and the backward of a sum
all-reduce is a sum all-reduce of the gradients.

Every collective is reported to the communication logger (``comms_logger``) like partita's others.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from partita.distributed.collective_errors import explain_collective_failure
from partita.monitor.comms_logger import COMMS_LOGGER

__all__ = ["all_reduce_sum", "all_to_all", "sequence_token_mean", "token_weighted_cross_entropy"]

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it are not tokens of the loss


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _all_to_all_raw(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Cut ``x`` into ``world`` equal chunks along ``scatter_dim``, send chunk j to rank j, and
    concatenate the chunks received (in source-rank order) along ``gather_dim``."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    size = x.size(scatter_dim)
    if size % world != 0:
        raise ValueError(
            f"all-to-all over {world} sequence ranks: dimension {scatter_dim} has size {size}, not divisible by "
            f"{world}; make it a multiple of the sequence_parallel_size"
        )
    # [.., size, ..] -> [world, .., size/world, ..]: chunk j is send[j], contiguous for the collective.
    send = x.unflatten(scatter_dim, (world, size // world)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    token = COMMS_LOGGER.start("all_to_all_single", _nbytes(send), send, group, "sequence parallel all-to-all")
    with explain_collective_failure("sequence parallel all-to-all"):
        dist.all_to_all_single(recv, send, group=group)
    COMMS_LOGGER.finish(token, None)
    # recv[j] is rank j's piece along gather_dim: put the source index just before that dim and merge.
    gather = gather_dim if gather_dim >= 0 else x.dim() + gather_dim
    return recv.movedim(0, gather).flatten(gather, gather + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all_raw(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        # The transpose of "scatter s, gather g" is "scatter g, gather s".
        return _AllToAll.apply(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, *, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all: ``x`` split along ``scatter_dim`` over the ranks of ``group``, the
    received pieces joined along ``gather_dim``. With sequence shards in, head shards out, when
    ``scatter_dim`` is the head dim and ``gather_dim`` the sequence dim (and the reverse)."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        _sum_in_place(out, group, "sequence parallel loss sum")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        # Every rank's output depends on every rank's input: d(sum_j L_j)/dx_i = sum_j dL_j/dy.
        out = grad.contiguous().clone()
        _sum_in_place(out, ctx.group, "sequence parallel loss sum (backward)")
        return out, None


def _sum_in_place(tensor: torch.Tensor, group: dist.ProcessGroup, purpose: str) -> None:
    if dist.get_world_size(group) == 1:
        return
    token = COMMS_LOGGER.start("all_reduce", _nbytes(tensor), tensor, group, purpose)
    with explain_collective_failure(purpose):
        dist.all_reduce(tensor, group=group)
    COMMS_LOGGER.finish(token, None)


def all_reduce_sum(x: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable sum over ``group`` (a new tensor; ``x`` is left alone)."""
    return _AllReduceSum.apply(x, group)


def sequence_token_mean(loss_sum: torch.Tensor, token_count: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """The mean over every token of the sequence group, from this rank's sum and count.

    Each sequence rank holds a slice of the same samples, so the loss of those samples is
    ``sum over ranks of loss_sum / sum over ranks of token_count``: exact even when ranks hold
    different numbers of valid tokens (padding, ignored targets), where averaging the ranks'
    own means would weight a token on a sparsely filled rank more.

    The returned value is that mean on every rank. Its gradient on each rank is
    ``group_size / total_tokens`` times the gradient of its own ``loss_sum``, so averaging the
    gradients over ``data x sequence`` (what ZeRO does over ``topology.zero_group``) gives the
    gradient of the mean over data ranks of each sequence group's exact token mean.
    """
    total = all_reduce_sum(loss_sum.float(), group=group)
    count = token_count.detach().to(device=total.device, dtype=torch.float32).clone()
    _sum_in_place(count, group, "sequence parallel token count")
    # No valid token anywhere in the group: a zero loss with zero gradient, not 0/0.
    return total / count.clamp_min(1.0)


def token_weighted_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, group: dist.ProcessGroup, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Cross-entropy of this rank's token slice, averaged over all tokens of the sequence group.

    ``logits`` is ``(..., vocab)`` and ``targets`` has the matching leading shape; targets equal
    to ``ignore_index`` count for neither sum nor count. Computed in fp32 like the reference
    GPT's loss.
    """
    flat_targets = targets.reshape(-1)
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), flat_targets, ignore_index=ignore_index, reduction="sum"
    )
    count = (flat_targets != ignore_index).sum()
    return sequence_token_mean(loss_sum, count, group=group)
