"""Pipelines with sequence parallelism: each stage's sequence ranks hold a slice of every sequence.

With ``sequence_parallel_size`` n > 1 the mesh's sequence axis sits inside every pipeline
stage: the n sequence ranks of a (stage, data) position hold the same layers and read the same
samples, each keeping 1/n of every sequence. The pipeline's point-to-point traffic needs nothing
new, because the pipe groups are per (data, sequence, tensor) position: sequence rank r of stage s
sends its slice to sequence rank r of stage s + 1, and every activation between stages is 1/n of
a whole one.

What the pipeline engine adds (the plain Engine leaves these to the model; a pipeline reads its
own data, so the engine does them):

- **Cutting.** The first stage's inputs and the last stage's labels of every micro-batch are cut
  along dimension 1 (``[batch, seq, ...]``, DeepSpeed-Ulysses' layout) to this rank's tokens:
  a contiguous slice for Ulysses, chunks ``r`` and ``2n-1-r`` for causal ring attention
  (:mod:`partita.sequence.sharding`). Tensors with fewer than two dimensions pass whole. Position
  ids, attention masks and anything else sequence-shaped are cut the same way, so a model with
  position embeddings takes its positions as an input (global positions, cut like the tokens).
- **The loss.** ``loss_fn`` stays the one a single process would use (e.g. a mean cross-entropy
  over the micro-batch). On a slice it is the mean over this rank's valid tokens; the engine turns
  it into the exact mean over every token of the sequence group: ``sum_r(loss_r * count_r) /
  sum_r(count_r)``, through :func:`partita.sequence.comm.sequence_token_mean`, whose gradient makes
  ZeRO's average over data x sequence the single-process gradient. A token is valid unless its
  integer label is -100 (``F.cross_entropy``'s ``ignore_index``); with float labels every
  position of dimensions 0 and 1 counts. A slice with no valid token at all needs a ``loss_fn``
  that returns 0 there rather than 0/0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from partita.sequence.comm import IGNORE_INDEX, sequence_token_mean
from partita.sequence.sharding import Layout, shard_sequence

__all__ = ["SequenceSlices", "valid_tokens"]


def valid_tokens(target: torch.Tensor) -> torch.Tensor:
    """The number of tokens of ``target`` (``[batch, seq, ...]``) that the loss averages over."""
    if target.is_floating_point():
        return torch.tensor(float(target.shape[0] * target.shape[1]), device=target.device)
    return (target != IGNORE_INDEX).sum().float()


class SequenceSlices:
    """This rank's share of each sequence, and the loss over the whole sequence group."""

    def __init__(self, *, rank: int, size: int, group: dist.ProcessGroup, mode: str) -> None:
        self.rank, self.size, self.group = rank, size, group
        # Causal ring attention balances work with the two-chunk layout; Ulysses keeps slices contiguous.
        self.layout: Layout = "balanced" if mode == "ring" else "contiguous"

    def cut(self, tensor: Any, what: str) -> Any:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
            return tensor
        try:
            return shard_sequence(tensor, dim=1, rank=self.rank, size=self.size, layout=self.layout)
        except ValueError as error:
            raise ValueError(f"pipeline with sequence_parallel_size={self.size}: {what} of shape "
                             f"{tuple(tensor.shape)} (dimension 1 is the sequence): {error}") from None

    def cut_inputs(self, args: tuple) -> tuple:
        return tuple(self.cut(t, f"input {i}") for i, t in enumerate(args))

    def cut_labels(self, target: torch.Tensor | None) -> torch.Tensor | None:
        if target is None:
            return None
        if target.dim() < 2:
            raise ValueError(
                f"pipeline with sequence_parallel_size={self.size}: labels of shape {tuple(target.shape)} have no "
                "sequence dimension; labels must be [batch, seq, ...] (one per token), cut like the inputs"
            )
        return self.cut(target, "the labels")

    def group_mean(self, loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``loss`` (the mean over this rank's valid tokens) as the mean over the sequence group's."""
        count = valid_tokens(target)
        return sequence_token_mean(loss.float() * count, count, group=self.group)
