"""DeepSpeed-Ulysses: ``DistributedAttention``, at DeepSpeed's path and with its call signature.

Each sequence rank holds a contiguous slice of every sequence, with all heads. Before the local
attention, one all-to-all per tensor trades that for the whole sequence and ``heads / sp`` of the
heads; attention is then ordinary full-sequence attention (any kernel, causal or not) on those
heads; one all-to-all after trades back. Each rank sends ``(sp - 1) / sp`` of q, k, v and the
output per layer, which does not grow with the number of ranks (DeepSpeed-Ulysses' point); the
price is that heads must divide by the sequence size (ring attention, :mod:`partita.sequence.ring`,
has no such limit).

Layouts are DeepSpeed's: 4-D tensors with heads at dim 2, the batch at ``batch_dim_idx`` (0:
``[batch, seq, heads, head_dim]``; 1: ``[seq, batch, heads, head_dim]``) and the sequence at the
other of dims 0 and 1. ``scatter_idx`` is the head dim the forward all-to-all splits (2).
``gather_idx`` is kept for DeepSpeed's signature; as in DeepSpeed the sequence dim is derived
from ``batch_dim_idx``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from partita.sequence.comm import all_to_all

__all__ = ["DistributedAttention"]


class DistributedAttention(nn.Module):
    """Ulysses attention over ``sequence_process_group``.

    Args:
        local_attention: ``f(q, k, v, *args, **kwargs)`` on full-sequence, head-sharded tensors in
            the same layout as the inputs; an ``nn.Module`` or any callable.
        sequence_process_group: the sequence-parallel group (``engine.topology.sequence_group``).
            May be None when the model is built before ``partita.initialize``: ``initialize`` (with
            ``sequence_parallel_size > 1``) binds it to the job's sequence group.
        scatter_idx: the head dim the forward all-to-all splits (DeepSpeed's default 2).
        gather_idx: DeepSpeed's argument, accepted for its signature (0).
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor],
        sequence_process_group: dist.ProcessGroup | None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
    ) -> None:
        super().__init__()
        if scatter_idx != 2:
            raise NotImplementedError(
                f"DistributedAttention(scatter_idx={scatter_idx}): partita splits heads at dim 2, DeepSpeed's "
                "default layout ([batch, seq, heads, head_dim] or [seq, batch, heads, head_dim]); pass scatter_idx=2"
            )
        if gather_idx not in (0, 1):
            raise ValueError(f"DistributedAttention(gather_idx={gather_idx}): must be 0 or 1 (a sequence or batch dim)")
        if sp_stream is not None:
            raise NotImplementedError(
                "DistributedAttention(sp_stream=...): overlapping the all-to-alls on a side stream is not "
                "implemented in partita; leave sp_stream=None"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx

    def bind_group(self, group: dist.ProcessGroup) -> None:
        """Set the sequence group of a layer built with ``sequence_process_group=None``."""
        self.spg = group

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int,
        rotary_pos_emb: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention of this rank's sequence slice against the whole sequence; returns the
        output for the slice, in the input layout (``[.., seq/sp, heads, head_dim]``)."""
        if self.spg is None:
            raise RuntimeError(
                "DistributedAttention has no sequence group: build it with "
                "sequence_process_group=engine.topology.sequence_group, or set sequence_parallel_size > 1 "
                "in the config so partita.initialize binds it"
            )
        if rotary_pos_emb is not None:
            raise NotImplementedError(
                "DistributedAttention(rotary_pos_emb=...) is not implemented in partita: rotary embeddings act "
                "position by position, so apply them to query and key before this call, with the global "
                "positions of this rank's slice (partita.sequence.sharding.local_positions)"
            )
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx={batch_dim_idx}: must be 0 ([batch, seq, ...]) or 1 ([seq, batch, ...])")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4:
                raise ValueError(
                    f"DistributedAttention: {name} has shape {tuple(t.shape)}; expected 4 dims "
                    "([batch, seq, heads, head_dim] with batch_dim_idx=0, or [seq, batch, heads, head_dim])"
                )
        world = dist.get_world_size(self.spg)
        heads = query.size(2)
        if heads % world != 0 or key.size(2) % world != 0:
            raise ValueError(
                f"Ulysses sequence parallelism splits heads over the {world} sequence ranks, but query has "
                f"{heads} heads and key {key.size(2)}: use a head count divisible by sequence_parallel_size="
                f"{world}, a sequence_parallel_size that divides it, or sequence_parallel.mode \"ring\""
            )
        seq_dim = 1 - batch_dim_idx
        # Sequence shards in, head shards out: scatter heads, gather the sequence.
        q, k, v = (all_to_all(t, scatter_dim=2, gather_dim=seq_dim, group=self.spg) for t in (query, key, value))
        context = self.local_attn(q, k, v, *args, **kwargs)
        return all_to_all(context, scatter_dim=seq_dim, gather_dim=2, group=self.spg)
