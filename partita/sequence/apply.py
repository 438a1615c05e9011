"""``apply_sequence_parallel``: split every sequence across the topology's sequence axis.

Called by ``partita.initialize`` when ``sequence_parallel_size > 1``, after the model is placed and
before activation checkpointing, compile and ZeRO (torchtitan's order: tensor, then
sequence/context parallelism, then checkpointing, compile and sharding).

Two kinds of models are handled:

- partita's reference GPT (:class:`partita.models.gpt.GPT`) is wired completely. A forward
  pre-hook cuts ``idx`` and ``targets`` to this rank's tokens (contiguous slices for Ulysses, the
  balanced chunks ``r`` and ``2n-1-r`` for causal ring attention) and passes their global
  ``position_ids``; every block's ``CausalSelfAttention.attend`` becomes Ulysses over the previous
  ``attend`` or ring attention; ``lm_loss`` becomes the token-weighted mean over the sequence
  group. Every sequence rank must be given the same whole samples, as the data loader does (its
  sampler shards over data ranks only). The returned logits are this rank's tokens only.
- any model holding ``DistributedAttention`` or ``RingAttention`` modules built with
  ``sequence_process_group=None`` gets them bound to the sequence group; cutting the inputs
  (:func:`partita.sequence.sharding.shard_sequence`) and the loss
  (:func:`partita.sequence.comm.token_weighted_cross_entropy`) stay the model's job, as in
  DeepSpeed.

Replicated parameters need no change: ZeRO reduces and shards over ``topology.zero_group``
(data x sequence), and the token-weighted loss is scaled so that average is exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.distributed.topology import Topology
from partita.sequence.comm import IGNORE_INDEX, sequence_token_mean, token_weighted_cross_entropy
from partita.sequence.config import SequenceParallelConfig
from partita.sequence.layer import DistributedAttention
from partita.sequence.ring import RingAttention, ring_attention
from partita.sequence.sharding import Layout, check_sequence_length, local_positions, shard_sequence

__all__ = ["SequenceParallelLoss", "apply_sequence_parallel", "has_sequence_attention"]


class SequenceParallelLoss(nn.Module):
    """The reference GPT's loss on a sequence shard: cross-entropy averaged over every token of the
    sequence group (no parameters, so the model's ``state_dict`` is unchanged)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_weighted_cross_entropy(logits, targets, group=self.group)

    def from_hidden(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tile_tokens: int) -> torch.Tensor:
        """The same mean with the loss tiled (``GPTConfig.loss_tile_tokens``): this rank's tiled sum
        over its tokens, then the exact token mean over the sequence group."""
        from partita.sequence.tiling import tiled_cross_entropy  # lazily: it imports torch._dynamo (see __init__)

        loss_sum = tiled_cross_entropy(hidden, weight, targets, tile_tokens=tile_tokens, reduction="sum")
        count = (targets.reshape(-1) != IGNORE_INDEX).sum()
        return sequence_token_mean(loss_sum, count, group=self.group)


def apply_sequence_parallel(model: nn.Module, topology: Topology, config: SequenceParallelConfig, *,
                            require_attention: bool = True) -> None:
    """Make ``model`` train with each sequence split over ``topology.sequence_group``; a no-op when
    the sequence axis has size 1. Raises ValueError for a head count Ulysses cannot split and
    NotImplementedError for a model partita cannot wire. ``require_attention=False``: this rank's
    part of the model may hold no attention layer (a pipeline stage; the pipeline checks the
    stages together, partita/pipe/setup.py)."""
    if topology.sequence_size == 1:
        return
    group = topology.sequence_group
    bound = 0
    for module in model.modules():
        if isinstance(module, (DistributedAttention, RingAttention)) and _group_of(module) is None:
            module.bind_group(group)
            bound += 1
    from partita.models.gpt import GPT  # the reference model: imported here, models depend on nothing here

    if isinstance(model, GPT):
        _wire_gpt(model, topology, config)
    elif require_attention and not has_sequence_attention(model):
        raise NotImplementedError(
            f"sequence_parallel_size={topology.sequence_size}: partita wires its reference GPT itself; "
            f"{type(model).__name__} has no partita.sequence.layer.DistributedAttention or "
            "partita.sequence.RingAttention module, so its attention would not see the whole sequence. Build "
            "the model's attention with DistributedAttention(local_attention, sequence_process_group=None) "
            "(bound at initialize), cut inputs with partita.sequence.shard_sequence and average the loss with "
            "partita.sequence.token_weighted_cross_entropy; or set sequence_parallel_size to 1"
        )


def has_sequence_attention(model: nn.Module) -> bool:
    """Whether ``model`` holds a sequence-parallel attention layer (bound or not)."""
    return any(isinstance(m, (DistributedAttention, RingAttention)) for m in model.modules())


def _group_of(module: nn.Module) -> Any:
    return module.spg if isinstance(module, DistributedAttention) else module.group


def _wire_gpt(model: nn.Module, topology: Topology, config: SequenceParallelConfig) -> None:
    from partita.models.gpt import CausalSelfAttention, LanguageModelLoss

    if type(model.lm_loss) is not LanguageModelLoss:
        # Tensor parallelism's vocabulary-parallel loss (or a user's): the token-weighted mean over the
        # sequence group would have to be built into it.
        raise NotImplementedError(
            f"sequence_parallel_size={topology.sequence_size} with the GPT's loss replaced by "
            f"{type(model.lm_loss).__name__} (tensor_parallel.vocab_parallel_lm_head, or your own) is not "
            "implemented; set tensor_parallel.vocab_parallel_lm_head to false or sequence_parallel_size to 1"
        )

    size, rank, group = topology.sequence_size, topology.sequence_rank, topology.sequence_group
    n_head = model.config.n_head
    if config.mode == "ulysses" and n_head % size != 0:
        divisors = [d for d in range(2, n_head + 1) if n_head % d == 0]
        raise ValueError(
            f"sequence_parallel.mode \"ulysses\" splits the {n_head} attention heads over sequence_parallel_size="
            f"{size} ranks, and {n_head} is not divisible by {size}: choose sequence_parallel_size among "
            f"{divisors}, or set sequence_parallel.mode to \"ring\" (no head limit)"
        )
    if config.mode == "ring" and model.config.dropout > 0:
        raise NotImplementedError(
            f"sequence_parallel.mode \"ring\" with attention dropout ({model.config.dropout}) is not implemented: "
            "set GPTConfig.dropout to 0 or use sequence_parallel.mode \"ulysses\""
        )
    layout: Layout = "balanced" if config.mode == "ring" else "contiguous"
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.attend = _ulysses_attend(module, group) if config.mode == "ulysses" else _ring_attend(group)
    model.lm_loss = SequenceParallelLoss(group)
    model.register_forward_pre_hook(_input_slicer(model.config.block_size, rank, size, layout), with_kwargs=True)


def _ulysses_attend(module: nn.Module, group: dist.ProcessGroup):
    """``attend`` as Ulysses around the module's previous ``attend`` (which may itself be wrapped,
    e.g. for tensor parallelism's dropout stream): it keeps seeing whole sequences, on fewer heads."""
    inner = module.attend

    def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # DistributedAttention's layout is [batch, seq, heads, head_dim]; attend's is [batch, heads, seq, head_dim].
        return inner(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    ulysses = DistributedAttention(local_attention, group)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = ulysses(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)
        return out.transpose(1, 2)

    return attend


def _ring_attend(group: dist.ProcessGroup):
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, group=group, causal=True, layout="balanced")

    return attend


def _input_slicer(block_size: int, rank: int, size: int, layout: Layout):
    """The GPT's forward pre-hook: whole samples in, this rank's tokens and their positions out."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        names = ("idx", "targets")
        values = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
        rest = {k: v for k, v in kwargs.items() if k not in names}
        idx, targets = values.get("idx"), values.get("targets")
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
            shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"idx must have shape (batch, seq), got {shape}")
        seq = idx.size(1)
        if seq > block_size:
            raise ValueError(
                f"cannot forward a sequence of length {seq}: block_size is {block_size}; "
                f"cut the input into windows of at most block_size tokens"
            )
        try:
            check_sequence_length(seq, size, layout)
        except ValueError as error:
            raise ValueError(f"sequence_parallel_size={size}: {error}") from None
        local = dict(
            idx=shard_sequence(idx, dim=1, rank=rank, size=size, layout=layout),
            position_ids=local_positions(seq, rank=rank, size=size, layout=layout, device=idx.device),
        )
        if targets is not None:
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}")
            local["targets"] = shard_sequence(targets, dim=1, rank=rank, size=size, layout=layout)
        return (), {**rest, **local}

    return hook
