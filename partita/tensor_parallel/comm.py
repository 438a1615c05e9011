"""The collectives of Megatron-style tensor parallelism, as autograd functions.

Each pairs a forward collective with the backward one that makes the gradient right:

========================  ==========================  ==============================
function                  forward                     backward
========================  ==========================  ==============================
``copy_to_tensor``        identity                    all-reduce (sum of partial grads)
``reduce_from_tensor``    all-reduce                  identity
``gather_sequence``       all-gather along ``dim``    reduce-scatter along ``dim``
``scatter_sequence``      keep this rank's chunk      all-gather along ``dim``
``reduce_scatter_seq``    reduce-scatter along dim    all-gather along ``dim``
========================  ==========================  ==============================

Why not DTensor's ``redistribute`` (which gives the same pairs): partita's ZeRO flattens each
rank's parameters into flat fp32 partitions and frees and refills their storage (stage 3,
offload), which needs parameters to be plain tensors; and every collective goes through
:mod:`partita.distributed.collectives`, so the comms logger reports tensor-parallel traffic
apart from the data-parallel traffic (``purpose`` starts with "tensor parallel"). With plain
local shards as parameters and these functions, nothing in ZeRO had to change.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.distributed import collectives

__all__ = ["copy_to_tensor", "gather_sequence", "reduce_from_tensor", "reduce_scatter_sequence", "scatter_sequence"]


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, purpose: str) -> torch.Tensor:
    x = x.contiguous().clone()
    collectives.all_reduce(x, group=group, purpose=purpose)
    return x


def all_gather_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup, purpose: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (no autograd)."""
    size = dist.get_world_size(group)
    # all_gather_into_tensor concatenates along dim 0: gather there, then move the chunks.
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    collectives.all_gather_into_tensor(out, moved, group=group, purpose=purpose)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup, purpose: str) -> torch.Tensor:
    size = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    if moved.shape[0] % size != 0:
        raise ValueError(
            f"tensor parallelism: dimension {dim} of size {moved.shape[0]} does not divide by the tensor size "
            f"{size} (sequence parallelism splits the sequence across tensor ranks); use a sequence length "
            f"that is a multiple of {size}"
        )
    out = torch.empty((moved.shape[0] // size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    collectives.reduce_scatter_tensor(out, moved, group=group, purpose=purpose)
    return out.movedim(0, dim)


def _chunk(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % size != 0:
        raise ValueError(
            f"sequence parallelism: dimension {dim} of size {x.shape[dim]} does not divide by the tensor size "
            f"{size}; use a sequence length that is a multiple of {size}"
        )
    return x.chunk(size, dim=dim)[rank].contiguous()


class _CopyToTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "tensor parallel: input-gradient all-reduce"), None


class _ReduceFromTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "tensor parallel: output all-reduce")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, group, "tensor parallel: sequence all-gather")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group, "tensor parallel: sequence reduce-scatter in backward"), None, None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group, "tensor parallel: sequence all-gather in backward"), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group, "tensor parallel: sequence reduce-scatter")

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group, "tensor parallel: sequence all-gather in backward"), None, None


def copy_to_tensor(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Enter a column-parallel region: forward unchanged, backward sums the ranks' gradients."""
    return _CopyToTensor.apply(x, group)


def reduce_from_tensor(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Leave a row-parallel region: sum the ranks' partial outputs."""
    return _ReduceFromTensor.apply(x, group)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Sequence shards -> the whole sequence (before a column-parallel layer under sequence parallelism)."""
    return _GatherSequence.apply(x, dim, group)


def scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The whole (replicated) sequence -> this rank's shard, with no communication forward."""
    return _ScatterSequence.apply(x, dim, group)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Partial outputs of a row-parallel layer -> this rank's sequence shard of their sum."""
    return _ReduceScatterSequence.apply(x, dim, group)
