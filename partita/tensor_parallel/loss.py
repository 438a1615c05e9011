"""Cross-entropy over vocabulary-sharded logits, without building the full-vocabulary logits.

Each tensor rank holds the logits of its slice of the vocabulary, ``(tokens, vocab / tp)``. The
loss needs three numbers per token from the whole vocabulary — the maximum (for a stable
softmax), the sum of exponentials and the target's logit — and each is one all-reduce of a
``(tokens,)`` vector, so the traffic is ``3 x tokens`` floats instead of ``tokens x vocab``.
The backward is local: ``softmax - one_hot`` restricted to this rank's slice.

Why our own and not ``torch.distributed.tensor.parallel.loss_parallel``: that needs DTensor
logits (partita's tensor-parallel layers produce plain local shards, see ``comm.py``), and its
semantics changed between torch 2.11 and 2.13 (replicated targets on a 1-D mesh only, then
N-D meshes with ``mean`` still 1-D only), which the GPU machines and CI straddle.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from partita.distributed import collectives

__all__ = ["VocabParallelCrossEntropy", "vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, ignore_index):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        maximum = logits.max(dim=-1).values
        collectives.all_reduce(maximum, group=group, op=dist.ReduceOp.MAX, purpose="tensor parallel: loss max")
        shifted = logits - maximum.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        local_target = targets - vocab_start
        here = (local_target >= 0) & (local_target < local_vocab)
        index = local_target.masked_fill(~here, 0)
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        both = torch.stack([sum_exp, target_logit])  # one all-reduce for both sums
        collectives.all_reduce(both, group=group, purpose="tensor parallel: loss sums")
        sum_exp, target_logit = both[0], both[1]
        valid = targets != ignore_index
        count = valid.sum()
        losses = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        loss = losses.sum() / count.clamp(min=1)
        ctx.save_for_backward(exp, sum_exp, index, here, valid, count)
        return loss

    @staticmethod
    def backward(ctx, grad):
        exp, sum_exp, index, here, valid, count = ctx.saved_tensors
        softmax = exp / sum_exp.unsqueeze(-1)
        softmax.scatter_add_(-1, index.unsqueeze(-1), -here.to(softmax.dtype).unsqueeze(-1))
        scale = (grad / count.clamp(min=1)) * valid.to(softmax.dtype)
        return softmax * scale.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, group: dist.ProcessGroup, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of ``targets`` (global token ids) over logits holding vocabulary
    ``[vocab_start, vocab_start + logits.shape[-1])`` on this rank; equal to
    ``F.cross_entropy`` on the gathered logits, in fp32."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCE.apply(flat, targets.reshape(-1), vocab_start, group, ignore_index)


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for a model's ``(logits, targets) -> loss`` module when its head is column-parallel."""

    def __init__(self, group: dist.ProcessGroup, vocab_size: int) -> None:
        super().__init__()
        self.group = group
        size = dist.get_world_size(group)
        self.vocab_start = dist.get_rank(group) * (vocab_size // size)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, vocab_start=self.vocab_start, group=self.group)
