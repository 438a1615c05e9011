"""Moving tokens to their experts and back: capacity buffers or dropless grouped rows, with
an all-to-all over the expert group when the experts live on several ranks.

Capacity mode (DeepSpeed's layout): every rank fills an ``(E, capacity, hidden)`` buffer (empty
slots are zeros), the ``E`` axis is cut into ``ep_size`` equal chunks, and one equal-split
all-to-all hands rank ``r`` the chunk of its experts from every rank. All ranks of the expert
group must use the same capacity, or the all-to-all sizes disagree (a hang or a crash):
:func:`agree_capacity` takes the maximum over the group.

Dropless mode: the (token, choice) rows are sorted by expert; the per-expert counts are
exchanged first (a small all-to-all), then the rows travel by ``all_to_all_single`` with
per-rank split sizes, are regrouped by local expert, run through the experts as one grouped
GEMM, and come back the same way. No row is dropped and no padding is sent.

The all-to-all is an autograd function: its backward is the all-to-all with the splits
swapped, so gradients return to the ranks their tokens came from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.distributed.collective_errors import explain_collective_failure
from partita.moe.experts import Experts
from partita.moe.gating import Routing
from partita.monitor.comms_logger import COMMS_LOGGER

__all__ = ["agree_capacity", "all_to_all", "capacity_dispatch", "dropless_dispatch"]


def _all_to_all_single(out: torch.Tensor, x: torch.Tensor, out_splits, in_splits, group, purpose: str) -> None:
    token = COMMS_LOGGER.start("all_to_all_single", x.numel() * x.element_size(), x, group, purpose)
    with explain_collective_failure(purpose):
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    COMMS_LOGGER.finish(token, None)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, purpose: str):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.purpose = group, out_splits, in_splits, purpose
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        _all_to_all_single(out, x.contiguous(), out_splits, in_splits, group, purpose)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _AllToAll.apply(ctx.group, grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.purpose + " (backward)")
        return None, back, None, None, None


def all_to_all(x: torch.Tensor, group, *, out_splits: list[int] | None = None, in_splits: list[int] | None = None,
               purpose: str = "MoE token all-to-all") -> torch.Tensor:
    """Differentiable ``all_to_all_single`` over dim 0 (``None`` splits: equal chunks)."""
    return _AllToAll.apply(group, x, out_splits, in_splits, purpose)


def agree_capacity(capacity: int, group, device: torch.device) -> int:
    """The largest capacity any rank of the expert group computed (they differ when ranks see
    different token counts, and unequal all-to-all buffers would hang or crash)."""
    value = torch.tensor([capacity], dtype=torch.int64, device=device)
    with explain_collective_failure("MoE capacity agreement (all-reduce max)"):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())


def capacity_dispatch(x: torch.Tensor, routing: Routing, experts: Experts, *, capacity: int, ep_size: int,
                      group) -> torch.Tensor:
    """Capacity mode: ``x`` ``(S, hidden)`` -> combined expert outputs ``(S, hidden)``.

    No host synchronisation: selecting the kept (token, choice) pairs with a boolean mask needs
    their count on the host (a ``nonzero`` per index, four per layer forward, each draining an
    accelerator's launch queue). Instead every pair is routed, and a dropped one goes to one
    extra "dump" row after the ``E * capacity`` slots, which the experts never see, and comes
    back as an exact zero. On the kept pairs the sums are the masked version's, in the same
    order (tests/test_moe_dispatch_sync_free.py)."""
    S, k = routing.experts.shape
    E = routing.num_experts
    n_local = E // ep_size
    hidden = x.shape[1]
    slots_total = E * capacity
    kept = (routing.kept & (routing.slots < capacity)).reshape(-1)  # the agreed capacity is never below the local one
    tokens = torch.arange(S, device=x.device).repeat_interleave(k)  # (S * k,), row-major over (token, choice)
    dest = torch.where(kept, routing.experts.reshape(-1) * capacity + routing.slots.reshape(-1), slots_total)
    buffer = x.new_zeros(slots_total + 1, hidden).index_add(0, dest, x[tokens])[:slots_total]
    if ep_size > 1:
        # Chunk r of the E axis belongs to expert rank r; what arrives is (source rank, local expert, slot).
        received = all_to_all(buffer, group)
        local_in = received.view(ep_size, n_local, capacity, hidden).transpose(0, 1).reshape(n_local, ep_size * capacity, hidden)
        local_out = experts.forward_padded(local_in)
        back = local_out.view(n_local, ep_size, capacity, hidden).transpose(0, 1).reshape(slots_total, hidden)
        out_buffer = all_to_all(back, group)
    else:
        out_buffer = experts.forward_padded(buffer.view(E, capacity, hidden)).reshape(slots_total, hidden)
    # A dropped pair reads slot 0 (any real slot) and is zeroed by where(), not by its weight: a
    # non-finite expert output must not leak into a token that never went to that expert.
    rows = out_buffer.index_select(0, torch.where(kept, dest, 0))
    weights = routing.weights.reshape(-1).to(x.dtype).unsqueeze(1)
    contributions = torch.where(kept.unsqueeze(1), rows * weights, rows.new_zeros(()))
    return x.new_zeros(S, hidden).index_add(0, tokens, contributions)


def dropless_dispatch(x: torch.Tensor, routing: Routing, experts: Experts, *, ep_size: int, group) -> torch.Tensor:
    """Dropless mode: every (token, choice) row goes to its expert (see the module docstring)."""
    S, k = routing.experts.shape
    E = routing.num_experts
    n_local = E // ep_size
    flat_experts = routing.experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    tokens = torch.arange(S, device=x.device).repeat_interleave(k)[order]
    rows = x[tokens]
    counts = torch.bincount(flat_experts, minlength=E)
    if ep_size == 1:
        out_rows = experts.forward_grouped(rows, counts.tolist())
    else:
        # Exchange counts first: received[src, j] = rows rank src sends to local expert j.
        received = torch.empty_like(counts)
        _all_to_all_single(received, counts, None, None, group, "MoE dropless token counts")
        sent_per_rank = counts.view(ep_size, n_local).sum(dim=1).tolist()
        received = received.view(ep_size, n_local)
        got_per_rank = received.sum(dim=1).tolist()
        arrived = all_to_all(rows, group, out_splits=got_per_rank, in_splits=sent_per_rank)
        # Rows arrive grouped by (source rank, local expert); regroup by local expert.
        local_expert = torch.arange(n_local, device=x.device).repeat(ep_size)
        key = torch.repeat_interleave(local_expert, received.reshape(-1).to(x.device))
        regroup = torch.argsort(key, stable=True)
        computed = experts.forward_grouped(arrived[regroup], received.sum(dim=0).tolist())
        restored = computed.index_select(0, torch.argsort(regroup))
        out_rows = all_to_all(restored, group, out_splits=sent_per_rank, in_splits=got_per_rank)
    weights = routing.weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    return x.new_zeros(S, x.shape[1]).index_add(0, tokens, out_rows * weights)
