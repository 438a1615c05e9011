"""Dropout random streams under tensor parallelism.

Inside a sharded region (attention over this rank's heads, or any dropout on this rank's
sequence shard under sequence parallelism) each tensor rank must draw *different* masks; in a
replicated region (dropout on the full residual stream) every tensor rank must draw the *same*
mask, or the replicas drift apart.

Replicated regions need nothing: every tensor rank runs the same ops in the same order from the
same seed, so the global generator agrees. A sharded region forks it: one number is drawn from
the global generator (the same on every tensor rank), and the region runs on a generator seeded
from that number and the tensor rank, then the global state is put back as it was after the
draw. The stream is a pure function of the global state, so activation checkpointing, which
restores the global state before recomputing, recomputes the very same masks — no per-rank RNG
tracker state to save and restore, unlike Megatron's ``CudaRNGStatesTracker``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["TensorParallelRNG", "tensor_parallel_rng"]

# Distinguishes the forked seeds from the user's own seeds (any constant works; fixed for resumes).
_STREAM_SALT = 0x5EED_7E45


@contextlib.contextmanager
def tensor_parallel_rng(tensor_rank: int, device: torch.device) -> Iterator[None]:
    """Run the body on a random stream of its own for this tensor rank (see the module docstring)."""
    draw = int(torch.randint(0, 2**62, (1,)).item())  # from the global CPU generator
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        seed = (draw ^ _STREAM_SALT) + 1_000_003 * (tensor_rank + 1)
        torch.manual_seed(seed % 2**63)
        yield


class TensorParallelRNG(nn.Module):
    """Runs ``inner`` (a dropout) on the tensor rank's own stream while training with p > 0."""

    def __init__(self, inner: nn.Module, tensor_rank: int) -> None:
        super().__init__()
        self.inner = inner
        self.tensor_rank = tensor_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or getattr(self.inner, "p", 1.0) == 0.0:
            return self.inner(x)  # no randomness: no fork, bit-identical to the plain module
        with tensor_parallel_rng(self.tensor_rank, x.device):
            return self.inner(x)
