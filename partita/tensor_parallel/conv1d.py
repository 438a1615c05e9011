"""Tensor-parallel layers for Hugging Face's ``transformers.Conv1D`` (GPT-2's matmuls).

``Conv1D`` is a Linear whose weight is stored transposed, ``(in, out)``, which torch's built-in
tensor-parallel styles do not cover. :mod:`partita.tensor_parallel.apply` builds these for a
``column`` / ``row`` style on such a module; :mod:`partita.tensor_parallel.autotp` recognises the
models that have them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from partita.tensor_parallel.comm import copy_to_tensor, reduce_from_tensor
from partita.tensor_parallel.layers import _Parallel, mark_replicated, shard_parameter

__all__ = ["Conv1DColumnParallel", "Conv1DRowParallel", "is_hf_conv1d"]


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (``y = x @ W + b`` with ``W`` of shape ``(in, out)``), by structure."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and getattr(module, "nf", None) == weight.shape[1])


class Conv1DColumnParallel(_Parallel):
    """A ``Conv1D`` split by output features: weight columns (dim 1) and bias, chunk by chunk."""

    def __init__(self, conv: nn.Module, group: dist.ProcessGroup, *, chunks: int = 1, name: str = "conv1d") -> None:
        super().__init__(group, sequence_parallel=False)
        shard = dict(rank=self.tensor_rank, size=self.tensor_size, group=group, chunks=chunks)
        self.weight = shard_parameter(conv.weight, dim=1, what=f"{name}.weight (output features)", **shard)
        self.bias = shard_parameter(conv.bias, dim=0, what=f"{name}.bias", **shard)
        self.nf = self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, copy_to_tensor(x, self.group).reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.nf)


class Conv1DRowParallel(_Parallel):
    """A ``Conv1D`` split by input features (weight rows, dim 0); the bias is added once after the sum."""

    def __init__(self, conv: nn.Module, group: dist.ProcessGroup, *, name: str = "conv1d") -> None:
        super().__init__(group, sequence_parallel=False)
        self.weight = shard_parameter(conv.weight, dim=0, rank=self.tensor_rank, size=self.tensor_size, group=group,
                                      what=f"{name}.weight (input features)")
        self.bias = conv.bias
        mark_replicated([self.bias])
        self.nf = self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = (x.reshape(-1, x.shape[-1]) @ self.weight).view(*x.shape[:-1], self.nf)
        return reduce_from_tensor(partial, self.group) + self.bias
